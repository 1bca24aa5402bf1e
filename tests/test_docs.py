"""The docs hold: every fenced code block in the guides runs, in document order, as a reader
would run it; the README's Python runs; the product says nothing of how it was made; the
repository and its shipped profiles stay small.

* ``python`` blocks of one guide share one namespace and run in this process, in a scratch
  directory; the process environment and ``sys.path`` are restored afterwards.
* ``bash`` blocks run with ``bash -e`` in the same scratch directory, as a reader runs them
  from the clone's root: ``.venv`` there is this venv (the guides name its executables,
  ``.venv/bin/kvswap``; see "Commands run the clone's own executables" below), and PATH is the
  reader's. The directory holds a copy of ``examples/`` so that ``.venv/bin/pip install
  ./examples/vendor_backend`` works; pip is configured (through ``PIP_*`` variables) to install
  offline, without dependencies, into a throwaway folder that is on PYTHONPATH, so the venv is
  never changed.
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


def blocks(doc: str, folder: Path = DOCS) -> list[Block]:
    out, lines = [], (folder / doc).read_text().splitlines()
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
    # A reader's shell: no kvswap switches, and no Triton interpreter (which the test
    # suite turns on when there is no GPU).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSWAP_", "TRITON_INTERPRET"))}
    site = scratch / "site"
    env.update(
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
    from kvswap.registry.plugins import reset_plugin_host

    shutil.copytree(ROOT / "examples", scratch / "examples",
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    (scratch / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
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
    from kvswap.registry import hookspecs

    text = (DOCS / "writing-a-backend.md").read_text()
    hooks = sorted(n for n in vars(hookspecs) if n.startswith("kvswap_"))
    assert len(hooks) == 5
    for hook in hooks:
        assert re.search(rf"^### `{hook}`", text, re.M), f"docs/writing-a-backend.md has no '### `{hook}`' section"


def test_block_parser_sees_languages_flags_and_lines():
    found = blocks("writing-a-backend.md")
    assert {b.lang for b in found} >= {"python", "bash", "toml"}
    first = found[0]
    assert (DOCS / "writing-a-backend.md").read_text().splitlines()[first.line - 1].startswith("```python")


# --- The README ---------------------------------------------------------------------------

README = ROOT / "README.md"
FIRST_COMMANDS = (
    "bash .ci/setup && .venv/bin/kvswap calibrate --quick",
    "bash .ci/setup && .venv/bin/python -m pytest -q",
)


def test_readme_is_short_and_begins_with_the_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; keep it to 200 (move detail to docs/)"
    first = blocks("README.md", ROOT)[0]
    assert first.lang == "bash" and first.line <= 3, "the README opens with the two commands"
    commands = [line.split("#")[0].strip() for line in first.code.splitlines() if line.strip()]
    assert commands == list(FIRST_COMMANDS)


def test_ci_runs_the_readme_test_command():
    run = (ROOT / ".ci" / "run").read_text()
    assert FIRST_COMMANDS[1] in run


def test_the_test_command_reports_skips_as_a_count_per_reason():
    """The README's test command lists failures and errors one by one, and skips (dozens of
    GPU tests on a CPU) as one line per reason (tests/conftest.py)."""
    from types import SimpleNamespace

    from conftest import skip_counts

    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    chars = "".join(a[2:] for a in addopts.split() if a.startswith("-r"))
    assert chars and set(chars) <= set("fE"), f"addopts {addopts!r}: -r lists only failures and errors"
    gpu = SimpleNamespace(longrepr=("t.py", 3, "Skipped: needs a GPU"))
    other = SimpleNamespace(longrepr=("t.py", 9, "Skipped: no vLLM"))
    assert skip_counts([gpu, other, gpu]) == [(2, "needs a GPU"), (1, "no vLLM")]


def test_readme_python_runs(tmp_path, monkeypatch):
    from kvswap.registry.plugins import reset_plugin_host

    python = [b for b in blocks("README.md", ROOT) if b.lang == "python" and "gpu" not in b.flags]
    assert python, "the README shows how an engine calls kvswap"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    namespace: dict = {"__name__": "readme"}
    try:
        for block in python:
            try:
                exec(compile("\n" * block.line + block.code, str(README), "exec"), namespace)
            except Exception:
                pytest.fail(f"README.md line {block.line} raised:\n{traceback.format_exc()}")
    finally:
        reset_plugin_host()


def test_readme_links_resolve():
    text = README.read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if "://" not in t]
    assert local, "the README links to the docs"
    for target in local:
        assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"
    for doc in DOCS.glob("*.md"):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" not in target:
                assert (doc.parent / target).exists(), f"docs/{doc.name} links to {target}, which does not exist"


# --- Commands run the clone's own executables -----------------------------------------------

# The convention (README, under its two commands): a shell command in the README, in docs/
# or in an example's README that runs kvswap, pip, pytest or python runs it from the clone's
# root through the venv .ci/setup makes, by path (.venv/bin/kvswap, .venv/bin/pip,
# .venv/bin/python -m pytest): .ci/setup activates nothing, and a bare name finds whatever
# the shell has first (the system's pytest, without kvswap). A block that runs in another
# environment (an engine's, where kvswap is installed) says so in its prose and carries
# ``own-env`` in its info string (```` ```bash own-env ````).
VENV_COMMANDS = {"kvswap", "pip", "pip3", "pytest", "py.test", "python", "python3"}
SHELL = {"bash", "sh", "shell", "console"}
OWN_ENV = "own-env"


def command_docs() -> list[Path]:
    """Every page a reader runs commands from: the README, docs/*.md, the examples' READMEs."""
    return [README, *sorted(DOCS.glob("*.md")), *sorted((ROOT / "examples").glob("*/README.md"))]


