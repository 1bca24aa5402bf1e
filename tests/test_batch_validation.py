"""One batch, one verdict: the whole batch is validated in core before any implementation
runs, on every route; and the registry's guards against plugins that shadow names, steer
ranking with numbers they do not own, race, or are named by switches that match nothing.

Real copies on the CPU (host reference, the Triton kernel in its interpreter): random data,
poisoned destinations, every byte checked.
"""
from __future__ import annotations

import os
import re
import sys
import threading
import time
import warnings

import numpy as np
import pytest

import kvswap
from kvswap import (
    Calibration, CopyImpl, Curve, DriverError, InvalidTransferError, Policy, PluginWarning, ResolutionError,
    hookimpl,
)
from kvswap.addressing.descriptors import GRID_FROM, GRID_SLOTS, SMALL_BATCH, _grid_clash, validate
from kvswap.registry.plugins import create_plugin_host
from kvswap.registry.reference import host_copy

from fakes import Offer, address

POISON = 0x5A
KiB = 1024


class Pools:
    """A random source pool and a poisoned destination pool, with every byte checkable."""

    def __init__(self, rng, nbytes=1 << 21):
        self.src = rng.integers(0, 256, nbytes, dtype=np.uint8)
        self.dst = np.full(nbytes, POISON, dtype=np.uint8)
        self.before = self.dst.copy()

    def untouched(self) -> bool:
        return np.array_equal(self.dst, self.before)


SEEN: list[tuple[str, np.ndarray, np.ndarray, np.ndarray]] = []


def watching_impl(name="acme.watch", kind="batch"):
    """An impl that records every batch it is handed (and copies it)."""
    def factory(ctx):
        def fn(src, dst, sizes, stream):
            SEEN.append((name, src.copy(), dst.copy(), sizes.copy()))
            host_copy(src, dst, sizes)
        return fn

    return CopyImpl(name, kind, ("cpu",), ("h2d", "d2h"), factory)


def watched_fn():
    host = create_plugin_host(entry_points=[], env={}, extra=[("acme", Offer([watching_impl()]))])
    return kvswap.resolve("h2d", device="cpu", host=host, policy=Policy(force="acme.watch"))


# ---- 1. a batch split across two routes gets one verdict ----------------------------

