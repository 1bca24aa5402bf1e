"""Random transfers through every route, every byte and every canary checked.

Not a benchmark: a correctness fuzz. For each direction (h2d, d2h, and d2d where the
installed kvswap has it) and each route (the resolved ``SwapFn`` and one forced to each
usable implementation), it copies random batches:

* through ``SwapFn``: descriptors of 1 B to 1 MiB (log-uniform) at any byte offset, sources
  anywhere in a random pool (they may overlap each other), destinations packed in random
  order with random gaps into a window that was poisoned first; the whole window is read
  back, so a byte written between or past the blocks is caught as a canary;
* through ``BlockMover``: tensors whose blocks are rows of a wider buffer (the spare bytes of
  every row are canaries), blocks of a random size, random ids, jobs kept ``--inflight``
  deep (descriptor buffers are reused from the pool once their jobs complete); the
  destination tensors are compared with the jobs replayed in order on the host.

Prints the totals (transfers, bytes, wrong bytes, wrong canaries) and writes them as JSON::

    python tests/bench/fuzz.py --device cuda:0 --transfers 100000 --json fuzz.json

``--limits`` runs instead single batches at kvswap's per-call limits (docs/known-issues.md):
mixed sizes of 1-4,096 bytes at odd addresses at, just over and far over the mixed limit (up
to 200,000 descriptors, the batch that faults inside the driver in one call), and blocks of
one size at and just over the one-size cap, through every route, every byte checked::

    python tests/bench/fuzz.py --device cuda:0 --limits --json fuzz_limits.json

On a CPU (``--device cpu``) the same logic runs on host memory (host reference, and
``triton.kernel`` in its interpreter under ``TRITON_INTERPRET=1``): use a small
``--transfers``. Exit status 1 when any byte is wrong.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import numpy as np

MiB = 1 << 20


@dataclass
class Config:
    device: str = "cuda:0"
    transfers: int = 100_000  # descriptors copied over every path, direction and route
    max_size: int = MiB  # largest descriptor of the SwapFn fuzz, and largest mover block
    inflight: int = 256  # BlockMover jobs kept in flight
    seed: int = 0
    directions: tuple[str, ...] = ()  # default: every direction kvswap has
    pool_bytes: int = 256 * MiB  # per side
    max_batch: int = 512  # descriptors per SwapFn batch at most
    sabotage: bool = False  # flip one destination byte after every SwapFn batch (checks the checker)
    limits: bool = False  # run the batches at kvswap's per-call limits instead (below)
    mixed_limit: int = 0  # descriptors a call for mixed sizes (0: cuda.batch's MIXED_CHUNK)
    uniform_limit: int = 0  # descriptors a call for one size (0: cuda.batch's DEFAULT_CHUNK)
    limit_sizes: tuple[int, ...] = (4096, 16384)  # the one-size batches' block sizes
    far_counts: tuple[int, ...] = (50_000, 200_000)  # mixed batches far over the limit (the fault's counts)


@dataclass
class Tally:
    path: str
    direction: str
    route: str
    transfers: int = 0
    batches: int = 0
    bytes: int = 0
    wrong: int = 0  # destination bytes inside blocks that differ from their source
    canaries: int = 0  # bytes outside every block that changed
    max_inflight: int = 0
    first_error: Optional[str] = None
    skipped: Optional[str] = None
    case: str = ""  # the limits entry: the batch's shape
    block_major_rounds: int = 0  # mover rounds whose host side was block-major


@dataclass
class Report:
    config: dict[str, Any]
    device: str
    rows: list[Tally] = field(default_factory=list)
    seconds: float = 0.0

    def totals(self) -> dict[str, int]:
        keys = ("transfers", "batches", "bytes", "wrong", "canaries")
        out = {k: sum(getattr(r, k) for r in self.rows) for k in keys}
        out["max_inflight"] = max((r.max_inflight for r in self.rows), default=0)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "device": self.device, "seconds": round(self.seconds, 1),
                "totals": self.totals(), "rows": [asdict(r) for r in self.rows]}


# -- memory ------------------------------------------------------------------------------------
class Side:
    """A pool of bytes on the host (pinned on a GPU machine) or on the device, with its address."""

    def __init__(self, torch: Any, nbytes: int, where: str, pinned: bool) -> None:
        self.torch, self.where = torch, where
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=where, pin_memory=pinned)
        self.base = int(self.tensor.data_ptr())

    def upload(self, data: np.ndarray, at: int = 0) -> None:
        self.tensor[at:at + len(data)].copy_(self.torch.from_numpy(data))

    def fill(self, value: int, at: int, nbytes: int) -> None:
        self.tensor[at:at + nbytes].fill_(value)

    def read(self, at: int, nbytes: int) -> np.ndarray:
        return self.tensor[at:at + nbytes].cpu().numpy().copy()


def sides_of(direction: str, device: str) -> tuple[str, str]:
    """Where the source and the destination live for ``direction`` on ``device``."""
    if device == "cpu":
        return "cpu", "cpu"
    return {"h2d": ("cpu", device), "d2h": (device, "cpu"), "d2d": (device, device)}[direction]


def synchronize(torch: Any, device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize(device)


# -- the SwapFn fuzz ---------------------------------------------------------------------------
def align(values: Any, a: int) -> Any:
    """``values`` rounded up to a multiple of ``a``."""
    return (values + a - 1) // a * a if a > 1 else values


def log_uniform(rng: np.random.Generator, lo: int, hi: int, n: int) -> np.ndarray:
    return np.exp(rng.uniform(np.log(lo), np.log(hi + 1), n)).astype(np.int64).clip(lo, hi)


def draw_batch(rng: np.random.Generator, cfg: Config, src_bytes: int, window_cap: int, c: dict[str, Any]) -> tuple:
    """``(src offsets, dst offsets in the window, sizes, window bytes)`` of one batch, within
    the route's constraints ``c`` (alignment, min and max block bytes)."""
    a = c["alignment"]
    count = int(log_uniform(rng, 1, cfg.max_batch, 1)[0])
    top = min(cfg.max_size, c["max_block_bytes"] or cfg.max_size)
    sizes = align(log_uniform(rng, max(1, c["min_block_bytes"]), top, count), a).clip(c["min_block_bytes"], top)
    keep = np.cumsum(sizes) <= window_cap // 2
    keep[0] = True
    sizes = sizes[keep]
    src = align(rng.integers(0, src_bytes - sizes + 1 - a), a)
    gaps = align(rng.integers(0, 64, len(sizes) + 1), a)  # odd gaps (unless aligned): blocks start at any byte
    order = rng.permutation(len(sizes))
    spans = sizes[order] + gaps[1:]
    starts = gaps[0] + np.concatenate([[0], np.cumsum(spans)[:-1]])
    dst = np.empty(len(sizes), dtype=np.int64)
    dst[order] = starts
    return src.astype(np.int64), dst, sizes, int(gaps[0] + spans.sum())


