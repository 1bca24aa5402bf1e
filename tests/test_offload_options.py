"""kvswap's options as an engine's configuration carries them: Policy fields pass through,
worker options are checked, anything else is refused naming the key and the valid ones;
host memory becomes a number of chunks. kvswap's vLLM spec, over a fake vLLM: its checks of
vLLM's configuration, and what it says of a vLLM other than the one it was tested with."""
from __future__ import annotations

import dataclasses
import importlib
import logging
import re
import sys
import types
from types import SimpleNamespace
from typing import Any, Optional

import pytest

from kvswap import ConfigurationError, Policy
from kvswap.integrations.offload import OffloadOptions, chunks_for, host_bytes

WHERE = 'kv_connector_extra_config["kvswap"]'


def test_nothing_given_is_the_defaults():
    assert OffloadOptions.parse(None) == OffloadOptions() == OffloadOptions.parse({})
    assert OffloadOptions().policy == Policy()


def test_every_policy_field_passes_through():
    values = {"max_sms": 8, "prefer": "low_interference", "force": "host.reference", "require_pinned": True,
              "coalesce": False, "staging_bytes": 1 << 20}
    assert set(values) == {f.name for f in dataclasses.fields(Policy)}, "a new Policy field: add it here"
    options = OffloadOptions.parse(dict(values, numa_node=1, stats_file="/tmp/s.json", corrupt_loads=True))
    assert options.policy == Policy(**values)
    assert (options.numa_node, options.stats_file, options.corrupt_loads) == (1, "/tmp/s.json", True)


def test_an_unknown_key_is_named_with_the_valid_ones():
    with pytest.raises(ConfigurationError) as e:
        OffloadOptions.parse({"max_sm": 8, "prefer": "throughput"}, where=WHERE)
    text = str(e.value)
    assert text.startswith(WHERE) and "'max_sm'" in text and "max_sms" in text and "stats_file" in text


@pytest.mark.parametrize("options, match", [
    ({"max_sms": -1}, r"Policy.max_sms=-1"),
    ({"prefer": "fast"}, r"Policy.prefer='fast'"),
    ({"force": ""}, r"Policy.force=''"),
    ({"coalesce": "yes"}, r"Policy.coalesce='yes'"),
    ({"staging_bytes": -1}, r"Policy.staging_bytes=-1"),
    ({"numa_node": -2}, r"numa_node=-2"),
    ({"numa_node": True}, r"numa_node=True"),
    ({"stats_file": 3}, r"stats_file=3"),
    ({"corrupt_loads": 1}, r"corrupt_loads=1"),
])
def test_a_bad_value_is_refused_naming_where_it_came_from(options, match):
    with pytest.raises(ConfigurationError, match=match) as e:
        OffloadOptions.parse(options, where=WHERE)
    assert str(e.value).startswith(WHERE)


def test_not_a_mapping_is_refused():
    with pytest.raises(ConfigurationError, match="must be a mapping"):
        OffloadOptions.parse(["max_sms", 8], where=WHERE)


@pytest.mark.parametrize("host_bytes, want", [(1000, 5), (1000.0, 5), ("1000", 5), (4e9, 20_000_000)])
def test_chunks_for_divides_host_memory_among_workers(host_bytes, want):
    assert chunks_for(host_bytes, bytes_per_block=50, blocks_per_chunk=2, workers=2) == want


@pytest.mark.parametrize("host_bytes", [0, -5, 1.5, "lots", True, None])
def test_chunks_for_refuses_what_is_not_bytes(host_bytes):
    with pytest.raises(ConfigurationError, match="must be a whole number >= 1"):
        chunks_for(host_bytes, 50, 1)


def test_chunks_for_refuses_memory_that_holds_no_chunk():
    with pytest.raises(ConfigurationError, match="holds no chunk: one takes 400 bytes"):
        chunks_for(399, bytes_per_block=100, blocks_per_chunk=4)


def test_unknown_keys_of_any_type_are_named():
    with pytest.raises(ConfigurationError, match=r"unknown option\(s\) 'maxsms', 0; valid: max_sms"):
        OffloadOptions.parse({"max_sms": 1, 0: 1, "maxsms": 2}, where=WHERE)


def test_integral_floats_are_whole_numbers_everywhere_and_the_rest_refused_in_one_wording(capsys):
    """JSON writes 8 as 8.0 or 4e9 as often as not: every number kvswap is given (Policy's
    fields, the offloading options, the CLI's) takes an integral float, and refuses the
    rest in the same words."""
    from kvswap.cli import main
    from kvswap.integrations.offload.options import whole as options_whole
    from kvswap.types import whole

    assert Policy(max_sms=8.0).max_sms == 8 and Policy(staging_bytes=6.4e7).staging_bytes == 64_000_000
    got = OffloadOptions.parse({"max_sms": 8.0, "numa_node": 1.0}, where=WHERE)
    assert (got.policy.max_sms, got.numa_node) == (8, 1)
    assert host_bytes(4e9, "cpu_bytes_to_use") == 4_000_000_000
    assert main(["explain", "--direction", "h2d", "--device", "cpu", "--max-sms", "8.0", "--block-bytes", "1.6384e4"]) == 0
    assert "max_sms=8," in capsys.readouterr().out
    for bad in (8.5, True, "8", float("nan"), -1.0):
        words = {re.sub(r"^.*?=", "", str(e.value)) for e in [
            pytest.raises(ConfigurationError, Policy, max_sms=bad),
            pytest.raises(ConfigurationError, OffloadOptions.parse, {"numa_node": bad}),
            pytest.raises(ConfigurationError, whole, bad, "x"),
            pytest.raises(ConfigurationError, options_whole, bad, "x"),
        ]}
        assert words == {f"{bad!r} must be a whole number >= 0"}, words
    assert main(["explain", "--direction", "h2d", "--max-sms", "8.5"]) == 2
    assert "argument --max-sms: 8.5 must be a whole number >= 0" in capsys.readouterr().err


