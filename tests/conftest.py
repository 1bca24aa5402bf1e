"""Shared test set-up: GPU gating, the Triton interpreter on CPU, fresh plugin hosts."""
from __future__ import annotations

import os
from collections import Counter
from typing import Any, Iterable

import pytest


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


HAS_GPU = _has_gpu()

# Without a GPU, Triton kernels run in its interpreter on host memory: the real kernel
# logic, on raw host addresses. Set before any test module imports triton.
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a GPU (CUDA or ROCm); run `pytest -m gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_plugin_host(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory):
    """Each test starts from a freshly loaded plugin host and an empty user profile dir."""
    from kvswap.registry import plugins

    home = tmp_path_factory.mktemp("xdg")
    monkeypatch.setenv("XDG_DATA_HOME", str(home))
    for var in ("KVSWAP_PLUGINS", "KVSWAP_DISABLE_PLUGINS", "KVSWAP_FORCE_IMPL", "KVSWAP_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    plugins.reset_plugin_host()
    yield
    plugins.reset_plugin_host()


def skip_counts(reports: Iterable[Any]) -> list[tuple[int, str]]:
    """``(count, reason)`` of the skipped tests, most first: one line per reason."""
    reasons = Counter()
    for r in reports:
        reason = r.longrepr[2] if isinstance(r.longrepr, tuple) else str(r.longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    return sorted(((n, why) for why, n in reasons.items()), key=lambda t: (-t[0], t[1]))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    counts = skip_counts(terminalreporter.stats.get("skipped", []))
    if counts:
        terminalreporter.section("skipped, by reason", sep="-")
        for n, why in counts:
            terminalreporter.line(f"{n:5d}  {why}")
