"""How a BlockMover is built: everything a job does not depend on is decided here, once.

From the tensors it derives where every block lives, resolves the copy route, picks the
staged, by-id or descriptor path and where jobs are issued, and makes the completion, the
descriptor pool and the bounce buffers a job uses: the mover's :class:`~.plan.Plan`.
"""
from __future__ import annotations

import warnings
from typing import Any, Optional

from ..addressing.regions import jobs_overlap
from ..errors import ConfigurationError, ForkedProcessError
from ..memory import numa
from ..memory.allocation import allocating
from ..memory.pinned_pool import DescriptorPool
from ..resolution.resolver import resolve
from ..types import Direction, Policy
from . import process
from .completion import CudaCompletion, HostCompletion
from .descriptors import JobDescriptors
from .inputs import bouncer_for, device_side, group_templates, groups_share_destinations, paired_sides
from .plan import LAUNCH_HERE_FROM, Plan, bind_ids
from .route_choice import staged_choice
from .types import KVGroup


def build(specs: list[KVGroup], grouped: bool, direction: Direction, policy: Optional[Policy], stream: Any,
          resolve_kw: dict[str, Any], issuing_thread: Optional[bool], device_descriptors: bool) -> tuple[Plan, list]:
    """The plan of a mover over ``specs``, and the tensors its addresses point into."""
    if issuing_thread is not None and not isinstance(issuing_thread, bool):
        raise ConfigurationError(f"issuing_thread={issuing_thread!r} must be None, True or False")
    if not isinstance(device_descriptors, bool):
        raise ConfigurationError(f"device_descriptors={device_descriptors!r} must be True or False")
    policy = policy or Policy()
    sides = paired_sides(specs, grouped)
    all_src = [t for s, _ in sides for t in s]
    all_dst = [t for _, d in sides for t in d]
    device = device_side(all_src, all_dst, direction)
    templates = group_templates(sides, [spec.block_dim for spec in specs], grouped)
    on_device = device.type != "cpu"
    if on_device and process.cuda_forked():
        raise ForkedProcessError(
            f"cannot build a mover on {device}: CUDA was initialised in the parent of this process before it "
            f"forked, and a forked child cannot use it; start workers with multiprocessing's 'spawn' method"
        )
    block_bytes = sorted({c for t in templates for c in t.chunk_sizes})
    resolve_args = dict(device="cpu" if not on_device else str(device), block_bytes=block_bytes, **resolve_kw)
    fn = resolve(direction, policy=policy, **resolve_args)
    host = [] if direction is Direction.D2D else (all_src if direction.src_is_host else all_dst)
    bounce = bouncer_for(host, fn, direction, policy, on_device, grouped)
    notes = []
    # Host memory on another NUMA node than the device's crosses the inter-socket link.
    numa_note = numa.host_memory_note(host, fn.plan.device) if host else None
    if numa_note:
        warnings.warn(numa.NumaWarning(numa_note), stacklevel=4)
    if not on_device:
        if stream is not None:
            raise ConfigurationError(f"stream={stream!r}: a mover between host tensors has no stream")
        completion: Any = HostCompletion()
    else:
        with allocating("a BlockMover's transfer stream", 0, "device"):
            completion = CudaCompletion(device.index or 0, stream)
    pool = DescriptorPool(pinned=on_device)
    pool.release(pool.acquire(1))  # its first buffer now: running out is an error here, not in a step
    check_across = grouped and groups_share_destinations(sides)
    # Tensors that share memory across the two sides (or views cut two ways): each job's
    # descriptors are checked whole before anything is enqueued.
    check_all = jobs_overlap(templates)
    # With device_descriptors, where the route derives addresses itself (CopyImpl.by_ids), a
    # job sends only ids. Its templates are base + id * stride: sub-blocks (a block-size
    # factor) take the descriptor path.
    ids_ok = (device_descriptors and len(templates) == 1 and bounce is None and templates[0].factor == 1
              and not check_all)
    ids = None
    if ids_ok and on_device:  # a host side in long runs (block-major) takes a staged route where one serves
        choice = staged_choice(fn, templates[0], direction, policy, resolve_args)
        ids = choice.steps
        notes.append(choice.note)
    if ids is None and ids_ok:
        ids = bind_ids(fn, templates[0])
    # The checks of a job's descriptors must raise before anything is enqueued, and bounce
    # buffers read or write the host blocks around the copy: those movers issue in submit.
    threaded = on_device if issuing_thread is None else issuing_thread
    if threaded and (check_across or check_all or bounce is not None):
        if issuing_thread:
            raise ConfigurationError(
                "issuing_thread=True: this mover "
                + ("carries pageable host memory through bounce buffers" if bounce is not None
                   else "has KV groups that share destination tensors" if check_across
                   else "has source and destination tensors that share memory")
                + ", so it issues on the caller's thread; leave issuing_thread out"
            )
        threaded = False
    # Left to kvswap (issuing_thread=None), a device mover launches a large by-id job in submit
    # while its thread is idle; issuing_thread=True sends every job to the thread.
    here_from = LAUNCH_HERE_FROM if threaded and issuing_thread is None and ids is not None else None
    plan = Plan(fn, JobDescriptors(templates, pool, check_across, check_all), completion, ids, bounce, threaded,
                here_from, grouped, tuple(n for n in notes + [numa_note or ""] if n))
    return plan, sides
