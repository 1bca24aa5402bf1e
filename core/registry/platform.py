"""Which platform and device a resolve is for: ``cpu`` here, others through torch or a hook."""
from __future__ import annotations

import os
import platform as _platform
import re
from functools import lru_cache
from typing import Any, Optional

from ..errors import ConfigurationError, DeviceNotFoundError
from ..types import DeviceInfo, slug
from .plugins import PluginHost

_SPEC = re.compile(r"^([a-z_]+)(?::(\d+))?$")


def device_spec(device: Any) -> Optional[str]:
    """Normalise what a caller passes as ``device`` (None, ``"cuda:1"``, torch.device, int)."""
    if device is None:
        return None
    if isinstance(device, bool):
        raise ConfigurationError(f"device={device!r} is not a device")
    if isinstance(device, int):
        if device < 0:
            raise ConfigurationError(f"device={device!r} must be >= 0")
        return f"cuda:{device}"
    text = str(device).strip().lower()
    if not _SPEC.match(text):
        raise ConfigurationError(
            f"device={device!r} is not valid; use 'cpu', 'cuda', 'cuda:N' or another 'type:N'"
        )
    return text


def torch_platform() -> str:
    """``cuda``, ``rocm`` or ``cpu``, as the installed torch sees this machine."""
    import torch

    if torch.cuda.is_available():
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return "cpu"


@lru_cache(maxsize=1)
def cpu_device() -> DeviceInfo:
    model = _platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    machine = _platform.machine() or "unknown"
    name = model or machine
    return DeviceInfo(
        platform="cpu",
        name=name,
        identity=slug(f"cpu-{machine}-{name}"),
        compute_units=os.cpu_count() or 1,
        arch=machine,
        runtime_version=_platform.python_version(),
        details={"torch_type": "cpu"},
    )


def torch_device(spec: Optional[str]) -> DeviceInfo:
    """A plain description of a CUDA or ROCm device through torch alone."""
    import torch

    m = _SPEC.match(spec) if spec is not None else None
    if m and m.group(1) != "cuda":
        raise ConfigurationError(
            f"device={spec!r} is not recognised: no plugin claims {m.group(1)!r} devices; "
            "use 'cpu', 'cuda', 'cuda:N' or a device an installed backend announces"
        )
    kind = torch_platform()
    if kind == "cpu":
        raise DeviceNotFoundError(f"device={spec!r}: torch sees no CUDA or ROCm device here")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device()
    if spec is not None:
        m = _SPEC.match(spec)
        if m.group(2) is not None:
            index = int(m.group(2))
    if not 0 <= index < count:
        raise DeviceNotFoundError(f"device={spec!r}: torch sees {count} device(s), 0..{count - 1}")
    p = torch.cuda.get_device_properties(index)
    arch = getattr(p, "gcnArchName", "") if kind == "rocm" else f"sm_{p.major}{p.minor}"
    runtime = getattr(torch.version, "hip" if kind == "rocm" else "cuda", None) or "unknown"
    return DeviceInfo(
        platform=kind,
        name=p.name,
        identity=slug(f"{kind}-{p.name}-{arch}-{p.multi_processor_count}cu"),
        compute_units=p.multi_processor_count,
        index=index,
        arch=arch or "unknown",
        runtime_version=str(runtime),
        details={"torch_type": "cuda", "source": "torch"},
    )


def detect(host: PluginHost, device: Any = None) -> DeviceInfo:
    """Describe the device to resolve for.

    ``cpu`` is core's; otherwise the plugins' ``kvswap_detect_platform`` answers first
    (where several claim the device, the one whose platform torch agrees with wins, then
    the first by plugin name, with a warning); failing that, torch's plain description,
    or the CPU when there is no accelerator and none was asked for.
    """
    spec = device_spec(device)
    if spec == "cpu":
        return cpu_device()
    claims: list[tuple[str, DeviceInfo]] = []
    for name, info in host.call_each("kvswap_detect_platform", device=spec):
        if info is None:
            continue
        if not isinstance(info, DeviceInfo):
            host.drop(name, f"kvswap_detect_platform returned {info!r}, not a DeviceInfo or None")
            continue
        claims.append((name, info))
    if claims:
        if len(claims) > 1:
            native = torch_platform()
            claims.sort(key=lambda c: (c[1].platform != native, c[0]))
            host.warn(
                claims[1][0],
                f"also claimed device {spec or 'default'}; kvswap uses {claims[0][0]!r}'s description",
            )
        return claims[0][1]
    if spec is None and torch_platform() == "cpu":
        return cpu_device()
    return torch_device(spec)
