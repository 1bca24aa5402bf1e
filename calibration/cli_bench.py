"""``kvswap bench``: the resolved route against every candidate and vLLM's policy."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvswap.cli import (add_device, add_directions, block_list, file_to_write, link_directions, non_negative, positive,
                        write_json)
from kvswap.errors import ConfigurationError

HELP = "compare the resolved route with every candidate and a peer policy over a grid"
DESCRIPTION = (
    "In one process, for a grid of block sizes x batch sizes in both directions, measure the "
    "contiguous ceiling, every available implementation (bound as the resolver binds it), the "
    "SwapFn resolve() returns, and vLLM's policy as a peer baseline (kernel on 12 SMs for "
    "blocks under 28 KiB in batches of at least 16, batch DMA otherwise; device to host always "
    "batch DMA), on a CUDA device as vLLM PR 42212 ships it: the kernel's descriptors packed by "
    "numpy and uploaded by torch on every call, the batch DMA one unchecked driver call. Prints GB/s, resolved/best-candidate "
    "(regret) and resolved/peer, and writes them as JSON with --json. On a machine without an "
    "accelerator it measures the host reference's host memory copies."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_device(p)
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the results to FILE as JSON")
    add_directions(p)
    p.add_argument("--block-bytes", type=block_list, metavar="N[,N...]",
                   help="block sizes of the grid, in bytes (default: 1 KiB-512 KiB on a GPU; 4, 16 and "
                   "64 KiB on the host)")
    p.add_argument("--batches", type=block_list, metavar="N[,N...]",
                   help="batch sizes of the grid, in blocks per call (default: 1-10000 on a GPU; 1, 16 and 256 "
                   "on the host)")
    p.add_argument("--repeats", type=positive, metavar="N",
                   help="timed calls of each contender per point (GB/s: their median; ratios: the median "
                   "of the contenders' round-by-round ratios); default on a GPU: 41, and more for short calls, "
                   "up to 801, so that each point times about 0.2 s; on the host: 3")
    p.add_argument("--passes", type=positive, metavar="N",
                   help="time the grid N times over, each point on a fresh random draw of slots every "
                   "time, the rounds above shared among the passes (default on a GPU: 3; on the host: 1)")
    p.add_argument("--confirm", type=non_negative, metavar="N",
                   help="after the grid, time each point under a bar (resolved under 0.97 x the best candidate, "
                   "or under 1.0 x the peer where it is not the same code) N passes more on fresh draws, "
                   "against the same best candidate, and report those ratios beside the grid's: the worst of many "
                   "points is mostly the draw that came out lowest (default on a GPU: 3; on the host: 1; 0: off)")
    from .multi import add_arguments as add_multi

    add_multi(p)
    from . import cli_step

    cli_step.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    from . import cli_step

    if cli_step.wanted(args):  # --model, a custom shape or --render: the step benchmark
        return cli_step.run(args)
    cli_step.refuse(args, {**cli_step.STEP_ONLY, "plot": None, "render_command": ""},
                    "without --model or a custom shape (--layers, --kv-heads, --head-dim)")
    if args.window is not None and args.devices is None:
        raise ConfigurationError("--window: not used without --devices")
    from kvswap.registry.platform import detect
    from kvswap.registry.plugins import plugin_host

    from .bench import PEER_BATCH, PEER_KERNEL, bench_settings, run_bench
    from .report import bench_report, one_route
    from .progress import Progress
    from .timing import on_host

    if getattr(args, "devices", None) is not None:
        from .multi import run as run_devices

        return run_devices(args)
    dirs = link_directions(args.directions)
    file_to_write(args.json, "--json")
    host = plugin_host()
    dev = detect(host, args.device)
    settings = bench_settings(on_host(dev), args.block_bytes, args.batches, args.repeats, args.passes,
                              args.confirm)
    if on_host(dev):
        print(f"kvswap bench: no accelerator on {dev.name!r}; measuring HOST MEMORY COPIES (host.reference)",
              file=sys.stderr)
    progress = Progress.on_stderr("point")
    try:
        result = run_bench(args.device, settings, dirs, host=host, progress=progress)
    finally:
        progress.close()
    print(f"kvswap bench on {dev.platform} device {dev.name!r} ({result.measured})")
    only = one_route(result)
    if only is not None:
        print(f"  {only} is the one route here: nothing to rank it against")
    else:
        for d, cal in result.calibration.items():
            print(f"  {d} calibration: {cal.get('source')}")
        if any(r.peer for r in result.rows):
            print(f"  peer: {result.peer_policy}")
        else:
            print(f"  peer: not applicable here (vLLM's policy needs {PEER_KERNEL} and {PEER_BATCH})")
    print()
    print(bench_report(result))
    for note in result.notes:
        print(f"note: {note}")
    for f in result.failures:
        print(f"failed: {f.describe()}")
    if args.json is not None:
        write_json(args.json, result.to_dict())
    return 0
