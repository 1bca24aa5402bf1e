"""Whether a device BlockMover moves its blocks through a staged route, and why.

A staged route (a :class:`~kvswap.CopyImpl` of kind ``"staged"``) gathers or scatters a
block's scattered device chunks in a short burst at memory speed and crosses the link with
the copy engines, one descriptor per host run: as fast as a copy kernel where the runs are
long, and it leaves the SMs to the compute for the rest of the transfer. Where the host side
keeps the device's small chunks apart (a per-layer host cache), the link would copy them one
by one at the copy engines' small-chunk speed, so the mover keeps its resolved route.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from ..errors import AllocationError
from .descriptors import by_ids_steps
from ..addressing.regions import DescriptorTemplate
from ..resolution.resolver import resolve
from ..addressing.runs import host_runs
from ..resolution.swapfn import SwapFn
from ..types import Direction, Policy

# The shortest host run a staged route takes. Batch copies of 64 KiB blocks ran at 0.8 of the
# link's ceiling on an H200 and of 128 KiB at 0.88 (docs/benchmarks.md), against 0.1-0.4 at
# 4-16 KiB, where a per-layer host cache keeps the device's chunks.
MIN_RUN_BYTES = 64 << 10


def staged_steps(fn: SwapFn, template: DescriptorTemplate, direction: Direction, policy: Policy,
                 resolve_args: dict[str, Any]) -> tuple[Optional[tuple], str]:
    """``(steps, note)``: the staged route's by-id steps (as :func:`by_ids_steps` gives
    them) where this mover takes it, else None; ``note`` says why, for ``explain()``."""
    if policy.force or direction is Direction.D2D:
        return None, ""
    staged = [c for c in fn.plan.candidates if c.kind == "staged"]
    if not staged:
        return None, ""
    usable = [c for c in staged if c.available]
    if not usable:
        c = staged[0]
        return None, f"staged route not used: {c.name} is unavailable ({c.reason})"
    name = usable[0].name
    runs = host_runs(template, host_is_src=direction.src_is_host)
    if runs.smallest < MIN_RUN_BYTES:
        return None, (f"staged route not used: the host side holds a block as {runs.count} run(s) of "
                      f"{runs.smallest}+ bytes, and the link copies runs under {MIN_RUN_BYTES >> 10} KiB slowly; "
                      f"a block-major host cache (kvswap.host_cache) holds each block as one run")
    try:
        route = resolve(direction, policy=replace(policy, force=name), **resolve_args)
        steps = by_ids_steps(route, template)
    except AllocationError:  # out of memory: the mover cannot be built as asked
        raise
    except Exception as e:  # the resolved route serves instead
        return None, f"staged route not used: {name} could not be bound ({type(e).__name__}: {e})"
    if steps is None:
        return None, (f"staged route not used: {name} declined this layout (pieces not 8-byte aligned, or a "
                      f"block larger than half of Policy.staging_bytes={policy.staging_bytes})")
    return steps, (f"staged: {name} moves each block as {runs.count} host run(s) of {runs.smallest}+ bytes "
                   f"over the link, the device side gathered or scattered in bursts")
