"""Bind the kernel's launch parameters once; per call, stage the batch and launch.

A :class:`KernelCopy` is what ``triton.kernel``'s factory returns and what the public
:func:`~kvswap.backends.triton_generic.copy.copy` uses. Per call it packs the descriptors into
one pinned int64 launch buffer (launch_buffers.py). A small batch (each program handles at most
``TilePlan.host_tiles`` tiles) is read by the kernel straight from that pinned buffer; a
larger one is first uploaded with one asynchronous copy into the buffer's device twin, so
the copy loop reads its descriptors from device memory. The kernel variant, compiled once
per launch shape, is launched directly on the raw stream handle (compiled.py), and an
event recorded after it keeps both buffers out of reuse until it has finished. Host cost
per call is what decides small batches, so the hot path avoids Triton's JIT dispatch,
torch's stream/device context managers (unless the device must change) and any per-call
allocation. Without a device (``TRITON_INTERPRET=1`` on a CPU) the same kernel runs in
Triton's interpreter over host addresses, synchronously.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import numpy as np

from kvswap.errors import ConfigurationError

from .graphs import MAX_DESCRIPTORS as MAX_GRAPHED, Graphs

# Whether Triton is installed, found without importing it.
HAS_TRITON = importlib.util.find_spec("triton") is not None

# Defaults for a step of one program: TILE_ELEMS 8-byte elements (64 KiB) across WARPS
# warps. Small blocks need several whole blocks in flight per SM (on an H200, one 4 KiB
# block per step reached 24 GB/s on 12 SMs), and registers bound the tile: each element
# holds a 64-bit address besides its data, so past ~16-32 elements per thread the
# compiler spills (ptxas -v, sm_90), and variants that spilled lost 25-75% of their
# speed. Measured on an H200 (tests/bench/bench_triton.py --sweep, N=10 000):
# host->device 4 KiB blocks on 4 SMs went 0.76 -> 0.90 of the ceiling from 32 to 64 KiB
# tiles.
TILE_ELEMS = 8192
ROW_MAX = 1024  # elements of one descriptor per step; longer blocks loop
ROW_MIN = 32
WARPS = 8
# The any-alignment variant carries the byte path too: it spills above this tile.
GENERAL_TILE, GENERAL_WARPS = 4096, 8
ALIGNS = (16, 8, 1)
CACHES = ("", ".cg")
# Read the descriptors from pinned host memory when each program handles at most this
# many tiles: one PCIe round trip per tile instead of an upload (~17 us of host time:
# torch's stream context and copy) before the kernel. Measured on an H200 (GPU time per
# queued call, 4-8 SMs): host->device, reading from host was 3-9% faster up to 8 tiles
# per program at 16 KiB blocks, 3% slower at 8 tiles of 4 KiB blocks, 8-40% slower from
# 16 on (each tile waits a round trip before its loads; prefetching the next tile's
# descriptors did not help); device->host, within 1.5% of uploading or faster up to 63.
HOST_TILES = {"h2d": 8, "d2h": 64}


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def batch_alignment(packed: np.ndarray) -> int:
    """16, 8 or 1: what every address and size in ``packed`` is a multiple of."""
    bits = int(np.bitwise_or.reduce(packed)) if len(packed) else 0
    return 16 if not bits & 15 else 8 if not bits & 7 else 1


@dataclass(frozen=True)
class Tile:
    """One launch shape: ``jobs`` descriptors side by side, ``words`` elements of each per
    step, ``warps`` warps per program, ``splits`` programs per tile, ``align`` the kernel
    variant (16-byte vectors, 8-byte words, or any alignment), ``prefetch`` the next
    tile's descriptors loaded while this one copies."""

    jobs: int
    words: int
    warps: int
    splits: int = 1
    align: int = 16
    prefetch: bool = False
    cache: str = ""


