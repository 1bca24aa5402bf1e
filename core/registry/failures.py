"""How a failure in a plugin's code is told: one line naming the exception.

kvswap calls a plugin's code (its import, its hooks, an availability check) inside
``except KeyboardInterrupt: raise`` / ``except BaseException``: a plugin that calls
``sys.exit()`` (some vendor SDKs do when no device is found) or raises another
``BaseException`` is a broken plugin, dropped with its name, not the end of the process;
only the user's interrupt goes through.
"""
from __future__ import annotations


def describe(e: BaseException) -> str:
    """``Type: message`` on one line, for a warning or a reason; an exception whose
    ``str()`` fails is still named."""
    try:
        text = " ".join(str(e).split())
    except Exception:
        text = "(its message cannot be shown: str() raised)"
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
