"""The CUDA :class:`~kvswap.DeviceInfo`: what kvswap knows of an NVIDIA GPU.

The identity key is made of what decides copy performance and stays the same across runs,
processes and machines of the same kind: the GPU model, its architecture, its SM count and
the PCIe link it can train to. It never holds the bus id (that names a slot, not a kind
of machine) nor the link's *current* speed, which drops while the GPU idles.
"""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

from kvswap.errors import KvSwapError
from kvswap.types import DeviceInfo, slug

from . import driver as drv

SYSFS_PCI = Path("/sys/bus/pci/devices")
NVIDIA_PROC_VERSION = Path("/proc/driver/nvidia/version")
_SPEC = re.compile(r"^cuda(?::(\d+))?$")
_BUS = re.compile(r"^([0-9a-fA-F]+):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")
# Transfer rate per lane (GT/s) -> PCIe generation.
_GEN_BY_RATE = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6, 128.0: 7}


def parse_spec(spec: Optional[str]) -> tuple[bool, Optional[int]]:
    """``(is a CUDA device spec, index or None for the current device)``."""
    if spec is None:
        return True, None
    m = _SPEC.match(spec)
    if not m:
        return False, None
    return True, None if m.group(1) is None else int(m.group(1))


def torch_reason() -> Optional[str]:
    """None when torch drives a CUDA GPU in this process, else why not."""
    try:
        import torch
    except ImportError as e:
        return f"torch cannot be imported: {e}"
    if getattr(torch.version, "hip", None):
        return f"torch {torch.__version__} is a ROCm build (HIP {torch.version.hip}), not CUDA"
    if not getattr(torch.version, "cuda", None):
        return f"torch {torch.__version__} is built without CUDA"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return None


def normalize_bus_id(text: str) -> str:
    """``"00000000:19:00.0"`` -> ``"0000:19:00.0"`` (sysfs spelling, lower case)."""
    m = _BUS.match(text.strip())
    if not m:
        return "unknown"
    domain, bus, dev, fn = m.groups()
    return f"{int(domain, 16):04x}:{bus.lower()}:{dev.lower()}.{fn}"


def link_generation(speed: str) -> Optional[int]:
    """PCIe generation from a sysfs link speed such as ``"32.0 GT/s PCIe"``."""
    m = re.match(r"^\s*([0-9.]+)\s*GT/s", speed or "")
    return _GEN_BY_RATE.get(float(m.group(1))) if m else None


def link_text(gen: Optional[int], width: Optional[int]) -> str:
    return f"pcie-gen{gen}-x{width}" if gen and width else "unknown"


def device_identity(name: str, arch: str, sms: int, link: str) -> str:
    return slug(f"cuda-{name}-{arch}-{sms}sm-{link}")


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _width(text: Optional[str]) -> Optional[int]:
    try:
        value = int(text) if text is not None else 0
    except ValueError:
        return None
    return value or None


def sysfs_link(bus_id: str, root: Optional[Path] = None) -> tuple[Optional[int], Optional[int], dict[str, Any]]:
    """``(generation, width, details)`` the GPU's link can train to, from sysfs.

    The link is the lesser of what the GPU and its upstream port support (a Gen5 GPU in
    a Gen4 slot runs Gen4); where the maxima are unreadable the current values stand in.
    """
    dev = (SYSFS_PCI if root is None else root) / bus_id
    if not dev.exists():
        return None, None, {}
    cur_gen = link_generation(_read(dev / "current_link_speed") or "")
    cur_width = _width(_read(dev / "current_link_width"))
    gens = [link_generation(_read(d / "max_link_speed") or "") for d in (dev, dev.resolve().parent)]
    widths = [_width(_read(d / "max_link_width")) for d in (dev, dev.resolve().parent)]
    gens, widths = [g for g in gens if g], [w for w in widths if w]
    gen = min(gens) if gens else cur_gen
    width = min(widths) if widths else cur_width
    return gen, width, {"link_current": link_text(cur_gen, cur_width)}


def nvml_info(bus_id: str) -> dict[str, Any]:
    """Driver version and link maxima from NVML (``pynvml``), or {} when it is absent."""
    try:
        import pynvml
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
    except Exception:
        return {}
    out: dict[str, Any] = {}
    try:
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
            out["driver"] = version.decode() if isinstance(version, bytes) else str(version)
        except Exception:
            pass
        try:
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
        except Exception:
            return out
        for key, fn in (
            ("max_gen", "nvmlDeviceGetMaxPcieLinkGeneration"),
            ("max_width", "nvmlDeviceGetMaxPcieLinkWidth"),
            ("cur_gen", "nvmlDeviceGetCurrPcieLinkGeneration"),
            ("cur_width", "nvmlDeviceGetCurrPcieLinkWidth"),
        ):
            try:
                out[key] = int(getattr(pynvml, fn)(handle))
            except Exception:
                pass
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return out


def _kernel_module_version() -> Optional[str]:
    m = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]+)", _read(NVIDIA_PROC_VERSION) or "")
    return m.group(1) if m else None


def describe(spec: Optional[str]) -> Optional[DeviceInfo]:
    """The DeviceInfo for ``spec`` (None, ``"cuda"``, ``"cuda:N"``), or None when the
    device is not a CUDA GPU this process can see (core then explains what is wrong)."""
    claims, index = parse_spec(spec)
    if not claims or torch_reason() is not None:
        return None
    import torch

    if index is None:
        index = torch.cuda.current_device()
    if not 0 <= index < torch.cuda.device_count():
        return None
    return _describe(index)


@lru_cache(maxsize=None)
def _describe(index: int) -> DeviceInfo:
    import torch

    p = torch.cuda.get_device_properties(index)
    arch = f"sm_{p.major}{p.minor}"
    sms = int(p.multi_processor_count)
    details: dict[str, Any] = {"torch_type": "cuda", "source": "kvswap.backends.cuda",
                               "total_memory": int(p.total_memory)}
    bus, cuda_version = "unknown", None
    try:
        d = drv.get()
        cuda_version = d.version
        details["cuda_driver_api"] = d.version
        bus = normalize_bus_id(d.pci_bus_id(index))
    except KvSwapError as e:
        details["driver_problem"] = str(e)
    if bus == "unknown" and hasattr(p, "pci_bus_id"):
        bus = f"{getattr(p, 'pci_domain_id', 0):04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
    gen = width = None
    nv = nvml_info(bus) if bus != "unknown" else {}
    if nv.get("max_gen") and nv.get("max_width"):
        gen, width = nv["max_gen"], nv["max_width"]
        details.update(link_source="nvml", link_current=link_text(nv.get("cur_gen"), nv.get("cur_width")))
    elif bus != "unknown":
        gen, width, extra = sysfs_link(bus)
        details.update(extra, link_source="sysfs" if gen and width else "none")
    release = nv.get("driver") or _kernel_module_version()
    api = f"CUDA {drv.version_text(cuda_version)}" if cuda_version else None
    driver_version = " / ".join(v for v in (release, api) if v) or "unknown"
    link = link_text(gen, width)
    return DeviceInfo(
        platform="cuda",
        name=p.name,
        identity=device_identity(p.name, arch, sms, link),
        compute_units=sms,
        index=index,
        arch=arch,
        driver_version=driver_version,
        runtime_version=str(torch.version.cuda),
        link=link,
        pci_bus_id=bus,
        details=details,
    )
