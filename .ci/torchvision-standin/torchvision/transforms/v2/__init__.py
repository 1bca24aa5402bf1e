"""Stand-in for ``torchvision.transforms.v2``: every name is a callable that raises."""
from torchvision import missing

from . import functional  # noqa: F401


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return missing(f"torchvision.transforms.v2.{name}")
