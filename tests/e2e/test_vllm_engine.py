"""A real vLLM engine offloading through kvswap: vLLM's CPU build runs a tiny random-weight
Llama, built here, over prompts that share prefixes, with a KV budget that forces the
prefixes out of the engine's own cache and back in from kvswap's host cache.

* Greedy outputs are the same with and without kvswap's spec, while the second wave of
  prompts finds its prefixes cached only with it.
* kvswap's movers carried the stores and the loads: the worker's counters, written to a
  file the test names (the engine runs its worker in a child process), say how many.
* Loads that kvswap corrupts (a test control) change the outputs: the comparison sees a
  bad load.
* Chunks of several blocks give the same outputs.
* The LLM(...) command of docs/using-kvswap-in-vllm.md runs against the tiny model.

Run it in the environment ``.ci/vllm-setup`` makes: ``.venv-vllm/bin/python -m pytest
tests/e2e``. Where vLLM is not installed the module skips, unless KVSWAP_REQUIRE_VLLM=1
(CI sets it) makes that a failure.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DOC = ROOT / "docs" / "using-kvswap-in-vllm.md"
DOC_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
ACTIVE = re.compile(r"kvswap \S+ is active for KV offloading: (.*)")

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("KVSWAP_REQUIRE_VLLM") == "1":
        pytest.fail("KVSWAP_REQUIRE_VLLM=1 but vLLM is not installed here: run .ci/vllm-setup and use "
                    ".venv-vllm/bin/python", pytrace=False)
    pytest.skip("vLLM is not installed (bash .ci/vllm-setup makes .venv-vllm with it)", allow_module_level=True)

sys.path.insert(0, str(HERE))
import vllm_engine  # noqa: E402


def engine_env() -> dict[str, str]:
    """The environment a user's engine would have: none of the suite's switches."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("KVSWAP_", "TRITON_INTERPRET"))}


@dataclass
class Run:
    waves: list[list[dict]]
    log: str
    stats: dict | None

    def tokens(self) -> list[list[list[int]]]:
        return [[r["tokens"] for r in wave] for wave in self.waves]

    def cached(self, wave: int) -> int:
        return sum(r["cached"] for r in self.waves[wave])


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run([sys.executable, str(HERE / "tiny_llama.py"), str(out)], check=True, capture_output=True,
                   timeout=300, env=engine_env())
    return out


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory):
    runs: dict[str, Run] = {}
    scratch = tmp_path_factory.mktemp("runs")

    def run(name: str, *args: str) -> Run:
        if name not in runs:
            out, stats = scratch / f"{name}.json", scratch / f"{name}.stats.json"
            cmd = [sys.executable, str(HERE / "vllm_engine.py"), "--model", str(model), "--out", str(out), *args]
            if "--kvswap" in args:
                cmd += ["--stats-file", str(stats)]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=engine_env())
            log = p.stdout + p.stderr
            assert p.returncode == 0, f"engine run {name!r} exited {p.returncode}:\n{log[-6000:]}"
            runs[name] = Run(json.loads(out.read_text())["waves"], log,
                             json.loads(stats.read_text()) if stats.exists() else None)
        return runs[name]

    return run


def test_outputs_are_the_same_and_prefixes_come_back_from_kvswap(engine):
    base, kv = engine("base"), engine("kvswap", "--kvswap")
    assert kv.tokens() == base.tokens()
    assert all(len(t) == vllm_engine.MAX_TOKENS for wave in kv.tokens() for t in wave)
    store, load = kv.stats["store"], kv.stats["load"]
    assert store["jobs"] > 0 and store["blocks"] > 0 and load["jobs"] > 0 and load["blocks"] > 0
    assert store["failed"] == store["refused"] == load["failed"] == load["refused"] == 0
    assert load["blocks"] <= store["blocks"]
    assert store["bytes"] == store["blocks"] * kv.stats["host_block_bytes"]
    # Every prompt token the second wave finds cached beyond the engine's own cache came
    # through a kvswap load.
    extra = kv.cached(1) - base.cached(1)
    assert 0 < extra <= load["blocks"] * vllm_engine.BLOCK_SIZE
    (line,) = ACTIVE.findall(kv.log)
    assert "block-major" in line and "store d2h: " in line and "load h2d: " in line
    assert "host.reference" in line  # the CPU's copy route, resolved by kvswap


def test_corrupted_loads_change_the_outputs(engine):
    base, bad = engine("base"), engine("corrupt", "--kvswap", "--corrupt-loads")
    assert bad.stats["load"]["jobs"] > 0
    assert bad.tokens()[0] == base.tokens()[0]  # the first wave loads nothing
    assert bad.tokens()[1] != base.tokens()[1]


def test_chunks_of_three_blocks_give_the_same_outputs(engine):
    base, kv = engine("base"), engine("chunks3", "--kvswap", "--blocks-per-chunk", "3")
    assert kv.tokens() == base.tokens()
    assert kv.stats["blocks_per_chunk"] == 3
    assert kv.stats["store"]["blocks"] > 0 and kv.stats["load"]["blocks"] > 0
    assert kv.cached(1) > base.cached(1)
    assert "chunks of 3 block(s)" in ACTIVE.findall(kv.log)[0]


def doc_llm_script(model: Path) -> str:
    """The page's LLM(...) block, with the tiny model in place of the page's."""
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), re.M | re.S)
    (block,) = [b for b in blocks if "LLM(" in b]
    assert DOC_MODEL in block
    return block.replace(DOC_MODEL, str(model))


def test_the_docs_llm_command_runs_against_the_tiny_model(model, tmp_path):
    script = tmp_path / "offload.py"
    script.write_text(doc_llm_script(model))
    env = dict(engine_env(), VLLM_CPU_KVCACHE_SPACE="1")  # 1 GiB of KV: the page's command sizes none
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env,
                       cwd=tmp_path)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-6000:]
    assert len(ACTIVE.findall(log)) == 1, log[-6000:]
