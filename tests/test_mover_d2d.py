"""d2d: copies between two allocations of one device, and their host flavour on a CPU."""
from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

import kvswap
from kvswap import BlockMover, Direction
from kvswap.cli import direction as parse_direction, directions as parse_directions
from kvswap.errors import TensorPlacementError
from mover_layouts import Pool, expected_after, layouts

LAYOUTS = layouts()


def test_d2d_is_a_direction_with_no_host_side():
    d = Direction.parse("D2D")
    assert d is Direction.D2D and str(d) == "d2d"
    assert not d.src_is_host and not d.dst_is_host and not d.crosses_host
    assert Direction.H2D.crosses_host and Direction.D2H.crosses_host
    assert parse_direction("d2d") is Direction.D2D
    assert parse_directions("h2d,d2h") == [Direction.H2D, Direction.D2H]
    with pytest.raises(argparse.ArgumentTypeError, match="choose one or more of h2d, d2h"):
        parse_directions("h2d,d2d")  # the commands that take a list measure the host link
    with pytest.raises(argparse.ArgumentTypeError, match="'h2d', 'd2h', 'd2d'"):
        parse_direction("sideways")


def test_resolve_d2d_copies_on_the_host():
    rng = np.random.default_rng(21)
    block, n = 384, 50
    src = rng.integers(0, 256, n * block, dtype=np.uint8)
    dst = rng.integers(0, 256, n * block, dtype=np.uint8)
    before = dst.copy()
    fn = kvswap.resolve("d2d", device="cpu", block_bytes=block)
    # The host reference takes d2d (triton.kernel, offered on the CPU under Triton's
    # interpreter, serves d2d too but is not chosen).
    assert "host.reference" in fn.impls and {r.impl for r in fn.plan.routes} == {"host.reference"}
    sid, did = rng.permutation(n)[:17], rng.permutation(n)[:17]
    s = (src.ctypes.data + sid * block).astype(np.int64)
    d = (dst.ctypes.data + did * block).astype(np.int64)
    fn(s, d, np.full(len(sid), block, dtype=np.int64))
    expected = before.reshape(n, block).copy()
    expected[did] = src.reshape(n, block)[sid]
    np.testing.assert_array_equal(dst.reshape(n, block), expected)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_d2d_mover_between_host_tensors_matches_torch_indexing(name):
    rng = np.random.default_rng(22)
    gen = torch.Generator().manual_seed(22)
    src, dst = Pool(LAYOUTS[name], 24, gen), Pool(LAYOUTS[name], 31, gen)
    before, src_before = dst.snapshot(), src.snapshot()
    jobs = []
    with BlockMover(src.tensors, dst.tensors, "d2d", block_dim=src.layout.block_dim) as mover:
        assert mover.direction is Direction.D2D and mover.stream is None
        for n in (3, 24, 1):
            sid = rng.choice(24, n, replace=False)
            did = rng.choice(31, n, replace=False)
            mover.submit(sid, did)
            jobs.append((sid, did))
    assert dst.matches(expected_after(dst, before, src_before, src, jobs))
    assert src.matches(src_before)


def test_d2d_mover_wants_both_sides_on_one_device():
    gen = torch.Generator().manual_seed(23)
    src, dst = Pool(LAYOUTS["mla"], 8, gen), Pool(LAYOUTS["mla"], 8, gen)
    meta = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in dst.tensors]
    with pytest.raises(TensorPlacementError, match="src_tensors and dst_tensors are on \\['cpu', 'meta'\\]"):
        BlockMover(src.tensors, meta, "d2d")
