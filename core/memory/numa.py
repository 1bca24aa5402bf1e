"""NUMA topology from sysfs, and which node host memory sits on.

Where a GPU hangs off the host (the node of its PCIe root port, with the CPUs near it)
comes from sysfs: ``bus/pci/devices/<bus id>/numa_node`` and ``local_cpulist``, and
``devices/system/node/nodeN/cpulist``. The root is injectable (:class:`Topology`), so
tests describe a machine with a temporary tree.

Which node a page of host memory sits on comes from ``move_pages(2)`` with no target
nodes: a pure query that moves nothing and, unlike ``get_mempolicy(MPOL_F_NODE |
MPOL_F_ADDR)``, never faults a page in to answer. It goes through libnuma's
``numa_move_pages`` when libnuma is loadable, else the raw system call; where neither
works (another architecture, a seccomp filter) the answer is "unknown", never a guess.
"""
from __future__ import annotations

import ctypes
import os
import platform
import re
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from ..errors import KvSwapWarning
from ..types import DeviceInfo

SYSFS_ROOT = Path("/sys")
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# Pages of one buffer :func:`page_nodes` asks about: spread evenly, enough to see a buffer
# split between nodes, few enough that a mover over 64 layers asks in well under a millisecond.
SAMPLE_PAGES = 64
# move_pages(2) by architecture, for when libnuma is not installed (asm/unistd.h).
_MOVE_PAGES_SYSCALL = {"x86_64": 279, "aarch64": 239}
_BUS = re.compile(r"^(?:([0-9a-f]+):)?([0-9a-f]{2}):([0-9a-f]{2})(?:\.([0-7]))?$")


class NumaWarning(KvSwapWarning):
    """Host memory that is, or may be, on another NUMA node than the device it feeds."""


def parse_cpulist(text: str) -> tuple[int, ...]:
    """CPUs of a sysfs cpulist such as ``"0-15,32-47"`` (also ``"0-31:2/4"``, strides of
    the kernel's list syntax), sorted; ``""`` is no CPU.

    :raises ValueError: text that is not a cpulist (the message quotes it).
    """
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+)(?::(\d+)/(\d+))?)?", part)
        if not m or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise ValueError(f"{text!r} is not a cpulist (e.g. '0-15,32-47'): bad part {part!r}")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        used, group = (int(m.group(3)), int(m.group(4))) if m.group(3) else (1, 1)
        if not 0 < used <= group:
            raise ValueError(f"{text!r} is not a cpulist: bad stride in {part!r}")
        cpus.update(c for c in range(lo, hi + 1) if (c - lo) % group < used)
    return tuple(sorted(cpus))


