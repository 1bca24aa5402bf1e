"""The parts of a calibration measured on their own: each route's host cost per call, the
compute slowdown beside it, and the staged route (its speed by chunk size, host cost and
slowdown, all on a block-major host cache: :mod:`.staged`); and ``kvswap calibrate --only
PARTS --update PROFILE``, which measures just those and rewrites a profile in place,
keeping everything else.

Both parts run on model-shaped per-layer tensors (:mod:`.host_cost`,
:mod:`.step_interference`), on an accelerator through torch (:class:`~.step_workload.DeviceEnv`)
or, on a machine without one, on host tensors with the host reference
(:class:`~.step_workload.HostEnv`), where a small matrix product stands in for the GEMMs.
"""
from __future__ import annotations

import datetime
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from kvswap import __version__
from kvswap.resolution import profiles
from kvswap.errors import ConfigurationError
from kvswap.types import DeviceInfo, Direction

from . import fit, host_cost, staged, store, step_interference
from .binding import Failures
from .progress import Progress
from .timing import on_host

HOST_COST, INTERFERENCE, STAGED = "host-cost", "interference", "staged"
PARTS = (HOST_COST, INTERFERENCE, STAGED)
# The compute a step runs beside its transfer, per step (step_interference's default).
STEP_MS = 20.0


def parts(text: str) -> list[str]:
    """``--only``'s value: a comma-separated list of :data:`PARTS`."""
    import argparse

    got = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in got if t not in PARTS]
    if bad or not got:
        raise argparse.ArgumentTypeError(f"{text!r}: name one or more of {', '.join(PARTS)}, comma-separated")
    return list(dict.fromkeys(got))


def make_env(dev: DeviceInfo) -> Any:
    """Where the parts run: the device, or host tensors with a stand-in for the GEMMs."""
    from .step_workload import DeviceEnv, HostEnv

    if not on_host(dev):
        return DeviceEnv(dev, STEP_MS)
    import numpy as np

    a = np.random.default_rng(0).standard_normal((192, 192))
    return HostEnv(lambda: a @ a)


def host_interference_cache() -> Any:
    """A small layout for the slowdown on the host (4 KiB chunks, 4 layers)."""
    from kvswap.cli.models import ModelShape

    return ModelShape("host layout", 4, 2, 64).at(1)


@dataclass
class PartsResult:
    """What :func:`measure` measured: raw records per part, and the routes that failed."""

    host_cost_records: list[dict[str, Any]] = field(default_factory=list)
    interference: list[dict[str, Any]] = field(default_factory=list)
    staged_records: list[dict[str, Any]] = field(default_factory=list)  # speed by chunk size (.staged)
    failures: Failures = field(default_factory=Failures)
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def host_cost(self) -> dict[str, dict[str, list[float]]]:
        return host_cost.profile_field(self.host_cost_records)

    def staged_section(self, before: Optional[dict[str, Any]] = None) -> Optional[dict[str, Any]]:
        """The profile's ``staged`` section from this run's records (None: none measured)."""
        if not self.staged_records:
            return None
        return staged.profile_section(self.staged_records, staged.StagedSettings(**self.settings["staged"]), before)

    @property
    def measured_anything(self) -> bool:
        return bool(self.host_cost_records or self.interference or self.staged_records)


def measure(which: Sequence[str], dev: DeviceInfo, spec: Any, host: Any, directions: Sequence[Direction], *,
            quick: bool = False, kernel_sms: Optional[int] = None, progress: Optional[Progress] = None,
            staged_slowdown: bool = True) -> PartsResult:
    """Measure ``which`` of :data:`PARTS` on ``dev`` (named ``spec`` by the caller) in
    ``directions``. Where a staged route is available, ``host-cost`` and ``interference``
    include it (on a block-major host cache); ``staged`` measures its speed by chunk size,
    its host cost and, with ``staged_slowdown``, its compute slowdown."""
    out = PartsResult()
    where = ",".join(str(d) for d in directions)
    try:
        env = make_env(dev)
    except Exception as e:  # the sweep's results stay usable without these parts
        for part in which:
            out.failures.add(where, part, None, None, e)
        return out
    has_staged = any(staged.staged_impl(d, spec, host) for d in directions)
    if STAGED in which and has_staged:
        st = staged.settings_for(dev, quick=quick)
        out.settings["staged"] = st.to_dict()
        try:
            out.staged_records = staged.measure(env, dev, directions, st, spec=spec, host=host, progress=progress,
                                                failures=out.failures)
        except Exception as e:
            out.failures.add(where, STAGED, None, None, e)
    if HOST_COST in which or (STAGED in which and has_staged):
        settings = host_cost.settings_for(dev, quick=quick, kernel_sms=kernel_sms)
        out.settings["host_cost"] = settings.to_dict()
        runs = ([(host_cost.PER_LAYER_KINDS, "per-layer")] if HOST_COST in which else []) + (
            [(host_cost.STAGED_KINDS, staged.HOST_LAYOUT)] if has_staged else [])
        for kinds, layout in runs:
            try:
                out.host_cost_records += host_cost.measure(env, dev, directions, settings, spec=spec, host=host,
                                                           progress=progress, failures=out.failures, kinds=kinds,
                                                           host_layout=layout)
            except Exception as e:
                out.failures.add(where, HOST_COST, None, None, e)
        out.settings["host_cost"]["routes"] = host_cost.route_notes(out.host_cost_records)
    if INTERFERENCE in which or (STAGED in which and has_staged and staged_slowdown):
        small = on_host(dev)
        sms = step_interference.SM_COUNTS
        out.settings["interference"] = {"workload": list(step_interference.WORKLOAD), "sm_counts": list(sms),
                                        "size_workloads": [] if small else [list(w) for w in
                                                                             step_interference.SIZE_WORKLOADS],
                                        "step_ms": STEP_MS}
        try:
            out.interference = step_interference.measure(
                env, dev, directions, sms, reps=3 if quick else 5, host=host, progress=progress,
                cache=host_interference_cache() if small else None,
                num_blocks=200 if small else step_interference.POOL_BLOCKS,
                by_size=() if small else step_interference.size_workloads(), staged=has_staged,
                per_layer=INTERFERENCE in which, staged_pool_bytes=4 << 20 if small else step_interference.STAGED_POOL_BYTES)
        except Exception as e:
            out.failures.add(where, INTERFERENCE, None, None, e)
    return out


