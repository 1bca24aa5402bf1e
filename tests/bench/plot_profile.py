"""Draw a profile's plot again from the profile alone (its curves and decisions), as
``kvswap calibrate --plot`` draws it after measuring; docs/benchmarks.md's calibration plots
come from the shipped profiles this way.

    python tests/bench/plot_profile.py PROFILE.json OUT.png
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from kvswap.calibration.decisions import Fitted
from kvswap.calibration.plot import plot_profile


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    doc = json.loads(Path(argv[0]).read_text())
    out = plot_profile(Fitted.from_dict(doc), Path(argv[1]), title=f"{doc['device']['name']} ({doc['identity']})")
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
