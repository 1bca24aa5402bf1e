"""What a step benchmark's JSON says: its table (plain text and markdown), a plot, and the bars.

Everything here reads the document :func:`kvswap.calibration.step.run_step_bench` wrote
(or several merged), so a run on a GPU machine is rendered anywhere.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

from kvswap.cli.models import PRESETS

from .plot import save_png
from .step_contenders import VARIANTS
from .step_contiguous import CONTIGUOUS

KiB = 1024

# The bars a step run is held to.
BAR_MAKESPAN = 1.03  # the default's makespan at most this x the best contender's
BAR_VS_VLLM = 1.0  # the default's transfer beside compute at least as fast as vLLM's policy
BAR_VS_VLLM_GEOMEAN = 1.3  # ... and this much faster in geomean where chunks are 4-16 KiB
GEOMEAN_CHUNKS = (4 * KiB, 16 * KiB)
SUBMIT_BASE_US, SUBMIT_PER_DESCRIPTOR_US = 100.0, 0.01  # the engine thread's budget per submit
BAR_CEILING = 0.90  # h2d 4 KiB x 10,000 through BlockMover (per-layer host), over the contiguous ceiling
CEILING_POINT = ("h2d", 4 * KiB, 10_000)
# Per host layout, over the built-in models' cases: the default's makespan over the contiguous
# reference's (span/contiguous), at most (every case, geomean).
BAR_CONTIGUOUS = {"per-layer": (1.20, 1.08), "block-major": (1.05, 1.02)}
# Where the transfer takes about as long as the compute: the default's makespan against the
# best contender that takes no staged route (either host layout), block-major.
BAR_VS_UNSTAGED, UNSTAGED_CASE = 0.85, ("llama-3.1-8b", 1, 512)
# The staged route alone on a block-major host, jobs of 512 blocks of 4-32 KiB chunks.
BAR_STAGED_CEILING, STAGED_CHUNKS, STAGED_BLOCKS = 0.90, (4 * KiB, 32 * KiB), 512
BAR_STAGED_SLOWDOWN = 0.05  # the compute throughput lost beside it (step_interference)

COLUMNS = ("model", "tp", "dir", "B", "host", "chunk", "desc", "contender", "route", "submit us", "alone ms",
           "beside ms", "GB/s beside", "slowdown", "makespan ms", "span/compute", "span/contiguous", "checked")


def _size(b: int) -> str:
    return f"{b // KiB} KiB" if b % KiB == 0 else f"{b} B"


def _bytes(n: int) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{n} B"


def _f(v: Optional[float], fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def host_layout(case: dict[str, Any]) -> str:
    """The case's host layout (a document from before the axis: per-layer)."""
    return case.get("host_layout", "per-layer")


def rows(doc: dict[str, Any], variants: bool = True) -> list[list[str]]:
    """One row per case and contender; without ``variants``, the default's variants left out."""
    out = []
    for case in doc["cases"]:
        for c in case["contenders"]:
            if not variants and c["name"] in VARIANTS:
                continue
            route = c["route"] + (f" (= {c['same_as']})" if c["same_as"] else "")
            if c["error"]:
                cells = ["failed: " + c["error"][:60]] + [""] * 8
            else:
                cells = [_f(c["submit_us"], ".0f"), _f(c["transfer_alone_ms"], ".3f"),
                         _f(c["transfer_beside_ms"], ".3f"), _f(c["gbps_beside"], ".1f"),
                         _f(c["slowdown"], ".3f"), _f(c["makespan_ms"], ".2f"),
                         _f(makespan_over_compute(case, c), ".3f"), _f(span_over_contiguous(case, c), ".3f"),
                         _bytes(c["bytes_checked"])]
            out.append([case["model"], str(case["tp"]), case["direction"], str(case["blocks"]), host_layout(case),
                        _size(case["chunk_bytes"]), str(case["descriptors"]), c["name"], route, *cells])
    return out


def text_table(doc: dict[str, Any]) -> str:
    cells = [list(COLUMNS)] + rows(doc)
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines[:1] + ["  ".join("-" * w for w in widths)] + lines[1:])


