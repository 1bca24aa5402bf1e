"""kvswap inside SGLang: HiCache's copies between GPU and host memory through kvswap.

Installed with kvswap, as the entry point ``kvswap`` of SGLang's plugin group
``sglang.srt.plugins``; SGLang loads it when ``SGLANG_PLUGINS`` names it (or names nothing)::

    SGLANG_PLUGINS=kvswap python -m sglang.launch_server ... --enable-hierarchical-cache

Its two AROUND hooks (:mod:`.hooks`) serve HiCache's per-layer loads and all-layer backups of
the MHA and MLA host pools with :class:`kvswap.BlockMover`s built over SGLang's own buffers
(:mod:`.layouts`, :mod:`.movers`); everything else stays SGLang's. ``KVSWAP_SGLANG=off``
installs no hook. :func:`explain` says what a pool's copies take and why.

Importing this package imports no SGLang; :func:`register` and :func:`explain` do.
"""
from __future__ import annotations

from typing import Any

__all__ = ["register", "explain"]


def register() -> None:
    """SGLang's plugin entry point: register kvswap's HiCache hooks with SGLang's
    ``HookRegistry`` (``sglang.srt.plugins.load_plugins`` applies them), unless
    ``KVSWAP_SGLANG=off``.

    :raises ConfigurationError: ``KVSWAP_SGLANG`` is neither on nor off.
    """
    from .hooks import register as install

    install()


def explain(pool: Any) -> str:
    """What kvswap does with an SGLang host pool's loads and backups, and why: each
    direction's :meth:`kvswap.BlockMover.explain`, or why the pool is left to SGLang."""
    from .hooks import explain as explained

    return explained(pool)
