"""kvswap: move KV-cache blocks between pinned host memory and accelerator memory.

Engines call :func:`resolve` (or hold a ``BlockMover``); backends need only
``from kvswap import hookimpl``.
"""
from __future__ import annotations

import pluggy

PROJECT = "kvswap"
hookimpl = pluggy.HookimplMarker(PROJECT)
hookspec = pluggy.HookspecMarker(PROJECT)

__version__ = "0.1.0"

from .errors import (  # noqa: E402
    AllocationError,
    BackendError,
    BlockIdError,
    BlockLayoutError,
    ConfigurationError,
    DeviceNotFoundError,
    DriverError,
    EngineTransferError,
    ForkedProcessError,
    InvalidImplError,
    InvalidTransferError,
    KvSwapError,
    KvSwapWarning,
    MoverClosedError,
    PluginWarning,
    ProfileWarning,
    ResolutionError,
    TensorPlacementError,
    UnknownImplError,
    UnpinnedMemoryError,
)
from .addressing.descriptors import coalesce  # noqa: E402
from .registry.impl import BindContext, CopyImpl  # noqa: E402
from .registry.thresholds import Calibration, Curve  # noqa: E402
from .types import DeviceInfo, Direction, Policy  # noqa: E402
from .resolution.plan import Plan, Route  # noqa: E402
from .resolution.resolver import resolve  # noqa: E402
from .resolution.swapfn import SwapFn  # noqa: E402
from .mover.handler import BlockMover  # noqa: E402
from .mover.types import GroupLayout, KVGroup, TransferResult  # noqa: E402
from .memory.bounce import PageableMemoryWarning  # noqa: E402
from .memory.host_memory import host_empty  # noqa: E402
from .memory.block_major import HostCache, host_cache  # noqa: E402
from .memory.numa import NumaWarning  # noqa: E402

__all__ = [
    "AllocationError",
    "BackendError",
    "BindContext",
    "BlockIdError",
    "BlockLayoutError",
    "BlockMover",
    "Calibration",
    "ConfigurationError",
    "CopyImpl",
    "Curve",
    "DeviceInfo",
    "DeviceNotFoundError",
    "Direction",
    "DriverError",
    "EngineTransferError",
    "ForkedProcessError",
    "GroupLayout",
    "HostCache",
    "InvalidImplError",
    "InvalidTransferError",
    "KVGroup",
    "KvSwapError",
    "KvSwapWarning",
    "MoverClosedError",
    "NumaWarning",
    "PageableMemoryWarning",
    "Plan",
    "PluginWarning",
    "Policy",
    "ProfileWarning",
    "ResolutionError",
    "Route",
    "SwapFn",
    "TensorPlacementError",
    "TransferResult",
    "UnknownImplError",
    "UnpinnedMemoryError",
    "coalesce",
    "hookimpl",
    "host_cache",
    "host_empty",
    "resolve",
]
