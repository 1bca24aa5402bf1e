"""How the kernel's best SM count moves with batch size: the data behind SM tiers.

Binds every route the way ``kvswap calibrate`` does (``Sweep.prepare``), then times the
kernel at every SM count and the batch route at each (block size, batch size) point,
interleaved and from an idle stream. Prints, per point, each SM count's time as a
fraction of the fastest route's, and writes the measurements as JSON under ``$OUT``.

    python tests/bench/bench_sm_by_batch.py [--sms 4,8,12,16,24,32] [--reps 15]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

KiB, MiB = 1024, 1 << 20
BLOCKS = (1, 2, 4, 8, 16, 24, 32, 64, 128, 256)
BATCHES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 10000)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sms", default="4,6,8,12,16,24,32,48")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--blocks", default=",".join(map(str, BLOCKS)), help="KiB")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--pool-mib", type=int, default=1536)
    args = ap.parse_args(argv)
    from kvswap.calibration.records import BATCH
    from kvswap.calibration.sweep import Sweep, settings_for
    from kvswap.calibration.workload import Pools
    from kvswap.platform import detect
    from kvswap.plugins import plugin_host

    sms = tuple(int(x) for x in args.sms.split(","))
    blocks = [int(x) * KiB for x in args.blocks.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    dev = detect(plugin_host(), args.device)
    s = replace(settings_for(dev), sm_counts=sms, repeats=args.reps, pool_bytes=args.pool_mib * MiB)
    sweep = Sweep(args.device, s, ["h2d", "d2h"])
    bounds = sweep.prepare()
    sweep.pools = Pools(sweep.dev, s.pool_bytes, s.seed)
    for d, bs in bounds.items():
        print(f"\n{d}: time of the fastest route / time of each (1.00 = fastest)", flush=True)
        labels = [b.label for b in bs]
        print("block   n      " + " ".join(f"{x:>17}" for x in labels), flush=True)
        for b in blocks:
            for n in batches:
                if n > sweep.pools.slots(b):
                    continue
                ms = sweep.measure(bs, sweep.pools.batch(d, b, n), BATCH)
                t = {(m.impl, m.num_sms): m.seconds for m in ms}
                best = min(t.values())
                cells = [f"{best / t[(x.impl, x.num_sms)]:.2f}" if (x.impl, x.num_sms) in t else "-" for x in bs]
                print(f"{b // KiB:>3}K {n:>6}  " + " ".join(f"{c:>17}" for c in cells)
                      + f"   best {n * b / best / 1e9:.1f} GB/s", flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "sm_by_batch.json"), "w") as f:
            json.dump({"device": sweep.dev.to_dict(), "measurements": [m.to_dict() for m in sweep.result.measurements],
                       "failures": [x.to_dict() for x in sweep.result.failures]}, f)
    for x in sweep.result.failures:
        print("failure:", x.describe(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
