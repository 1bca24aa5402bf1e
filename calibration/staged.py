"""The staged route's speed by chunk size, on the host layout it serves.

A staged route (a :class:`~kvswap.CopyImpl` of kind ``"staged"``) moves per-layer device
chunks through a device staging buffer and crosses the link in whole host runs, so it is
measured as a BlockMover runs it: per-layer device tensors paired with a **block-major**
host cache (:func:`kvswap.host_cache`, one run per block), jobs of random block ids, the
route forced. A per-layer host side is never measured: there the link copies each chunk by
itself, and a mover never takes the staged route (docs/design.md, "A third way: staged").

Per direction and chunk size, the job's GB/s (the median over repetitions of the job's
own events, every byte checked once) becomes a :class:`~kvswap.Curve` named by the staged
implementation, keyed by chunk size like every other route's: the profile's ``staged``
section (:func:`profile_section`), which :func:`kvswap.resolution.profiles.to_calibration`
adds to the calibration's curves. Its host cost and compute slowdown are measured by
:mod:`.host_cost` and :mod:`.step_interference` on the same host layout.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

import numpy as np

from kvswap import Curve, Policy
from kvswap.cli.models import KVCache, ModelShape
from kvswap.types import DeviceInfo, Direction

from .binding import Failures
from .progress import Progress
from .step_workload import StepPools
from .timing import median, on_host

KiB, MiB = 1024, 1 << 20
HOST_LAYOUT = "block-major"
# Head width of the synthetic caches: a chunk of 16 tokens x heads x 32 bf16 is 1 KiB a head.
HEAD_DIM = 32
BLOCK_TOKENS = 16


@dataclass(frozen=True)
class StagedSettings:
    """What :func:`measure` times: per chunk size, a cache of ``layers`` layers (K and V:
    ``2 * layers`` chunks a block, one host run), jobs of up to ``job_blocks`` blocks from a
    pool of at most ``pool_bytes`` a side, ``reps`` timed jobs after one untimed."""

    chunk_sizes: tuple[int, ...]
    layers: int
    job_blocks: int
    pool_bytes: int
    reps: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def chunks_per_block(self) -> int:
        return 2 * self.layers


def settings_for(device: DeviceInfo, quick: bool = False) -> StagedSettings:
    """On an accelerator, 32 layers (64 chunks a block: 4 KiB chunks make 256 KiB runs, as
    llama-3.1-8b at TP 8 has them) and jobs of 512 blocks, the step benchmark's; on a
    CPU-only machine, where Triton's interpreter runs the device side, a few small ones."""
    if on_host(device):
        return StagedSettings(chunk_sizes=(2 * KiB, 8 * KiB) if quick else (1 * KiB, 4 * KiB, 16 * KiB), layers=2,
                              job_blocks=4, pool_bytes=4 * MiB, reps=2 if quick else 3)
    return StagedSettings(chunk_sizes=(4 * KiB, 16 * KiB, 64 * KiB) if quick
                          else (2 * KiB, 4 * KiB, 8 * KiB, 16 * KiB, 32 * KiB, 64 * KiB, 128 * KiB),
                          layers=32, job_blocks=512, pool_bytes=(1 << 30) if quick else (2 << 30),
                          reps=3 if quick else 7)