def markdown_table(doc: dict[str, Any]) -> str:
    """The cases as a markdown table; the default's variants are summed up in
    :func:`variants_table` instead (the JSON keeps their rows)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in rows(doc, variants=False)]
    return "\n".join(lines)


def header(doc: dict[str, Any]) -> str:
    d, comp, s = doc["device"], doc["compute"], doc["settings"]
    return (f"device {d['name']!r} ({d['platform']}, {d['compute_units']} SMs, link {d.get('link', '?')}); "
            f"compute: {comp['gemms']} x {comp['gemm']} ({comp['gemm_ms']:.3f} ms each, step {s['step_ms']} ms"
            f"{', launched as ' + comp['launch'] if comp.get('launch') else ''}); "
            f"median of {s['reps']} repetitions, contenders interleaved; contiguous = one contiguous copy of the "
            f"job's bytes beside the same compute, span/contiguous = a makespan over its makespan in the same "
            f"repetition; vllm = {doc['vllm_policy']}")


# -- the bars ---------------------------------------------------------------------------------

def _contender(case: dict[str, Any], name: str) -> Optional[dict[str, Any]]:
    c = next((c for c in case["contenders"] if c["name"] == name), None)
    return c if c is not None and not c["error"] and c["makespan_ms"] is not None else None


def makespan_over_compute(case: dict[str, Any], c: dict[str, Any]) -> Optional[float]:
    """The step's makespan over the compute alone: the median of the per-repetition ratios
    where the document has them (``makespan_over_compute``), else the medians' ratio."""
    r = c.get("makespan_over_compute")
    if r is None and c["makespan_ms"] is not None and case["compute_alone_ms"]:
        r = c["makespan_ms"] / case["compute_alone_ms"]
    return r


def span_over_contiguous(case: dict[str, Any], c: dict[str, Any]) -> Optional[float]:
    """The step's makespan over the contiguous reference's, the median of the per-repetition
    ratios (None in a document without the reference)."""
    return c.get("span_over_contiguous")


def _case_label(case: dict[str, Any]) -> str:
    return f"{case['model']} tp{case['tp']} {host_layout(case)} {case['direction']} x{case['blocks']}"