def bare_commands(code: str) -> list[str]:
    """The lines of shell ``code`` that run one of :data:`VENV_COMMANDS` by its bare name:
    as a command, after variable assignments, in a pipeline, a list or a substitution."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line)
        for part in re.split(r"\|\|?|&&|;|\$\(|`|\(", line):
            words = part.split()
            while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
                words.pop(0)
            if words and words[0] in VENV_COMMANDS:
                out.append(line.strip())
                break
    return out


def looks_like_a_command(line: str) -> bool:
    words = line.split()
    return bool(words) and words[0] in VENV_COMMANDS and (
        words[0] != "kvswap" or len(words) > 1 and (words[1].startswith("-") or words[1].isalpha()))


@pytest.mark.parametrize("code, bare", [
    ("pytest -p kvswap.testing --kvswap-impl acme.copy", True),
    ("KVSWAP_DISABLE_PLUGINS=acme .venv/bin/kvswap info --json | python -c 'print(1)'", True),
    ('dest=$(python -c "print(1)")', True),
    ("bash .ci/setup && kvswap calibrate --quick", True),
    ("OUT=results \\\n  python tests/bench/fuzz.py", True),
    ("bash .ci/setup && .venv/bin/python -m pytest -q   # the tests", False),
    ("KVSWAP_PROFILE=p.json .venv/bin/kvswap explain --direction h2d | grep 'calibration: profile'", False),
    ("OUT=results tests/bench/step_all.sh", False),
    ("vllm serve model  # kvswap runs inside", False),
])
def test_bare_commands_are_found_wherever_a_shell_runs_them(code, bare):
    assert bool(bare_commands(code)) is bare


def test_every_command_runs_the_venvs_executables():
    """What failed a newcomer: the vendor quickstart's bare ``pytest`` was the system's, which
    has no kvswap. Every shell block says .venv/bin/..., or that it runs in an environment
    of the reader's own; a fence without a shell language holds no command."""
    report = []
    for page in command_docs():
        for b in blocks(page.name, page.parent):
            where = f"{page.relative_to(ROOT)} line {b.line}"
            if b.lang in SHELL and OWN_ENV not in b.flags:
                report += [f"{where}: {cmd!r}" for cmd in bare_commands(b.code)]
            elif b.lang not in SHELL:
                report += [f"{where}: a command in a ```{b.lang} fence: {line.strip()!r} (fence it as bash)"
                           for line in b.code.splitlines() if b.lang in ("", "text") and looks_like_a_command(line)]
    assert not report, ("run kvswap, pip, pytest and python as .venv/bin/..., or mark a block that runs in another "
                        "environment ```bash own-env:\n" + "\n".join(report))