def format_cpulist(cpus: Iterable[int]) -> str:
    """The compact cpulist of ``cpus`` (``"0-15,32-47"``); ``""`` for none."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(set(cpus)):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def pci_address(bus_id: str) -> Optional[str]:
    """A PCI address as sysfs spells it (``0000:17:00.0``), from what drivers and torch
    report (``00000000:17:00.0``, ``17:00.0``, ``0000:17:00``); None if it is none."""
    m = _BUS.match((bus_id or "").strip().lower())
    if not m:
        return None
    domain, bus, dev, fn = m.groups()
    return f"{int(domain or '0', 16):04x}:{bus}:{dev}.{fn or '0'}"


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


@dataclass(frozen=True)
class Topology:
    """The NUMA layout sysfs describes under ``root`` (``/sys`` on a real machine)."""

    root: Path = SYSFS_ROOT

    @property
    def _nodes_dir(self) -> Path:
        return Path(self.root) / "devices" / "system" / "node"

    def nodes(self) -> tuple[int, ...]:
        """Online nodes (``node/online``, else the ``nodeN`` folders); () where sysfs has none."""
        text = _read(self._nodes_dir / "online")
        if text is not None:
            try:
                return parse_cpulist(text)
            except ValueError:
                pass
        try:
            found = [int(p.name[4:]) for p in self._nodes_dir.iterdir() if re.fullmatch(r"node\d+", p.name)]
        except OSError:
            return ()
        return tuple(sorted(found))

    def memory_nodes(self) -> tuple[int, ...]:
        """Nodes that hold memory (``node/has_memory``, else every online node)."""
        text = _read(self._nodes_dir / "has_memory")
        try:
            return parse_cpulist(text) if text is not None else self.nodes()
        except ValueError:
            return self.nodes()

    def node_cpus(self, node: int) -> tuple[int, ...]:
        """The CPUs of ``node`` (``nodeN/cpulist``); () for a node without CPUs or unknown."""
        text = _read(self._nodes_dir / f"node{int(node)}" / "cpulist")
        try:
            return parse_cpulist(text) if text else ()
        except ValueError:
            return ()

    def distances(self, node: int) -> dict[int, int]:
        """Distance from ``node`` to each online node (``nodeN/distance``, in the order of
        :meth:`nodes`); {} where sysfs does not say."""
        text = _read(self._nodes_dir / f"node{int(node)}" / "distance")
        try:
            values = [int(v) for v in text.split()] if text else []
        except ValueError:
            return {}
        nodes = self.nodes()
        return dict(zip(nodes, values)) if len(values) == len(nodes) else {}

    def pci_node(self, bus_id: str) -> Optional[int]:
        """The node of a PCI device, or None: unknown address, no sysfs entry, or ``-1``
        (the firmware does not say; usual on a machine of one node)."""
        addr = pci_address(bus_id)
        text = _read(Path(self.root) / "bus" / "pci" / "devices" / addr / "numa_node") if addr else None
        try:
            node = int(text) if text is not None else -1
        except ValueError:
            return None
        return node if node >= 0 else None

    def pci_local_cpus(self, bus_id: str) -> tuple[int, ...]:
        """The CPUs near a PCI device (``local_cpulist``); () when sysfs does not say."""
        addr = pci_address(bus_id)
        text = _read(Path(self.root) / "bus" / "pci" / "devices" / addr / "local_cpulist") if addr else None
        try:
            return parse_cpulist(text) if text else ()
        except ValueError:
            return ()

    def device_node(self, device: DeviceInfo) -> Optional[int]:
        """The node ``device`` hangs off, or None (no PCI address, or sysfs does not say)."""
        if device.platform == "cpu" or device.pci_bus_id in ("", "unknown"):
            return None
        return self.pci_node(device.pci_bus_id)

    def near_cpus(self, device: DeviceInfo) -> tuple[int, ...]:
        """The host CPUs near ``device``: its ``local_cpulist``, else its node's CPUs."""
        if device.platform == "cpu" or device.pci_bus_id in ("", "unknown"):
            return ()
        local = self.pci_local_cpus(device.pci_bus_id)
        if local:
            return local
        node = self.device_node(device)
        return self.node_cpus(node) if node is not None else ()

    def placement_target(self, device: DeviceInfo) -> tuple[Optional[int], str]:
        """``(node, "")`` to place memory for ``device`` on, or ``(None, why not)``.

        On a machine whose memory is all on one node there is nothing to place: that is
        ``(None, "")``, no reason to tell anyone.
        """
        if device.platform == "cpu":
            return None, f"device {device.torch_device} is the host itself: no device node to place memory on"
        if len(self.memory_nodes()) == 1:
            return None, ""
        if device.pci_bus_id in ("", "unknown"):
            return None, f"device {device.torch_device} ({device.name}) has no known PCI address"
        node = self.pci_node(device.pci_bus_id)
        if node is None:
            return None, (f"sysfs gives no NUMA node for {device.torch_device} ({device.name}, PCI "
                          f"{device.pci_bus_id}): numa_node is -1 or missing")
        return node, ""


def topology() -> Topology:
    """This machine's topology (``SYSFS_ROOT``, replaced by tests)."""
    return Topology(SYSFS_ROOT)


