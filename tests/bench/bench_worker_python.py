"""The vLLM offloading worker's own Python per job, with its movers replaced by stand-ins
that copy nothing (CPU; not a test: it prints, it asserts nothing).

A stand-in mover's ``submit`` returns a job id and its ``poll`` the results, at once: what
is left is the worker's work on the engine's thread (mapping a job's ids, its bookkeeping,
building the results), against the same stand-in called bare. Per chunk size ``k`` and job
size, medians of ``--reps`` jobs of ``submit`` and of the ``get_finished`` that returns the
job, twice: warm (the calls back to back) and after a sleep of ``--pause`` ms before each
call, as an engine thread that slept in ``wait`` meets them (every line costs more then).

    python tests/bench/bench_worker_python.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vllm_worker import job_specs  # noqa: E402


class StandIn:
    """A mover that moves nothing: ``submit`` queues a finished result, ``poll`` hands it."""

    def __init__(self) -> None:
        from kvswap import TransferResult

        self.result, self.n, self.done = TransferResult, 0, []

    def submit(self, src: Any, dst: Any, **kw: Any) -> int:
        self.n += 1
        self.done.append(self.result(self.n, True, 1 << 20, 1e-3, len(src)))
        return self.n

    def poll(self) -> list:
        out, self.done = self.done, []
        return out

    def wait(self, job: Any = None) -> None:
        pass

    def close(self) -> None:
        pass


def measure(k: int, blocks: int, pause: float, reps: int, layers: int = 8, num_blocks: int = 1024) -> dict[str, Any]:
    import torch

    from kvswap.integrations.offload import OffloadWorker

    tensors = [torch.zeros((num_blocks, 64), dtype=torch.int8) for _ in range(layers)]
    worker = OffloadWorker(tensors, [tuple(range(layers))], num_blocks // k, k)
    worker.store.close()
    worker.load.close()
    store, bare = StandIn(), StandIn()
    worker.store = worker._stores.mover = store  # the worker's own Python is what is left
    rng = np.random.default_rng(k * 1000 + blocks)
    got: dict[str, list[float]] = {"worker_submit": [], "worker_get": [], "bare_submit": [], "bare_poll": []}
    clock = time.perf_counter

    def rest() -> None:
        if pause:
            time.sleep(pause)

    for rep in range(reps + 10):
        dspec, hspec, host = job_specs(rng, blocks, k, num_blocks, num_blocks // k)
        dev = dspec.block_ids
        rest()
        t0 = clock()
        worker.submit_store(rep, dspec, hspec)
        t1 = clock()
        rest()
        t2 = clock()
        (r,) = worker.get_finished()
        t3 = clock()
        assert r.ok and r.job_id == rep
        rest()
        t4 = clock()
        bare.submit(dev, host)
        t5 = clock()
        rest()
        t6 = clock()
        bare.poll()
        t7 = clock()
        if rep >= 10:
            for key, dt in zip(got, (t1 - t0, t3 - t2, t5 - t4, t7 - t6)):
                got[key].append(dt)
    worker.shutdown()
    med = {key: statistics.median(v) * 1e6 for key, v in got.items()}
    return {"k": k, "blocks": blocks, "pause_ms": pause * 1e3, **{f"{key}_us": round(v, 2) for key, v in med.items()},
            "extra_us": round(med["worker_submit"] + med["worker_get"] - med["bare_submit"] - med["bare_poll"], 2)}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", default="1,4", help="blocks per chunk")
    ap.add_argument("--blocks", default="16,256", help="device blocks per job")
    ap.add_argument("--pause", type=float, default=5.0, help="ms slept before each call in the cold rows")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    rows = [measure(k, b, p, args.reps) for p in (0.0, args.pause / 1e3) for k in map(int, args.k.split(","))
            for b in map(int, args.blocks.split(","))]
    print("| sleep before each call | k | blocks | worker submit µs | worker get_finished µs | "
          "stand-in submit µs | stand-in poll µs | worker's own µs |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['pause_ms']:g} ms | {r['k']} | {r['blocks']} | {r['worker_submit_us']:.1f} | "
              f"{r['worker_get_us']:.1f} | {r['bare_submit_us']:.1f} | {r['bare_poll_us']:.1f} | {r['extra_us']:+.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
