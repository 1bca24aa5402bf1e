"""What calibration copies: scattered blocks between two pools filled with random data.

One pool on each side (pinned host memory and device memory on an accelerator; two host
buffers on a CPU-only machine). A batch picks ``n`` distinct slots at random on each side,
so neighbouring descriptors are almost never contiguous and nothing merges them: the
pattern of a KV cache after some churn. Random data, so a route that copies nothing or
the wrong bytes is caught by :meth:`Pools.check` instead of looking fast.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from kvswap.errors import KvSwapError
from kvswap.memory.host_memory import host_empty
from kvswap.types import DeviceInfo, Direction

from .timing import on_host

# Slots start on 64-byte boundaries, which every route's alignment rule we know of admits;
# all grid sizes (multiples of 512 B) are slots of exactly their own size.
SLOT_ALIGN = 64


@dataclass(frozen=True)
class Batch:
    """One batch of descriptors: offsets into the pools and the addresses a SwapFn takes."""

    direction: Direction
    block_bytes: int
    src_off: np.ndarray
    dst_off: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    sizes: np.ndarray

    @property
    def n(self) -> int:
        return len(self.sizes)

    @property
    def nbytes(self) -> int:
        return self.n * self.block_bytes


def slot_bytes(block_bytes: int) -> int:
    return -(-block_bytes // SLOT_ALIGN) * SLOT_ALIGN


class WrongResult(KvSwapError):
    """A route returned without copying the bytes it was given."""


class Pools:
    """A pool of ``pool_bytes`` on each side of the link, filled with random bytes."""

    def __init__(self, device: DeviceInfo, pool_bytes: int, seed: int = 0, host_node: Optional[int] = None) -> None:
        self.device = device
        self.pool_bytes = int(pool_bytes)
        self.host_only = on_host(device)
        self.rng = np.random.default_rng(seed)
        if self.host_only:
            self.host = self.rng.integers(0, 256, self.pool_bytes, dtype=np.uint8)
            self.dev = self.rng.integers(0, 256, self.pool_bytes, dtype=np.uint8)
            self.host_addr, self.dev_addr = int(self.host.ctypes.data), int(self.dev.ctypes.data)
        else:
            import torch

            where = torch.device(device.torch_device)
            gen = torch.Generator(device=where).manual_seed(seed)
            self.dev = torch.randint(0, 256, (self.pool_bytes,), dtype=torch.uint8, device=where, generator=gen)
            # Pinned (page-locked, mapped) host memory: what both the DMA engine and a
            # copy kernel need, on the device's NUMA node (or ``host_node``) as an engine's
            # would be; filled on the device, which is faster than a host RNG.
            self.host = host_empty(self.pool_bytes, torch.uint8, device=device, node=host_node)
            self.host.copy_(torch.randint(0, 256, (self.pool_bytes,), dtype=torch.uint8, device=where, generator=gen))
            torch.cuda.synchronize(where)
            self.host_addr, self.dev_addr = int(self.host.data_ptr()), int(self.dev.data_ptr())

    def sides(self, direction: Direction) -> tuple[Any, int, Any, int]:
        """``(src buffer, src address, dst buffer, dst address)`` for ``direction``."""
        if Direction.parse(direction) is Direction.H2D:
            return self.host, self.host_addr, self.dev, self.dev_addr
        return self.dev, self.dev_addr, self.host, self.host_addr

    def slots(self, block_bytes: int) -> int:
        return self.pool_bytes // slot_bytes(block_bytes)

    def batch(self, direction: Direction, block_bytes: int, n: int) -> Batch:
        """``n`` blocks of ``block_bytes`` at distinct random slots on each side."""
        direction = Direction.parse(direction)
        slots = self.slots(block_bytes)
        if not 1 <= n <= slots:
            raise ValueError(f"{n} blocks of {block_bytes} B do not fit a {self.pool_bytes} B pool ({slots} slots)")
        stride = slot_bytes(block_bytes)
        src_off = self.rng.choice(slots, n, replace=False).astype(np.int64) * stride
        dst_off = self.rng.choice(slots, n, replace=False).astype(np.int64) * stride
        _, sa, _, da = self.sides(direction)
        sizes = np.full(n, block_bytes, dtype=np.int64)
        return Batch(direction, block_bytes, src_off, dst_off, sa + src_off, da + dst_off, sizes)

    def contiguous(self, direction: Direction, nbytes: int) -> Callable[[Any], None]:
        """``call(stream)`` copying ``nbytes`` contiguous bytes: the ceiling of the link."""
        src, _, dst, _ = self.sides(direction)
        nbytes = min(int(nbytes), self.pool_bytes)
        if self.host_only:
            s, d = src[:nbytes], dst[:nbytes]
            return lambda stream: np.copyto(d, s)
        s, d = src[:nbytes], dst[:nbytes]
        # Enqueued on the current stream, which the timer sets to its own.
        return lambda stream: d.copy_(s, non_blocking=True)

    # -- checking a route's result (outside any timing) ----------------------------------
    def _sample(self, batch: Batch, k: int) -> np.ndarray:
        return np.unique(np.linspace(0, batch.n - 1, num=min(k, batch.n)).astype(np.int64))

    def poison(self, batch: Batch, k: int = 8) -> None:
        """Overwrite up to ``k`` sampled destination blocks with the complement of their source."""
        src, _, dst, _ = self.sides(batch.direction)
        b = batch.block_bytes
        for i in self._sample(batch, k).tolist():
            s, d = int(batch.src_off[i]), int(batch.dst_off[i])
            if self.host_only:
                dst[d:d + b] = ~src[s:s + b]
            else:
                dst[d:d + b].copy_((~src[s:s + b]).to(dst.device))
        self._sync()

    def check(self, batch: Batch, k: int = 8) -> Optional[str]:
        """None when the sampled destination blocks equal their sources, else what differs."""
        self._sync()
        src, _, dst, _ = self.sides(batch.direction)
        b = batch.block_bytes
        for i in self._sample(batch, k).tolist():
            s, d = int(batch.src_off[i]), int(batch.dst_off[i])
            got, want = dst[d:d + b], src[s:s + b]
            if self.host_only:
                same = bool(np.array_equal(got, want))
            else:
                same = bool((got.cpu() == want.cpu()).all())
            if not same:
                return f"block {i} of {batch.n} ({b} B) differs from its source after the copy"
        return None

    def verify(self, timer: Any, call: Callable[[Any], None], batch: Batch) -> None:
        """Run ``call`` once on ``batch`` into poisoned destinations (on ``timer``'s stream)
        and raise :class:`WrongResult` unless the sampled blocks arrived intact."""
        self.poison(batch)
        timer.once(call)
        wrong = self.check(batch)
        if wrong:
            raise WrongResult(wrong)

    def _sync(self) -> None:
        if not self.host_only:
            import torch

            torch.cuda.synchronize(torch.device(self.device.torch_device))

