"""The Triton kernel family: copy a batch of (src, dst, size) descriptors in one launch.

This module imports Triton at the top, so nothing imports it until the first launch
(``launch.py`` does, inside a function).

The descriptors arrive as one int64 array ``[src[0..n), dst[0..n), size[0..n)]``. The
grid is persistent: ``num_programs`` programs (the SM budget) stride over tiles of ``JOBS``
consecutive descriptors. A tile copies its descriptors side by side, ``WORDS`` elements
of each per step, so a step keeps ``JOBS x WORDS`` elements in flight whatever the block
size: small blocks need several whole blocks per step to fill the link (FACTS.md: one
4 KiB block per step reaches 24 GB/s on 12 SMs; several per step, 50 on 4); a large block
is walked in ``WORDS``-element chunks.

Every size is copied exactly. Descriptors whose two addresses are 8-byte aligned move as
8-byte words (16-byte pairs when the whole tile is 16-byte aligned, so loads and stores
can be vectorised); the last ``size % 8`` bytes of those, and all bytes of descriptors
with an unaligned address, go through a byte path.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _copy_step(sp, dp, rem, col):
    # One step of every row in the tile: ``rem`` (per row, <= len(col)) elements.
    mask = col[None, :] < rem[:, None]
    ptr = col[None, :]
    v = tl.load(sp[:, None] + ptr, mask=mask)
    tl.store(dp[:, None] + ptr, v, mask=mask)


@triton.jit
def _load_descriptors(desc, n, tile, JOBS: tl.constexpr):
    j = tile.to(tl.int64) * JOBS + tl.arange(0, JOBS)
    live = j < n
    # Rows past ``n`` read as size 0 and copy nothing.
    s = tl.load(desc + j, mask=live, other=0)
    d = tl.load(desc + n + j, mask=live, other=0)
    z = tl.load(desc + 2 * n + j, mask=live, other=0)
    return s, d, z


@triton.jit
def copy_kernel(desc, n, splits, JOBS: tl.constexpr, WORDS: tl.constexpr, WIDE: tl.constexpr,
                PREFETCH: tl.constexpr):
    """Copy ``n`` descriptors packed in ``desc``; see the module docstring.

    ``splits``: how many programs share one tile, each taking every ``splits``-th step
    (more than 1 only when there are fewer tiles than programs, so a few large blocks
    still spread over the whole SM budget).
    ``WIDE``: take the 16-byte path for tiles whose addresses and sizes are all multiples
    of 16 (the compiler is told so, and vectorises the accesses).
    ``PREFETCH``: load the next tile's descriptors before copying this one, so their
    latency hides behind the copy instead of adding to every tile.
    """
    col = tl.arange(0, WORDS)
    work = tl.cdiv(n, JOBS) * splits
    step = tl.num_programs(0)
    first = tl.program_id(0)
    ns, nd, nz = _load_descriptors(desc, n, first // splits, JOBS)
    for w in range(first, work, step):
        part = w % splits
        if PREFETCH:
            s, d, z = ns, nd, nz
            ns, nd, nz = _load_descriptors(desc, n, (w + step) // splits, JOBS)
        else:
            s, d, z = _load_descriptors(desc, n, w // splits, JOBS)
        # 8-byte words where both addresses allow; size 0 rows (past n) copy nothing.
        nw = tl.where(((s | d) & 7) == 0, z >> 3, 0)
        top = tl.max(nw, 0)
        wide = False
        if WIDE:
            wide = tl.max((s | d | z) & 15, 0) == 0
        if wide:
            sp = tl.multiple_of(s, 16).to(tl.pointer_type(tl.int64))
            dp = tl.multiple_of(d, 16).to(tl.pointer_type(tl.int64))
            for c in range(part * WORDS, top, splits * WORDS):
                # Even counts from 16-byte aligned starts: the mask is constant over
                # pairs, which is what lets the accesses become 16-byte vectors.
                rem = tl.multiple_of(tl.minimum(nw - c, WORDS).to(tl.int32), 2)
                _copy_step(tl.multiple_of(sp + c, 16), tl.multiple_of(dp + c, 16), rem, col)
        else:
            sp = s.to(tl.pointer_type(tl.int64))
            dp = d.to(tl.pointer_type(tl.int64))
            for c in range(part * WORDS, top, splits * WORDS):
                rem = tl.minimum(nw - c, WORDS).to(tl.int32)
                _copy_step(sp + c, dp + c, rem, col)
        # Bytes: the tail of word-copied rows (< 8) and all of an unaligned row.
        b0 = nw * 8
        nb = z - b0
        tail = tl.max(nb, 0)
        if tail > 0:
            sb = s.to(tl.pointer_type(tl.uint8)) + b0
            db = d.to(tl.pointer_type(tl.uint8)) + b0
            for c in range(part * WORDS, tail, splits * WORDS):
                rem = tl.minimum(nb - c, WORDS).to(tl.int32)
                _copy_step(sb + c, db + c, rem, col)
