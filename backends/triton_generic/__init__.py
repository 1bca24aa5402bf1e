"""kvswap backend: triton_generic (being written)."""
