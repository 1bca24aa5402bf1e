"""The ``kvswap`` command: ``info``, ``explain``, ``calibrate``, ``bench``.

Exit status (:data:`EXIT_STATUS`): 0 done; 1 the work failed (a driver error, nothing
usable); 2 a usage error (bad arguments, a forced implementation that cannot be honoured);
3 no such device here (no GPU, or fewer than the index named); 130 interrupted; 141 (as for
SIGPIPE) when whoever reads stdout stops reading, e.g. ``kvswap info | head -1``.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import warnings
from typing import Any, Callable, Iterable, Optional, Sequence

from .. import __version__
from ..errors import ConfigurationError, DeviceNotFoundError, KvSwapError, ResolutionError
from ..types import Direction, Policy, whole

# Subcommands whose code lives elsewhere: name -> module with HELP, DESCRIPTION,
# add_arguments(p) and run(args). A command whose module fails to import is still listed,
# and running it says why.
EXTERNAL = {
    "models": "kvswap.cli.models",
    "calibrate": "kvswap.calibration.cli_calibrate",
    "bench": "kvswap.calibration.cli_bench",
}
FORCE_ENV = "KVSWAP_FORCE_IMPL"
EXIT_FAILED, EXIT_USAGE, EXIT_NO_DEVICE, EXIT_INTERRUPTED = 1, 2, 3, 130
EXIT_SIGPIPE = 128 + int(getattr(signal, "SIGPIPE", 13))
EXIT_STATUS = (f"Exit status: 0 done; {EXIT_FAILED} the work failed; {EXIT_USAGE} a usage error (bad arguments, a "
               f"forced implementation that cannot be honoured); {EXIT_NO_DEVICE} no such device here (no GPU, or "
               f"fewer than the index named); {EXIT_INTERRUPTED} interrupted; {EXIT_SIGPIPE} stdout closed by its "
               "reader.")


class UsageError(Exception):
    """Bad command-line arguments: one line on stderr, exit status 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse prints usage + message; we print one line
        raise UsageError(f"kvswap: error: {message} (see `{self.prog} --help`)")


def number(text: str, minimum: int) -> int:
    """``text`` as a whole number >= ``minimum`` (``16384``, ``8.0``, ``4e9``), read as
    :class:`~kvswap.Policy` reads its fields, and refused in the same words."""
    text = text.strip()
    try:
        value: Any = int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            value = text
    try:
        return whole(value, "", minimum)
    except ConfigurationError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def block_list(text: str) -> list[int]:
    """An argparse type: comma-separated positive whole numbers (byte counts, batches, degrees)."""
    values = [number(v, 1) for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r}: name one or more whole numbers >= 1, comma-separated")
    return values


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``minimum``, else a one-line error."""
    return lambda text: number(text, minimum)


non_negative = int_at_least(0)
positive = int_at_least(1)


LINK_DIRECTIONS = tuple(d for d in Direction if d.crosses_host)


def direction(text: str) -> Direction:
    try:
        return Direction.parse(text)
    except ConfigurationError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def directions(text: str) -> list[Direction]:
    """An argparse type: comma-separated directions across the host link (what ``calibrate``
    and ``bench`` measure), each once; the choices named are only those."""
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    valid = [str(d) for d in LINK_DIRECTIONS]
    if not names or not set(names) <= set(valid):
        raise argparse.ArgumentTypeError(f"{text!r}: choose one or more of {', '.join(valid)}, comma-separated")
    return list(dict.fromkeys(Direction.parse(n) for n in names))


def add_directions(p: argparse.ArgumentParser, also: str = "") -> None:
    """``--directions`` (also spelt ``--direction``, as ``explain`` spells it) of a command
    that measures the host link."""
    p.add_argument("--directions", "--direction", dest="directions", type=directions,
                   default=list(LINK_DIRECTIONS), metavar="h2d,d2h",
                   help=f"directions to measure, comma-separated (default both){also}")


def link_directions(dirs: Iterable[Direction]) -> list[Direction]:
    """``--directions`` of a command that measures the host link: each once, at least one,
    none that stays on the device."""
    dirs = list(dict.fromkeys(dirs))
    if not dirs:
        raise ConfigurationError("--directions must name at least one of h2d, d2h")
    within = [str(d) for d in dirs if not d.crosses_host]
    if within:
        raise ConfigurationError(f"--directions {','.join(within)}: only copies across the host link (h2d, d2h) "
                                 "are measured here")
    return dirs


def file_to_write(path: Any, option: str, what: str = "the file to write") -> None:
    """Refuse an output option naming a directory, or a file in a folder that cannot be
    made or written, before any measurement runs."""
    if path is None:
        return
    if os.path.isdir(path):
        raise ConfigurationError(f"{option} {str(path)!r} is a directory; name {what}")
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(folder):  # the first folder that exists: the rest are made under it
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigurationError(f"{option} {str(path)!r} cannot be written: {folder!r} is not a writable folder")


def write_json(path: Any, doc: Any) -> None:
    """A command's results as JSON at ``path`` (:func:`write_text`), and a line saying where."""
    write_text(json.dumps(doc, indent=1, default=str) + "\n", path)
    print(f"results written to {path}")


def write_text(text: str, path: Any) -> Any:
    """Write ``text`` to the file ``path`` whole or not at all (its folder made): beside it,
    then renamed over it, readable by all (mkstemp's 0600 would hide a shared profile). A
    device or pipe (``/dev/stdout``) is written to, never replaced. Returns ``path``."""
    import tempfile
    from pathlib import Path

    target = Path(os.path.realpath(path))
    if target.exists() and not target.is_file():
        target.write_text(text)
        return path
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", help="device to use: cpu, cuda, cuda:N (default: the current accelerator, else the CPU)")


