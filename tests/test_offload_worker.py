"""The offloading worker on host memory, driven as vLLM drives it: stores and loads of random
jobs (several KV groups that share a tensor, padded pages, chunks of 1 and 4 blocks, groups
that start and end inside a chunk), every byte of both sides checked; refusals, failures,
counters, the counters file and the corrupted-load control."""
from __future__ import annotations

import json
import logging
import re

import numpy as np
import pytest
import torch

from kvswap import ConfigurationError, TransferResult
from kvswap.integrations.offload import OffloadOptions, OffloadWorker, canonical_layout

from offload_jobs import (
    CanonicalCaches, CanonicalTensor, DeviceSpec, HostSpec, Ref, expected_device, expected_host, random_job,
)

NUM_BLOCKS = 40
# Four tensors: pages of 96 bytes padded to 128, of 64, of 160 (two layers of different
# un-padded pages on it), of 32. Group 0 has layers on tensors 0, 1 and 2; group 1 on 2 and 3.
PADDED = (128, 64, 160, 32)
REFS = [[Ref(0, 96), Ref(1, 64), Ref(2, 144)], [Ref(2, 160), Ref(3, 32)]]
WIDTHS = (96, 64, 160, 32)


def caches(device: str = "cpu") -> CanonicalCaches:
    tensors = [CanonicalTensor(torch.randint(-128, 128, (NUM_BLOCKS, p), dtype=torch.int8, device=device), p)
               for p in PADDED]
    return CanonicalCaches(tensors, [list(r) for r in REFS])


def full(c: CanonicalCaches) -> list:
    return [t.tensor for t in c.tensors]


def test_layout_cuts_padding_and_names_each_shared_tensor_once():
    c = caches()
    layout = canonical_layout(c)
    assert [tuple(t.shape) for t in layout.tensors] == [(NUM_BLOCKS, w) for w in WIDTHS]
    assert layout.groups == ((0, 1, 2), (2, 3))
    assert layout.block_bytes == sum(WIDTHS)
    assert layout.tensors[0].data_ptr() == c.tensors[0].tensor.data_ptr()  # a view, not a copy


@pytest.mark.parametrize("k", [1, 4])
def test_stores_then_loads_move_exactly_the_job_bytes(k):
    rng = np.random.default_rng(k)
    c = caches()
    num_chunks = 24
    worker = OffloadWorker.from_canonical(c, num_chunks, k)
    host = worker.host
    assert host.num_blocks == num_chunks * k and host.block_bytes == sum(WIDTHS)
    host.buffer.copy_(torch.randint(0, 256, host.buffer.shape, dtype=torch.uint8))  # poison
    groups = worker.groups
    device_free, chunks_free = list(range(NUM_BLOCKS)), list(range(num_chunks))
    jobs = [random_job(rng, device_free, chunks_free, k, groups=2, max_blocks=7) for _ in range(3)]
    for n, job in enumerate(jobs):
        want = expected_host(host.buffer, host.offsets, WIDTHS, full(c), groups, job)
        assert worker.submit_store(100 + n, job.device, job.host)
        (r,) = worker.get_finished()
        blocks = [len(p) for p in job.pairs]
        assert (r.job_id, r.ok) == (100 + n, True)
        assert r.bytes == blocks[0] * sum(WIDTHS[:3]) + blocks[1] * sum(WIDTHS[2:])
        assert torch.equal(host.buffer, want), f"job {n}: the host cache differs from the reference"
    assert worker.counters["store"].jobs == 3 and worker.counters["store"].blocks == sum(
        len(p) for j in jobs for p in j.pairs)

    for t in full(c):  # poison the device side, padding included
        t.copy_(torch.randint(-128, 128, t.shape, dtype=torch.int8))
    for n, job in enumerate(jobs):
        want = expected_device(full(c), host.buffer, host.offsets, WIDTHS, groups, job)
        assert worker.submit_load(200 + n, job.host, job.device)
        (r,) = worker.get_finished()
        assert (r.job_id, r.ok) == (200 + n, True) and r.seconds >= 0
        for i, (got, exp) in enumerate(zip(full(c), want)):
            assert torch.equal(got, exp), f"job {n}: tensor {i} differs from the reference"
    worker.shutdown()


