"""BlockMover on the host: host tensors on both sides, the host reference copying.

Every check compares whole allocations (guard bytes included) with a reference computed
by torch indexing, on random data.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
import torch

import kvswap
from kvswap import BlockMover, CopyImpl, Direction, InvalidTransferError, Policy, TransferResult, hookimpl
from kvswap.errors import (
    BlockIdError,
    BlockLayoutError,
    MoverClosedError,
    TensorPlacementError,
    UnpinnedMemoryError,
)
from kvswap.mover.inputs import SMALL_IDS
from kvswap.registry.plugins import create_plugin_host, reset_plugin_host
from kvswap.addressing.regions import block_regions
from fakes import DeferredStream
from mover_layouts import Pool, expected_after, layouts, pool_pair, random_ids

LAYOUTS = layouts()


def _pools(name: str, seed: int, src_blocks: int = 40, dst_blocks: int = 56) -> tuple[Pool, Pool]:
    return pool_pair(LAYOUTS[name], seed, src_blocks, dst_blocks)



# -- layouts -----------------------------------------------------------------------------
def test_flash_layout_is_two_chunks_per_block():
    t = torch.empty(2, 10, 4, 2, 16, dtype=torch.bfloat16)
    r = block_regions(t, 1, "t")
    chunk = 4 * 2 * 16 * 2
    assert (r.num_blocks, r.stride, r.chunk_bytes, r.offsets) == (10, chunk, chunk, (0, 10 * chunk))
    assert r.base == t.data_ptr()


@pytest.mark.parametrize("name, chunks", [("mla", 1), ("cross", 1), ("cross_views", 1)])
def test_contiguous_blocks_are_one_chunk(name, chunks):
    src, _ = _pools(name, 0)
    for t in src.tensors:
        assert len(block_regions(t, src.layout.block_dim, "t").offsets) == chunks


def test_strided_block_is_refused_with_the_reason():
    t = torch.empty(8, 32, dtype=torch.float32)
    with pytest.raises(BlockLayoutError, match="innermost dimension of a block .* stride 32, not 1"):
        BlockMover([t], [torch.empty(8, 32)], "h2d", block_dim=1)


def test_overlapping_elements_are_refused():
    t = torch.empty(1, 4, 16).expand(6, 4, 16)
    with pytest.raises(BlockLayoutError, match="share memory"):
        BlockMover([t], [torch.empty(6, 4, 16)], "d2h")


# -- random transfers over each layout ---------------------------------------------------
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_random_transfers_match_torch_indexing(name, direction):
    rng = np.random.default_rng(7)
    src, dst = _pools(name, 1)
    before, src_before = dst.snapshot(), src.snapshot()
    jobs = []
    with BlockMover(src.tensors, dst.tensors, direction, block_dim=src.layout.block_dim) as mover:
        assert {r.impl for r in mover.swap_fn.plan.routes} == {"host.reference"}
        ids = []
        for n in (1, 5, 17, 40, 0, 9):
            sid, did = random_ids(rng, n, src, dst)
            ids.append(mover.submit(sid, did))
            jobs.append((sid, did))
        results = mover.poll()
    assert [r.job_id for r in results] == ids == sorted(ids)
    for r, (sid, _) in zip(results, jobs):
        assert r.ok and r.error is None and r.seconds >= 0
        assert r.bytes == len(sid) * mover.block_bytes
    assert dst.matches(expected_after(dst, before, src_before, src, jobs))
    assert src.matches(src_before)


def test_ids_as_lists_numpy_and_cpu_tensors_agree():
    rng = np.random.default_rng(3)
    src, dst = _pools("flash", 2)
    before, src_before = dst.snapshot(), src.snapshot()
    sid, did = random_ids(rng, 12, src, dst)
    forms = [(sid.tolist(), did.tolist()), (sid.astype(np.uint32), did.astype(np.int16)),
             (torch.from_numpy(sid), torch.from_numpy(did).to(torch.int32))]
    mover = BlockMover(src.tensors, dst.tensors, "h2d", block_dim=1)
    for s, d in forms:
        got = mover.descriptors(s, d)
        for a, b in zip(got, mover.descriptors(sid, did)):
            np.testing.assert_array_equal(a, b)
        mover.submit(s, d)
    mover.close()
    assert dst.matches(expected_after(dst, before, src_before, src, [(sid, did)] * 3))


def test_block_dim_pair_for_differently_shaped_sides():
    """A raw byte pool on the host, blocks on dim 0 of a (num_blocks, 2, bytes) view, beside
    FlashAttention tensors with blocks on dim 1: same chunks, different shape, dtype and count."""
    gen = torch.Generator().manual_seed(5)
    src = Pool(LAYOUTS["flash"], 30, gen)
    chunk = src.tensors[0][0, 0].numel() * 2
    pools = [torch.randint(0, 256, (2, 45, chunk), dtype=torch.uint8, generator=gen) for _ in src.tensors]
    host = [p.transpose(0, 1) for p in pools]
    ref = [p.clone().transpose(0, 1) for p in pools]
    sid, did = np.array([3, 29, 0, 11]), np.array([44, 2, 17, 30])
    with BlockMover(src.tensors, host, "d2h", block_dim=(1, 0)) as mover:
        assert mover.chunks_per_block == 2 * len(src.tensors)
        mover.submit(sid, did)
    for h, r, s in zip(host, ref, src.tensors):
        blocks = s[:, torch.as_tensor(sid)].contiguous().view(torch.uint8).reshape(2, len(sid), chunk)
        r[torch.as_tensor(did)] = blocks.transpose(0, 1)
        assert torch.equal(h, r)


# -- coalescing --------------------------------------------------------------------------
def test_contiguous_runs_coalesce_into_fewer_descriptors_with_the_same_bytes():
    src, dst = _pools("flash", 4)
    before, src_before = dst.snapshot(), src.snapshot()
    pieces = len(src.tensors) * 2
    scattered = (np.array([5, 1, 9, 3, 7]), np.array([50, 40, 30, 20, 10]))
    runs = (np.r_[10:18, 30:33], np.r_[3:11, 20:23])   # two runs, contiguous on both sides
    one_sided = (np.r_[0:6], np.array([9, 7, 5, 3, 1, 11]))  # contiguous only on the source side
    mover = BlockMover(src.tensors, dst.tensors, "h2d", block_dim=1)
    counts = {}
    for key, (sid, did) in {"scattered": scattered, "runs": runs, "one_sided": one_sided}.items():
        s, d, n = mover.descriptors(sid, did)
        assert n.sum() == len(sid) * mover.block_bytes
        counts[key] = len(n)
        mover.submit(sid, did)
    results = mover.poll()
    assert counts == {"scattered": 5 * pieces, "runs": 2 * pieces, "one_sided": 6 * pieces}
    assert [r.descriptors for r in results] == [5 * pieces, 2 * pieces, 6 * pieces]
    assert [r.bytes for r in results] == [k * mover.block_bytes for k in (5, 11, 6)]
    assert dst.matches(expected_after(dst, before, src_before, src, [scattered, runs, one_sided]))


@pytest.mark.parametrize("name", ["cross", "cross_views"])
def test_cross_layer_block_is_one_descriptor(name):
    """Every layer of a block is adjacent in a cross-layer layout: one descriptor per block
    (and per run of consecutive blocks), whether the mover gets the whole tensor or each
    layer's FlashAttention-shaped view of it."""
    src, dst = _pools(name, 6)
    before, src_before = dst.snapshot(), src.snapshot()
    mover = BlockMover(src.tensors, dst.tensors, "d2h", block_dim=src.layout.block_dim)
    scattered = (np.array([4, 0, 21, 9]), np.array([1, 50, 3, 33]))
    runs = (np.r_[12:20], np.r_[40:48])
    assert len(mover.descriptors(*scattered)[2]) == 4
    assert len(mover.descriptors(*runs)[2]) == 1
    mover.submit(*scattered)
    mover.submit(*runs)
    mover.close()
    assert [r.descriptors for r in mover.poll()] == [4, 1]
    assert dst.matches(expected_after(dst, before, src_before, src, [scattered, runs]))


