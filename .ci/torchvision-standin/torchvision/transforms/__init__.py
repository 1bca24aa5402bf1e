"""Stand-in for ``torchvision.transforms``: the ``InterpolationMode`` names modules import, and
callables that raise for everything else."""
import enum

from torchvision import missing

from . import functional  # noqa: F401  (``from torchvision.transforms import functional``)


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return missing(f"torchvision.transforms.{name}")
