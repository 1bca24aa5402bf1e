"""Calibration profiles on disk: writing them (reading and lookup are :mod:`kvswap.profiles`).

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
from pathlib import Path
from typing import Any, Iterator, Optional

from kvswap import profiles
from kvswap.profiles import (  # noqa: F401  (reading is core's; re-exported for calibration's callers)
    PROFILE_ENV,
    SCHEMA,
    ProfileError,
    candidates,
    default_path,
    is_shipped,
    load,
    profile_name,
    profile_path,
    read,
    shipped_dir,
    source_of,
    to_calibration,
    user_dir,
)
from kvswap.thresholds import Calibration
from kvswap.types import DeviceInfo

SHIPPED = shipped_dir()


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
    """The measured calibration for ``device``, or None (:func:`kvswap.profiles.find`)."""
    if _overrides:
        top = _overrides[-1]
        if top is _NO_PROFILE:
            return None
        if top.identity in (None, device.identity):
            return top
    return profiles.find(device)


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
