"""A mover's calls run one at a time, and only in the process that built it."""
from __future__ import annotations

import functools
from typing import Any

from ..errors import ForkedProcessError
from . import process


def serialized(method: Any) -> Any:
    """One call at a time on a mover, from any thread, in the process that built it."""
    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self._pid != process.pid:
            raise forked(self)
        with self._lock:
            return method(self, *args, **kwargs)
    return call


def forked(mover: Any) -> ForkedProcessError:
    return ForkedProcessError(
        f"this BlockMover was built in process {mover._pid}; this is process {process.pid}, forked from it, "
        f"which inherits neither the mover's threads nor its device context; build a new mover here"
    )
