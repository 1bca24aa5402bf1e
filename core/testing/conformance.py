"""The conformance suite: what every kvswap copy implementation must do on its device.

Collected only through ``pytest -p kvswap.testing --kvswap-impl NAME``. Each copy test
moves fresh random data into a poisoned destination over scattered descriptors and checks
every byte of both buffers, guard bytes around each block included; the implementation is
exercised twice over: its factory's callable as a backend hands it to core, and the
:class:`kvswap.SwapFn` that ``resolve(..., policy=Policy(force=NAME))`` returns.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import numpy as np
import pytest

import kvswap
from kvswap import BindContext, Direction, InvalidTransferError, Policy, ResolutionError
from kvswap.cli.inventory import KNOWN_PLATFORMS
from kvswap.registry import streams
from kvswap.resolution.resolver import collect_impls, host_translator
from kvswap.testing import Target, get_target
from kvswap.testing.memory import Transfer, adjacent_runs, make_transfer
from kvswap.testing.target import REFUSAL_CAP, Violation


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    t = get_target(metafunc.config)
    names = metafunc.fixturenames
    if "direction" in names:
        metafunc.parametrize("direction", t.impl.directions, ids=str)
    if "max_sms" in names:
        # A kernel is also run on one SM: grid-stride and tail logic must not assume many.
        values = [None, 1] if t.impl.uses_sms else [None]
        metafunc.parametrize("max_sms", values, ids=lambda v: "default" if v is None else f"max_sms={v}")
    if "size" in names:
        metafunc.parametrize("size", t.sizes(), ids=lambda s: f"{s}B")
    if "violation" in names:
        cases = t.violations() or [None]
        metafunc.parametrize("violation", cases, ids=lambda v: "none-declared" if v is None else v.label)
    if "stream_kind" in names:
        metafunc.parametrize("stream_kind", ["torch-stream", "raw-handle"])


# -- fixtures ------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def kit(request: pytest.FixtureRequest) -> Target:
    return get_target(request.config)


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    given = request.config.getoption("kvswap_seed")
    return int(given if given is not None else np.random.SeedSequence().entropy % (1 << 63))


@pytest.fixture
def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _alive(kit: Target) -> None:
    """Fail, with the reason, once kvswap has dropped the plugin (every later resolve
    would only say the impl is not registered)."""
    record = kit.host.records[kit.plugin]
    if record.status != "loaded":
        pytest.fail(f"plugin {kit.plugin!r} was dropped, so kvswap no longer offers {kit.impl.name}: "
                    f"{record.reason}; a hook that raises or answers nonsense drops its whole plugin", pytrace=False)


def _usable(kit: Target) -> None:
    _alive(kit)
    if kit.unavailable is not None:
        pytest.skip(f"{kit.impl.name} is unavailable on {kit.device.name}: {kit.unavailable}")


@pytest.fixture
def swap(kit: Target, direction: Direction, max_sms: Optional[int]) -> kvswap.SwapFn:
    """The SwapFn an engine gets when it forces this impl."""
    _usable(kit)
    fn = kvswap.resolve(direction, device=kit.device_spec, policy=Policy(force=kit.impl.name, max_sms=max_sms))
    _alive(kit)
    return fn


@pytest.fixture
def bound(kit: Target, swap: kvswap.SwapFn, direction: Direction) -> Callable[..., None]:
    """The impl's per-transfer callable, bound by its factory with the parameters and the
    host address translation that resolve chose (``num_sms`` for kernels)."""
    params = swap.plan.params.get(kit.impl.name, {})
    fn = kit.impl.factory(BindContext(direction, kit.device, params, host_translator(kit.host, kit.device)))
    assert callable(fn), f"{kit.impl.name}'s factory returned {fn!r}, not a callable"
    return fn


def _transfer(kit: Target, rng: np.random.Generator, seed: int, direction: Direction, sizes: Any, **layouts: Any) -> Transfer:
    return make_transfer(rng, seed, direction, kit.torch_device, kit.impl.alignment,
                         np.asarray(sizes, dtype=np.int64), **layouts)


def _direct(fn: Callable[..., None], t: Transfer) -> None:
    fn(*t.descriptors, None)


def _mixed_sizes(kit: Target, rng: np.random.Generator) -> np.ndarray:
    sizes = [s for s in kit.sizes() for _ in range(max(1, min(6, kit.count(s) // 4)))]
    return rng.permutation(np.asarray(sizes, dtype=np.int64))


# -- registration --------------------------------------------------------------------------
def test_plugin_loaded_and_impl_registered_once(kit: Target) -> None:
    record = kit.host.records[kit.plugin]
    assert record.status == "loaded", f"plugin {kit.plugin!r} is {record.status}: {record.reason}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        offered = kit.host.collect("kvswap_register_copy_impls", kvswap.CopyImpl, platform=kit.device.platform)
    mine = [plugin for plugin, impl in offered if impl.name == kit.impl.name]
    assert mine == [kit.plugin], (
        f"{kit.impl.name} must be registered once, by one plugin; registrations came from {mine}")
    assert kit.host.records[kit.plugin].status == "loaded", (
        f"plugin {kit.plugin!r} was dropped while registering: {kit.host.records[kit.plugin].reason}")


def test_plugin_stays_loaded_through_a_resolve(kit: Target) -> None:
    """A resolve calls every hook it needs (the device, copy impls, calibrations, the host
    address translation); one that raises or answers nonsense drops the whole plugin."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            kvswap.resolve(kit.impl.directions[0], device=kit.device_spec)
        except ResolutionError:
            pass  # nothing usable for this direction: the hooks were called all the same
    _alive(kit)