def cache_at(chunk_bytes: int, layers: int) -> KVCache:
    """A FlashAttention-layout cache of ``layers`` layers whose chunks are ``chunk_bytes``
    (a multiple of 1 KiB)."""
    heads = max(1, chunk_bytes // (BLOCK_TOKENS * HEAD_DIM * 2))
    return ModelShape(f"staged {chunk_bytes // KiB} KiB chunks", layers, heads, HEAD_DIM).at(1, BLOCK_TOKENS)


def staged_impl(direction: Direction, spec: Any, host: Any) -> Optional[str]:
    """The staged implementation a mover can use here in ``direction``, or None."""
    from .step_contenders import routes_available

    return routes_available(direction, spec, host).staged


def measure(env: Any, dev: DeviceInfo, directions: Sequence[Direction], settings: StagedSettings, *,
            spec: Any = None, host: Any = None, progress: Optional[Progress] = None,
            failures: Optional[Failures] = None, seed: int = 0) -> list[dict[str, Any]]:
    """One record per direction and chunk size where a staged route is available: the
    median GB/s of ``settings.reps`` jobs on a block-major host cache."""
    from .step import Contender, make_mover, transfer_alone

    failures = failures if failures is not None else Failures()
    spec = dev.torch_device if spec is None else spec
    rng = np.random.default_rng(seed)
    records: list[dict[str, Any]] = []
    names = {d: staged_impl(Direction.parse(d), spec, host) for d in directions}
    if progress is not None:
        progress.add(sum(len(settings.chunk_sizes) for n in names.values() if n))
    for chunk in settings.chunk_sizes:
        cache = cache_at(chunk, settings.layers)
        num_blocks = max(2, min(2 * settings.job_blocks, settings.pool_bytes // cache.block_bytes))
        blocks = max(1, min(settings.job_blocks, num_blocks // 2))
        pools = None
        for d in (Direction.parse(x) for x in directions):
            name = names[d]
            if name is None:
                continue
            try:
                pools = pools or StepPools(env, cache, num_blocks, seed, HOST_LAYOUT)
                pools.prepare(d)
                src, dst = pools.sides(d)
                with env.context():
                    mover = make_mover(src, dst, d, cache.block_dim, Contender("staged", Policy(force=name)), dev)
                try:
                    sid, did = pools.draw(rng, blocks)
                    transfer_alone(env, pools, mover, d, sid, did)  # untimed: warms up, and is checked
                    checked = pools.check(d, sid, did)
                    seconds = []
                    for _ in range(settings.reps):
                        sid, did = pools.draw(rng, blocks)
                        seconds.append(transfer_alone(env, pools, mover, d, sid, did))
                    num_sms = mover.swap_fn.plan.params.get(name, {}).get("num_sms")
                finally:
                    mover.close()
            except Exception as e:
                failures.add(d, name, None, chunk, e)
                continue
            finally:
                if progress is not None:
                    progress.step(f"{d} staged {chunk // KiB} KiB")
            t = median(seconds)
            records.append({"direction": str(d), "route": name, "kind": "staged", "num_sms": num_sms,
                            "chunk_bytes": chunk, "run_bytes": cache.block_bytes, "blocks": blocks,
                            "host_layout": HOST_LAYOUT, "seconds": t, "reps": len(seconds),
                            "gbps": float(f"{blocks * cache.block_bytes / max(t, 1e-12) / 1e9:.4g}"),
                            "bytes_checked": checked})
        del pools
    return records


def curves(records: Sequence[dict[str, Any]]) -> list[Curve]:
    """The staged route's curves: GB/s by chunk size, per direction and implementation."""
    pts: dict[tuple[str, str], dict[int, float]] = {}
    for r in records:
        if r.get("gbps"):
            pts.setdefault((r["direction"], r["route"]), {})[r["chunk_bytes"]] = r["gbps"]
    return [Curve(impl, Direction.parse(d), tuple(sorted(p.items()))) for (d, impl), p in sorted(pts.items())]


SOURCE = ("measured: BlockMover jobs through the staged route, per-layer device tensors and a block-major host "
          "cache (one run per block), GB/s by chunk size")


def profile_section(records: Sequence[dict[str, Any]], settings: StagedSettings,
                    before: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """A profile's ``staged`` section: ``curves`` (GB/s by chunk size, per direction and
    staged implementation), ``host_layout``, ``chunks_per_block`` and ``source``. Curves
    of ``before`` (the section in force) that this run did not measure are kept."""
    from .decisions import curve_from_dict, curve_to_dict

    fresh = curves(records)
    mine = {(str(c.direction), c.impl) for c in fresh}
    kept = [curve_from_dict(c) for c in (before or {}).get("curves", ())
            if (c["direction"], c["impl"]) not in mine]
    return {"curves": [curve_to_dict(c) for c in sorted(kept + fresh, key=lambda c: (str(c.direction), c.impl))],
            "host_layout": HOST_LAYOUT, "chunks_per_block": settings.chunks_per_block, "source": SOURCE}


def describe(section: dict[str, Any]) -> list[str]:
    """Lines a person reads: per direction, the staged route's GB/s by chunk size."""
    out = []
    for c in section.get("curves", ()):
        pts = ", ".join(f"{g:.3g} at {b // KiB} KiB" for b, g in c["points"])
        out.append(f"{c['direction']} {c['impl']} (block-major host, {section.get('chunks_per_block')} chunks a "
                   f"block): GB/s by chunk size {pts}")
    return out
