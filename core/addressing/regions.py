"""Where a block lives in a KV tensor, and how a list of block ids becomes descriptors.

Derived once per mover: for every tensor, the block stride and the contiguous chunks a
block is made of; for every (src, dst) pair, one "piece" per chunk with its address in
block 0 and its block stride on each side. Per submit, descriptors are then a single
broadcast ``base[piece] + id * stride[piece]`` over all pieces and ids, written straight
into the caller's (pinned) buffer: no per-layer or per-block Python work.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence, Union

import numpy as np

from ..errors import BlockLayoutError
from .descriptors import merge_runs
from .overlap import Pieces, meeting, side_pieces, spans_meet

PairDim = Union[int, tuple[int, int]]
BlockDim = Union[PairDim, Sequence[PairDim]]


@dataclass(frozen=True)
class BlockRegions:
    """The bytes of block ``i`` of one tensor: chunk ``c`` starts at
    ``base + offsets[c] + i * stride`` and is ``chunk_bytes`` long.

    ``shape`` and ``order`` describe one block (size-1 dims dropped): its logical shape
    and its dims from innermost to outermost in memory, to tell a pair that stores a
    block's elements in different orders. With ``factor`` k > 1 the regions describe a
    sub-block: id ``i`` is sub-block ``i % k`` of block ``i // k``, which starts
    ``sub_step`` bytes after the one before it.
    """

    base: int
    stride: int
    num_blocks: int
    offsets: tuple[int, ...]
    chunk_bytes: int
    shape: tuple[int, ...]
    order: tuple[int, ...]
    factor: int = 1
    sub_step: int = 0

    @property
    def ids(self) -> int:
        """How many ids address this tensor: its blocks, or its sub-blocks."""
        return self.num_blocks * self.factor

    @property
    def block_bytes(self) -> int:
        return len(self.offsets) * self.chunk_bytes


def block_regions(tensor: Any, block_dim: int, what: str, split: Optional[tuple[int, int]] = None) -> BlockRegions:
    """Cut the blocks of ``tensor`` (indexed along ``block_dim``) into contiguous chunks.

    :param split: ``(dim, k)``: cut every block into k sub-blocks along ``dim`` and
        describe sub-block 0 (see :attr:`BlockRegions.factor`).
    :raises BlockLayoutError: the tensor is empty, ``block_dim`` is out of range, elements
        overlap (stride 0, ``expand``, ``as_strided``), or a block's innermost dimension is
        strided, so a block is scattered single elements rather than contiguous chunks.
    """
    shape, strides, item = tuple(tensor.shape), tuple(tensor.stride()), tensor.element_size()
    nd = len(shape)
    if nd == 0:
        raise BlockLayoutError(f"{what} is a 0-d tensor; it has no block dimension")
    if not -nd <= block_dim < nd:
        raise BlockLayoutError(f"block_dim={block_dim} is out of range for {what} of shape {shape}")
    b = block_dim % nd
    if tensor.numel() == 0:
        raise BlockLayoutError(f"{what} of shape {shape} is empty")
    # Non-overlap: sorted by stride, each dim must step past everything the inner dims reach.
    reach = 0
    for size, stride in sorted((p for p in zip(shape, strides) if p[0] > 1), key=lambda p: p[1]):
        if stride <= reach:
            raise BlockLayoutError(
                f"{what} (shape {shape}, strides {strides}) has elements that share memory "
                f"(an expanded or as_strided view); blocks would overlap"
            )
        reach += stride * (size - 1)
    factor, sub_step = 1, 0
    if split is not None:
        t, factor = split
        sub = list(shape)
        sub[t] //= factor
        sub_step = strides[t] * sub[t] * item
        shape = tuple(sub)
    dims = [i for i in range(nd) if i != b and shape[i] > 1]
    order = tuple(sorted(dims, key=lambda i: strides[i]))
    chunk, run = 1, 0
    for i in order:  # the contiguous run: innermost dims whose stride is what came before
        if strides[i] != chunk:
            break
        chunk *= shape[i]
        run += 1
    outer = [i for i in dims if i not in order[:run]]
    if chunk == 1 and outer:
        inner = order[0]
        raise BlockLayoutError(
            f"{what} (shape {shape}, strides {strides}, block_dim={b}): the innermost dimension of a "
            f"block (dim {inner}) has stride {strides[inner]}, not 1, so a block is single scattered "
            f"elements, not contiguous chunks; copy from a layout where each block holds contiguous runs"
        )
    offsets = np.zeros(1, dtype=np.int64)
    for i in outer:  # logical order, so chunk c of src pairs with chunk c of dst
        offsets = (offsets[:, None] + np.arange(shape[i], dtype=np.int64)[None, :] * strides[i]).ravel()
    return BlockRegions(
        base=int(tensor.data_ptr()),
        stride=strides[b] * item,
        num_blocks=shape[b],
        offsets=tuple(int(o) * item for o in offsets),
        chunk_bytes=chunk * item,
        shape=tuple(shape[i] for i in dims),
        order=tuple(dims.index(i) for i in order),
        factor=factor,
        sub_step=sub_step,
    )


@dataclass(frozen=True, eq=False)
class DescriptorTemplate:
    """Every chunk of every (src, dst) pair, as arrays over pieces, ready to broadcast.

    Piece ``p`` of block ids ``(i, j)`` copies ``sizes[p]`` bytes from
    ``src_base[p] + i * src_stride[p]`` to ``dst_base[p] + j * dst_stride[p]``. Where a
    side's blocks are ``k = src_factor`` (``dst_factor``) times the other side's, its ids
    count sub-blocks: ``i`` stands for ``(i // k) * stride[p] + (i % k) * sub[p]``.
    ``id_major`` puts a block's pieces next to each other in the descriptor list (chosen
    when that lets contiguous pieces coalesce, as in a cross-layer layout); otherwise a
    piece's ids are neighbours, so runs of consecutive ids coalesce.
    """

    src_base: np.ndarray
    src_stride: np.ndarray
    dst_base: np.ndarray
    dst_stride: np.ndarray
    sizes: np.ndarray
    pair: np.ndarray
    src_blocks: int
    dst_blocks: int
    id_major: bool = False
    src_sub: Optional[np.ndarray] = None
    dst_sub: Optional[np.ndarray] = None
    src_factor: int = 1
    dst_factor: int = 1
    # Destination pieces cut with different strides whose spans meet: a job's destinations
    # may then overlap, which only the job's own descriptors can tell (:func:`jobs_overlap`).
    dst_may_meet: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "_filler", _Filler(self))
        object.__setattr__(self, "block_bytes", int(self.sizes.sum()))  # bytes one block id moves

    @property
    def count(self) -> int:
        return len(self.sizes)

    @property
    def chunk_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.sizes.tolist())))

    @property
    def factor(self) -> int:
        """k: how many of one side's blocks make one of the other side's (1: equal)."""
        return max(self.src_factor, self.dst_factor)

    def fill(self, src_ids: np.ndarray, dst_ids: np.ndarray, out: np.ndarray) -> int:
        """Write the descriptors of ``len(src_ids)`` block pairs into ``out[0..2, :m]``
        (src, dst, sizes) and return ``m``. Ids must already be validated."""
        return self._filler(src_ids, dst_ids, out)

    def with_order(self, id_major: bool) -> DescriptorTemplate:
        return replace(self, id_major=id_major)


class _Filler:
    """``DescriptorTemplate.fill`` with its broadcast shapes and constants bound once."""

    def __init__(self, t: DescriptorTemplate) -> None:
        axis = (None, slice(None)) if t.id_major else (slice(None), None)
        self.id_major = t.id_major
        self.count = t.count
        self.src = _Side(t.src_base, t.src_stride, t.src_sub, t.src_factor, axis, t.id_major)
        self.dst = _Side(t.dst_base, t.dst_stride, t.dst_sub, t.dst_factor, axis, t.id_major)
        size0 = int(t.sizes[0])
        self.size = size0 if (t.sizes == size0).all() else None
        self.size_grid = t.sizes[axis]

    def __call__(self, src_ids: np.ndarray, dst_ids: np.ndarray, out: np.ndarray) -> int:
        n = len(src_ids)
        m = n * self.count
        shape = (n, self.count) if self.id_major else (self.count, n)
        self.src.place(out[0, :m].reshape(shape), src_ids)
        self.dst.place(out[1, :m].reshape(shape), dst_ids)
        if self.size is not None:
            out[2, :m].fill(self.size)
        else:
            np.copyto(out[2, :m].reshape(shape), self.size_grid)
        return m


class _Side:
    """One side's addresses: ``base + id * stride``, or with sub-blocks
    ``base + (id // k) * stride + (id % k) * sub``, broadcast over pieces x ids."""

    def __init__(self, base: np.ndarray, stride: np.ndarray, sub: Optional[np.ndarray], factor: int,
                 axis: tuple, id_major: bool) -> None:
        self.base, self.stride = base[axis], stride[axis]
        self.step = int(stride[0]) if (stride == stride[0]).all() else None
        self.factor = factor
        sub = np.zeros_like(stride) if sub is None else sub
        self.sub = sub[axis]
        self.sub_step = int(sub[0]) if (sub == sub[0]).all() else None
        self.id_major = id_major

    def place(self, out: np.ndarray, ids: np.ndarray) -> None:
        k = self.factor
        if k == 1:
            q, r = ids, None
        else:
            q, r = np.divmod(ids, k)
        if self.step is not None and (r is None or self.sub_step is not None):
            # one stride for every piece: the offset of each id once, then one add
            off = q * self.step if r is None else q * self.step + r * self.sub_step
            np.add(self.base, off[:, None] if self.id_major else off[None, :], out=out)
            return
        qa = q[:, None] if self.id_major else q[None, :]
        np.multiply(qa, self.stride, out=out)
        if r is not None:
            out += (r[:, None] if self.id_major else r[None, :]) * self.sub
        np.add(out, self.base, out=out)


def _as_pair(block_dim: Any) -> tuple[int, int]:
    if isinstance(block_dim, bool):
        raise BlockLayoutError(f"block_dim={block_dim!r} must be an int or a (src, dst) pair of ints")
    if isinstance(block_dim, int):
        return block_dim, block_dim
    if (isinstance(block_dim, tuple) and len(block_dim) == 2
            and all(isinstance(d, int) and not isinstance(d, bool) for d in block_dim)):
        return block_dim
    raise BlockLayoutError(f"block_dim={block_dim!r} must be an int or a (src, dst) pair of ints")


def block_dims(block_dim: BlockDim, pairs: int) -> list[tuple[int, int]]:
    """``(src, dst)`` block dims for each of ``pairs`` tensor pairs.

    An int or a ``(src, dst)`` tuple holds for every pair; a list gives one entry (an int
    or a tuple) per pair, so layouts mix in one mover: FlashAttention ``(2, n, ...)``,
    FlashInfer ``(n, 2, ...)`` and MLA ``(n, ...)`` caches are ``[1, 0, 0]``.
    """
    if isinstance(block_dim, list):
        if len(block_dim) != pairs:
            raise BlockLayoutError(
                f"block_dim is a list of {len(block_dim)} entries but there are {pairs} tensor pair(s); "
                f"a list gives one entry per pair (a tuple is one (src, dst) pair for all)"
            )
        out = []
        for k, d in enumerate(block_dim):
            try:
                out.append(_as_pair(d))
            except BlockLayoutError:
                raise BlockLayoutError(
                    f"block_dim[{k}]={d!r} must be an int or a (src, dst) pair of ints"
                ) from None
        return out
    return [_as_pair(block_dim)] * pairs


def _describe(r: BlockRegions) -> str:
    return f"{len(r.offsets)} chunk(s) of {r.chunk_bytes} bytes"


def _split_dim(big: Any, bdim: int, small: Any, sdim: int, small_r: BlockRegions, k: int, what: str) -> BlockRegions:
    """The regions of sub-block 0 of ``big`` cut into ``k`` along the one dimension that
    makes its blocks ``small``'s blocks; raises when there is none.

    With the same dtype and rank on both sides, the sub-block's shape must be the small
    block's; with a byte pool on one side, its chunks must be the small block's (the
    outermost dimension that fits wins). The innermost dimension is never cut.
    """
    nd = big.dim()
    b = bdim % nd
    inner = min((i for i in range(nd) if i != b and big.shape[i] > 1), key=lambda i: big.stride(i), default=None)
    same_kind = big.dtype == small.dtype and big.dim() == small.dim()
    small_shape = [x for i, x in enumerate(small.shape) if i != sdim % small.dim()]
    for t in range(nd):
        if t == b or t == inner or big.shape[t] % k:
            continue
        if same_kind:
            sub = [x // k if i == t else x for i, x in enumerate(big.shape)]
            if [x for i, x in enumerate(sub) if i != b] != small_shape:
                continue
            r = block_regions(big, bdim, what, split=(t, k))
            if r.shape == small_r.shape and r.order != small_r.order:
                continue
            return r
        r = block_regions(big, bdim, what, split=(t, k))
        if len(r.offsets) == len(small_r.offsets) and r.chunk_bytes == small_r.chunk_bytes:
            return r
    raise BlockLayoutError("no split")


def _refine(a: BlockRegions, b: BlockRegions) -> tuple[list[int], list[int], int]:
    """Cut the chunks of two descriptions of one block's bytes, each read in its chunks'
    order, to their greatest common size: ``(a offsets, b offsets, chunk bytes)``."""
    g = math.gcd(a.chunk_bytes, b.chunk_bytes)

    def cut(r: BlockRegions) -> list[int]:
        return [o + m * g for o in r.offsets for m in range(r.chunk_bytes // g)]

    return cut(a), cut(b), g


def _block_dims(t: Any, block_dim: int) -> list[tuple[int, int]]:
    """``(size, byte stride)`` of each dimension of one block of ``t``, in logical order,
    size-1 dimensions dropped (as :func:`block_regions` drops them)."""
    b, item = block_dim % t.dim(), t.element_size()
    return [(n, st * item) for i, (n, st) in enumerate(zip(t.shape, t.stride())) if i != b and n > 1]


def _paired_elements(s: Any, sdim: int, d: Any, ddim: int) -> tuple[list[int], list[int], int]:
    """Pieces that pair each element of a src block with the same element of the dst block,
    for blocks of one dtype and one logical shape stored in any two layouts.

    A piece is the innermost run of dimensions that is contiguous, in the same order, on
    both sides; every other dimension is enumerated in logical order, each side stepping by
    its own strides. A FlashAttention block (K and V planes apart) against a block-major
    host block (K and V adjacent) pairs as two pieces of one plane each.
    """
    src, dst = _block_dims(s, sdim), _block_dims(d, ddim)
    item = s.element_size()
    run, inner = item, set()
    for j in sorted(range(len(src)), key=lambda j: src[j][1]):
        if src[j][1] != run or dst[j][1] != run:
            break
        run *= src[j][0]
        inner.add(j)
    so, do = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
    for j in range(len(src)):
        if j in inner:
            continue
        steps = np.arange(src[j][0], dtype=np.int64)
        so = (so[:, None] + steps[None, :] * src[j][1]).ravel()
        do = (do[:, None] + steps[None, :] * dst[j][1]).ravel()
    return so.tolist(), do.tolist(), run


def _pair(k: int, s: Any, d: Any, sdim: int, ddim: int) -> tuple[BlockRegions, BlockRegions, list[int], list[int], int]:
    """Regions of one pair, its piece offsets on each side, and the piece size.

    Blocks of one size pair by element where both sides have one dtype and one logical
    block shape (however each side lays its block out), else by byte in the order of each
    side's chunks (a ``torch.uint8`` byte pool on one side, or shapes that differ but chunk
    alike); chunks are cut to the size the two sides have in common.
    """
    rs = block_regions(s, sdim, f"src_tensors[{k}]")
    rd = block_regions(d, ddim, f"dst_tensors[{k}]")
    mismatch = BlockLayoutError(
        f"pair {k}: a src block is {_describe(rs)} but a dst block is {_describe(rd)}; the blocks must hold "
        f"the same elements (one dtype and block shape, in any layout), the same chunks, or one side's blocks "
        f"must be k whole times the other's, cut along one dimension (not the innermost) into blocks of the "
        f"other side's shape (src shape {tuple(s.shape)}, dst shape {tuple(d.shape)})"
    )
    if rs.block_bytes == rd.block_bytes:
        if s.dtype == d.dtype and rs.shape == rd.shape:
            so, do, size = _paired_elements(s, sdim, d, ddim)
            if size < min(rs.chunk_bytes, rd.chunk_bytes):
                raise BlockLayoutError(
                    f"pair {k}: src and dst blocks have the same shape {rs.shape} but store its elements in "
                    f"different orders (strides {tuple(s.stride())} vs {tuple(d.stride())}); pairing them "
                    f"element by element would cut each chunk into runs of {size} bytes"
                )
            return rs, rd, so, do, size
        if s.dtype != d.dtype or (len(rs.offsets), rs.chunk_bytes) == (len(rd.offsets), rd.chunk_bytes):
            so, do, size = _refine(rs, rd)
            return rs, rd, so, do, size
        raise mismatch
    big_is_src = rs.block_bytes > rd.block_bytes
    big, small = (rs, rd) if big_is_src else (rd, rs)
    if big.block_bytes % small.block_bytes:
        raise mismatch
    factor = big.block_bytes // small.block_bytes
    try:
        if big_is_src:
            rs = _split_dim(s, sdim, d, ddim, rd, factor, f"src_tensors[{k}]")
        else:
            rd = _split_dim(d, ddim, s, sdim, rs, factor, f"dst_tensors[{k}]")
        so, do, size = _refine(rs, rd)
    except BlockLayoutError:
        raise mismatch from None
    return rs, rd, so, do, size


def pair_regions(src_tensors: Sequence[Any], dst_tensors: Sequence[Any], block_dim: BlockDim) -> DescriptorTemplate:
    """Derive, once, the descriptor template of ``src_tensors[k] -> dst_tensors[k]``.

    A pair's blocks may differ in size when one side's are k whole times the other's
    (vLLM's ``block_size_factor``): the larger block is cut into k sub-blocks along the
    dimension whose size is k times the other side's (the tokens of a block), and ids on
    both sides count the smaller block. Every pair must have the same k on the same side.

    :raises BlockLayoutError: a tensor's blocks are not contiguous chunks; a pair differs
        in dtype (other than a ``torch.uint8`` byte pool on one side), in block shape with
        other chunks (and is no whole multiple), or in the order a block's elements are stored; tensors on
        one side hold different numbers of blocks; or two destination tensors share memory.
    """
    dims = block_dims(block_dim, len(src_tensors))
    rows, src_counts, dst_counts, factors = [], set(), set(), set()
    for k, (s, d) in enumerate(zip(src_tensors, dst_tensors)):
        if s.dtype != d.dtype and "torch.uint8" not in (str(s.dtype), str(d.dtype)):
            raise BlockLayoutError(
                f"src_tensors[{k}] is {s.dtype} but dst_tensors[{k}] is {d.dtype}; a byte copy would "
                f"reinterpret the values (use torch.uint8 on one side for a raw byte pool)"
            )
        rs, rd, so_list, do_list, size = _pair(k, s, d, *dims[k])
        src_counts.add(rs.ids)
        dst_counts.add(rd.ids)
        factors.add((rs.factor, rd.factor))
        for so, do in zip(so_list, do_list):
            rows.append((rs.base + so, rs.stride, rd.base + do, rd.stride, size, k, rs.sub_step, rd.sub_step))
    for side, counts in (("src", src_counts), ("dst", dst_counts)):
        if len(counts) > 1:
            raise BlockLayoutError(
                f"the {side} tensors hold different numbers of blocks ({sorted(counts)}); every tensor of a "
                f"side must hold the same blocks, since one id addresses a block in all of them"
            )
    if len(factors) > 1:
        raise BlockLayoutError(
            "the tensor pairs differ in how many blocks of one side make a block of the other "
            f"((src, dst) sub-blocks per block: {sorted(factors)}); ids count one block size for every pair"
        )
    (sf, df), = factors
    cols = [np.ascontiguousarray(c) for c in np.array(rows, dtype=np.int64).T]
    template = DescriptorTemplate(*cols[:6], src_counts.pop(), dst_counts.pop(),
                                  src_sub=cols[6], dst_sub=cols[7], src_factor=sf, dst_factor=df)
    template = replace(template, dst_may_meet=_check_aliasing(template))
    return _best_order(template)


def _probe(t: DescriptorTemplate, src_ids: np.ndarray, dst_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    out = np.empty((3, t.count * len(src_ids)), dtype=np.int64)
    m = t.fill(src_ids, dst_ids, out)
    return out[0, :m], out[1, :m], out[2, :m]


def _check_aliasing(t: DescriptorTemplate) -> bool:
    """Refuse destination tensors that share memory (the same tensor passed twice, views
    of one buffer that overlap): the result would depend on the order of the copies.
    Exact for pieces of one block stride; returns whether pieces may still meet (views cut
    with two strides), which is left to each job's check (:func:`jobs_overlap`)."""
    dst = side_pieces(t, dst=True)
    certain, possible = meeting(dst, dst, same=True)
    if certain.any():
        a, b = np.argwhere(certain)[0]
        i, j = sorted((int(dst.tensor[a]), int(dst.tensor[b])))
        which = f"dst_tensors[{i}] and dst_tensors[{j}]" if i != j else f"chunks of dst_tensors[{i}]"
        raise BlockLayoutError(f"{which} share memory; each destination byte must be written once")
    return bool(possible.any())


def jobs_overlap(templates: Sequence[DescriptorTemplate]) -> bool:
    """Whether a job's blocks may overlap in memory though the layout was accepted: a
    destination block with a source block (the two sides share memory, as a
    device-to-device mover within one cache does), or with another destination block of
    its group (views of one buffer cut with different strides). Such a mover checks every
    job's descriptors before it enqueues anything."""
    if any(t.dst_may_meet for t in templates):
        return True
    src, dst = ([side_pieces(t, dst=side) for t in templates] for side in (False, True))
    joined = [Pieces(*(np.concatenate(parts) for parts in zip(*side))) for side in (src, dst)]
    return spans_meet(*joined) and any(m.any() for m in meeting(*joined, same=False))


def _best_order(t: DescriptorTemplate) -> DescriptorTemplate:
    """Order descriptors so that the common contiguity of the layout coalesces: a block's
    pieces side by side when they are adjacent in memory (per-layer views of a cross-layer
    tensor), else each piece's ids side by side (consecutive ids of one tensor)."""
    if t.count < 2 or min(t.src_blocks, t.dst_blocks) < 2:
        return t
    ids = np.arange(2, dtype=np.int64)
    merged = {major: len(merge_runs(*_probe(t.with_order(major), ids, ids))[2]) for major in (False, True)}
    return t.with_order(merged[True] < merged[False])