def update(path: Path, which: Sequence[str], dev: DeviceInfo, spec: Any, host: Any, directions: Sequence[Direction],
           *, quick: bool = False, progress: Optional[Progress] = None
           ) -> tuple[dict[str, Any], PartsResult, Optional[Path]]:
    """Measure ``which`` and rewrite the profile at ``path`` in place: the parts' fields
    replaced for ``directions``, the class routes of the measured directions ranked again
    under the new host cost, everything else kept; raw records moved beside it, as
    ``--strip`` does. Returns the new profile, what was measured and the raw file (None,
    and nothing written, where nothing could be measured).

    :raises ConfigurationError: the file is no usable profile, or is another device's.
    """
    try:
        doc = profiles.read(Path(path))  # as the resolver reads it: NaN, too deep, not an object refused
        profiles.to_calibration(doc, str(path))
    except (OSError, ValueError, profiles.ProfileError) as e:
        raise ConfigurationError(f"--update {str(path)!r} is not a profile kvswap can read: {e}") from None
    if doc["identity"] != dev.identity:
        raise ConfigurationError(f"--update {str(path)!r} is the profile of {doc['identity']!r}, but this device is "
                                 f"{dev.identity!r}: measure a device's own profile only on that device")
    knees = [v.get("kernel_sms") for v in doc.get("decisions", {}).values() if v.get("kernel_sms")]
    got = measure(which, dev, spec, host, directions, quick=quick, kernel_sms=max(knees) if knees else None,
                  progress=progress)
    if not got.measured_anything:
        return doc, got, None  # nothing measured: the file stays as it was
    measured = [str(d) for d in directions]
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    fresh = got.host_cost
    if fresh:  # a part that measured nothing leaves the profile's field as it was; routes not measured keep theirs
        before = doc.get("host_cost", {})
        doc["host_cost"] = {**before, **{d: {**before.get(d, {}), **v} for d, v in fresh.items()}}
        doc["host_cost_source"] = fit.HOST_COST_MEASURED
        _rerank(doc, [d for d in measured if d in fresh])
    fresh_rows = step_interference.profile_rows(got.interference)
    if fresh_rows:
        doc["slowdown_by_sms"] = merged_rows(doc.get("slowdown_by_sms", {}), fresh_rows)
        doc["slowdown_source"] = fit.SLOWDOWN_MEASURED
        if INTERFERENCE in which:
            doc.pop("slowdown", None)  # an older measurement's numbers: one measurement of slowdown only
    section = got.staged_section(doc.get("staged"))
    if section is not None:
        doc["staged"] = section
    settings = doc.setdefault("settings", {})
    for part, new in got.settings.items():  # the notes of routes not measured now are kept
        old = settings.get(part)
        if isinstance(old, dict) and isinstance(old.get("routes"), dict) and isinstance(new.get("routes"), dict):
            new = {**new, "routes": {**old["routes"], **new["routes"]}}
        settings[part] = new
    doc.setdefault("failures", []).extend(f.to_dict() for f in got.failures.records)
    doc.setdefault("notes", []).append(f"{', '.join(which)} measured again for {', '.join(measured)} on {when} "
                                       f"(kvswap {__version__}, kvswap calibrate --update)")
    doc["host_cost_records"], doc["interference"] = got.host_cost_records, got.interference
    doc["staged_records"] = got.staged_records
    profile, raw = store.split(doc)
    store.save(profile, path)
    raw_path = store.measurements_path(path)
    if raw_path.is_file():  # the run's other raw rows stay as they were
        try:
            before = json.loads(raw_path.read_text())
        except ValueError:
            before = {}
        raw = {**before, **{k: v for k, v in raw.items() if v or k not in before}}
    store.save_measurements(raw, raw_path)
    return profile, got, raw_path


def merged_rows(before: dict[str, list], fresh: dict[str, list]) -> dict[str, list]:
    """``slowdown_by_sms`` with ``fresh``'s rows in place of those of the routes (and kinds)
    they name, per direction; the rows of routes not measured now are kept."""
    out = {d: list(v) for d, v in before.items()}
    for d, rows in fresh.items():
        named = {r[0] for r in rows}
        out[d] = [r for r in out.get(d, []) if r[0] not in named] + [list(r) for r in rows]
    return out


def _rerank(doc: dict[str, Any], directions: Sequence[str]) -> None:
    """The class routes (and crossover) of ``directions``, ranked again from the profile's
    curves under its host cost (what ``explain()`` will show)."""
    from .decisions import curve_from_dict

    curves = [curve_from_dict(c) for c in doc.get("curves", ())]
    for d in directions:
        dec = doc.get("decisions", {}).get(d)
        if not dec or dec.get("carried_from") is not None:
            continue
        routes = fit.resolver_routes(curves, d, dec.get("kernel_sms"), doc["host_cost"].get(d))
        dec["routes"] = [r.to_dict() for r in routes]
        dec["crossover_bytes"] = fit.crossover(routes)
