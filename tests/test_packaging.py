"""The wheel holds every package of the source tree (mapped packages are easy to drop)."""
from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAPPING = {"core": "kvswap", "backends": "kvswap.backends", "calibration": "kvswap.calibration"}


def source_packages() -> set[str]:
    found = set()
    for folder, name in MAPPING.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            if "__pycache__" not in rel:
                found.add(".".join((name,) + rel))
    return found


def source_files() -> list[Path]:
    """The repository's files as a clone has them: no build output (setuptools packs whatever
    a stale ``build/lib`` still holds, deleted modules included)."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                             capture_output=True, timeout=60, check=True)
        return [ROOT / n for n in out.stdout.decode().split("\0") if n and (ROOT / n).is_file()]
    except (OSError, subprocess.SubprocessError):
        skip = {".git", ".venv", "build", "dist", "__pycache__"}
        return [f for f in ROOT.rglob("*") if f.is_file() and not skip & set(f.relative_to(ROOT).parts)
                and not any(p.endswith(".egg-info") for p in f.relative_to(ROOT).parts)]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    src = tmp_path_factory.mktemp("source")
    for f in source_files():
        dest = src / f.relative_to(ROOT)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dest)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        check=True, capture_output=True, timeout=300,
    )
    (path,) = out.glob("kvswap-*.whl")
    return zipfile.ZipFile(path)


def test_every_source_package_is_in_the_wheel(wheel):
    names = wheel.namelist()
    in_wheel = {n[: -len("/__init__.py")].replace("/", ".") for n in names if n.endswith("/__init__.py")}
    missing = source_packages() - in_wheel
    assert not missing, f"packages missing from the wheel (list them in pyproject.toml): {sorted(missing)}"
    assert source_packages() >= {"kvswap", "kvswap.backends.cuda", "kvswap.backends.rocm",
                                 "kvswap.backends.triton_generic", "kvswap.calibration"}


def test_every_module_and_shipped_profile_is_in_the_wheel(wheel):
    names = set(wheel.namelist())
    for folder, name in MAPPING.items():
        for f in (ROOT / folder).rglob("*"):
            if f.suffix in {".py", ".json"} and "__pycache__" not in f.parts:
                rel = f.relative_to(ROOT / folder)
                assert "/".join(name.split(".") + list(rel.parts)) in names, f"{f} is not in the wheel"


def test_entry_points_register_backends_and_never_autoload_the_pytest_plugin(wheel):
    (ep_file,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    cfg = configparser.ConfigParser()
    cfg.read_string(wheel.read(ep_file).decode())
    assert dict(cfg["kvswap.backends"]) == {
        "cuda": "kvswap.backends.cuda",
        "rocm": "kvswap.backends.rocm",
        "triton": "kvswap.backends.triton_generic",
    }
    assert cfg["console_scripts"]["kvswap"] == "kvswap.cli:main"
    assert "pytest11" not in cfg


def test_backend_modules_import_light():
    code = (
        "import sys\n"
        "import kvswap.backends.cuda, kvswap.backends.rocm, kvswap.backends.triton_generic\n"
        "heavy = [m for m in ('triton',) if m in sys.modules]\n"
        "torch = sys.modules.get('torch')\n"
        "if torch is not None and torch.cuda.is_initialized(): heavy.append('CUDA context')\n"
        "maps = open('/proc/self/maps').read()\n"
        "heavy += [lib for lib in ('libcuda.so', 'libamdhip64') if lib in maps]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing the backends loaded {out.stdout.strip()}"


def test_version_is_one_number_in_pyproject_and_the_package():
    import tomllib

    from kvswap import __version__

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["version"] == __version__
    assert project["requires-python"] == ">=3.10"
    assert set(project["optional-dependencies"]) >= {"triton", "plot", "test"}
    assert not any(d.startswith("triton") for d in project["dependencies"]), "Triton stays optional"


def test_wheel_metadata_carries_the_readme_and_the_extras(wheel):
    (meta,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    text = wheel.read(meta).decode()
    assert "Provides-Extra: triton" in text and "Provides-Extra: plot" in text and "Provides-Extra: test" in text
    assert "Requires-Python: >=3.10" in text
    assert "bash .ci/setup" in text  # the README is the long description


def test_wheel_holds_no_module_the_source_tree_lacks(wheel):
    expected = set()
    for folder, name in MAPPING.items():
        for f in (ROOT / folder).rglob("*.py"):
            if "__pycache__" not in f.parts:
                expected.add("/".join(name.split(".") + list(f.relative_to(ROOT / folder).parts)))
    for f in (ROOT / "calibration" / "profiles").glob("*.json"):
        expected.add(f"kvswap/calibration/profiles/{f.name}")
    shipped = {n for n in wheel.namelist() if n.startswith("kvswap/") and n.endswith((".py", ".json"))}
    assert len(shipped) > 50
    assert shipped <= expected, f"the wheel holds files the source tree lacks: {sorted(shipped - expected)}"


def test_the_wheel_holds_no_root_init(wheel):
    """The repository root's ``__init__.py`` serves a clone imported from its parent folder
    only; no distribution carries it."""
    assert "__init__.py" not in wheel.namelist()
    assert all(n.startswith(("kvswap/", "kvswap-")) for n in wheel.namelist())


@pytest.mark.parametrize("code, says", [
    ("import kvswap; print(kvswap.__spec__.origin); print(kvswap.resolve('h2d', device='cpu'))",
     "<kvswap.SwapFn h2d on cpu: host.reference>"),
    ("import kvswap.backends.cuda, kvswap.calibration.bench, kvswap.cli; import kvswap; print(kvswap.__spec__.origin);"
     "print(kvswap.__version__)", "0.1.0"),
], ids=["resolve", "subpackages"])
def test_the_clone_is_kvswap_from_the_folder_above_it(tmp_path, code, says):
    """A clone in a folder named ``kvswap``, Python started in the folder above: the current
    directory comes first on sys.path, so that folder is what ``import kvswap`` finds; it
    must be kvswap (the root ``__init__.py``), not an empty namespace package."""
    (tmp_path / "kvswap").symlink_to(ROOT, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSWAP_")}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    origin, last = out.stdout.strip().splitlines()[0], out.stdout.strip().splitlines()[-1]
    assert origin == str(tmp_path / "kvswap" / "__init__.py") and last == says
    cli = subprocess.run([sys.executable, "-m", "kvswap", "--version"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert cli.returncode == 0 and cli.stdout.strip() == "kvswap 0.1.0", cli.stderr
