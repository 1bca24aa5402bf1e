"""One offloading job's block lists to mover ids: the vectorised mapping against a reference
that walks logical positions one at a time, over random jobs (several groups, chunks of 1 to
8 blocks, groups starting and ending inside a chunk, empty groups), and every refusal."""
from __future__ import annotations

import numpy as np
import pytest

from kvswap import BlockIdError
from kvswap.integrations.offload import device_block_ids, host_block_ids, job_block_ids

from offload_jobs import DeviceSpec, HostSpec, random_job, reference_host_ids


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_random_jobs_match_the_reference(k):
    rng = np.random.default_rng(k)
    for _ in range(200):
        groups = int(rng.integers(1, 4))
        job = random_job(rng, list(range(400)), list(range(300)), k, groups, max_blocks=20)
        device, host = job_block_ids(job.device, job.host, k, groups)
        assert [list(zip(d.tolist(), h.tolist())) for d, h in zip(device, host)] == job.pairs
        assert all(d.dtype.kind == h.dtype.kind == "i" for d, h in zip(device, host))


def test_a_partly_covered_first_and_last_chunk():
    # Blocks 6..12 of a request, 4 a chunk: blocks 6, 7 are the second half of chunk 30,
    # 8..11 all of chunk 31, 12 the first quarter of chunk 32.
    (host,) = host_block_ids([30, 31, 32], [7], [6], 4)
    assert host.tolist() == [122, 123, 124, 125, 126, 127, 128]
    assert host.tolist() == reference_host_ids([30, 31, 32], [7], [6], 4)[0]


def test_groups_take_their_chunks_in_order_and_an_empty_group_takes_none():
    host = host_block_ids([5, 9, 2], [3, 0, 2], [1, 7, 2], 2)
    assert [h.tolist() for h in host] == [[11, 18, 19], [], [4, 5]]
    device = device_block_ids([4, 5, 6, 7, 8], [3, 0, 2])
    assert [d.tolist() for d in device] == [[4, 5, 6], [], [7, 8]]


def test_chunks_of_one_block_are_the_host_ids():
    chunks = np.array([17, 3, 8], dtype=np.int32)
    (host,) = host_block_ids(chunks, [3], [5], 1)
    assert host.tolist() == [17, 3, 8]


@pytest.mark.parametrize("chunks, sizes, starts, k, match", [
    ([1, 2], [3], [0], 4, "names 2 chunks but its groups cover 1"),
    ([1], [3], [2], 2, "group 0 needs chunks 0..1"),
    ([1, 2], [2, 1], [0], 2, "2 groups but block_indices has 1"),
    ([1, 2], [-1], [0], 2, "negative"),
    ([1.5], [1], [0], 2, "integers"),
    ([[1, 2]], [2], [0], 2, "1-D"),
    ([1], ["x"], [0], 1, "integers"),
])
def test_host_ids_refuse_lists_that_disagree(chunks, sizes, starts, k, match):
    with pytest.raises(BlockIdError, match=match):
        host_block_ids(chunks, sizes, starts, k)


def test_job_refuses_a_job_of_other_groups_or_sizes():
    with pytest.raises(BlockIdError, match="1 KV groups .* this worker moves 2"):
        job_block_ids(DeviceSpec(np.array([1]), [1], [0]), HostSpec(np.array([0])), 1, 2)
    with pytest.raises(BlockIdError, match="add up to 3 but the job names 2"):
        job_block_ids(DeviceSpec(np.array([1, 2]), [3], [0]), HostSpec(np.array([0, 1, 2])), 1, 1)
