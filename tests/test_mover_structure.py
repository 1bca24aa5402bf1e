"""The mover's house rules, read from the source: BlockMover's state is declared in one class
of at most one base besides object, one function in core/mover calls a copy route (every issue
site calls it), and nothing outside core/mover reads a mover's private attributes (attribute
access the import graph cannot see)."""
from __future__ import annotations

import ast
from pathlib import Path

from kvswap import BlockMover

ROOT = Path(__file__).resolve().parents[1]
MOVER = ROOT / "core" / "mover"
# The product outside the mover. Tests and the bench scripts under tests/ are instruments: they
# may open the mover up to measure or set up what no caller can reach.
PRODUCT = [p for folder in ("core", "backends", "calibration", "examples") for p in sorted((ROOT / folder).rglob("*.py"))
           if MOVER not in p.parents]
# What calls a copy route: a SwapFn's calls, the mover's resolved function called directly, and
# a by-id transfer's two halves.
COPY_CALLS = {"call_built", "call_validated", "fn", "swap_fn", "pack"}


def _functions(tree: ast.AST, prefix: str = ""):
    """``(qualified name, node)`` of every function, methods as ``Class.method``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{prefix}{node.name}", node
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")


def test_blockmover_has_at_most_one_base_besides_object():
    bases = [b for b in BlockMover.__bases__ if b is not object]
    assert len(bases) <= 1, bases


def _callers_of_copy_routes() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in sorted(MOVER.glob("*.py")):
        tree = ast.parse(path.read_text())
        for name, fn in _functions(tree):
            for node in ast.walk(fn):
                launched = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in COPY_CALLS
                if launched:
                    found.setdefault(f"{path.stem}.{name}", set()).add(node.func.attr)
    return found


def test_one_function_in_the_mover_calls_a_copy_route():
    found = _callers_of_copy_routes()
    assert set(found) == {"run.run"}, found
    assert found["run.run"] == {"call_built", "pack"}


def test_every_issue_site_runs_jobs_through_that_function():
    """``submit`` (the caller's thread) and the issuing thread (jobs.Jobs) call ``run``; no
    other function does."""
    callers = set()
    for path in sorted(MOVER.glob("*.py")):
        for name, fn in _functions(ast.parse(path.read_text())):
            if any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "run"
                   for n in ast.walk(fn)):
                callers.add(f"{path.stem}.{name}")
    assert callers == {"handler.BlockMover.submit", "jobs.Jobs._start"}, callers


def _mover_private_names() -> set[str]:
    """Every ``_``-prefixed name a BlockMover holds: declared, assigned, or defined on it."""
    tree = ast.parse((MOVER / "handler.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "BlockMover"]
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node in cls.body:
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "mover"):
            names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.endswith("__")}


def test_no_file_outside_the_mover_reads_its_private_attributes():
    private = _mover_private_names()
    assert {"_plan", "_jobs", "_lock"} <= private  # the scan sees the mover's state
    wrong = []
    for path in PRODUCT:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in private \
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2 \
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in private:
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    assert not wrong, wrong


def test_the_private_attribute_scan_finds_a_reach_into_the_mover(tmp_path):
    """The scan above would fail on what calibration/step_contenders.py once did."""
    private = _mover_private_names()
    tree = ast.parse("def label(mover, ids):\n    return mover._plan.by_ids(ids)\n")
    hits = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in private]
    assert hits == ["_plan"]


def test_design_md_shows_the_run_function_as_it_is():
    """docs/design.md's "Life of a call" quotes the run function (abridged): each line it
    quotes is a line of core/mover/run.py."""
    text = (ROOT / "docs" / "design.md").read_text()
    life = text[text.index("## Life of a call"):]
    quoted = life[life.index("```\n") + 4:]
    quoted = quoted[:quoted.index("```")]
    source = {line.split("  #")[0].strip() for line in (MOVER / "run.py").read_text().splitlines()}
    lines = [line.strip() for line in quoted.splitlines() if line.strip()]
    assert len(lines) >= 10 and "plan.fn.call_built(arr[0, :m], arr[1, :m], arr[2, :m], c.stream)" in lines
    assert [line for line in lines if line not in source] == []
