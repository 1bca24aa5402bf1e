"""Measured calibration profiles: finding and reading them (writing is ``kvswap calibrate``'s).

A profile is a versioned JSON document keyed by device identity. The lookup order for a
device (first usable file wins): the file named by ``KVSWAP_PROFILE``; the user's data
directory (``<user data dir>/kvswap/profiles/<identity>.json``); the profiles shipped with
kvswap (``kvswap/calibration/profiles/``). A file that is missing (when named by
``KVSWAP_PROFILE``), unreadable (its folder included), not a regular file, malformed, too
deeply nested, holding a non-finite number, of another schema or for another device is
skipped with a :class:`kvswap.ProfileWarning` naming it.

A profile document (schema ``kvswap.profile/1``) holds ``schema``, ``kvswap_version``,
``identity``, ``device`` (the full DeviceInfo), ``created``, ``measured``, ``settings``,
``ceiling_gbps``, ``measurements``, ``failures``, ``curves``, ``decisions`` (per direction:
``routes``, ``kernel_sms``, ``kernel_min_batch``, ``min_batch_by_size``,
``kernel_sms_by_batch``, ``crossover``), ``slowdown`` (profiles written before
``slowdown_by_sms``; read where that has no rows), ``slowdown_by_sms`` (per direction,
``[route, num_sms, fraction]`` rows) and ``host_cost`` (per direction and route,
``[a_us, b_us]``: one call holds the calling thread ``a_us + b_us * n`` microseconds for
``n`` descriptors), and, where the staged route was measured, ``staged`` (its ``curves``,
GB/s by chunk size on a block-major host cache, read among the calibration's curves;
profiles without it decide the staged route by rule). :func:`to_calibration` is what the
resolver reads of it; a
``host_cost`` entry that is not two finite numbers >= 0 is skipped with a
:class:`kvswap.ProfileWarning`, the rest of the profile still used.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import stat
import warnings
from pathlib import Path
from typing import Any, Optional

from ..errors import ConfigurationError, ProfileWarning
from ..registry.thresholds import Calibration, Curve, host_cost_row
from ..types import DeviceInfo

__all__ = [
    "PROFILE_ENV",
    "SCHEMA",
    "SOURCE_PREFIX",
    "ProfileError",
    "candidates",
    "default_path",
    "find",
    "is_shipped",
    "load",
    "profile_name",
    "profile_path",
    "read",
    "shipped_dir",
    "source_of",
    "to_calibration",
    "user_dir",
]

SCHEMA = "kvswap.profile/1"
PROFILE_ENV = "KVSWAP_PROFILE"
# The ``source`` of a calibration read from a profile file: what explain() shows, and what
# :func:`profile_path` reads the file back from.
SOURCE_PREFIX = "profile "


class ProfileError(ConfigurationError):
    """Why a profile file cannot be used (turned into a warning by :func:`find`; the CLI
    reports it as an error of its own, a :class:`~kvswap.ConfigurationError`)."""


def shipped_dir() -> Path:
    """The folder of the profiles shipped with kvswap (``kvswap/calibration/profiles``),
    located without importing the calibration package."""
    spec = importlib.util.find_spec("kvswap.calibration")
    places = list(spec.submodule_search_locations or ()) if spec is not None else []
    if not places:  # an install without the calibration package ships no profiles
        return Path(__file__).resolve().parent / "calibration" / "profiles"
    return Path(places[0]) / "profiles"


def user_dir() -> Path:
    """Where ``kvswap calibrate`` writes profiles by default (platformdirs' user data dir)."""
    import platformdirs

    return Path(platformdirs.user_data_dir("kvswap", appauthor=False)) / "profiles"


def profile_name(identity: str) -> str:
    return f"{identity}.json"


def default_path(device: DeviceInfo) -> Path:
    """Where ``kvswap calibrate`` writes the profile of ``device`` unless told otherwise."""
    return user_dir() / profile_name(device.identity)


def source_of(path: Path) -> str:
    """The ``source`` of a calibration read from ``path``."""
    return f"{SOURCE_PREFIX}{path}"


def profile_path(source: str) -> Optional[Path]:
    """The file a calibration's ``source`` was read from (None: not a profile's)."""
    return Path(source.removeprefix(SOURCE_PREFIX)) if source.startswith(SOURCE_PREFIX) else None


def is_shipped(source: str) -> bool:
    """Whether a calibration's ``source`` is a profile shipped with kvswap: measured on
    another machine of the device's kind, whose short transfers can favour other routes
    (docs/calibrating-a-device.md)."""
    path = profile_path(source)
    return path is not None and path.parent == shipped_dir()


def to_calibration(doc: Any, source: str) -> Calibration:
    """Build the resolver's Calibration from a parsed profile document.

    :raises ProfileError: the document is not a usable profile (the message says why).
    """
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
            for c in [*doc["curves"], *(doc.get("staged") or {}).get("curves", ())]
        )

        def table(key: str) -> dict[str, Any]:
            return {d: v[key] for d, v in decisions.items() if v.get(key)}

        return Calibration(
            source=source,
            platform=device["platform"],
            scope="device",
            curves=curves,
            kernel_sms=table("kernel_sms"),
            kernel_min_batch=table("kernel_min_batch"),
            min_batch_by_size=table("min_batch_by_size"),
            kernel_sms_by_batch=table("kernel_sms_by_batch"),
            slowdown=doc.get("slowdown", {}),
            slowdown_by_sms=doc.get("slowdown_by_sms", {}),
            ceiling_gbps=doc.get("ceiling_gbps", {}),
            host_cost=_host_cost(doc.get("host_cost", {}), source),
            staged_chunks=int((doc.get("staged") or {}).get("chunks_per_block", 0)),
            identity=identity,
            host_reference=doc.get("host_reference") is True,
            driver_version=str(device["driver_version"]) if device.get("driver_version") else None,
        )
    except ProfileError:
        raise
    except Exception as e:  # RecursionError included: a malformed document is never fatal
        raise ProfileError(f"{type(e).__name__}: {e}") from e


