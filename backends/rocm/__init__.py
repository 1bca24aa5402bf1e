"""kvswap backend: rocm (being written)."""
