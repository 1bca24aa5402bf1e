"""kvswap's conformance kit: a pytest plugin that certifies one copy implementation.

Load it on request; it is never loaded into other projects' test runs::

    pytest -p kvswap.testing --kvswap-impl NAME [--kvswap-device DEVICE] [--kvswap-seed N]

The run collects only the kit's own suite (:mod:`kvswap.testing.conformance`), from any
directory and without the caller's test files (paths given with it are a usage error). A
name that no loaded plugin registers for the device's platform is a usage error (exit
status 4), and so is a run without ``--kvswap-impl``: both say which implementations are
registered for the device.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Optional

import pytest

from .target import KitUsageError, Target, find_target, registered_here

__all__ = ["SUITE", "Target", "get_target"]

SUITE = Path(__file__).resolve().parent / "conformance.py"
SUITE_MODULE = "kvswap.testing.conformance"
_TARGET = pytest.StashKey[Target]()

# The suite is imported by name (see KitModule), so pytest's import hook never sees it:
# ask for its asserts to be rewritten all the same.
pytest.register_assert_rewrite(SUITE_MODULE)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvswap", "kvswap conformance kit")
    group.addoption("--kvswap-impl", metavar="NAME", default=None,
                    help="certify the registered copy implementation NAME (runs only the kit's suite)")
    group.addoption("--kvswap-device", metavar="DEVICE", default=None,
                    help="device to certify it on: cpu, cuda:N, or a device a plugin recognises "
                    "(default: the current accelerator, else the CPU)")
    group.addoption("--kvswap-seed", metavar="N", type=int, default=None,
                    help="seed for the random data (default: fresh per test; failures print theirs)")


def pytest_configure(config: pytest.Config) -> None:
    name: Optional[str] = config.getoption("kvswap_impl")
    device: Optional[str] = config.getoption("kvswap_device")
    if not name:
        # Loaded on request (-p kvswap.testing), the kit certifies one implementation: run
        # without one, it would collect whatever lies in the current directory.
        raise pytest.UsageError(f"the kvswap conformance kit needs --kvswap-impl NAME: {registered_here(device)}")
    if config.args_source == pytest.Config.ArgsSource.ARGS:
        raise pytest.UsageError(f"--kvswap-impl runs the kit's own suite; drop the paths {config.args}")
    try:
        config.stash[_TARGET] = find_target(name, device)
    except KitUsageError as e:
        raise pytest.UsageError(str(e)) from None
    config.args[:] = [str(SUITE)]


def get_target(config: pytest.Config) -> Target:
    """The implementation and device this run certifies."""
    try:
        return config.stash[_TARGET]
    except KeyError:
        raise pytest.UsageError("the conformance suite runs through `pytest -p kvswap.testing --kvswap-impl NAME`") from None


def pytest_report_header(config: pytest.Config) -> Optional[str]:
    target = config.stash.get(_TARGET, None)
    return None if target is None else target.describe()


@pytest.hookimpl(tryfirst=True)
def pytest_collect_directory(path: Path, parent: pytest.Collector) -> Optional[pytest.Collector]:
    # The suite lives inside the kvswap package; a plain directory collector keeps pytest
    # from importing the package's __init__ files a second time under path-derived names.
    if _TARGET in parent.config.stash and path in SUITE.parents and (path / "__init__.py").exists():
        return pytest.Dir.from_parent(parent, path=path)
    return None


class KitModule(pytest.Module):
    """The suite, imported by its module name rather than from its path."""

    def _getobj(self) -> Any:
        return importlib.import_module(SUITE_MODULE)


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> Optional[pytest.Module]:
    if _TARGET in parent.config.stash and Path(module_path).resolve() == SUITE:
        # One node id wherever the package is installed (the path may lie outside rootdir).
        return KitModule.from_parent(parent, path=module_path, nodeid="kvswap/testing/conformance.py")
    return None
