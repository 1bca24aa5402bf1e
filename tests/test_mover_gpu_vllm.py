"""BlockMover on a GPU in the shapes vLLM's offloading path uses: host blocks k times the
device blocks with padded rows, FlashAttention, MLA and FlashInfer caches in one mover,
several KV groups, pinned and pageable host memory, d2d, and what a job waits for.

Random data, poisoned destinations; whole allocations (padding and guards included) are
compared with a reference copied by torch indexing on host copies.
"""
from __future__ import annotations

import warnings
import zlib

import numpy as np
import pytest
import torch

from kvswap import BlockMover, KVGroup, PageableMemoryWarning, Policy
from mover_shapes import KINDS, Side, expected_after

pytestmark = pytest.mark.gpu

ROUTES = [None, "triton.kernel", "cuda.batch"]
MIXED = [KINDS["flash"], KINDS["mla"], KINDS["flashinfer"]]
TOKENS = 16
# torch.cuda._sleep spins this many GPU clock cycles: ~0.5-1 s at 1-2 GHz, far longer than
# the host needs to queue the work that follows it.
SPIN = 1_000_000_000


def _mover(*args, pinned: bool, **kw) -> BlockMover:
    if pinned:
        with warnings.catch_warnings():
            warnings.simplefilter("error", PageableMemoryWarning)
            mover = BlockMover(*args, **kw)
        assert not mover.bounces_host_memory
        return mover
    with pytest.warns(PageableMemoryWarning):
        mover = BlockMover(*args, **kw)
    assert mover.bounces_host_memory
    return mover


def _jobs(rng: np.random.Generator, mover: BlockMover) -> list[tuple[np.ndarray, np.ndarray]]:
    jobs = [(rng.choice(mover.num_src_blocks, n, replace=False), rng.choice(mover.num_dst_blocks, n, replace=False))
            for n in (1, 9, 40, 96)]
    jobs.append((np.arange(6, 30), np.arange(33, 57)))  # runs of sub-blocks that coalesce
    return jobs


def _check(mover: BlockMover, jobs, results) -> None:
    assert [r.bytes for r in results] == [len(s) * mover.block_bytes for s, _ in jobs]
    assert all(r.ok for r in results), results


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r or "default")
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_factor_three_padded_rows_and_mixed_layouts(direction, route, pinned):
    seed = zlib.crc32(f"{direction}/{route}/{pinned}".encode())
    gen, rng = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
    host = Side(MIXED, 40, 3 * TOKENS, gen, pad=256, pinned=pinned)
    device = Side(MIXED, 128, TOKENS, gen, device="cuda")
    src, dst = (host, device) if direction == "h2d" else (device, host)
    before, src_before = dst.snapshot(), src.snapshot()
    policy = Policy(force=route) if route else None
    mover = _mover(src.tensors, dst.tensors, direction, block_dim=[1, 0, 0], policy=policy, pinned=pinned)
    assert mover.block_size_factor == 3
    jobs = _jobs(rng, mover)
    for sid, did in jobs:
        mover.submit(sid, did)
    mover.close()
    _check(mover, jobs, mover.poll())
    assert dst.matches(expected_after(src, src_before, dst, before, jobs))
    assert src.matches(src_before)


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_kv_groups_in_one_job(direction, pinned):
    gen, rng = torch.Generator().manual_seed(61), np.random.default_rng(61)
    pairs = [  # (device side, host side, block_dim): full attention with host blocks 2x, MLA, FlashInfer
        (Side([KINDS["flash"]] * 4, 64, TOKENS, gen, device="cuda"),
         Side([KINDS["flash"]] * 4, 40, 2 * TOKENS, gen, pad=512, pinned=pinned), 1),
        (Side([KINDS["mla"]] * 2, 50, TOKENS, gen, device="cuda"), Side([KINDS["mla"]] * 2, 70, TOKENS, gen, pinned=pinned), 0),
        (Side([KINDS["flashinfer"]], 30, TOKENS, gen, device="cuda"),
         Side([KINDS["flashinfer"]], 45, TOKENS, gen, pinned=pinned), 0),
    ]
    sides = [(h, d, bd) if direction == "h2d" else (d, h, bd) for d, h, bd in pairs]
    befores = [(s.snapshot(), d.snapshot()) for s, d, _ in sides]
    groups = [KVGroup(s.tensors, d.tensors, bd) for s, d, bd in sides]
    if pinned:
        mover = BlockMover.groups(groups, direction)
    else:
        with pytest.warns(PageableMemoryWarning):
            mover = BlockMover.groups(groups, direction)
    per_group: list[list] = [[] for _ in sides]
    jobs = []
    for n in ((5, 0, 3), (30, 20, 10)):
        sids = [rng.choice(g.num_src_blocks, k, replace=False) for g, k in zip(mover.layouts, n)]
        dids = [rng.choice(g.num_dst_blocks, k, replace=False) for g, k in zip(mover.layouts, n)]
        jobs.append(mover.submit(sids, dids))
        for g in range(3):
            per_group[g].append((sids[g], dids[g]))
    mover.close()
    results = mover.poll()
    assert [r.job_id for r in results] == jobs and all(r.ok for r in results)
    for (s, d, _), (s_before, d_before), g_jobs in zip(sides, befores, per_group):
        assert d.matches(expected_after(s, s_before, d, d_before, g_jobs))