def split_fn():
    """On the CPU: blocks under 64 KiB to triton.kernel (its interpreter), larger ones to
    host.reference, as a measured profile would decide."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernel in its interpreter on host memory (no GPU)")
    curves = []
    for d in ("h2d", "d2h"):
        curves.append(Curve("triton.kernel", d, ((4 * KiB, 90.0), (32 * KiB, 90.0), (64 * KiB, 1.0)), num_sms=4))
        curves.append(Curve("host.reference", d, ((4 * KiB, 1.0), (32 * KiB, 1.0), (64 * KiB, 90.0))))
    cal = Calibration(source="test split", platform="cpu", scope="device", curves=tuple(curves),
                      kernel_sms={"h2d": 4, "d2h": 4}, kernel_min_batch={"h2d": 1, "d2h": 1})
    fn = kvswap.resolve("h2d", device="cpu", calibration=cal)
    assert fn.assign(np.array([1 << 20]), np.array([1 << 30]), np.array([4 * KiB]))[0][0] == "triton.kernel"
    assert fn.assign(np.array([1 << 20]), np.array([1 << 30]), np.array([256 * KiB]))[0][0] == "host.reference"
    return fn


def split_batch(rng, pools):
    """20 small blocks then 3 large ones, scattered without overlap; caller order shuffled."""
    sizes = np.array([4 * KiB + 3] * 20 + [256 * KiB] * 3, dtype=np.int64)
    slots = rng.permutation(len(pools.dst) // (256 * KiB + 64))[:len(sizes)] * (256 * KiB + 64)
    so = rng.permutation(len(pools.src) // (256 * KiB + 64))[:len(sizes)] * (256 * KiB + 64)
    return address(pools.src) + so + 1, address(pools.dst) + slots + 3, sizes


def test_a_split_batch_bad_in_its_second_slice_changes_no_byte():
    fn = split_fn()
    rng = np.random.default_rng(11)
    pools = Pools(rng, 1 << 23)
    src, dst, sizes = split_batch(rng, pools)
    dst[21] = dst[22] + 5  # two large blocks (the host.reference slice) overlap
    with pytest.raises(InvalidTransferError, match="descriptors 21 and 22 overlap"):
        fn(src, dst, sizes)
    assert pools.untouched()  # the kernel's slice did not run either


def test_overlap_between_the_slices_is_refused_naming_the_callers_indices():
    fn = split_fn()
    rng = np.random.default_rng(12)
    pools = Pools(rng, 1 << 23)
    src, dst, sizes = split_batch(rng, pools)
    dst[5] = dst[21] + 100  # a small block (kernel) inside a large one (host.reference)
    with pytest.raises(InvalidTransferError, match="descriptors 5 and 21 overlap"):
        fn(src, dst, sizes)
    assert pools.untouched()
    src, dst, sizes = split_batch(rng, pools)
    fn(src, dst, sizes)  # the same function, a good batch: every byte lands
    want = pools.before.copy()
    for s, d, n in zip(src - address(pools.src), dst - address(pools.dst), sizes):
        want[d:d + n] = pools.src[s:s + n]
    assert np.array_equal(pools.dst, want)


# ---- 2 and 3: every route refuses overlap, overflow and narrow addresses --------------

def bad_batches(base_src: int, base_dst: int):
    """``(label, src, dst, sizes, message)``: each breaks one rule, at descriptor 1 or 2."""
    s = [base_src, base_src + 4096, base_src + 8192]
    d = [base_dst, base_dst + 4096, base_dst + 8192]
    n = [100, 100, 100]
    top = (1 << 63) - 50
    return [
        ("same-destination", s, [d[0], d[2], d[2]], n, "descriptors 1 and 2 overlap"),
        ("overlapping-destinations", s, [d[0], d[1], d[1] + 99], n, "descriptors 1 and 2 overlap"),
        ("destination-over-a-source", s, [d[0], d[1], s[0] + 50], n,
         "destination range of descriptor 2 overlaps the source range of descriptor 0"),
        ("overflowing-source", [s[0], top, s[2]], d, n, r"src_ptrs\[1\]=.* ends past the largest address"),
        ("overflowing-destination", s, [d[0], d[1], top], n, r"dst_ptrs\[2\]=.* ends past the largest address"),
        ("wrapping-size", s, d, [100, (1 << 63) - 1, 100], "ends past the largest address"),
        ("null-source", [s[0], 0, s[2]], d, n, r"src_ptrs\[1\]=0 is not a valid address"),
        ("negative-destination", s, [d[0], d[1], -4096], n, r"dst_ptrs\[2\]=-4096 is not a valid address"),
        ("narrow-addresses", np.array(s, dtype=np.int64).astype(np.int32), d, n, "int64 .*addresses, got dtype int32"),
        ("uint64-beyond-int64", np.array([1 << 63, 1, 2], dtype=np.uint64), d, n, "beyond int64"),
        ("zero-size", s, d, [100, 0, 100], r"sizes\[1\]=0"),
    ]


@pytest.mark.parametrize("many", [False, True], ids=["few", "many"])  # both ways of checking
def test_no_implementation_ever_sees_an_invalid_batch(many):
    fn = watched_fn()
    rng = np.random.default_rng(3)
    pools = Pools(rng)
    for label, src, dst, sizes, message in bad_batches(address(pools.src), address(pools.dst) + 64):
        src, dst, sizes = (np.asarray(a) for a in (src, dst, sizes))
        if many:  # the same bad descriptors behind a long run of good ones
            k = 4 * SMALL_BATCH
            pad = np.arange(k, dtype=np.int64) * 256
            src = np.concatenate([src, address(pools.src) + (1 << 20) + pad]).astype(src.dtype)
            dst = np.concatenate([dst, address(pools.dst) + (1 << 20) + pad]).astype(dst.dtype)
            sizes = np.concatenate([sizes, np.full(k, 7)])
        SEEN.clear()
        with pytest.raises(InvalidTransferError, match=message):
            fn(src, dst, sizes)
        assert SEEN == [], label
        assert pools.untouched(), label


def clashes(a, an, b, bn):
    """Pairwise: which ranges ``[a, a + an)`` overlap which ``[b, b + bn)``."""
    return np.maximum(a[:, None], b[None, :]) < np.minimum((a + an)[:, None], (b + bn)[None, :])


def _refusal(src, dst, sizes):
    """``validate``'s refusal of the batch as text, or None where it accepts it."""
    try:
        validate(src, dst, sizes)
    except InvalidTransferError as e:
        return str(e)
    return None



