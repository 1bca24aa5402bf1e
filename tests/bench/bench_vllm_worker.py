"""kvswap's vLLM offloading worker against a bare BlockMover doing the same jobs (GPU; not a
test: it prints ratios measured in one run, it asserts nothing).

Both move the same random jobs between llama-3.1-8b-shaped canonical caches (``--layers``
int8 tensors of ``(num_blocks, --page)``) and one block-major host cache, each from the same
vLLM-shaped job specs (chunk ids of ``k`` blocks, a group starting inside its first chunk).
The bare mover takes the job the shortest way a caller of its own could: the spec's int32
device ids as they are, and its chunk ids as they are at ``k`` = 1 (they are host block ids)
or, at ``k`` > 1, mapped to host blocks in one numpy expression timed with its submit
(``--premapped`` computes them beforehand instead, leaving the mapping to the worker's
account alone). Their jobs take turns, so drift in the machine hits both alike. Per
direction, ``k`` and job size:

* host time per job: the engine thread's time in ``submit`` plus in the ``get_finished``
  (``poll``) call that returns the job, medians, and the worker's over the mover's;
* transfer time: the job's seconds as its result reports them (the mover's events),
  medians, and the ratio;
* the noise of both: a second bare mover over the same tensors (``bare B``) measured the
  same way, and its medians over the first's (an A/A comparison: how far apart two
  identical contenders land in this run).

The engine's thread waits for each job one of three ways (``--engine``), for a fixed time
per case (1.1 x the copy's time in the warm-up repetitions), then in ``wait``:

* ``idle``: it sleeps in ``wait`` from the start; after such a sleep every line of Python
  runs several times slower (caches and clocks gone cold), the worker's few lines more
  than the bare mover's;
* ``busy``: it stays on the CPU but lets other threads run (``time.sleep(0)`` in a loop),
  as an engine thread does while its step's work releases the GIL;
* ``python``: it runs pure Python, holding the GIL but for the interpreter's switch
  interval, as an engine thread busy in Python does; a route that needs kvswap's own
  thread to move the job then waits for it.

    python tests/bench/bench_vllm_worker.py --out-dir results [--device cuda:0]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the vLLM stand-ins

from offload_jobs import DeviceSpec, HostSpec, reference_host_ids  # noqa: E402


def job_specs(rng: np.random.Generator, blocks: int, k: int, device_blocks: int,
              num_chunks: int) -> tuple[DeviceSpec, HostSpec, np.ndarray]:
    """A one-group job of ``blocks`` device blocks starting inside a chunk (where k > 1):
    vLLM's specs, and its host block ids (the reference mapping, to check the bare one)."""
    start = int(rng.integers(0, k))
    n_chunks = -(-(blocks + start) // k)
    dev = rng.choice(device_blocks, blocks, replace=False)
    chunks = rng.choice(num_chunks, n_chunks, replace=False)
    dspec, hspec = DeviceSpec(dev.astype(np.int32), [blocks], [start]), HostSpec(chunks.astype(np.int32))
    host = np.array(reference_host_ids(chunks.tolist(), [blocks], [start], k)[0])
    return dspec, hspec, host


def bare_host_ids(dspec: DeviceSpec, hspec: HostSpec, k: int, within: np.ndarray) -> np.ndarray:
    """A one-group job's host block ids as a bare mover's caller maps them: chunk ``c``
    holds host blocks ``c * k .. c * k + k - 1``, and the group starts ``block_indices[0] % k``
    blocks into its first chunk (``within`` is ``np.arange(k)``)."""
    if k == 1:
        return hspec.block_ids
    skip = dspec.block_indices[0] % k
    return (hspec.block_ids[:, None] * k + within).ravel()[skip:skip + len(dspec.block_ids)]


def timed(fn: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def spin_until(deadline: float, engine: str) -> None:
    """The engine's thread busy with its own work until ``deadline``: releasing the GIL
    (``busy``) or holding it (``python``)."""
    clock = time.perf_counter
    if engine == "busy":
        while clock() < deadline:
            time.sleep(0)
    else:
        while clock() < deadline:
            pass


def measure(args: argparse.Namespace, direction: str, k: int, blocks: int, engine: str) -> dict[str, Any]:
    import torch

    import kvswap
    from kvswap.integrations.offload import OffloadWorker, route_summary

    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    tensors = [torch.randint(-128, 128, (args.device_blocks, args.page), dtype=torch.int8, device=device)
               for _ in range(args.layers)]
    num_chunks = args.host_blocks // k
    worker = OffloadWorker(tensors, [tuple(range(args.layers))], num_chunks, k)
    views = list(worker.host.views)
    def bare_mover() -> kvswap.BlockMover:
        return (kvswap.BlockMover(tensors, views, "d2h") if direction == "d2h"
                else kvswap.BlockMover(views, tensors, "h2d"))

    bares = {"bare": bare_mover(), "bare_b": bare_mover()}
    rng = np.random.default_rng(blocks * 10 + k)
    within = np.arange(k, dtype=np.int32)
    names = ("worker", "bare", "bare_b")
    rows: dict[str, dict[str, list[float]]] = {who: {"host": [], "transfer": []} for who in names}
    warm: list[float] = []  # copy times in the warm-up repetitions (the engine idle then)
    spin = 0.0  # how long the engine's thread works before it waits, per job (fixed per case)
    for rep in range(args.warmup + args.reps):
        if rep == args.warmup and engine != "idle":
            spin = 1.1 * statistics.median(warm)
        dspec, hspec, host = job_specs(rng, blocks, k, args.device_blocks, num_chunks)
        dev = dspec.block_ids
        assert np.array_equal(bare_host_ids(dspec, hspec, k, within), host)
        for who in names[rep % 3:] + names[:rep % 3]:  # each contender first, second and third in turn
            if who == "worker":
                submit = (lambda: worker.submit_store(rep, dspec, hspec)) if direction == "d2h" else (
                    lambda: worker.submit_load(rep, hspec, dspec))
                ok, t_submit = timed(submit)
                assert ok
                if spin:
                    spin_until(time.perf_counter() + spin, engine)
                worker.wait({rep})
                sync()
                done, t_poll = timed(worker.get_finished)
                (r,) = done
                seconds = r.seconds
            else:
                bare = bares[who]
                if args.premapped:
                    ids = lambda: host  # noqa: E731
                else:
                    ids = lambda: bare_host_ids(dspec, hspec, k, within)  # noqa: E731
                job, t_submit = timed(lambda: bare.submit(dev, ids()) if direction == "d2h" else bare.submit(ids(), dev))
                if spin:
                    spin_until(time.perf_counter() + spin, engine)
                bare.wait(job)
                sync()
                done, t_poll = timed(bare.poll)
                (r,) = done
                seconds = r.seconds
            assert r.ok, r.error
            if rep < args.warmup:
                warm.append(seconds)
            else:
                rows[who]["host"].append(t_submit + t_poll)
                rows[who]["transfer"].append(seconds)
    route = route_summary(worker.store if direction == "d2h" else worker.load)
    worker.shutdown()
    for bare in bares.values():
        bare.close()
    med = {who: {m: statistics.median(v) for m, v in r.items()} for who, r in rows.items()}
    return {
        "engine": engine, "direction": direction, "k": k, "blocks": blocks, "bytes": blocks * args.layers * args.page,
        "worker_host_us": med["worker"]["host"] * 1e6, "bare_host_us": med["bare"]["host"] * 1e6,
        "host_ratio": med["worker"]["host"] / med["bare"]["host"],
        "host_extra_us": (med["worker"]["host"] - med["bare"]["host"]) * 1e6,
        "worker_transfer_ms": med["worker"]["transfer"] * 1e3, "bare_transfer_ms": med["bare"]["transfer"] * 1e3,
        "transfer_ratio": med["worker"]["transfer"] / med["bare"]["transfer"] if med["bare"]["transfer"] else None,
        "aa_host_ratio": med["bare_b"]["host"] / med["bare"]["host"],
        "aa_host_extra_us": (med["bare_b"]["host"] - med["bare"]["host"]) * 1e6,
        "aa_transfer_ratio": (med["bare_b"]["transfer"] / med["bare"]["transfer"]
                              if med["bare"]["transfer"] else None),
        "within_bar": med["worker"]["host"] <= 1.1 * med["bare"]["host"] + 20e-6,
        "route": route,
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| engine | dir | k | blocks | worker host µs | bare host µs | ratio | +µs | ≤ 1.1× + 20 µs | worker copy ms | "
            "bare copy ms | ratio | A/A host ratio (+µs) | A/A copy ratio |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        tr = "-" if r["transfer_ratio"] is None else f"{r['transfer_ratio']:.3f}"
        aa = "-" if r["aa_transfer_ratio"] is None else f"{r['aa_transfer_ratio']:.3f}"
        lines.append(f"| {r['engine']} | {r['direction']} | {r['k']} | {r['blocks']} | {r['worker_host_us']:.1f} | "
                     f"{r['bare_host_us']:.1f} | {r['host_ratio']:.3f} | {r['host_extra_us']:+.1f} | "
                     f"{'yes' if r['within_bar'] else 'no'} | {r['worker_transfer_ms']:.3f} | "
                     f"{r['bare_transfer_ms']:.3f} | {tr} | {r['aa_host_ratio']:.3f} ({r['aa_host_extra_us']:+.1f}) | "
                     f"{aa} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", required=True, help="where bench_vllm_worker.json goes")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--page", type=int, default=2 * 16 * 8 * 128 * 2, help="bytes of a layer's block (K and V)")
    ap.add_argument("--device-blocks", type=int, default=1024)
    ap.add_argument("--host-blocks", type=int, default=1024)
    ap.add_argument("--blocks", default="16,64,256", help="device blocks per job")
    ap.add_argument("--k", default="1,4", help="blocks per chunk")
    ap.add_argument("--premapped", action="store_true",
                    help="give the bare mover its host block ids computed beforehand (not timed)")
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--engine", default="idle,busy,python",
                    help="how the engine's thread waits for a job: idle, busy, python (see above), comma-separated")
    args = ap.parse_args(argv)
    rows = []
    for e in args.engine.split(","):
        for d in ("d2h", "h2d"):
            for k in map(int, args.k.split(",")):
                for b in map(int, args.blocks.split(",")):
                    rows.append(measure(args, d, k, b, e))
                    print(table(rows[-1:]).splitlines()[-1], flush=True)  # a row as it is measured
    print(table(rows))
    for d in ("d2h", "h2d"):
        print(f"{d} route: {next(r['route'] for r in rows if r['direction'] == d)}")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"host": platform.node(), "python": platform.python_version(), "args": vars(args)}
    (out / "bench_vllm_worker.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