def test_a_chunk_is_one_host_region_over_every_tensor():
    worker = OffloadWorker.from_canonical(caches(), num_chunks=6, blocks_per_chunk=4)
    base = worker.host.buffer.data_ptr()
    for i, view in enumerate(worker.host.views):
        for h in (0, 5, 9, 23):
            assert view[h].data_ptr() - base == h * worker.host.block_bytes + worker.host.offsets[i]
    chunk = 3  # host blocks 12..15: one run of 4 * block_bytes
    assert worker.host.buffer[chunk * 4:(chunk + 1) * 4].is_contiguous()


def test_a_refused_job_moves_nothing_and_is_logged(caplog):
    c = caches()
    worker = OffloadWorker.from_canonical(c, num_chunks=4, blocks_per_chunk=2)
    before = [t.clone() for t in full(c)]
    host_before = worker.host.buffer.clone()
    bad = [
        (DeviceSpec(np.array([1, 2]), [2, 0], [0, 0]), HostSpec(np.array([7]))),  # chunk 7 of 4
        (DeviceSpec(np.array([1, 2]), [2, 0], [0, 0]), HostSpec(np.array([0, 1]))),  # a chunk too many
        (DeviceSpec(np.array([1, 2]), [3, 0], [0, 0]), HostSpec(np.array([0]))),  # sizes != ids
        (DeviceSpec(np.array([1, 2]), [2], [0]), HostSpec(np.array([0]))),  # one group of two
    ]
    with caplog.at_level(logging.ERROR):
        for n, (d, h) in enumerate(bad):
            assert worker.submit_load(n, h, d) is False
            assert worker.submit_store(10 + n, d, h) is False
        # A device block loaded twice; a host block (of the tensor both groups use) stored twice.
        assert not worker.submit_load(20, HostSpec(np.array([0])), DeviceSpec(np.array([1, 1]), [2, 0], [0, 0]))
        assert not worker.submit_store(21, DeviceSpec(np.array([1, 2]), [1, 1], [0, 0]), HostSpec(np.array([0, 0])))
    assert worker.get_finished() == []
    assert worker.counters["load"].refused == worker.counters["store"].refused == len(bad) + 1
    assert all(torch.equal(a, b) for a, b in zip(full(c), before)) and torch.equal(worker.host.buffer, host_before)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 * len(bad) + 2 and all(m.startswith("kvswap refused") for m in messages)
    assert "chunks [7]" in messages[0] and "device blocks [1, 2]" in messages[0]
    assert "BlockIdError" in messages[0] and "out of range" in messages[0]


def test_a_job_id_names_one_job_at_a_time_and_wait_skips_unknown_ids():
    worker = OffloadWorker.from_canonical(caches(), num_chunks=4, blocks_per_chunk=1)
    job = (DeviceSpec(np.array([3]), [1, 0], [0, 0]), HostSpec(np.array([2])))
    assert worker.submit_store(5, *job)
    assert not worker.submit_store(5, *job)  # still unreported
    worker.wait({5, 6, 99})
    assert [r.job_id for r in worker.get_finished()] == [5]
    assert worker.submit_store(5, *job)  # reported: the id is free again
    worker.shutdown()
    assert [r.job_id for r in worker.get_finished()] == [5]
    assert not worker.submit_store(6, *job)  # after shutdown
    worker.shutdown()  # idempotent


def test_a_failed_copy_is_reported_failed_and_logged(caplog, monkeypatch):
    worker = OffloadWorker.from_canonical(caches(), num_chunks=4, blocks_per_chunk=1)
    assert worker.submit_load(9, HostSpec(np.array([1])), DeviceSpec(np.array([3]), [1, 0], [0, 0]))
    (done,) = worker.load.poll()  # what the mover said, replaced by a driver failure
    failed = TransferResult(done.job_id, False, 0, 0.001, 1, "DriverError: cuMemcpyBatchAsync failed")
    monkeypatch.setattr(worker.load, "poll", lambda: [failed])
    with caplog.at_level(logging.ERROR):
        (r,) = worker.get_finished()
    assert (r.job_id, r.ok, r.bytes) == (9, False, 0) and "cuMemcpyBatchAsync" in r.error
    assert worker.counters["load"].failed == 1 and worker.counters["load"].jobs == 0
    assert any("load job 9 failed" in rec.getMessage() for rec in caplog.records)