@pytest.mark.parametrize("count", [1, 2, 17, SMALL_BATCH, SMALL_BATCH + 1, 1000])
def test_validation_matches_a_plain_pairwise_check(count):
    rng = np.random.default_rng(count)
    verdicts = set()
    for trial in range(40):
        sizes = rng.integers(1, 64, count)
        space = int(sizes.sum()) * max(2, count * (trial % 4))
        dst = rng.integers(1, space, count) + (1 << 30) * (trial % 2)  # apart from the sources, or among them
        src = rng.integers(1, space, count) + (1 << 30)
        verdicts.add(_matches_pairwise(src, dst, sizes, trial) is None)
    assert verdicts == {True, False}  # both verdicts were exercised


def _matches_pairwise(src, dst, sizes, trial):
    """validate's refusal (None: accepted), checked against a plain pairwise check: refused
    exactly when two destinations or a destination and a source overlap, naming such a pair."""
    among = clashes(dst, sizes, dst, sizes)
    np.fill_diagonal(among, False)
    over = clashes(dst, sizes, src, sizes)
    refused = _refusal(src, dst, sizes)
    assert (refused is not None) == bool(among.any() or over.any()), (trial, refused)
    if refused and "destination ranges of descriptors" in refused:
        i, j = (int(w) for w in refused.split("descriptors ")[1].split(" overlap")[0].split(" and "))
        assert among[i, j]
    elif refused:
        assert "the destination range of descriptor" in refused and not among.any()
        i, j = (int(w) for w in refused.split("descriptor ")[1:3] for w in [w.split(" ")[0]])
        assert over[i, j]
    return refused


def test_triton_kernel_through_resolve_refuses_identical_destinations():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernel in its interpreter on host memory (no GPU)")
    fn = kvswap.resolve("h2d", device="cpu", policy=Policy(force="triton.kernel"))
    pools = Pools(np.random.default_rng(5))
    a, b = address(pools.src), address(pools.dst)
    with pytest.raises(InvalidTransferError, match="descriptors 0 and 1 overlap"):
        fn([a, a + 4096], [b, b], [512, 512])
    with pytest.raises(InvalidTransferError, match="ends past the largest address"):
        fn([a, (1 << 63) - 16], [b, b + 4096], [512, 512])
    with pytest.raises(InvalidTransferError, match="got dtype int32"):
        fn(np.array([a], dtype=np.int64).astype(np.int32), [b], [512])
    assert pools.untouched()


def test_uint64_addresses_that_fit_and_numpy_scalars_are_accepted():
    rng = np.random.default_rng(6)
    pools = Pools(rng)
    fn = kvswap.resolve("d2h", device="cpu", block_bytes=np.int64(100))
    src = np.array([address(pools.src), address(pools.src) + 4096], dtype=np.uint64)
    fn(src, [np.int64(address(pools.dst)), address(pools.dst) + 300], np.array([100, 7], dtype=np.int32))
    assert np.array_equal(pools.dst[:100], pools.src[:100])
    assert np.array_equal(pools.dst[300:307], pools.src[4096:4103])


# ---- 11. numpy integer scalars wherever ints are --------------------------------------