# -- many jobs in flight -----------------------------------------------------------------
def _install(name: str, fn_factory: Callable, **impl_kw: Any) -> None:
    class Plugin:
        @hookimpl
        def kvswap_register_copy_impls(self, platform, register):
            if platform == "cpu":
                register(CopyImpl(name=name, kind="batch", platforms=("cpu",),
                                  directions=(Direction.H2D, Direction.D2H), factory=fn_factory, **impl_kw))

    reset_plugin_host(create_plugin_host(entry_points=[], env={}, extra=[("testplugin", Plugin())]))


def test_many_jobs_in_flight_keep_their_buffers_until_complete():
    stream = DeferredStream()
    _install("test.deferred", lambda ctx: stream.enqueue)
    rng = np.random.default_rng(11)
    src, dst = _pools("flash", 8, src_blocks=64, dst_blocks=80)
    before, src_before = dst.snapshot(), src.snapshot()
    mover = BlockMover(src.tensors, dst.tensors, "h2d", block_dim=1, policy=Policy(force="test.deferred"))
    mover._plan.completion = stream
    jobs = []

    def submit(k: int) -> list[int]:
        out = []
        for _ in range(k):
            sid, did = random_ids(rng, int(rng.integers(1, 9)), src, dst)
            out.append(mover.submit(sid, did))
            jobs.append((sid, did))
        return out

    first = submit(80)
    assert (mover.in_flight, mover.pool.in_use, mover.pool.allocated) == (80, 80, 80)
    assert mover.poll() == [] and dst.matches(before)   # nothing ran yet
    stream.run(30)
    done = mover.poll()
    assert [r.job_id for r in done] == first[:30] and all(r.ok for r in done)
    assert mover.pool.in_use == 50
    second = submit(40)                                  # reuses the 30 buffers handed back
    assert (mover.pool.allocated, mover.pool.in_use) == (90, 90)
    mover.wait(second[4])
    assert [r.job_id for r in mover.poll()] == first[30:] + second[:5]
    mover.close()
    assert [r.job_id for r in mover.poll()] == second[5:]
    assert (mover.pool.in_use, mover.pool.allocated) == (0, 90)
    assert dst.matches(expected_after(dst, before, src_before, src, jobs))


