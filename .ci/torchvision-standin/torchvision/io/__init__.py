"""Stand-in for ``torchvision.io``: every name is a callable that raises."""
from torchvision import missing


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return missing(f"torchvision.io.{name}")
