"""Engine-like load on one device for a given time, every job checked (GPU; a short CPU
version runs in the tests).

Movers for both directions, every route the resolver offers (the resolved default and each
usable implementation forced with ``kvswap.Policy(force=...)``) and two host layouts:

* ``per_layer``: a host tensor per layer, FlashAttention-shaped ``(2, blocks, ...)`` on both
  sides;
* ``block_major``: one host tensor ``(blocks, layers, 2, ...)`` with per-layer views
  ``host[:, l]``, against per-layer device tensors of the same block shape ``(blocks, 2,
  ...)``; ``--mixed-pairing`` pairs the views with FlashAttention-shaped ``(2, blocks, ...)``
  device tensors instead (where this kvswap accepts that pairing).

Jobs of 1-512 blocks (log-uniform) go to the movers in turn, with ``after`` cycling through
left out, ``None``, a stream and an event (on a GPU), up to ``--inflight`` jobs in flight a
mover; destination blocks are taken from a free list and return to it, poisoned again, only
once their job was checked. Every job's result is checked on a sample of its blocks (every
layer), one job in fifty on all of them, and then on a few free blocks that must still hold
the poison. Readings of host RSS, pinned and device memory, the movers' descriptor pools and
the thread count are taken at 20% of the run and at the end.

    python3 tests/bench/soak.py --device cuda:0 --seconds 300 --out $OUT/soak
    python3 tests/bench/soak.py --device cpu --seconds 20 --out /tmp/soak

Writes ``soak.json`` under ``--out`` (default ``$OUT``) and prints a table. Exit status 1
when any byte was wrong, a canary changed or a job failed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

POISON = -21846  # 0xAAAA in every 16-bit element of a free destination block


@dataclass
class Config:
    device: str = "cuda:0"
    seconds: float = 300.0
    layers: int = 8
    blocks: int = 8192  # per tensor set and side
    block_tokens: int = 16
    heads: int = 2
    head_dim: int = 64  # bf16: 4 KiB per K or V chunk, 8 KiB per block and layer
    max_job: int = 512
    inflight: int = 256  # jobs in flight per mover, at most
    full_every: int = 50
    sample_blocks: int = 2
    routes: tuple[str, ...] = ()  # default: "default" and every usable implementation
    layouts: tuple[str, ...] = ("per_layer", "block_major")
    directions: tuple[str, ...] = ("h2d", "d2h")
    mixed_pairing: bool = False
    issuing_thread: Optional[bool] = None  # None: the mover's default on a device, True on the host
    mark_at: float = 0.2  # the first reading, as a fraction of the run
    seed: int = 0


@dataclass
class Tally:
    mover: str
    jobs: int = 0
    blocks: int = 0
    bytes: int = 0
    checked_bytes: int = 0
    full_checks: int = 0
    wrong: int = 0
    canaries: int = 0
    failed: int = 0
    max_inflight: int = 0
    first_error: Optional[str] = None
    skipped: Optional[str] = None


class TensorSet:
    """The source and destination tensors of one direction and layout, and the destination
    blocks free to write (poisoned)."""

    def __init__(self, torch: Any, cfg: Config, direction: str, layout: str, rng: np.random.Generator) -> None:
        self.torch, self.direction, self.layout = torch, direction, layout
        on_gpu = cfg.device != "cpu"
        dev = cfg.device if on_gpu else "cpu"
        host_kw = dict(pin_memory=on_gpu)
        L, nb = cfg.layers, cfg.blocks
        inner = (cfg.block_tokens, cfg.heads, cfg.head_dim)
        gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)))

        def random_host(shape: tuple) -> Any:
            t = torch.empty(shape, dtype=torch.bfloat16, **host_kw)
            t.view(torch.int16).copy_(torch.randint(-32768, 32767, shape, dtype=torch.int16, generator=gen))
            return t

        if layout == "per_layer":
            host = [random_host((2, nb) + inner) for _ in range(L)]
            device = [torch.empty((2, nb) + inner, dtype=torch.bfloat16, device=dev) for _ in range(L)]
            host_dim = dev_dim = 1
        else:
            self.host_block_major = random_host((nb, L, 2) + inner)
            host = [self.host_block_major[:, layer] for layer in range(L)]
            host_dim = 0
            if cfg.mixed_pairing:
                device = [torch.empty((2, nb) + inner, dtype=torch.bfloat16, device=dev) for _ in range(L)]
                dev_dim = 1
            else:
                device = [torch.empty((nb, 2) + inner, dtype=torch.bfloat16, device=dev) for _ in range(L)]
                dev_dim = 0
        for t in device:
            t.view(torch.int16).copy_(torch.randint(-32768, 32767, t.shape, dtype=torch.int16, generator=gen))
        if direction == "h2d":
            self.src, self.dst, self.src_dim, self.dst_dim = host, device, host_dim, dev_dim
        else:
            self.src, self.dst, self.src_dim, self.dst_dim = device, host, dev_dim, host_dim
        for t in self.dst:
            t.view(torch.int16).fill_(POISON)
        self.blocks = nb
        self.free: deque[int] = deque(rng.permutation(nb).tolist())
        self.quarantine: deque[tuple[Any, list[int]]] = deque()  # (event or None, ids) being poisoned
        self.on_gpu = on_gpu and self.dst[0].is_cuda

    @property
    def block_dim(self) -> Any:
        return self.src_dim if self.src_dim == self.dst_dim else (self.src_dim, self.dst_dim)

    def take(self, n: int) -> Optional[np.ndarray]:
        while self.quarantine and (self.quarantine[0][0] is None or self.quarantine[0][0].query()):
            self.free.extend(self.quarantine.popleft()[1])
        if len(self.free) < n:
            return None
        return np.array([self.free.popleft() for _ in range(n)], dtype=np.int64)

    def release(self, did: np.ndarray) -> None:
        """Poison the blocks again; free them once the poison is in place."""
        idx = self.torch.as_tensor(did, device=self.dst[0].device)
        for t in self.dst:
            t.view(self.torch.int16).index_fill_(self.dst_dim, idx, POISON)
        event = None
        if self.on_gpu:
            event = self.torch.cuda.Event()
            event.record()
        self.quarantine.append((event, did.tolist()))

    def compare(self, sid: np.ndarray, did: np.ndarray) -> tuple[int, int]:
        """``(wrong bytes, bytes checked)`` of blocks ``did`` against sources ``sid``, every layer."""
        torch = self.torch
        wrong = checked = 0
        for s, d in zip(self.src, self.dst):
            a = s.index_select(self.src_dim, torch.as_tensor(sid, device=s.device)).movedim(self.src_dim, 0)
            b = d.index_select(self.dst_dim, torch.as_tensor(did, device=d.device)).movedim(self.dst_dim, 0)
            a, b = a.contiguous().cpu().view(torch.uint8), b.contiguous().cpu().view(torch.uint8)
            wrong += int((a != b).sum())
            checked += a.numel()
        return wrong, checked

    def canaries(self, rng: np.random.Generator, k: int) -> int:
        """Bytes that are not poison in ``k`` free destination blocks."""
        if not self.free:
            return 0
        ids = self.torch.as_tensor(rng.choice(np.array(self.free), min(k, len(self.free)), replace=False))
        bad = 0
        for d in self.dst:
            got = d.index_select(self.dst_dim, ids.to(d.device)).contiguous().cpu().view(self.torch.int16)
            bad += 2 * int((got != POISON).sum())
        return bad


def routes_for(kvswap: Any, direction: str, device: str) -> list[str]:
    fn = kvswap.resolve(direction, device=device)
    return ["default"] + [c.name for c in fn.plan.candidates if c.available]


def reading(torch: Any, cfg: Config, movers: dict) -> dict[str, Any]:
    """Host RSS, threads, pinned and device memory, and the movers' pools, now."""
    out: dict[str, Any] = {"python_threads": threading.active_count()}
    try:
        status = Path("/proc/self/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        out["rss_bytes"] = int(fields["VmRSS"].split()[0]) * 1024
        out["os_threads"] = int(fields["Threads"])
    except (OSError, KeyError, ValueError):
        import resource

        out["rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    pools = {k: dict(allocated=m.pool.allocated, idle=m.pool.idle, in_use=m.pool.in_use, in_flight=m.in_flight)
             for k, m in movers.items()}
    out["descriptor_pools"] = pools
    out["descriptor_buffers"] = sum(p["allocated"] for p in pools.values())
    if cfg.device != "cpu":
        dev = torch.device(cfg.device)
        out["device_allocated"] = torch.cuda.memory_allocated(dev)
        out["device_reserved"] = torch.cuda.memory_reserved(dev)
        free, total = torch.cuda.mem_get_info(dev)
        out["device_used"] = total - free
        stats = getattr(torch.cuda, "host_memory_stats", None)
        if callable(stats):
            try:
                host = stats()
                out["pinned_bytes"] = next((v for k, v in host.items() if "allocated" in k and "current" in k), None)
                out["pinned_reserved"] = next((v for k, v in host.items() if "reserved" in k and "current" in k), None)
            except Exception:
                pass
        try:
            from kvswap.backends.triton_generic import launch_buffers

            out["launch_buffers"] = sum(len(p) for p in list(launch_buffers._POOLS.values()))
        except Exception:
            pass
    return out


@dataclass
class Report:
    config: dict[str, Any]
    device: str = ""
    seconds: float = 0.0
    rows: list[Tally] = field(default_factory=list)
    readings: dict[str, Any] = field(default_factory=dict)

    def totals(self) -> dict[str, int]:
        keys = ("jobs", "blocks", "bytes", "checked_bytes", "full_checks", "wrong", "canaries", "failed")
        out = {k: sum(getattr(r, k) for r in self.rows) for k in keys}
        out["max_inflight"] = max((r.max_inflight for r in self.rows), default=0)
        return out

    def to_dict(self) -> dict[str, Any]:
        return dict(config=self.config, device=self.device, seconds=round(self.seconds, 1), totals=self.totals(),
                    rows=[asdict(r) for r in self.rows], readings=self.readings, growth=self.growth())

    def growth(self) -> dict[str, Any]:
        """End reading minus the first, for every number both have."""
        a, b = self.readings.get("mark", {}), self.readings.get("end", {})
        return {k: b[k] - a[k] for k in a if isinstance(a.get(k), (int, float)) and isinstance(b.get(k), (int, float))}


def run(cfg: Config) -> Report:
    import torch

    import kvswap

    rng = np.random.default_rng(cfg.seed)
    on_gpu = cfg.device != "cpu"
    report = Report(asdict(cfg), torch.cuda.get_device_name(cfg.device) if on_gpu else "cpu")
    threaded = cfg.issuing_thread if cfg.issuing_thread is not None else (None if on_gpu else True)
    sets, movers, tallies = {}, {}, {}
    for direction in cfg.directions:
        for layout in cfg.layouts:
            ts = sets[direction, layout] = TensorSet(torch, cfg, direction, layout, rng)
            for route in cfg.routes or routes_for(kvswap, direction, cfg.device):
                key = f"{direction}/{layout}/{route}"
                tally = tallies[key] = Tally(key)
                report.rows.append(tally)
                policy = None if route == "default" else kvswap.Policy(force=route)
                try:
                    movers[key] = kvswap.BlockMover(ts.src, ts.dst, direction, block_dim=ts.block_dim, policy=policy,
                                                    issuing_thread=threaded)
                except kvswap.KvSwapError as e:
                    tally.skipped = f"{type(e).__name__}: {e}"
                    print(f"{key}: skipped: {tally.skipped}", flush=True)
    keys = list(movers)
    side = torch.cuda.Stream(cfg.device) if on_gpu else None
    afters = ["current", None] + (["stream", "event"] if on_gpu else [])
    pending: dict[str, dict[int, tuple]] = {k: {} for k in keys}
    started = time.monotonic()
    mark_at, deadline = started + cfg.mark_at * cfg.seconds, started + cfg.seconds
    count = 0

    def settle(key: str, results: list) -> None:
        tally, (direction, layout, _) = tallies[key], key.split("/")
        ts = sets[direction, layout]
        for r in results:
            sid, did, full = pending[key].pop(r.job_id)
            if not r.ok:
                tally.failed += 1
                tally.first_error = tally.first_error or f"job {r.job_id}: {r.error}"
            else:
                tally.bytes += r.bytes
            pick = np.arange(len(sid)) if full else rng.choice(len(sid), min(cfg.sample_blocks, len(sid)),
                                                               replace=False)
            wrong, checked = ts.compare(sid[pick], did[pick])
            if full:
                tally.full_checks += 1
                tally.canaries += ts.canaries(rng, 2)
            tally.wrong += wrong
            tally.checked_bytes += checked
            if wrong and tally.first_error is None:
                tally.first_error = f"job {r.job_id}: {wrong} wrong bytes in {len(pick)} checked blocks"
            ts.release(did)

    while time.monotonic() < deadline:
        key = keys[count % len(keys)]
        count += 1
        mover, tally = movers[key], tallies[key]
        direction, layout, _ = key.split("/")
        ts = sets[direction, layout]
        settle(key, mover.poll())
        if mover.in_flight >= cfg.inflight:
            oldest = min(pending[key])
            mover.wait(oldest)
            settle(key, mover.poll())
            continue
        n = int(np.exp(rng.uniform(0, np.log(cfg.max_job + 1)))) or 1
        did = ts.take(min(n, cfg.max_job))
        if did is None:  # the destination is full of jobs in flight: let the oldest finish
            if pending[key]:
                mover.wait(min(pending[key]))
                settle(key, mover.poll())
            continue
        sid = rng.integers(0, ts.blocks, len(did)).astype(np.int64)
        kind = afters[count % len(afters)]
        if kind == "stream":
            side.wait_stream(torch.cuda.current_stream(cfg.device))
            after: Any = side
        elif kind == "event":
            after = torch.cuda.Event()
            after.record()
        else:
            after = kind
        if on_gpu and count % 16 == 0:
            torch.cuda._sleep(20_000)  # keep the compute stream busy now and then: ``after`` means something
        job = mover.submit(sid, did) if kind == "current" else mover.submit(sid, did, after=after)
        pending[key][job] = (sid, did, tally.jobs % cfg.full_every == 0)
        tally.jobs += 1
        tally.blocks += len(did)
        tally.max_inflight = max(tally.max_inflight, mover.in_flight)
        if "mark" not in report.readings and time.monotonic() >= mark_at:
            report.readings["mark"] = dict(reading(torch, cfg, movers), at_s=round(time.monotonic() - started, 1))
    for key, mover in movers.items():
        mover.wait()
        settle(key, mover.poll())
    if on_gpu:
        torch.cuda.synchronize(cfg.device)
    report.readings.setdefault("mark", dict(reading(torch, cfg, movers), at_s=round(time.monotonic() - started, 1)))
    report.readings["end"] = dict(reading(torch, cfg, movers), at_s=round(time.monotonic() - started, 1))
    for mover in movers.values():
        mover.close()
    report.seconds = time.monotonic() - started
    return report


def table(report: Report) -> str:
    lines = [f"{'mover':34s} {'jobs':>7s} {'blocks':>9s} {'GB':>8s} {'checked GB':>10s} {'full':>5s} "
             f"{'wrong':>6s} {'canary':>6s} {'failed':>6s} {'in flight':>9s}"]
    for r in report.rows:
        if r.skipped:
            lines.append(f"{r.mover:34s} skipped: {r.skipped}")
            continue
        lines.append(f"{r.mover:34s} {r.jobs:7d} {r.blocks:9d} {r.bytes / 1e9:8.2f} {r.checked_bytes / 1e9:10.3f} "
                     f"{r.full_checks:5d} {r.wrong:6d} {r.canaries:6d} {r.failed:6d} {r.max_inflight:9d}"
                     + (f"  {r.first_error}" if r.first_error else ""))
    t = report.totals()
    lines.append(f"{'total':34s} {t['jobs']:7d} {t['blocks']:9d} {t['bytes'] / 1e9:8.2f} {t['checked_bytes'] / 1e9:10.3f} "
                 f"{t['full_checks']:5d} {t['wrong']:6d} {t['canaries']:6d} {t['failed']:6d} {t['max_inflight']:9d}")
    lines += ["", f"{'reading':26s} {'at ' + str(report.readings['mark'].get('at_s')) + ' s':>16s} "
                  f"{'at end':>16s} {'growth':>14s}"]
    a, b, g = report.readings["mark"], report.readings["end"], report.growth()
    for k in a:
        if k in g and k != "at_s":
            lines.append(f"{k:26s} {a[k]:>16,} {b[k]:>16,} {g[k]:>+14,}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--seconds", type=float, default=Config.seconds)
    p.add_argument("--layers", type=int, default=Config.layers)
    p.add_argument("--blocks", type=int, default=Config.blocks)
    p.add_argument("--inflight", type=int, default=Config.inflight)
    p.add_argument("--routes", default="", help="comma-separated (default: 'default' and every usable route)")
    p.add_argument("--layouts", default=",".join(Config.layouts))
    p.add_argument("--directions", default=",".join(Config.directions))
    p.add_argument("--mixed-pairing", action="store_true", help="block-major host views with (2, blocks, ...) tensors")
    p.add_argument("--mark-at", type=float, default=Config.mark_at, help="first reading, as a fraction of the run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("OUT", "soak-out"))
    a = p.parse_args(argv)
    cfg = Config(device=a.device, seconds=a.seconds, layers=a.layers, blocks=a.blocks, inflight=a.inflight,
                 routes=tuple(x for x in a.routes.split(",") if x), layouts=tuple(a.layouts.split(",")),
                 directions=tuple(a.directions.split(",")), mixed_pairing=a.mixed_pairing, mark_at=a.mark_at,
                 seed=a.seed)
    report = run(cfg)
    print(table(report))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(report.to_dict(), indent=1))
    print(f"wrote {out / 'soak.json'} ({report.seconds:.0f} s on {report.device})")
    t = report.totals()
    return 1 if t["wrong"] or t["canaries"] or t["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