def test_host_memory_is_refused_by_the_name_the_engine_gives_it():
    key = 'kv_connector_extra_config["cpu_bytes_to_use"]'
    with pytest.raises(ConfigurationError, match=re.escape(f"{key}='8GB' must be a whole number >= 1")):
        chunks_for("8GB", 50, 1, where=key)
    with pytest.raises(ConfigurationError, match=re.escape(f"{key}=10 bytes holds no chunk")):
        chunks_for(10, 50, 1, where=key)
    assert host_bytes("4096", key) == 4096


# kvswap's vLLM spec, against just enough of vLLM's modules to import it: its own checks, and
# what it says when the vLLM it meets is not the one it was tested with.

class FakeCPUSpec:
    """vLLM 0.32's CPUOffloadingSpec, as far as it reads its configuration."""

    def __init__(self, config: Any) -> None:
        self.config, self.extra_config = config, config.extra_config
        self.blocks_per_chunk = config.cache.blocks_per_chunk
        if not self.extra_config.get("cpu_bytes_to_use"):
            raise Exception("cpu_bytes_to_use must be specified in kv_connector_extra_config")
        self.num_chunks = int(self.extra_config["cpu_bytes_to_use"]) // max(config.worker_kv_bytes_per_block, 1)
        self._worker = None


@pytest.fixture
def fake_vllm():
    """``load(version, base)``: kvswap.integrations.vllm imported over a fake vLLM of that
    version whose ``vllm.v1.kv_offload.base`` holds ``base``; everything restored after."""
    import kvswap.integrations

    def ours(name: str) -> bool:
        return name == "vllm" or name.startswith("vllm.") or name == "kvswap.integrations.vllm"

    saved = {k: v for k, v in sys.modules.items() if ours(k)}
    had = kvswap.integrations.__dict__.get("vllm")

    def load(version: str = "0.32.0", base: Optional[dict] = None) -> Any:
        for k in [k for k in sys.modules if ours(k)]:
            del sys.modules[k]
        base = {"CanonicalKVCaches": object, "OffloadingWorker": object, "TransferResult": tuple} if base is None else base
        for name, attrs in {"vllm": {"__version__": version}, "vllm.logger": {"init_logger": logging.getLogger},
                            "vllm.v1": {}, "vllm.v1.kv_offload": {}, "vllm.v1.kv_offload.base": base,
                            "vllm.v1.kv_offload.config": {"OffloadingConfig": object}, "vllm.v1.kv_offload.cpu": {},
                            "vllm.v1.kv_offload.cpu.spec": {"CPUOffloadingSpec": FakeCPUSpec}}.items():
            module = types.ModuleType(name)
            module.__dict__.update(attrs)
            sys.modules[name] = module
        return importlib.import_module("kvswap.integrations.vllm")

    yield load
    for k in [k for k in sys.modules if ours(k)]:
        del sys.modules[k]
    sys.modules.update(saved)
    if had is None:
        kvswap.integrations.__dict__.pop("vllm", None)
    else:
        kvswap.integrations.vllm = had


def offloading_config(cpu_bytes: Any = 4000, **kw: Any) -> Any:
    fields = dict(extra_config={"cpu_bytes_to_use": cpu_bytes, "kvswap": {"max_sms": 2}}, canonical_layout=False,
                  worker_kv_bytes_per_block=100, cache=SimpleNamespace(blocks_per_chunk=2),
                  parallel=SimpleNamespace(world_size=2, rank=0))
    return SimpleNamespace(**{**fields, **kw})


def test_the_spec_reads_its_options_and_host_memory(fake_vllm):
    spec = fake_vllm().KvswapOffloadingSpec(offloading_config())
    assert spec.num_chunks == 10 and spec.kvswap_options.policy.max_sms == 2 and spec.replicated_layout is False


@pytest.mark.parametrize("cpu_bytes", ["8GB", 0, None, -5, 1.5])
def test_host_memory_that_is_not_bytes_is_kvswaps_error_naming_the_key(fake_vllm, cpu_bytes):
    """Before vLLM's own int() of it, whose error names neither the key nor kvswap."""
    spec = fake_vllm().KvswapOffloadingSpec
    with pytest.raises(ConfigurationError, match=re.escape(f'kv_connector_extra_config["cpu_bytes_to_use"]={cpu_bytes!r}')):
        spec(offloading_config(cpu_bytes))


def test_another_vllm_is_named_before_its_api_can_fail(fake_vllm, caplog):
    """A vLLM whose config lacks a field the spec reads: the warning that names both versions
    is in the log before the error."""
    spec = fake_vllm("0.40.1").KvswapOffloadingSpec
    config = offloading_config()
    del config.canonical_layout
    with caplog.at_level(logging.WARNING), pytest.raises(AttributeError):
        spec(config)
    assert "tested with vLLM 0.32.0; this is vLLM 0.40.1" in caplog.text


def test_another_vllm_without_the_offloading_api_fails_to_import_naming_both_versions(fake_vllm):
    with pytest.raises(ImportError, match=r"tested with vLLM 0\.32\.0; this is vLLM 0\.40\.1.*CanonicalKVCaches"):
        fake_vllm("0.40.1", base={"OffloadingWorker": object, "TransferResult": tuple})