# -- bad input: a specific error, before any byte moves ----------------------------------
@pytest.fixture
def flash_mover():
    src, dst = _pools("flash", 9)
    mover = BlockMover(src.tensors, dst.tensors, "h2d", block_dim=1)
    yield mover, src, dst
    mover.close()


BAD_IDS = {
    "src out of range": ([1, 40], [0, 1], "src_block_ids\\[1\\]=40 is out of range.*40 blocks"),
    "dst out of range": ([1, 2], [0, 56], "dst_block_ids\\[1\\]=56 is out of range.*56 blocks"),
    "src negative": ([-1, 2], [0, 1], "src_block_ids\\[0\\]=-1 is out of range"),
    "dst negative": ([1, 2], [3, -7], "dst_block_ids\\[1\\]=-7 is out of range"),
    "length mismatch": ([1, 2, 3], [4, 5], "3 ids but dst_block_ids has 2"),
    "float ids": ([1.0, 2.0], [4, 5], "must hold integers"),
    "float tensor": (torch.tensor([1.5]), [4], "must hold integers"),
    "bool tensor": (torch.tensor([True]), [4], "must hold integers"),
    "string ids": (["a"], [4], "must hold integers"),
    "2-d ids": (np.array([[1, 2]]), [4, 5], "must be 1-D"),
    "duplicate dst": ([1, 2, 3], [7, 9, 7], "dst_block_ids\\[0\\] and dst_block_ids\\[2\\] are both 7"),
}


