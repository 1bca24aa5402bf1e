"""The process a BlockMover belongs to.

A child made by ``fork()`` inherits a mover's Python object but not the threads behind it
(its issuing thread, the staging worker), nor, where CUDA was initialised before the fork,
a usable device context (CUDA's rule: a forked child cannot use the parent's context and
cannot initialise its own). A mover records :data:`pid` when it is built and refuses to run
anywhere else. :data:`pid` is updated in the child by an ``os.register_at_fork`` hook, so the
check is one comparison, not a system call.
"""
from __future__ import annotations

import os
import sys

pid = os.getpid()


def _after_fork_in_child() -> None:
    global pid
    pid = os.getpid()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def cuda_forked() -> bool:
    """Whether this process was forked after CUDA was initialised in its parent (torch then
    refuses to initialise CUDA here). False where torch is not loaded."""
    torch = sys.modules.get("torch")
    bad_fork = getattr(getattr(torch, "cuda", None), "_is_in_bad_fork", None)
    try:
        return bool(bad_fork()) if callable(bad_fork) else False
    except Exception:
        return False
