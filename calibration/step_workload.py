"""Where a step benchmark runs, and the tensors it moves.

:class:`DeviceEnv` drives a CUDA (or ROCm) device through torch: bf16 GEMMs on a compute
stream and CUDA events on it and on each transfer's stream (a mover's, or the side stream
of the contiguous reference, :mod:`.step_contiguous`). :class:`HostEnv` runs
the same procedure on host tensors with a callable standing in for the GEMMs, synchronously
(so "beside" is "after"): what the tests exercise on a machine without an accelerator.
:class:`StepPools` holds one rank's per-layer KV tensors on the device and, in either host
layout (:data:`HOST_LAYOUTS`), on the host; it fills them with random bytes, poisons
destinations and checks every moved byte.
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Callable, Optional

import numpy as np

from kvswap.memory.block_major import HostCache, block_major_layout
from kvswap.errors import ConfigurationError, KvSwapError
from kvswap.cli.models import KVCache
from kvswap import BlockMover
from kvswap.types import DeviceInfo, Direction

from .timing import median

MiB = 1 << 20
POISON = 0xA5
GEMM_N = 4096  # bf16 4096^3: ~0.2 ms on an H100/H200, fine-grained enough to fill a step
# per-layer: one host tensor per layer in the device's layout; block-major: one host
# allocation where host block i holds device block i of every layer (kvswap.host_cache).
HOST_LAYOUTS = ("per-layer", "block-major")


class WrongBytes(KvSwapError):
    """A job finished without the bytes it was given in its destination blocks."""


class HostEnv:
    """Host tensors, the host reference copy, and ``compute`` (a callable) for the GEMMs:
    everything runs synchronously, so "beside" is "after" and only the code is tested."""

    name = "host"

    def __init__(self, compute: Callable[[], Any], device: str = "cpu") -> None:
        import torch

        self.torch, self.device, self.compute_fn = torch, device, compute
        self.gemms = 1
        self.gemm_seconds = 0.0
        self.gemm_label = "a host callable"
        self.launch = "a call"

    def alloc(self, nbytes: int, host: bool) -> Any:
        return self.torch.empty(nbytes, dtype=self.torch.uint8)

    def random_(self, t: Any, gen_seed: int) -> None:
        g = self.torch.Generator().manual_seed(gen_seed)
        t.copy_(self.torch.randint(0, 256, t.shape, dtype=self.torch.uint8, generator=g))

    def block_major(self, device_tensors: list, num_blocks: int, block_dim: int) -> HostCache:
        """A block-major host cache laid out as :func:`kvswap.host_cache` lays it out, in
        plain host memory (nothing here can be pinned)."""
        layout = block_major_layout(device_tensors, block_dim=block_dim)
        flat = self.alloc(num_blocks * layout.block_bytes, host=True)
        return layout.over(flat.view(num_blocks, layout.block_bytes))

    def mirror_of(self, host_flat: Any) -> Any:
        return host_flat.clone()

    def launch_compute(self) -> None:
        self.compute_fn()

    def mark(self, stream: Any = None) -> float:
        return time.perf_counter()

    def elapsed(self, a: float, b: float) -> float:
        return max(b - a, 0.0)

    def sync(self) -> None:
        pass

    def submit(self, mover: BlockMover, sid: np.ndarray, did: np.ndarray, after: Any) -> int:
        return mover.submit(sid, did)

    def context(self) -> Any:
        return contextlib.nullcontext()

    def side_stream(self, owner: object) -> None:
        return None

    def on(self, stream: Any) -> Any:
        return contextlib.nullcontext()

    def wait(self, stream: Any, mark: Any) -> None:
        pass


class DeviceEnv:
    """A CUDA (or ROCm) device through torch: a compute stream running bf16 GEMMs, and
    CUDA events on it and on each mover's transfer stream."""

    name = "device"

    def __init__(self, dev: DeviceInfo, step_ms: float) -> None:
        import torch

        self.torch, self.dev = torch, dev
        self.device = torch.device(dev.torch_device)
        self.index = self.device.index or 0
        with torch.cuda.device(self.index):
            self.compute = torch.cuda.Stream(device=self.index)
        gen = torch.Generator(device=self.device).manual_seed(0)
        self.a = torch.randn(GEMM_N, GEMM_N, device=self.device, dtype=torch.bfloat16, generator=gen)
        self.b = torch.randn(GEMM_N, GEMM_N, device=self.device, dtype=torch.bfloat16, generator=gen)
        self.out = torch.empty_like(self.a)
        self.gemms = 1
        self.gemm_label = f"bf16 {GEMM_N}x{GEMM_N}x{GEMM_N}"
        self.graph: Any = None
        self.gemm_seconds = self._one_gemm()
        self.gemms = max(1, round(step_ms / 1e3 / self.gemm_seconds))
        self.launch = self._capture()

    def _capture(self) -> str:
        """Capture the step's GEMMs as one CUDA graph, as engines launch a decode step: the
        copy's submit then follows the launch by microseconds, not by the 1-2 ms a hundred
        eager launches take (time the bound does not count). Eager where capture fails."""
        t = self.torch
        try:
            with self.context():
                self.launch_compute()  # warm cuBLAS on this stream before capturing
                self.sync()
                graph = t.cuda.CUDAGraph()
                with t.cuda.graph(graph, stream=self.compute):
                    self.launch_compute()
                self.sync()
        except Exception as e:  # e.g. a platform whose torch cannot capture: eager launches
            t.cuda.synchronize(self.device)
            return f"eager ({type(e).__name__} when capturing: {e})"
        self.graph = graph
        return "one CUDA graph"

    def _one_gemm(self) -> float:
        with self.context():
            for _ in range(5):
                self.launch_compute()
            times = []
            for _ in range(5):
                s = self.mark()
                for _ in range(10):
                    self.launch_compute()
                e = self.mark()
                e.synchronize()
                times.append(self.elapsed(s, e) / 10)
        return median(times)

    def alloc(self, nbytes: int, host: bool) -> Any:
        t = self.torch
        if host:
            return t.empty(nbytes, dtype=t.uint8, pin_memory=True)
        return t.empty(nbytes, dtype=t.uint8, device=self.device)

    def random_(self, flat: Any, gen_seed: int) -> None:
        t = self.torch
        g = t.Generator(device=self.device).manual_seed(gen_seed)
        step = 256 * MiB
        for i in range(0, flat.numel(), step):
            part = flat[i:i + step]
            part.copy_(t.randint(0, 256, part.shape, dtype=t.uint8, device=self.device, generator=g))
        t.cuda.synchronize(self.device)

    def block_major(self, device_tensors: list, num_blocks: int, block_dim: int) -> HostCache:
        """:func:`kvswap.host_cache` for ``device_tensors``: pinned, on the device's NUMA node."""
        from kvswap.memory.block_major import host_cache

        return host_cache(device_tensors, num_blocks, block_dim=block_dim)

    def mirror_of(self, host_flat: Any) -> Any:
        return host_flat.to(self.device)

    def launch_compute(self) -> None:
        if self.graph is not None:
            self.graph.replay()
            return
        mm = self.torch.matmul
        for _ in range(self.gemms):
            mm(self.a, self.b, out=self.out)

    def mark(self, stream: Any = None) -> Any:
        e = self.torch.cuda.Event(enable_timing=True)
        e.record(self.compute if stream is None else stream)
        return e

    def elapsed(self, a: Any, b: Any) -> float:
        return max(a.elapsed_time(b) / 1e3, 0.0)

    def sync(self) -> None:
        self.torch.cuda.synchronize(self.device)

    def submit(self, mover: BlockMover, sid: np.ndarray, did: np.ndarray, after: Any) -> int:
        """``after``: None (wait for nothing) or an event to wait for."""
        return mover.submit(sid, did, after=after)

    def context(self) -> Any:
        stack = contextlib.ExitStack()
        stack.enter_context(self.torch.cuda.device(self.index))
        stack.enter_context(self.torch.cuda.stream(self.compute))
        return stack

    def side_stream(self, owner: object) -> Any:
        """A stream of kvswap's own, held while ``owner`` lives: never the compute stream
        (torch's pool hands its streams out in turn)."""
        from kvswap.registry.streams import own_stream

        return own_stream(self.index, owner)

    def on(self, stream: Any) -> Any:
        """``stream`` current for what is enqueued inside."""
        return self.torch.cuda.stream(stream)

    def wait(self, stream: Any, mark: Any) -> None:
        """Work enqueued on ``stream`` from now on waits for ``mark`` (an event)."""
        stream.wait_event(mark)


