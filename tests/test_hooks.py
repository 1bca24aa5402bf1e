"""Every hook in the contract is documented, tested, and written to one docstring template."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import numpy as np
import pytest

import kvswap
from kvswap import Calibration, CopyImpl, Curve, DeviceInfo, Policy, hookimpl
from kvswap.registry import hookspecs
from kvswap.registry.plugins import create_plugin_host
from kvswap.registry.reference import host_copy

ROOT = Path(__file__).resolve().parents[1]
HOOKS = sorted(n for n, f in vars(hookspecs).items() if n.startswith("kvswap_") and inspect.isfunction(f))


def test_there_are_hooks():
    assert set(HOOKS) >= {"kvswap_register_copy_impls", "kvswap_register_calibrations", "kvswap_detect_platform"}


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_is_documented_in_the_docs(hook):
    docs = "\n".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    assert re.search(rf"^#+ .*`{hook}`", docs, re.M), f"{hook} has no heading in docs/*.md"


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_has_a_test(hook):
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    assert f"def test_hook_{hook}" in tests


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hookspec_follows_the_docstring_template(hook):
    fn = getattr(hookspecs, hook)
    doc = inspect.getdoc(fn) or ""
    summary = doc.splitlines()[0] if doc else ""
    assert summary and summary[0].isupper() and summary.endswith("."), hook
    assert not summary.split()[0].endswith("s"), f"{hook}: summary should be imperative ({summary!r})"
    for arg in inspect.signature(fn).parameters:
        assert f":param {arg}:" in doc, f"{hook} does not document {arg}"


class Plugin:
    def __init__(self, **hooks):
        for name, fn in hooks.items():
            setattr(self, name, hookimpl(fn))


def host_with(**hooks):
    return create_plugin_host(entry_points=[], env={}, extra=[("acme", Plugin(**hooks))])


def test_hook_kvswap_register_copy_impls():
    seen = []

    def register_impls(platform, register):
        seen.append(platform)
        register(CopyImpl("acme.copy", "batch", (platform,), ("h2d",), lambda ctx: host_copy))

    host = host_with(kvswap_register_copy_impls=register_impls)
    fn = kvswap.resolve("h2d", device="cpu", host=host, policy=Policy(force="acme.copy"))
    assert seen == ["cpu"] and fn.impls == ("acme.copy",)


def test_hook_kvswap_register_calibrations():
    devices = []

    def register_cals(device, register):
        devices.append(device)
        register(Calibration("acme lab, 2026", "cpu", scope="device",
                             curves=(Curve("acme.copy", "h2d", ((1, 99.0),)),)))
        register(Calibration("acme generic", "cpu", scope="platform"))

    host = host_with(kvswap_register_calibrations=register_cals)
    fn = kvswap.resolve("h2d", device="cpu", host=host)
    assert devices and devices[0].platform == "cpu"
    assert fn.plan.calibration["source"] == "acme lab, 2026"  # device scope beats platform scope


def test_hook_kvswap_detect_platform():
    asked = []

    def detect(device):
        asked.append(device)
        if device and device.startswith("acme"):
            return DeviceInfo("acme", "Acme Tile", "acme-tile-v1", 64, index=0)
        return None

    def register_impls(platform, register):
        if platform == "acme":
            register(CopyImpl("acme.copy", "batch", ("acme",), ("h2d", "d2h"), lambda ctx: host_copy))

    host = host_with(kvswap_detect_platform=detect, kvswap_register_copy_impls=register_impls)
    fn = kvswap.resolve("d2h", device="acme:0", host=host)
    assert asked == ["acme:0"] and fn.plan.device.platform == "acme" and fn.impls == ("acme.copy",)
    assert kvswap.resolve("d2h", device="cpu", host=host).plan.device.platform == "cpu"


def test_hook_kvswap_host_address_translator():
    seen = []

    def translator(device):
        def translate(addrs):
            seen.append(addrs.copy())
            return addrs + 0

        return translate

    def register_impls(platform, register):
        def factory(ctx):
            def fn(src, dst, sizes, stream):
                host_copy(ctx.translate_host(src), dst, sizes)
            return fn

        register(CopyImpl("acme.kern", "kernel", ("cpu",), ("h2d",), factory))

    host = host_with(kvswap_host_address_translator=translator, kvswap_register_copy_impls=register_impls)
    fn = kvswap.resolve("h2d", device="cpu", host=host, policy=Policy(force="acme.kern"))
    src = np.random.default_rng(0).integers(0, 256, 64, dtype=np.uint8)
    dst = np.full(64, 3, dtype=np.uint8)
    fn([src.ctypes.data], [dst.ctypes.data], [64])
    assert np.array_equal(src, dst) and seen[0].tolist() == [src.ctypes.data]


def test_detect_platform_returning_garbage_drops_only_that_plugin():
    host = host_with(kvswap_detect_platform=lambda device: "acme")
    with pytest.warns(kvswap.PluginWarning, match="returned 'acme', not a DeviceInfo"):
        assert kvswap.resolve("h2d", host=host).plan.device.platform == "cpu"


def test_hook_kvswap_create_stream():
    """kvswap's own streams come from the hook, one per owner, and go back to a free list
    when their owner is collected; nothing else is handed them."""
    import gc

    from kvswap.registry.streams import own_handle

    made = []

    def create(platform, device_index):
        made.append((platform, device_index))
        return 0x7000 + len(made)

    host = host_with(kvswap_create_stream=create)

    class Owner:
        pass

    a, b = Owner(), Owner()
    ha, hb = own_handle(901, a, host, platform="acme"), own_handle(901, b, host, platform="acme")
    assert ha != hb and made == [("acme", 901), ("acme", 901)]
    del a
    gc.collect()
    c = Owner()
    assert own_handle(901, c, host, platform="acme") == ha and len(made) == 2  # given back, then reused
    assert own_handle(902, Owner(), host, platform="acme") not in (ha, hb)  # another device: a stream of its own


@pytest.mark.parametrize("index, answer", list(enumerate([RuntimeError("no context"), -5, "0x10", True,
                                                           SystemExit("acme: no device")], start=910)))
def test_a_plugin_that_cannot_create_a_stream_is_dropped_and_torchs_pool_serves(index, answer):
    from kvswap.registry.streams import own_handle

    def create(platform, device_index):
        if isinstance(answer, BaseException):
            raise answer
        return answer

    host = host_with(kvswap_create_stream=create)
    with pytest.warns(kvswap.PluginWarning, match="acme"):
        with pytest.warns(kvswap.KvSwapWarning, match="torch's stream pool"):
            assert own_handle(index, object(), host, platform="acme") is None  # a device warned once
