"""Calibration profiles on disk: versioned JSON keyed by device identity.

Lookup order for a device (first hit wins): the file named by ``KVSWAP_PROFILE``; the
user's data directory (``<user data dir>/kvswap/profiles/<identity>.json``); the profiles
shipped in ``kvswap/calibration/profiles/``. A profile that is malformed, of another
schema, or for another device is skipped with a :class:`kvswap.ProfileWarning` naming the
file.

A profile document (schema ``kvswap.profile/1``) holds: ``schema``, ``kvswap_version``,
``identity``, ``device`` (the full DeviceInfo), ``created``, ``measured`` (what was timed,
in words), ``settings``, ``ceiling_gbps``, ``measurements`` (raw timings), ``failures``,
``curves``, ``decisions`` (per direction: routes, ``kernel_sms``, ``kernel_min_batch``,
``min_batch_by_size``, ``kernel_sms_by_batch``, crossover), ``slowdown`` and ``interference``. :func:`to_calibration` is what the resolver
reads of it.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional

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


def default_path(device: DeviceInfo) -> Path:
    """Where ``kvswap calibrate`` writes the profile of ``device`` unless told otherwise."""
    return user_dir() / profile_name(device.identity)


class ProfileError(ValueError):
    """Why a profile file cannot be used (turned into a warning by :func:`find`)."""


def to_calibration(doc: dict[str, Any], source: str) -> Calibration:
    """Build the resolver's Calibration from a parsed profile document."""
    if not isinstance(doc, dict):
        raise ProfileError("not a JSON object")
    if doc.get("schema") != SCHEMA:
        raise ProfileError(f"schema is {doc.get('schema')!r}, this kvswap reads {SCHEMA!r}")
    try:
        identity, device = doc["identity"], doc["device"]
        if not isinstance(device, dict) or device.get("identity") != identity:
            raise ProfileError(
                f"identity {identity!r} does not match the device it describes "
                f"({device.get('identity') if isinstance(device, dict) else device!r})"
            )
        decisions = doc["decisions"]
        curves = tuple(
            Curve(c["impl"], c["direction"], tuple(map(tuple, c["points"])), c.get("num_sms"))
            for c in doc["curves"]
        )
        return Calibration(
            source=source,
            platform=device["platform"],
            scope="device",
            curves=curves,
            kernel_sms={d: v["kernel_sms"] for d, v in decisions.items() if v.get("kernel_sms")},
            kernel_min_batch={d: v["kernel_min_batch"] for d, v in decisions.items() if v.get("kernel_min_batch")},
            min_batch_by_size={d: v["min_batch_by_size"] for d, v in decisions.items() if v.get("min_batch_by_size")},
            kernel_sms_by_batch={
                d: v["kernel_sms_by_batch"] for d, v in decisions.items() if v.get("kernel_sms_by_batch")
            },
            slowdown=doc.get("slowdown", {}),
            ceiling_gbps=doc.get("ceiling_gbps", {}),
            identity=identity,
        )
    except ProfileError:
        raise
    except Exception as e:
        raise ProfileError(f"{type(e).__name__}: {e}") from e


def load(path: Path, device: Optional[DeviceInfo] = None) -> Calibration:
    """Read one profile; raise :class:`ProfileError` if unusable (or for another device)."""
    return to_calibration(read(path, device), source_of(path))


# The ``source`` of a calibration read from a profile file: what explain() shows, and what
# profile_path() reads the file back from.
SOURCE_PREFIX = "profile "


def source_of(path: Path) -> str:
    return f"{SOURCE_PREFIX}{path}"


def profile_path(source: str) -> Optional[Path]:
    """The file a calibration's ``source`` was read from (None: not a profile's)."""
    return Path(source.removeprefix(SOURCE_PREFIX)) if source.startswith(SOURCE_PREFIX) else None


def read(path: Path, device: Optional[DeviceInfo] = None) -> dict[str, Any]:
    """The checked document of one profile (what :func:`load` turns into a Calibration)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ProfileError(f"cannot be read as JSON: {e}") from e
    cal = to_calibration(doc, source_of(path))
    if device is not None and cal.identity != device.identity:
        raise ProfileError(f"is for device {cal.identity!r}, not {device.identity!r}")
    return doc


def is_shipped(source: str) -> bool:
    """Whether a calibration's ``source`` is a profile shipped with kvswap: measured on
    another machine of the device's kind, whose short transfers can favour other routes
    (docs/calibrating-a-device.md)."""
    path = profile_path(source)
    return path is not None and path.parent == SHIPPED


def candidates(device: DeviceInfo) -> list[Path]:
    """The files to try for ``device``, in lookup order."""
    out = []
    env = os.environ.get(PROFILE_ENV)
    if env:
        out.append(Path(env))
    try:
        out.append(user_dir() / profile_name(device.identity))
    except ImportError:  # installed with --no-deps somewhere without platformdirs
        warnings.warn("kvswap cannot search the user profile directory: platformdirs is not installed",
                      ProfileWarning, stacklevel=3)
    out.append(SHIPPED / profile_name(device.identity))
    return out


# While `kvswap calibrate` measures, it must bind kernels at exact SM counts and must not
# be steered by the profile it is about to replace; an override stands in for find().
_NO_PROFILE = object()
_overrides: list[Any] = []


@contextlib.contextmanager
def override(calibration: Optional[Calibration]) -> Iterator[None]:
    """Inside the block, :func:`find` answers ``calibration`` (None: no profile at all,
    so the resolver falls back to backend defaults) instead of reading files."""
    _overrides.append(_NO_PROFILE if calibration is None else calibration)
    try:
        yield
    finally:
        _overrides.pop()


def find(device: DeviceInfo) -> Optional[Calibration]:
    """The measured calibration for ``device``, or None; bad files are skipped with a warning."""
    if _overrides:
        top = _overrides[-1]
        if top is _NO_PROFILE:
            return None
        if top.identity in (None, device.identity):
            return top
    env = os.environ.get(PROFILE_ENV)
    for path in candidates(device):
        if not path.exists() and str(path) != env:
            continue
        try:
            return load(path, device)
        except ProfileError as e:
            warnings.warn(f"kvswap skipped calibration profile {path}: {e}", ProfileWarning, stacklevel=2)
    return None


def make_document(device: DeviceInfo, **fields: Any) -> dict[str, Any]:
    """A profile document for ``device``: schema, version, identity, device, time, then ``fields``."""
    from kvswap import __version__

    # DeviceInfo.details is free-form plugin data: keep what JSON can hold, as text otherwise.
    described = json.loads(json.dumps(device.to_dict(), default=str))
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "kvswap_version": __version__,
        "identity": device.identity,
        "device": described,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    doc.update(fields)
    return doc


_FLAT_LIST = re.compile(r"\[\s+([^\[\]{}\"]*?)\s+\]")


def dumps(doc: dict[str, Any]) -> str:
    """Indented JSON with lists of numbers (curve points) on one line each."""
    text = json.dumps(doc, indent=1, sort_keys=True, allow_nan=False)
    # JSON escapes newlines inside strings, so every raw newline here is layout.
    return _FLAT_LIST.sub(lambda m: "[" + re.sub(r"\s*\n\s*", " ", m.group(1)) + "]", text) + "\n"


def save(doc: dict[str, Any], path: Path) -> Path:
    """Write ``doc`` atomically (temporary file in the same folder, then rename)."""
    to_calibration(doc, str(path))  # refuse to write what could not be read back
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = dumps(doc)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # a profile is meant to be read and shared, unlike mkstemp's 0600
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path