@dataclass(frozen=True)
class TilePlan:
    """Chooses the tile for a batch from its mean block size, length and alignment (bound
    at resolve time).

    :param tile_elems: elements in flight per program and step.
    :param row_max: most elements of one descriptor per step.
    :param warps: warps per program for a full tile (fewer for smaller tiles).
    :param warp_elems: elements a warp takes per step at least: a tile of ``tile_elems``
        runs on at most ``tile_elems // warp_elems`` warps.
    :param align_max: the widest variant allowed (16, 8 or 1; 1 always takes the path
        that handles any alignment).
    :param prefetch: load the next tile's descriptors during this tile's copy.
    :param cache: cache modifier of the data loads: ``""`` (default) or ``".cg"`` (L2 only).
    :param host_tiles: the kernel reads the descriptors straight from pinned host memory
        when each program handles at most this many tiles; past it they are uploaded to
        device memory first (0: always upload).
    """

    tile_elems: int = TILE_ELEMS
    row_max: int = ROW_MAX
    warps: int = WARPS
    warp_elems: int = 512
    align_max: int = 16
    prefetch: bool = False
    cache: str = ""
    host_tiles: int = HOST_TILES["h2d"]

    def __post_init__(self) -> None:
        for name in ("tile_elems", "row_max", "warps", "warp_elems"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1 or v & (v - 1):
                raise ConfigurationError(f"triton.kernel {name}={v!r} must be a power of two >= 1")
        if self.row_max < ROW_MIN or self.tile_elems < self.row_max:
            raise ConfigurationError(
                f"triton.kernel needs {ROW_MIN} <= row_max <= tile_elems, got "
                f"row_max={self.row_max}, tile_elems={self.tile_elems}"
            )
        if self.align_max not in ALIGNS:
            raise ConfigurationError(f"triton.kernel align_max={self.align_max!r}; choose one of {ALIGNS}")
        if self.cache not in CACHES:
            raise ConfigurationError(f"triton.kernel cache={self.cache!r}; choose one of {CACHES}")
        h = self.host_tiles
        if not isinstance(h, int) or isinstance(h, bool) or h < 0:
            raise ConfigurationError(f"triton.kernel host_tiles={h!r} must be an int >= 0")

    @classmethod
    def from_params(cls, params: Mapping[str, Any], base: Optional[TilePlan] = None) -> TilePlan:
        """``base`` (default: the defaults) with the launch-shape keys found in ``params``."""
        import dataclasses

        keys = ("tile_elems", "row_max", "warps", "warp_elems", "align_max", "prefetch", "cache", "host_tiles")
        return dataclasses.replace(base or cls(), **{k: params[k] for k in keys if k in params})

    def pick(self, n: int, total_bytes: int, num_sms: int, align: int = 16) -> Tile:
        """The tile for ``n`` descriptors of ``total_bytes`` whose alignment is ``align``."""
        align = min(align, self.align_max)
        tile_elems, max_warps = self.tile_elems, self.warps
        if align == 1:
            tile_elems, max_warps = min(tile_elems, GENERAL_TILE), min(max_warps, GENERAL_WARPS)
        mean_words = -(-total_bytes // (8 * n))
        words = min(max(_pow2_at_least(mean_words), ROW_MIN), self.row_max, tile_elems)
        # One tile shape per row width keeps the compiled variants few (each costs a
        # compile on first use); short batches are latency-bound by one step anyway.
        jobs = tile_elems // words
        tiles = -(-n // jobs)
        splits = 1
        if tiles < num_sms:
            # Fewer tiles than programs: let programs share a tile's steps.
            splits = max(1, min(num_sms // tiles, -(-mean_words // words)))
        warps = max(1, min(max_warps, tile_elems // self.warp_elems))
        return Tile(jobs, words, warps, splits, align, self.prefetch, self.cache)


# Launch shapes per direction where the resolver passes none: the winners of
# tests/bench/bench_triton.py --sweep on an H200 (best mean fraction of the ceiling at
# 4-8 SMs). Device->host the 64 KiB tiles tie within 1%; 16 warps with L2-only loads led.
# Device->device (the staged route's device side) takes device->host's loads (its sources
# are device memory too) and its ids or descriptors uploaded first (a copy that does not
# cross the link is short, so a round trip per tile to read them weighs more); its shape, 32
# warps over rows of 512 B (many rows in flight per warp), led
# tests/bench/bench_device_gather_tiles.py at 4-32 KiB chunks on 32 SMs of an H200.
DEFAULT_PLANS: dict[str, TilePlan] = {
    "h2d": TilePlan(host_tiles=HOST_TILES["h2d"]),
    "d2h": TilePlan(warps=16, cache=".cg", host_tiles=HOST_TILES["d2h"]),
    "d2d": TilePlan(row_max=64, warps=32, warp_elems=256, cache=".cg", host_tiles=0),
}


@dataclass(frozen=True)
class Launch:
    """What one call launched: ``grid`` programs (never more than the SM budget), and
    where the kernel read the descriptors: ``"host"`` (the pinned launch buffer),
    ``"device"`` (uploaded first) or ``""`` (interpreter, or nothing launched)."""

    n: int
    grid: int
    tile: Optional[Tile]
    descriptors: str = ""


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

    KEEP_LAUNCHES = 256  # batch shapes whose launch is remembered

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
        self._pool: Any = None
        self._streams: Any = None
        self._graphs: Any = None  # small launches replayed from CUDA graphs (graphs.py)
        self.variants: Any = None  # compiled.Variants of the device (GPU only)
        if device_index is not None:
            from .compiled import variants
            from .launch_buffers import Streams, shared_pool

            # The launch buffers are host memory a kernel reads: map them like host data.
            self._pool = shared_pool(device_index, translate_src or translate_dst)
            self._streams = Streams(device_index)
            self.variants = variants(device_index)
            self._graphs = Graphs(device_index, self._pool, self.variants)
        self._launches: dict[tuple[int, int, int], Launch] = {}
        self.last_launch: Optional[Launch] = None
        self.note = (f"{num_sms} SMs; tile {tiles.tile_elems} x 8 B, rows <= {tiles.row_max}, "
                     f"{tiles.warps} warps, vectors <= {tiles.align_max} B; descriptors read from host "
                     f"up to {tiles.host_tiles} tiles per program"
                     + ("" if self._graphs is None else f"; {self._graphs.describe()}"))

    def prepare(self, block_bytes: Any = (), align: int = 16) -> list[Tile]:
        """Compile now (not on a first transfer) the variants for batches of blocks of
        each size in ``block_bytes`` whose addresses are multiples of ``align``. A no-op
        in the interpreter. Returns the tiles prepared."""
        tiles = [self.tiles.pick(1024, 1024 * int(b), self.num_sms, align) for b in block_bytes]
        if self.variants is not None:
            for tile in tiles:
                self.variants.get(tile)
        return tiles

    def __call__(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, stream: Any = None) -> Launch:
        """Copy validated int64 descriptor arrays; enqueued on ``stream`` (GPU) or done
        on return (interpreter)."""
        n = len(sizes)
        if n == 0:
            self.last_launch = Launch(0, 0, None)
            return self.last_launch
        if self._translate_src is not None:
            src = np.asarray(self._translate_src(src), dtype=np.int64)
        if self._translate_dst is not None:
            dst = np.asarray(self._translate_dst(dst), dtype=np.int64)
        if self._pool is None:
            packed = np.concatenate((src, dst, sizes))
            launch = self._plan(n, int(sizes.sum()), batch_alignment(packed))
            self._interpret(packed, launch)
        else:
            entry = self._pool.take(3 * n)
            packed = entry.view[:3 * n]
            packed[:n] = src
            packed[n:2 * n] = dst
            packed[2 * n:] = sizes
            launch = self._plan(n, int(sizes.sum()), batch_alignment(packed))
            self._enqueue(entry, launch, stream)
        self.last_launch = launch
        return launch

    def _plan(self, n: int, total: int, align: int) -> Launch:
        """The launch for ``n`` descriptors of ``total`` bytes aligned to ``align``;
        remembered, as engines repeat the same batch shapes step after step."""
        key = (n, total, align)
        launch = self._launches.get(key)
        if launch is None:
            tile = self.tiles.pick(n, total, self.num_sms, align)
            work = -(-n // tile.jobs) * tile.splits
            grid = min(self.num_sms, work)
            where = "" if self._pool is None else "host" if work <= grid * self.tiles.host_tiles else "device"
            launch = Launch(n, grid, tile, where)
            if len(self._launches) >= self.KEEP_LAUNCHES:
                self._launches.clear()
            self._launches[key] = launch
        return launch

    def _interpret(self, packed: np.ndarray, launch: Launch) -> None:
        import torch

        from .compiled import constexprs
        from .jit import copy_kernel

        tile = launch.tile
        copy_kernel[(launch.grid,)](torch.from_numpy(packed), launch.n, tile.splits, **constexprs(tile),
                                    num_warps=tile.warps)

    def _enqueue(self, entry: Any, launch: Launch, stream: Any) -> None:
        import torch

        try:
            s = self._streams.get(stream)
        except BaseException:
            self._pool.give(entry)
            raise
        if torch.cuda.current_device() == self.device_index:
            self._launch(entry, launch, s, stream is None)
        else:
            # Triton launches in the current context: make the bound device current.
            with torch.cuda.device(self.device_index):
                self._launch(entry, launch, s, stream is None)

    def _launch(self, entry: Any, launch: Launch, s: Any, current: bool) -> None:
        import torch

        n, tile, m = launch.n, launch.tile, 3 * launch.n
        read = True  # whether the GPU reads ``entry`` (a graph replay reads its own buffer)
        try:
            variant = self.variants.get(tile)  # compiles on a shape's first use
            if launch.descriptors == "host" and n <= MAX_GRAPHED and variant.direct:
                slot = self._graphs.slot(launch)
                if slot is not None:
                    read = False
                    self._graphs.replay(slot, entry.view[:m], s)
                    return
            if launch.descriptors == "host":
                desc, ptr = entry.host, entry.host_ptr
            else:
                desc, ptr = self._pool.device_buffer(entry), entry.dev_ptr
                if current:  # ``s`` is the current stream already: skip torch's context (~6 us)
                    desc[:m].copy_(entry.host[:m], non_blocking=True)
                else:
                    with torch.cuda.stream(s):
                        desc[:m].copy_(entry.host[:m], non_blocking=True)
            if variant.direct:
                self.variants.launch(variant, tile, launch.grid, ptr, n, tile.splits, s.cuda_stream)
            else:
                from .compiled import constexprs
                from .jit import copy_kernel

                with torch.cuda.stream(s):
                    copy_kernel[(launch.grid,)](desc, n, tile.splits, **constexprs(tile), num_warps=tile.warps)
        finally:
            if read:  # also on failure: the upload may already be in flight
                entry.done.record(s)
            self._pool.give(entry)


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET``)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")
