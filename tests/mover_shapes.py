"""KV caches of several layouts and block sizes, and a reference copy by torch indexing.

Each side's tensors are views into flat uint8 allocations with random guard bytes on
both sides and, optionally, padding after every block row (a block stride larger than
the block), so comparing whole allocations checks the copied blocks, the blocks that must
stay untouched, the padding and the bytes just outside each tensor.

A cache's blocks hold ``tokens`` tokens; with ``factor`` k a side's blocks hold k times
as many, and ids count the smaller blocks: id ``i`` on such a side is tokens
``[(i % k) * tokens, (i % k + 1) * tokens)`` of block ``i // k``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GUARD = 256
INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Kind:
    """A layout: the block dim, the token dim and the shape for ``nb`` blocks of ``t`` tokens."""

    name: str
    block_dim: int
    token_dim: int
    dtype: torch.dtype
    heads: int = 2
    head_dim: int = 16

    def shape(self, nb: int, t: int) -> tuple[int, ...]:
        h, d = self.heads, self.head_dim
        return {"flash": (2, nb, t, h, d), "flashinfer": (nb, 2, t, h, d), "mla": (nb, t, 4 * d + 8)}[self.name]


KINDS = {
    "flash": Kind("flash", 1, 2, torch.bfloat16),   # vLLM FlashAttention: K and V split on dim 0
    "flashinfer": Kind("flashinfer", 0, 2, torch.float16),  # FlashInfer: K and V inside each block
    "mla": Kind("mla", 0, 1, torch.bfloat16),       # MLA: one latent vector per token
}


class Side:
    """One side of a mover: one tensor per kind in ``kinds``, ``nb`` blocks of ``tokens``
    tokens each, every block row followed by ``pad`` bytes."""

    def __init__(self, kinds: list[Kind], nb: int, tokens: int, gen: torch.Generator,
                 pad: int = 0, device: str = "cpu", pinned: bool = False) -> None:
        self.kinds, self.nb, self.tokens, self.pad = kinds, nb, tokens, pad
        self.flats = []
        for k in kinds:
            data = torch.randint(0, 256, (self._bytes(k) + 2 * GUARD,), dtype=torch.uint8, generator=gen)
            if device != "cpu":
                data = data.to(device)
            elif pinned:
                data = data.pin_memory()
            self.flats.append(data)
        self.tensors = self.views(self.flats)

    def _row(self, k: Kind) -> tuple[int, int]:
        """(rows, bytes per row): a row holds one block (of one of K/V for flash)."""
        shape = k.shape(self.nb, self.tokens)
        item = torch.empty((), dtype=k.dtype).element_size()
        rows = 2 * self.nb if k.name == "flash" else self.nb
        return rows, int(np.prod(shape)) * item // rows

    def _bytes(self, k: Kind) -> int:
        rows, row = self._row(k)
        return rows * (row + self.pad)

    def views(self, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for k, flat in zip(self.kinds, flats):
            rows, row = self._row(k)
            body = flat[GUARD:GUARD + self._bytes(k)].view(rows, row + self.pad)[:, :row]
            typed = body.view(k.dtype)  # (rows, row elements), rows padded
            shape = k.shape(self.nb, self.tokens)
            if k.name == "flash":
                typed = typed.view(2, self.nb, -1)
            out.append(typed.view(shape))
        return out

    def snapshot(self) -> list[torch.Tensor]:
        return [f.detach().to("cpu", copy=True) for f in self.flats]

    def matches(self, expected: list[torch.Tensor]) -> bool:
        return all(torch.equal(f.cpu(), e) for f, e in zip(self.flats, expected))

    def block(self, t: torch.Tensor, k: Kind, i: int, small: int) -> torch.Tensor:
        """The (sub-)block id ``i`` addresses, ``small`` tokens long."""
        per = self.tokens // small
        b = t.select(k.block_dim, i // per)
        return b.narrow(k.token_dim - (k.token_dim > k.block_dim), (i % per) * small, small)


def expected_after(src: Side, src_snapshot: list[torch.Tensor], dst: Side, dst_before: list[torch.Tensor],
                   jobs: list[tuple[np.ndarray, np.ndarray]]) -> list[torch.Tensor]:
    """``dst``'s allocations after ``jobs``, copied (sub-)block by (sub-)block by indexing."""
    small = min(src.tokens, dst.tokens)
    exp = [b.clone() for b in dst_before]
    dviews, sviews = dst.views(exp), src.views(src_snapshot)
    for sid, did in jobs:
        for k_s, k_d, s, d in zip(src.kinds, dst.kinds, sviews, dviews):
            as_int = INT_OF[s.element_size()]
            for i, j in zip(np.asarray(sid).tolist(), np.asarray(did).tolist()):
                dst.block(d, k_d, j, small).view(as_int).copy_(src.block(s, k_s, i, small).view(as_int))
    return exp