def test_numpy_integer_scalars_are_accepted_wherever_ints_are():
    fn = kvswap.resolve("h2d", device="cpu", block_bytes=np.int64(4096))
    assert fn.plan.routes[0].impl == "host.reference"
    kvswap.resolve("h2d", device="cpu", block_bytes=[np.int32(4096), np.uint64(8192)])
    kvswap.resolve("h2d", device="cpu", block_bytes=np.array([4096, 8192]))
    assert Policy(max_sms=np.int64(4)).max_sms == 4 and type(Policy(max_sms=np.int64(4)).max_sms) is int
    impl = CopyImpl("acme.np", "batch", ("cpu",), ("h2d",), lambda ctx: host_copy, alignment=np.int64(8),
                    min_block_bytes=np.int32(8), max_block_bytes=np.uint32(1 << 20))
    assert (impl.alignment, impl.min_block_bytes, impl.max_block_bytes) == (8, 8, 1 << 20)
    dev = kvswap.DeviceInfo(platform="cpu", name="x", identity="cpu-x", compute_units=np.int64(4), index=np.int64(0))
    assert dev.compute_units == 4 and dev.index == 0
    cal = Calibration(source="np", platform="cpu", kernel_sms={"h2d": np.int64(4)})
    assert cal.sms(kvswap.Direction.H2D) == 4
    for bad in (True, 1.5, "8"):
        with pytest.raises(kvswap.ConfigurationError):
            Policy(max_sms=bad)
        with pytest.raises(kvswap.ConfigurationError):
            kvswap.resolve("h2d", device="cpu", block_bytes=bad)


# ---- 4. names kvswap's own backends register cannot be taken --------------------------

def impostor(name="host.reference", platform="cpu"):
    def factory(ctx):
        def fn(src, dst, sizes, stream):
            raise AssertionError("the impostor copied")
        return fn

    return CopyImpl(name, "batch", (platform,), ("h2d", "d2h"), factory)


@pytest.mark.parametrize("plugin", ["aaa", "zzz"])  # sorting first or last changes nothing
def test_a_plugin_cannot_take_a_built_in_name_and_the_warning_names_it(plugin):
    host = create_plugin_host(entry_points=[], env={}, extra=[(plugin, Offer([impostor()]))])
    with pytest.warns(PluginWarning) as caught:
        fn = kvswap.resolve("h2d", device="cpu", host=host)
    (w,) = [w for w in caught if "host.reference" in str(w.message)]
    assert f"kvswap plugin {plugin!r}" in str(w.message) and "already registered by kvswap's own plugin 'host'" in str(w.message)
    assert next(c for c in fn.plan.candidates if c.name == "host.reference").plugin == "host"
    pools = Pools(np.random.default_rng(7))
    fn([address(pools.src)], [address(pools.dst)], [64])
    assert np.array_equal(pools.dst[:64], pools.src[:64])


def test_an_in_tree_backends_names_are_reserved_too():
    from kvswap.backends import triton_generic

    host = create_plugin_host(entry_points=[], env={}, extra=[("aaa", Offer([impostor("triton.kernel", "cuda")])),
                                                              ("triton", triton_generic)])
    from kvswap.registry.plugins import collect_impls

    with pytest.warns(PluginWarning, match="'aaa'.*registers 'triton.kernel', already registered by kvswap's own"):
        owners = {impl.name: p for p, impl in collect_impls(host, "cuda")}
    assert owners["triton.kernel"] == "triton"


# ---- 8. a plugin's calibration describes only its own implementations -----------------

def test_a_plugins_calibration_cannot_set_curves_for_others_or_for_a_kind():
    mine = watching_impl("acme.mine")
    greedy = Calibration(source="greedy", platform="cpu", scope="device", calibrated=False, curves=(
        Curve("acme.mine", "h2d", ((1, 1.0),)),
        Curve("host.reference", "h2d", ((1, 0.001),)),  # talk the built-in down
        Curve("*batch", "h2d", ((1, 0.002),)),
    ))
    host = create_plugin_host(entry_points=[], env={}, extra=[("acme", Offer([mine], greedy))])
    with pytest.warns(PluginWarning) as caught:
        fn = kvswap.resolve("h2d", device="cpu", host=host, block_bytes=4096)
    said = " | ".join(str(w.message) for w in caught)
    assert "curves for 'host.reference', which plugin 'host' registers" in said
    assert "'*batch'" in said and "only kvswap's own backends may" in said
    route = fn.plan.routes[0]
    assert dict(route.predicted) == {"acme.mine": 1.0, "host.reference": None}  # measured its own only
    assert route.impl == "acme.mine"


