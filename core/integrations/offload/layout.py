"""What an offloading worker moves, read from an engine's description of its KV caches.

vLLM describes its caches as ``CanonicalKVCaches`` (``vllm/v1/kv_offload/base.py``): a list
of distinct tensors, each with blocks on its first dimension and a (possibly padded) page
size, and per KV group a list of references, one per layer, naming a tensor and the
un-padded page size of that layer. Layers may share one tensor (groups that overlay the
same memory); a reference is read only for its tensor index and page size here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ... import BlockLayoutError


@dataclass(frozen=True)
class CacheLayout:
    """The device side of an offloading worker.

    :ivar tensors: one int8 ``(num_blocks, page_bytes)`` view per tensor that some layer
        uses, cut to the largest un-padded page of its layers (padding is never moved).
    :ivar groups: per KV group, the indices into ``tensors`` that its layers use, each once.
    """

    tensors: tuple[Any, ...]
    groups: tuple[tuple[int, ...], ...]

    @property
    def block_bytes(self) -> int:
        """Bytes of one device block over every tensor: a host block's size."""
        return sum(int(t.shape[1]) for t in self.tensors)


def canonical_layout(kv_caches: Any) -> CacheLayout:
    """The tensors and groups to move, from an object with vLLM's ``CanonicalKVCaches``
    fields: ``tensors`` (each with ``.tensor`` and ``.page_size_bytes``) and
    ``group_data_refs`` (per group, references with ``.tensor_idx`` and ``.page_size_bytes``).

    :raises BlockLayoutError: a reference to a missing tensor, a page larger than its
        tensor's, a tensor whose blocks (its first dimension) are not pages of that size,
        or a group with no layer.
    """
    import torch

    entries = list(kv_caches.tensors)
    groups_refs = [list(refs) for refs in kv_caches.group_data_refs]
    if not groups_refs:
        raise BlockLayoutError("the KV caches name no KV group")
    used: dict[int, int] = {}  # tensor index -> the largest un-padded page of its layers
    for g, refs in enumerate(groups_refs):
        if not refs:
            raise BlockLayoutError(f"KV group {g} has no layer to move")
        for ref in refs:
            i, page = int(ref.tensor_idx), int(ref.page_size_bytes)
            if not 0 <= i < len(entries):
                raise BlockLayoutError(f"KV group {g} refers to tensor {i}; there are {len(entries)}")
            if page <= 0:
                raise BlockLayoutError(f"KV group {g}: a layer of tensor {i} has a page of {page} bytes")
            used[i] = max(used.get(i, 0), page)
    order = sorted(used)
    views = []
    for i in order:
        entry = entries[i]
        padded = int(entry.page_size_bytes)
        t = entry.tensor
        if not isinstance(t, torch.Tensor):
            raise BlockLayoutError(f"tensor {i} is a {type(t).__name__}, not a torch.Tensor")
        if used[i] > padded:
            raise BlockLayoutError(f"tensor {i} has pages of {padded} bytes but a layer's page takes {used[i]}")
        try:
            pages = t.view(torch.int8).view(-1, padded)
        except RuntimeError as e:
            raise BlockLayoutError(f"tensor {i} of shape {tuple(t.shape)} and strides {t.stride()} cannot be read "
                                   f"as blocks of {padded}-byte pages: {e}") from e
        # Blocks on the first dimension, a page each: anything else (K and V first, a page
        # size that is not the tensor's) would cut it into pages that are not its blocks.
        blocks = t.shape[0] if t.dim() else 0
        if pages.shape[0] != blocks:
            raise BlockLayoutError(f"tensor {i} ({t.dtype}, shape {tuple(t.shape)}) must hold one {padded}-byte page "
                                   f"per block of its first dimension ({blocks}); it holds {pages.shape[0]} such pages")
        views.append(pages[:, :used[i]])
    position = {i: k for k, i in enumerate(order)}
    groups = tuple(tuple(dict.fromkeys(position[int(r.tensor_idx)] for r in refs)) for refs in groups_refs)
    return CacheLayout(tuple(views), groups)