@pytest.mark.parametrize("case", list(BAD_IDS))
def test_bad_ids_raise_before_any_byte_moves(flash_mover, case):
    mover, src, dst = flash_mover
    sid, did, message = BAD_IDS[case]
    before = dst.snapshot()
    with pytest.raises(BlockIdError, match=message) as err:
        mover.submit(sid, did)
    assert isinstance(err.value, ValueError) and isinstance(err.value, InvalidTransferError)
    assert dst.matches(before) and mover.in_flight == 0 and mover.poll() == []
    with pytest.raises(BlockIdError):
        mover.descriptors(sid, did)
    job = mover.submit([0, 39], [55, 0])                 # still usable afterwards
    assert [r.job_id for r in mover.poll()] == [job]


def test_submit_after_close(flash_mover):
    mover, _, dst = flash_mover
    mover.close()
    before = dst.snapshot()
    with pytest.raises(MoverClosedError, match="after close"):
        mover.submit([1], [2])
    assert isinstance(MoverClosedError("x"), ValueError) and dst.matches(before)
    mover.close()  # idempotent


def test_context_manager_closes(flash_mover):
    _, src, dst = flash_mover
    with BlockMover(src.tensors, dst.tensors, "h2d", block_dim=1) as mover:
        mover.submit([1], [1])
    assert mover.closed and len(mover.poll()) == 1
    with pytest.raises(MoverClosedError):
        mover.submit([2], [2])


def test_wait_on_an_unknown_job(flash_mover):
    mover, _, _ = flash_mover
    job = mover.submit([1], [2])
    mover.wait(job)
    mover.wait(job)  # already complete: returns
    for bad in (0, job + 1, -3, "1", True):
        with pytest.raises(InvalidTransferError, match="was not returned"):
            mover.wait(bad)


def _bad_construction(make: Callable[[], Any], error: type, message: str) -> None:
    with pytest.raises(error, match=message) as err:
        make()
    assert isinstance(err.value, ValueError)


def test_bad_tensors_are_refused_at_construction():
    src, dst = _pools("flash", 10)
    before = dst.snapshot()
    s, d = src.tensors, dst.tensors
    other = _pools("flash", 10, src_blocks=40, dst_blocks=33)[1].tensors
    mla = _pools("mla", 10)[1].tensors
    cases = [
        (lambda: BlockMover(s, d[:2], "h2d", block_dim=1), BlockLayoutError, "3 tensor.* dst_tensors has 2"),
        (lambda: BlockMover([], [], "h2d"), BlockLayoutError, "empty"),
        (lambda: BlockMover(s, [x.view(torch.int16).numpy() for x in d], "h2d", block_dim=1), BlockLayoutError, "not a torch.Tensor"),
        (lambda: BlockMover(s, d, "h2d", block_dim=5), BlockLayoutError, "block_dim=5 is out of range"),
        (lambda: BlockMover(s, d, "h2d", block_dim=True), BlockLayoutError, "block_dim=True"),
        (lambda: BlockMover(s, [x[..., :8] for x in d], "h2d", block_dim=1), BlockLayoutError,
         "2 chunk\\(s\\) of 256 bytes but a dst block is 16 chunk\\(s\\) of 16 bytes; the blocks must hold the same"),
        (lambda: BlockMover(s[:1], [mla[0].view(torch.bfloat16)], "h2d", block_dim=(1, 0)), BlockLayoutError,
         "1 chunk\\(s\\) of 576 bytes; the blocks must hold the same elements"),
        (lambda: BlockMover(s, [x.view(torch.float16) for x in d], "h2d", block_dim=1), BlockLayoutError,
         "is torch.bfloat16 but dst_tensors\\[0\\] is torch.float16"),
        (lambda: BlockMover(s, [d[0], d[1], d[0]], "h2d", block_dim=1), BlockLayoutError,
         "dst_tensors\\[0\\] and dst_tensors\\[2\\] share memory"),
        (lambda: BlockMover(s, [d[0], other[1], d[2]], "h2d", block_dim=1), BlockLayoutError,
         "dst tensors hold different numbers of blocks \\(\\[33, 56\\]\\)"),
        (lambda: BlockMover(s, [x.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4) for x in d], "h2d",
                            block_dim=1), BlockLayoutError, "different orders"),
        (lambda: BlockMover(s, d, "sideways", block_dim=1), kvswap.ConfigurationError, "direction='sideways'"),
    ]
    for make, error, message in cases:
        _bad_construction(make, error, message)
    assert dst.matches(before)


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_tensors_on_the_wrong_device_for_the_direction(direction):
    src, dst = _pools("mla", 12)
    before = dst.snapshot()
    meta = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in src.tensors]
    host_side = "src" if direction == "h2d" else "dst"
    make_host_meta = (lambda: BlockMover(meta, dst.tensors, direction)) if direction == "h2d" else \
        (lambda: BlockMover(src.tensors, meta[:len(dst.tensors)], direction))
    _bad_construction(make_host_meta, TensorPlacementError,
                      f"{host_side}_tensors\\[0\\] is on meta, but for direction {direction} .* must be host")
    mixed = [dst.tensors[0], torch.empty(dst.tensors[1].shape, dtype=dst.tensors[1].dtype, device="meta"),
             *dst.tensors[2:]]
    device_side = "dst" if direction == "h2d" else "src"
    pair = (src.tensors, mixed) if direction == "h2d" else (mixed, src.tensors)
    _bad_construction(lambda: BlockMover(*pair, direction), TensorPlacementError,
                      f"{device_side}_tensors are on \\['cpu', 'meta'\\]; a mover serves one device")
    assert dst.matches(before)


