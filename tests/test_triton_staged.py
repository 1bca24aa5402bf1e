"""``triton.staged`` in Triton's CPU interpreter: the device-side kernel gathers or scatters
through a staging buffer (host memory here), the host reference stands in for the copy
engines over the link. Staging budgets far below the job force slices, both halves in
turn and descriptors cut to fit a half. Whole allocations are checked (guard bytes
included) on random data, against torch indexing or a per-descriptor reference.
"""
from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch

import kvswap
from kvswap import BlockMover, Direction, Policy
from kvswap.mover.route_choice import MIN_RUN_BYTES, staged_choice
from kvswap.addressing.runs import SLOT_ALIGN, host_runs
from fakes import install_staged_on_cpu
from mover_layouts import Pool, expected_after, layouts

pytest.importorskip("triton")
from kvswap.backends.triton_generic.launch import interpreting  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="runs the kernel in Triton's CPU interpreter")
LAYOUTS = layouts()


@pytest.fixture
def link_calls(monkeypatch) -> list:
    """``triton.staged`` without its pinned-memory requirement (host tensors here are
    pageable, and the interpreter copies synchronously), its link the host reference,
    recording how many descriptors cross the link per call."""
    import kvswap.registry.reference as reference

    calls: list = []
    plain = reference.host_copy

    def link(src, dst, sizes, stream=None):
        calls.append(len(sizes))
        return plain(src, dst, sizes, stream)

    monkeypatch.setattr(reference, "host_copy", link)
    install_staged_on_cpu()
    return calls


