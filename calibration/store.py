"""Calibration profiles on disk: versioned JSON keyed by device identity.

Lookup order for a device (first hit wins): the file named by ``KVSWAP_PROFILE``; the
user's data directory (``<user data dir>/kvswap/profiles/<identity>.json``); the profiles
shipped in ``kvswap/calibration/profiles/``. A profile that is malformed, of another
schema, or for another device is skipped with a :class:`kvswap.ProfileWarning` naming the
file.
"""
from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Optional

from kvswap.errors import ProfileWarning
from kvswap.thresholds import Calibration, Curve
from kvswap.types import DeviceInfo

SCHEMA = "kvswap.profile/1"
PROFILE_ENV = "KVSWAP_PROFILE"
SHIPPED = Path(__file__).resolve().parent / "profiles"


def user_dir() -> Path:
    """Where ``kvswap calibrate`` writes profiles by default (platformdirs' user data dir)."""
    import platformdirs

    return Path(platformdirs.user_data_dir("kvswap", appauthor=False)) / "profiles"


def profile_name(identity: str) -> str:
    return f"{identity}.json"


class ProfileError(ValueError):
    """Why a profile file cannot be used (turned into a warning by :func:`find`)."""


def to_calibration(doc: dict[str, Any], source: str) -> Calibration:
    """Build the resolver's Calibration from a parsed profile document."""
    if not isinstance(doc, dict):
        raise ProfileError("not a JSON object")
    if doc.get("schema") != SCHEMA:
        raise ProfileError(f"schema is {doc.get('schema')!r}, this kvswap reads {SCHEMA!r}")
    try:
        decisions = doc["decisions"]
        curves = tuple(
            Curve(c["impl"], c["direction"], tuple(map(tuple, c["points"])), c.get("num_sms"))
            for c in doc["curves"]
        )
        return Calibration(
            source=source,
            platform=doc["device"]["platform"],
            scope="device",
            curves=curves,
            kernel_sms={d: v["kernel_sms"] for d, v in decisions.items() if v.get("kernel_sms")},
            kernel_min_batch={d: v["kernel_min_batch"] for d, v in decisions.items() if v.get("kernel_min_batch")},
            slowdown=doc.get("slowdown", {}),
            ceiling_gbps=doc.get("ceiling_gbps", {}),
            identity=doc["identity"],
        )
    except ProfileError:
        raise
    except Exception as e:
        raise ProfileError(f"{type(e).__name__}: {e}") from e


def load(path: Path, device: Optional[DeviceInfo] = None) -> Calibration:
    """Read one profile; raise :class:`ProfileError` if unusable (or for another device)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ProfileError(f"cannot be read as JSON: {e}") from e
    cal = to_calibration(doc, f"profile {path}")
    if device is not None and cal.identity != device.identity:
        raise ProfileError(f"is for device {cal.identity!r}, not {device.identity!r}")
    return cal


def candidates(device: DeviceInfo) -> list[Path]:
    """The files to try for ``device``, in lookup order."""
    out = []
    env = os.environ.get(PROFILE_ENV)
    if env:
        out.append(Path(env))
    out.append(user_dir() / profile_name(device.identity))
    out.append(SHIPPED / profile_name(device.identity))
    return out


def find(device: DeviceInfo) -> Optional[Calibration]:
    """The measured calibration for ``device``, or None; bad files are skipped with a warning."""
    env = os.environ.get(PROFILE_ENV)
    for path in candidates(device):
        if not path.exists() and str(path) != env:
            continue
        try:
            return load(path, device)
        except ProfileError as e:
            warnings.warn(f"kvswap skipped calibration profile {path}: {e}", ProfileWarning, stacklevel=2)
    return None


def save(doc: dict[str, Any], path: Path) -> Path:
    """Write ``doc`` atomically (temporary file in the same folder, then rename)."""
    to_calibration(doc, str(path))  # refuse to write what could not be read back
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path
