"""What is installed and what it can do here: the data behind ``kvswap info``."""
from __future__ import annotations

from typing import Any

from .. import __version__
from ..memory import numa
from ..registry.platform import detect
from ..registry.plugins import PluginHost
from ..resolution.lookup import find_calibration
from ..resolution.plan import calibration_lines, sizes_taken
from ..resolution.resolver import collect_impls
from ..types import DeviceInfo

KNOWN_PLATFORMS = ("cpu", "cuda", "rocm")


def impl_rows(host: PluginHost, device: DeviceInfo) -> list[dict[str, Any]]:
    """Every impl registered for the known platforms and this device's, with its verdict here."""
    rows: dict[str, dict[str, Any]] = {}
    for platform in dict.fromkeys((device.platform,) + KNOWN_PLATFORMS):
        for plugin, impl in collect_impls(host, platform):
            if impl.name in rows:
                continue
            reason = impl.unavailable_reason(device)
            if reason and device.platform not in impl.platforms:
                own = impl.own_reason(device)
                if own:
                    reason = f"{reason}; {own}"
            rows[impl.name] = {
                "name": impl.name,
                "kind": impl.kind,
                "plugin": plugin,
                "platforms": list(impl.platforms),
                "directions": [str(d) for d in impl.directions],
                "available": reason is None,
                "reason": reason,
                "constraints": impl.constraints(),
                "description": impl.description,
            }
    return sorted(rows.values(), key=lambda r: (not r["available"], r["name"]))


def report(host: PluginHost, device: Any = None) -> dict[str, Any]:
    dev = detect(host, device)
    cal = find_calibration(host, dev)
    return {
        "kvswap_version": __version__,
        "platform": dev.platform,
        "device": dev.to_dict(),
        "calibration": cal.summary(),
        "plugins": [r.to_dict() for r in sorted(host.records.values(), key=lambda r: r.name)],
        "impls": impl_rows(host, dev),
        "gpus": numa.gpu_rows(host),
    }


def format_report(info: dict[str, Any]) -> str:
    d = info["device"]
    cal = info["calibration"]
    lines = [
        f"kvswap {info['kvswap_version']}",
        f"platform: {info['platform']}",
        f"device:   {d['name']} (identity {d['identity']}, {d['compute_units']} compute units, "
        f"arch {d['arch']}, link {d['link']})",
        *calibration_lines(cal, DeviceInfo(**d)),
        *numa.format_gpu_rows(info.get("gpus", [])),
        "plugins:",
    ]
    for p in info["plugins"]:
        tail = f" ({p['reason']})" if p["reason"] else ""
        lines.append(f"  {p['name']:<10} {p['distribution']} {p['version']:<8} {p['status']}{tail}  [{p['module']}]")
    lines.append("implementations:")
    width = max([len(r["name"]) for r in info["impls"]] + [4])
    for r in info["impls"]:
        mark = "+" if r["available"] else "-"
        status = "available" if r["available"] else f"unavailable: {r['reason']}"
        c = r["constraints"]
        if c["alignment"] > 1 or c["min_block_bytes"] > 1 or c["max_block_bytes"] is not None:
            status += f"; takes {sizes_taken(c)}"
        lines.append(f"  {mark} {r['name']:<{width}} {r['kind']:<6} {','.join(r['directions']):<8} {status}")
    return "\n".join(lines)
