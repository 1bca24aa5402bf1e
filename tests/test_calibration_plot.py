"""The calibration plot: a PNG from a profile, matplotlib imported only when drawing."""
from __future__ import annotations

import subprocess
import sys

import json

from kvswap.calibration import fit, store
from kvswap.calibration.decisions import Fitted
from kvswap.calibration.plot import plot_profile

from test_calibration_fit import DEVICE, synthetic_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_plot_is_a_png_of_every_route(tmp_path):
    ms = synthetic_run()
    fitted = fit.profile_fields(ms, [], ["h2d", "d2h"])
    assert fitted.decisions["h2d"].crossover_bytes  # a crossover to mark
    path = plot_profile(fitted, tmp_path / "sub" / "curves.png", title="synthetic")
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 20_000
    from PIL import Image

    with Image.open(path) as im:  # more than the step plot's 16: a shade per SM count
        assert im.mode == "P" and 16 < len(im.getcolors()) <= 64


def test_plot_of_one_direction_and_no_kernel(tmp_path):
    ms = [m for m in synthetic_run() if m.direction == "d2h" and m.kind != "kernel"]
    fitted = fit.profile_fields(ms, [], ["d2h"])
    assert plot_profile(fitted, tmp_path / "one.png").read_bytes()[:8] == PNG_MAGIC


def test_plot_of_a_profile_read_back_without_its_raw_measurements(tmp_path):
    ms = synthetic_run()
    doc = store.make_document(DEVICE, fit.profile_fields(ms, [], ["h2d", "d2h"]), measurements=ms)
    profile, raw = store.split(doc)
    assert "measurements" not in profile and len(raw["measurements"]) == len(ms)
    fitted = Fitted.from_dict(json.loads(store.dumps(profile)))
    assert fitted == fit.profile_fields(ms, [], ["h2d", "d2h"])
    assert plot_profile(fitted, tmp_path / "back.png").read_bytes()[:8] == PNG_MAGIC


def test_cli_modules_import_nothing_heavy():
    code = (
        "import sys, kvswap.cli, kvswap.calibration.cli_calibrate, kvswap.calibration.cli_bench, "
        "kvswap.calibration.plot, kvswap.calibration.sweep, kvswap.calibration.bench\n"
        "heavy = [m for m in ('matplotlib', 'tqdm', 'torch', 'triton') if m in sys.modules]\n"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