def test_an_unmeasured_plugin_impl_never_outranks_a_built_in_route():
    host = create_plugin_host(entry_points=[], env={}, extra=[("aaa", Offer([watching_impl("aaa.copy")]))])
    fn = kvswap.resolve("h2d", device="cpu", host=host)
    assert {r.impl for r in fn.plan.routes} == {"host.reference"}
    # A kind curve from a built-in calibration predicts built-in routes only.
    cal = Calibration(source="kinds", platform="cpu", curves=(Curve("*batch", "h2d", ((1, 5.0),)),))
    fn = kvswap.resolve("h2d", device="cpu", host=host, calibration=cal)
    assert dict(fn.plan.routes[0].predicted) == {"host.reference": 5.0, "aaa.copy": None}
    assert fn.plan.routes[0].impl == "host.reference"


def test_explain_says_why_a_plugin_impl_took_a_route_unmeasured():
    host = create_plugin_host(entry_points=[], env={}, extra=[("acme", Acme())])
    text = kvswap.resolve("h2d", device="acme", host=host).explain()
    assert ("acme.copy (plugin acme), which takes blocks of 4 KiB to 1 MiB, in multiples of 4096 B, took blocks "
            "of 4 KiB to ") in text and " unmeasured" in text, text
    assert "no measured or built-in route can copy these sizes" in text
    own = create_plugin_host(entry_points=[], env={}, extra=[("acme", Offer([watching_impl("acme.mine")], Calibration(
        source="acme guesses", platform="cpu", scope="device", calibrated=False,
        curves=(Curve("acme.mine", "h2d", ((1, 1.0),)),))))])
    text = kvswap.resolve("h2d", device="cpu", host=own).explain()
    assert ("acme.mine (plugin acme), which takes blocks of 1 B or more, is ranked by numbers that are not "
            "measured") in text


# ---- resolve() refuses block sizes no usable route can copy ---------------------------

class Acme:
    """A platform of its own whose one route takes blocks of 4 KiB multiples up to 1 MiB."""

    @hookimpl
    def kvswap_detect_platform(self, device):
        if device == "acme":
            return kvswap.DeviceInfo(platform="acme", name="ACME", identity="acme-1", compute_units=1,
                                     details={"torch_type": "cpu"})
        return None

    @hookimpl
    def kvswap_register_copy_impls(self, platform, register):
        if platform == "acme":
            register(CopyImpl("acme.copy", "batch", ("acme",), ("h2d", "d2h"), lambda ctx: host_copy,
                              alignment=4096, min_block_bytes=4096, max_block_bytes=1 << 20))


def test_resolve_refuses_block_sizes_no_route_can_copy_naming_the_limits():
    host = create_plugin_host(entry_points=[], env={}, extra=[("acme", Acme())])
    assert kvswap.resolve("h2d", device="acme", host=host, block_bytes=1 << 20).impls == ("acme.copy",)
    with pytest.raises(ResolutionError, match=r"blocks of 1300000 bytes .*acme.copy takes blocks of 4 KiB to 1 MiB, "
                                              r"in multiples of 4096 B"):
        kvswap.resolve("h2d", device="acme", host=host, block_bytes=1_300_000)
    with pytest.raises(ResolutionError, match="blocks of 6000 bytes"):
        kvswap.resolve("h2d", device="acme", host=host, block_bytes=[4096, 6000])


def test_forcing_an_unknown_name_is_a_usage_error():
    with pytest.raises(kvswap.UnknownImplError, match="'nosuch' is not registered") as caught:
        kvswap.resolve("h2d", device="cpu", policy=Policy(force="nosuch"))
    assert isinstance(caught.value, ResolutionError)


# ---- 6. concurrent first resolves with a failing plugin -------------------------------

class Raising:
    @hookimpl
    def kvswap_register_copy_impls(self, platform, register):
        time.sleep(0.002)  # every thread inside the hook at once, then all drop it together
        raise RuntimeError("broken plugin")

    @hookimpl
    def kvswap_register_calibrations(self, device, register):
        raise RuntimeError("broken plugin")


def test_concurrent_first_resolves_drop_a_failing_plugin_once_without_racing():
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show
    try:
        race_resolves(60)
    finally:
        sys.setswitchinterval(old)