def device_row(device: DeviceInfo, topo: Optional[Topology] = None) -> dict[str, Any]:
    """What ``kvswap info`` lists for one GPU: link, NUMA node, the host CPUs near it."""
    topo = topology() if topo is None else topo
    node = topo.device_node(device)
    return {
        "device": device.torch_device,
        "name": device.name,
        "identity": device.identity,
        "link": device.link,
        "pci_bus_id": device.pci_bus_id,
        "numa_node": node,
        "near_cpus": format_cpulist(topo.near_cpus(device)),
    }


# -- which node host memory sits on ---------------------------------------------------

@dataclass(frozen=True)
class PagePlacement:
    """Where the sampled pages of a buffer sit.

    :ivar nodes: node -> pages sampled there.
    :ivar missing: sampled pages not in memory yet (never touched) or not queryable.
    """

    nodes: dict[int, int] = field(default_factory=dict)
    missing: int = 0

    @property
    def sampled(self) -> int:
        return sum(self.nodes.values()) + self.missing

    def off(self, node: int) -> dict[int, int]:
        """Pages on nodes other than ``node``."""
        return {n: k for n, k in self.nodes.items() if n != node}

    def describe(self) -> str:
        where = ", ".join(f"{k} on node {n}" for n, k in sorted(self.nodes.items())) or "none resident"
        return f"{self.sampled} pages sampled: {where}" + (f", {self.missing} not resident" if self.missing else "")


@lru_cache(maxsize=1)
def _move_pages() -> Optional[Any]:
    """``call(count, pages, status) -> (rc, errno)`` querying move_pages(2), or None."""
    for name in ("libnuma.so.1", "libnuma.so"):
        try:
            lib = ctypes.CDLL(name, use_errno=True)
            fn = lib.numa_move_pages
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        return lambda n, pages, status: (fn(0, n, pages, None, status, 0), ctypes.get_errno())
    number = _MOVE_PAGES_SYSCALL.get(platform.machine())
    if number is None:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        sc = libc.syscall
    except (OSError, AttributeError):
        return None
    sc.restype = ctypes.c_long
    return lambda n, pages, status: (
        sc(ctypes.c_long(number), ctypes.c_long(0), ctypes.c_ulong(n), pages, None, status, ctypes.c_int(0)),
        ctypes.get_errno(),
    )


