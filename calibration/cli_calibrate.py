"""``kvswap calibrate``: measure this device, fit its thresholds, write its profile and plot."""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Optional

from kvswap.cli import add_device, add_directions, file_to_write, link_directions, non_negative
from kvswap.errors import ConfigurationError
from kvswap.registry.plugins import PluginHost
from kvswap.types import DeviceInfo, Direction

from .fit import TOLERANCE
from .update import PARTS, parts

HELP = "measure this device and write its calibration profile (and a plot)"
DESCRIPTION = (
    "Measure, on the present device and in one run: the contiguous copy ceiling per direction "
    "(at its start and again at its end: a note says when the two disagree, the machine not steady), "
    "every available implementation over block sizes (1 KiB-512 KiB) and batch sizes, the kernel "
    "at several SM counts, how long one call of each route holds the calling thread by descriptor "
    "count (its host cost, on per-layer tensors like an engine's), and optionally the compute slowdown "
    "beside bf16 GEMMs per SM count (--interference). Fit the route per block size, the SM knee and the "
    "minimum batch for the kernel, and exclude a route whose call holds the thread longer than the whole "
    "transfer takes on another; write the profile "
    "(JSON, keyed by device identity) where the resolver finds it, the raw measurements beside it "
    "(<profile>.measurements.json, optional: the resolver never reads them), and a PNG of the curves. "
    "Where a staged route is available, also measure it as a BlockMover runs it, on a block-major host cache: "
    "GB/s by chunk size, its host cost, and (with --interference) its compute slowdown. "
    "With --only and --update, measure just the host cost, the slowdown and/or the staged route and rewrite an "
    "existing profile in place. "
    "On a machine without an accelerator it measures the host reference's host memory copies, and "
    "marks the profile so (explain does not present it as a device calibration)."
)


def fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= v < 0.5:
        raise argparse.ArgumentTypeError(f"{text!r} must be a fraction in [0, 0.5), e.g. 0.03")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_device(p)
    p.add_argument("--quick", action="store_true",
                   help="a smaller grid: about a minute on a GPU (the full run takes under ten)")
    add_directions(p, "; others are carried over from the calibration in force")
    p.add_argument("--max-sms", type=non_negative, metavar="N",
                   help="measure kernels on at most N SMs (0: measure no kernel route; default: up to all "
                   "of the device's)")
    p.add_argument("--knee-tolerance", type=fraction, default=TOLERANCE, metavar="F",
                   help=f"the SM knee is the fewest SMs within this fraction of the kernel's best, on the "
                   f"geometric mean over the block sizes where the kernel wins (default {TOLERANCE})")
    p.add_argument("--interference", action="store_true",
                   help="also measure the compute slowdown per direction, route and SM count: bf16 GEMMs and a "
                   "BlockMover job started together, as an engine runs them (what Policy(prefer="
                   "'low_interference') ranks by; a few minutes on a GPU)")
    p.add_argument("--only", type=parts, metavar="PARTS",
                   help=f"with --update: measure only these ({', '.join(PARTS)}; comma-separated), not the "
                   "whole grid")
    p.add_argument("--update", type=Path, metavar="PROFILE",
                   help="with --only: rewrite this profile of the present device in place with the parts "
                   "measured now, keeping everything else (raw records go beside it, as with --strip)")
    p.add_argument("--out", type=Path, metavar="FILE",
                   help="write the profile here (default: the user data directory, where the resolver looks); "
                   "the raw measurements go beside it, to FILE's name with .measurements.json")
    p.add_argument("--plot", type=Path, metavar="FILE.png", help="write the plot here (default: next to the profile)")
    p.add_argument("--strip", type=Path, nargs="+", metavar="PROFILE",
                   help="measure nothing: move the raw measurements of existing profiles into a "
                   ".measurements.json file beside each, leaving what the resolver reads (how the profiles "
                   "shipped with kvswap are made)")


def _check(args: argparse.Namespace) -> list[Direction]:
    dirs = link_directions(args.directions)
    if (args.only is None) != (args.update is None):
        raise ConfigurationError("--only and --update go together: --only PARTS --update PROFILE measures PARTS "
                                 "and rewrites PROFILE")
    if args.update is not None and (args.out is not None or args.plot is not None or args.interference):
        raise ConfigurationError("--update rewrites its profile in place and draws no plot: leave out --out, "
                                 "--plot and --interference (name the parts with --only)")
    file_to_write(args.out, "--out", "the profile file to write")
    if args.out is not None and args.out.exists() and not args.out.is_file():
        # the profile is written beside and renamed over: a device or pipe would be replaced
        raise ConfigurationError(f"--out {str(args.out)!r} is not a regular file; name the profile file to write")
    if args.plot is not None and args.plot.suffix.lower() != ".png":
        raise ConfigurationError(f"--plot {str(args.plot)!r} must name a .png file")
    file_to_write(args.plot, "--plot")
    return dirs