# -- the tensors of one rank, and the byte checks ------------------------------------------

class StepPools:
    """One rank's per-layer KV tensors on both sides, ``num_blocks`` blocks each, and a
    mirror of the host side next to the device (where checks run).

    ``host_layout`` (:data:`HOST_LAYOUTS`): ``"per-layer"``, one host tensor per layer in
    the device's layout; ``"block-major"``, one host allocation whose block ``i`` holds
    device block ``i`` of every layer, read through per-layer views of each device
    tensor's dtype and shape. The mirror has the host side's layout.
    """

    def __init__(self, env: Any, cache: KVCache, num_blocks: int, seed: int = 0,
                 host_layout: str = "per-layer") -> None:
        import torch

        if host_layout not in HOST_LAYOUTS:
            raise ConfigurationError(f"host_layout={host_layout!r} must be one of {', '.join(HOST_LAYOUTS)}")
        self.env, self.cache, self.num_blocks, self.seed = env, cache, num_blocks, seed
        self.host_layout = host_layout
        self.torch = torch
        shape = cache.tensor_shape(num_blocks)
        self.nbytes = math.prod(shape) * cache.element_bytes
        self.dtype = getattr(torch, cache.model.dtype)
        layers = cache.model.layers
        self.dev_flat = [env.alloc(self.nbytes, host=False) for _ in range(layers)]
        self.device_tensors = [self._typed(f) for f in self.dev_flat]
        # The host side and its mirror as flat byte tensors (what is filled, poisoned and
        # copied whole) and as per-layer tensors (what a mover takes and a check compares).
        if host_layout == "per-layer":
            self.host_flat = [env.alloc(self.nbytes, host=True) for _ in range(layers)]
            self.host_tensors = [self._typed(f) for f in self.host_flat]
            self.mirror = [env.mirror_of(f) for f in self.host_flat]
            self.mirror_tensors = [self._typed(f) for f in self.mirror]
        else:
            host = env.block_major(self.device_tensors, num_blocks, cache.block_dim)
            self.host_flat = [host.buffer.view(-1)]
            self.host_tensors = list(host.views)
            self.mirror = [env.mirror_of(self.host_flat[0])]
            layout = block_major_layout(self.device_tensors, block_dim=cache.block_dim)
            self.mirror_tensors = list(layout.over(self.mirror[0].view(num_blocks, -1)).views)
        self._fills = 0
        self.prepared: Optional[Direction] = None

    def _typed(self, flat: Any) -> Any:
        return flat.view(self.dtype).view(self.cache.tensor_shape(self.num_blocks))

    def _bytes(self, typed: Any) -> Any:
        """A layer's tensor as bytes (its innermost dimension, contiguous, in bytes)."""
        return typed.view(self.torch.uint8)

    def sides(self, direction: Direction) -> tuple[list, list]:
        if direction.src_is_host:
            return self.host_tensors, self.device_tensors
        return self.device_tensors, self.host_tensors

    def prepare(self, direction: Direction) -> None:
        """Fresh random bytes in ``direction``'s source (the other direction's runs left
        poison and copies in it), mirrored next to the device for the checks."""
        for f in (self.host_flat if direction.src_is_host else self.dev_flat):
            self._fills += 1
            self.env.random_(f, self.seed * 1_000_003 + self._fills)
        if direction.src_is_host:
            for m, h in zip(self.mirror, self.host_flat):
                m.copy_(h)
        self.env.sync()
        self.prepared = direction

    def poison(self, direction: Direction) -> None:
        """Every destination byte set to :data:`POISON` before a job."""
        if direction.src_is_host:
            for f in self.dev_flat:
                f.fill_(POISON)
        else:  # on the device, then one contiguous copy of each host allocation
            for m, h in zip(self.mirror, self.host_flat):
                m.fill_(POISON)
                h.copy_(m)
        self.env.sync()

    def check(self, direction: Direction, sid: np.ndarray, did: np.ndarray) -> int:
        """Bytes verified: every destination block ``did[i]`` of every layer equals source
        block ``sid[i]``, and every other destination block is still poison.

        :raises WrongBytes: naming the first layer and block that differ.
        """
        t = self.torch
        if direction.src_is_host:
            dst, src = self.device_tensors, self.mirror_tensors
        else:
            for m, h in zip(self.mirror, self.host_flat):
                m.copy_(h)
            dst, src = self.mirror_tensors, self.device_tensors
        bd = self.cache.block_dim
        where = dst[0].device
        s_idx = t.as_tensor(sid, dtype=t.int64).to(where)
        d_idx = t.as_tensor(did, dtype=t.int64).to(where)
        keep = np.ones(self.num_blocks, dtype=bool)
        keep[did] = False
        rest = t.as_tensor(np.flatnonzero(keep), dtype=t.int64).to(where)
        for layer, (d, s) in enumerate(zip(dst, src)):
            got = self._bytes(d).index_select(bd, d_idx)
            want = self._bytes(s).index_select(bd, s_idx)
            if not t.equal(got, want):
                bad = (got != want).movedim(bd, 0).reshape(len(did), -1).any(dim=1)
                i = int(t.nonzero(bad)[0, 0])
                raise WrongBytes(f"{direction}: layer {layer}, destination block {int(did[i])} does not hold "
                                 f"source block {int(sid[i])} (job position {i})")
            if len(rest):
                left = self._bytes(d).index_select(bd, rest)
                if not bool((left == POISON).all()):
                    bad = (left != POISON).movedim(bd, 0).reshape(len(rest), -1).any(dim=1)
                    j = int(rest[int(t.nonzero(bad)[0, 0])])
                    raise WrongBytes(f"{direction}: layer {layer}, destination block {j} was not in the job "
                                     f"but was written")
        return len(did) * self.cache.block_bytes

    def draw(self, rng: np.random.Generator, blocks: int) -> tuple[np.ndarray, np.ndarray]:
        return (rng.choice(self.num_blocks, blocks, replace=False).astype(np.int64),
                rng.choice(self.num_blocks, blocks, replace=False).astype(np.int64))
