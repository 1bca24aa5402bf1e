"""Memory kvswap allocates for itself, and the one error it raises when memory runs out.

Where a mover, a staging pool or a launcher allocates device or page-locked host memory, the
allocation runs inside :func:`allocating`: running out (torch's ``OutOfMemoryError``, a
driver's "out of memory", Python's ``MemoryError``) becomes :class:`kvswap.AllocationError`,
which names what the memory was for and how much; any other failure passes through as it was.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from ..errors import AllocationError


def out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` says memory ran out: ``MemoryError``, torch's ``OutOfMemoryError``
    (``torch.cuda.OutOfMemoryError``), or a runtime error whose message says so (what torch
    raises when page-locking host memory fails, and Triton when a module cannot load)."""
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        return True
    return isinstance(e, RuntimeError) and "out of memory" in str(e).lower()


@contextmanager
def allocating(what: str, nbytes: int, memory: str) -> Iterator[None]:
    """Turn running out of memory inside the block into :class:`AllocationError`.

    :param what: what the memory is for, as the message should say it.
    :param nbytes: how many bytes are asked for.
    :param memory: ``"device"``, ``"page-locked host"`` or ``"host"``.
    """
    try:
        yield
    except AllocationError:
        raise
    except Exception as e:
        if not out_of_memory(e):
            raise
        first = str(e).splitlines()[0] if str(e) else ""
        raise AllocationError(what, nbytes, memory, f"{type(e).__name__}: {first}") from e
