"""Writing calibration profiles: versioned JSON keyed by device identity.

Reading and finding them is :mod:`kvswap.resolution.profiles` (the resolver's); this module writes what
it reads. A profile document (schema ``kvswap.profile/1``) holds: ``schema``,
``kvswap_version``, ``identity``, ``device`` (the full DeviceInfo), ``created``, ``measured``
(what was timed, in words), ``host_reference`` (true where the host reference's host memory
copies were timed, on a machine without an accelerator: not a device calibration),
``settings``, ``directions``, ``failures``, ``notes``, and the fitted fields
(:class:`~.decisions.Fitted`): ``curves``, ``decisions`` (per direction: routes,
``kernel_sms``, ``kernel_min_batch``, ``min_batch_by_size``, ``kernel_sms_by_batch``,
crossover), ``ceiling_gbps``, ``slowdown_by_sms``, ``host_cost``, each of the last two's
``*_source`` in words, and ``staged`` (the staged route's speed by chunk size on a
block-major host, :mod:`.staged`; absent where none was measured).

The raw rows a profile was fitted from (every timing, every interference and host-cost
record) are kept
apart, in an optional ``<profile stem>.measurements.json`` beside it (:func:`split`), so a
profile holds what the resolver reads and stays small; the profiles shipped with kvswap come
without theirs (``kvswap calibrate --strip``).
"""
from __future__ import annotations

import datetime
import json
import re
from pathlib import Path
from typing import Any, Optional

from kvswap import Curve, DeviceInfo
from kvswap.cli import write_text
from kvswap.resolution import profiles

from .decisions import Fitted, curve_to_dict
from .records import Measurement


def _plain(value: Any) -> Any:
    """``value`` as JSON holds it: dataclasses of this package by their ``to_dict()``."""
    if isinstance(value, Curve):
        return curve_to_dict(value)
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def make_document(device: DeviceInfo, fitted: Optional[Fitted] = None, **fields: Any) -> dict[str, Any]:
    """A profile document for ``device``: schema, version, identity, device, time, then the
    ``fitted`` fields and ``fields`` (dataclasses written as their ``to_dict()``)."""
    from kvswap import __version__

    # DeviceInfo.details is free-form plugin data: keep what JSON can hold, as text otherwise.
    described = json.loads(json.dumps(device.to_dict(), default=str))
    doc: dict[str, Any] = {
        "schema": profiles.SCHEMA,
        "kvswap_version": __version__,
        "identity": device.identity,
        "device": described,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if fitted is not None:
        doc.update(fitted.to_dict())
    doc.update({k: _plain(v) for k, v in fields.items()})
    return doc


# A profile holds what the resolver reads and how it was measured, in words; the raw rows
# it was fitted from (every timing, every interference and host-cost record) go to a file of
# their own beside it, which is optional and never shipped: ``<profile stem>.measurements.json``.
MEASUREMENTS_SCHEMA = "kvswap.measurements/1"
RAW_FIELDS = ("measurements", "interference", "host_cost_records", "staged_records")


def measurements_path(profile: Path) -> Path:
    """Where the raw measurements of the profile at ``profile`` are written."""
    profile = Path(profile)
    return profile.with_name(f"{profile.stem}.measurements.json")


def split(doc: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``doc`` as a profile without its raw rows, and those rows as a measurements document."""
    profile = {k: v for k, v in doc.items() if k not in RAW_FIELDS}
    raw = {"schema": MEASUREMENTS_SCHEMA, "identity": doc.get("identity"), "created": doc.get("created"),
           **{k: doc.get(k, []) for k in RAW_FIELDS}}
    return profile, raw


def read_measurements(path: Path) -> tuple[list[Measurement], list[dict[str, Any]]]:
    """The timings and the interference records of a measurements file (:func:`split`)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise profiles.ProfileError(f"cannot be read as JSON: {e}") from e
    if not isinstance(doc, dict) or doc.get("schema") != MEASUREMENTS_SCHEMA:
        raise profiles.ProfileError(f"is not a {MEASUREMENTS_SCHEMA} file")
    try:
        return ([Measurement.from_dict(m) for m in doc.get("measurements", [])],
                [dict(r) for r in doc.get("interference", [])])
    except (KeyError, TypeError) as e:
        raise profiles.ProfileError(f"{type(e).__name__}: {e}") from e


_FLAT_LIST = re.compile(r"\[\s+([^\[\]{}\"]*?)\s+\]")


def dumps(doc: dict[str, Any]) -> str:
    """Indented JSON with lists of numbers (curve points) on one line each."""
    text = json.dumps(doc, indent=1, sort_keys=True, allow_nan=False)
    # JSON escapes newlines inside strings, so every raw newline here is layout.
    return _FLAT_LIST.sub(lambda m: "[" + re.sub(r"\s*\n\s*", " ", m.group(1)) + "]", text) + "\n"


def write(text: str, path: Path) -> Path:
    """Write ``text`` to ``path`` whole or not at all (:func:`kvswap.cli.write_text`)."""
    return Path(write_text(text, path))


def save(doc: dict[str, Any], path: Path) -> Path:
    """Write the profile ``doc`` to ``path`` atomically, refusing what could not be read back
    (:class:`~kvswap.resolution.profiles.ProfileError`, the file left as it was)."""
    profiles.to_calibration(doc, str(path))
    try:
        text = dumps(doc)
    except ValueError as e:  # NaN or an infinity in a field the resolver does not check
        raise profiles.ProfileError(f"{path} cannot be written as JSON: {e}") from None
    return write(text, path)


def save_measurements(raw: dict[str, Any], path: Path) -> Path:
    """Write a measurements document (:func:`split`) to ``path`` atomically."""
    return write(json.dumps(raw, sort_keys=True, allow_nan=False) + "\n", path)


def strip(path: Path) -> tuple[Path, Optional[Path]]:
    """Rewrite the profile at ``path`` without its raw rows, which go to
    :func:`measurements_path` beside it (None where it held none): how the shipped
    profiles are made from a calibration's output. What the resolver reads is unchanged."""
    path = Path(path)
    # Read as the resolver reads it: a file it would skip (NaN, nested too deeply, not an
    # object) is refused here too, before anything is written.
    profile, raw = split(profiles.read(path))
    out = None
    if any(raw[k] for k in RAW_FIELDS):
        out = save_measurements(raw, measurements_path(path))
    save(profile, path)
    return path, out
