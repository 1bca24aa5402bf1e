"""kvswap backend: cuda (being written)."""
