"""Where a block lives in a KV tensor, and how a list of block ids becomes descriptors.

Derived once per mover: for every tensor, the block stride and the contiguous chunks a
block is made of; for every (src, dst) pair, one "piece" per chunk with its address in
block 0 and its block stride on each side. Per submit, descriptors are then a single
broadcast ``base[piece] + id * stride[piece]`` over all pieces and ids, written straight
into the caller's (pinned) buffer: no per-layer or per-block Python work.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, Union

import numpy as np

from .descriptors import coalesce, first_overlap
from .errors import BlockLayoutError

BlockDim = Union[int, tuple[int, int]]


@dataclass(frozen=True)
class BlockRegions:
    """The bytes of block ``i`` of one tensor: chunk ``c`` starts at
    ``base + offsets[c] + i * stride`` and is ``chunk_bytes`` long.

    ``shape`` and ``order`` describe one block (size-1 dims dropped): its logical shape
    and its dims from innermost to outermost in memory, to tell a pair that stores a
    block's elements in different orders.
    """

    base: int
    stride: int
    num_blocks: int
    offsets: tuple[int, ...]
    chunk_bytes: int
    shape: tuple[int, ...]
    order: tuple[int, ...]


def block_regions(tensor: Any, block_dim: int, what: str) -> BlockRegions:
    """Cut the blocks of ``tensor`` (indexed along ``block_dim``) into contiguous chunks.

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
    )


