"""kvswap's vLLM offloading worker on a GPU, driven with what vLLM passes it (GPU).

vLLM's wheels are not needed: the worker is driven through kvswap's engine-neutral worker
with stand-ins carrying the same fields (``block_ids``, ``group_sizes``, ``block_indices``;
canonical ``(num_blocks, page_size_bytes)`` int8 tensors), over llama-3.1-8b-shaped caches
(32 layers, a page of K and V for 16 tokens of 8 heads of 128 bf16: 64 KiB), and over a
layout with padded pages and two KV groups that share a tensor. Several stores, then several
loads, are in flight together, chunks of 1 and 4 blocks, groups starting inside a chunk;
random data, poisoned destinations, every byte of the device caches and of the host cache
compared with the reference.

    python -m pytest -m gpu tests/test_vllm_worker_gpu.py
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kvswap.integrations.offload import OffloadOptions, OffloadWorker

from offload_jobs import CanonicalCaches, CanonicalTensor, Ref, expected_device, expected_host, random_job

pytestmark = pytest.mark.gpu

LLAMA_LAYERS, LLAMA_PAGE = 32, 2 * 16 * 8 * 128 * 2
DEVICE_BLOCKS = 256


def llama_caches(device: torch.device) -> CanonicalCaches:
    tensors = [CanonicalTensor(torch.randint(-128, 128, (DEVICE_BLOCKS, LLAMA_PAGE), dtype=torch.int8, device=device),
                               LLAMA_PAGE) for _ in range(LLAMA_LAYERS)]
    return CanonicalCaches(tensors, [[Ref(i, LLAMA_PAGE) for i in range(LLAMA_LAYERS)]])


def mixed_caches(device: torch.device) -> CanonicalCaches:
    """Pages padded (40 KiB used of 48), a tensor that two groups' layers share, 4 KiB pages."""
    padded = (48 << 10, 64 << 10, 4 << 10, 64 << 10)
    tensors = [CanonicalTensor(torch.randint(-128, 128, (DEVICE_BLOCKS, p), dtype=torch.int8, device=device), p)
               for p in padded]
    refs = [[Ref(0, 40 << 10), Ref(1, 64 << 10), Ref(3, 64 << 10)], [Ref(2, 4 << 10), Ref(3, 60 << 10)]]
    return CanonicalCaches(tensors, refs)


def finish_all(worker: OffloadWorker, job_ids: set[int], timeout: float = 60.0) -> list:
    worker.wait(job_ids)
    results, deadline = [], time.monotonic() + timeout
    while {r.job_id for r in results} != job_ids:
        assert time.monotonic() < deadline, f"jobs {job_ids - {r.job_id for r in results}} never finished"
        results += worker.get_finished()
    return results


def run_jobs(caches: CanonicalCaches, k: int, num_chunks: int, options: OffloadOptions, jobs_in_flight: int,
             max_blocks: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    worker = OffloadWorker.from_canonical(caches, num_chunks, k, options)
    print(f"\nk={k} {options.policy}: {worker.describe()}")
    host = worker.host
    assert host.buffer.is_pinned()
    widths = [int(t.shape[1]) for t in worker.tensors]
    full = [c.tensor for c in caches.tensors]
    layout_index = sorted({r.tensor_idx for refs in caches.group_data_refs for r in refs})
    assert layout_index == list(range(len(full)))  # every tensor is used: worker indices are vLLM's
    groups = worker.groups
    host.buffer.copy_(torch.randint(0, 256, host.buffer.shape, dtype=torch.uint8))  # poison
    device_free, chunks_free = list(range(DEVICE_BLOCKS)), list(range(num_chunks))
    jobs = [random_job(rng, device_free, chunks_free, k, len(groups), max_blocks) for _ in range(jobs_in_flight)]
    group_bytes = [sum(widths[i] for i in g) for g in groups]

    want = host.buffer.clone()
    device_cpu = [t.cpu() for t in full]
    for job in jobs:
        want = expected_host(want, host.offsets, widths, device_cpu, groups, job)
    torch.cuda.synchronize()
    for n, job in enumerate(jobs):
        assert worker.submit_store(1000 + n, job.device, job.host)
    results = finish_all(worker, {1000 + n for n in range(len(jobs))})
    for r in results:
        job = jobs[r.job_id - 1000]
        assert r.ok, r.error
        assert r.bytes == sum(len(p) * b for p, b in zip(job.pairs, group_bytes)) and r.seconds > 0
    assert torch.equal(host.buffer, want), "the host cache differs from the reference after the stores"

    for t in full:  # poison every device byte, padding included
        t.copy_(torch.randint(-128, 128, t.shape, dtype=torch.int8, device=t.device))
    want_device = [t.cpu() for t in full]
    for job in jobs:
        want_device = expected_device(want_device, host.buffer, host.offsets, widths, groups, job)
    torch.cuda.synchronize()
    for n, job in enumerate(jobs):
        assert worker.submit_load(2000 + n, job.host, job.device)
    for r in finish_all(worker, {2000 + n for n in range(len(jobs))}):
        assert r.ok, r.error
    for i, (got, exp) in enumerate(zip(full, want_device)):
        assert torch.equal(got.cpu(), exp), f"device tensor {i} differs from the reference after the loads"
    assert worker.counters["store"].jobs == worker.counters["load"].jobs == len(jobs)
    assert worker.counters["store"].failed == worker.counters["load"].refused == 0
    worker.shutdown()


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("policy", [{}, {"force": "cuda.batch"}, {"max_sms": 0}], ids=["default", "batch", "no-sms"])
def test_llama_shaped_stores_and_loads(k, policy):
    caches = llama_caches(torch.device("cuda", 0))
    run_jobs(caches, k, num_chunks=128 // k * 2, options=OffloadOptions.parse(policy), jobs_in_flight=6,
             max_blocks=32, seed=k)


@pytest.mark.parametrize("k", [1, 4])
def test_padded_pages_and_groups_sharing_a_tensor(k):
    caches = mixed_caches(torch.device("cuda", 0))
    run_jobs(caches, k, num_chunks=200 // k, options=OffloadOptions(), jobs_in_flight=5, max_blocks=16, seed=10 + k)
