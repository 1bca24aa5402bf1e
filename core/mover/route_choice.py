"""Whether a device BlockMover moves its blocks through a staged route, and why.

A staged route (a :class:`~kvswap.CopyImpl` of kind ``"staged"``) gathers or scatters a
block's scattered device chunks in a short burst at memory speed and crosses the link with
the copy engines, one descriptor per host run: as fast as a copy kernel where the runs are
long, and it leaves the SMs to the compute for the rest of the transfer. Where the host side
keeps the device's chunks apart (a per-layer host cache), the link would copy them one by
one at the copy engines' small-chunk speed, so the mover keeps its resolved route.

Where the calibration measured the staged route (its speed by chunk size on a block-major
host, its host cost and its compute slowdown: ``kvswap calibrate``), the mover takes it
where its predicted makespan of a job is the shortest (:func:`kvswap.resolution.routing.step_cost`);
otherwise by rule, where the host runs are :data:`MIN_RUN_BYTES` or longer.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple, Optional

from ..addressing.regions import DescriptorTemplate
from ..addressing.runs import host_runs
from ..errors import AllocationError
from ..resolution.resolver import resolve
from ..resolution.routing import Rate, step_cost
from ..resolution.swapfn import SwapFn
from ..types import Direction, Policy
from .plan import IdSteps, bind_ids

# The shortest host run a staged route takes where the calibration does not predict it.
# Batch copies of 64 KiB blocks ran at 0.8 of the link's ceiling on an H200 and of 128 KiB at
# 0.88 (docs/benchmarks.md), against 0.1-0.4 at 4-16 KiB, where a per-layer host cache keeps
# the device's chunks.
MIN_RUN_BYTES = 64 << 10
# The job the build-time choice is predicted for: the step benchmark's larger job (512 blocks
# a step).
REFERENCE_BLOCKS = 512


class StagedChoice(NamedTuple):
    """What :func:`staged_choice` decided for a mover: the staged route's by-id steps where
    the mover takes it, else None, and why, for ``explain()`` (the predictions per candidate
    where there are some)."""

    steps: Optional[IdSteps]
    note: str


def _explained(rates: tuple[Rate, ...], count: int, nbytes: int, compute: float, winner: str) -> str:
    """The predictions per candidate in words."""
    parts = []
    for r in rates:
        t = r.seconds(count, nbytes)
        cost = f"{t * 1e3:.3g} ms, step {step_cost(t, r.slowdown, compute) * 1e3:.3g} ms"
        parts.append(f"{r.name} {cost} (compute slowdown {r.slowdown:.0%}){' <- chosen' if r.name == winner else ''}")
    return "; ".join(parts)


def staged_choice(fn: SwapFn, template: DescriptorTemplate, direction: Direction, policy: Policy,
                  resolve_args: dict[str, Any]) -> StagedChoice:
    """Decide, once, whether a device mover of ``template`` takes the staged route (see the
    module doc); the returned choice says why, for ``explain()``."""
    if policy.force or direction is Direction.D2D:
        return StagedChoice(None, "")
    staged = [c for c in fn.plan.candidates if c.kind == "staged"]
    if not staged:
        return StagedChoice(None, "")
    usable = [c for c in staged if c.available]
    if not usable:
        c = staged[0]
        return StagedChoice(None, f"staged route not used: {c.name} is unavailable ({c.reason})")
    name = usable[0].name
    runs = host_runs(template, host_is_src=direction.src_is_host)
    if runs.count >= template.count:  # no two chunks of a block adjacent on the host
        return StagedChoice(None, (
            f"staged route not used: the host side holds a block as {runs.count} run(s) of {runs.smallest}+ bytes, "
            f"every chunk apart (a per-layer host cache), so the link would copy them one by one at the copy "
            f"engines' small-chunk speed, and host threads gathering them reached 0.04-0.39 of the link "
            f"(docs/design.md); a block-major host cache (kvswap.host_cache) holds each block as one run"))
    cal = fn.calibration  # what the resolved route was decided by
    chunk = min(template.chunk_sizes)
    rate, scale = None, 1.0
    if cal is not None and not fn.plan.forced:
        gbps = cal.predict(name, "staged", direction, chunk)
        line = cal.host_line(name, "staged", direction)
        if gbps and line is not None:
            scale = _shorter_runs(fn, cal, direction, runs.smallest, chunk)
            gbps *= scale
            rate = Rate(name, gbps, line[0], line[1], cal.slowdown_at(name, "staged", direction, None, chunk))
    table = fn.rate_table(chunk) if rate is not None and len(set(template.chunk_sizes)) == 1 else None
    count, nbytes = REFERENCE_BLOCKS * template.count, REFERENCE_BLOCKS * template.block_bytes
    every = None if table is None else table.at(count)
    rates = None if every is None else (rate, *every)
    if rates is None:
        why = ("the calibration holds no staged measurement" if rate is None else
               "the calibration does not predict the resolved route's cost (no host cost measured)")
        if runs.smallest < MIN_RUN_BYTES:
            return StagedChoice(None, (
                f"staged route not used (by rule: {why}): the host side holds a block as {runs.count} run(s) of "
                f"{runs.smallest}+ bytes, and the link copies runs under {MIN_RUN_BYTES >> 10} KiB slowly; "
                f"`kvswap calibrate` measures the staged route"))
        verdict = f"by rule: host runs of {MIN_RUN_BYTES >> 10} KiB or more ({why})"
    else:
        # A step whose compute is as long as the quickest transfer: a route that is as fast but
        # slows the compute ends the step later, so a copy beside compute is ranked as one.
        compute = min(r.seconds(count, nbytes) for r in rates)
        cost = [(step_cost(r.seconds(count, nbytes), r.slowdown, compute), i) for i, r in enumerate(rates)]
        win = rates[min(cost)[1]].name
        how = "step makespan max(compute + slowdown x transfer, transfer), compute = the quickest transfer"
        said = (f"predicted {how} for a job of {REFERENCE_BLOCKS} blocks ({cal.source}): "
                f"{_explained(rates, count, nbytes, compute, win)}")
        if scale < 1.0:
            said += (f" (the staged curve scaled by {scale:.2f}: host runs of {runs.smallest} bytes, shorter than "
                     f"the {cal.staged_chunks} chunks a run it was measured on)")
        if win != name:
            return StagedChoice(None, f"staged route not used: {said}")
        verdict = f"by {said}"
    try:
        route = resolve(direction, policy=replace(policy, force=name), **resolve_args)
        steps = bind_ids(route, template)
    except AllocationError:  # out of memory: the mover cannot be built as asked
        raise
    except Exception as e:  # the resolved route serves instead
        return StagedChoice(None, f"staged route not used: {name} could not be bound ({type(e).__name__}: {e})")
    if steps is None:
        return StagedChoice(None, (
            f"staged route not used: {name} declined this layout (pieces not 8-byte aligned, or a "
            f"block larger than half of Policy.staging_bytes={policy.staging_bytes})"))
    return StagedChoice(steps, (
        f"staged: {name} moves each block as {runs.count} host run(s) of {runs.smallest}+ bytes over the link, "
        f"the device side gathered or scattered in bursts; chosen {verdict}"))


def _shorter_runs(fn: SwapFn, cal: Any, direction: Direction, run: int, chunk: int) -> float:
    """The factor the staged curve is scaled by for host runs of ``run`` bytes where it was
    measured on longer ones (``cal.staged_chunks`` chunks a run): the link moves runs, so what
    the batch route (its link) loses at the shorter run; 1 where the runs are as long or
    nothing predicts the batch route."""
    measured = chunk * cal.staged_chunks
    if run >= measured:
        return 1.0
    link = next((c for c in fn.plan.candidates if c.kind == "batch" and c.available), None)
    at_run = cal.predict(link.name, "batch", direction, run) if link else None
    at_measured = cal.predict(link.name, "batch", direction, measured) if link else None
    return min(1.0, at_run / at_measured) if at_run and at_measured else 1.0