def test_stream_hook_answers_a_handle_or_none(kit: Target) -> None:
    """On an accelerator, kvswap asks every plugin for a stream of its own
    (``kvswap_create_stream``) when a mover or route first needs one; a hook that raises or
    answers anything but None or a stream handle drops the whole plugin. Asked for this
    device, the plugin's hook answers; a handle it gives is a stream that runs work."""
    index = kit.device.index or 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        answers = [h for plugin, h in kit.host.call_each("kvswap_create_stream", platform=kit.device.platform,
                                                         device_index=index) if plugin == kit.plugin]
    _alive(kit)
    for handle in answers:
        assert handle is None or streams.valid_handle(handle), (
            f"{kit.plugin}'s kvswap_create_stream returned {handle!r}: it must return None or a stream handle "
            "(an int > 0); kvswap drops a plugin that answers otherwise")
        if handle is not None and kit.memory == "accelerator":
            import torch

            stream = torch.cuda.ExternalStream(handle, device=kit.torch_device)
            x = torch.arange(1 << 16, device=kit.torch_device)
            with torch.cuda.stream(stream):
                y = x * 3
            stream.synchronize()
            assert torch.equal(y, torch.arange(1 << 16, device=kit.torch_device) * 3), (
                f"work enqueued on the stream {kit.plugin}'s kvswap_create_stream created gave wrong results")


def test_registered_only_for_platforms_it_serves(kit: Target) -> None:
    asked = dict.fromkeys((kit.device.platform, *KNOWN_PLATFORMS, *kit.impl.platforms))
    wrong = [p for p in asked
             if any(i.name == kit.impl.name for _, i in collect_impls(kit.host, p)) and p not in kit.impl.platforms]
    assert not wrong, (f"{kit.impl.name} serves {kit.impl.platforms} but is registered when kvswap asks "
                       f"for {wrong}; register an impl only for the platforms it serves")