def page_nodes(addr: int, nbytes: int, sample: int = SAMPLE_PAGES) -> Optional[PagePlacement]:
    """Where up to ``sample`` pages spread evenly over ``[addr, addr + nbytes)`` sit, or None
    when this machine cannot say (no move_pages here, or the call is refused)."""
    if nbytes <= 0 or addr <= 0:
        return PagePlacement()
    call = _move_pages()
    if call is None:
        return None
    first, last = addr // PAGE, (addr + nbytes - 1) // PAGE
    count = last - first + 1
    k = max(1, min(sample, count))
    if k == 1:
        picks = [first]
    else:
        picks = sorted({first + (i * (count - 1)) // (k - 1) for i in range(k)})
    pages = (ctypes.c_void_p * len(picks))(*[p * PAGE for p in picks])
    status = (ctypes.c_int * len(picks))()
    rc, _ = call(len(picks), pages, status)
    if rc < 0:  # ENOSYS, EPERM (a seccomp filter), ...: unknown, not a guess
        return None
    nodes: Counter[int] = Counter()
    missing = 0
    for s in status:
        if s >= 0:
            nodes[s] += 1
        else:
            missing += 1
    return PagePlacement(dict(nodes), missing)


def tensor_nodes(tensor: Any, sample: int = SAMPLE_PAGES) -> Optional[PagePlacement]:
    """:func:`page_nodes` of a host tensor's bytes (None where unknown or not on the host)."""
    if getattr(getattr(tensor, "device", None), "type", "cpu") != "cpu":
        return None
    nbytes = tensor.numel() * tensor.element_size()
    return page_nodes(int(tensor.data_ptr()), nbytes, sample)


@dataclass(frozen=True)
class RemoteMemory:
    """A host tensor with pages on another node than the device it is copied to or from.

    :ivar index: its position in the list :func:`remote_host_memory` was given.
    :ivar device_node: the device's node.
    :ivar placement: where its sampled pages sit.
    """

    index: int
    device_node: int
    placement: PagePlacement

    @property
    def remote_share(self) -> float:
        resident = sum(self.placement.nodes.values())
        return sum(self.placement.off(self.device_node).values()) / resident if resident else 0.0

    def describe(self) -> str:
        return (f"host tensor {self.index}: {self.remote_share:.0%} of its resident pages are off node "
                f"{self.device_node} ({self.placement.describe()})")


def remote_host_memory(tensors: Sequence[Any], device_info: DeviceInfo,
                       topo: Optional[Topology] = None) -> list[RemoteMemory]:
    """The host tensors among ``tensors`` with sampled pages on another node than
    ``device_info``'s; [] where the device's node or the pages' nodes are unknown (one
    node, no sysfs entry, no move_pages), which is never reported as remote."""
    topo = topology() if topo is None else topo
    node = topo.device_node(device_info)
    if node is None:
        return []
    out = []
    for i, t in enumerate(tensors):
        placed = tensor_nodes(t)
        if placed is not None and placed.off(node):
            out.append(RemoteMemory(i, node, placed))
    return out


def remote_note(remote: Sequence[RemoteMemory], device_info: DeviceInfo, total: int) -> Optional[str]:
    """One line for :func:`remote_host_memory`'s findings (None when there are none): what
    ``explain()`` shows and a mover warns with."""
    if not remote:
        return None
    worst = max(remote, key=lambda r: r.remote_share)
    nodes = sorted({n for r in remote for n in r.placement.off(r.device_node)})
    return (f"{len(remote)} of {total} host tensor(s) have pages on NUMA node(s) {', '.join(map(str, nodes))}, "
            f"while {device_info.torch_device} ({device_info.name}) is on node {worst.device_node}: copies cross "
            f"the inter-socket link, which can cost a large share of the PCIe bandwidth (worst: {worst.describe()}); "
            f"allocate them with kvswap.host_empty(..., device={device_info.torch_device!r})")


def host_memory_note(tensors: Sequence[Any], device_info: DeviceInfo, topo: Optional[Topology] = None) -> Optional[str]:
    """:func:`remote_note` of :func:`remote_host_memory`: what a mover holding ``tensors``
    on the host side for ``device_info`` warns with and shows in ``explain()``, or None."""
    return remote_note(remote_host_memory(tensors, device_info, topo), device_info, len(tensors))


def accelerator_count() -> int:
    """GPUs torch sees in this process (CUDA or ROCm), 0 without any."""
    from ..registry.platform import torch_platform

    if torch_platform() == "cpu":
        return 0
    import torch

    return int(torch.cuda.device_count())


def gpu_rows(host: Any, count: Optional[int] = None, topo: Optional[Topology] = None) -> list[dict[str, Any]]:
    """:func:`device_row` of every GPU torch sees (``cuda:0`` .. ``cuda:count-1``), each
    described by the plugins as a resolve would; a GPU that cannot be described says why."""
    from ..errors import KvSwapError
    from ..registry.platform import detect

    count = accelerator_count() if count is None else count
    rows = []
    for i in range(count):
        try:
            rows.append(device_row(detect(host, f"cuda:{i}"), topo))
        except KvSwapError as e:
            rows.append({"device": f"cuda:{i}", "error": str(e)})
    return rows


def format_gpu_rows(rows: Sequence[dict[str, Any]]) -> list[str]:
    """``kvswap info``'s lines for :func:`gpu_rows`."""
    if not rows:
        return ["gpus: none seen by torch"]
    lines = ["gpus:"]
    for r in rows:
        if "error" in r:
            lines.append(f"  {r['device']:<7} not described: {r['error']}")
            continue
        node = "unknown" if r["numa_node"] is None else str(r["numa_node"])
        lines.append(f"  {r['device']:<7} {r['name']} (link {r['link']}, PCI {r['pci_bus_id']}, NUMA node {node}, "
                     f"near CPUs {r['near_cpus'] or 'unknown'})")
    return lines
