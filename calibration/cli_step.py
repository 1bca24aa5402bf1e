"""``kvswap bench --model``: the step benchmark's options, and ``--render`` of its JSON."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvswap.cli import block_list, file_to_write, link_directions, positive, write_json
from kvswap.errors import ConfigurationError, DeviceNotFoundError
from kvswap.cli.models import DEFAULT_BLOCK_TOKENS, add_shape_arguments, shapes_from_args


def _names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def model_names(text: str) -> list[str]:
    """``--model``'s value: one or more names, comma-separated."""
    names = _names(text)
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names no model; e.g. llama-3.1-8b, or all")
    return names


def milliseconds(text: str) -> float:
    """A positive, finite number of milliseconds."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of milliseconds")
    return v


# Options of one benchmark that the other ignores, at their defaults when not given.
STEP_ONLY = {"tp": [1], "block_tokens": DEFAULT_BLOCK_TOKENS, "blocks": [32, 512], "host_layouts": None,
             "step_ms": 20.0, "reps": 7, "variants": False, "dtype": None}
GRID_ONLY = {"block_bytes": None, "batches": None, "repeats": None, "passes": None, "confirm": None,
             "devices": None, "window": None}
MEASURE = {"model": None, "layers": None, "kv_heads": None, "head_dim": None, "layout": None, "json": None,
           "device": None}


def refuse(args: argparse.Namespace, options: dict[str, Any], why: str) -> None:
    """A usage error naming every option of ``options`` given away from its default."""
    flag = {"render_command": "--command"}
    given = [flag.get(n, "--" + n.replace("_", "-")) for n, default in options.items()
             if getattr(args, n, default) != default]
    if given:
        raise ConfigurationError(f"{', '.join(given)}: not used {why}")


def host_layouts(text: str) -> list[str]:
    """``per-layer,block-major`` -> the host layouts, each once, in the order given."""
    from .step_workload import HOST_LAYOUTS

    names = list(dict.fromkeys(_names(text)))
    bad = [n for n in names if n not in HOST_LAYOUTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: {'unknown host layout ' + repr(bad[0]) if bad else 'none named'}; "
                                         f"choose from {','.join(HOST_LAYOUTS)}")
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .step_contiguous import BUFFER_MAX

    g = p.add_argument_group(
        "step benchmark (--model, or a custom shape): BlockMover jobs on a model's per-layer KV tensors "
        "beside bf16 GEMMs, per host layout and contender (default, low_interference, batch, kernel@12, staged, "
        "vllm), each case with a reference, contiguous: one contiguous copy of the job's bytes across the link, "
        f"launched beside the same compute as a job is (copies of at most {BUFFER_MAX >> 20} MiB back to back "
        "for a larger job). Per contender: submit host time, transfer alone and beside compute, compute slowdown, step "
        "makespan, also over the compute alone of its repetition and over the contiguous copy's makespan in the "
        "same repetition (span/contiguous: what the step costs beyond moving its bytes at all; the bars judge "
        "it), bytes checked")
    g.add_argument("--model", type=model_names, metavar="NAME[,NAME...]",
                   help="built-in model shape(s) (kvswap models), or all")
    g.add_argument("--tp", type=block_list, default=STEP_ONLY["tp"], metavar="N[,N...]",
                   help="tensor-parallel degrees (default 1); a degree that does not split a model's KV heads "
                   "evenly is skipped for it")
    g.add_argument("--block-tokens", type=positive, default=DEFAULT_BLOCK_TOKENS, metavar="N",
                   help="tokens per KV block (default 16)")
    g.add_argument("--blocks", type=block_list, default=STEP_ONLY["blocks"], metavar="B[,B...]",
                   help="blocks per job (default 32,512)")
    g.add_argument("--host-layouts", type=host_layouts, default=None, metavar="LAYOUT[,LAYOUT...]",
                   help="host KV layouts: per-layer (one pinned tensor per layer, the device's layout) and "
                   "block-major (kvswap.host_cache: host block i holds device block i of every layer) "
                   "(default both)")
    g.add_argument("--step-ms", type=milliseconds, default=STEP_ONLY["step_ms"], metavar="MS",
                   help="compute per step: bf16 GEMMs for about this long (default 20)")
    g.add_argument("--reps", type=positive, default=STEP_ONLY["reps"], metavar="N",
                   help="repetitions per case, contenders interleaved; numbers are medians (default 7)")
    g.add_argument("--variants", action="store_true",
                   help="also run the default with one older mechanism taken away each: without its issuing "
                   "thread, without launching large by-id jobs in submit, and sending descriptors instead of ids "
                   "(what each still gains shows against the default, beside a second run of the default, whose "
                   "spread is the noise)")
    g.add_argument("--plot", type=Path, metavar="FILE.png", help="also draw the results (needs matplotlib)")
    g.add_argument("--render", type=Path, nargs="+", metavar="FILE.json",
                   help="measure nothing: print as markdown the JSON file(s) of one device that kvswap bench "
                   "wrote: the step benchmark's table and bars (and draw --plot), or the grid's tables (not "
                   "the JSON of --devices)")
    g.add_argument("--command", dest="render_command", default="", metavar="TEXT",
                   help="with --render: the command that produced the JSON, quoted in the markdown")
    add_shape_arguments(p)


def wanted(args: argparse.Namespace) -> bool:
    """Whether the options ask for the step benchmark rather than the route grid."""
    return bool(args.model or args.render or any(
        getattr(args, a, None) is not None for a in ("layers", "kv_heads", "head_dim", "layout")))


def caches_from_args(args: argparse.Namespace) -> tuple[list[Any], list[str]]:
    """The KV caches to run (model x TP) and a note per combination skipped."""
    caches, notes = [], []
    for shape in shapes_from_args(args.model, args, default_all=False):
        for tp in dict.fromkeys(args.tp):
            if shape.splits(tp):
                caches.append(shape.at(tp, args.block_tokens))
            else:
                notes.append(f"{shape.name} at tp {tp}: its KV cache does not split over {tp} ranks "
                             f"({'mla latent cache' if shape.layout == 'mla' else f'{shape.kv_heads} KV heads'}); "
                             f"skipped")
    return caches, notes


def render(args: argparse.Namespace) -> int:
    from .report import bench_markdown
    from .step_report import interference_markdown, merge, plot, render_markdown

    refuse(args, {**STEP_ONLY, **GRID_ONLY, **MEASURE}, "with --render, which measures nothing")
    steps, slowdowns, grids = [], [], []
    for f in args.render:
        try:
            doc = json.loads(Path(f).read_text())
        except (OSError, ValueError) as e:
            raise ConfigurationError(f"--render {str(f)!r}: {e}") from None
        kind = doc.get("kind") if isinstance(doc, dict) else None
        if kind == "kvswap step bench":
            steps.append(doc)
        elif kind == "kvswap step interference":
            slowdowns.append(doc)
        elif isinstance(doc, dict) and "peer_policy" in doc and "rows" in doc:
            grids.append(doc)
        else:
            raise ConfigurationError(f"--render {str(f)!r} is not the JSON of kvswap bench (its grid or --model) "
                                     f"or of kvswap.calibration.step_interference")
    if steps:
        doc = merge(steps)
        print(render_markdown(doc, args.render_command, args.plot.name if args.plot else None, slowdowns), end="")
        if args.plot:
            try:
                print(f"plot written to {plot(doc, args.plot)}", file=sys.stderr)
            except ImportError:
                print("note: --plot needs matplotlib (pip install kvswap[plot]); no plot drawn", file=sys.stderr)
    for doc in slowdowns:
        print()
        print(interference_markdown(doc), end="")
    for doc in grids:
        print(bench_markdown(doc, args.render_command))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.render:
        return render(args)
    from kvswap.registry.platform import detect
    from kvswap.registry.plugins import plugin_host

    from .progress import Progress
    from .step import DeviceEnv, StepSettings, run_step_bench
    from .step_report import bars, bars_table, header, plot, text_table, variants_table
    from .timing import on_host

    refuse(args, {**GRID_ONLY, "render_command": ""}, "by the step benchmark (--model or a custom shape)")
    file_to_write(args.json, "--json")
    file_to_write(args.plot, "--plot")
    dirs = link_directions(args.directions)
    caches, notes = caches_from_args(args)
    if not caches:
        raise ConfigurationError("no model x TP left to run: " + "; ".join(notes))
    host = plugin_host()
    dev = detect(host, args.device)
    if on_host(dev):
        raise DeviceNotFoundError(f"kvswap bench --model needs a GPU (CUDA or ROCm): the device here is {dev.name!r}, "
                          f"and its numbers are an engine's step on an accelerator")
    settings = StepSettings(blocks=tuple(args.blocks), step_ms=args.step_ms, reps=args.reps,
                            variants=args.variants,
                            **({"host_layouts": tuple(args.host_layouts)} if args.host_layouts else {}))
    progress = Progress.on_stderr("run")
    try:
        doc = run_step_bench(DeviceEnv(dev, args.step_ms), dev, caches, dirs, settings, host=host, progress=progress)
    finally:
        progress.close()
    doc["notes"] = notes + doc["notes"]
    doc["command"] = " ".join(["kvswap", *sys.argv[1:]])
    print(f"kvswap bench --model: {header(doc)}")
    print()
    print(text_table(doc))
    print()
    print(bars_table(bars([doc])))
    stays = variants_table([doc])
    if stays:
        print()
        print(stays)
    for note in doc["notes"]:
        print(f"note: {note}")
    if args.json is not None:
        write_json(args.json, doc)
    if args.plot is not None:
        try:
            print(f"plot written to {plot(doc, args.plot)}")
        except ImportError:
            print("note: --plot needs matplotlib (pip install kvswap[plot]); no plot drawn")
    return 0
