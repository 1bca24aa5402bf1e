"""Which pieces of a mover's tensors can hold the same bytes, decided once per mover.

A piece (one chunk of one tensor, :class:`~kvswap.addressing.regions.DescriptorTemplate`)
lives at ``base + i * stride`` for block ``i``: an arithmetic progression. Two pieces of
one stride meet for some pair of blocks exactly when some block distance ``k`` puts them
within each other's size, which a few integer operations decide for every pair at once;
pieces of different strides (rare: views of one buffer cut two ways) are said to meet
where their spans do. Sub-blocks (``factor`` > 1) are progressions of their own, one per
sub-block position.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

# Piece pairs compared at once: bounds the temporary arrays for layouts of many pieces.
PAIRS_AT_ONCE = 1 << 20


class Pieces(NamedTuple):
    """One side's pieces as progressions: ``base + i * stride`` for ``i < blocks``,
    ``size`` bytes each; ``tensor`` is the index of the tensor pair each belongs to."""

    base: np.ndarray
    stride: np.ndarray
    size: np.ndarray
    blocks: np.ndarray
    tensor: np.ndarray


def side_pieces(t: Any, dst: bool) -> Pieces:
    """The source or destination side of the template ``t`` (a
    :class:`~kvswap.addressing.regions.DescriptorTemplate`) as progressions."""
    base, stride, sub = (t.dst_base, t.dst_stride, t.dst_sub) if dst else (t.src_base, t.src_stride, t.src_sub)
    factor, ids = (t.dst_factor, t.dst_blocks) if dst else (t.src_factor, t.src_blocks)
    if sub is None or factor == 1:
        sub, factor = np.zeros_like(stride), 1
    r = np.repeat(np.arange(factor, dtype=np.int64)[None, :], len(base), 0)
    blocks = np.full(r.size, max(1, ids // factor), dtype=np.int64)
    return Pieces((base[:, None] + r * sub[:, None]).ravel(), np.repeat(stride, factor),
                  np.repeat(t.sizes, factor), blocks, np.repeat(t.pair, factor))


def meeting(a: Pieces, b: Pieces, same: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(certain, possible)``: boolean matrices over (piece of ``a``, piece of ``b``),
    true where the two pieces hold the same bytes for some pair of blocks (``certain``:
    known exactly, one stride) or may (``possible``: of different strides, spans that
    meet). With ``same`` (``a`` is ``b``), a piece against itself is left out."""
    certain = np.zeros((len(a.base), len(b.base)), dtype=bool)
    possible = np.zeros_like(certain)
    rows = max(1, PAIRS_AT_ONCE // max(1, len(b.base)))
    (lo_a, hi_a), (lo_b, hi_b) = _span(a), _span(b)
    for r0 in range(0, len(a.base), rows):
        sl = slice(r0, r0 + rows)
        ab, asz, an, s = a.base[sl, None], a.size[sl, None], a.blocks[sl, None], a.stride[sl, None]
        one = (s == b.stride[None, :]) & (s > 0)
        # One stride s: block i of a meets block j of b where k = i - j satisfies
        # d - size_a < k * s < d + size_b, d = base_b - base_a; the least k above the lower
        # bound, raised to the least possible distance, must pass the upper bound.
        d = b.base[None, :] - ab
        step = np.where(one, s, 1)
        k = np.maximum((d - asz) // step + 1, 1 - b.blocks[None, :])
        certain[sl] = one & (k <= an - 1) & (k * step < d + b.size[None, :])
        possible[sl] = ~one & (lo_a[sl, None] < hi_b[None, :]) & (lo_b[None, :] < hi_a[sl, None])
    if same:
        np.fill_diagonal(certain, False)
        np.fill_diagonal(possible, False)
    return certain, possible


def spans_meet(a: Pieces, b: Pieces) -> bool:
    """Whether the memory ``a``'s pieces span meets the memory ``b``'s span (host and
    device memory never do): where not, no piece of one meets a piece of the other."""
    lo_a, hi_a = _span(a)
    lo_b, hi_b = _span(b)
    return bool(lo_a.min() < hi_b.max() and lo_b.min() < hi_a.max())


def _span(p: Pieces) -> tuple[np.ndarray, np.ndarray]:
    """Each piece's lowest address and the end of its highest block."""
    last = (p.blocks - 1) * p.stride
    return p.base + np.minimum(last, 0), p.base + np.maximum(last, 0) + p.size
