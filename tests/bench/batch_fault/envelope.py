"""Map where ``cuMemcpyBatchAsync`` faults: descriptor count x size range x alignment x
direction, each shape one call in its own process (GPU; not a test).

Builds ``repro.c`` (beside this file) with nvcc, then runs it once per shape, several
children at a time, each with a timeout: a child that dies by a signal is recorded as that
signal, one that outlives its timeout as a hang. Shapes run in order of priority (the shape
known to fault first, then the mixed-size batches around the limit, then the shapes engines
send: blocks of one size of 4-64 KiB up to kvswap's 32,768 a call), and whatever the time
budget leaves is recorded as not run. Then, while time remains, every faulting shape runs
once more and the count between the largest clean and the smallest faulting count of each
class is bisected.

From the map it derives the per-call limits: for batches of mixed sizes and of one size, per
direction, the largest count below which no shape of the class failed. It writes
``envelope.json`` and ``envelope.md`` (the tables and the limits) under ``--out`` (default
``$OUT``), prints the tables, and with ``--update-doc docs/known-issues.md`` replaces that
file's envelope section with them::

    python3 tests/bench/batch_fault/envelope.py --out $OUT/envelope --budget-s 270
    python3 tests/bench/batch_fault/envelope.py --quick --out /tmp/env   # a few shapes
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Optional

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "repro.c"
COUNTS = (1000, 4096, 8192, 16384, 32768, 50000, 200000)
SIZES = ("m1-4096", "u4096", "u16384", "u65536", "m1-65536")
ALIGNS = ("odd", "8", "256")
DIRECTIONS = ("h2d", "d2h", "d2d")
BEGIN, END = "<!-- envelope:begin -->", "<!-- envelope:end -->"
FAILURES = ("signal", "hang", "call error", "stream error", "wrong bytes", "canaries changed", "exit")


@dataclass(frozen=True)
class Shape:
    direction: str
    sizes: str  # "u4096": every block 4,096 bytes; "m1-4096": drawn from [1, 4096]
    align: str  # "odd", or a byte multiple
    count: int
    abi: str = ""  # "" (the driver's own: 13000 on CUDA 13), "12080" or "export"
    order: str = ""  # "" (any for h2d, stream otherwise), "any", "stream" or "during"

    @property
    def mixed(self) -> bool:
        return self.sizes.startswith("m")

    @property
    def klass(self) -> tuple[str, str, str]:
        return self.direction, self.sizes, self.align

    def pool_bytes(self) -> int:
        """About the bytes of each side's pool (blocks and the gaps between them)."""
        if self.mixed:
            lo, hi = (int(x) for x in self.sizes[1:].split("-"))
            return self.count * (lo + hi)  # mean block (lo+hi)/2 plus a mean gap of about hi/2
        return int(self.count * int(self.sizes[1:]) * 1.5) + self.count * 256

    def argv(self, binary: str) -> list[str]:
        out = [binary, "-n", str(self.count), "-s", self.sizes, "-a", self.align, "-d", self.direction]
        if self.abi:
            out += ["-b", self.abi]
        if self.order:
            out += ["-o", self.order]
        return out

    def label(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in (("abi", self.abi), ("order", self.order)) if v)
        return f"{self.direction} {self.sizes} align {self.align} n={self.count}{extra}"


@dataclass
class Outcome:
    shape: Shape
    outcome: str  # "ok", "signal", "hang", "call error", ..., "not run", "skipped"
    detail: str = ""  # the signal's name, the driver's error, why skipped
    seconds: float = 0.0
    child: dict[str, Any] = field(default_factory=dict)  # repro's JSON line
    stderr: str = ""

    @property
    def failed(self) -> bool:
        return self.outcome in FAILURES

    def cell(self) -> str:
        return {"ok": "ok", "not run": "·", "skipped": "skip"}.get(
            self.outcome, self.detail if self.outcome == "signal" else self.outcome)