def test_a_copy_that_raises_at_submit_is_refused_not_raised(caplog, monkeypatch):
    worker = OffloadWorker.from_canonical(caches(), num_chunks=4, blocks_per_chunk=1)

    def broken(*a, **k):
        raise RuntimeError("the copy route failed at launch")

    monkeypatch.setattr(worker.store, "submit", broken)
    with caplog.at_level(logging.ERROR):
        assert worker.submit_store(1, DeviceSpec(np.array([3]), [1, 0], [0, 0]), HostSpec(np.array([1]))) is False
    assert "failed at launch" in caplog.records[-1].getMessage()


def test_counters_file_follows_the_jobs(tmp_path):
    path = tmp_path / "kvswap-{rank}.json"
    options = OffloadOptions.parse({"stats_file": str(path)})
    worker = OffloadWorker.from_canonical(caches(), 4, 1, options, rank=3)
    written = tmp_path / "kvswap-3.json"
    assert json.loads(written.read_text())["store"]["jobs"] == 0
    assert worker.submit_store(1, DeviceSpec(np.array([3, 4]), [2, 0], [0, 0]), HostSpec(np.array([1, 2])))
    worker.get_finished()
    stats = json.loads(written.read_text())
    assert stats["store"]["jobs"] == 1 and stats["store"]["blocks"] == 2
    assert stats["store"]["bytes"] == 2 * sum(WIDTHS[:3]) and stats["load"]["jobs"] == 0
    assert stats["num_chunks"] == 4 and stats["groups"] == [[0, 1, 2], [2, 3]]


def test_corrupt_loads_overwrites_the_loaded_blocks_only():
    c = caches()
    worker = OffloadWorker.from_canonical(c, 4, 1, OffloadOptions(corrupt_loads=True))
    worker.host.buffer.copy_(torch.randint(0, 256, worker.host.buffer.shape, dtype=torch.uint8))
    before = [t.clone() for t in full(c)]
    assert worker.submit_load(1, HostSpec(np.array([2])), DeviceSpec(np.array([5]), [1, 0], [0, 0]))
    (r,) = worker.get_finished()
    assert r.ok
    for i, (t, b) in enumerate(zip(full(c), before)):
        others = torch.ones(NUM_BLOCKS, dtype=torch.bool)
        if i in (0, 1, 2):
            others[5] = False
            loaded = worker.host.buffer[2, worker.host.offsets[i]:worker.host.offsets[i] + WIDTHS[i]]
            assert not torch.equal(t[5, :WIDTHS[i]].view(torch.uint8), loaded)  # not what was loaded
        assert torch.equal(t[others], b[others])


def test_describe_and_explain_name_the_layout_and_both_routes():
    worker = OffloadWorker.from_canonical(caches(), 4, 2)
    line = worker.describe()
    assert "4 tensors in 2 KV group(s)" in line and "4 chunks of 2 block(s)" in line
    assert f"{sum(WIDTHS)} B a block" in line and "store d2h: " in line and "load h2d: " in line
    assert "host.reference" in line and "\n" not in line
    text = worker.explain()
    assert text.count("kvswap plan for") == 2 and "d2h" in text and "h2d" in text


@pytest.mark.parametrize("kw, match", [
    (dict(num_chunks=0, blocks_per_chunk=1), "num_chunks=0"),
    (dict(num_chunks=2, blocks_per_chunk=True), "blocks_per_chunk=True"),
])
def test_bad_counts_are_refused_before_anything_is_allocated(kw, match):
    with pytest.raises(ConfigurationError, match=match):
        OffloadWorker.from_canonical(caches(), **kw)


def test_groups_must_name_tensors():
    with pytest.raises(ConfigurationError, match="KV group 1"):
        OffloadWorker([torch.zeros(4, 8, dtype=torch.int8)], [(0,), (1,)], 2, 1)


def test_layers_sharing_a_tensor_in_one_group_move_it_once():
    t = torch.randint(-128, 128, (8, 256), dtype=torch.int8)
    packed = CanonicalCaches([CanonicalTensor(t, 256)], [[Ref(0, 200), Ref(0, 256)], [Ref(0, 256)]])
    layout = canonical_layout(packed)
    assert layout.groups == ((0,), (0,)) and [tuple(v.shape) for v in layout.tensors] == [(8, 256)]


@pytest.mark.parametrize("refs, match", [
    ([[Ref(3, 64)]], "refers to tensor 3"),
    ([[Ref(0, 200)]], "pages of 128 bytes but a layer's page takes 200"),
    ([[]], "KV group 0 has no layer"),
    ([], "no KV group"),
])
def test_a_layout_that_cannot_be_moved_is_refused(refs, match):
    from kvswap import BlockLayoutError

    c = CanonicalCaches([CanonicalTensor(torch.zeros(4, 128, dtype=torch.int8), 128)], refs)
    with pytest.raises(BlockLayoutError, match=match):
        canonical_layout(c)