def fuzz_swapfn(torch: Any, fn: Any, direction: str, cfg: Config, rng: np.random.Generator,
                tally: Tally, budget: int, c: dict[str, Any]) -> None:
    src_where, dst_where = sides_of(direction, cfg.device)
    pinned = cfg.device != "cpu"
    src = Side(torch, cfg.pool_bytes, src_where, pinned and src_where == "cpu")
    dst = Side(torch, cfg.pool_bytes, dst_where, pinned and dst_where == "cpu")
    data = rng.integers(0, 256, cfg.pool_bytes, dtype=np.uint8)
    src.upload(data)
    stream = torch.cuda.current_stream(cfg.device) if cfg.device != "cpu" else None
    while tally.transfers < budget:
        so, do, sizes, window = draw_batch(rng, cfg, cfg.pool_bytes, cfg.pool_bytes, c)
        at = align(int(rng.integers(0, cfg.pool_bytes - window + 1 - c["alignment"])), c["alignment"])
        poison = int(rng.integers(0, 256))
        dst.fill(poison, at, window)
        fn(src.base + so, dst.base + at + do, sizes, stream=stream)
        synchronize(torch, cfg.device)
        got = dst.read(at, window)
        if cfg.sabotage:
            got[int(do[0])] ^= 0xFF
        check_window(got, poison, data, so, do, sizes, tally)
        tally.transfers += len(sizes)
        tally.batches += 1
        tally.bytes += int(sizes.sum())


