"""Find the calibration for a device: measured profile, then backend defaults, then fallback."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from ..registry.impl import CopyImpl
from ..registry.plugins import PluginHost, collect_impls
from ..registry.thresholds import FALLBACK, SCOPES, Calibration
from ..types import DeviceInfo
from . import profiles as profile_files


def find_calibration(host: PluginHost, device: DeviceInfo, profiles: bool = True,
                     registered: Optional[list[tuple[str, CopyImpl]]] = None) -> Calibration:
    """The calibration the resolver decides by, in this order (docs/design.md):

    1. a measured profile (``KVSWAP_PROFILE``, the user's data directory, shipped
       profiles), unless ``profiles`` is False;
    2. calibrations the backends register for this device, most specific ``scope`` first
       (ties: the plugin name, then the source, so installation order never decides),
       with each other plugin's curves for its own implementations added;
    3. :data:`kvswap.registry.thresholds.FALLBACK`, a conservative guess that says it is one.

    A plugin's calibration may describe only its own implementations: its curves for
    another plugin's, and curves for a whole kind (``*batch``, ``*kernel``), are ignored
    with a warning naming it. kvswap's own backends describe each other's.

    :param registered: ``collect_impls(host, device.platform)`` where the caller has it.
    """
    measured = profile_files.find(device) if profiles else None
    if measured is not None:
        return measured
    if registered is None:
        registered = collect_impls(host, device.platform)
    owners = {impl.name: plugin for plugin, impl in registered}
    offered = sorted(
        ((SCOPES.index(cal.scope), plugin, cal.source, _own(host, plugin, cal, owners))
         for plugin, cal in host.collect("kvswap_register_calibrations", Calibration, device=device)
         if cal.platform in (device.platform, "*")),
        key=lambda t: t[:3],
    )
    if not offered:
        return FALLBACK
    base_plugin, base = offered[0][1], offered[0][3]
    known = {(c.impl, c.direction) for c in base.curves}
    added, seen = [], {base_plugin}
    for _, plugin, _, cal in offered[1:]:
        if plugin in seen:
            continue  # a plugin's most specific calibration speaks for it
        seen.add(plugin)
        added += [c for c in cal.curves if owners.get(c.impl) == plugin and (c.impl, c.direction) not in known]
    return replace(base, curves=base.curves + tuple(added)) if added else base


def _own(host: PluginHost, plugin: str, cal: Calibration, owners: dict[str, str]) -> Calibration:
    """``cal`` with the curves ``plugin`` may not set removed (with a warning)."""
    if host.is_builtin(plugin):
        return cal
    kept = []
    for c in cal.curves:
        owner = owners.get(c.impl)
        if c.impl.startswith("*"):
            host.warn(plugin, f"registers a calibration with a curve for every {c.impl[1:]} route "
                      f"({c.impl!r}); only kvswap's own backends may, so it is ignored")
        elif owner is not None and owner != plugin:
            host.warn(plugin, f"registers a calibration with curves for {c.impl!r}, which plugin "
                      f"{owner!r} registers; a plugin may describe only its own implementations, so they are ignored")
        elif owner == plugin:
            kept.append(c)
    return cal if len(kept) == len(cal.curves) else replace(cal, curves=tuple(kept))