def served_directions(host: PluginHost, dev: DeviceInfo) -> set[str]:
    """The directions some implementation usable on ``dev`` copies: only these are carried
    over from the calibration in force where this run does not measure them."""
    from kvswap.resolution.resolver import collect_impls

    return {str(d) for _, impl in collect_impls(host, dev.platform) if impl.unavailable_reason(dev) is None
            for d in impl.directions}


def duration(seconds: float) -> str:
    """``seconds`` as a person reads a run's length: 0.42 s, 12.3 s, 4 min 05 s."""
    if seconds < 10:
        return f"{seconds:.2g} s" if seconds < 1 else f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"


def strip(args: argparse.Namespace) -> int:
    from kvswap.resolution.profiles import ProfileError

    from . import store

    paths: list[Path] = args.strip
    unused = [f"--{name.replace('_', '-')}" for name in ("device", "max_sms", "only", "update", "out", "plot")
              if getattr(args, name) is not None] + [f"--{name}" for name in ("quick", "interference")
                                                      if getattr(args, name)]
    if unused:
        raise ConfigurationError(f"--strip measures nothing: leave out {', '.join(unused)}")
    for path in paths:
        before = path.stat().st_size if path.is_file() else 0
        try:
            _, raw = store.strip(path)
        except ProfileError as e:
            raise ConfigurationError(f"--strip {str(path)!r}: {e}") from None
        where = f"raw measurements moved to {raw}" if raw else "it held no raw measurements"
        print(f"{path}: {before // 1024} KiB -> {path.stat().st_size // 1024} KiB; {where}")
    return 0