def _host_cost(doc: Any, source: str) -> dict[str, list[tuple[str, float, float]]]:
    """A profile's ``host_cost`` as :class:`Calibration` takes it; an entry that is not a
    route's two finite numbers >= 0 is left out with a :class:`ProfileWarning` (the route
    is then unmeasured: the resolver excludes nothing by it)."""
    if not isinstance(doc, dict):
        raise ProfileError(f"host_cost must be an object by direction, not {type(doc).__name__}")
    out: dict[str, list[tuple[str, float, float]]] = {}
    for d, routes in doc.items():
        if not isinstance(routes, dict):
            raise ProfileError(f"host_cost[{d!r}] must be an object by route")
        rows = []
        for route, value in routes.items():
            try:
                a, b = value
                rows.append(host_cost_row((route, a, b)))
            except (TypeError, ValueError) as e:
                warnings.warn(f"kvswap skipped host_cost[{d!r}][{route!r}]={value!r} of calibration {source}: {e}",
                              ProfileWarning, stacklevel=4)
        if rows:
            out[d] = rows
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"holds the non-finite number {name}")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"holds the number {text}, which is not finite as a float")
    return value


def read(path: Path, device: Optional[DeviceInfo] = None) -> dict[str, Any]:
    """The checked document of one profile (what :func:`load` turns into a Calibration).

    :raises ProfileError: unreadable, not a regular file, not JSON, too deeply nested,
        holding NaN or an infinity, not a profile, or (given ``device``) for another device.
    """
    try:
        # A pipe or a device would hold the caller (an engine starting) for as long as it
        # gives bytes: only a regular file is read.
        regular = stat.S_ISREG(Path(path).stat().st_mode)
        text = Path(path).read_text() if regular else ""
    except (OSError, ValueError) as e:
        raise ProfileError(f"cannot be read as JSON: {e}") from e
    if not regular:
        raise ProfileError("is not a regular file (a folder, a pipe or a device)")
    try:
        doc = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise ProfileError("cannot be read as JSON: it is nested too deeply") from None
    except ValueError as e:
        raise ProfileError(f"cannot be read as JSON: {e}") from e
    cal = to_calibration(doc, source_of(path))
    if device is not None and cal.identity != device.identity:
        raise ProfileError(f"is for device {cal.identity!r}, not {device.identity!r}")
    return doc


def load(path: Path, device: Optional[DeviceInfo] = None) -> Calibration:
    """Read one profile; raise :class:`ProfileError` if unusable (or for another device)."""
    return to_calibration(read(path, device), source_of(path))


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
    out.append(shipped_dir() / profile_name(device.identity))
    return out


def _absent(path: Path) -> bool:
    """Whether nothing is at ``path``. A folder on the way that cannot be searched is not
    absence (``Path.exists`` raises for it): reading the file then says why it is skipped."""
    try:
        return not path.exists()
    except OSError:
        return False


def find(device: DeviceInfo) -> Optional[Calibration]:
    """The measured calibration for ``device``, or None; bad files are skipped with a
    warning, and so is a ``KVSWAP_PROFILE`` that names no file."""
    env = os.environ.get(PROFILE_ENV)
    for i, path in enumerate(candidates(device)):
        named = bool(env) and i == 0  # KVSWAP_PROFILE, shown as it was given
        if not named and _absent(path):
            continue
        try:
            return load(path, device)
        except ProfileError as e:
            where = env if named else path
            warnings.warn(f"kvswap skipped calibration profile {where}: {e}", ProfileWarning, stacklevel=2)
    return None
