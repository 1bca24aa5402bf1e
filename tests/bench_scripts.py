"""A script of ``tests/bench/`` imported as a module, for the tests that run its functions."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent / "bench"


def load_bench(relative: str, name: str) -> ModuleType:
    """``tests/bench/<relative>`` imported afresh as ``name``, registered in ``sys.modules``
    (the dataclasses of a script look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / relative)
    assert spec is not None and spec.loader is not None, f"no script at {BENCH / relative}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