def check_window(got: np.ndarray, poison: int, data: np.ndarray, so: np.ndarray, do: np.ndarray,
                 sizes: np.ndarray, tally: Tally) -> None:
    """Every byte of the window: each block equals its source, everything else is poison."""
    want = np.full(len(got), poison, dtype=np.uint8)
    covered = np.zeros(len(got), dtype=bool)
    for s, d, n in zip(so.tolist(), do.tolist(), sizes.tolist()):
        want[d:d + n] = data[s:s + n]
        covered[d:d + n] = True
    bad = got != want
    inside, outside = int((bad & covered).sum()), int((bad & ~covered).sum())
    tally.wrong += inside
    tally.canaries += outside
    if (inside or outside) and tally.first_error is None:
        k = int(np.argmax(bad))
        i = next((i for i, (d, n) in enumerate(zip(do.tolist(), sizes.tolist())) if d <= k < d + n), None)
        where = f"byte {k - int(do[i])} of descriptor {i} (size {int(sizes[i])})" if i is not None else "a canary"
        tally.first_error = f"batch {tally.batches}: {inside} wrong, {outside} canaries; first at {where}"


# -- the BlockMover fuzz -----------------------------------------------------------------------
def fuzz_mover(torch: Any, kvswap: Any, policy: Any, direction: str, cfg: Config, rng: np.random.Generator,
               tally: Tally, budget: int, c: dict[str, Any]) -> None:
    """BlockMover jobs of random blocks between per-layer tensors; in half the rounds the
    host side is block-major (every layer's piece of a block in one run, as
    ``kvswap.host_cache`` lays it out), which a device mover stages where the runs are long."""
    src_where, dst_where = sides_of(direction, cfg.device)
    pinned = cfg.device != "cpu"
    a = c["alignment"]
    top = min(cfg.max_size, c["max_block_bytes"] or cfg.max_size)
    # The host side of the direction (on a machine without a GPU both sides are host memory:
    # either may be the block-major one).
    hosts = [x for x, w in (("src", src_where), ("dst", dst_where)) if w == "cpu"]
    while tally.transfers < budget:
        block = int(align(log_uniform(rng, max(1, c["min_block_bytes"]), top, 1), a).clip(None, top)[0])
        pad = int(align(rng.integers(1, 64), a))  # spare bytes after every block: canaries
        layers = int(rng.integers(1, 4))
        rows = max(4, min(4096, cfg.pool_bytes // (2 * layers * (block + pad))))
        n_src, n_dst = rows, max(4, rows - int(rng.integers(0, rows // 2 + 1)))
        host_is = str(rng.choice(hosts)) if hosts else None
        block_major = host_is is not None and rng.random() < 0.5
        src_major, dst_major = block_major and host_is == "src", block_major and host_is == "dst"
        poison = int(rng.integers(0, 256))

        def rows_of(n: int, major: bool, fill: Any) -> list[np.ndarray]:
            """The arrays of one side: one for a block-major host, else one per layer."""
            return [fill((n, layers * block + pad))] if major else [fill((n, block + pad)) for _ in range(layers)]

        def side(arrays: list[np.ndarray], where: str, major: bool) -> tuple[list, list]:
            """``(tensors, per-layer views the mover copies)`` of one side."""
            ts = [torch.from_numpy(x.copy()).to(where) for x in arrays]
            if pinned and where == "cpu":
                ts = [t.pin_memory() for t in ts]
            if major:
                return ts, [ts[0][:, i * block:(i + 1) * block] for i in range(layers)]
            return ts, [t[:, :block] for t in ts]

        src_arrays = rows_of(n_src, src_major, lambda shape: rng.integers(0, 256, shape, dtype=np.uint8))
        src_t, views_s = side(src_arrays, src_where, src_major)
        dst_t, views_d = side(rows_of(n_dst, dst_major, lambda shape: np.full(shape, poison, dtype=np.uint8)),
                              dst_where, dst_major)
        layer_src = ([src_arrays[0][:, i * block:(i + 1) * block] for i in range(layers)] if src_major
                     else [x[:, :block] for x in src_arrays])
        mirror = [t.cpu().numpy().copy() for t in dst_t]
        jobs, results = 0, []
        with kvswap.BlockMover(views_s, views_d, direction, policy=policy) as mover:
            # Two waves: the first held behind a busy compute stream, so that every job of
            # it is in flight at once; the second reuses the descriptor buffers it returned.
            for wave in range(2):
                if cfg.device != "cpu" and wave == 0:
                    # About 0.5 s of a GPU's clock on the compute stream: longer than the wave's
                    # submits with their mirror updates, which took over 0.1 s on an H200.
                    torch.cuda._sleep(1_000_000_000)
                for _ in range(cfg.inflight + 8):
                    k = int(rng.integers(1, min(n_src, n_dst, 64) + 1))
                    sid = rng.integers(0, n_src, k)
                    did = rng.permutation(n_dst)[:k]
                    mover.submit(sid, did)
                    for i, h in enumerate(layer_src):
                        if dst_major:
                            mirror[0][did, i * block:(i + 1) * block] = h[sid]
                        else:
                            mirror[i][did, :block] = h[sid]
                    tally.max_inflight = max(tally.max_inflight, mover.in_flight)
                    tally.transfers += k * layers
                    tally.bytes += k * layers * block
                    jobs += 1
                mover.wait()
                results += mover.poll()
        failed = [r for r in results if not r.ok]
        if failed and tally.first_error is None:
            tally.first_error = f"job {failed[0].job_id} failed: {failed[0].error}"
        synchronize(torch, cfg.device)
        used = layers * block if dst_major else block  # the rest of each row: canaries
        for t, m in zip(dst_t, mirror):
            got = t.cpu().numpy()
            bad = got != m
            tally.wrong += int(bad[:, :used].sum())
            tally.canaries += int(bad[:, used:].sum())
            if bad.any() and tally.first_error is None:
                r, col = np.argwhere(bad)[0]
                where = "block-major host" if block_major else "per-layer"
                tally.first_error = f"mover block {block} B ({where}): row {r} byte {col} wrong"
        tally.batches += jobs
        tally.block_major_rounds += int(block_major)


# -- at the per-call limits --------------------------------------------------------------------
def limit_cases(cfg: Config) -> list[tuple[str, int, int, int, bool]]:
    """``(label, count, smallest, largest size, odd addresses)``: batches of mixed sizes
    (1-4,096 bytes at odd addresses, the driver's fault) at, just over and far over the
    mixed limit, up to 200,000 descriptors; batches of one size at and just over the
    one-size limit, 256-byte aligned, as engines send them. A route must split each into
    calls the driver survives and copy every byte."""
    from kvswap.backends.cuda import batch

    mixed = cfg.mixed_limit or batch.MIXED_CHUNK_H2D  # the smaller cap; the others' too through far_counts
    uniform = cfg.uniform_limit or batch.DEFAULT_CHUNK
    out = [(f"mixed 1-4096 odd x {n:,}", n, 1, 4096, True)
           for n in dict.fromkeys((mixed, mixed + 1, 2 * mixed + 3) + tuple(cfg.far_counts))]
    for size in cfg.limit_sizes:
        out += [(f"{size} B x {n:,}", n, size, size, False) for n in (uniform, uniform + 1)]
    return out


def pack(rng: np.random.Generator, sizes: np.ndarray, odd: bool) -> tuple[np.ndarray, int]:
    """Offsets of the blocks in a random order, each start odd or 256-byte aligned, with
    random gaps (canaries) between them; and the bytes they span."""
    order = rng.permutation(len(sizes))
    gaps = rng.integers(1, 64, len(sizes)) if odd else 256 * rng.integers(0, 2, len(sizes))
    spans = sizes[order] + gaps
    if odd:
        spans = spans + (spans % 2)  # keep every start odd
    else:
        spans = align(spans, 256)
    starts = (1 if odd else 0) + np.concatenate([[0], np.cumsum(spans)[:-1]])
    offsets = np.empty(len(sizes), dtype=np.int64)
    offsets[order] = starts
    return offsets, int(starts[-1] + spans[-1]) + 256


def fuzz_limits(torch: Any, fn: Any, direction: str, cfg: Config, rng: np.random.Generator,
                case: tuple, tally: Tally) -> None:
    """One batch of ``case`` through ``fn``, every byte of the destination window checked."""
    label, count, lo, hi, odd = case
    sizes = rng.integers(lo, hi + 1, count).astype(np.int64)
    so, src_bytes = pack(rng, sizes, odd)
    do, window = pack(rng, sizes, odd)
    src_where, dst_where = sides_of(direction, cfg.device)
    pinned = cfg.device != "cpu"
    src = Side(torch, src_bytes, src_where, pinned and src_where == "cpu")
    dst = Side(torch, window, dst_where, pinned and dst_where == "cpu")
    # 16 MiB of random bytes, repeated: drawing hundreds of MiB per batch would take longer than the copy.
    tile = rng.integers(0, 256, min(src_bytes, 16 * MiB), dtype=np.uint8)
    data = np.resize(tile, src_bytes)
    src.upload(data)
    poison = int(rng.integers(0, 256))
    dst.fill(poison, 0, window)
    stream = torch.cuda.current_stream(cfg.device) if cfg.device != "cpu" else None
    fn(src.base + so, dst.base + do, sizes, stream=stream)
    synchronize(torch, cfg.device)
    got = dst.read(0, window)
    if cfg.sabotage:
        got[int(do[0])] ^= 0xFF
    check_window(got, poison, data, so, do, sizes, tally)
    tally.transfers += count
    tally.batches += 1
    tally.bytes += int(sizes.sum())


def run_limits(cfg: Config, report: "Report") -> None:
    import torch

    import kvswap

    rng = np.random.default_rng(cfg.seed)
    for d in cfg.directions or tuple(str(x) for x in kvswap.Direction):
        try:
            found = routes(kvswap, d, cfg.device)
        except kvswap.ResolutionError as e:
            report.rows.append(Tally("limits", d, "-", skipped=str(e)))
            continue
        for label, policy, _ in found:
            fn = kvswap.resolve(d, device=cfg.device, policy=policy)
            for case in limit_cases(cfg):
                tally = Tally("limits", d, label, case=case[0])
                report.rows.append(tally)
                print(f"limits {d:<5}{label:<16}{case[0]:<28}", end="", flush=True)  # before a call that may fault
                try:
                    fuzz_limits(torch, fn, d, cfg, rng, case, tally)
                except Exception as e:
                    tally.first_error = tally.first_error or f"{type(e).__name__}: {e}"
                    tally.wrong += 1
                print(f"wrong {tally.wrong} canaries {tally.canaries}" + (f"  {tally.first_error}" if tally.first_error
                                                                          else ""), flush=True)


# -- driver ------------------------------------------------------------------------------------
ANY = {"alignment": 1, "min_block_bytes": 1, "max_block_bytes": None}


def routes(kvswap: Any, direction: str, device: str) -> list[tuple[str, Any, dict[str, Any]]]:
    """``(label, Policy or None, constraints)``: the resolved route (descriptors any size
    at any byte: its fallbacks take what a route refuses), then each usable impl forced."""
    fn = kvswap.resolve(direction, device=device)
    usable = [c for c in fn.plan.candidates if c.available]
    return [("resolved", None, ANY)] + [(c.name, kvswap.Policy(force=c.name), dict(c.constraints)) for c in usable]


def run(cfg: Config) -> Report:
    import torch

    import kvswap

    rng = np.random.default_rng(cfg.seed)
    names = cfg.directions or tuple(str(d) for d in kvswap.Direction)
    plan: list[tuple[str, str, str, Any, dict[str, Any]]] = []
    report = Report(asdict(cfg), cfg.device)
    if cfg.limits:
        t0 = time.perf_counter()
        run_limits(cfg, report)
        report.seconds = time.perf_counter() - t0
        return report
    for d in names:
        try:
            found = routes(kvswap, d, cfg.device)
        except kvswap.ResolutionError as e:  # a direction this device has no route for
            report.rows.append(Tally("-", d, "-", skipped=str(e)))
            print(f"{d}: skipped: {e}", flush=True)
            continue
        for label, policy, c in found:
            for path in ("swapfn", "mover"):
                plan.append((path, d, label, policy, c))
    share = -(-cfg.transfers // max(len(plan), 1))
    t0 = time.perf_counter()
    for path, d, label, policy, c in plan:
        tally = Tally(path, d, label)
        report.rows.append(tally)
        if path == "mover" and cfg.device == "cpu" and c.get("requires_pinned"):
            tally.skipped = "needs pinned host tensors, which a machine without a GPU cannot make"
            print(f"{path:<7}{d:<5}{label:<16} skipped: {tally.skipped}", flush=True)
            continue
        try:
            if path == "swapfn":
                fn = kvswap.resolve(d, device=cfg.device, policy=policy)
                fuzz_swapfn(torch, fn, d, cfg, rng, tally, share, c)
            else:
                fuzz_mover(torch, kvswap, policy, d, cfg, rng, tally, share, c)
        except Exception as e:  # a route that raises is a finding, not the end of the run
            tally.first_error = tally.first_error or f"{type(e).__name__}: {e}"
            tally.wrong += 1
        print(f"{path:<7}{d:<5}{label:<16}{tally.transfers:>9} transfers {tally.bytes / 1e6:>10.1f} MB "
              f"wrong {tally.wrong} canaries {tally.canaries} in flight {tally.max_inflight}"
              + (f"  {tally.first_error}" if tally.first_error else ""), flush=True)
    report.seconds = time.perf_counter() - t0
    return report


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--transfers", type=int, default=Config.transfers)
    p.add_argument("--max-size", type=int, default=Config.max_size)
    p.add_argument("--inflight", type=int, default=Config.inflight)
    p.add_argument("--pool-mib", type=int, default=Config.pool_bytes // MiB)
    p.add_argument("--directions", default="", help="comma-separated (default: every direction)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--limits", action="store_true",
                   help="batches at the per-call limits (mixed sizes at odd addresses up to 200,000; one size at the cap)")
    p.add_argument("--mixed-limit", type=int, default=0, help="descriptors a call for mixed sizes (default MIXED_CHUNK)")
    p.add_argument("--uniform-limit", type=int, default=0, help="descriptors a call for one size (default DEFAULT_CHUNK)")
    p.add_argument("--limit-sizes", default="4096,16384", help="block sizes of the one-size batches")
    p.add_argument("--far-counts", default="50000,200000", help="mixed batches far over the limit")
    a = p.parse_args(argv)
    cfg = Config(device=a.device, transfers=a.transfers, max_size=a.max_size, inflight=a.inflight,
                 seed=a.seed, pool_bytes=a.pool_mib * MiB,
                 directions=tuple(x for x in a.directions.split(",") if x), limits=a.limits,
                 mixed_limit=a.mixed_limit, uniform_limit=a.uniform_limit,
                 limit_sizes=tuple(int(x) for x in a.limit_sizes.split(",") if x),
                 far_counts=tuple(int(x) for x in a.far_counts.split(",") if x))
    report = run(cfg)
    totals = report.totals()
    print(f"total: {totals['transfers']} transfers, {totals['bytes']} bytes, {totals['batches']} batches/jobs, "
          f"wrong {totals['wrong']}, canaries {totals['canaries']}, max in flight {totals['max_inflight']}, "
          f"{report.seconds:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report.to_dict(), f, indent=1)
    return 1 if totals["wrong"] or totals["canaries"] else 0


if __name__ == "__main__":
    sys.exit(main())
