"""Bind the kernel's launch parameters once; per call, upload the batch and launch.

A :class:`KernelCopy` is what ``triton.kernel``'s factory returns and what the public
:func:`kvswap.backends.triton_generic.copy` uses. Per call it packs the descriptors into
one pinned int64 staging buffer, uploads it with one asynchronous copy on the transfer
stream, launches the kernel on the same stream, and records an event that keeps the
staging buffer out of reuse until the kernel that reads it has finished. Without a device
(``TRITON_INTERPRET=1`` on a CPU) the same kernel runs in Triton's interpreter over host
addresses, synchronously.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import numpy as np

from kvswap.errors import ConfigurationError

# A step of one program moves TILE_ELEMS 8-byte elements (32 KiB) across 8 warps: enough
# bytes in flight per SM to fill PCIe Gen5 from 4 SMs at 4 KiB blocks (FACTS.md: a
# multi-block tile reached 50.5 GB/s there; one block per step only 24 on 12 SMs).
TILE_ELEMS = 4096
ROW_MAX = 1024  # elements of one descriptor per step; longer blocks loop
ROW_MIN = 32
WARPS = 8
POOL_LIMIT = 32  # staging buffers kept; past this, wait for the oldest to be free


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


@dataclass(frozen=True)
class Tile:
    """One launch shape: ``jobs`` descriptors side by side, ``words`` elements of each per
    step, ``warps`` warps per program, ``splits`` programs per tile, ``wide`` 16-byte path,
    ``prefetch`` next tile's descriptors loaded while this one copies."""

    jobs: int
    words: int
    warps: int
    splits: int = 1
    wide: bool = True
    prefetch: bool = True


