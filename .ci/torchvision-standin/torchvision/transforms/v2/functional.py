"""Stand-in for ``torchvision.transforms.v2.functional``: every name is a callable that raises."""
from torchvision import missing


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return missing(f"torchvision.transforms.v2.functional.{name}")
