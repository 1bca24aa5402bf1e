"""The Triton kernel family: copy a batch of (src, dst, size) descriptors in one launch.

This module imports Triton at the top, so nothing imports it until the first launch
(``launch.py`` does, inside a function).

The descriptors arrive as one int64 array ``[src[0..n), dst[0..n), size[0..n)]``. The
grid is persistent: ``num_programs`` programs (the SM budget) stride over tiles of ``JOBS``
consecutive descriptors. A tile copies its descriptors side by side, ``WORDS`` elements
of each per step, so a step keeps ``JOBS x WORDS`` elements in flight whatever the block
size: small blocks need several whole blocks per step to fill the link; a large
block is walked in ``WORDS``-element chunks.

Every size is copied exactly. The launcher picks a variant by the batch's alignment: all
addresses and sizes multiples of 16 move as 16-byte vectors, multiples of 8 as 8-byte
words; any other batch moves 8-byte words where a descriptor's two addresses allow, and
the last ``size % 8`` bytes of those, and all bytes of the others, through a byte path.
"""
from __future__ import annotations

# On an H200, one 4 KiB block per step reached 24 GB/s on 12 SMs; several per step, 50 on 4.
import triton
import triton.language as tl


@triton.jit
def _copy_step(sp, dp, rem, col, CACHE: tl.constexpr):
    # One step of every row in the tile: ``rem`` (per row, <= len(col)) elements.
    mask = col[None, :] < rem[:, None]
    ptr = col[None, :]
    v = tl.load(sp[:, None] + ptr, mask=mask, cache_modifier=CACHE)
    tl.store(dp[:, None] + ptr, v, mask=mask)


@triton.jit
def _copy_words(s, d, nw, top, part, splits, col, WORDS: tl.constexpr, ALIGN: tl.constexpr,
                CACHE: tl.constexpr):
    """Copy ``nw`` 8-byte words from each row's ``s`` to its ``d``, this program's share
    (``part`` of ``splits``) of every ``WORDS``-wide step; 16-byte vectors where ``ALIGN`` is 16."""
    if ALIGN == 16:
        sp = tl.multiple_of(s, 16).to(tl.pointer_type(tl.int64))
        dp = tl.multiple_of(d, 16).to(tl.pointer_type(tl.int64))
        for c in range(part * WORDS, top, splits * WORDS):
            # Even counts from 16-byte aligned starts: the mask is constant over
            # pairs, which is what lets the accesses become 16-byte vectors.
            rem = tl.multiple_of(tl.minimum(nw - c, WORDS).to(tl.int32), 2)
            _copy_step(tl.multiple_of(sp + c, 16), tl.multiple_of(dp + c, 16), rem, col, CACHE)
    else:
        sp = s.to(tl.pointer_type(tl.int64))
        dp = d.to(tl.pointer_type(tl.int64))
        for c in range(part * WORDS, top, splits * WORDS):
            rem = tl.minimum(nw - c, WORDS).to(tl.int32)
            _copy_step(sp + c, dp + c, rem, col, CACHE)


@triton.jit
def _load_descriptors(desc, n, tile, JOBS: tl.constexpr):
    j = tile.to(tl.int64) * JOBS + tl.arange(0, JOBS)
    live = j < n
    # Rows past ``n`` read as size 0 and copy nothing.
    s = tl.load(desc + j, mask=live, other=0)
    d = tl.load(desc + n + j, mask=live, other=0)
    z = tl.load(desc + 2 * n + j, mask=live, other=0)
    return s, d, z


# ``n`` and ``splits`` are left unspecialised (Triton would otherwise compile separate
# variants for 1 and for multiples of 16), so one compiled variant per launch shape serves
# every batch and can be launched directly (compiled.py).
@triton.jit(do_not_specialize=["n", "splits"])
def copy_kernel(desc, n, splits, JOBS: tl.constexpr, WORDS: tl.constexpr, ALIGN: tl.constexpr,
                PREFETCH: tl.constexpr, CACHE: tl.constexpr):
    """Copy ``n`` descriptors packed in ``desc``; see the module docstring.

    ``splits``: how many programs share one tile, each taking every ``splits``-th step
    (more than 1 only when there are fewer tiles than programs, so a few large blocks
    still spread over the whole SM budget).
    ``ALIGN``: what the launcher found every address and size of the batch to be a
    multiple of. 16: 16-byte vectors (the compiler is told so); 8: 8-byte words; 1: any
    batch (words where a descriptor allows, then the byte path). Each variant compiles
    only its own path: registers are what limits the bytes a program keeps in flight.
    ``PREFETCH``: load the next tile's descriptors before copying this one.
    ``CACHE``: the cache modifier of the data loads (``""`` default, ``".cg"`` L2 only).
    """
    col = tl.arange(0, WORDS)
    work = tl.cdiv(n, JOBS) * splits
    step = tl.num_programs(0)
    first = tl.program_id(0)
    if PREFETCH:
        ns, nd, nz = _load_descriptors(desc, n, first // splits, JOBS)
    for w in range(first, work, step):
        part = w % splits
        if PREFETCH:
            s, d, z = ns, nd, nz
            ns, nd, nz = _load_descriptors(desc, n, (w + step) // splits, JOBS)
        else:
            s, d, z = _load_descriptors(desc, n, w // splits, JOBS)
        if ALIGN == 1:
            # 8-byte words only where both addresses allow.
            nw = tl.where(((s | d) & 7) == 0, z >> 3, 0)
        else:
            nw = z >> 3
        top = tl.max(nw, 0)
        _copy_words(s, d, nw, top, part, splits, col, WORDS, ALIGN, CACHE)
        if ALIGN == 1:
            # Bytes: the tail of word-copied rows (< 8) and all of an unaligned row.
            b0 = nw * 8
            nb = z - b0
            tail = tl.max(nb, 0)
            if tail > 0:
                sb = s.to(tl.pointer_type(tl.uint8)) + b0
                db = d.to(tl.pointer_type(tl.uint8)) + b0
                for c in range(part * WORDS, tail, splits * WORDS):
                    rem = tl.minimum(nb - c, WORDS).to(tl.int32)
                    _copy_step(sb + c, db + c, rem, col, CACHE)
