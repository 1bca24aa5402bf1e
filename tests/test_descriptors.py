"""Descriptor arrays: normalisation and coalescing, checked against a plain loop."""
from __future__ import annotations

import numpy as np
import pytest

from kvswap import InvalidTransferError
from kvswap.addressing.descriptors import SMALL_BATCH, as_int64, checked, coalesce, first_overlap, normalize


def test_as_int64_is_zero_copy_for_int64_and_refuses_the_rest():
    import torch

    a = np.arange(5, dtype=np.int64)
    assert as_int64(a, "x") is a or np.shares_memory(as_int64(a, "x"), a)
    t = torch.arange(5, dtype=torch.int64)
    assert np.shares_memory(as_int64(t, "x"), t.numpy())
    assert as_int64(np.arange(3, dtype=np.uint32), "x").dtype == np.int64
    with pytest.raises(InvalidTransferError, match="x must hold integers, got dtype bool"):
        as_int64(np.array([True]), "x")
    with pytest.raises(InvalidTransferError, match="x must hold integers"):
        as_int64(torch.ones(2), "x")
    with pytest.raises(InvalidTransferError, match="beyond int64"):
        as_int64(np.array([2**63], dtype=np.uint64), "x")


def loop_coalesce(src, dst, sizes):
    out = []
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1][2] += n
        else:
            out.append([s, d, n])
    return [tuple(r) for r in out]


@pytest.mark.parametrize("seed", range(5))
def test_coalesce_matches_a_plain_loop(seed):
    rng = np.random.default_rng(seed)
    n = 500
    ids_s = np.sort(rng.choice(2000, n, replace=False)) if seed % 2 else rng.choice(2000, n, replace=False)
    ids_d = ids_s + rng.integers(0, 2, n).cumsum() * (seed > 2)
    size = 4096
    src, dst = ids_s * size + 1 << 20, ids_d * size + 1 << 30
    sizes = np.full(n, size, dtype=np.int64)
    got = coalesce(src.astype(np.int64), dst.astype(np.int64), sizes)
    assert list(zip(*[a.tolist() for a in got])) == loop_coalesce(src, dst, sizes)
    assert got[2].sum() == sizes.sum()


def test_coalesce_merges_a_contiguous_run_into_one_descriptor():
    src = np.array([100, 110, 120, 500], dtype=np.int64)
    dst = np.array([900, 910, 920, 930], dtype=np.int64)
    s, d, n = coalesce(src, dst, np.full(4, 10, dtype=np.int64))
    assert s.tolist() == [100, 500] and d.tolist() == [900, 930] and n.tolist() == [30, 10]


def test_first_overlap_and_normalize():
    assert first_overlap(np.array([0, 10, 20]), np.array([10, 10, 10])) is None
    assert first_overlap(np.array([20, 0, 15]), np.array([10, 10, 10])) in {(2, 0), (0, 2)}
    s, d, n = normalize([1], [100], [3])
    assert s.dtype == d.dtype == n.dtype == np.int64


@pytest.mark.parametrize("count", [1, SMALL_BATCH, SMALL_BATCH + 1, 300])  # both ways of reducing
def test_checked_finds_the_extremes_and_names_the_bad_descriptor(count):
    rng = np.random.default_rng(count)
    src = rng.integers(1, 1 << 40, count, dtype=np.int64)
    dst = rng.integers(1, 1 << 40, count, dtype=np.int64)
    sizes = rng.integers(1, 1 << 20, count, dtype=np.int64)
    s, d, n, smallest, largest = checked(src, dst, sizes)
    assert (smallest, largest) == (int(sizes.min()), int(sizes.max()))
    assert type(smallest) is int and type(largest) is int and s is src and n is sizes
    i = int(rng.integers(count))
    for what, arrays, value, message in (
        ("sizes", (src, dst, sizes), 0, rf"sizes\[{i}\]=0: every size must be >= 1 byte"),
        ("src", (src, dst, sizes), 0, rf"src_ptrs\[{i}\]=0 is not a valid address"),
        ("dst", (src, dst, sizes), -8, rf"dst_ptrs\[{i}\]=-8 is not a valid address"),
    ):
        bad = [a.copy() for a in arrays]
        bad[("src", "dst", "sizes").index(what)][i] = value
        with pytest.raises(InvalidTransferError, match=message):
            checked(*bad)