def test_the_readme_states_the_command_convention_the_suites_time_and_what_setup_installs():
    text = " ".join(README.read_text().split())
    assert "`.venv/bin/`" in text and "own environment" in text
    assert "the tests take about 4 minutes on 2 cores" in text
    assert "Where only PyPI is reachable, that torch is the CUDA build with its `nvidia-*` wheels" in text


def test_the_engine_set_up_stops_a_cuda_torch_saying_how_to_get_a_cpu_one(tmp_path):
    """Where pip reaches only PyPI, .ci/vllm-setup gets torch's CUDA build; its check says
    what to do instead of a bare assertion."""
    import torch

    check = ROOT / ".ci" / "check-cpu-torch.py"
    assert f'"$VENV/bin/python" .ci/check-cpu-torch.py "$VENV" .ci/vllm-setup' in (ROOT / ".ci" / "vllm-setup").read_text()
    ok = subprocess.run([sys.executable, str(check), ".venv", ".ci/vllm-setup"], capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == (0 if torch.version.cuda is None else 1), ok.stderr
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("__version__ = '2.13.0'\nfrom . import version\n")
    (fake / "version.py").write_text("cuda = '12.8'\n")
    out = subprocess.run([sys.executable, str(check), ".venv-vllm", ".ci/vllm-setup"], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert out.returncode == 1
    said = " ".join(out.stderr.split())
    assert ".venv-vllm needs torch's CPU build, and torch 2.13.0 is a CUDA build (CUDA 12.8)" in said
    assert "rm -rf .venv-vllm" in said and "PIP_FIND_LINKS=" in said and "Traceback" not in said


# --- The product speaks only of the product -------------------------------------------------

# Each pattern names a way development history shows up in text: files of the team's notes
# outside the repository, the sessions and machines of its making, runs named by letter,
# trees by hash, issue numbers of its own tracker, dated anecdotes, and raw result folders.
# Public citations stay legal: "vLLM issue 49276", "ROCm/clr issue 273" have 3+ digits.
HISTORY = [
    (re.compile(r"\b(?:FACTS|DESIGN|STYLE)\.md\b"), "a team note outside the repository"),
    (re.compile(r"\.\./shared\b|/work/shared\b"), "a folder outside the repository"),
    (re.compile(r"\bsessions?[ _-]?\d+\b|\bsession\d+\b", re.I), "a numbered session"),
    (re.compile(r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|this|last|previous|"
                r"next)\s+session\b", re.I), "a session of work"),
    (re.compile(r"\blent\s+(?:GPUs?|machines?|H100s?|H200s?)\b", re.I), "a lent machine"),
    (re.compile(r"\bworkplace\b", re.I), "the workplace"),
    (re.compile(r"\bdevice[ -]time\b", re.I), "device time"),
    (re.compile(r"\b(?:[Rr]uns?|[Bb]ench(?:es)?|[Mm]achines?|[Cc]alibrations?)\s+[A-Z]\d?\b(?![-'’.]\w)"),
     "a run named by letter"),
    (re.compile(r"\bH[12]00\s+[A-Z]\d?\b(?![-'’.]\w)"), "a run named by machine and letter"),
    (re.compile(r"\btree\s+[0-9a-f]{7,40}\b"), "a tree by hash"),
    (re.compile(r"\bissues?\s+#?\d{1,2}\b", re.I), "an issue of the project's own tracker"),
    (re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"), "a dated anecdote"),
    (re.compile(r"\bdocs/results\b"), "a raw results folder"),
]
SKIP_DIRS = {".git", ".venv", "__pycache__", "build", "dist", ".pytest_cache", ".whl", ".gl"}


def repository_files() -> list[Path]:
    """Every file of the repository: git's view where there is one, else a walk without what
    .gitignore leaves out."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                             capture_output=True, timeout=60, check=True)
        names = [n for n in out.stdout.decode().split("\0") if n]
        return sorted(ROOT / n for n in names if (ROOT / n).is_file())
    except (OSError, subprocess.SubprocessError):
        return sorted(p for p in ROOT.rglob("*") if p.is_file() and not (SKIP_DIRS & set(p.relative_to(ROOT).parts))
                      and not any(part.endswith(".egg-info") for part in p.relative_to(ROOT).parts))


def product_text_files() -> list[Path]:
    """README, docs/, every .py, .ci/, pyproject.toml, examples/ and the bench scripts' README
    and shell script: what a user or a maintainer reads."""
    out = []
    for path in repository_files():
        rel = path.relative_to(ROOT)
        if rel == Path("tests/test_docs.py"):
            continue  # the patterns themselves
        if (rel.suffix in {".py", ".md", ".sh", ".toml", ".txt", ".cfg"} or rel.parts[0] == ".ci"):
            out.append(path)
    return out


def history_in(text: str) -> list[tuple[int, str, str]]:
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern, what in HISTORY:
            m = pattern.search(line)
            if m:
                found.append((number, what, m.group(0)))
    return found


@pytest.mark.parametrize("text, hit", [
    ("measured on the lent GPU machine", "a lent machine"),
    ("see FACTS.md", "a team note outside the repository"),
    ("in session 8 on tree 7b09e83", "a numbered session"),
    ("the seventh session", "a session of work"),
    ("H100 run K and H200 N", "a run named by letter"),
    ("on the H200 N", "a run named by machine and letter"),
    ("the bar of issue 6", "an issue of the project's own tracker"),
    ("measured 2026-11-21", "a dated anecdote"),
    ("on this workplace's machines", "the workplace"),
])
def test_history_patterns_catch_history(text, hit):
    assert hit in {what for _, what, _ in history_in(text)}


@pytest.mark.parametrize("text", [
    '@pytest.fixture(scope="session")',
    "buffers still lent to their jobs stay; the lent buffers return to the pool",
    "vLLM issue 49276 and ROCm/clr issue 273",
    "an H100 GPU, an H200 (PCIe Gen5 x16)",
    "run a bench on a machine; Run `kvswap bench`",
    "timed from an idle stream, each run on the H200",
    "the test suite turns on the interpreter",
])
def test_history_patterns_leave_product_words_alone(text):
    assert history_in(text) == []


OWN_FILES = ("README.md", "docs/", ".ci/", "pyproject.toml", "core/cli/__init__.py", "tests/bench/README.md",
             "tests/bench/gpu_session.sh", "tests/test_cli.py", "tests/test_packaging.py")


def _history_report(paths: list[Path]) -> list[str]:
    report = []
    for path in paths:
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for number, what, match in history_in(text):
            report.append(f"{path.relative_to(ROOT)}:{number}: {what}: {match!r}")
    return report


def test_readme_docs_and_setup_speak_only_of_the_product():
    own = [p for p in product_text_files() if str(p.relative_to(ROOT)).startswith(OWN_FILES)]
    assert any(p.name == "README.md" for p in own) and any(p.parent.name == "docs" for p in own)
    report = _history_report(own)
    assert not report, "development history in the product:\n" + "\n".join(report)


def test_no_product_file_speaks_of_development_history():
    report = _history_report(product_text_files())
    assert not report, "development history in the product:\n" + "\n".join(report)


# --- Size -------------------------------------------------------------------------------------

def test_repository_is_at_most_3_mb():
    files = repository_files()
    total = sum(p.stat().st_size for p in files)
    largest = sorted(files, key=lambda p: p.stat().st_size, reverse=True)[:5]
    assert total <= 3 * 1000 * 1000, (
        f"the repository holds {total / 1e6:.2f} MB; largest: "
        + ", ".join(f"{p.relative_to(ROOT)} {p.stat().st_size // 1000} kB" for p in largest))


def test_each_shipped_profile_is_at_most_64_kib():
    profiles = sorted((ROOT / "calibration" / "profiles").glob("*.json"))
    assert profiles, "kvswap ships profiles"
    big = {p.name: p.stat().st_size for p in profiles if p.stat().st_size > 64 * 1024}
    assert not big, f"shipped profiles over 64 KiB: {big}"