def cmd_info(args: argparse.Namespace) -> int:
    from .inventory import format_report, report
    from ..registry.plugins import plugin_host

    info = report(plugin_host(), args.device)
    print(json.dumps(info, indent=1) if args.json else format_report(info))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from ..resolution.resolver import resolve

    policy = Policy(max_sms=args.max_sms, prefer=args.prefer, force=args.force)
    fn = resolve(args.direction, device=args.device, block_bytes=args.block_bytes, policy=policy)
    print(json.dumps(fn.plan.to_dict(), indent=1) if args.json else fn.explain())
    return 0


def build_parser() -> Parser:
    parser = Parser(
        prog="kvswap",
        description="Move KV-cache blocks between pinned host memory and accelerator memory. "
        "Inspect the backends (info), see how a transfer would be routed (explain), "
        "list the KV shapes of known models (models), "
        "measure this device (calibrate) and compare routes (bench).",
        epilog="Environment: KVSWAP_FORCE_IMPL=IMPL uses one implementation for everything (as explain "
        "--force); KVSWAP_PROFILE=FILE is the calibration profile tried first; KVSWAP_PLUGINS=a,b loads only these "
        "plugins, KVSWAP_DISABLE_PLUGINS=a,b none of these. " + EXIT_STATUS,
    )
    parser.add_argument("--version", action="version", version=f"kvswap {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True

    p = sub.add_parser("info", help="platform, device, plugins and every implementation with its availability",
                       description="Show the platform, the device, the plugins loaded (with distribution and "
                       "version), every implementation available or not with the reason, and where the "
                       "calibration comes from.")
    add_device(p)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout (warnings go to stderr)")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("explain", help="how a transfer would be routed, and why",
                       description="Resolve a swap function as an engine would and print its decision trace: "
                       "candidates, rejections with reasons, calibration source, route per block-size class.")
    p.add_argument("--direction", "--directions", dest="direction", required=True, type=direction,
                   metavar="h2d|d2h|d2d", help="h2d (host to device), d2h (device to host) or d2d (within one device)")
    p.add_argument("--block-bytes", type=block_list, metavar="N[,N...]",
                   help="block sizes the engine will copy, e.g. 8192,16384 (default: a route per block-size "
                   "class, as resolve() decides without them)")
    add_device(p)
    p.add_argument("--max-sms", type=non_negative, metavar="N", help="most SMs a kernel route may take (0: none; default: as the "
                   "calibration decides)")
    p.add_argument("--prefer", choices=["throughput", "low_interference"], default="throughput",
                   help="rank by bandwidth alone, or discount routes that slow compute down")
    p.add_argument("--force", metavar="IMPL", help="use this implementation for everything")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=cmd_explain)

    for name, module in EXTERNAL.items():
        add_external(sub, name, module)
    return parser


def add_external(sub: Any, name: str, module: str) -> None:
    """Register ``name`` from ``module``; if the module cannot load, a stub that says why."""
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # any failure of an optional part: report it, keep the CLI working
        why = f"kvswap {name} is unavailable: importing {module} failed: {type(e).__name__}: {e}"
        p = sub.add_parser(name, help=f"unavailable ({type(e).__name__}: {e}); `kvswap {name}` says more",
                           description=why)
        p.set_defaults(func=unavailable(why), any_arguments=True)
        return
    p = sub.add_parser(name, help=mod.HELP, description=mod.DESCRIPTION)
    mod.add_arguments(p)
    p.set_defaults(func=mod.run)


def unavailable(why: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        print(f"kvswap: error: {why}", file=sys.stderr)
        return EXIT_FAILED

    return run


def _one_line_warning(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
    text = str(message)
    # A library warning names kvswap for an engine's log; here the prefix already does.
    text = text[len("kvswap "):] if text.startswith("kvswap ") else text
    print(f"kvswap: warning: {text}", file=sys.stderr if file is None else file)


def forced(args: Optional[argparse.Namespace]) -> Optional[str]:
    """The implementation this command was told to use (``--force``, else the switch)."""
    return getattr(args, "force", None) or os.environ.get(FORCE_ENV, "").strip() or None


def main(argv: Optional[Sequence[str]] = None) -> int:
    warnings.showwarning = _one_line_warning
    args = None
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if extra and not getattr(args, "any_arguments", False):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler below
        return status
    except UsageError as e:
        print(e, file=sys.stderr)
        return EXIT_USAGE
    except DeviceNotFoundError as e:
        print(f"kvswap: error: {e}", file=sys.stderr)
        return EXIT_NO_DEVICE
    except ConfigurationError as e:
        print(f"kvswap: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ResolutionError as e:
        # A forced implementation that cannot be honoured is a mistake in the flag or switch.
        flag = "--force: " if getattr(args, "force", None) else ""
        print(f"kvswap: error: {flag}{e}", file=sys.stderr)
        return EXIT_USAGE if forced(args) else EXIT_FAILED
    except KvSwapError as e:
        print(f"kvswap: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except BrokenPipeError:
        # The reader went away (``| head``): say nothing, and keep the interpreter's final
        # flush of stdout from failing again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_SIGPIPE
    except OSError as e:  # a result that could not be written (disk full, no permission)
        print(f"kvswap: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("kvswap: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