# -- raw descriptors through a forced SwapFn ----------------------------------------------
@pytest.mark.parametrize("staging", [1 << 12, 1 << 14, 1 << 20])
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_descriptors_land_exactly_in_slices(direction, staging, link_calls):
    rng = np.random.default_rng(staging)
    src = np.frombuffer(rng.bytes(1 << 18), dtype=np.uint8).copy()
    dst = np.frombuffer(rng.bytes(1 << 18), dtype=np.uint8).copy()
    before = dst.copy()
    n = 40
    sizes = rng.integers(1, 3000, n)
    sizes[:3] = 5000  # larger than half the smallest budget: cut to fit
    scattered = rng.permutation(np.arange(0, (1 << 18) - 5000, 5000))[:n]
    adjacent = np.cumsum(np.concatenate(([0], sizes[:-1])))  # on the host: merged on the link
    adjacent[n // 2:] += 777  # a gap: two runs
    so, do = (adjacent, scattered) if direction == "h2d" else (scattered, adjacent)
    swap = kvswap.resolve(direction, device="cpu", policy=Policy(force="triton.staged", staging_bytes=staging))
    swap(src.ctypes.data + so, dst.ctypes.data + do, sizes)
    expect = before.copy()
    for a, b, z in zip(so, do, sizes):
        expect[b:b + z] = src[a:a + z]
    assert np.array_equal(dst, expect)
    if staging == 1 << 20:  # one slice: the two host runs cross the link as two descriptors
        assert link_calls == [2]


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_a_half_spreads_its_link_over_the_link_streams_in_parts_of_equal_bytes(direction, link_calls, monkeypatch):
    from kvswap.backends.triton_generic import staged as staged_mod

    import kvswap.registry.reference as reference

    monkeypatch.setattr(staged_mod, "LINK_STREAMS", 3)
    part_bytes: list = []
    counted = reference.host_copy  # the fixture's recorder, which counts descriptors

    def link(src, dst, sizes, stream=None):
        part_bytes.append(int(np.sum(sizes)))
        return counted(src, dst, sizes, stream)

    monkeypatch.setattr(reference, "host_copy", link)
    rng = np.random.default_rng(21)
    src = np.frombuffer(rng.bytes(1 << 20), dtype=np.uint8).copy()
    dst = np.frombuffer(rng.bytes(1 << 20), dtype=np.uint8).copy()
    before = dst.copy()
    n = 3 * staged_mod.MIN_LINK_DESCRIPTORS + 5
    sizes = np.full(n, 4096, dtype=np.int64)
    sizes[::4] = 8192  # unequal descriptors: the parts are cut by bytes, not by count
    slots = np.arange(0, (1 << 20) - 8192, 2 * 8192)
    so, do = rng.permutation(slots)[:n], rng.permutation(slots)[:n]  # no two adjacent: none merge
    swap = kvswap.resolve(direction, device="cpu", policy=Policy(force="triton.staged", staging_bytes=1 << 22))
    swap(src.ctypes.data + so, dst.ctypes.data + do, sizes)
    expect = before.copy()
    for a, b, z in zip(so, do, sizes):
        expect[b:b + z] = src[a:a + z]
    assert np.array_equal(dst, expect)
    assert len(link_calls) == 3 and sum(link_calls) == n
    assert max(part_bytes) - min(part_bytes) <= 2 * 8192  # a third of the bytes each, to a descriptor
    link_calls.clear()
    few = 2 * staged_mod.MIN_LINK_DESCRIPTORS - 1  # too few for two streams' worth
    swap(src.ctypes.data + so[:few], dst.ctypes.data + do[:few], sizes[:few])
    assert link_calls == [few]


# -- a BlockMover's blocks by id ----------------------------------------------------------
def _typed(layout_name: str, dtype: torch.dtype):
    return dataclasses.replace(LAYOUTS[layout_name], dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("host_name", ["cross_views", "flash"])
def test_mover_blocks_through_the_staging_buffer(host_name, direction, dtype, link_calls):
    """Per-layer device tensors against a block-major host (one run per block) or a
    per-layer host (a run per chunk), through budgets of a few blocks."""
    gen, rng = torch.Generator().manual_seed(11), np.random.default_rng(12)
    host, device = Pool(_typed(host_name, dtype), 40, gen), Pool(_typed("flash", dtype), 32, gen)
    src, dst = (host, device) if direction == "h2d" else (device, host)
    before, src_before = dst.snapshot(), src.snapshot()
    block = 2 * 3 * 4 * 2 * 16 * 2
    jobs = []
    with BlockMover(src.tensors, dst.tensors, direction, block_dim=1, device_descriptors=True,
                    policy=Policy(force="triton.staged", staging_bytes=6 * block)) as mover:
        staged = mover._plan.ids.fns[0]
        assert staged is not None and staged.slots == 3  # three blocks a half: slices of three
        assert staged.runs.count == (1 if host_name == "cross_views" else 6)
        for n in (1, 7, 20, 0, 3):
            sid = rng.choice(src.num_blocks, n, replace=False).astype(np.int64)
            did = rng.choice(dst.num_blocks, n, replace=False).astype(np.int64)
            mover.submit(sid, did)
            jobs.append((sid, did))
        results = mover.poll()
    assert all(r.ok for r in results) and [r.bytes for r in results] == [n * block for n in (1, 7, 20, 0, 3)]
    assert dst.matches(expected_after(dst, before, src_before, src, jobs))
    assert src.matches(src_before)


def test_consecutive_host_blocks_cross_the_link_as_one_run(link_calls):
    gen = torch.Generator().manual_seed(13)
    device = [torch.randn(2, 16, 4, 2, 16, generator=gen).to(torch.bfloat16) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kvswap.NumaWarning)
        cache = kvswap.host_cache(device, 24, block_dim=1)
    with BlockMover(device, list(cache.views), "d2h", block_dim=1, device_descriptors=True,
                    policy=Policy(force="triton.staged")) as mover:
        mover.submit([9, 2, 5, 0, 11], [7, 5, 6, 20, 8])  # host 5..8 consecutive, 20 apart
    assert link_calls == [2]
    for i, j in zip([9, 2, 5, 0, 11], [7, 5, 6, 20, 8]):
        for t, v in zip(device, cache.views):
            assert torch.equal(v[:, j].view(torch.int16), t[:, i].view(torch.int16))


# -- which host sides a mover stages ------------------------------------------------------
def test_host_runs_merge_pieces_adjacent_on_the_host():
    gen = torch.Generator().manual_seed(14)
    device, _ = Pool(LAYOUTS["flash"], 10, gen), None
    per_layer, block_major = Pool(LAYOUTS["flash"], 12, gen), Pool(LAYOUTS["cross_views"], 12, gen)
    for host, runs_per_block in ((block_major, 1), (per_layer, 6)):
        mover = BlockMover(device.tensors, host.tensors, "d2h", block_dim=1, issuing_thread=False)
        t = mover._plan.templates[0]
        runs = host_runs(t, host_is_src=False)
        assert runs.count == runs_per_block and int(runs.size.sum()) == t.block_bytes
        assert runs.slot_bytes % SLOT_ALIGN == 0 and runs.slot_bytes >= t.block_bytes
        # Every piece has its own place in the slot, in host address order.
        order = np.argsort(t.dst_base)
        assert np.array_equal(runs.piece_rel[order], np.cumsum(t.sizes[order]) - t.sizes[order])
        mover.close()


def test_a_mover_stages_only_a_host_side_of_long_runs(link_calls):
    kb = MIN_RUN_BYTES // 1024
    device = [torch.empty(2, 8, kb // 4, 8, 64, dtype=torch.float16) for _ in range(2)]  # K or V: MIN_RUN / 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kvswap.NumaWarning)
        cache = kvswap.host_cache(device, 8, block_dim=1)
    per_layer = [torch.empty_like(t) for t in device]
    policy = Policy()
    for host, staged in ((list(cache.views), True), (per_layer, False)):
        mover = BlockMover(device, host, "d2h", block_dim=1, issuing_thread=False)
        fn = kvswap.resolve("d2h", device="cpu", block_bytes=mover._plan.templates[0].chunk_sizes)
        steps, note = staged_choice(fn, mover._plan.templates[0], Direction.D2H, policy, dict(device="cpu"))
        assert (steps is not None) == staged
        assert note.startswith("staged: triton.staged moves each block as 1 host run") if staged else \
            "a block-major host cache (kvswap.host_cache) holds each block as one run" in note
        mover.close()
    off = Policy(staging_bytes=0)
    fn = kvswap.resolve("d2h", device="cpu", policy=off)
    mover = BlockMover(device, list(cache.views), "d2h", block_dim=1, issuing_thread=False)
    steps, note = staged_choice(fn, mover._plan.templates[0], Direction.D2H, off, dict(device="cpu"))
    assert steps is None and "Policy.staging_bytes=0" in note
    mover.close()


def test_staged_routes_never_take_raw_batches_unless_forced(link_calls):
    swap = kvswap.resolve("h2d", device="cpu", block_bytes=[1 << 20])
    assert {r.impl for r in swap.plan.routes} == {"host.reference"}
    assert [c.kind for c in swap.plan.candidates if c.name == "triton.staged"] == ["staged"]


def test_a_staged_impl_without_a_batch_route_is_unavailable_with_the_reason():
    install_staged_on_cpu()
    # No batch route copies d2d here: the staged route (h2d, d2h) is bound for neither.
    with pytest.raises(kvswap.ResolutionError, match="staging_bytes=0 allows no staged routes"):
        kvswap.resolve("h2d", device="cpu", policy=Policy(force="triton.staged", staging_bytes=0))
    from kvswap.resolution.resolver import _link_for

    assert _link_for([], {}, frozenset(), Policy())[1] == (
        "needs a batch route of this direction for the link, and none is usable here")


def test_policy_staging_bytes_is_checked():
    with pytest.raises(kvswap.ConfigurationError, match="Policy.staging_bytes=-1 must be a whole number >= 0"):
        Policy(staging_bytes=-1)
    assert Policy(staging_bytes=np.int64(1 << 20)).staging_bytes == 1 << 20