# -- building ------------------------------------------------------------------------------
def cuda_include(nvcc: Optional[str]) -> Optional[Path]:
    for root in filter(None, (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
                              str(Path(nvcc).resolve().parent.parent) if nvcc else None, "/usr/local/cuda")):
        if (Path(root) / "include" / "cuda.h").exists():
            return Path(root) / "include"
    return None


def build(out: Path, source: Path = SOURCE) -> tuple[str, str]:
    """Compile ``source`` into ``out``; ``(binary, the command that built it)``. nvcc first,
    else the C compiler with cuda.h's folder."""
    out.mkdir(parents=True, exist_ok=True)
    binary = out / "repro"
    nvcc = shutil.which("nvcc")
    tries = []
    if nvcc:
        tries.append([nvcc, "-O2", "-o", str(binary), str(source), "-ldl"])
    include = cuda_include(nvcc)
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc and include:
        tries.append([cc, "-O2", "-std=gnu11", f"-I{include}", "-o", str(binary), str(source), "-ldl"])
    errors = []
    for cmd in tries:
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode == 0:
            return str(binary), " ".join(cmd)
        errors.append(f"{' '.join(cmd)}:\n{p.stderr.strip()}")
    raise SystemExit("cannot build repro.c: " + ("\n".join(errors) or "no nvcc, and no C compiler with cuda.h"))


# -- the shapes ----------------------------------------------------------------------------
def grid(counts: tuple[int, ...], sizes: tuple[str, ...], aligns: tuple[str, ...],
         directions: tuple[str, ...]) -> list[Shape]:
    """Every shape once, most telling first: the known fault, mixed sizes host to device,
    the shapes engines send (one size, 256-byte aligned), then everything else."""
    def rank(s: Shape) -> tuple:
        known = s.direction == "h2d" and s.sizes == "m1-4096" and s.align == "odd" and s.count >= 50000
        engine = not s.mixed and s.align == "256"
        return (not known, not (s.mixed and s.direction == "h2d" and s.sizes == "m1-4096"), not engine,
                not s.mixed, s.sizes != "m1-4096", s.direction != "h2d", s.count)

    shapes = [Shape(d, z, a, n) for d in directions for z in sizes for a in aligns for n in counts]
    return sorted(shapes, key=rank)


def known_fault_variants(counts: tuple[int, ...]) -> list[Shape]:
    """The shape known to fault through the other ABIs and source orders."""
    n = 50000 if 50000 in counts else max(counts)
    base = Shape("h2d", "m1-4096", "odd", n)
    return [replace(base, abi="12080"), replace(base, abi="export"), replace(base, order="stream")]


