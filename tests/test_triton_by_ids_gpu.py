"""The by-id kernel copy on a GPU: every mover layout, both directions, ids read from
pinned memory and uploaded, the copy ordered on the stream it was given.

Host tensors are pinned; every check compares whole allocations (guards included) with a
reference computed by torch indexing on host copies, on random data.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from kvswap.addressing.regions import pair_regions
from mover_layouts import Pool, expected_after, layouts

pytestmark = pytest.mark.gpu

LAYOUTS = layouts(bs=16, heads=2, head_dim=64, layers=4)
SPIN = 200_000_000


def _pair(name, direction, seed, src_blocks=300, dst_blocks=400):
    gen = torch.Generator().manual_seed(seed)
    h2d = direction == "h2d"
    src = Pool(LAYOUTS[name], src_blocks, gen, device="cpu" if h2d else "cuda", pinned=h2d)
    dst = Pool(LAYOUTS[name], dst_blocks, gen, device="cuda" if h2d else "cpu", pinned=not h2d)
    return src, dst


def _bound(src, dst, direction, num_sms=8):
    from kvswap.backends.triton_generic.by_ids import KernelCopyByIds
    from kvswap.backends.triton_generic.launch import DEFAULT_PLANS

    copy = KernelCopyByIds(num_sms, torch.cuda.current_device(), tiles=DEFAULT_PLANS[direction])
    fn = copy.by_ids(pair_regions(src.tensors, dst.tensors, src.layout.block_dim))
    assert fn is not None
    return fn


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_both_directions(name, direction):
    rng = np.random.default_rng(zlib.crc32(f"{name}/{direction}".encode()))
    src, dst = _pair(name, direction, seed=1)
    fn = _bound(src, dst, direction)
    before, src_before = dst.snapshot(), src.snapshot()
    stream = torch.cuda.Stream()
    jobs, where = [], set()
    for n in (1, 7, 64, 300):
        sid = rng.integers(0, src.num_blocks, n).astype(np.int64)
        did = rng.permutation(dst.num_blocks)[:n].astype(np.int64)
        where.add(fn(sid, did, stream).ids)
        jobs.append((sid, did))
    stream.synchronize()
    assert where <= {"host", "device"}
    assert dst.matches(expected_after(dst, before, src_before, src, jobs))
    assert src.matches(src_before)


def test_device_to_device_uploads_the_ids_and_copies_every_piece():
    """The staged route's device side (the d2d plan on 32 programs): its ids are uploaded
    first however short the batch, and its given piece size copies every byte."""
    rng = np.random.default_rng(8)
    gen = torch.Generator().manual_seed(8)
    src, dst = (Pool(LAYOUTS["flash"], nb, gen, device="cuda") for nb in (300, 400))
    fn = _bound(src, dst, "d2d", num_sms=32)
    assert fn.each > 0
    before, src_before = dst.snapshot(), src.snapshot()
    jobs = []
    for n in (1, 5, 300):
        sid = rng.integers(0, src.num_blocks, n).astype(np.int64)
        did = rng.permutation(dst.num_blocks)[:n].astype(np.int64)
        assert fn(sid, did, torch.cuda.current_stream()).ids == "device"
        jobs.append((sid, did))
    torch.cuda.synchronize()
    assert dst.matches(expected_after(dst, before, src_before, src, jobs))
    assert src.matches(src_before)


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_ordered_on_the_stream_both_ways(direction):
    """Work queued before the launch (a fill of the destinations) lands first; work queued
    after it (a snapshot of the destinations) sees the copied bytes."""
    rng = np.random.default_rng(3)
    src, dst = _pair("flash", direction, seed=2, src_blocks=2048, dst_blocks=2048)
    fn = _bound(src, dst, direction, num_sms=4)
    src_before = src.snapshot()
    stream = torch.cuda.Stream()
    sid = rng.integers(0, 2048, 2000).astype(np.int64)
    did = rng.permutation(2048)[:2000].astype(np.int64)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SPIN)
        for f in dst.flats:
            f.fill_(0xA5)
    assert fn.launch_only(2000)  # the upload is a kernel launched directly, no stream switch
    launch = fn(sid, did, stream)
    assert launch.ids == "device"  # a long batch: ids uploaded first
    with torch.cuda.stream(stream):
        snaps = [f.to("cuda", non_blocking=True) if not f.is_cuda else f.clone() for f in dst.flats]
    stream.synchronize()
    poisoned = [torch.full_like(f.cpu(), 0xA5) for f in dst.flats]
    want = expected_after(dst, poisoned, src_before, src, [(sid, did)])
    for snap, w in zip(snaps, want):
        assert torch.equal(snap.cpu(), w)
    assert dst.matches(want)


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_block_mover_on_the_kernel_route_sends_only_ids(direction):
    """Through BlockMover: the by-id path is bound at construction and taken by submit;
    a fill of the destinations queued on the compute stream before submit lands first."""
    from kvswap import BlockMover, Policy

    rng = np.random.default_rng(4)
    src, dst = _pair("flash", direction, seed=3, src_blocks=1024, dst_blocks=1024)
    src_before = src.snapshot()
    with BlockMover(src.tensors, dst.tensors, direction, block_dim=1, policy=Policy(force="triton.kernel"), device_descriptors=True) as mover:
        assert mover.id_route(1) == "triton.kernel" and all(f is not None for f in mover._plan.ids.fns)
        sid = rng.integers(0, 1024, 700).astype(np.int64)
        did = rng.permutation(1024)[:700].astype(np.int64)
        torch.cuda._sleep(SPIN)  # the compute stream is busy
        for f in dst.flats:
            f.fill_(0x3C)  # (on the host for d2h: done at once)
        job = mover.submit(sid, did)
        mover.wait(job)
        (r,) = mover.poll()
    assert r.ok and r.descriptors == 700 * mover.chunks_per_block
    poisoned = [torch.full_like(f.cpu(), 0x3C) for f in dst.flats]
    assert dst.matches(expected_after(dst, poisoned, src_before, src, [(sid, did)]))



def test_each_call_on_the_stream_it_names():
    """The launch arguments are resolved when the ids are staged and the stream's handle
    is remembered between calls: calls alternating between two streams, a raw handle and
    the current stream each land after a fill of the destinations queued (behind a spin)
    on the stream they name, and before a snapshot queued after them."""
    rng = np.random.default_rng(5)
    src, dst = _pair("flash", "h2d", seed=4, src_blocks=2048, dst_blocks=2048)
    fn = _bound(src, dst, "h2d", num_sms=16)  # 16 programs: ids read from pinned memory
    src_before = src.snapshot()
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    current = torch.cuda.current_stream()
    calls = [(a, a), (b, b), (a.cuda_stream, a), (None, current), (b, b), (a, a)]
    for i, (given, on) in enumerate(calls):
        fill = 0x11 * (i + 1)
        with torch.cuda.stream(on):
            torch.cuda._sleep(SPIN // 4)  # a copy on any other stream would land before the fill
            for f in dst.flats:
                f.fill_(fill)
        sid = rng.integers(0, 2048, 300).astype(np.int64)
        did = rng.permutation(2048)[:300].astype(np.int64)
        assert fn(sid, did, given).ids == "host"
        with torch.cuda.stream(on):  # queued behind the copy: sees its bytes
            snaps = [f.clone() for f in dst.flats]
        on.synchronize()
        poisoned = [torch.full_like(f.cpu(), fill) for f in dst.flats]
        want = expected_after(dst, poisoned, src_before, src, [(sid, did)])
        assert all(torch.equal(s.cpu(), w) for s, w in zip(snaps, want)), f"call {i}"
        assert dst.matches(want), f"call {i}"


@pytest.mark.parametrize("n", [8, 2000], ids=["ids-from-host", "ids-uploaded"])
def test_launch_hook_sees_the_by_id_launches(n):
    """With a profiler's launch hook set (Triton's knobs), a by-id call launches with
    Triton's metadata, the hook sees the copy kernel, and the bytes are right."""
    knobs = pytest.importorskip("triton.knobs")
    chain = knobs.runtime.launch_enter_hook
    if not hasattr(chain, "add"):
        pytest.skip("this Triton keeps one launch hook, not a chain")
    rng = np.random.default_rng(6)
    src, dst = _pair("flash", "h2d", seed=5, src_blocks=2048, dst_blocks=2048)
    fn = _bound(src, dst, "h2d", num_sms=4)
    src_before, before = src.snapshot(), dst.snapshot()
    sid = rng.integers(0, 2048, n).astype(np.int64)
    did = rng.permutation(2048)[:n].astype(np.int64)
    seen = []
    hook = seen.append
    chain.add(hook)
    try:
        launch = fn(sid, did, torch.cuda.current_stream())
    finally:
        chain.remove(hook)
    torch.cuda.synchronize()
    assert launch.ids == ("host" if n == 8 else "device")
    assert [h.get()["name"] for h in seen] == ["copy_by_ids_kernel"]
    assert dst.matches(expected_after(dst, before, src_before, src, [(sid, did)]))
