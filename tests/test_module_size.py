"""Every module of core, the backends and calibration stays under 500 lines: a module does
one thing, and one that grows past the limit is split along its seams."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("core", "backends", "calibration")
LIMIT = 500


def test_every_module_is_under_the_limit():
    sizes = {path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines())
             for folder in FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))}
    assert len(sizes) > 100  # the trees were read
    over = {path: n for path, n in sizes.items() if n >= LIMIT}
    assert not over, f"modules of {LIMIT} lines or more: {over}"
