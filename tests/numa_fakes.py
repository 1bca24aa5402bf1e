"""A sysfs stand-in for NUMA tests: nodes with their CPUs, GPUs with their node."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from kvswap import DeviceInfo


def fake_sysfs(root: Path, nodes: dict[int, str], gpus: Optional[dict[str, tuple[str, str]]] = None,
               has_memory: Optional[str] = None) -> Path:
    """Write a sysfs tree under ``root`` and return ``root``.

    :param nodes: node -> its cpulist text.
    :param gpus: PCI address -> (``numa_node`` text, ``local_cpulist`` text or "" for none).
    :param has_memory: the ``has_memory`` list (default: every node).
    """
    base = root / "devices" / "system" / "node"
    base.mkdir(parents=True, exist_ok=True)
    for n, cpus in nodes.items():
        (base / f"node{n}").mkdir(exist_ok=True)
        (base / f"node{n}" / "cpulist").write_text(cpus + "\n")
    listed = ",".join(str(n) for n in sorted(nodes))
    (base / "online").write_text(listed + "\n")
    (base / "has_memory").write_text((listed if has_memory is None else has_memory) + "\n")
    for bus, (node, local) in (gpus or {}).items():
        dev = root / "bus" / "pci" / "devices" / bus
        dev.mkdir(parents=True, exist_ok=True)
        (dev / "numa_node").write_text(node + "\n")
        if local:
            (dev / "local_cpulist").write_text(local + "\n")
    return root


def allowed_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def gpu(index: int = 0, bus: str = "0000:17:00.0", name: str = "Fake GPU", sms: int = 132,
        link: str = "pcie-gen5-x16", platform: str = "cuda") -> DeviceInfo:
    return DeviceInfo(platform=platform, name=name, identity=f"{platform}-fake-{sms}sm-{link}", compute_units=sms,
                      index=index, arch="sm_90", link=link, pci_bus_id=bus, details={"torch_type": "cuda"})