# -- running -------------------------------------------------------------------------------
def run_child(binary: str, shape: Shape, timeout: float, env: Optional[dict] = None) -> Outcome:
    t0 = time.monotonic()
    try:
        p = subprocess.run(shape.argv(binary), capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        if "call 1:" not in err:  # still setting up its pools: slow, not a fault
            return Outcome(shape, "not run", f"set-up took over {timeout:.0f} s", time.monotonic() - t0,
                           stderr=err[-600:])
        return Outcome(shape, "hang", f"no return within {timeout:.0f} s", time.monotonic() - t0, stderr=err[-600:])
    seconds = time.monotonic() - t0
    child: dict[str, Any] = {}
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            try:
                child = json.loads(line)
            except json.JSONDecodeError:
                pass
    rc = p.returncode
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return Outcome(shape, "signal", name, seconds, child, p.stderr[-600:])
    outcome = {0: "ok", 3: "call error", 4: "stream error", 5: "wrong bytes", 6: "canaries changed"}.get(rc)
    if outcome is None:
        outcome, detail = ("skipped", f"set-up failed (exit {rc})") if rc == 2 else ("exit", f"exit {rc}")
    else:
        detail = child.get("error", "")
    return Outcome(shape, outcome, detail, seconds, child, p.stderr[-600:])


class Runner:
    """Runs shapes ``jobs`` at a time until the budget is spent; remembers every outcome."""

    def __init__(self, binary: str, jobs: int, timeout: float, budget: float, max_pool: int,
                 env: Optional[dict] = None) -> None:
        self.binary, self.jobs, self.timeout, self.max_pool, self.env = binary, jobs, timeout, max_pool, env
        self.deadline = time.monotonic() + budget
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, shapes: list[Shape]) -> list[Outcome]:
        pending: Iterator[Shape] = iter(shapes)
        got: list[Outcome] = []

        def worker() -> None:
            while True:
                with self._lock:
                    shape = next(pending, None)
                if shape is None:
                    return
                if shape.pool_bytes() > self.max_pool:
                    o = Outcome(shape, "skipped", f"pools of ~{shape.pool_bytes() / 2**30:.1f} GiB a side")
                elif self.left() < 1.0:
                    o = Outcome(shape, "not run", "time budget spent")
                else:
                    o = run_child(self.binary, shape, min(self.timeout, max(5.0, self.left())), self.env)
                    print(f"{o.shape.label():55s} {o.outcome:14s} {o.detail:28s} {o.seconds:6.1f} s", flush=True)
                with self._lock:
                    got.append(o)
                    self.outcomes.append(o)

        with ThreadPoolExecutor(self.jobs) as pool:
            for f in [pool.submit(worker) for _ in range(self.jobs)]:
                f.result()
        return got


# -- reading the map -----------------------------------------------------------------------
def first_fault(outcomes: list[Outcome], klass: tuple) -> tuple[Optional[int], Optional[int]]:
    """``(largest clean count below every failure, smallest failing count)`` of a class
    (default ABI and order only); None where there is none."""
    runs = [o for o in outcomes if o.shape.klass == klass and not o.shape.abi and not o.shape.order
            and o.outcome not in ("not run", "skipped")]
    failing = [o.shape.count for o in runs if o.failed]
    bad = min(failing) if failing else None
    clean = [o.shape.count for o in runs if o.outcome == "ok" and (bad is None or o.shape.count < bad)]
    return (max(clean) if clean else None), bad


def bisect_shapes(outcomes: list[Outcome]) -> list[Shape]:
    """For each class with a clean count below a failing one, the geometric midpoint."""
    out = []
    for klass in sorted({o.shape.klass for o in outcomes}):
        good, bad = first_fault(outcomes, klass)
        if good is not None and bad is not None and bad > good * 1.05 + 1:
            out.append(Shape(*klass, int(round((good * bad) ** 0.5))))
    return out


