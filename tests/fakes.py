"""Throwaway plugins and distributions for tests (real entry points, no pip install), and a
host stand-in for a device stream.

A distribution is a ``<name>-<version>.dist-info`` folder (METADATA + entry_points.txt)
beside the plugin's module in a temporary directory; putting that directory on
``sys.path`` (or PYTHONPATH for a subprocess) makes ``importlib.metadata`` find it exactly
as it finds an installed package.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import numpy as np

from kvswap import hookimpl


# A plugin module that really copies (one memmove per descriptor) under ``<name>.copy``.
COPYING_PLUGIN = """
    import ctypes
    from kvswap import CopyImpl, hookimpl

    def _copy(src, dst, sizes, stream):
        for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
            ctypes.memmove(d, s, n)

    @hookimpl
    def kvswap_register_copy_impls(platform, register):
        if platform == "cpu":
            register(CopyImpl("{name}.copy", "batch", ("cpu",), ("h2d", "d2h"), lambda ctx: _copy))
"""


def make_distribution(root: Path, dist: str, plugins: dict[str, str], modules: dict[str, str], version: str = "1.0") -> Path:
    """Write a fake distribution ``dist`` under ``root`` and return ``root``.

    :param plugins: entry point name -> module name, in group ``kvswap.backends``.
    :param modules: module name -> source text.
    """
    root.mkdir(parents=True, exist_ok=True)
    for name, source in modules.items():
        (root / f"{name}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = ["[kvswap.backends]"] + [f"{ep} = {mod}" for ep, mod in plugins.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return root


def entry_points_from(root: Path) -> list[importlib.metadata.EntryPoint]:
    """The ``kvswap.backends`` entry points of the fake distributions under ``root``."""
    found = []
    for dist in importlib.metadata.distributions(path=[str(root)]):
        found.extend(ep for ep in dist.entry_points if ep.group == "kvswap.backends")
    return found


def forget_modules(*names: str) -> None:
    for name in names:
        sys.modules.pop(name, None)


def scattered(rng: np.random.Generator, pool_bytes: int, sizes: np.ndarray, slot: int) -> np.ndarray:
    """Offsets of ``len(sizes)`` non-overlapping blocks in a pool cut into ``slot``-byte slots,
    in random order, each placed at a random offset inside its slot."""
    n = len(sizes)
    slots = rng.choice(pool_bytes // slot, size=n, replace=False).astype(np.int64) * slot
    slack = slot - sizes
    return slots + (rng.integers(0, slack + 1) if n else 0)


def address(buf: np.ndarray) -> int:
    return int(buf.ctypes.data)


class DeferredStream:
    """A stand-in for a device stream on the host, with the completion protocol BlockMover
    uses: the route queues each batch (views of the mover's descriptor arrays, as a device
    reads them later), markers are queue positions, and a marker is done once the copies
    before it ran, which happens only when the test says. A buffer handed back to the pool
    too early would corrupt a queued job. Safe to enqueue from the mover's issuing thread."""

    stream = "deferred"

    def __init__(self) -> None:
        self.queue: list = []
        self.executed = 0
        self.lock = threading.Lock()

    def enqueue(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, stream: Any) -> None:
        assert stream == self.stream
        with self.lock:
            self.queue.append((src, dst, sizes))

    def run(self, count: int) -> None:
        from kvswap.registry.reference import host_copy

        with self.lock:
            for s, d, n in self.queue[self.executed:self.executed + count]:
                host_copy(s, d, n)
            self.executed = min(len(self.queue), self.executed + count)

    def check_after(self, after: Any) -> None:
        pass

    def order_after(self, after: Any) -> None:
        pass

    def device_guard(self) -> Any:
        return contextlib.nullcontext()

    def bind_thread(self) -> None:
        pass

    def mark(self) -> int:
        with self.lock:
            return len(self.queue)

    def done(self, marker: int) -> bool:
        return self.executed >= marker

    def wait(self, marker: int) -> None:
        self.run(marker - self.executed)

    def seconds(self, start: int, end: int) -> float:
        return 0.0

    def recycle(self, *markers: int) -> None:
        pass


class Offer:
    """A plugin offering the given impls (on the platforms each serves) and, optionally, one
    calibration."""

    def __init__(self, impls: Any, calibration: Any = None) -> None:
        self.impls, self.calibration = impls, calibration

    @hookimpl
    def kvswap_register_copy_impls(self, platform: str, register: Any) -> None:
        for impl in self.impls:
            if platform in impl.platforms:
                register(impl)

    @hookimpl
    def kvswap_register_calibrations(self, device: Any, register: Any) -> None:
        if self.calibration is not None:
            register(self.calibration)


def install_staged_on_cpu() -> None:
    """A fresh plugin host whose ``cpu`` platform offers ``triton.staged`` without its
    pinned-memory requirement: host tensors in tests are pageable, and Triton's interpreter
    copies synchronously. Needs ``TRITON_INTERPRET=1``."""
    import dataclasses

    from kvswap import hookimpl
    from kvswap.backends.triton_generic.staged import staged_impl
    from kvswap.registry.plugins import create_plugin_host, reset_plugin_host

    class Plugin:
        @hookimpl
        def kvswap_register_copy_impls(self, platform, register):
            if platform == "cpu":
                register(dataclasses.replace(staged_impl(), requires_pinned=False))

    reset_plugin_host(create_plugin_host(entry_points=[], env={}, extra=[("testplugin", Plugin())]))