def _geomean(values: Sequence[float]) -> Optional[float]:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def bars(docs: Sequence[dict[str, Any]], interference: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Each bar: ``{"bar", "cases", "passed", "worst", "worst_case", "ok", "note"}`` (``ok``
    None where no case could be judged). ``interference``: documents of
    :mod:`kvswap.calibration.step_interference`, which the staged route's slowdown bar reads.
    The default's variants (:func:`variants_table`) and the contiguous reference (every
    contender's ``span_over_contiguous`` holds what it says) are not contenders here."""
    cases = [dict(c, contenders=[x for x in c["contenders"] if x["name"] not in (*VARIANTS, CONTIGUOUS)])
             for doc in docs for c in doc["cases"]]
    out: list[dict[str, Any]] = []

    def bar(name: str, judged: list[tuple[str, float, bool]], worst_is_min: bool, extra: str = "") -> None:
        if not judged:
            out.append({"bar": name, "cases": 0, "passed": 0, "worst": None, "worst_case": None, "ok": None,
                        "note": extra or "no case to judge"})
            return
        pick = min if worst_is_min else max
        label, value, _ = pick(judged, key=lambda j: j[1])
        passed = sum(ok for _, _, ok in judged)
        out.append({"bar": name, "cases": len(judged), "passed": passed, "worst": round(value, 4),
                    "worst_case": label, "ok": passed == len(judged), "note": extra})

    def geomean_bar(name: str, values: list[float], ok: Callable[[float], bool]) -> None:
        g = _geomean(values)
        out.append({"bar": name, "cases": len(values), "passed": int(g is not None and ok(g)),
                    "worst": None if g is None else round(g, 4), "worst_case": "geomean",
                    "ok": None if g is None else ok(g), "note": "" if values else "no case to judge"})

    judged = []
    for case in cases:
        default = _contender(case, "default")
        others = [c for c in case["contenders"] if _contender(case, c["name"])]
        if default and others:
            # Each makespan over the compute alone of its own repetition: the GEMMs' time
            # drifts between repetitions with the GPU's clock, more than a route moves it.
            best = min(makespan_over_compute(case, c) for c in others)
            r = makespan_over_compute(case, default) / best
            judged.append((_case_label(case), r, r <= BAR_MAKESPAN))
    bar(f"default makespan / compute alone <= {BAR_MAKESPAN} x best contender's", judged, worst_is_min=False)

    judged, geo = [], []
    for case in cases:
        default, vllm = _contender(case, "default"), _contender(case, "vllm")
        if default and vllm and default["transfer_beside_ms"]:
            r = vllm["transfer_beside_ms"] / default["transfer_beside_ms"]
            judged.append((_case_label(case), r, r >= BAR_VS_VLLM))
            if GEOMEAN_CHUNKS[0] <= case["chunk_bytes"] <= GEOMEAN_CHUNKS[1] and case["model"] in PRESETS:
                geo.append(r)
    bar(f"default transfer beside compute >= {BAR_VS_VLLM} x vLLM policy's (speed)", judged, worst_is_min=True)
    geomean_bar(f"geomean of that over built-in models' cases with 4-16 KiB chunks >= {BAR_VS_VLLM_GEOMEAN}", geo,
                lambda g: g >= BAR_VS_VLLM_GEOMEAN)

    judged = []
    others_over = 0
    for case in cases:
        budget = SUBMIT_BASE_US + SUBMIT_PER_DESCRIPTOR_US * case["descriptors"]
        for c in case["contenders"]:
            if _contender(case, c["name"]) is None or c["same_as"]:
                continue
            r = c["submit_us"] / budget
            if c["name"] == "default":
                judged.append((_case_label(case), r, r <= 1.0))
            elif r > 1.0:
                others_over += 1
    bar(f"default submit host time <= {SUBMIT_BASE_US:.0f} us + {SUBMIT_PER_DESCRIPTOR_US * 1e3:.0f} ns "
        f"x descriptors (worst: fraction of budget)", judged, worst_is_min=False,
        extra=f"other contenders over budget in {others_over} case(s)")

    judged = []
    d, chunk, n = CEILING_POINT
    for case in cases:
        default = _contender(case, "default")
        if (case["direction"], case["chunk_bytes"], case["descriptors"]) == (d, chunk, n) and default \
                and host_layout(case) == "per-layer" and case.get("ceiling_gbps") and default["gbps_alone"]:
            r = default["gbps_alone"] / case["ceiling_gbps"]
            judged.append((_case_label(case), r, r >= BAR_CEILING))
    bar(f"{d} {chunk // KiB} KiB x {n:,} through BlockMover (per-layer host) >= {BAR_CEILING} x contiguous ceiling",
        judged, worst_is_min=True, extra="" if judged else "run the ceiling case (see docs/benchmarks.md)")

    _contiguous_bars(cases, bar, geomean_bar)
    _block_major_bars(cases, bar)
    judged, floor = [], []
    for doc in interference:
        for r in doc["records"]:
            if r.get("kind") == "staged" and not r.get("error"):
                where = f"{r['direction']} {r['route']} {r['chunk_bytes'] // KiB} KiB x{r['blocks']}"
                judged.append((where, r["slowdown"], r["slowdown"] <= BAR_STAGED_SLOWDOWN))
            elif r.get("kind") == "contiguous" and not r.get("error"):
                floor.append(r["slowdown"])
    extra = "" if judged else "run python -m kvswap.calibration.step_interference on a GPU"
    if judged and floor:
        extra = f"a contiguous copy of the same bytes beside the same compute: {min(floor):.1%} to {max(floor):.1%}"
    bar(f"staged route's compute slowdown (block-major host, step_interference) <= {BAR_STAGED_SLOWDOWN:.0%}", judged,
        worst_is_min=False, extra=extra)
    return out


def _contiguous_bars(cases: list[dict[str, Any]], bar: Callable[..., None], geomean_bar: Callable[..., None]) -> None:
    """Per host layout, over the built-in models' cases: the default's makespan over the
    contiguous reference's in the same repetition, in every case and in geomean."""
    for layout, (every, geo) in BAR_CONTIGUOUS.items():
        judged = []
        for case in cases:
            default = _contender(case, "default")
            r = span_over_contiguous(case, default) if default else None
            if r is not None and host_layout(case) == layout and case["model"] in PRESETS:
                judged.append((_case_label(case), r, r <= every))
        bar(f"{layout} host, built-in models: default span <= {every} x contiguous copy's (span/contiguous), "
            f"every case", judged, worst_is_min=False)
        geomean_bar(f"{layout} host, built-in models: geomean of that <= {geo}", [j[1] for j in judged],
                    lambda g, geo=geo: g <= geo)


def _block_major_bars(cases: list[dict[str, Any]], bar: Callable[..., None]) -> None:
    """The bars of a block-major host: the default against every route that is not staged,
    and the staged route against the link's ceiling."""
    block_major = [c for c in cases if host_layout(c) == "block-major"]
    judged = []
    model, tp, blocks = UNSTAGED_CASE
    for case in block_major:
        default = _contender(case, "default")
        if (case["model"], case["tp"], case["blocks"]) != (model, tp, blocks) or default is None:
            continue
        # The same step on either host layout, by every contender whose jobs took no staged route.
        same = [c for c in cases if (c["model"], c["tp"], c["blocks"], c["direction"]) ==
                (model, tp, blocks, case["direction"])]
        unstaged = [makespan_over_compute(c, x) for c in same for x in c["contenders"]
                    if _contender(c, x["name"]) and not x["same_as"] and not x.get("staged")]
        if unstaged:
            r = makespan_over_compute(case, default) / min(unstaged)
            judged.append((_case_label(case), r, r <= BAR_VS_UNSTAGED))
    bar(f"{model} tp{tp} x{blocks}, block-major: default span/compute <= {BAR_VS_UNSTAGED} x best contender's "
        f"without a staged route (either host layout)", judged, worst_is_min=False)

    judged = []
    lo, hi = STAGED_CHUNKS
    for case in block_major:
        staged = _contender(case, "staged")
        if (staged and case["blocks"] == STAGED_BLOCKS and lo <= case["chunk_bytes"] <= hi
                and case.get("ceiling_gbps") and staged["gbps_alone"]):
            r = staged["gbps_alone"] / case["ceiling_gbps"]
            judged.append((_case_label(case), r, r >= BAR_STAGED_CEILING))
    bar(f"block-major x{STAGED_BLOCKS}, {lo // KiB}-{hi // KiB} KiB chunks: staged alone >= {BAR_STAGED_CEILING} x "
        f"contiguous ceiling", judged, worst_is_min=True)
def bars_table(results: Sequence[dict[str, Any]]) -> str:
    head = ("bar", "cases", "passed", "worst", "where", "verdict")
    cells = [list(head)]
    for b in results:
        verdict = "n/a" if b["ok"] is None else ("PASS" if b["ok"] else "FAIL")
        cells.append([b["bar"], str(b["cases"]), str(b["passed"]), _f(b["worst"], ".3f"), b["worst_case"] or "-",
                      verdict + (f" ({b['note']})" if b.get("note") else "")])
    lines = ["| " + " | ".join(r) + " |" for r in cells]
    return "\n".join(lines[:1] + ["|" + "---|" * len(head)] + lines[1:])


# -- the plot ----------------------------------------------------------------------------------

ROW_INCHES = 6.0  # a row of panels, with room for the case labels under them

def plot(doc: dict[str, Any], path: Path) -> Path:
    """Per direction and host layout: each contender's (not the default's variants) and the
    contiguous reference's transfer time beside compute and the step's makespan over the
    compute alone and over the reference's, per case (needs matplotlib:
    ``pip install kvswap[plot]``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((c["direction"], host_layout(c)) for c in doc["cases"]))
    # The default's variants are left to the variants table, as in the markdown.
    names = list(dict.fromkeys(c["name"] for case in doc["cases"] for c in case["contenders"]
                               if c["name"] not in VARIANTS))
    metrics = (("transfer beside compute (ms, log)", lambda case, c: c["transfer_beside_ms"], True),
               ("step makespan / compute alone", makespan_over_compute, False),
               ("step makespan / contiguous copy's", span_over_contiguous, False))
    fig, axes = plt.subplots(len(panels), len(metrics), figsize=(22, ROW_INCHES * len(panels)), squeeze=False)
    width = 0.8 / max(len(names), 1)
    for row, (d, layout) in enumerate(panels):
        cases = [c for c in doc["cases"] if (c["direction"], host_layout(c)) == (d, layout)]
        labels = [f"{c['model']} tp{c['tp']} x{c['blocks']} {_size(c['chunk_bytes'])}" for c in cases]
        for col, (title, value, log) in enumerate(metrics):
            ax = axes[row][col]
            for i, name in enumerate(names):
                ys = []
                for case in cases:
                    c = _contender(case, name)
                    v = value(case, c) if c is not None else None
                    ys.append(math.nan if v is None else v)
                xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(cases))]
                ax.bar(xs, ys, width, label=name)
            if log:
                ax.set_yscale("log")
            else:
                ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_xticks(range(len(cases)))
            ax.set_xticklabels(labels, fontsize=7, rotation=90)  # side by side, they would overlap
            ax.set_title(f"{d}, {layout} host: {title}")
            ax.grid(axis="y", alpha=0.3)
        axes[row][0].legend(fontsize=8)
    dev = doc["device"]
    fig.suptitle(f"kvswap bench --model on {dev['name']} (step {doc['settings']['step_ms']} ms of bf16 GEMMs)")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / (ROW_INCHES * len(panels))))  # room for the title
    path = save_png(fig, path, colours=16)  # seven contenders' bars, text, the grid
    plt.close(fig)
    return path


def merge(docs: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """One document of several runs on one device (cases and notes concatenated)."""
    docs = list(docs)
    out = dict(docs[0])
    out["cases"] = [c for d in docs for c in d["cases"]]
    out["notes"] = [n for d in docs for n in d["notes"]]
    return out


def interference_markdown(doc: dict[str, Any]) -> str:
    """The compute slowdown per direction, route, host layout and SM count (``step_interference``'s JSON)."""
    lines = [f"Compute slowdown beside a BlockMover job on {doc['device']} (fraction of GEMM throughput lost "
             f"while the job runs; the job sized to outlast the compute alone):", "",
             "| dir | route | host | SMs | chunk | blocks | slowdown | transfer ms | compute ms | covered |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["records"]:
        chunk = f"{r['chunk_bytes'] // 1024} KiB" if r.get("chunk_bytes") else "-"
        where = (f"| {r['direction']} | {r['route']} | {r.get('host_layout', 'per-layer')} | {r['num_sms'] or '-'} "
                 f"| {chunk} |")
        if r.get("error"):
            lines.append(f"{where} failed: {r['error'][:60]} | | | | |")
            continue
        lines.append(f"{where} {r['blocks']} | {r['slowdown']:.1%} | {r['transfer_beside_ms']:.2f} | "
                     f"{r['compute_beside_ms']:.2f} | {'yes' if r['covered'] else 'no'} |")
    return "\n".join(lines) + "\n"


def variants_table(docs: Sequence[dict[str, Any]]) -> Optional[str]:
    """What each older mechanism still gains (``kvswap bench --model --variants``): per
    variant, over the cases where it and the default both ran, its step (makespan over the
    compute alone) over the default's: above 1 the mechanism it lacks shortened the step,
    below 1 it lengthened it. Also its submit host time over the default's. None where no
    document holds a variant."""
    per: dict[str, list[tuple[str, float, Optional[float]]]] = {v: [] for v in VARIANTS}
    for doc in docs:
        for case in doc["cases"]:
            default = _contender(case, "default")
            if default is None:
                continue
            for v in VARIANTS:
                c = _contender(case, v)
                if c is not None:
                    r = makespan_over_compute(case, c) / makespan_over_compute(case, default)
                    host = c["submit_us"] / default["submit_us"] if default["submit_us"] else None
                    per[v].append((_case_label(case), r, host))
    if not any(per.values()):
        return None
    lines = ["| variant | cases | step / default's, geomean | most gained (case) | most lost (case) | "
             "submit host time / default's, geomean |", "|---|---|---|---|---|---|"]
    for v, got in per.items():
        if not got:
            continue
        hi, lo = max(got, key=lambda g: g[1]), min(got, key=lambda g: g[1])
        hosts = [h for _, _, h in got if h]
        lines.append(f"| {v} | {len(got)} | {_geomean([r for _, r, _ in got]):.3f} | {hi[1]:.3f} ({hi[0]}) | "
                     f"{lo[1]:.3f} ({lo[0]}) | {_f(_geomean(hosts), '.3f')} |")
    return "\n".join(lines)


def render_markdown(doc: dict[str, Any], command: str = "", plot_path: Optional[str] = None,
                    interference: Sequence[dict[str, Any]] = ()) -> str:
    """The section of docs/benchmarks.md for one device's run (``interference``: its
    step_interference documents, which one bar reads)."""
    out = [f"**{doc['device']['name']}**" + (f" — `{command}`" if command else ""), "", header(doc), "",
           markdown_table(doc), "", bars_table(bars([doc], interference))]
    stays = variants_table([doc])
    if stays:
        out += ["", "What each older mechanism still gains (the default without it, step over the default's):",
                "", stays]
    if plot_path:
        out += ["", f"![step benchmark on {doc['device']['name']}]({plot_path})"]
    return "\n".join(out) + "\n"
