"""How a failure in a plugin's code is told: one line naming the exception.

kvswap calls a plugin's code (its import, its hooks, an availability check) inside
``except KeyboardInterrupt: raise`` / ``except BaseException``: a plugin that calls
``sys.exit()`` (some vendor SDKs do when no device is found) or raises another
``BaseException`` is a broken plugin, dropped with its name, not the end of the process;
only the user's interrupt goes through.

A copy implementation's bound function is called on every transfer: what it raises reaches
the caller as a kvswap error naming it (:func:`copy_failure`).
"""
from __future__ import annotations

from ..errors import AllocationError, BackendError, KvSwapError


def describe(e: BaseException) -> str:
    """``Type: message`` on one line, for a warning or a reason; an exception whose
    ``str()`` fails is still named."""
    try:
        text = " ".join(str(e).split())
    except Exception:
        text = "(its message cannot be shown: str() raised)"
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def copy_failure(e: Exception, impl: str) -> Exception:
    """What the caller gets where implementation ``impl``'s copy raised ``e``: ``e`` itself
    where it is kvswap's own (a backend's :class:`~kvswap.DriverError`, say); an
    :class:`~kvswap.AllocationError` where memory ran out (``MemoryError``, torch's
    ``OutOfMemoryError``); else a :class:`~kvswap.BackendError` naming ``impl``, with ``e``
    as its ``__cause__`` (as ``raise ... from e`` sets it, so a caller that raises it later,
    off the ``except`` block, keeps the chain)."""
    if isinstance(e, KvSwapError):
        return e
    out: Exception
    if isinstance(e, MemoryError) or any(t.__name__ == "OutOfMemoryError" for t in type(e).__mro__):
        out = AllocationError(f"a copy by {impl}", 0, "host" if isinstance(e, MemoryError) else "device", describe(e))
    else:
        out = BackendError(impl, describe(e))
    out.__cause__ = e
    return out
