"""How many descriptors one driver batch call may take, for every in-tree batch route.

Driver batch calls have practical limits below what their signatures allow: a hang was
reported on Blackwell with 51,828 descriptors in one ``cuMemcpyBatchAsync`` (vLLM issue
49276), and ``hipMemcpyBatchAsync`` batches over 8,192 descriptors have faulted (vLLM PR
43018). A batch route therefore splits a larger batch into pieces of at most a
per-platform cap, enqueued one after another on the same stream, so they run in order as
one batch would.

The cap is the bind parameter ``batch_chunk`` (``BindContext.params``, e.g. from a
calibration), else the platform's environment variable, else the platform's default.
"""
from __future__ import annotations

import os
from typing import Any, Iterator, Mapping, Optional

from kvswap.errors import ConfigurationError

PARAM = "batch_chunk"


def chunk_size(params: Mapping[str, Any], default: int, env_name: str,
               env: Optional[Mapping[str, str]] = None) -> int:
    """Descriptors per batch call: ``params["batch_chunk"]``, else ``$env_name``, else
    ``default``. Raises :class:`ConfigurationError` for anything but a positive int."""
    env = os.environ if env is None else env
    if params.get(PARAM) is not None:
        value, where = params[PARAM], PARAM
    elif env.get(env_name):
        value, where = env[env_name], env_name
    else:
        value, where = default, "default chunk"
    try:
        n = int(value)
        ok = not isinstance(value, bool) and n >= 1 and (not isinstance(value, float) or n == value)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigurationError(f"{where}={value!r} must be a positive number of descriptors (default {default})")
    return n


def pieces(count: int, chunk: int) -> Iterator[tuple[int, int]]:
    """``(first descriptor, descriptors)`` of each call for a batch of ``count``, in order."""
    for lo in range(0, count, chunk):
        yield lo, min(chunk, count - lo)