def limits(outcomes: list[Outcome]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per batch kind (mixed, uniform) and direction: ``first_fault`` (the smallest count
    any class of the kind failed at), ``safe`` (the largest clean count below it, over the
    classes that failed; None where none failed), ``tested_to`` (the largest count that
    ran clean in every class where it ran) and the classes that failed."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    classes = sorted({o.shape.klass for o in outcomes})
    for kind in ("mixed", "uniform"):
        for direction in [d for d in DIRECTIONS if any(k[0] == d for k in classes)]:
            mine = [k for k in classes if k[0] == direction and (k[1].startswith("m") == (kind == "mixed"))]
            if not mine:
                continue
            goods, faults, failing = [], [], []
            for k in mine:
                good, bad = first_fault(outcomes, k)
                if bad is not None:
                    faults.append(bad)
                    goods.append(good or 0)
                    failing.append(f"{k[1]} align {k[2]}")
            ran = [o for o in outcomes if o.shape.klass in mine and not o.shape.abi and not o.shape.order
                   and o.outcome not in ("not run", "skipped")]
            clean = [c for c in sorted({o.shape.count for o in ran})
                     if all(o.outcome == "ok" for o in ran if o.shape.count <= c)]
            out.setdefault(kind, {})[direction] = dict(
                safe=min(goods) if goods else None, first_fault=min(faults) if faults else None,
                failing_classes=failing, tested_to=max(clean) if clean else None)
    return out


def markdown(outcomes: list[Outcome], meta: dict[str, Any], lim: dict) -> str:
    counts = sorted({o.shape.count for o in outcomes if not o.shape.abi and not o.shape.order})
    lines = [f"Measured on {meta.get('device', '?')}, driver CUDA {meta.get('driver_text', '?')} "
             f"({meta.get('driver_release', 'release unknown')}); one call per process, every byte checked. "
             f"`ok`: copied and verified; `SIGSEGV` (or another signal): the process died inside the call; "
             f"`hang`: no return within {meta.get('timeout_s', '?')} s; `·`: not run within the time budget; "
             f"`skip`: pools too large for the budget. Repeated runs show as `k/n` failed.", ""]
    for direction in [d for d in DIRECTIONS if any(o.shape.direction == d for o in outcomes)]:
        lines += [f"**{direction}**", "", "| sizes | align | " + " | ".join(f"{c:,}" for c in counts) + " |",
                  "|---|---|" + "---|" * len(counts)]
        for sizes in SIZES + tuple(sorted({o.shape.sizes for o in outcomes} - set(SIZES))):
            for align in ALIGNS + tuple(sorted({o.shape.align for o in outcomes} - set(ALIGNS))):
                row = [o for o in outcomes if o.shape.klass == (direction, sizes, align)
                       and not o.shape.abi and not o.shape.order]
                if not row:
                    continue
                cells = []
                for c in counts:
                    runs = [o for o in row if o.shape.count == c]
                    cells.append(_cell(runs))
                extra = sorted({o.shape.count for o in row} - set(counts))
                note = "; also " + ", ".join(f"{c:,}: {_cell([o for o in row if o.shape.count == c])}"
                                              for c in extra) if extra else ""
                lines.append(f"| {sizes} | {align} | " + " | ".join(cells) + f" |{note}")
        lines.append("")
    variants = [o.shape for o in outcomes if o.shape.abi or o.shape.order]
    if variants:
        lines += ["Other entry points and source orders, same shape:", ""]
        lines += [f"* {v.label()}: {_cell([o for o in outcomes if o.shape == v])}" for v in dict.fromkeys(variants)]
        lines.append("")
    lines += ["Per-call limits derived from the map:", "",
              "| batch | direction | every shape clean up to | smallest failing count | largest clean count "
              "below it | failing classes |", "|---|---|---|---|---|---|"]
    for kind, per in lim.items():
        for direction, v in per.items():
            def num(x: Optional[int]) -> str:
                return "-" if x is None else f"{x:,}"
            lines.append(f"| {kind} | {direction} | {num(v['tested_to'])} | {num(v['first_fault'])} | "
                         f"{num(v['safe'])} | {', '.join(v['failing_classes']) or '-'} |")
    return "\n".join(lines) + "\n"


def _cell(runs: list[Outcome]) -> str:
    ran = [o for o in runs if o.outcome not in ("not run", "skipped")]
    if not ran:
        return runs[0].cell() if runs else ""
    bad = [o for o in ran if o.failed]
    if len(ran) == 1:
        return ran[0].cell()
    if not bad:
        return f"ok {len(ran)}/{len(ran)}"
    return f"{bad[0].cell()} {len(bad)}/{len(ran)}"


def update_doc(path: Path, text: str) -> None:
    doc = path.read_text()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{path} has no {BEGIN} ... {END} section to replace")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{BEGIN}\n{text}{END}{tail}")