@pytest.mark.parametrize("k", [1, 3, 4])
def test_one_groups_ids_map_as_the_checked_path_maps_them(k):
    """A one-group worker maps a job's ids on its own short path: the same host block for
    every device block as the reference, the engine's device array passed as it is (the
    mover widens it); a job that path does not recognise goes to the checked path, which
    refuses it by name."""
    from kvswap import BlockIdError
    from kvswap.integrations.offload.ids import job_block_ids

    rng = np.random.default_rng(30 + k)
    tensors = [torch.randint(-128, 128, (NUM_BLOCKS, w), dtype=torch.int8) for w in (64, 96)]
    worker = OffloadWorker(tensors, [(0, 1)], 12, k)
    for _ in range(40):
        job = random_job(rng, list(range(NUM_BLOCKS)), list(range(12)), k, groups=1, max_blocks=9)
        for cast in (np.int32, np.int64):
            dev_spec = DeviceSpec(job.device.block_ids.astype(cast), job.device.group_sizes,
                                  job.device.block_indices)
            host_spec = HostSpec(job.host.block_ids.astype(cast))
            (dev,), (host,) = worker._ids(dev_spec, host_spec)
            assert dev is dev_spec.block_ids and host.dtype == (np.int64 if k > 1 else cast)
            assert list(zip(dev.tolist(), host.tolist())) == job.pairs[0]
            (ref_dev,), (ref_host,) = job_block_ids(dev_spec, host_spec, k, 1)
            assert np.array_equal(dev, ref_dev) and np.array_equal(host, ref_host)
    short = DeviceSpec(np.arange(5, dtype=np.int32), [5], [k - 1])
    with pytest.raises(BlockIdError, match="chunks"):
        worker._ids(short, HostSpec(np.zeros(1 if k > 1 else 4, dtype=np.int32)))
    before = worker.host.buffer.clone()
    for chunk in (-1, 12, 2**31 - 1):  # negative or past the cache: refused, nothing moved
        chunks = np.full(-(-2 // k), chunk, dtype=np.int32)
        assert not worker.submit_store(999, DeviceSpec(np.arange(2, dtype=np.int32), [2], [0]), HostSpec(chunks))
    assert torch.equal(worker.host.buffer, before) and worker.counters["store"].refused == 3
    if k > 1:  # where the first block's place in its chunk matters, it must be one
        with pytest.raises(BlockIdError, match="negative"):
            worker._ids(DeviceSpec(np.arange(2), [2], [-1]), HostSpec(np.arange(2)))
    worker.shutdown()


@pytest.mark.parametrize("shape, page", [
    ((2, NUM_BLOCKS, 64), 128),  # K and V first, blocks second
    ((NUM_BLOCKS, 128), 64),  # a page size that is half the tensor's
    ((NUM_BLOCKS, 128), 256),  # a page size that is two of the tensor's blocks
    ((), 1),  # no block dimension
])
def test_a_tensor_whose_blocks_are_not_pages_of_its_first_dimension_is_refused(shape, page):
    """Cut into pages that are not its blocks, such a tensor would move the wrong bytes."""
    from kvswap import BlockLayoutError

    t = torch.randint(-128, 128, shape, dtype=torch.int8)
    with pytest.raises(BlockLayoutError, match=rf"tensor 0 \(torch.int8, shape {re.escape(str(tuple(shape)))}\) "
                                               rf"must hold one {page}-byte page per block"):
        canonical_layout(CanonicalCaches([CanonicalTensor(t, page)], [[Ref(0, page)]]))


def test_a_route_that_raises_at_launch_is_a_failed_job_not_a_refused_one(caplog, monkeypatch):
    c = caches()
    worker = OffloadWorker.from_canonical(c, num_chunks=4, blocks_per_chunk=1)
    worker.host.buffer.copy_(torch.randint(0, 256, worker.host.buffer.shape, dtype=torch.uint8))  # poison
    host_before = worker.host.buffer.clone()

    def broken(*a, **k):
        raise RuntimeError("the copy route failed at launch")

    monkeypatch.setattr(worker.store.swap_fn, "call_built", broken)
    with caplog.at_level(logging.ERROR):
        assert worker.submit_store(1, DeviceSpec(np.array([3]), [1, 0], [0, 0]), HostSpec(np.array([1]))) is False
    counters = worker.counters["store"]
    assert (counters.failed, counters.refused, counters.jobs) == (1, 0, 0)
    message = caplog.records[-1].getMessage()
    assert "failed to launch store job 1" in message and "RuntimeError: the copy route failed at launch" in message
    assert torch.equal(worker.host.buffer, host_before)
    assert worker.get_finished() == []  # reported once, at submit
    monkeypatch.undo()  # the route works again: so does the worker
    assert worker.submit_store(2, DeviceSpec(np.array([3]), [1, 0], [0, 0]), HostSpec(np.array([1])))
    assert [(r.job_id, r.ok) for r in worker.get_finished()] == [(2, True)]
    worker.shutdown()


def test_jobs_of_a_mover_that_cannot_be_polled_are_reported_failed_not_left_in_flight(caplog, monkeypatch):
    """The engine waits for every job it submitted: one never reported would hang its request."""
    worker = OffloadWorker.from_canonical(caches(), num_chunks=4, blocks_per_chunk=1)
    assert worker.submit_load(7, HostSpec(np.array([1])), DeviceSpec(np.array([3]), [1, 0], [0, 0]))
    assert worker.submit_load(8, HostSpec(np.array([2])), DeviceSpec(np.array([4]), [1, 0], [0, 0]))

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(worker.load, "poll", broken)
    with caplog.at_level(logging.ERROR):
        results = worker.get_finished()
    assert [(r.job_id, r.ok, r.bytes) for r in results] == [(7, False, 0), (8, False, 0)]
    assert all("could not poll" in r.error and "illegal memory access" in r.error for r in results)
    assert "load job(s) [7, 8] failed" in caplog.records[-1].getMessage()
    assert worker.counters["load"].failed == 2 and worker.get_finished() == []
    monkeypatch.undo()  # the mover's own results of those jobs come later: each job is reported once
    assert worker.get_finished() == []
    assert worker.submit_load(7, HostSpec(np.array([1])), DeviceSpec(np.array([3]), [1, 0], [0, 0]))
    assert [(r.job_id, r.ok) for r in worker.get_finished()] == [(7, True)]
    worker.shutdown()


def test_a_job_that_cannot_be_waited_for_is_reported_failed_not_done(caplog, monkeypatch):
    """vLLM waits for stores before it reuses their blocks: a wait that did not hold must not
    end in a job reported done, whose host copy may hold the blocks' next contents."""
    worker = OffloadWorker.from_canonical(caches(), num_chunks=4, blocks_per_chunk=1)
    assert worker.submit_store(3, DeviceSpec(np.array([5]), [1, 0], [0, 0]), HostSpec(np.array([0])))
    assert worker.submit_store(4, DeviceSpec(np.array([6]), [1, 0], [0, 0]), HostSpec(np.array([1])))

    def broken(job_id=None):
        raise RuntimeError("CUDA error: unspecified launch failure")

    monkeypatch.setattr(worker.store, "wait", broken)
    with caplog.at_level(logging.ERROR):
        worker.wait({3})
    assert "store job(s) [3] failed: could not wait for it" in caplog.records[-1].getMessage()
    monkeypatch.undo()
    results = worker.get_finished()
    assert [(r.job_id, r.ok) for r in results] == [(3, False), (4, True)]
    assert "unspecified launch failure" in results[0].error
    assert worker.counters["store"].failed == 1 and worker.counters["store"].jobs == 1
    worker.shutdown()


@pytest.mark.parametrize("where", ["missing/kvswap.json", "."])
def test_a_counters_file_that_cannot_be_written_is_refused_at_start(tmp_path, where):
    options = OffloadOptions.parse({"stats_file": str(tmp_path / where)})
    with pytest.raises(ConfigurationError, match=r"stats_file=.*(cannot write|is a directory)"):
        OffloadWorker.from_canonical(caches(), 4, 1, options)
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_a_host_cache_larger_than_memory_is_kvswaps_allocation_error():
    """A few zeros too many in the engine's host memory setting: kvswap's error, not numpy's."""
    from kvswap import AllocationError

    with pytest.raises(AllocationError, match="could not allocate .* bytes of host memory"):
        OffloadWorker.from_canonical(caches(), num_chunks=10**15, blocks_per_chunk=1)
