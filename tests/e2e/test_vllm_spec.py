"""kvswap's spec through vLLM's own classes, without an engine: vLLM's factory loads it from
``spec_module_path``; it builds vLLM's CPU manager and kvswap's worker; the worker takes
vLLM's ``GPULoadStoreSpec``/``CPULoadStoreSpec`` (chunks of several blocks, a group starting
inside its first chunk, two groups sharing a tensor, padded pages) and answers with vLLM's
``TransferResult``; every byte is checked. Bad kvswap options fail when vLLM builds the spec.

Run in the environment ``.ci/vllm-setup`` makes; skips where vLLM is absent, unless
KVSWAP_REQUIRE_VLLM=1.
"""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("KVSWAP_REQUIRE_VLLM") == "1":
        pytest.fail("KVSWAP_REQUIRE_VLLM=1 but vLLM is not installed here", pytrace=False)
    pytest.skip("vLLM is not installed (bash .ci/vllm-setup makes .venv-vllm with it)", allow_module_level=True)

import torch  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec, OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig, OffloadingModelConfig, OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

from kvswap import ConfigurationError  # noqa: E402
from kvswap.integrations.vllm import KvswapOffloadingSpec, KvswapOffloadingWorker  # noqa: E402

from offload_jobs import Job, expected_device, expected_host, reference_host_ids  # noqa: E402

PADDED, UNPADDED = (6144, 4096, 4096), (6000, 4096, 4096)
BLOCKS = 32
BYTES_PER_BLOCK = sum(PADDED)


def offloading_config(k: int, extra: dict, world_size: int = 1, canonical: bool = False) -> OffloadingConfig:
    extra = {"spec_name": "KvswapOffloadingSpec", "spec_module_path": "kvswap.integrations.vllm",
             "cpu_bytes_to_use": 40 * k * BYTES_PER_BLOCK * world_size + 123, **extra}
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("l0", "l1"), 0), OffloadingGroupConfig(16, ("l2", "l3"), 1)),
        worker_kv_bytes_per_block=BYTES_PER_BLOCK, enable_kv_cache_events=False, extra_config=extra,
        engine_id="e2e", model=OffloadingModelConfig("tiny", "float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=k),
        parallel=OffloadingParallelConfig(rank=0, world_size=world_size, tp_size=world_size, pp_size=1, pcp_size=1,
                                          dcp_size=1, data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True),
        canonical_layout=canonical,
    )


def canonical_caches() -> CanonicalKVCaches:
    # Tensor 0 padded; tensor 2 holds a layer of each group (groups overlaying one pool).
    tensors = [CanonicalKVCacheTensor(torch.randint(-128, 128, (BLOCKS, p), dtype=torch.int8), p) for p in PADDED]
    refs = [[CanonicalKVCacheRef(0, UNPADDED[0]), CanonicalKVCacheRef(2, UNPADDED[2])],
            [CanonicalKVCacheRef(1, UNPADDED[1]), CanonicalKVCacheRef(2, UNPADDED[2])]]
    return CanonicalKVCaches(tensors, refs)


def test_vllms_factory_loads_the_spec_with_vllms_manager():
    spec = OffloadingSpecFactory.create_spec(offloading_config(4, {"kvswap": {"max_sms": 4}}))
    assert type(spec) is KvswapOffloadingSpec and spec.kvswap_options.policy.max_sms == 4
    assert spec.num_chunks == 40 and spec.replicated_layout is False
    assert isinstance(spec.get_manager(), CPUOffloadingManager)
    two = KvswapOffloadingSpec(offloading_config(4, {}, world_size=2))
    assert two.num_chunks == 40  # cpu_bytes_to_use is shared by the workers


@pytest.mark.parametrize("extra, match", [
    ({"kvswap": {"max_sm": 4}}, r'kv_connector_extra_config\["kvswap"\]: unknown option\(s\) \'max_sm\''),
    ({"kvswap": {"prefer": "fast"}}, r"Policy.prefer='fast'"),
    ({"kvswap": "max_sms=4"}, "must be a mapping"),
    ({"cpu_bytes_to_use": 10}, "holds no chunk"),
])
def test_bad_options_fail_when_vllm_builds_the_spec(extra, match):
    with pytest.raises(ConfigurationError, match=match):
        OffloadingSpecFactory.create_spec(offloading_config(2, extra))


def test_canonical_layout_is_refused():
    with pytest.raises(ConfigurationError, match="canonical_layout"):
        KvswapOffloadingSpec(offloading_config(1, {}, canonical=True))


def vllm_job(dev: list[list[int]], starts: list[int], chunks: list[int], k: int) -> tuple:
    sizes = [len(d) for d in dev]
    gpu = GPULoadStoreSpec([b for d in dev for b in d], group_sizes=sizes, block_indices=starts)
    cpu = CPULoadStoreSpec(chunks)
    host = reference_host_ids(chunks, sizes, starts, k)
    return gpu, cpu, Job(gpu, cpu, [list(zip(d, h)) for d, h in zip(dev, host)])


@pytest.mark.parametrize("k", [1, 4])
def test_the_worker_takes_vllms_specs_and_answers_with_transfer_results(k):
    spec = KvswapOffloadingSpec(offloading_config(k, {}))
    caches = canonical_caches()
    worker = spec.get_worker(caches)
    assert isinstance(worker, KvswapOffloadingWorker) and isinstance(worker, OffloadingWorker)
    assert spec.get_worker(caches) is worker  # built once
    inner = worker.kvswap
    host, groups = inner.host, inner.groups
    assert groups == [(0, 2), (1, 2)] and host.block_bytes == sum(UNPADDED)
    host.buffer.copy_(torch.randint(0, 256, host.buffer.shape, dtype=torch.uint8))
    full = [t.tensor for t in caches.tensors]
    # Group 0: logical blocks 5..10 (from inside a chunk where k = 4: 2 chunks); group 1: 0..2.
    chunks = {1: [7, 8, 9, 10, 11, 12, 31, 32, 33], 4: [7, 8, 9]}[k]
    gpu, cpu, job = vllm_job([[3, 9, 4, 17, 20, 1], [30, 2, 11]], [5, 0], chunks, k)
    want = expected_host(host.buffer, host.offsets, UNPADDED, full, groups, job)
    assert worker.submit_store(11, gpu, cpu) is True
    worker.wait({11})
    (r,) = worker.get_finished()
    assert isinstance(r, TransferResult) and (r.job_id, r.success) == (11, True)
    assert r.transfer_size == 6 * (UNPADDED[0] + UNPADDED[2]) + 3 * (UNPADDED[1] + UNPADDED[2])
    assert r.transfer_time is not None and r.transfer_time >= 0
    assert torch.equal(host.buffer, want)

    for t in full:
        t.copy_(torch.randint(-128, 128, t.shape, dtype=torch.int8))
    want_device = expected_device(full, host.buffer, host.offsets, UNPADDED, groups, job)
    assert worker.submit_load(12, cpu, gpu) is True
    (r,) = worker.get_finished()
    assert (r.job_id, r.success) == (12, True)
    assert all(torch.equal(a, b) for a, b in zip(full, want_device))

    assert worker.submit_load(13, CPULoadStoreSpec([10_000]), GPULoadStoreSpec([0], [1, 0], [0, 0])) is False
    worker.shutdown()
    assert inner.counters["store"].jobs == inner.counters["load"].jobs == 1
    assert inner.counters["load"].refused == 1
    assert np.array_equal(gpu.block_ids, np.array([3, 9, 4, 17, 20, 1, 30, 2, 11]))  # the spec is untouched
