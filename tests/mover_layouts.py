"""KV layouts and byte-exact reference checks shared by the BlockMover tests.

Every tensor is a view into a flat uint8 allocation with random guard bytes on both
sides, so a check of the whole allocation covers the copied blocks, the blocks that must
stay untouched and the bytes just outside the tensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

GUARD = 256  # bytes before and after each tensor; keeps 256-byte alignment for kernels
INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Layout:
    """A KV layout: ``groups`` allocations of ``shape(num_blocks)``, each cut into tensors by ``views``."""

    name: str
    dtype: torch.dtype
    block_dim: int
    groups: int
    shape: Callable[[int], tuple[int, ...]]
    views: Callable[[torch.Tensor], list[torch.Tensor]]


def layouts(bs: int = 4, heads: int = 2, head_dim: int = 16, layers: int = 3) -> dict[str, Layout]:
    return {
        # vLLM FlashAttention: per layer (2, num_blocks, block_size, heads, head_dim); K and V split.
        "flash": Layout("flash", torch.bfloat16, 1, layers,
                        lambda nb: (2, nb, bs, heads, head_dim), lambda t: [t]),
        # MLA: per layer (num_blocks, block_size, kv_lora_rank + rope_dim); one chunk per block.
        "mla": Layout("mla", torch.float16, 0, layers + 1,
                      lambda nb: (nb, bs, 4 * head_dim + 8), lambda t: [t]),
        # vLLM cross-layer blocks: one tensor, every layer's K and V of a block side by side.
        "cross": Layout("cross", torch.bfloat16, 0, 1,
                        lambda nb: (nb, layers, 2, bs, heads, head_dim), lambda t: [t]),
        # The same memory as each attention layer sees it: FlashAttention-shaped views
        # (2, num_blocks, ...) of the cross-layer tensor, one per layer.
        "cross_views": Layout("cross_views", torch.bfloat16, 1, 1,
                              lambda nb: (nb, layers, 2, bs, heads, head_dim),
                              lambda t: [t[:, k].permute(1, 0, 2, 3, 4) for k in range(t.shape[1])]),
    }


def random_bytes(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)


class Pool:
    """The tensors of one side of a mover, and the flat allocations behind them."""

    def __init__(self, layout: Layout, num_blocks: int, gen: torch.Generator,
                 device: str = "cpu", pinned: bool = False) -> None:
        self.layout, self.num_blocks = layout, num_blocks
        shape = layout.shape(num_blocks)
        self.nbytes = int(np.prod(shape)) * torch.empty((), dtype=layout.dtype).element_size()
        self.flats = []
        for _ in range(layout.groups):
            data = random_bytes(self.nbytes + 2 * GUARD, gen)
            if device != "cpu":
                data = data.to(device)
            elif pinned:
                data = data.pin_memory()
            self.flats.append(data)
        self.tensors = self.views(self.flats)

    def views(self, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        shape = self.layout.shape(self.num_blocks)
        out = []
        for flat in flats:
            typed = flat[GUARD:GUARD + self.nbytes].view(self.layout.dtype).view(shape)
            out.extend(self.layout.views(typed))
        return out

    def snapshot(self) -> list[torch.Tensor]:
        """Host copies of every allocation, guards included."""
        return [f.detach().to("cpu", copy=True) for f in self.flats]

    def matches(self, expected: list[torch.Tensor]) -> bool:
        return all(torch.equal(f.cpu(), e) for f, e in zip(self.flats, expected))


def pool_pair(layout: Layout, seed: int, src_blocks: int, dst_blocks: int) -> tuple[Pool, Pool]:
    """Host pools of ``layout`` filled from one seeded generator: (source, destination)."""
    gen = torch.Generator().manual_seed(seed)
    return Pool(layout, src_blocks, gen), Pool(layout, dst_blocks, gen)


def random_ids(rng: np.random.Generator, n: int, src: Pool, dst: Pool) -> tuple[np.ndarray, np.ndarray]:
    """``n`` distinct random source and destination block ids (int64)."""
    return (rng.choice(src.num_blocks, n, replace=False).astype(np.int64),
            rng.choice(dst.num_blocks, n, replace=False).astype(np.int64))


def expected_after(dst: Pool, before: list[torch.Tensor], src_snapshot: list[torch.Tensor], src: Pool,
                   jobs: list[tuple[np.ndarray, np.ndarray]]) -> list[torch.Tensor]:
    """What ``dst``'s allocations hold after ``jobs`` (in order), by torch indexing:
    block ``did[i]`` of every destination tensor becomes block ``sid[i]`` of its source."""
    exp = [b.clone() for b in before]
    exp_views, src_views = dst.views(exp), src.views(src_snapshot)
    bd_d, bd_s = dst.layout.block_dim, src.layout.block_dim
    for sid, did in jobs:
        s_idx, d_idx = torch.as_tensor(np.asarray(sid, dtype=np.int64)), torch.as_tensor(np.asarray(did, dtype=np.int64))
        for e, s in zip(exp_views, src_views):
            as_int = INT_OF[e.element_size()]
            e.view(as_int).index_copy_(bd_d, d_idx, s.view(as_int).index_select(bd_s, s_idx))
    return exp