def device_meta(binary: str, env: Optional[dict]) -> dict[str, Any]:
    """The device and driver, from a one-descriptor run and nvidia-smi where present."""
    meta: dict[str, Any] = {}
    o = run_child(binary, Shape("h2d", "u4096", "256", 1), 60, env)
    if o.child:
        meta["device"] = o.child.get("device")
        v = int(o.child.get("driver", 0))
        meta["driver_cuda"] = v
        meta["driver_text"] = f"{v // 1000}.{v % 1000 // 10}"
    meta["probe"] = o.outcome if o.outcome == "ok" else f"{o.outcome}: {o.detail} {o.stderr.strip()[-200:]}"
    smi = shutil.which("nvidia-smi")
    if smi:
        p = subprocess.run([smi, "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True,
                           text=True)
        if p.returncode == 0 and p.stdout.strip():
            meta["driver_release"] = "driver " + p.stdout.strip().splitlines()[0].split(",")[-1].strip()
    return meta


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "envelope-out"), help="results folder (default $OUT)")
    ap.add_argument("--budget-s", type=float, default=270.0, help="wall time for all children (default 270)")
    ap.add_argument("--timeout-s", type=float, default=60.0, help="one child's limit; longer is a hang")
    ap.add_argument("--jobs", type=int, default=4, help="children at a time (default 4)")
    ap.add_argument("--max-pool-gib", type=float, default=6.0, help="skip shapes with larger pools a side")
    ap.add_argument("--counts", default=",".join(map(str, COUNTS)))
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--aligns", default=",".join(ALIGNS))
    ap.add_argument("--directions", default=",".join(DIRECTIONS))
    ap.add_argument("--bisect", type=int, default=3, help="bisection rounds per class with a fault (default 3)")
    ap.add_argument("--quick", action="store_true", help="a handful of shapes (the known fault and its neighbours)")
    ap.add_argument("--binary", help="a built repro (skips the build)")
    ap.add_argument("--update-doc", help="replace the envelope section of this markdown file")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    binary, how = (a.binary, "given") if a.binary else build(out)
    counts = tuple(int(x) for x in a.counts.split(","))
    if a.quick:
        shapes = [Shape("h2d", "m1-4096", "odd", n) for n in (4096, 50000)] + [Shape("h2d", "u16384", "256", 32768)]
    else:
        shapes = grid(counts, tuple(a.sizes.split(",")), tuple(a.aligns.split(",")), tuple(a.directions.split(",")))
        shapes[2:2] = known_fault_variants(counts)
    t0 = time.monotonic()
    meta = device_meta(binary, None)
    meta.update(build=how, jobs=a.jobs, timeout_s=a.timeout_s, budget_s=a.budget_s, argv=sys.argv[1:] if argv is None
                else argv)
    print(f"device {meta.get('device')} driver CUDA {meta.get('driver_text')} ({meta.get('driver_release', '?')}); "
          f"probe {meta['probe']}; {len(shapes)} shapes, {a.jobs} at a time, {a.budget_s:.0f} s", flush=True)
    runner = Runner(binary, a.jobs, a.timeout_s, a.budget_s - (time.monotonic() - t0), int(a.max_pool_gib * 2**30))
    runner.run(shapes)
    again = [o.shape for o in runner.outcomes if o.failed]
    if again and runner.left() > 5:
        runner.run(again)  # does each fault repeat?
    for _ in range(a.bisect):
        mids = bisect_shapes(runner.outcomes)
        if not mids or runner.left() < 5:
            break
        runner.run(mids)
    lim = limits(runner.outcomes)
    text = markdown(runner.outcomes, meta, lim)
    meta["seconds"] = round(time.monotonic() - t0, 1)
    (out / "envelope.json").write_text(json.dumps(dict(
        meta=meta, limits=lim,
        runs=[dict(asdict(o.shape), outcome=o.outcome, detail=o.detail, seconds=round(o.seconds, 2), child=o.child,
                   stderr=o.stderr) for o in runner.outcomes]), indent=1))
    (out / "envelope.md").write_text(text)
    print("\n" + text)
    print(f"wrote {out / 'envelope.json'} and {out / 'envelope.md'} ({meta['seconds']} s)")
    if a.update_doc:
        update_doc(Path(a.update_doc), text)
        print(f"replaced the envelope section of {a.update_doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
