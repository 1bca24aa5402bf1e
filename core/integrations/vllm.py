"""kvswap as vLLM's KV offloading: a spec for vLLM's OffloadingConnector.

vLLM's OffloadingConnector loads an offloading spec from any module named in its extra
config (``spec_name``, ``spec_module_path``; ``vllm/v1/kv_offload/factory.py``)::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "KvswapOffloadingSpec",
        "spec_module_path": "kvswap.integrations.vllm", "cpu_bytes_to_use": 8000000000}}'

The spec keeps vLLM's scheduler side as it is (the CPU spec's manager: its eviction
policies, events and metrics), and replaces the worker: kvswap allocates the host cache
(block-major: a chunk's bytes over every layer are one host region) and runs every store
and load through two :class:`kvswap.BlockMover`s built once over vLLM's canonical tensors.
kvswap's options go in ``kv_connector_extra_config["kvswap"]`` (see
:class:`kvswap.integrations.offload.OffloadOptions`); a bad one stops the engine at start.

This module imports vLLM; nothing else in kvswap does. Tested with vLLM 0.32.0, whose
offloading API vLLM calls experimental.
"""
from __future__ import annotations

from typing import Any

import vllm

from .. import ConfigurationError, __version__
from .offload import OffloadOptions, OffloadWorker, chunks_for, host_bytes

__all__ = ["KvswapOffloadingSpec", "KvswapOffloadingWorker", "TESTED_VLLM", "OPTIONS_KEY"]

TESTED_VLLM = "0.32.0"
OPTIONS_KEY = "kvswap"  # kv_connector_extra_config[OPTIONS_KEY]: kvswap's options
CPU_BYTES = 'kv_connector_extra_config["cpu_bytes_to_use"]'

try:
    from vllm.logger import init_logger
    from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingWorker, TransferResult
    from vllm.v1.kv_offload.config import OffloadingConfig
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
except ImportError as e:  # another vLLM, whose experimental offloading API moved: say which one
    raise ImportError(f"kvswap's offloading spec is tested with vLLM {TESTED_VLLM}; this is vLLM "
                      f"{getattr(vllm, '__version__', 'of no version')}, whose offloading API differs: {e}") from e
# Under vLLM's logger, so that its handler and format (and VLLM_LOGGING_LEVEL) apply.
logger = init_logger("vllm.kvswap")


class KvswapOffloadingWorker(OffloadingWorker):
    """vLLM's worker interface over a :class:`~kvswap.integrations.offload.OffloadWorker`.

    vLLM's GPU spec carries the device blocks (``block_ids``, ``group_sizes``,
    ``block_indices``); its CPU spec carries chunk ids. Results become vLLM's
    ``TransferResult`` with the job's success, bytes and seconds.
    """

    def __init__(self, worker: OffloadWorker) -> None:
        self.kvswap = worker

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self.kvswap.submit_store(job_id, src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self.kvswap.submit_load(job_id, src_spec, dst_spec)

    def get_finished(self) -> list[TransferResult]:
        return [TransferResult(job_id=r.job_id, success=r.ok, transfer_size=r.bytes, transfer_time=r.seconds)
                for r in self.kvswap.get_finished()]

    def wait(self, job_ids: set[int]) -> None:
        self.kvswap.wait(job_ids)

    def shutdown(self) -> None:
        self.kvswap.shutdown()


class KvswapOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading with kvswap's worker and host cache.

    Extra config read here, beside vLLM's own keys (``cpu_bytes_to_use``,
    ``blocks_per_chunk`` or ``block_size``, ``eviction_policy``, ...):

    * ``kvswap``: a JSON object of kvswap options: every :class:`kvswap.Policy` field
      (``max_sms``, ``prefer``, ``force``, ...), ``numa_node``, ``stats_file``.

    ``cpu_bytes_to_use`` is host memory for all of the engine's workers together; each
    keeps its own cache of ``cpu_bytes_to_use / world_size`` at most.

    :raises ConfigurationError: a bad kvswap option, a ``cpu_bytes_to_use`` that is not a
        number of bytes or holds no chunk, or ``canonical_layout`` (kvswap keeps its own host
        layout), when vLLM builds the spec: at engine start.
    """

    def __init__(self, config: OffloadingConfig) -> None:
        # First: should another vLLM's config or spec break what follows, the log says why.
        if vllm.__version__.split(".")[:2] != TESTED_VLLM.split(".")[:2]:
            logger.warning("kvswap's offloading spec is tested with vLLM %s; this is vLLM %s, whose experimental "
                           "offloading API may differ", TESTED_VLLM, vllm.__version__)
        extra = config.extra_config
        self.kvswap_options = OffloadOptions.parse(extra.get(OPTIONS_KEY),
                                                   where=f'kv_connector_extra_config["{OPTIONS_KEY}"]')
        if config.canonical_layout:
            raise ConfigurationError('kv_connector_extra_config["canonical_layout"]: kvswap lays out its host '
                                     "cache itself (block-major); leave canonical_layout out")
        host_bytes(extra.get("cpu_bytes_to_use"), CPU_BYTES)  # before vLLM's own int() of it, named
        super().__init__(config)
        # Each worker rank holds its own host cache, so each stores its own blocks; vLLM's
        # replicated layout (one copy shared through a /dev/shm region) does not apply.
        self.replicated_layout = False
        if config.worker_kv_bytes_per_block > 0:
            self.num_chunks = chunks_for(extra.get("cpu_bytes_to_use"), config.worker_kv_bytes_per_block,
                                         self.blocks_per_chunk, config.parallel.world_size, CPU_BYTES)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            worker = OffloadWorker.from_canonical(kv_caches, self.num_chunks, self.blocks_per_chunk,
                                                  self.kvswap_options, rank=self.config.parallel.rank, log=logger)
            logger.info("kvswap %s is active for KV offloading: %s", __version__, worker.describe())
            logger.debug("kvswap routes:\n%s", worker.explain())
            self._worker = KvswapOffloadingWorker(worker)  # type: ignore[assignment]
        return self._worker
