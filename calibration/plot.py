"""Draw a profile: bandwidth against block size per route, both directions (PNG).

matplotlib is an optional extra (``kvswap[plot]``) and is imported only here, on the Agg
backend, so a machine without a display (or without matplotlib) still calibrates.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .decisions import Fitted


def _label(b: int) -> str:
    return f"{b // 1024}K" if b % 1024 == 0 else f"{b / 1024:g}K"


def plot_profile(fitted: Fitted, path: Path, title: str = "") -> Path:
    """Write ``path`` (PNG) from a profile's curves and decisions: one panel per direction;
    each batch route a line, the kernel one line per SM count (darker = more SMs), the
    staged route (by chunk size, on a block-major host) a dashed purple line, the ceiling dashed, the chosen route highlighted and the kernel/batch crossover marked."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    directions = [d for d, dec in fitted.decisions.items() if dec.carried_from is None and fitted.curves_of(d)]
    directions = directions or ["h2d"]
    fig, axes = plt.subplots(1, len(directions), figsize=(7.5 * len(directions), 5.2), squeeze=False)
    cmap = plt.get_cmap("viridis")
    for ax, d in zip(axes[0], directions):
        rows: dict[tuple[str, str, Any], dict[int, float]] = {
            (c.impl, "kernel" if c.num_sms else "batch", c.num_sms): dict(c.points) for c in fitted.curves_of(d)}
        kernel_sms = sorted({k[2] for k in rows if k[1] == "kernel" and k[2]})
        for (impl, kind, sms), pts in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2] or 0)):
            xs = sorted(pts)
            if kind == "kernel":
                shade = 0.15 + 0.75 * kernel_sms.index(sms) / max(len(kernel_sms) - 1, 1)
                ax.plot(xs, [pts[x] for x in xs], "-o", ms=3, lw=1.2, color=cmap(1 - shade), label=f"{impl} {sms} SMs")
            else:
                ax.plot(xs, [pts[x] for x in xs], "-s", ms=4, lw=2, label=impl)
        for c in fitted.staged_curves(d):  # by chunk size, on a block-major host: its own style
            xs = [b for b, _ in c.points]
            ax.plot(xs, [g for _, g in c.points], "--D", ms=4, lw=2, color="tab:purple",
                    label=f"{c.impl} (block-major host, by chunk size)")
        dec = fitted.decisions.get(d)
        chosen = dec.by_size if dec else []
        if chosen:
            ax.plot([r.block_bytes for r in chosen], [r.gbps for r in chosen], "-", lw=7, alpha=0.22,
                    color="tab:red", label="chosen route", zorder=0)
        ceiling = fitted.ceiling_gbps.get(d)
        if ceiling:
            ax.axhline(ceiling, ls="--", color="black", lw=1, label=f"contiguous ceiling {ceiling:.1f} GB/s")
        cross = dec.crossover_bytes if dec else None
        if cross:
            ax.axvline(cross, ls=":", color="tab:red", lw=1.5)
            ax.annotate(f"batch from {_label(cross)}", (cross, ax.get_ylim()[1] * 0.95), rotation=90,
                        va="top", ha="right", fontsize=8, color="tab:red")
        sizes = sorted({b for pts in rows.values() for b in pts} | {b for c in fitted.staged_curves(d) for b, _ in c.points})
        ax.set_xscale("log", base=2)
        if sizes:
            ax.set_xticks(sizes)
            ax.set_xticklabels([_label(b) for b in sizes], rotation=90, fontsize=7)
        ax.set_xlabel("block size (bytes)")
        ax.set_ylabel("GB/s")
        knee = dec.kernel_sms if dec else None
        sub = f", kernel knee {knee} SMs" if knee else ""
        sub += f", kernel from batch {dec.kernel_min_batch}" if dec and dec.kernel_min_batch else ""
        ax.set_title(f"{d}{sub}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"kvswap calibration: {title}" if title else "kvswap calibration", fontsize=11)
    fig.tight_layout()
    path = save_png(fig, path)
    plt.close(fig)
    return path


def save_png(fig: Any, path: Any, colours: int = 64) -> Path:
    """Write ``fig`` to ``path`` as a PNG of ``colours`` colours: a plot of flat colours
    looks the same in a fraction of the bytes (Pillow comes with matplotlib). The
    calibration plot's shades of one colour per SM count want the default; bars of a few
    colours take far fewer."""
    import io

    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = io.BytesIO()
    fig.savefig(raw, format="png", dpi=110)
    raw.seek(0)
    with Image.open(raw) as im:
        im.convert("RGB").quantize(colors=colours, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
    return path
