"""The Triton kernel that copies blocks by id: addresses derived on the device.

Imports Triton at the top; only by_ids.py imports it, inside a function.

A BlockMover's descriptor template says where every piece (one contiguous chunk of one
tensor pair) of block 0 lives and how far apart blocks are: ``tmpl`` is one int64 array
``[src_base | src_stride | dst_base | dst_stride | size]`` of ``pieces`` entries each,
uploaded once. Per launch only the ids travel: ``ids = [src_ids | dst_ids]``, ``n``
each. Work item ``w`` (``pieces x n`` of them, piece-major) copies ``size[p]`` bytes from
``src_base[p] + src_ids[i] * src_stride[p]`` to ``dst_base[p] + dst_ids[i] *
dst_stride[p]`` with ``p = w // n``, ``i = w % n``. The copy loop is copy_kernel's
(jit.py): a persistent grid of ``num_programs`` programs strides over tiles of
``JOBS`` work items, ``WORDS`` 8-byte elements of each per step; ``splits`` programs
share a tile when there are fewer tiles than programs. Where every piece has one size
(``UNIFORM``, the usual template: K and V of every layer alike), the launcher passes it in
words as ``each``; otherwise each tile finds its longest row by a reduction, which makes the
program's warps wait for each other at every tile.

Only 8- and 16-byte aligned templates run here (every base, stride and size a multiple
of 8, or of 16 for vectors); the launcher declines others, which then take the
descriptor path.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .jit import _copy_words


@triton.jit(do_not_specialize=["n", "pieces", "splits", "each"])
def copy_by_ids_kernel(tmpl, ids, n, pieces, splits, each, JOBS: tl.constexpr, WORDS: tl.constexpr,
                       ALIGN: tl.constexpr, CACHE: tl.constexpr, UNIFORM: tl.constexpr):
    """Copy ``pieces x n`` work items; see the module docstring. ``ALIGN``: 16 (vectors)
    or 8 (words), what every base, stride and size is a multiple of. ``UNIFORM``: every
    piece is ``each`` words long."""
    col = tl.arange(0, WORDS)
    total = n.to(tl.int64) * pieces
    work = tl.cdiv(total, JOBS) * splits
    step = tl.num_programs(0)
    for w in range(tl.program_id(0), work, step):
        part = w % splits
        j = (w // splits).to(tl.int64) * JOBS + tl.arange(0, JOBS)
        live = j < total
        p = tl.where(live, j // n, 0)
        i = tl.where(live, j - p * n, 0)
        sid = tl.load(ids + i, mask=live, other=0)
        did = tl.load(ids + n + i, mask=live, other=0)
        s = tl.load(tmpl + p, mask=live, other=0) + sid * tl.load(tmpl + pieces + p, mask=live, other=0)
        d = tl.load(tmpl + 2 * pieces + p, mask=live, other=0) + did * tl.load(tmpl + 3 * pieces + p, mask=live,
                                                                               other=0)
        # Rows past the end read as size 0 and copy nothing.
        nw = tl.load(tmpl + 4 * pieces + p, mask=live, other=0) >> 3
        if UNIFORM:
            top = each
        else:
            top = tl.max(nw, 0)
        _copy_words(s, d, nw, top, part, splits, col, WORDS, ALIGN, CACHE)


@triton.jit(do_not_specialize=["count"])
def load_ids_kernel(src, dst, count, BLOCK: tl.constexpr):
    """Copy ``count`` int64 ids from ``src`` (pinned host memory) to ``dst`` (device memory),
    ``BLOCK`` per program: the upload before a long batch, launched like the copy itself
    (no stream switch on the host)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < count
    tl.store(dst + i, tl.load(src + i, mask=live), mask=live)
