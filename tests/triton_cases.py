"""Descriptor sizes and layouts the Triton tests share (interpreter and GPU alike)."""
from __future__ import annotations

import numpy as np

from kvswap.testing.memory import Layout, scattered


def log_sizes(rng: np.random.Generator, n: int, lo: int, hi: int) -> np.ndarray:
    """``n`` sizes spread evenly over orders of magnitude in ``[lo, hi]``."""
    return np.exp(rng.uniform(np.log(lo), np.log(hi + 1), n)).astype(np.int64).clip(lo, hi)


def mixed_layout(rng: np.random.Generator, sizes: np.ndarray) -> Layout:
    """Scattered blocks, each start 16-byte aligned, 8-byte aligned or at any byte."""
    base = scattered(rng, sizes, 16)
    shift = rng.choice(np.array([0, 8, 1, 3, 5, 7, 9, 12, 15]), len(sizes))
    return Layout(base.offsets + shift, base.nbytes)
