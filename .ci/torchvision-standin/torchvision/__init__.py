"""An import-only stand-in for torchvision (kvswap's SGLang CI venv): names resolve, calls raise."""
from __future__ import annotations

from typing import Any, NoReturn

__version__ = "0.0.0"


def missing(qualname: str) -> Any:
    """A stand-in for ``qualname`` that raises when it is called."""

    def call(*args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(f"{qualname} is not available: this torchvision is an import-only stand-in "
                           f"(kvswap's SGLang CI venv); install real torchvision to use it")

    call.__qualname__ = call.__name__ = qualname
    return call


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return missing(f"torchvision.{name}")
