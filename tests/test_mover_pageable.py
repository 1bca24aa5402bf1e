"""Pageable host memory through bounce buffers, and what a job waits for (``after=``),
on the host: a stand-in route that declares it needs pinned memory makes a host-only
mover carry its pageable tensors through bounce buffers exactly as a GPU mover does."""
from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Any

import numpy as np
import pytest
import torch

from kvswap import BlockMover, ConfigurationError, CopyImpl, Direction, PageableMemoryWarning, Policy, hookimpl
from kvswap.errors import UnpinnedMemoryError
from kvswap.registry.plugins import create_plugin_host, reset_plugin_host
from kvswap.registry.reference import host_copy
from mover_shapes import KINDS, Side, expected_after

TOKENS = 4
MIXED = [KINDS["flash"], KINDS["mla"], KINDS["flashinfer"]]


class Recorder:
    """A route that copies on the host and keeps every descriptor it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.gate: Any = None

    def __call__(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, stream: Any = None) -> None:
        self.calls.append((src.copy(), dst.copy(), sizes.copy()))
        if self.gate is None:
            host_copy(src, dst, sizes)
        else:
            self.gate.queue.append((src.copy(), dst.copy(), sizes.copy()))


def _install(route: Recorder) -> None:
    class Plugin:
        @hookimpl
        def kvswap_register_copy_impls(self, platform, register):
            if platform == "cpu":
                register(CopyImpl(name="test.pinned", kind="batch", platforms=("cpu",),
                                  directions=(Direction.H2D, Direction.D2H), factory=lambda ctx: route,
                                  requires_pinned=True))

    reset_plugin_host(create_plugin_host(entry_points=[], env={}, extra=[("testplugin", Plugin())]))


def _inside(addrs: np.ndarray, tensors: list[torch.Tensor]) -> np.ndarray:
    hit = np.zeros(len(addrs), dtype=bool)
    for t in tensors:
        lo = t.untyped_storage().data_ptr()
        hit |= (addrs >= lo) & (addrs < lo + t.untyped_storage().nbytes())
    return hit


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_pageable_host_tensors_are_staged_with_one_warning(direction):
    route = Recorder()
    _install(route)
    gen, rng = torch.Generator().manual_seed(51), np.random.default_rng(51)
    host, device = Side(MIXED, 9, 3 * TOKENS, gen, pad=64), Side(MIXED, 25, TOKENS, gen)
    src, dst = (host, device) if direction == "h2d" else (device, host)
    before, src_before = dst.snapshot(), src.snapshot()
    with pytest.warns(PageableMemoryWarning, match="3 of the 3 host tensor\\(s\\) of this .* are pageable") as got:
        mover = BlockMover(src.tensors, dst.tensors, direction, block_dim=[1, 0, 0],
                           policy=Policy(force="test.pinned"))
    assert len(got) == 1 and mover.bounces_host_memory and mover.block_size_factor == 3
    jobs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once, at construction: never per submit
        for n in (5, 25, 1, 0, 12):
            sid = rng.choice(mover.num_src_blocks, n, replace=False)
            did = rng.choice(mover.num_dst_blocks, n, replace=False)
            mover.submit(sid, did)
            jobs.append((sid, did))
        mover.close()
    results = mover.poll()
    assert [r.bytes for r in results] == [len(s) * mover.block_bytes for s, _ in jobs] and all(r.ok for r in results)
    assert dst.matches(expected_after(src, src_before, dst, before, jobs))
    assert src.matches(src_before)
    host_row = 0 if direction == "h2d" else 1
    for call in route.calls:  # the route only ever saw bounce addresses on the host side
        assert not _inside(call[host_row], host.flats).any()
        assert _inside(call[1 - host_row], device.flats).all()
    assert mover._plan.bounce.pool.in_use == 0


class Gate:
    """A completion whose device copies run only when the test opens the gate (from any
    thread), so a device-to-host job can be seen before its bytes are in place."""

    stream = None

    def __init__(self) -> None:
        self.queue: list = []
        self.opened = threading.Event()

    def check_after(self, after) -> None:
        pass

    def order_after(self, after) -> None:
        pass

    def device_guard(self):
        return contextlib.nullcontext()

    def mark(self) -> int:
        return 0

    def done(self, marker) -> bool:
        return self.opened.is_set()

    def wait(self, marker) -> None:
        self.opened.wait(10)

    def seconds(self, start, end) -> float:
        return 0.0

    def recycle(self, *markers) -> None:
        pass

    def open(self) -> None:
        for s, d, n in self.queue:
            host_copy(s, d, n)
        self.opened.set()


def test_a_device_to_host_job_completes_only_once_its_bytes_are_in_pageable_memory():
    route = Recorder()
    _install(route)
    gen = torch.Generator().manual_seed(52)
    device, host = Side([KINDS["flash"]], 12, TOKENS, gen), Side([KINDS["flash"]], 12, TOKENS, gen)
    before, src_before = host.snapshot(), device.snapshot()
    with pytest.warns(PageableMemoryWarning):
        mover = BlockMover(device.tensors, host.tensors, "d2h", block_dim=1, policy=Policy(force="test.pinned"))
    gate = route.gate = mover._plan.completion = Gate()
    job = mover.submit([3, 0, 7], [1, 11, 4])
    assert mover.poll() == [] and host.matches(before) and mover.in_flight == 1
    gate.open()
    mover.wait(job)
    (r,) = mover.poll()
    assert r.ok and r.job_id == job and r.bytes == 3 * mover.block_bytes
    assert host.matches(expected_after(device, src_before, host, before, [([3, 0, 7], [1, 11, 4])]))
    mover.close()


def test_strict_policy_refuses_pageable_memory_and_checks_its_type():
    _install(Recorder())
    gen = torch.Generator().manual_seed(53)
    host, device = Side([KINDS["mla"]], 6, TOKENS, gen), Side([KINDS["mla"]], 6, TOKENS, gen)
    with pytest.raises(UnpinnedMemoryError, match="src_tensors\\[0\\] is pageable .* require_pinned=True"):
        BlockMover(host.tensors, device.tensors, "h2d", policy=Policy(force="test.pinned", require_pinned=True))
    with pytest.raises(ConfigurationError, match="require_pinned=1 must be True or False"):
        Policy(require_pinned=1)


def test_a_host_only_mover_with_the_reference_route_needs_no_bounce_buffers():
    gen = torch.Generator().manual_seed(54)
    host, device = Side([KINDS["mla"]], 6, TOKENS, gen), Side([KINDS["mla"]], 6, TOKENS, gen)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mover = BlockMover(host.tensors, device.tensors, "h2d")
    assert not mover.bounces_host_memory


# -- after= ------------------------------------------------------------------------------
class FakeStream:
    cuda_stream = 1234

    def wait_stream(self, other) -> None:
        raise AssertionError("a host mover must not wait on streams")


@pytest.mark.parametrize("after", ["default", None])
def test_a_host_mover_takes_the_default_or_nothing_to_wait_for(after):
    gen, rng = torch.Generator().manual_seed(55), np.random.default_rng(55)
    src, dst = Side([KINDS["flash"]], 10, TOKENS, gen), Side([KINDS["flash"]], 10, TOKENS, gen)
    before, src_before = dst.snapshot(), src.snapshot()
    sid, did = rng.permutation(10)[:6], rng.permutation(10)[:6]
    with BlockMover(src.tensors, dst.tensors, "h2d", block_dim=1) as mover:
        if after == "default":
            mover.submit(sid, did)
        else:
            mover.submit(sid, did, after=None)
    assert dst.matches(expected_after(src, src_before, dst, before, [(sid, did)]))


def test_after_that_cannot_be_honoured_is_refused_before_any_byte_moves():
    gen = torch.Generator().manual_seed(56)
    src, dst = Side([KINDS["mla"]], 6, TOKENS, gen), Side([KINDS["mla"]], 6, TOKENS, gen)
    before = dst.snapshot()
    mover = BlockMover(src.tensors, dst.tensors, "h2d")
    with pytest.raises(ConfigurationError, match="can wait for no stream or event"):
        mover.submit([1], [2], after=FakeStream())
    for bad in (5, "compute", object()):
        with pytest.raises(ConfigurationError, match="must be omitted .* None .* torch.cuda.Stream or a torch.cuda.Event"):
            mover.submit([1], [2], after=bad)
    assert dst.matches(before) and mover.in_flight == 0 and mover.poll() == []


def test_bounce_copies_split_over_threads_move_every_byte(monkeypatch):
    from kvswap.memory import bounce

    monkeypatch.setattr(bounce, "PARALLEL_BYTES", 1 << 14)
    rng = np.random.default_rng(57)
    n, size = 300, 4096 + 64
    src = rng.integers(0, 256, n * size, dtype=np.uint8)
    dst = rng.integers(0, 256, n * size + 512, dtype=np.uint8)
    before = dst.copy()
    perm, slots = rng.permutation(n), rng.permutation(n)[:200]
    sizes = rng.integers(1, size + 1, 200).astype(np.int64)
    s = (src.ctypes.data + perm[:200] * size).astype(np.int64)
    d = (dst.ctypes.data + 256 + slots * size).astype(np.int64)
    bounce.host_memmove(s, d, sizes, threads=4)
    expected = before.copy()
    for i in range(200):
        a, b = perm[i] * size, 256 + slots[i] * size
        expected[b:b + sizes[i]] = src[a:a + sizes[i]]
    np.testing.assert_array_equal(dst, expected)
