"""kvswap's options as an engine's configuration carries them: Policy fields pass through,
worker options are checked, anything else is refused naming the key and the valid ones;
host memory becomes a number of chunks."""
from __future__ import annotations

import dataclasses

import pytest

from kvswap import ConfigurationError, Policy
from kvswap.integrations.offload import OffloadOptions, chunks_for

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
    with pytest.raises(ConfigurationError, match="positive whole number of bytes"):
        chunks_for(host_bytes, 50, 1)


def test_chunks_for_refuses_memory_that_holds_no_chunk():
    with pytest.raises(ConfigurationError, match="holds no chunk: one takes 400 bytes"):
        chunks_for(399, bytes_per_block=100, blocks_per_chunk=4)
