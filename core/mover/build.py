"""How a BlockMover is built: everything a job does not depend on is decided here, once.

From the tensors it derives where every block lives, resolves the copy route, picks the
staged, by-id or descriptor path, and makes the completion, the descriptor pool and the
staging a job uses.
"""
from __future__ import annotations

import threading
import warnings
from collections import deque
from typing import Any, Optional

import numpy as np

from ..addressing.regions import DescriptorTemplate, jobs_overlap
from ..errors import ConfigurationError, ForkedProcessError
from ..memory import numa
from ..memory.allocation import allocating
from ..memory.pinned_pool import DescriptorPool
from ..memory.staging import Stager
from ..resolution.resolver import resolve
from ..resolution.swapfn import SwapFn
from ..types import Direction, DirectionLike, Policy
from . import process
from .completion import CudaCompletion, HostCompletion
from .descriptors import JobDescriptors, by_ids_steps
from .inputs import device_side, group_templates, groups_share_destinations, paired_sides, stager_for
from .issuing import IssuingThread
from .jobs import Job
from .staged import staged_choice
from .types import KVGroup, TransferResult
from .within import QuietChoice, StagedRanking


def _keep_route(n: int, within: float) -> None:
    """``within``'s choice for a mover that took the staged route by rule: keep it."""
    return None


class Setup:
    """The construction of a :class:`~kvswap.BlockMover` (its ``__init__`` and ``groups``
    call this)."""

    def _setup(self, specs: list[KVGroup], grouped: bool, direction: DirectionLike,
               policy: Optional[Policy], stream: Any, resolve_kw: dict[str, Any],
               issuing_thread: Optional[bool]) -> None:
        self._closed = True  # until built: __del__ and close() have nothing to wait for
        self._pid, self._lock = process.pid, threading.RLock()
        self._issuer: Optional[IssuingThread] = None
        self._last_handed: Optional[Job] = None  # the last job given to the issuing thread
        if issuing_thread is not None and not isinstance(issuing_thread, bool):
            raise ConfigurationError(f"issuing_thread={issuing_thread!r} must be None, True or False")
        if not isinstance(self._device_descriptors, bool):
            raise ConfigurationError(f"device_descriptors={self._device_descriptors!r} must be True or False")
        self._inflight: deque[Job] = deque()
        self.direction = Direction.parse(direction)
        self._grouped = grouped
        sides = paired_sides(specs, grouped)
        all_src = [t for s, _ in sides for t in s]
        all_dst = [t for _, d in sides for t in d]
        device = device_side(all_src, all_dst, self.direction)
        templates = group_templates(sides, [spec.block_dim for spec in specs], grouped)
        self._templates: list[DescriptorTemplate] = templates
        self._per_block = np.array([t.count for t in templates], dtype=np.int64)
        on_device = device.type != "cpu"
        if on_device and process.cuda_forked():
            raise ForkedProcessError(
                f"cannot build a mover on {device}: CUDA was initialised in the parent of this process before it "
                f"forked, and a forked child cannot use it; start workers with multiprocessing's 'spawn' method"
            )
        block_bytes = sorted({c for t in templates for c in t.chunk_sizes})
        self._resolve_args = dict(device="cpu" if not on_device else str(device), block_bytes=block_bytes,
                                  **resolve_kw)
        self._fn: SwapFn = resolve(self.direction, policy=policy, **self._resolve_args)
        # Per job with ``within``: the route that takes no SMs, where it ends the step sooner
        # (on a device bound and predicted now, not on the engine's steps).
        self._within = QuietChoice(self._fn, self.direction, policy or Policy(), self._resolve_args, templates,
                                   block_bytes, on_device)
        host = [] if self.direction is Direction.D2D else (all_src if self.direction.src_is_host else all_dst)
        self._stager: Optional[Stager] = stager_for(host, self._fn, self.direction, policy or Policy(), on_device,
                                                    grouped)
        # Host memory on another NUMA node than the device's crosses the inter-socket link.
        self._numa_note = numa.host_memory_note(host, self._fn.plan.device) if host else None
        if self._numa_note:
            warnings.warn(numa.NumaWarning(self._numa_note), stacklevel=3)
        if not on_device:
            if stream is not None:
                raise ConfigurationError(f"stream={stream!r}: a mover between host tensors has no stream")
            self._completion: Any = HostCompletion()
        else:
            with allocating("a BlockMover's transfer stream", 0, "device"):
                self._completion = CudaCompletion(device.index or 0, stream)
        self.pool = DescriptorPool(pinned=on_device)
        self.pool.release(self.pool.acquire(1))  # its first buffer now: running out is an error here, not in a step
        self._check_across = grouped and groups_share_destinations(sides)
        # Tensors that share memory across the two sides (or views cut two ways): each job's
        # descriptors are checked whole before anything is enqueued.
        self._check_jobs = jobs_overlap(templates)
        # With device_descriptors, where the kernel route derives addresses itself (ByIdsFn), a
        # job sends only ids. Its templates are base + id * stride: sub-blocks (a block-size
        # factor) take the descriptor path.
        by_ids_ok = (self._device_descriptors and len(templates) == 1 and self._stager is None
                     and templates[0].factor == 1 and not self._check_jobs)
        # On a device, a host side in long runs (block-major) takes a staged route where one serves.
        steps, self._staged_note = None, ""
        if by_ids_ok and on_device:
            choice = staged_choice(self._fn, templates[0], self.direction, policy or Policy(), self._resolve_args)
            steps, self._staged_note = choice.steps, choice.note
            if choice.staged is not None:  # predicted: ``within`` ranks it beside the kernel and the batch route
                self._within = StagedRanking(choice, self._fn, self.direction, policy or Policy(), self._resolve_args,
                                             templates[0])
            elif steps is not None:
                self._within = _keep_route  # taken by rule: nothing predicts it to rank it by
        if steps is None and by_ids_ok:
            steps = by_ids_steps(self._fn, templates[0])
        self._desc = JobDescriptors(templates, self.pool, self._check_across, steps, self._check_jobs)
        # The checks of a job's descriptors must raise before anything is enqueued, and staging
        # reads or writes the host blocks around the copy: those movers issue in submit.
        threaded = on_device if issuing_thread is None else issuing_thread
        if threaded and (self._check_across or self._check_jobs or self._stager is not None):
            if issuing_thread:
                raise ConfigurationError(
                    "issuing_thread=True: this mover "
                    + ("stages pageable host memory" if self._stager is not None
                       else "has KV groups that share destination tensors" if self._check_across
                       else "has source and destination tensors that share memory")
                    + ", so it issues on the caller's thread; leave issuing_thread out"
                )
            threaded = False
        self._threaded = threaded
        self._tensors: Optional[list] = sides  # the memory the addresses point into
        self._results: deque[TransferResult] = deque()
        self._next_id = 1
        self._closed = False