@pytest.mark.parametrize("factor", [1, 2])
@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r or "default")
def test_d2d_on_each_route(route, factor):
    seed = zlib.crc32(f"d2d/{route}/{factor}".encode())
    gen, rng = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
    src = Side(MIXED, 100, TOKENS, gen, device="cuda")
    dst = Side(MIXED, 120 // factor, factor * TOKENS, gen, pad=128 if factor > 1 else 0, device="cuda")
    before, src_before = dst.snapshot(), src.snapshot()
    with BlockMover(src.tensors, dst.tensors, "d2d", block_dim=[1, 0, 0],
                    policy=Policy(force=route) if route else None) as mover:
        if route:
            assert mover.swap_fn.impls == (route,)
        jobs = _jobs(rng, mover)
        for sid, did in jobs:
            mover.submit(sid, did)
    _check(mover, jobs, mover.poll())
    assert dst.matches(expected_after(src, src_before, dst, before, jobs))


def _warm(mover: BlockMover, n: int) -> None:
    """Compile and load what a job of ``n`` ids runs, so a spin outlasts the next submit."""
    mover.submit(np.arange(n), np.arange(n))
    mover.wait()
    mover.poll()


def test_after_none_starts_while_the_compute_stream_still_runs():
    """A prefix load into free blocks: after=None, the copy does not wait for the spin
    queued on the current stream, and its bytes are right."""
    gen, rng = torch.Generator().manual_seed(62), np.random.default_rng(62)
    host, device = Side(MIXED, 60, TOKENS, gen, pinned=True), Side(MIXED, 60, TOKENS, gen, device="cuda")
    mover = BlockMover(host.tensors, device.tensors, "h2d", block_dim=[1, 0, 0])
    _warm(mover, 24)
    before, src_before = device.snapshot(), host.snapshot()
    sid, did = rng.choice(60, 24, replace=False), rng.choice(60, 24, replace=False)
    torch.cuda.synchronize()
    torch.cuda._sleep(4 * SPIN)
    spun = torch.cuda.Event()
    spun.record()
    job = mover.submit(sid, did, after=None)
    mover.wait(job)
    assert not spun.query()                 # done while the compute stream still spins
    torch.cuda.synchronize()
    assert device.matches(expected_after(host, src_before, device, before, [(sid, did)]))
    mover.close()


@pytest.mark.parametrize("wait_for", ["stream", "event"])
def test_after_a_stream_or_an_event(wait_for):
    """A side stream rewrites the device blocks behind a spin; an offload submitted
    with after=that stream (or an event recorded after the rewrite) copies the new bytes."""
    gen, rng = torch.Generator().manual_seed(63), np.random.default_rng(63)
    device, host = Side(MIXED, 50, TOKENS, gen, device="cuda"), Side(MIXED, 50, TOKENS, gen, pinned=True)
    mover = BlockMover(device.tensors, host.tensors, "d2h", block_dim=[1, 0, 0])
    _warm(mover, 20)
    before = host.snapshot()
    fresh = [torch.randint(0, 256, f.shape, dtype=torch.uint8, generator=gen).to("cuda") for f in device.flats]
    sid, did = rng.choice(50, 20, replace=False), rng.choice(50, 20, replace=False)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SPIN)
        for f, new in zip(device.flats, fresh):
            f.copy_(new)
        rewritten = torch.cuda.Event()
        rewritten.record()
    job = mover.submit(sid, did, after=side if wait_for == "stream" else rewritten)
    mover.wait(job)
    assert host.matches(expected_after(device, [n.cpu() for n in fresh], host, before, [(sid, did)]))
    mover.close()


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r or "default")
def test_a_pageable_offload_completes_only_with_its_bytes_in_place(route):
    gen, rng = torch.Generator().manual_seed(64), np.random.default_rng(64)
    device, host = Side(MIXED, 80, TOKENS, gen, device="cuda"), Side(MIXED, 30, 3 * TOKENS, gen, pinned=False)
    mover = _mover(device.tensors, host.tensors, "d2h", block_dim=[1, 0, 0],
                   policy=Policy(force=route) if route else None, pinned=False)
    _warm(mover, 64)
    before, src_before = host.snapshot(), device.snapshot()
    sid, did = rng.choice(80, 64, replace=False), rng.choice(90, 64, replace=False)
    with torch.cuda.stream(mover.stream):
        torch.cuda._sleep(SPIN)             # holds the transfer stream
    job = mover.submit(sid, did)
    assert mover.poll() == [] and host.matches(before)
    mover.wait(job)
    (r,) = mover.poll()
    assert r.ok and r.job_id == job
    assert host.matches(expected_after(device, src_before, host, before, [(sid, did)]))
    mover.close()
