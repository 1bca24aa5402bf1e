"""``kvswap.host_cache``: a block-major pinned host cache for a set of device KV tensors.

Host block ``i`` is one contiguous region that holds device block ``i`` of every tensor,
one tensor after another. A device cache keeps each layer apart (and often K and V apart),
so one block is many small chunks there; on the host the same block is one run of bytes,
and a copy over the link moves it whole: one descriptor per block instead of one per chunk,
at the size where the copy engines reach the link's speed. The views it hands out have each
device tensor's dtype and shape, so a :class:`~kvswap.BlockMover` pairs them element by
element with the device tensors, whatever the device layout. :func:`block_major_layout`
gives the same views over a buffer allocated elsewhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from ..errors import BlockLayoutError, ConfigurationError
from .host_memory import host_empty

__all__ = ["BlockMajorLayout", "HostCache", "block_major_layout", "host_cache"]


@dataclass(frozen=True, eq=False)
class HostCache:
    """A block-major host cache: ``buffer[i]`` is host block ``i``, and ``views[k]`` reads
    tensor ``k``'s share of every block in that tensor's dtype and shape.

    :ivar buffer: a ``torch.uint8`` tensor of shape ``(num_blocks, block_bytes)``.
    :ivar views: one tensor per device tensor, its shape with ``num_blocks`` along the
        block dimension; pass them as a mover's host side.
    :ivar offsets: where tensor ``k``'s bytes start inside a host block.
    """

    buffer: Any
    views: tuple[Any, ...]
    offsets: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return int(self.buffer.shape[0])

    @property
    def block_bytes(self) -> int:
        """Bytes of one host block: every tensor's block, each aligned to its element size."""
        return int(self.buffer.shape[1])


def _block_dim_list(block_dim: Union[int, Sequence[int]], n: int) -> list[int]:
    dims = list(block_dim) if isinstance(block_dim, (list, tuple)) else [block_dim] * n
    if len(dims) != n or any(isinstance(d, bool) or not isinstance(d, int) for d in dims):
        raise BlockLayoutError(f"block_dim={block_dim!r} must be an int, or a list of {n} ints (one per tensor)")
    return dims


def _memory_order(t: Any, b: int) -> list[int]:
    """A block's dimensions of ``t`` from outermost to innermost in memory (size-1
    dimensions where they stand logically), so the host block keeps the device's element
    order and the pieces paired with it are as long as the device's chunks."""
    dims = [i for i in range(t.dim()) if i != b]
    return sorted(dims, key=lambda i: (-t.stride(i) if t.shape[i] > 1 else 0, i))


def _tensor_list(device_tensors: Any) -> list:
    import torch

    tensors = list(device_tensors) if isinstance(device_tensors, (list, tuple)) else [device_tensors]
    if not tensors:
        raise BlockLayoutError("device_tensors is empty; give one tensor per layer (or per K/V plane)")
    for k, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise BlockLayoutError(f"device_tensors[{k}] is a {type(t).__name__}, not a torch.Tensor")
        if t.is_nested or t.layout != torch.strided:
            kind = "nested" if t.is_nested else str(t.layout)
            raise BlockLayoutError(f"device_tensors[{k}] is a {kind} tensor; a host cache mirrors dense (strided) ones")
    return tensors


@dataclass(frozen=True, eq=False)
class BlockMajorLayout:
    """Where each device tensor's share lies in a block-major host block, and how to read it.

    :ivar block_bytes: bytes of one host block: every tensor's block, each aligned to its
        element size.
    :ivar offsets: where tensor ``k``'s bytes start inside a host block.
    """

    block_bytes: int
    offsets: tuple[int, ...]
    _parts: tuple[tuple[Any, tuple[int, ...], int, tuple[int, ...], int], ...]  # dtype, shape, dim, order, bytes

    def over(self, buffer: Any) -> HostCache:
        """The cache over ``buffer``, a contiguous ``torch.uint8`` tensor of shape
        ``(num_blocks, block_bytes)`` on any device: ``views[k]`` has tensor ``k``'s dtype
        and shape with ``num_blocks`` along its block dimension.

        :raises BlockLayoutError: ``buffer`` is not such a tensor.
        """
        import torch

        if (not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.dim() != 2
                or buffer.shape[1] != self.block_bytes or not buffer.is_contiguous()):
            got = (f"{tuple(buffer.shape)} {buffer.dtype}" if isinstance(buffer, torch.Tensor)
                   else type(buffer).__name__)
            raise BlockLayoutError(f"buffer is {got}; give a contiguous torch.uint8 tensor of shape "
                                   f"(num_blocks, {self.block_bytes})")
        num_blocks = int(buffer.shape[0])
        views = []
        for (dtype, shape, b, order, nbytes), off in zip(self._parts, self.offsets):
            flat = buffer[:, off:off + nbytes].view(dtype)
            stored = flat.view(num_blocks, *(shape[i] for i in order))  # [block] + memory order
            axes = [b, *order]
            views.append(stored.permute(*[axes.index(i) for i in range(len(shape))]))
        return HostCache(buffer=buffer, views=tuple(views), offsets=self.offsets)


