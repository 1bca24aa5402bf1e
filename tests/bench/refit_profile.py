"""Fit a profile's decisions again from the measurements it holds, with this kvswap's fit.

Not a test. A profile keeps every raw measurement, so a change to the fitting rules (not
to what is measured) needs no new run on the device: this rewrites ``decisions``,
``curves``, ``ceiling_gbps`` and ``slowdown`` of PROFILE from its own ``measurements`` and
``interference``, records the refit in ``notes``, writes OUT (default: PROFILE itself),
prints the report ``kvswap calibrate`` prints, and draws the plot again to PLOT if given.

    python tests/bench/refit_profile.py PROFILE [OUT [PLOT.png]]
"""
from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from kvswap import __version__
    from kvswap.calibration import fit, store
    from kvswap.calibration.records import Interference, Measurement
    from kvswap.calibration.report import calibration_report

    if len(argv) not in (1, 2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    src = Path(argv[0])
    out = Path(argv[1]) if len(argv) >= 2 else src
    doc = store.read(src)
    ms = [Measurement.from_dict(m) for m in doc["measurements"]]
    records = [Interference.from_dict(r) for r in doc.get("interference", [])]
    tolerance = doc.get("settings", {}).get("knee_tolerance", fit.TOLERANCE)
    doc.update(fit.profile_fields(ms, records, doc["directions"], None, tolerance))
    doc["notes"] = list(doc.get("notes", [])) + [
        f"decisions fitted again by kvswap {__version__} from the measurements of {doc['created']}"]
    store.save(doc, out)
    print(calibration_report(doc))
    print(f"\nprofile written to {out}")
    if len(argv) == 3:
        from kvswap.calibration.plot import plot_profile

        print(f"plot written to {plot_profile(doc, Path(argv[2]))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
