"""Which pieces of a mover's tensors can hold the same bytes (kvswap.addressing.overlap),
against every pair of blocks enumerated."""
from __future__ import annotations

import numpy as np
import pytest

from kvswap.addressing.overlap import PAIRS_AT_ONCE, Pieces, meeting, spans_meet


def random_pieces(rng: np.random.Generator, n: int, strides: tuple[int, ...]) -> Pieces:
    stride = rng.choice(strides, n).astype(np.int64)
    size = rng.integers(1, 24, n)
    return Pieces(rng.integers(0, 200, n), stride, np.minimum(size, stride), rng.integers(1, 6, n), np.arange(n))


def brute(a: Pieces, b: Pieces, same: bool) -> np.ndarray:
    out = np.zeros((len(a.base), len(b.base)), dtype=bool)
    for p in range(len(a.base)):
        for q in range(len(b.base)):
            if same and p == q:
                continue
            for i in range(a.blocks[p]):
                x = a.base[p] + i * a.stride[p]
                for j in range(b.blocks[q]):
                    y = b.base[q] + j * b.stride[q]
                    if x < y + b.size[q] and y < x + a.size[p]:
                        out[p, q] = True
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("same", [False, True])
def test_exact_for_one_stride_and_never_misses_for_two(seed, same):
    rng = np.random.default_rng(seed)
    a = random_pieces(rng, 40, (24, 32, 48))
    b = a if same else random_pieces(rng, 30, (24, 32, 48))
    certain, possible = meeting(a, b, same)
    truth = brute(a, b, same)
    one = a.stride[:, None] == b.stride[None, :]
    assert np.array_equal(certain, truth & one)  # one stride: exactly the pairs that meet
    assert not (certain & ~one).any() and not (possible & one).any()
    assert not (truth & ~one & ~possible).any()  # two strides: every pair that meets is flagged
    assert truth.any() and (~truth).any()  # the draw holds both kinds of pairs


def test_chunked_rows_give_the_same_answer(monkeypatch):
    rng = np.random.default_rng(7)
    a, b = random_pieces(rng, 50, (24, 32)), random_pieces(rng, 45, (24, 32))
    whole = meeting(a, b, False)
    monkeypatch.setattr("kvswap.addressing.overlap.PAIRS_AT_ONCE", 7 * 45)
    assert PAIRS_AT_ONCE != 7 * 45
    parts = meeting(a, b, False)
    assert all(np.array_equal(x, y) for x, y in zip(whole, parts))


def test_spans_apart_never_meet():
    rng = np.random.default_rng(3)
    a = random_pieces(rng, 10, (32,))
    far = a._replace(base=a.base + 10**9)
    assert not spans_meet(a, far) and not meeting(a, far, False)[0].any()
    assert spans_meet(a, a)