def test_pageable_host_memory_refused_where_the_route_needs_pinned_and_the_policy_is_strict():
    copied = []
    _install("test.pinned", lambda ctx: lambda s, d, n, stream: copied.append(len(n)), requires_pinned=True)
    src, dst = _pools("flash", 13)
    before = dst.snapshot()
    strict = Policy(force="test.pinned", require_pinned=True)
    for direction, side in (("h2d", "src"), ("d2h", "dst")):
        _bad_construction(
            lambda: BlockMover(src.tensors, dst.tensors, direction, block_dim=1, policy=strict),
            UnpinnedMemoryError, f"{side}_tensors\\[0\\] is pageable host memory, but the route\\(s\\) test.pinned "
                                 f"need pinned")
    assert copied == [] and dst.matches(before)


def test_a_failing_route_reports_a_failed_job_and_keeps_its_buffer():
    def boom(ctx):
        def fn(src, dst, sizes, stream):
            raise kvswap.DriverError("cuFake", 700, "CUDA_ERROR_ILLEGAL_ADDRESS")
        return fn

    _install("test.boom", boom)
    src, dst = _pools("mla", 14)
    mover = BlockMover(src.tensors, dst.tensors, "h2d", policy=Policy(force="test.boom"))
    with pytest.raises(kvswap.DriverError):
        mover.submit([1, 2], [3, 4])
    (r,) = mover.poll()
    assert isinstance(r, TransferResult) and not r.ok and r.bytes == 0 and "CUDA_ERROR_ILLEGAL_ADDRESS" in r.error
    assert mover.pool.in_use == 0


def test_a_submit_validates_its_batch_once(monkeypatch):
    """BlockMover checks ids against a checked template; the SwapFn does not check the
    descriptors it built a second time (the whole-batch check is O(n log n))."""
    import kvswap.resolution.swapfn

    calls = []
    real = kvswap.resolution.swapfn.validate
    monkeypatch.setattr(kvswap.resolution.swapfn, "validate", lambda *a: calls.append(1) or real(*a))
    src = torch.randn(16, 4, 32)
    dst = torch.zeros(16, 4, 32)
    with BlockMover(src, dst, "h2d") as mover:
        mover.submit([3, 1, 7], [0, 9, 4])
    assert calls == []
    assert torch.equal(dst[[0, 9, 4]], src[[3, 1, 7]])
    assert not dst[[i for i in range(16) if i not in (0, 9, 4)]].any()