def run_update(args: argparse.Namespace) -> int:
    from kvswap.registry.platform import detect
    from kvswap.registry.plugins import plugin_host

    from . import staged, update
    from .progress import Progress
    from .report import host_cost_lines, slowdown_lines
    from .decisions import Fitted

    dirs = _check(args)
    host = plugin_host()
    dev = detect(host, args.device)
    what = "host memory copies (host reference)" if dev.platform == "cpu" else f"{dev.platform} device {dev.name!r}"
    print(f"kvswap calibrate: measuring {', '.join(args.only)} for {', '.join(map(str, dirs))} on {what}; "
          f"updating {args.update}", file=sys.stderr)
    t0 = time.monotonic()
    progress = Progress.on_stderr("step")
    try:
        profile, got, raw_path = update.update(args.update, args.only, dev, args.device, host, dirs, quick=args.quick,
                                               progress=progress)
    finally:
        progress.close()
    for f in got.failures.records:
        print(f"skipped {f.describe()}")
    if raw_path is None:
        why = "" if got.failures.records else (
            f": no route here serves {', '.join(args.only)} (kvswap info lists each implementation and why it is "
            f"unusable)")
        print(f"kvswap: error: nothing could be measured{why}; {args.update} is as it was", file=sys.stderr)
        return 1
    fitted = Fitted.from_dict(profile)
    lines = (host_cost_lines(fitted) if {update.HOST_COST, update.STAGED} & set(args.only) else []) + (
        slowdown_lines(fitted, got.interference) if {update.INTERFERENCE, update.STAGED} & set(args.only) else []) + (
        staged.describe(fitted.staged) if update.STAGED in args.only else [])
    print("\n".join(lines))
    print(f"profile {args.update} updated ({', '.join(args.only)}) in {duration(time.monotonic() - t0)}; "
          f"raw records in {raw_path}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.strip:
        return strip(args)
    if args.update is not None:
        return run_update(args)
    from kvswap.resolution import profiles
    from kvswap.resolution.lookup import find_calibration
    from kvswap.registry.platform import detect
    from kvswap.registry.plugins import plugin_host

    from . import fit, staged, store, update
    from .progress import Progress
    from .report import calibration_report
    from .sweep import Sweep, settings_for

    dirs = _check(args)
    host = plugin_host()
    dev = detect(host, args.device)
    settings = settings_for(dev, quick=args.quick, max_sms=args.max_sms, knee_tolerance=args.knee_tolerance)
    prior = find_calibration(host, dev)  # what is in force now: carried over for what this run skips
    path = Path(args.out) if args.out is not None else profiles.default_path(dev)
    file_to_write(path, "--out (default)" if args.out is None else "--out")
    raw_path = store.measurements_path(path)
    plot_path: Optional[Path] = Path(args.plot) if args.plot is not None else path.with_suffix(".png")
    written: list[Path] = []
    t0 = time.monotonic()
    try:
        progress = Progress.on_stderr("step")
        sweep = Sweep(args.device, settings, dirs, host=host, progress=progress)
        # The CPU platform's host copies, timed where there is no accelerator: explain()
        # must not present them as a device calibration. A plugin's device whose memory is
        # host memory is measured as itself.
        reference = sweep.result.host_only and dev.platform == "cpu"
        if reference:
            measured = ("host memory copies (host reference): no accelerator, so the host reference copied "
                        "between two host buffers; not a device calibration")
            print(f"kvswap calibrate: no accelerator on {dev.name!r}; measuring HOST MEMORY COPIES "
                  "(host.reference, the host reference), not a device link", file=sys.stderr)
        else:
            memory = "host buffers (this device's memory is host memory)" if sweep.result.host_only else (
                "pinned host memory and device memory")
            measured = f"{dev.platform} copies between {memory}"
            units = "SMs" if dev.platform in ("cuda", "rocm") else "compute units"
            print(f"kvswap calibrate: {dev.platform} device {dev.name!r} ({dev.compute_units} {units}, link "
                  f"{dev.link}); measuring its copies between {memory}", file=sys.stderr)
        print(f"  identity {dev.identity}; {'quick' if args.quick else 'full'} grid", file=sys.stderr)
        for d, bounds in sweep.bounds.items():
            names = dict.fromkeys(b.impl for b in bounds)
            routes = [n + (f" at {[b.num_sms for b in bounds if b.impl == n]} SMs" if any(
                b.impl == n and b.num_sms for b in bounds) else "") for n in names]
            print(f"  {d}: measuring {'; '.join(routes) or 'nothing (no usable route)'}", file=sys.stderr)
        extra = [update.HOST_COST, update.STAGED] + ([update.INTERFERENCE] if args.interference else [])
        try:
            result = sweep.run()
            if any(m.stage != "ceiling" for m in result.measurements):
                knees = [fit.fit_direction(result.measurements, str(d), args.knee_tolerance).kernel_sms for d in dirs]
                knees = [k for k in knees if k]
                got = update.measure(extra, dev, args.device, host, dirs, quick=args.quick, progress=progress,
                                     kernel_sms=max(knees) if knees else None, staged_slowdown=args.interference)
                result.failures.extend(got.failures.records)
        finally:
            progress.close()
        elapsed = time.monotonic() - t0
        if not any(m.stage != "ceiling" for m in result.measurements):
            for line in [*result.notes, *(f.describe() for f in result.failures)]:
                print(f"kvswap calibrate: {line}", file=sys.stderr)
            print("kvswap: error: no route could be measured; no profile written", file=sys.stderr)
            return 1

        fitted = fit.profile_fields(result.measurements, got.interference, dirs, prior, args.knee_tolerance,
                                    host_cost=got.host_cost, staged=got.staged_section(),
                                    served=served_directions(host, dev))
        doc = store.make_document(
            dev, fitted,
            measured=measured,
            host_reference=reference,
            timer=result.timer,
            elapsed_s=round(elapsed, 2),
            settings={**settings.to_dict(), **got.settings},
            directions=[str(d) for d in dirs],
            measurements=result.measurements,
            failures=result.failures,
            interference=got.interference,
            host_cost_records=got.host_cost_records,
            staged_records=got.staged_records,
            notes=result.notes,
        )
        profile, raw = store.split(doc)
        store.save(profile, path)
        written.append(path)
        store.save_measurements(raw, raw_path)
        written.append(raw_path)
        try:
            from .plot import plot_profile

            what = "host memory copies, host reference" if reference else f"{dev.platform} copies"
            plot_profile(fitted, plot_path, title=f"{dev.name} ({what})")
            written.append(plot_path)
        except ImportError as e:
            plot_path = None
            warnings.warn(f"no plot written: {e} (install kvswap[plot] for matplotlib)")
        print(calibration_report(fitted, result.measurements, got.interference, result.failures))
        print("\n".join(staged.describe(fitted.staged)))
        print()
        for note in result.notes:
            print(f"note: {note}")
        if reference:
            print("measured: HOST MEMORY COPIES (the host reference, no accelerator); these are not device link "
                  "numbers, and explain() says so")
        print(f"profile for {dev.identity} written to {path} (in {duration(elapsed)})")
        print(f"raw measurements written to {raw_path}")
        if plot_path is not None:
            print(f"plot written to {plot_path}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = profiles.find(dev)
        used = profiles.profile_path(found.source) if found is not None else None
        if used is None or used.resolve() != path.resolve():
            try:
                also = f", or copy it to {profiles.default_path(dev)}"
            except ImportError:  # a --no-deps install without platformdirs has no user directory
                also = ""
            reads = f"it reads {used}" if used else f"it finds no profile for it, and decides by {prior.source}"
            print(f"note: the resolver does not read this file for {dev.identity} ({reads}); "
                  f"set {profiles.PROFILE_ENV}={path} to use it{also}")
        return 0
    except KeyboardInterrupt:
        if not written:
            print(f"kvswap calibrate: interrupted after {duration(time.monotonic() - t0)}; nothing was saved "
                  f"({path} is as it was)", file=sys.stderr)
        else:
            print(f"kvswap calibrate: interrupted after saving the profile for {dev.identity} to {path}"
                  + (f" (also written: {', '.join(map(str, written[1:]))})" if written[1:] else "")
                  , file=sys.stderr)
        return 130
