"""Dependencies point one way: core never imports calibration or a backend, the parts of core
stand on each other in layers, no private name crosses a package, and no modules import each
other in a cycle. Read from the source (every ``import``, lazy ones inside functions included)
and checked at run time."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"core": "kvswap", "backends": "kvswap.backends", "calibration": "kvswap.calibration"}


def modules() -> dict[str, Path]:
    out = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


MODULES = modules()


def package_of(module: str) -> str:
    """The package a module belongs to: core, calibration, or one backend."""
    parts = module.split(".")
    if module.startswith("kvswap.backends.") and len(parts) > 2:
        return ".".join(parts[:3])
    if module.startswith("kvswap.calibration"):
        return "kvswap.calibration"
    return "kvswap"


def imports() -> list[tuple[str, str, str]]:
    """``(importer, module imported, name)`` for every import of a kvswap module; ``name`` is
    the imported name for ``from X import name`` (a submodule counts as the module)."""
    out = []
    for module, path in MODULES.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out += [(module, a.name, "") for a in node.names if a.name.startswith("kvswap")]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[:len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if not target.startswith("kvswap"):
                    continue
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    out.append((module, sub, "") if sub in MODULES else (module, target, a.name))
    return out


IMPORTS = imports()


def test_core_never_imports_calibration_or_a_backend():
    wrong = [(m, t) for m, t, _ in IMPORTS
             if package_of(m) == "kvswap" and t.startswith(("kvswap.calibration", "kvswap.backends"))]
    assert not wrong, wrong


def test_no_private_name_crosses_a_package():
    def private(text: str) -> bool:
        return text.startswith("_") and not (text.startswith("__") and text.endswith("__"))

    wrong = [(m, t, n) for m, t, n in IMPORTS
             if package_of(m) != package_of(t) and (private(n) or any(private(p) for p in t.split(".")))]
    assert not wrong, wrong


def cycles(within: str) -> list[list[str]]:
    """Strongly connected groups of modules of ``within`` (a package) that import each other;
    importing a package's own ``__init__`` from inside it does not count."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES if package_of(m) == within}
    for m, t, _ in IMPORTS:
        if m in graph and t in graph and t != m and not m.startswith(t + "."):
            graph[m].add(t)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


PACKAGES = sorted({package_of(m) for m in MODULES})

# The parts of core, lowest first: a part imports only parts below it. The package's face
# (core/__init__.py) imports from every part to export the public names; below it, a part
# takes only the markers and the version from the face, except the two that stand on the
# public API.
LAYERS = (
    ("kvswap.errors",),
    ("kvswap.types",),
    ("kvswap.addressing",),
    ("kvswap.registry",),
    ("kvswap.resolution", "kvswap.memory"),
    ("kvswap.mover", "kvswap.cli"),
    ("kvswap.testing",),
    ("kvswap.integrations",),
    ("kvswap.__main__",),
)
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}
FACE_NAMES = {"PROJECT", "hookimpl", "hookspec", "__version__"}
ON_THE_PUBLIC_API = {"kvswap.testing", "kvswap.integrations"}


CORE = {m for m, path in MODULES.items() if path.is_relative_to(ROOT / "core")}


def part_of(module: str) -> str:
    """The part of core a module belongs to: ``kvswap.mover`` for ``kvswap.mover.jobs``."""
    return ".".join(module.split(".")[:2])


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles(package):
    found = cycles(package)
    assert not found, f"modules of {package} that import each other: {found}"


def test_every_part_of_core_has_a_layer():
    parts = {part_of(m) for m in CORE} - {"kvswap"}
    assert parts == set(RANK), f"parts of core without a layer: {sorted(parts - set(RANK))}; " \
                               f"layers without a part: {sorted(set(RANK) - parts)}"


def test_parts_of_core_import_only_the_layers_below_them():
    wrong = [(m, t) for m, t, _ in IMPORTS
             if m in CORE and t in CORE and "kvswap" not in (m, t)
             and part_of(m) != part_of(t) and RANK[part_of(t)] >= RANK[part_of(m)]]
    assert not wrong, f"imports that run up or across the layers of core: {wrong}"


def test_parts_of_core_take_only_markers_and_version_from_the_face():
    wrong = [(m, n) for m, t, n in IMPORTS
             if t == "kvswap" and m in CORE and m != "kvswap"
             and part_of(m) not in ON_THE_PUBLIC_API and n not in FACE_NAMES]
    assert not wrong, wrong


def test_the_graph_is_read_whole():
    assert {"kvswap.resolution.resolver", "kvswap.resolution.routing", "kvswap.resolution.profiles",
            "kvswap.mover.handler", "kvswap.calibration.store"} <= set(MODULES)
    assert ("kvswap.calibration.store", "kvswap.resolution.profiles", "") in IMPORTS  # calibration reads through core


def test_resolving_and_explaining_loads_no_calibration_module(tmp_path):
    code = ("import sys, kvswap\n"
            "kvswap.resolve('h2d', device='cpu').explain()\n"
            "print(sorted(m for m in sys.modules if m.startswith('kvswap.calibration')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={"XDG_DATA_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_integrations_use_only_kvswaps_public_api():
    import kvswap

    public = set(kvswap.__all__) | {"__version__"}
    wrong = [(m, t, n) for m, t, n in IMPORTS if m.startswith("kvswap.integrations")
             and not t.startswith("kvswap.integrations") and (t != "kvswap" or n not in public)]
    assert not wrong, f"integrations import what kvswap does not export: {wrong}"
    assert any(m == "kvswap.integrations.vllm" for m, _, _ in IMPORTS)


def test_importing_kvswap_and_its_offloading_parts_imports_no_engine(tmp_path):
    code = ("import sys, kvswap, kvswap.integrations, kvswap.integrations.offload\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'sglang', 'lmcache')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={"XDG_DATA_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