@pytest.mark.parametrize("sort", [False, True])
@pytest.mark.parametrize("n", [2, SMALL_IDS, SMALL_IDS + 1, 600])
def test_id_checks_agree_on_both_sides_of_the_small_batch_path(n, sort, monkeypatch):
    # Up to SMALL_IDS ids are checked with Python's builtins, beyond with numpy (repeats by
    # a bitmap of the destination blocks, or by sorting for pools large against the ids):
    # the same verdicts and messages, and nothing copied on a refusal.
    if sort:
        monkeypatch.setattr(kvswap.mover.inputs, "BITMAP_BLOCKS_PER_ID", 0)
    rng = np.random.default_rng(n)
    src = torch.from_numpy(rng.integers(0, 256, (700, 48), dtype=np.uint8))
    dst = torch.full((650, 48), 0xA5, dtype=torch.uint8)
    with BlockMover(src, dst, "h2d") as mover:
        sid = rng.choice(700, n, replace=False).astype(np.int64)
        did = rng.choice(650, n, replace=False).astype(np.int64)
        i, j = sorted(rng.choice(n, 2, replace=False).tolist())
        bad = {
            f"src_block_ids\\[{j}\\]=700 is out of range": (np.where(np.arange(n) == j, 700, sid), did),
            f"dst_block_ids\\[{i}\\]=-3 is out of range": (sid, np.where(np.arange(n) == i, -3, did)),
            f"dst_block_ids\\[{i}\\] and dst_block_ids\\[{j}\\] are both {did[i]}":
                (sid, np.where(np.arange(n) == j, did[i], did)),
        }
        for message, (s, d) in bad.items():
            with pytest.raises(BlockIdError, match=message):
                mover.submit(s, d)
        assert (dst == 0xA5).all() and mover.in_flight == 0
        mover.submit(sid, did)
        mover.wait()
    expected = torch.full_like(dst, 0xA5)
    expected[torch.from_numpy(did)] = src[torch.from_numpy(sid)]
    assert torch.equal(dst, expected)


@pytest.mark.parametrize("threaded", [False, True])
def test_narrow_integer_id_arrays_copy_as_int64_ones_do_and_are_checked_alike(threaded):
    """vLLM passes int32 arrays: they are widened once, strided or not, and checked as
    int64 ids are (out of range and negative ids refused before anything moves)."""
    rng = np.random.default_rng()
    src, dst = _pools("flash", int(rng.integers(1 << 30)))
    before, src_before = dst.snapshot(), src.snapshot()
    sid, did = random_ids(rng, 24, src, dst)
    with BlockMover(src.tensors, dst.tensors, "h2d", block_dim=1, issuing_thread=threaded) as mover:
        strided = np.empty(48, dtype=np.int32)
        strided[::2] = did
        mover.submit(sid.astype(np.int32), strided[::2])
        for bad in (np.array([0, -1], dtype=np.int32), np.array([0, src.num_blocks], dtype=np.int32)):
            with pytest.raises(BlockIdError, match=r"src_block_ids\[1\]"):
                mover.submit(bad, np.array([0, 1], dtype=np.int32))
        mover.wait()
        assert all(r.ok for r in mover.poll())
    assert dst.matches(expected_after(dst, before, src_before, src, [(sid, did)]))


def test_a_jobs_descriptors_go_to_the_route_as_built_without_a_second_look_for_runs(monkeypatch):
    """The mover merges a job's runs when it builds the descriptors; its SwapFn does not
    look for runs again (it would find none)."""
    from kvswap.resolution.swapfn import SwapFn

    def never(*a, **k):
        raise AssertionError("a BlockMover job was looked at for runs twice")

    monkeypatch.setattr(SwapFn, "_merged", never)
    rng = np.random.default_rng()
    src, dst = _pools("cross", int(rng.integers(1 << 30)))
    before, src_before = dst.snapshot(), src.snapshot()
    sid = np.arange(10, 30, dtype=np.int64)  # consecutive: runs to merge
    did = np.arange(5, 25, dtype=np.int64)
    with BlockMover(src.tensors, dst.tensors, "h2d", block_dim=0, policy=Policy(coalesce=True)) as mover:
        mover.submit(sid, did)
        (r,) = mover.poll()
    assert r.ok and r.descriptors < 20 * mover.chunks_per_block
    assert dst.matches(expected_after(dst, before, src_before, src, [(sid, did)]))
