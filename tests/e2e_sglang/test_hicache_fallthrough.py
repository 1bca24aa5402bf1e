"""What kvswap's SGLang hooks leave to SGLang, and how they fail.

A call kvswap does not serve reaches SGLang's own method with the caller's arguments, and
kvswap moves no byte of it: another host pool class, the ``kernel_ascend`` io backend, indices
that are not whole pages, a layer the load does not name. ``KVSWAP_SGLANG=off`` installs no
hook. A failure inside kvswap raises ``kvswap.EngineTransferError`` naming the pool and layer,
before any byte moves. Runs where SGLang is installed (see test_hicache_roundtrip.py).
"""
from __future__ import annotations

import importlib.metadata
import logging

import pytest

from hicache import HOOKED, bits, build, hooked, plugin, random_bits, restore_hooks, tokens  # noqa: F401

import sglang.srt.plugins as sglang_plugins  # noqa: E402
import torch  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402

from kvswap import ConfigurationError, EngineTransferError  # noqa: E402
import kvswap.integrations.sglang as kvswap_sglang  # noqa: E402


class OwnPages(MHATokenToKVPoolHost):
    """A subclass, as SGLang's quantized and sparse pools are: it may lay pages out its own way."""


@pytest.fixture
def spied(monkeypatch):
    """Record what reaches SGLang's own methods (the hooked originals call these), moving nothing."""
    calls = []

    def spy(name):
        def record(self, *args, **kwargs):
            calls.append((name, self, args, kwargs))
        return record

    for name in ("load_to_device_per_layer", "backup_from_device_all_layer"):
        for cls in (MHATokenToKVPoolHost, OwnPages):
            monkeypatch.setattr(cls, name, spy(name))
    return calls


def filled(kind="mha", layout="page_first", io="kernel", host_class=None):
    cache = build(kind, layout, io, torch.bfloat16, host_class=host_class)
    gen = torch.Generator().manual_seed(11)
    cache.host.kv_buffer.copy_(random_bits(cache.host.kv_buffer.shape, torch.bfloat16, "cpu", gen))
    for t in cache.device_tensors:
        t.copy_(random_bits(t.shape, t.dtype, "cpu", gen))
    return cache, [bits(t) for t in cache.device_tensors], bits(cache.host.kv_buffer)


def unchanged(cache, device_before, host_before):
    return (all(torch.equal(bits(t), b) for t, b in zip(cache.device_tensors, device_before))
            and torch.equal(bits(cache.host.kv_buffer), host_before))


@pytest.mark.parametrize("case", ["other pool class", "kernel_ascend", "not on a page boundary",
                                  "not consecutive", "not whole pages", "backup not whole pages",
                                  "backup kernel_ascend", "target load of a layer past the target's"])
def test_calls_kvswap_does_not_serve_reach_sglang_unchanged(plugin, spied, caplog, case):  # noqa: F811
    cache, dev_before, host_before = filled(host_class=OwnPages if case == "other pool class" else None)
    host, dev = cache.host, cache.device_pool
    h, d = tokens([3, 5]), tokens([2, 8])
    layer, io, backup = 1, "kernel", case.startswith("backup")
    if case in ("kernel_ascend", "backup kernel_ascend"):
        io = "kernel_ascend"
    elif case == "not on a page boundary":
        d = d + 1
    elif case == "not consecutive":
        h = h.flip(0)
    elif case in ("not whole pages", "backup not whole pages"):
        h, d = h[:-1], d[:-1]
    elif case == "target load of a layer past the target's":
        layer = host.layer_num
    with caplog.at_level(logging.DEBUG, logger="kvswap.sglang"):
        if backup:
            host.backup_from_device_all_layer_physical(dev, h, d, io)
        else:
            host.load_to_device_per_layer_physical(dev, h, d, layer, io)
    assert len(spied) == 1, f"SGLang's own method was called {len(spied)} times"
    name, self, args, kwargs = spied[0]
    assert self is host and args[0] is dev and args[1] is h and args[2] is d
    assert name == ("backup_from_device_all_layer" if backup else "load_to_device_per_layer")
    assert args[-1] == io and (backup or args[3] == layer)
    assert unchanged(cache, dev_before, host_before), "kvswap moved bytes of a call it left to SGLang"
    assert any("kvswap" in r.getMessage() and "SGLang" in r.getMessage() for r in caplog.records), \
        "no debug line says why"


