"""The clone's own folder, where Python imports it as ``kvswap``.

Run from the folder above a clone named ``kvswap``, Python finds that folder first (the
current directory leads ``sys.path``), ahead of the installed kvswap. Without this file it
would take the folder for an empty namespace package: ``kvswap.resolve`` would not exist
and ``python -m kvswap`` would fail. With it, the folder is kvswap itself: subpackages are
found where pyproject.toml maps them (``core/`` is ``kvswap``; ``backends/`` and
``calibration/`` lie here at the root), and ``core/__init__.py`` runs as the package's own.

No distribution contains this file (pyproject.toml lists the packages it builds), and
imported under any other name it does nothing.
"""
from pathlib import Path as _Path

if __name__ == "kvswap":
    _root = _Path(__file__).resolve().parent
    __path__ = [str(_root / "core"), str(_root)]
    __file__ = str(_root / "core" / "__init__.py")
    exec(compile(_Path(__file__).read_text(), __file__, "exec"))
    del _root
del _Path
