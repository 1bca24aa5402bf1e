"""Find the calibration for a device: measured profile, then backend defaults, then fallback."""
from __future__ import annotations

from . import profiles as profile_files
from .plugins import PluginHost
from .thresholds import FALLBACK, SCOPES, Calibration
from .types import DeviceInfo


def find_calibration(host: PluginHost, device: DeviceInfo, profiles: bool = True) -> Calibration:
    """The calibration the resolver decides by, in this order (docs/design.md):

    1. a measured profile (``KVSWAP_PROFILE``, the user's data directory, shipped
       profiles), unless ``profiles`` is False;
    2. calibrations the backends register for this device, most specific ``scope`` first
       (ties: the plugin name, then the source, so installation order never decides);
    3. :data:`kvswap.thresholds.FALLBACK`, a conservative guess that says it is one.
    """
    measured = profile_files.find(device) if profiles else None
    if measured is not None:
        return measured
    offered = [
        (SCOPES.index(cal.scope), plugin, cal.source, cal)
        for plugin, cal in host.collect("kvswap_register_calibrations", Calibration, device=device)
        if cal.platform in (device.platform, "*")
    ]
    if offered:
        return min(offered, key=lambda t: t[:3])[3]
    return FALLBACK