@dataclass(frozen=True, eq=False)
class DescriptorTemplate:
    """Every chunk of every (src, dst) pair, as arrays over pieces, ready to broadcast.

    Piece ``p`` of block ids ``(i, j)`` copies ``sizes[p]`` bytes from
    ``src_base[p] + i * src_stride[p]`` to ``dst_base[p] + j * dst_stride[p]``.
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "_filler", _Filler(self))
        object.__setattr__(self, "block_bytes", int(self.sizes.sum()))  # bytes one block id moves

    @property
    def count(self) -> int:
        return len(self.sizes)

    @property
    def chunk_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.sizes.tolist())))

    def fill(self, src_ids: np.ndarray, dst_ids: np.ndarray, out: np.ndarray) -> int:
        """Write the descriptors of ``len(src_ids)`` block pairs into ``out[0..2, :m]``
        (src, dst, sizes) and return ``m``. Ids must already be validated."""
        return self._filler(src_ids, dst_ids, out)

    def with_order(self, id_major: bool) -> DescriptorTemplate:
        return DescriptorTemplate(self.src_base, self.src_stride, self.dst_base, self.dst_stride,
                                  self.sizes, self.pair, self.src_blocks, self.dst_blocks, id_major)


class _Filler:
    """``DescriptorTemplate.fill`` with its broadcast shapes and constants bound once."""

    def __init__(self, t: DescriptorTemplate) -> None:
        axis = (None, slice(None)) if t.id_major else (slice(None), None)
        self.id_major = t.id_major
        self.count = t.count
        self.src = _side(t.src_base, t.src_stride, axis)
        self.dst = _side(t.dst_base, t.dst_stride, axis)
        size0 = int(t.sizes[0])
        self.size = size0 if (t.sizes == size0).all() else None
        self.size_grid = t.sizes[axis]

    def __call__(self, src_ids: np.ndarray, dst_ids: np.ndarray, out: np.ndarray) -> int:
        n = len(src_ids)
        m = n * self.count
        shape = (n, self.count) if self.id_major else (self.count, n)
        self._place(out[0, :m].reshape(shape), src_ids, *self.src)
        self._place(out[1, :m].reshape(shape), dst_ids, *self.dst)
        if self.size is not None:
            out[2, :m].fill(self.size)
        else:
            np.copyto(out[2, :m].reshape(shape), self.size_grid)
        return m

    def _place(self, out: np.ndarray, ids: np.ndarray, base: np.ndarray, step: Any, stride: np.ndarray) -> None:
        ids = ids[:, None] if self.id_major else ids[None, :]
        if step is not None:  # one stride for every piece: scale the few ids, then one add
            np.add(base, ids * step, out=out)
        else:
            np.multiply(ids, stride, out=out)
            np.add(out, base, out=out)


def _side(base: np.ndarray, stride: np.ndarray, axis: tuple) -> tuple[np.ndarray, Any, np.ndarray]:
    step = int(stride[0]) if (stride == stride[0]).all() else None
    return base[axis], step, stride[axis]


def _as_pair(block_dim: BlockDim) -> tuple[int, int]:
    if isinstance(block_dim, bool):
        raise BlockLayoutError(f"block_dim={block_dim!r} must be an int or a (src, dst) pair of ints")
    if isinstance(block_dim, int):
        return block_dim, block_dim
    if (isinstance(block_dim, tuple) and len(block_dim) == 2
            and all(isinstance(d, int) and not isinstance(d, bool) for d in block_dim)):
        return block_dim
    raise BlockLayoutError(f"block_dim={block_dim!r} must be an int or a (src, dst) pair of ints")


def pair_regions(src_tensors: Sequence[Any], dst_tensors: Sequence[Any], block_dim: BlockDim) -> DescriptorTemplate:
    """Derive, once, the descriptor template of ``src_tensors[k] -> dst_tensors[k]``.

    :raises BlockLayoutError: a tensor's blocks are not contiguous chunks; a pair differs
        in dtype (other than a ``torch.uint8`` byte pool on one side), in chunk sizes or in
        the order a block's elements are stored; tensors on one side hold different numbers
        of blocks; or two destination tensors share memory.
    """
    sdim, ddim = _as_pair(block_dim)
    rows, src_counts, dst_counts = [], set(), set()
    for k, (s, d) in enumerate(zip(src_tensors, dst_tensors)):
        if s.dtype != d.dtype and "torch.uint8" not in (str(s.dtype), str(d.dtype)):
            raise BlockLayoutError(
                f"src_tensors[{k}] is {s.dtype} but dst_tensors[{k}] is {d.dtype}; a byte copy would "
                f"reinterpret the values (use torch.uint8 on one side for a raw byte pool)"
            )
        rs = block_regions(s, sdim, f"src_tensors[{k}]")
        rd = block_regions(d, ddim, f"dst_tensors[{k}]")
        if len(rs.offsets) != len(rd.offsets) or rs.chunk_bytes != rd.chunk_bytes:
            raise BlockLayoutError(
                f"pair {k}: a src block is {len(rs.offsets)} chunk(s) of {rs.chunk_bytes} bytes but a dst block "
                f"is {len(rd.offsets)} chunk(s) of {rd.chunk_bytes} bytes; chunk sizes must match "
                f"(src shape {tuple(s.shape)}, dst shape {tuple(d.shape)})"
            )
        if rs.shape == rd.shape and rs.order != rd.order:
            raise BlockLayoutError(
                f"pair {k}: src and dst blocks have the same shape {rs.shape} but store its elements in "
                f"different orders (strides {tuple(s.stride())} vs {tuple(d.stride())}); a byte copy would "
                f"scramble them"
            )
        src_counts.add(rs.num_blocks)
        dst_counts.add(rd.num_blocks)
        for so, do in zip(rs.offsets, rd.offsets):
            rows.append((rs.base + so, rs.stride, rd.base + do, rd.stride, rs.chunk_bytes, k))
    for side, counts in (("src", src_counts), ("dst", dst_counts)):
        if len(counts) > 1:
            raise BlockLayoutError(
                f"the {side} tensors hold different numbers of blocks ({sorted(counts)}); every tensor of a "
                f"side must hold the same blocks, since one id addresses a block in all of them"
            )
    cols = np.array(rows, dtype=np.int64).T
    template = DescriptorTemplate(*(np.ascontiguousarray(c) for c in cols), src_counts.pop(), dst_counts.pop())
    _check_aliasing(template)
    return _best_order(template)


def _probe(t: DescriptorTemplate, src_ids: np.ndarray, dst_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    out = np.empty((3, t.count * len(src_ids)), dtype=np.int64)
    m = t.fill(src_ids, dst_ids, out)
    return out[0, :m], out[1, :m], out[2, :m]


def _check_aliasing(t: DescriptorTemplate) -> None:
    """Refuse destination tensors that share memory (the same tensor passed twice, views
    of one buffer that overlap): the result would depend on the order of the copies.
    Checked on the first, second and last destination block, where such mistakes show."""
    dst_ids = np.unique(np.array([0, 1, t.dst_blocks - 1], dtype=np.int64).clip(0, t.dst_blocks - 1))
    _, dst, sizes = _probe(t, np.zeros_like(dst_ids), dst_ids)
    clash = first_overlap(dst, sizes)
    if clash is not None:
        i, j = (int(t.pair[c // len(dst_ids)]) for c in clash)  # piece-major: built before ordering
        which = f"dst_tensors[{i}] and dst_tensors[{j}]" if i != j else f"chunks of dst_tensors[{i}]"
        raise BlockLayoutError(f"{which} share memory; each destination byte must be written once")


def _best_order(t: DescriptorTemplate) -> DescriptorTemplate:
    """Order descriptors so that the common contiguity of the layout coalesces: a block's
    pieces side by side when they are adjacent in memory (per-layer views of a cross-layer
    tensor), else each piece's ids side by side (consecutive ids of one tensor)."""
    if t.count < 2 or min(t.src_blocks, t.dst_blocks) < 2:
        return t
    ids = np.arange(2, dtype=np.int64)
    merged = {major: len(coalesce(*_probe(t.with_order(major), ids, ids))[2]) for major in (False, True)}
    return t.with_order(merged[True] < merged[False])
