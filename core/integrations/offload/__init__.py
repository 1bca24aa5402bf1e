"""The engine-neutral parts of kvswap's offloading integrations: no engine imported.

* :class:`OffloadWorker`: a block-major host cache kvswap allocates, a mover per direction,
  and the engine's jobs (stores, loads, results, counters);
* :func:`canonical_layout`: the tensors and KV groups to move, from vLLM's description;
* :func:`job_block_ids`: one job's block lists as the ids a mover takes;
* :class:`OffloadOptions`: kvswap's options as an engine's configuration carries them
  (:func:`chunks_for`, :func:`host_bytes`: its host memory).
"""
from __future__ import annotations

from .ids import device_block_ids, host_block_ids, job_block_ids
from .layout import CacheLayout, canonical_layout
from .options import OffloadOptions, chunks_for, host_bytes
from .worker import Counters, JobResult, OffloadWorker, route_summary

__all__ = [
    "CacheLayout",
    "Counters",
    "JobResult",
    "OffloadOptions",
    "OffloadWorker",
    "canonical_layout",
    "chunks_for",
    "device_block_ids",
    "host_block_ids",
    "host_bytes",
    "job_block_ids",
    "route_summary",
]