def test_served_calls_never_reach_sglang(plugin, spied):  # noqa: F811
    cache, _, _ = filled()
    cache.host.load_to_device_per_layer_physical(cache.device_pool, tokens([3]), tokens([2]), 0, "kernel")
    cache.host.backup_from_device_all_layer_physical(cache.device_pool, tokens([3]), tokens([2]), "direct")
    assert spied == []


def test_why_a_pool_is_not_served_is_said(plugin, spied):  # noqa: F811
    cache, _, _ = filled(host_class=OwnPages)
    assert "not seen" in kvswap_sglang.explain(cache.host)
    cache.host.load_to_device_per_layer_physical(cache.device_pool, tokens([3]), tokens([2]), 0, "kernel")
    assert "pool class OwnPages is not served" in kvswap_sglang.explain(cache.host)


@pytest.mark.parametrize("direction", ["load", "backup"])
@pytest.mark.parametrize("bad", ["host page past the pool", "device page repeated"])
def test_a_failure_inside_kvswap_names_pool_and_layer_and_moves_nothing(plugin, spied, direction, bad):  # noqa: F811
    cache, dev_before, host_before = filled()
    host = cache.host
    past = host.kv_buffer.shape[1] // 4 + 3  # page_first: [2, tokens, L, H, D]
    h, d = (tokens([3, past]), tokens([2, 8])) if bad.startswith("host") else (tokens([3, 5]), tokens([2, 2]))
    if direction == "backup" and bad.startswith("device"):
        h, d = tokens([3, 3]), tokens([2, 8])  # a host page written twice
    with pytest.raises(EngineTransferError) as err:
        if direction == "load":
            host.load_to_device_per_layer_physical(cache.device_pool, h, d, 2, "kernel")
        else:
            host.backup_from_device_all_layer_physical(cache.device_pool, h, d, "kernel")
    text = str(err.value)
    assert "MHATokenToKVPoolHost 'kv'" in text and "layout page_first" in text
    assert ("layer 2" if direction == "load" else "all layers") in text
    assert isinstance(err.value.__cause__, Exception)
    assert spied == [] and unchanged(cache, dev_before, host_before)


def test_kvswap_sglang_off_installs_no_hook(monkeypatch):
    restore_hooks()
    monkeypatch.setenv("SGLANG_PLUGINS", "kvswap")
    monkeypatch.setenv("KVSWAP_SGLANG", "off")
    try:
        sglang_plugins.load_plugins()
        assert not any(hooked(name) for name in HOOKED)
        cache = build("mha", "page_first", "kernel", torch.bfloat16)
        with pytest.raises(AttributeError) as err:  # SGLang's own path: its copy ops are not bound on a CPU
            cache.controller.write(tokens([2, 3]))
        assert isinstance(err.value.__context__, NameError)  # SGLang's cleanup hides the real error there
    finally:
        restore_hooks()


def test_a_bad_kvswap_sglang_value_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("KVSWAP_SGLANG", "maybe")
    with pytest.raises(ConfigurationError, match="KVSWAP_SGLANG='maybe'.*'on' or 'off'"):
        kvswap_sglang.register()


def test_sglang_plugins_naming_another_plugin_leaves_kvswap_out(monkeypatch):
    restore_hooks()
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else")
    try:
        sglang_plugins.load_plugins()
        assert not any(hooked(name) for name in HOOKED)
    finally:
        restore_hooks()


def test_the_entry_point_is_kvswaps_register():
    (ep,) = [e for e in importlib.metadata.entry_points(group="sglang.srt.plugins") if e.name == "kvswap"]
    assert ep.value == "kvswap.integrations.sglang:register" and ep.load() is kvswap_sglang.register
