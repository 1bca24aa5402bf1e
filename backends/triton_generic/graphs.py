"""Small kernel copies replayed from CUDA graphs instead of launched.

A copy of a few blocks costs more in its launch than in its bytes, and a graph replay
reaches the GPU sooner than a kernel launch (tests/bench/bench_graph_launch.py). The call's
own bookkeeping (descriptors packed, launch planned, events) stays, so its thread time moves
less than its GPU time. A graph bakes in its arguments,
so one is captured per launch shape (descriptor count, grid, tile), once the shape has been
seen :data:`SEEN_BEFORE_CAPTURE` times (engines repeat their shapes; a one-off shape is not
worth a capture), over :data:`RING` fixed buffers, each written again only once the replay
that read it has finished. When every buffer of a shape is still being read, a capture
failed, or the platform's graph launch cannot be called directly, the launch goes the plain way.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Optional

# Measured on an H100 host (bench_graph_launch.py, 1-256 blocks of 4 KiB, both directions): a
# graphed call took 0.88-0.94 of a plain call's GPU time from an idle stream, and 0.75-0.78 of
# its thread time in five of eight cases, 1.1-1.4 in the other three.

# Set to off (or 0, no, false) to launch every copy the plain way, e.g. where an engine's own
# graph captures must not meet another thread's.
ENV = "KVSWAP_TRITON_GRAPHS"
# Descriptors a graphed launch may have: the graphs read them from pinned memory, as the
# launcher's own small batches do (launch.HOST_TILES).
MAX_DESCRIPTORS = 256
RING = 4
SEEN_BEFORE_CAPTURE = 2
KEEP_SHAPES = 64


class Slot:
    """One fixed buffer of a shape (a launch buffer kept for good) and the graph over it
    (``exec``: its executable's raw handle). ``busy`` while a thread fills and replays it;
    ``used`` once a replay was enqueued (its ``entry.done`` then says when the buffer may be
    written again)."""

    __slots__ = ("entry", "graph", "exec", "used", "busy")

    def __init__(self, entry: Any, graph: Any, exec_handle: int) -> None:
        self.entry, self.graph, self.exec, self.used, self.busy = entry, graph, exec_handle, False, False


def raw_launcher() -> Optional[Any]:
    """The platform's graph launch (``cuGraphLaunch``, ``hipGraphLaunch``) through ctypes, or
    None: then no graphs. torch's ``replay()`` launches on the current stream only, and making
    the caller's stream current costs more than the launch saves (bench_graph_launch.py)."""
    # Replayed through torch, graphed calls took 1.4-1.8 times a plain call's GPU and thread
    # time (bench_graph_launch.py, an H100 host).
    import ctypes

    import torch

    lib, name = ("libamdhip64.so", "hipGraphLaunch") if torch.version.hip else ("libcuda.so.1", "cuGraphLaunch")
    try:
        fn = getattr(ctypes.CDLL(lib), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_void_p), ctypes.c_int
    return fn


class Graphs:
    """The graphs of one launcher (:class:`~.launch.KernelCopy`) on one device.

    :param pool: where the fixed buffers come from (:class:`~.launch_buffers.LaunchBufferPool`); they
        are never given back.
    :param variants: the launcher's compiled variants.
    """

    def __init__(self, device_index: int, pool: Any, variants: Any) -> None:
        self.device_index, self.pool, self.variants = device_index, pool, variants
        self._seen: dict[tuple, int] = {}
        self._rings: dict[tuple, list[Slot]] = {}
        self._stream: Any = None
        self._launch: Any = None  # raw_launcher(), found at the first capture
        self._lock = threading.Lock()
        self.failed: Optional[str] = None  # why no graphs are captured: turned off, or one failed
        if os.environ.get(ENV, "").strip().lower() in ("off", "0", "no", "false"):
            self.failed = f"{ENV}={os.environ[ENV]}"

    def describe(self) -> str:
        """What this launcher does with small launches, for ``explain()``."""
        if self.failed is not None:
            return f"CUDA graphs off ({self.failed})"
        return f"launches of up to {MAX_DESCRIPTORS} descriptors replayed from CUDA graphs once their shape repeats"

    def slot(self, launch: Any) -> Optional[Slot]:
        """A free slot of ``launch``'s shape, marked in use (capturing its graphs now if the
        shape is due), or None: launch it the plain way."""
        if self.failed is not None and not self._rings:
            return None  # turned off, or no capture ever worked: no lock, no counting, per call
        key = (launch.n, launch.grid, launch.tile)
        with self._lock:
            ring = self._rings.get(key)
            if ring is None:
                seen = self._seen.get(key, 0) + 1
                if self.failed is not None or seen < SEEN_BEFORE_CAPTURE or len(self._rings) >= KEEP_SHAPES:
                    if len(self._seen) < 4096:
                        self._seen[key] = seen
                    return None
                ring = self._capture(launch)
                if ring is None:
                    return None
                self._rings[key] = ring
            for slot in ring:
                if not slot.busy and (not slot.used or slot.entry.done.query()):
                    slot.busy = True
                    return slot
        return None

    def _capture(self, launch: Any) -> Optional[list[Slot]]:
        """:data:`RING` graphs of ``launch`` over fixed buffers, captured on a stream of
        their own (capture enqueues nothing; this thread alone is held to capture rules)."""
        if self._launch is None:
            self._launch = raw_launcher()
            if self._launch is None:
                self.failed = "no graph launch entry point (cuGraphLaunch, hipGraphLaunch) found"
                return None
        import torch

        try:
            variant = self.variants.get(launch.tile)
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=self.device_index)
            ring = []
            for _ in range(RING):
                entry = self.pool.take(3 * launch.n)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.stream(self._stream):
                    graph.capture_begin(capture_error_mode="thread_local")
                    try:
                        self.variants.launch(variant, launch.tile, launch.grid, entry.host_ptr, launch.n,
                                             launch.tile.splits, self._stream.cuda_stream)
                    finally:
                        graph.capture_end()
                ring.append(Slot(entry, graph, int(graph.raw_cuda_graph_exec())))  # a torch without it: no graphs
            return ring
        except Exception as e:  # the plain launch serves, from now on
            self.failed = f"{type(e).__name__}: {e}"
            return None

    def replay(self, slot: Slot, packed: Any, s: Any) -> None:
        """Copy the ``packed`` descriptors into ``slot``'s buffer and launch its graph on the
        torch stream ``s``."""
        try:
            slot.entry.view[:len(packed)] = packed
            rc = self._launch(slot.exec, s.cuda_stream)
            if rc:
                raise RuntimeError(f"{self._launch.__name__} of a captured copy failed with error {rc}")
        finally:  # also on failure: a replay may be enqueued
            slot.entry.done.record(s)
            slot.used, slot.busy = True, False
