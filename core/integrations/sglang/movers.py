"""The movers of one SGLang host pool: one per layer for loads, one for the all-layer backup.

Each is a :class:`kvswap.BlockMover` over the pool's own tensors (SGLang's buffers, viewed as
pages by :mod:`.layouts`), built once, at the first call of its direction, on the stream
current then: SGLang's host-to-device or device-to-host transfer stream. A job is issued on
the caller's thread (``issuing_thread=False``), so it is on the stream when the hook returns
and the event SGLang records next (a layer's load event, a backup's finish event) follows
it. Called on another stream, that stream waits for the mover's.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Optional

from ... import BlockMover, EngineTransferError, __version__
from ..offload import route_summary
from .layouts import LayerTensors, PoolLayout
from .pages import LastTransfer, Pages

LOAD, BACKUP = "load", "backup"


def _current_stream(index: Optional[int]) -> Any:
    import torch

    return torch.cuda.current_stream(index)


class PoolMovers:
    """One pool's movers and the page ids of its transfer in progress.

    :param layout: the pool's layers (:func:`~.layouts.mha_layout`, :func:`~.layouts.mla_layout`).
    :param log: where the line saying what each direction takes goes (info) and its
        ``explain()`` (debug).
    """

    def __init__(self, layout: PoolLayout, log: logging.Logger) -> None:
        self.layout = layout
        self.last = LastTransfer()
        self._log = log
        self._loads: Optional[dict[int, BlockMover]] = None
        self._backup: Optional[BlockMover] = None
        self._lock = threading.Lock()
        dev = layout.layers[0].device[0].device
        self._index = dev.index if layout.on_device else None

    # -- building -----------------------------------------------------------------------
    def _stream(self) -> Any:
        return _current_stream(self._index) if self.layout.on_device else None

    def _built(self, direction: str) -> Any:
        """The movers of ``direction``, built at its first call."""
        with self._lock:
            if direction == LOAD and self._loads is None:
                stream = self._stream()
                self._loads = {t.layer_id: self._mover(list(t.host), list(t.device), "h2d", stream)
                               for t in self.layout.layers}
                self._announce(LOAD, next(iter(self._loads.values())))
            elif direction == BACKUP and self._backup is None:
                layers = self.layout.layers
                self._backup = self._mover([d for t in layers for d in t.device], [h for t in layers for h in t.host],
                                           "d2h", self._stream())
                self._announce(BACKUP, self._backup)
            return self._loads if direction == LOAD else self._backup

    def _mover(self, src: list, dst: list, direction: str, stream: Any) -> BlockMover:
        try:
            return BlockMover(src, dst, direction, block_dim=0, stream=stream, issuing_thread=False)
        except Exception as e:
            raise EngineTransferError(f"kvswap could not build its {direction} mover for SGLang host pool "
                                      f"{self.layout.name}: {type(e).__name__}: {e}") from e

    def _announce(self, direction: str, mover: BlockMover) -> None:
        what = "loads (layer by layer)" if direction == LOAD else "backups (all layers at once)"
        self._log.info("kvswap %s serves the HiCache %s of %s: a page is %d piece(s), %d B; %s", __version__, what,
                       self.layout.name, mover.chunks_per_block, mover.block_bytes, route_summary(mover))
        self._log.debug("kvswap %s routes of %s:\n%s", direction, self.layout.name, mover.explain())

    # -- per call -----------------------------------------------------------------------
    def load(self, layer: LayerTensors, pages: Pages) -> None:
        """Enqueue one layer's load of ``pages`` (host pages to device pages)."""
        mover = self._built(LOAD)[layer.layer_id]
        self._run(mover, pages.host, pages.device, f"layer {layer.layer_id}", "load")

    def backup(self, pages: Pages) -> None:
        """Enqueue the backup of ``pages`` (device pages to host pages) over every layer."""
        self._run(self._built(BACKUP), pages.device, pages.host, "all layers", "back up")

    def _run(self, mover: BlockMover, src: Any, dst: Any, what: str, verb: str) -> None:
        try:
            job = mover.submit(src, dst)
            stream = mover.stream
            if stream is not None:
                current = _current_stream(self._index)
                if current.cuda_stream != stream.cuda_stream:
                    current.wait_stream(stream)  # what the caller records next follows the copy
                if mover.bounces_host_memory and verb != "load":
                    mover.wait(job)  # pageable host memory is written by a thread, after the stream
            failed = [r for r in mover.poll() if not r.ok]
        except Exception as e:
            raise EngineTransferError(f"kvswap could not {verb} {what} of SGLang host pool {self.layout.name}: "
                                      f"{type(e).__name__}: {e}") from e
        if failed:
            raise EngineTransferError(f"kvswap could not {verb} {what} of SGLang host pool {self.layout.name}: "
                                      f"job {failed[0].job_id} failed: {failed[0].error}")

    # -- what it does -------------------------------------------------------------------
    def explain(self) -> str:
        """What this pool's loads and backups take and why (each direction's
        :meth:`kvswap.BlockMover.explain`; a direction not called yet says so)."""
        with self._lock:
            loads, backup = self._loads, self._backup
        parts = [f"kvswap serves SGLang host pool {self.layout.name}"]
        built = next(iter((loads or {}).values()), backup)
        if built is not None and built.bounces_host_memory:
            parts.append("host memory: pageable (pin_memory=False), staged through kvswap's pinned buffers; "
                         "backups wait for their copy")
        if loads is None:
            parts.append("loads: none yet (their movers are built at the first load)")
        else:
            first = next(iter(loads.values()))
            parts.append(f"loads, layer by layer ({len(loads)} movers of one shape; a page is "
                         f"{first.chunks_per_block} piece(s), {first.block_bytes} B):\n{first.explain()}")
        if backup is None:
            parts.append("backups: none yet (the mover is built at the first backup)")
        else:
            parts.append(f"backups, all layers at once (a page is {backup.chunks_per_block} piece(s), "
                         f"{backup.block_bytes} B):\n{backup.explain()}")
        return "\n".join(parts)

    def close(self) -> None:
        """Wait for every job and close the movers."""
        with self._lock:
            movers = list((self._loads or {}).values()) + ([self._backup] if self._backup else [])
        for m in movers:
            m.close()