def race_resolves(trials):
    for trial in range(trials):
        host = create_plugin_host(entry_points=[], env={}, extra=[(f"broken{i}", Raising()) for i in range(3)])
        start = threading.Barrier(8)
        errors: list[BaseException] = []

        def go():
            try:
                start.wait()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    fn = kvswap.resolve("h2d", device="cpu", host=host)
                assert fn.impls == ("host.reference",)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=go) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, f"trial {trial}: {errors[0]!r}"
        assert all(host.records[f"broken{i}"].status == "failed" for i in range(3))


# ---- 7. switches that name nothing are warned about -----------------------------------

def test_switches_naming_no_plugin_are_warned_about():
    with pytest.warns(PluginWarning, match="'nosuch' is named in KVSWAP_DISABLE_PLUGINS but is not installed"):
        create_plugin_host(entry_points=[], env={"KVSWAP_DISABLE_PLUGINS": "nosuch"})
    with pytest.warns(PluginWarning, match="'nosuch' is named in KVSWAP_PLUGINS but is not installed"):
        create_plugin_host(entry_points=[], env={"KVSWAP_PLUGINS": "nosuch"})
    with pytest.warns(PluginWarning, match="'host' .*is named in KVSWAP_DISABLE_PLUGINS but is built in"):
        create_plugin_host(entry_points=[], env={"KVSWAP_DISABLE_PLUGINS": "host"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        create_plugin_host(entry_points=[], env={"KVSWAP_DISABLE_PLUGINS": "acme"}, extra=[("acme", Acme())])


# ---- a failed batch leaves the SwapFn usable ------------------------------------------

def test_a_driver_error_leaves_the_swapfn_usable():
    calls = []

    def factory(ctx):
        def fn(src, dst, sizes, stream):
            calls.append(len(sizes))
            if len(calls) == 1:
                raise DriverError("acmeMemcpyBatch", 700, "ACME_ERROR_LAUNCH_FAILED", "simulated", index=3)
            host_copy(src, dst, sizes)
        return fn

    flaky = CopyImpl("acme.flaky", "batch", ("cpu",), ("h2d", "d2h"), factory)
    host = create_plugin_host(entry_points=[], env={}, extra=[("acme", Offer([flaky]))])
    fn = kvswap.resolve("h2d", device="cpu", host=host, policy=Policy(force="acme.flaky"))
    rng = np.random.default_rng(9)
    pools = Pools(rng)
    src = address(pools.src) + np.arange(5, dtype=np.int64) * 4096
    dst = address(pools.dst) + np.arange(5, dtype=np.int64) * 8192
    with pytest.raises(DriverError, match="ACME_ERROR_LAUNCH_FAILED") as caught:
        fn(src, dst, np.full(5, 1000))
    assert caught.value.index == 3
    fn(src, dst, np.full(5, 1000))
    for i in range(5):
        assert np.array_equal(pools.dst[i * 8192:i * 8192 + 1000], pools.src[i * 4096:i * 4096 + 1000])
    assert calls == [5, 5]


def test_a_driver_error_names_the_callers_descriptor_through_a_split():
    """A route reports a failing descriptor by its index in the slice it was handed; the
    SwapFn's error names the caller's index instead."""
    def failing(ctx):
        def fn(src, dst, sizes, stream):
            raise DriverError("acmeBatchCopy", 7, "ACME_ERROR_BUSY", index=1)
        return fn

    small = CopyImpl("acme.small", "batch", ("cpu",), ("h2d",), lambda ctx: host_copy)
    large = CopyImpl("acme.large", "batch", ("cpu",), ("h2d",), failing)
    curves = (Curve("acme.small", "h2d", ((4 * KiB, 90.0), (32 * KiB, 90.0), (64 * KiB, 1.0))),
              Curve("acme.large", "h2d", ((4 * KiB, 1.0), (32 * KiB, 1.0), (64 * KiB, 90.0))))
    cal = Calibration(source="acme split", platform="cpu", scope="device", curves=curves)
    host = create_plugin_host(entry_points=[], env={}, extra=[("acme", Offer([small, large], cal))])
    fn = kvswap.resolve("h2d", device="cpu", host=host, policy=Policy(force=None))
    rng = np.random.default_rng(13)
    pools = Pools(rng, 1 << 23)
    sizes = np.full(8, 4 * KiB, dtype=np.int64)
    sizes[[2, 5, 7]] = 256 * KiB  # the large slice is the caller's descriptors 2, 5 and 7
    slot = 256 * KiB + 64
    src = address(pools.src) + rng.permutation(len(pools.src) // slot)[:8] * slot
    dst = address(pools.dst) + rng.permutation(len(pools.dst) // slot)[:8] * slot
    assert {name for name, _, _ in fn.assign(src, dst, sizes)} == {"acme.small", "acme.large"}
    with pytest.raises(DriverError) as e:
        fn(src, dst, sizes)
    assert (e.value.name, e.value.index) == ("ACME_ERROR_BUSY", 5)
    assert str(e.value).endswith("[descriptor 5]")


@pytest.mark.parametrize("count", [2, 17, SMALL_BATCH, SMALL_BATCH + 1, 700])
def test_one_size_destinations_are_refused_exactly_when_two_are_closer_than_the_size(count):
    """Blocks of one size (what engines send) are checked by the gaps between the sorted
    destinations: a gap of the size itself is adjacent, one byte less overlaps."""
    rng = np.random.default_rng()
    size = int(rng.integers(8, 4096))
    verdicts = set()
    for trial in range(30):
        gaps = rng.integers(size, 3 * size, count)  # every destination at least a size past the last
        if trial % 2:
            gaps[rng.integers(1, count)] = size - int(rng.integers(1, size))  # one pair overlaps
        elif trial % 4 == 0:
            gaps[rng.integers(1, count)] = size  # exactly adjacent: fine
        order = rng.permutation(count) if trial % 3 else np.arange(count)  # scattered or ascending
        dst = (np.cumsum(gaps) + (1 << 32))[order]
        src = rng.permutation(count).astype(np.int64) * size + (1 << 40)
        sizes = np.full(count, size, dtype=np.int64)
        among = clashes(dst, sizes, dst, sizes)
        np.fill_diagonal(among, False)
        refused = _refusal(src, dst, sizes)
        verdicts.add(refused is None)
        assert (refused is not None) == bool(among.any()), (trial, refused)
        if refused:
            i, j = (int(w) for w in refused.split("descriptors ")[1].split(" overlap")[0].split(" and "))
            assert among[i, j]
    assert verdicts == {True, False}


@pytest.mark.parametrize("spread", [2, GRID_SLOTS + 1, 1 << 12])
def test_large_one_size_batches_on_a_grid_are_refused_exactly_when_two_destinations_overlap(spread):
    """From GRID_FROM descriptors, destinations on a grid of the block size are checked by
    slot (a bitmap over a compact range, sorted slot numbers over a wide one) and the rest
    by sorting: every way gives the pairwise check's verdict and names an overlapping pair."""
    rng = np.random.default_rng(spread)
    count = GRID_FROM + int(rng.integers(0, 600))
    size = int(rng.choice([512, 4096, 3 * 1024]))
    verdicts = set()
    for trial in range(24):
        slots = rng.choice(spread * count, count, replace=False).astype(np.int64)
        dst = slots * size + (1 << 32)
        i, j = (int(x) for x in rng.choice(count, 2, replace=False))
        if trial % 4 == 1:
            dst[i] = dst[j]  # the same slot
        elif trial % 4 == 2:
            dst[i] = dst[j] + int(rng.integers(1, size))  # off the grid, overlapping
        elif trial % 4 == 3:
            dst[i] = dst[j] + size * (1 + int(rng.integers(0, 2)))  # adjacent or one apart: overlaps only a taken slot
        src = rng.permutation(count).astype(np.int64) * size + ((1 << 32) if trial % 6 == 5 else (1 << 44))
        sizes = np.full(count, size, dtype=np.int64)
        verdicts.add(_matches_pairwise(src, dst, sizes, trial) is None)
        grid = _grid_clash(dst, size)
        assert (grid is None) == (trial % 4 == 2)  # only the shifted one leaves the grid
        among = clashes(dst, sizes, dst, sizes)
        np.fill_diagonal(among, False)
        assert grid is None or grid[0] == bool(among.any())
    assert verdicts == {True, False}
