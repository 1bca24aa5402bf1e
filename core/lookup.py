"""Find the calibration for a device: measured profile, then backend defaults, then fallback."""
from __future__ import annotations

from .plugins import PluginHost
from .thresholds import FALLBACK, SCOPES, Calibration
from .types import DeviceInfo


def find_calibration(host: PluginHost, device: DeviceInfo) -> Calibration:
    """The calibration the resolver decides by, in DESIGN.md's order.

    1. a measured profile (``KVSWAP_PROFILE``, the user's data directory, shipped profiles);
    2. calibrations the backends register for this device, most specific ``scope`` first
       (ties: the plugin name, then the source, so installation order never decides);
    3. :data:`kvswap.thresholds.FALLBACK`, a conservative guess that says it is one.
    """
    from .calibration import store

    measured = store.find(device)
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
