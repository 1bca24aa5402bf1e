"""Work a copy function hands to another thread, and how its failure reaches the job.

A TransferFn may return before its driver calls are made: ``cuda.batch`` issues large
batches from a per-device thread (backends/cuda/issuer.py), ordered on the caller's
stream. It reports each such piece of work with :func:`report`: an object with an
``error`` attribute (None until the work failed) that is final once the stream has passed
the work. A caller that tracks jobs (BlockMover) wraps its call in :func:`collect` and,
once the job's end marker has completed, asks :func:`failure` whether any of it failed;
work whose failure was reported that way is marked ``reported``, so the copy function
does not raise it a second time on its next call.

``collect(stable=True)`` also promises that the descriptor arrays passed inside the block
stay untouched until the stream has passed the work (BlockMover's pinned buffers return
to its pool only then), so a copy function may keep them instead of copying them.
"""
from __future__ import annotations

import threading
from typing import Any, Optional

_local = threading.local()


class collect:
    """Collect, in a list, the work reported on this thread inside the block
    (``with collect(...) as items``).

    :param stable: the caller's descriptor arrays stay untouched until its stream has
        passed the work (see the module docstring).
    """

    # A class, not a generator-based context manager: a BlockMover job enters one per
    # call, and a generator costs several times more to enter and leave.
    __slots__ = ("items", "stable", "outer")

    def __init__(self, stable: bool = False) -> None:
        self.items: list = []
        self.stable = stable

    def __enter__(self) -> list:
        self.outer = getattr(_local, "items", None), getattr(_local, "stable", False)
        _local.items, _local.stable = self.items, self.stable
        return self.items

    def __exit__(self, *exc: Any) -> None:
        _local.items, _local.stable = self.outer


def arrays_stable() -> bool:
    """Whether the current :func:`collect` block promised stable descriptor arrays."""
    return getattr(_local, "stable", False)


def report(item: Any) -> None:
    """Called by a copy function for work it left to another thread (no-op outside :func:`collect`)."""
    items = getattr(_local, "items", None)
    if items is not None:
        items.append(item)


def failure(items: list) -> Optional[BaseException]:
    """The first error among ``items`` (call once the stream has passed them), or None;
    every failed item is marked ``reported``."""
    first = None
    for item in items:
        err = getattr(item, "error", None)
        if err is not None:
            item.reported = True
            first = first or err
    return first
