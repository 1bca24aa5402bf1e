"""Buffers and layouts for the conformance suite: random sources, poisoned destinations,
and a check of every byte of both buffers after a transfer.

Each side of a transfer is one torch ``uint8`` buffer: host memory (pinned when the device
is an accelerator) or device memory, as the direction says. Blocks sit at scattered
offsets with guard bytes before and after each one, so a write past either end of a block
lands on bytes the check knows must not change.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..types import Direction

# Guard bytes on each side of a block: a backend that writes one byte too many (or too
# early) hits one of them. Rounded up to the impl's alignment so blocks stay aligned.
GUARD = 16


def round_up(values: Any, multiple: int) -> Any:
    return (values + multiple - 1) // multiple * multiple


def ranges(offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Every byte index covered by the blocks ``[offsets[i], offsets[i] + sizes[i])``, concatenated."""
    total = int(sizes.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    starts = np.cumsum(sizes) - sizes
    return np.repeat(offsets - starts, sizes) + np.arange(total, dtype=np.int64)


@dataclass(frozen=True)
class Layout:
    """Where each block sits inside a buffer of ``nbytes`` bytes."""

    offsets: np.ndarray
    nbytes: int


def scattered(rng: np.random.Generator, sizes: np.ndarray, alignment: int) -> Layout:
    """Blocks in random order, each in its own slot at a random aligned offset, with at
    least ``GUARD`` bytes before it and at least one byte after it that belong to no block."""
    sizes = np.asarray(sizes, dtype=np.int64)
    guard = int(round_up(max(GUARD, alignment), alignment))
    slots = round_up(sizes, alignment) + 2 * guard
    order = rng.permutation(len(sizes))
    starts = np.empty(len(sizes), dtype=np.int64)
    starts[order] = np.cumsum(slots[order]) - slots[order]
    jitter = rng.integers(0, guard // alignment, size=len(sizes)) * alignment
    return Layout(starts + guard + jitter, int(slots.sum()) + guard)


def adjacent_runs(rng: np.random.Generator, size: int, runs: int, run_len: int, alignment: int) -> Layout:
    """``runs * run_len`` blocks of ``size`` bytes, each run contiguous (block i+1 starts
    where block i ends) and the runs scattered: what a coalescing backend must get right."""
    outer = scattered(rng, np.full(runs, size * run_len, dtype=np.int64), alignment)
    inner = np.arange(run_len, dtype=np.int64) * size
    return Layout((outer.offsets[:, None] + inner[None, :]).reshape(-1), outer.nbytes)


class Buffer:
    """One side of a transfer: ``nbytes`` usable bytes starting at an aligned address."""

    def __init__(self, nbytes: int, torch_device: str, pinned: bool, alignment: int) -> None:
        import torch

        pad = max(alignment, 256)
        kwargs: dict[str, Any] = {"dtype": torch.uint8}
        if torch_device == "cpu":
            kwargs["pin_memory"] = pinned
        else:
            kwargs["device"] = torch_device
        self._storage = torch.empty(nbytes + pad, **kwargs)
        skip = (-self._storage.data_ptr()) % pad
        self.tensor = self._storage[skip: skip + nbytes]
        self.base = self._storage.data_ptr() + skip

    def fill(self, data: np.ndarray) -> None:
        import torch

        self.tensor.copy_(torch.from_numpy(data))

    def read(self) -> np.ndarray:
        return self.tensor.cpu().numpy().copy()


def synchronize(torch_device: str) -> None:
    """Wait for all work on the device (a no-op for host-only devices)."""
    if torch_device == "cpu":
        return
    import torch

    dev = torch.device(torch_device)
    getattr(torch, dev.type).synchronize(dev)


@dataclass
class Transfer:
    """A batch of descriptors between two freshly filled buffers, and its byte-exact check.

    The source holds random bytes; the destination is poisoned with other random bytes
    first. After the copy every destination byte must equal the source block it belongs
    to, or its poison if it belongs to none; every source byte must be unchanged.
    """

    src: Buffer
    dst: Buffer
    src_offsets: np.ndarray
    dst_offsets: np.ndarray
    sizes: np.ndarray
    src_data: np.ndarray
    dst_poison: np.ndarray
    torch_device: str
    seed: int

    @property
    def descriptors(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.src.base + self.src_offsets, self.dst.base + self.dst_offsets, self.sizes.copy()

    def expected(self) -> np.ndarray:
        out = self.dst_poison.copy()
        out[ranges(self.dst_offsets, self.sizes)] = self.src_data[ranges(self.src_offsets, self.sizes)]
        return out

    def check(self, what: str) -> None:
        """Assert the copy happened exactly; the message locates the first wrong byte."""
        synchronize(self.torch_device)
        self._compare(self.dst.read(), self.expected(), "destination", what)
        self._compare(self.src.read(), self.src_data, "source", what)

    def check_untouched(self, what: str) -> None:
        """Assert no byte of either buffer changed (a refused transfer)."""
        synchronize(self.torch_device)
        self._compare(self.dst.read(), self.dst_poison, "destination", what)
        self._compare(self.src.read(), self.src_data, "source", what)

    def _compare(self, got: np.ndarray, want: np.ndarray, side: str, what: str) -> None:
        bad = np.flatnonzero(got != want)
        if not len(bad):
            return
        at = int(bad[0])
        offsets = self.dst_offsets if side == "destination" else self.src_offsets
        inside = np.flatnonzero((offsets <= at) & (at < offsets + self.sizes))
        if len(inside):
            i = int(inside[0])
            where = (f"byte {at - int(offsets[i])} of descriptor {i} "
                     f"(of {len(self.sizes)}, size {int(self.sizes[i])})")
        else:
            where = "a byte outside every block (a write beyond a descriptor's range)"
        raise AssertionError(
            f"{what}: {len(bad)} byte(s) of the {side} differ from what they must hold; the first is "
            f"{where}, offset {at}: got {int(got[at])}, want {int(want[at])} "
            f"[{len(self.sizes)} descriptors, sizes {sorted(set(self.sizes.tolist()))[:8]}, seed {self.seed}]"
        )


def make_transfer(
    rng: np.random.Generator,
    seed: int,
    direction: Direction,
    torch_device: str,
    alignment: int,
    sizes: np.ndarray,
    src_layout: Optional[Layout] = None,
    dst_layout: Optional[Layout] = None,
) -> Transfer:
    """Allocate both sides for ``direction`` on ``torch_device``, fill and poison them.

    On a host-only device both sides are host memory; on an accelerator the host side is
    pinned and the other side is device memory.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    src_layout = src_layout or scattered(rng, sizes, alignment)
    dst_layout = dst_layout or scattered(rng, sizes, alignment)
    accel = torch_device != "cpu"
    src_where = "cpu" if direction.src_is_host or not accel else torch_device
    dst_where = "cpu" if direction.dst_is_host or not accel else torch_device
    src = Buffer(src_layout.nbytes, src_where, pinned=accel and src_where == "cpu", alignment=alignment)
    dst = Buffer(dst_layout.nbytes, dst_where, pinned=accel and dst_where == "cpu", alignment=alignment)
    src_data = rng.integers(0, 256, size=src_layout.nbytes, dtype=np.uint8)
    poison = rng.integers(0, 256, size=dst_layout.nbytes, dtype=np.uint8)
    # Every byte a block must overwrite starts out different from what it must become,
    # so even one byte the backend skips shows.
    into, out_of = ranges(dst_layout.offsets, sizes), ranges(src_layout.offsets, sizes)
    poison[into] = src_data[out_of] ^ rng.integers(1, 256, size=len(into), dtype=np.uint8)
    src.fill(src_data)
    dst.fill(poison)
    synchronize(torch_device)
    return Transfer(src, dst, src_layout.offsets, dst_layout.offsets, sizes, src_data, poison, torch_device, seed)