def test_refusal_is_what_the_declaration_says(kit: Target) -> None:
    impl, a = kit.impl, kit.impl.alignment
    lo, hi = impl.min_block_bytes, impl.max_block_bytes
    sizes = np.array(sorted({1, 2, 3, lo, lo + 1, max(lo - 1, 1), 4096, 4097, *kit.sizes(),
                             *([hi, hi + 1] if hi else [])}), dtype=np.int64)
    base = np.int64(1 << 20)
    for shift in (0, 1, a // 2 if a > 1 else 0):
        src, dst = np.full(len(sizes), base + shift), np.full(len(sizes), base)
        want = ((src | dst | sizes) % a != 0) | (sizes < lo)
        if hi is not None:
            want |= sizes > hi
        got = np.asarray(impl.refused(src, dst, sizes), dtype=bool)
        assert np.array_equal(got, want), (
            f"{impl.name}.refused() disagrees with its declared constraints {impl.constraints()} "
            f"for sizes {sizes[got != want].tolist()} at source shift {shift}")
    assert impl.constraints() == {"alignment": a, "min_block_bytes": lo, "max_block_bytes": hi,
                                  "requires_pinned": impl.requires_pinned, "mixed_sizes": impl.mixed_sizes}


def test_availability_answers_none_or_a_reason(kit: Target) -> None:
    answer, raised = None, None
    try:
        answer = kit.impl.availability(kit.device)
    except Exception as e:
        raised = f"{type(e).__name__}: {e}"
    assert raised is None, (f"{kit.impl.name}'s availability check raised {raised}; it must return None or a "
                            "reason, never raise (kvswap counts a raise as unavailable)")
    assert answer is None or (isinstance(answer, str) and answer.strip()), (
        f"{kit.impl.name}'s availability check must return None or a reason (a non-empty str), "
        f"got {answer!r}")
    assert kit.impl.availability(kit.device) == answer, "availability must give the same answer twice"


def test_resolve_refuses_directions_not_advertised(kit: Target) -> None:
    missing = [d for d in Direction if d not in kit.impl.directions]
    if not missing:
        pytest.skip(f"{kit.impl.name} advertises every direction")
    _usable(kit)  # an unavailable impl is refused for that reason first
    for d in missing:
        with pytest.raises(ResolutionError, match="copies only"):
            kvswap.resolve(d, device=kit.device_spec, policy=Policy(force=kit.impl.name))


# -- the impl's own callable ---------------------------------------------------------------
def test_copies_each_size(kit, bound, rng, seed, direction, size):
    t = _transfer(kit, rng, seed, direction, np.full(kit.count(size), size))
    _direct(bound, t)
    t.check(f"{kit.impl.name} {direction}, {kit.count(size)} blocks of {size} B")


def test_copies_one_block(kit, bound, rng, seed, direction):
    t = _transfer(kit, rng, seed, direction, [kit.small_size()])
    _direct(bound, t)
    t.check(f"{kit.impl.name} {direction}, one block")


def test_copies_thousands_of_blocks(kit, bound, rng, seed, direction):
    t = _transfer(kit, rng, seed, direction, np.full(kit.thousands(), kit.small_size()))
    _direct(bound, t)
    t.check(f"{kit.impl.name} {direction}, {kit.thousands()} blocks")


def test_copies_mixed_sizes_in_one_call(kit, bound, rng, seed, direction):
    if not kit.impl.mixed_sizes:
        pytest.skip(f"{kit.impl.name} declares mixed_sizes=False (its SwapFn splits by size; "
                    "test_swapfn_copies_mixed_sizes covers that)")
    t = _transfer(kit, rng, seed, direction, _mixed_sizes(kit, rng))
    _direct(bound, t)
    t.check(f"{kit.impl.name} {direction}, mixed sizes")


def test_copies_many_odd_sizes_at_odd_addresses(kit, bound, rng, seed, direction):
    """Over a thousand descriptors of odd sizes (odd multiples of the alignment), each at
    its own offset: tiling, tails and per-descriptor bookkeeping at once."""
    if not kit.impl.mixed_sizes:
        pytest.skip(f"{kit.impl.name} declares mixed_sizes=False (test_swapfn_copies_many_odd_sizes covers it)")
    sizes = kit.odd_sizes(rng)
    t = _transfer(kit, rng, seed, direction, sizes)
    _direct(bound, t)
    t.check(f"{kit.impl.name} {direction}, {len(sizes)} blocks of odd sizes")


def test_copies_adjacent_runs(kit, bound, rng, seed, direction):
    size, a = kit.small_size(), kit.impl.alignment
    src, dst = (adjacent_runs(rng, size, runs=9, run_len=7, alignment=a) for _ in range(2))
    t = _transfer(kit, rng, seed, direction, np.full(63, size), src_layout=src, dst_layout=dst)
    _direct(bound, t)
    t.check(f"{kit.impl.name} {direction}, runs of blocks contiguous on both sides")


def test_bound_callable_is_reusable(kit, bound, rng, seed, direction):
    for n in (5, 700, 1):
        t = _transfer(kit, rng, seed, direction, np.full(n, kit.small_size()))
        _direct(bound, t)
        t.check(f"{kit.impl.name} {direction}, call with {n} blocks after other calls")


# -- the SwapFn resolve() returns when the impl is forced ----------------------------------
def test_swapfn_uses_only_this_impl(kit, swap, direction, max_sms):
    assert swap.impls == (kit.impl.name,)
    assert swap.plan.forced == kit.impl.name and swap.plan.direction == direction
    assert [r.impl for r in swap.plan.routes] == [kit.impl.name]
    assert swap.requires_pinned == kit.impl.requires_pinned
    if kit.impl.uses_sms and max_sms is not None:
        assert swap.plan.params[kit.impl.name]["num_sms"] <= max_sms


def test_swapfn_empty_batch_changes_nothing(kit, swap, rng, seed, direction):
    t = _transfer(kit, rng, seed, direction, [kit.small_size()] * 3)
    empty = np.zeros(0, dtype=np.int64)
    swap(empty, empty, empty)
    t.check_untouched(f"{kit.impl.name} {direction}, empty batch")


def test_swapfn_copies_one_block(kit, swap, rng, seed, direction):
    t = _transfer(kit, rng, seed, direction, [kit.small_size()])
    swap(*t.descriptors)
    t.check(f"SwapFn forcing {kit.impl.name} {direction}, one block")


def test_swapfn_copies_thousands_from_torch_tensors(kit, swap, rng, seed, direction):
    import torch

    t = _transfer(kit, rng, seed, direction, np.full(kit.thousands(), kit.small_size()))
    swap(*(torch.from_numpy(a) for a in t.descriptors))  # vLLM's swap_blocks_batch shape
    t.check(f"SwapFn forcing {kit.impl.name} {direction}, {kit.thousands()} blocks")


def test_swapfn_copies_mixed_sizes(kit, swap, rng, seed, direction):
    t = _transfer(kit, rng, seed, direction, _mixed_sizes(kit, rng))
    swap(*t.descriptors)
    t.check(f"SwapFn forcing {kit.impl.name} {direction}, mixed sizes")


def test_swapfn_copies_many_odd_sizes(kit, swap, rng, seed, direction):
    sizes = kit.odd_sizes(rng)
    t = _transfer(kit, rng, seed, direction, sizes)
    swap(*t.descriptors)
    t.check(f"SwapFn forcing {kit.impl.name} {direction}, {len(sizes)} blocks of odd sizes")


def test_swapfn_resolved_for_declared_block_sizes(kit, rng, seed, direction):
    _usable(kit)
    sizes = kit.sizes()
    fn = kvswap.resolve(direction, device=kit.device_spec, block_bytes=sizes, policy=Policy(force=kit.impl.name))
    t = _transfer(kit, rng, seed, direction, rng.permutation(sizes))
    fn(*t.descriptors)
    t.check(f"SwapFn forcing {kit.impl.name} {direction} resolved for block_bytes={sizes}")


def test_swapfn_refuses_what_the_impl_declares_it_cannot_copy(kit, rng, seed, direction, violation):
    """A descriptor that breaks a declared constraint must be refused before any byte
    moves, not copied wrongly: every byte of both buffers is checked unchanged."""
    if violation is None:
        pytest.skip(f"{kit.impl.name} declares no alignment or size bound")
    _usable(kit)
    v: Violation = violation
    if v.size > REFUSAL_CAP:
        pytest.skip(f"{v.label}: a {v.size}-byte block is too large to allocate for this check")
    swap = kvswap.resolve(direction, device=kit.device_spec, policy=Policy(force=kit.impl.name))
    small = kit.small_size()
    sizes = np.full(8, small, dtype=np.int64)
    k = int(rng.integers(0, 8))
    sizes[k] = v.size
    t = _transfer(kit, rng, seed, direction, sizes)
    src, dst, n = t.descriptors
    src[k] += v.src_shift
    dst[k] += v.dst_shift
    try:
        swap(src, dst, n)
    except InvalidTransferError:
        pass
    else:
        pytest.fail(f"{kit.impl.name} {direction}: a batch holding a {v.label} descriptor (size {v.size}) "
                    f"was accepted, not refused with InvalidTransferError; its constraints declare "
                    f"{kit.impl.constraints()}")
    t.check_untouched(f"{kit.impl.name} {direction}, batch with a {v.label} descriptor")
    if v.src_shift == v.dst_shift == 0:
        with pytest.raises(ResolutionError):
            kvswap.resolve(direction, device=kit.device_spec, block_bytes=v.size,
                           policy=Policy(force=kit.impl.name))


def test_swapfn_copies_on_the_given_stream(kit, swap, rng, seed, direction, stream_kind):
    """The copy is enqueued on the caller's stream: waiting for that stream alone suffices."""
    if kit.torch_device == "cpu":
        pytest.skip(f"{kit.device.platform} device {kit.device.name!r} is host-only: it has no streams")
    import torch

    dev = torch.device(kit.torch_device)
    stream = torch.cuda.Stream(device=dev)
    t = _transfer(kit, rng, seed, direction, np.full(257, kit.small_size()))
    # Keep the current stream busy: a copy wrongly enqueued there would finish only after
    # the wait below, and the check would see poison.
    torch.cuda._sleep(50_000_000)
    swap(*t.descriptors, stream=stream if stream_kind == "torch-stream" else int(stream.cuda_stream))
    stream.synchronize()
    with torch.cuda.stream(stream):
        got = t.dst.tensor.to("cpu").numpy().copy()  # a snapshot, also of pinned host memory
    torch.cuda.synchronize(dev)
    want = t.expected()
    assert np.array_equal(got, want), (
        f"{kit.impl.name} {direction}: after waiting for the given stream only, "
        f"{int((got != want).sum())} destination bytes are wrong [seed {seed}]")
