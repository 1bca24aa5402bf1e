"""Every fenced code block in the guides runs, in document order, as a reader would run it.

* ``python`` blocks of one guide share one namespace and run in this process, in a scratch
  directory; the process environment and ``sys.path`` are restored afterwards.
* ``bash`` blocks run with ``bash -e`` in the same scratch directory, with this venv's
  ``python``, ``pip``, ``kvswap`` and ``pytest`` first on PATH. The directory holds a copy of
  ``examples/`` so that ``pip install ./examples/vendor_backend`` works; pip is configured
  (through ``PIP_*`` variables) to install offline, without dependencies, into a throwaway
  folder that is on PYTHONPATH, so the venv is never changed.
* ``toml`` blocks must parse; one declaring ``kvswap.backends`` entry points must declare
  what the example distribution's ``pyproject.toml`` does.
* A block whose info string carries ``gpu`` (```` ```python gpu ````) needs an accelerator:
  it runs only in the ``gpu``-marked variant of the test.

Any other fence language fails the test: a guide holds only code that is run.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import traceback
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GUIDES = ["writing-a-backend.md", "using-kvswap-in-an-engine.md", "calibrating-a-device.md"]
LANGUAGES = {"python", "bash", "toml"}
FENCE = re.compile(r"^```(\S*)[ \t]*(.*)$")


@dataclass(frozen=True)
class Block:
    doc: str
    line: int
    lang: str
    flags: frozenset[str]
    code: str

    @property
    def where(self) -> str:
        return f"docs/{self.doc} line {self.line} ({self.lang})"


def blocks(doc: str) -> list[Block]:
    out, lines = [], (DOCS / doc).read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, body = i + 1, []
        i += 1
        while i < len(lines) and lines[i].rstrip() != "```":
            body.append(lines[i])
            i += 1
        out.append(Block(doc, start, m.group(1), frozenset(m.group(2).split()), "\n".join(body) + "\n"))
        i += 1
    return out


def _bash_env(scratch: Path) -> dict[str, str]:
    # A reader's shell: no kvswap switches, and no Triton interpreter (which this test
    # session turns on when there is no GPU).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSWAP_", "TRITON_INTERPRET"))}
    site = scratch / "site"
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
        PIP_TARGET=str(site),
        PIP_NO_DEPS="1",
        PIP_NO_INDEX="1",
        PIP_NO_BUILD_ISOLATION="0",  # pip reads this one inverted: "0" turns isolation off
        PIP_NO_CACHE_DIR="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_UPGRADE="1",
        XDG_DATA_HOME=str(scratch / "xdg"),
    )
    return env


def run_guide(doc: str, scratch: Path, monkeypatch: pytest.MonkeyPatch, gpu: bool) -> int:
    """Run the guide's blocks in order; return how many ran."""
    from kvswap.plugins import reset_plugin_host

    shutil.copytree(ROOT / "examples", scratch / "examples",
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    monkeypatch.chdir(scratch)
    monkeypatch.setenv("XDG_DATA_HOME", str(scratch / "xdg"))
    saved_env, saved_path = dict(os.environ), list(sys.path)
    # A real module, so that what the blocks define (dataclasses included) resolves its names.
    module = types.ModuleType(f"docs_{doc.replace('-', '_').removesuffix('.md')}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
    ran = 0
    try:
        for block in blocks(doc):
            assert block.lang in LANGUAGES, f"{block.where}: fence language {block.lang!r} is not run by this test"
            if "gpu" in block.flags and not gpu:
                continue
            ran += 1
            if block.lang == "python":
                try:
                    # Padded so that tracebacks give the line numbers of the guide itself.
                    code = compile("\n" * block.line + block.code, str(DOCS / doc), "exec")
                    exec(code, namespace)
                except Exception:
                    pytest.fail(f"{block.where} raised:\n{traceback.format_exc()}")
            elif block.lang == "bash":
                out = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.code], cwd=scratch,
                                     env=_bash_env(scratch), capture_output=True, text=True, timeout=600)
                assert out.returncode == 0, (
                    f"{block.where} exited {out.returncode}:\n{block.code}\n--- stdout\n{out.stdout}\n--- stderr\n{out.stderr}")
            else:
                check_toml(block)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        sys.path[:] = saved_path
        reset_plugin_host()
    return ran


def check_toml(block: Block) -> None:
    doc = tomllib.loads(block.code)
    declared = doc.get("project", {}).get("entry-points", {})
    if "kvswap.backends" in declared:
        example = tomllib.loads((ROOT / "examples" / "vendor_backend" / "pyproject.toml").read_text())
        assert declared == example["project"]["entry-points"], f"{block.where} differs from the example's entry points"
        assert doc["project"]["name"] == example["project"]["name"]


@pytest.mark.parametrize("doc", GUIDES)
def test_guide_blocks_run(doc, tmp_path, monkeypatch):
    assert run_guide(doc, tmp_path, monkeypatch, gpu=False) >= 3


@pytest.mark.gpu
@pytest.mark.parametrize("doc", GUIDES)
def test_guide_blocks_run_on_a_gpu(doc, tmp_path, monkeypatch):
    if not any("gpu" in b.flags for b in blocks(doc)):
        pytest.skip(f"docs/{doc} has no gpu blocks")
    run_guide(doc, tmp_path, monkeypatch, gpu=True)


def test_backend_guide_has_a_section_per_hook():
    from kvswap import hookspecs

    text = (DOCS / "writing-a-backend.md").read_text()
    hooks = sorted(n for n in vars(hookspecs) if n.startswith("kvswap_"))
    assert len(hooks) == 4
    for hook in hooks:
        assert re.search(rf"^### `{hook}`", text, re.M), f"docs/writing-a-backend.md has no '### `{hook}`' section"


def test_block_parser_sees_languages_flags_and_lines():
    found = blocks("writing-a-backend.md")
    assert {b.lang for b in found} >= {"python", "bash", "toml"}
    first = found[0]
    assert (DOCS / "writing-a-backend.md").read_text().splitlines()[first.line - 1].startswith("```python")