def _layout(tensors: list, block_dim: Union[int, Sequence[int]]) -> BlockMajorLayout:
    dims = _block_dim_list(block_dim, len(tensors))
    parts, offsets, offset, align = [], [], 0, 1
    for k, (t, b) in enumerate(zip(tensors, dims)):
        if not -t.dim() <= b < t.dim():
            raise BlockLayoutError(f"block_dim={b} is out of range for device_tensors[{k}] of shape {tuple(t.shape)}")
        b %= t.dim()
        item = t.element_size()
        offset = -(-offset // item) * item
        nbytes = t[(slice(None),) * b + (0,)].numel() * item if t.shape[b] else 0
        if nbytes == 0:
            raise BlockLayoutError(f"device_tensors[{k}] of shape {tuple(t.shape)} has empty blocks")
        parts.append((t.dtype, tuple(t.shape), b, tuple(_memory_order(t, b)), nbytes))
        offsets.append(offset)
        offset += nbytes
        align = max(align, item)
    return BlockMajorLayout(block_bytes=-(-offset // align) * align, offsets=tuple(offsets), _parts=tuple(parts))


def block_major_layout(device_tensors: Sequence[Any], *, block_dim: Union[int, Sequence[int]] = 0) -> BlockMajorLayout:
    """The layout :func:`host_cache` gives a host block of ``device_tensors``, for a buffer
    allocated elsewhere (``layout.over(buffer)``): the same views over any byte buffer of
    ``(num_blocks, layout.block_bytes)``, a device-side mirror of a host cache included.

    :param device_tensors, block_dim: as for :func:`host_cache`.
    :raises BlockLayoutError: as :func:`host_cache` does for these arguments.
    """
    return _layout(_tensor_list(device_tensors), block_dim)


def host_cache(device_tensors: Sequence[Any], num_blocks: int, *, block_dim: Union[int, Sequence[int]] = 0,
               pin: bool = True, node: Optional[int] = None) -> HostCache:
    """Allocate a block-major host cache of ``num_blocks`` blocks for ``device_tensors``.

    :param device_tensors: the device side's KV tensors (one per layer, K/V plane or group
        member), all on one device; each may have its own dtype, shape and layout.
    :param num_blocks: host blocks to allocate.
    :param block_dim: the dimension that indexes blocks: an int for every tensor, or one
        int per tensor (as :class:`~kvswap.BlockMover` takes it).
    :param pin: page-lock (and map) the buffer, as every device route needs.
    :param node: place it on this NUMA node instead of the device's.
    :raises BlockLayoutError: no tensors, a tensor that is not a torch.Tensor, a bad
        ``block_dim``, or tensors on different devices.
    :raises ConfigurationError: ``num_blocks`` is not a positive int; see
        :func:`kvswap.host_empty` for placement and pinning.

    The buffer comes from :func:`kvswap.host_empty`: pinned, on the NUMA node of the
    tensors' device. ``views[k][..., i, ...]`` (block ``i`` along tensor ``k``'s block
    dimension) lies inside ``buffer[i]``.
    """
    import torch

    tensors = _tensor_list(device_tensors)
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
        raise ConfigurationError(f"num_blocks={num_blocks!r} must be an int >= 1")
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise BlockLayoutError(f"device_tensors are on {sorted(map(str, devices))}; a host cache feeds one device")
    layout = _layout(tensors, block_dim)
    buffer = host_empty((num_blocks, layout.block_bytes), torch.uint8, device=next(iter(devices)), pin=pin, node=node)
    return layout.over(buffer)