@dataclass(frozen=True)
class TilePlan:
    """Chooses the tile for a batch from its mean block size and length (bound at resolve time).

    :param tile_elems: elements in flight per program and step.
    :param row_max: most elements of one descriptor per step.
    :param warps: warps per program for a full tile (fewer for smaller tiles).
    :param wide: allow the 16-byte vector path.
    :param prefetch: load the next tile's descriptors during this tile's copy.
    """

    tile_elems: int = TILE_ELEMS
    row_max: int = ROW_MAX
    warps: int = WARPS
    wide: bool = True
    prefetch: bool = True

    def __post_init__(self) -> None:
        for name in ("tile_elems", "row_max", "warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ConfigurationError(f"triton.kernel {name}={v!r} must be a power of two >= 1")
        if self.row_max < ROW_MIN or self.tile_elems < self.row_max:
            raise ConfigurationError(
                f"triton.kernel needs {ROW_MIN} <= row_max <= tile_elems, got "
                f"row_max={self.row_max}, tile_elems={self.tile_elems}"
            )

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> TilePlan:
        keys = ("tile_elems", "row_max", "warps", "wide", "prefetch")
        return cls(**{k: params[k] for k in keys if k in params})

    def pick(self, n: int, total_bytes: int, num_sms: int) -> Tile:
        mean_words = -(-total_bytes // (8 * n))
        words = min(max(_pow2_at_least(mean_words), ROW_MIN), self.row_max)
        # One tile shape per row width keeps the compiled variants few (each costs a
        # compile on first use); short batches are latency-bound by one step anyway.
        jobs = self.tile_elems // words
        tiles = -(-n // jobs)
        splits = 1
        if tiles < num_sms:
            # Fewer tiles than programs: let programs share a tile's steps.
            splits = max(1, min(num_sms // tiles, -(-mean_words // words)))
        warps = max(1, min(self.warps, jobs * words // 512))
        return Tile(jobs, words, warps, splits, self.wide, self.prefetch)


@dataclass(frozen=True)
class Launch:
    """What one call launched: ``grid`` programs (never more than the SM budget)."""

    n: int
    grid: int
    tile: Optional[Tile]


class _StagingPool:
    """Pinned int64 staging buffers, each reused only after its last kernel finished."""

    def __init__(self) -> None:
        self._free: list[tuple[Any, np.ndarray, Any]] = []

    def take(self, count: int) -> tuple[Any, np.ndarray, Any]:
        import torch

        for i, entry in enumerate(self._free):
            if entry[1].size >= count and entry[2].query():
                return self._free.pop(i)
        if len(self._free) >= POOL_LIMIT:
            # Every kept buffer is busy or too small: the oldest is reused once free.
            entry = self._free.pop(0)
            entry[2].synchronize()
            if entry[1].size >= count:
                return entry
        buf = torch.empty(max(_pow2_at_least(count), 3 * 1024), dtype=torch.int64, pin_memory=True)
        return buf, buf.numpy(), torch.cuda.Event()

    def give(self, entry: tuple[Any, np.ndarray, Any]) -> None:
        self._free.append(entry)


class KernelCopy:
    """The per-transfer callable of ``triton.kernel``, with its launch parameters bound.

    :param num_sms: the SM budget: the grid never has more programs.
    :param device_index: the GPU to launch on; None runs Triton's interpreter on the CPU
        (``TRITON_INTERPRET=1``) over host addresses.
    :param tiles: how tiles are chosen per batch.
    :param translate_src: maps source addresses to ones the kernel may use (host side of
        host->device), or None.
    :param translate_dst: the same for destination addresses (device->host), or None.
    """

    def __init__(
        self,
        num_sms: int,
        device_index: Optional[int],
        tiles: TilePlan = TilePlan(),
        translate_src: Optional[Callable[[np.ndarray], np.ndarray]] = None,
        translate_dst: Optional[Callable[[np.ndarray], np.ndarray]] = None,
    ) -> None:
        if not isinstance(num_sms, int) or isinstance(num_sms, bool) or num_sms < 1:
            raise ConfigurationError(f"num_sms={num_sms!r} must be an int >= 1")
        self.num_sms = num_sms
        self.device_index = device_index
        self.tiles = tiles
        self._translate_src = translate_src
        self._translate_dst = translate_dst
        self._pool = _StagingPool() if device_index is not None else None
        self.last_launch: Optional[Launch] = None
        self.note = f"{num_sms} SMs; tile {tiles.tile_elems} x 8 B, rows <= {tiles.row_max}, {tiles.warps} warps"

    def __call__(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, stream: Any = None) -> Launch:
        """Copy validated int64 descriptor arrays; enqueued on ``stream`` (GPU) or done
        on return (interpreter)."""
        from .kernel import copy_kernel

        n = len(sizes)
        if n == 0:
            self.last_launch = Launch(0, 0, None)
            return self.last_launch
        if self._translate_src is not None:
            src = np.asarray(self._translate_src(src), dtype=np.int64)
        if self._translate_dst is not None:
            dst = np.asarray(self._translate_dst(dst), dtype=np.int64)
        tile = self.tiles.pick(n, int(sizes.sum()), self.num_sms)
        grid = min(self.num_sms, -(-n // tile.jobs) * tile.splits)
        launch = Launch(n, grid, tile)
        if self.device_index is None:
            self._interpret(copy_kernel, src, dst, sizes, launch)
        else:
            self._enqueue(copy_kernel, src, dst, sizes, launch, stream)
        self.last_launch = launch
        return launch

    @staticmethod
    def _args(tile: Tile) -> dict[str, Any]:
        return dict(JOBS=tile.jobs, WORDS=tile.words, WIDE=tile.wide, PREFETCH=tile.prefetch,
                    num_warps=tile.warps)

    def _interpret(self, kernel: Any, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, launch: Launch) -> None:
        import torch

        desc = torch.from_numpy(np.concatenate((src, dst, sizes)))
        kernel[(launch.grid,)](desc, launch.n, launch.tile.splits, **self._args(launch.tile))

    def _enqueue(self, kernel: Any, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray,
                 launch: Launch, stream: Any) -> None:
        import torch

        from kvswap.streams import torch_stream

        n, idx = launch.n, self.device_index
        entry = self._pool.take(3 * n)
        buf, view, done = entry
        view[:n] = src
        view[n:2 * n] = dst
        view[2 * n:3 * n] = sizes
        s = torch_stream(stream, idx)
        with torch.cuda.device(idx), torch.cuda.stream(s):
            try:
                # Allocated on ``s`` and used only there: the caching allocator may hand
                # it out again only to work ordered after this kernel.
                desc = torch.empty(3 * n, dtype=torch.int64, device=f"cuda:{idx}")
                desc.copy_(buf[:3 * n], non_blocking=True)
                kernel[(launch.grid,)](desc, n, launch.tile.splits, **self._args(launch.tile))
            finally:
                # Also on failure: the upload may already be in flight.
                done.record(s)
                self._pool.give(entry)


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET``)."""
    import os

    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")
