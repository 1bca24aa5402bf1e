"""The staged route's ordering on the host: every slice of a job is issued at once, and only
the events between the device side and the link keep a half from being reused before its
last user let go of it. Streams and events are simulated with CUDA's rules (a stream runs its
work in order; a wait holds its stream until the record it captured, the event's last one
enqueued before the wait, has run), and the simulated device runs the streams in random
interleavings, moving real bytes: wrong ordering shows as wrong bytes."""
from __future__ import annotations

import ctypes
from collections import deque

import numpy as np
import pytest

from kvswap.backends.triton_generic.staged import Pipeline, Slice

HALF = 256  # bytes in a half of the simulated staging buffer
SLICE = 4  # blocks a slice, one slot each
BLOCK = HALF // SLICE


class Event:
    def __init__(self) -> None:
        self.enqueued = 0  # records enqueued so far
        self.passed = 0  # records the device has run

    def record(self, stream: "Stream") -> None:
        self.enqueued += 1
        stream.ops.append(("record", self, self.enqueued))


class Stream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.ops: deque = deque()

    def wait_event(self, ev: Event) -> None:
        self.ops.append(("wait", ev, ev.enqueued))  # a never-recorded event: nothing to wait for

    def work(self, fn) -> None:
        self.ops.append(("work", fn, None))


def run(streams: list[Stream], rng: np.random.Generator) -> None:
    """Run every stream to its end, the next op taken from a random stream that can go."""
    while any(s.ops for s in streams):
        ready = [s for s in streams if s.ops and (s.ops[0][0] != "wait" or s.ops[0][1].passed >= s.ops[0][2])]
        assert ready, "the streams wait for each other: a deadlock"
        s = ready[rng.integers(len(ready))]
        kind, what, version = s.ops.popleft()
        if kind == "record":
            what.passed = version
        elif kind == "work":
            what()


def move(src: int, dst: int, n: int) -> None:
    ctypes.memmove(dst, src, n)


class Device:
    """A device side that enqueues its gather or scatter on the stream it is given."""

    def __init__(self, pairs: list[tuple[int, int, int]]) -> None:
        self.pairs, self.cancelled = pairs, False

    def __call__(self, stream: Stream) -> None:
        stream.work(lambda: [move(a, b, z) for a, b, z in self.pairs])

    def cancel(self) -> None:
        self.cancelled = True


def link(a: np.ndarray, b: np.ndarray, z: np.ndarray, stream: Stream) -> None:
    a, b, z = a.copy(), b.copy(), z.copy()
    stream.work(lambda: [move(int(x), int(y), int(n)) for x, y, n in zip(a, b, z)])


def job(to_host: bool, halves: np.ndarray, first: int, blocks: int, device: np.ndarray, host: np.ndarray,
        rng: np.random.Generator, streams: int) -> tuple[list[Slice], list[tuple[int, int]]]:
    """A job of ``blocks`` random device blocks to or from random host blocks, in slices of
    ``SLICE`` blocks through the halves in turn from ``first``; the link of a slice spread
    over up to ``streams`` parts."""
    dev_ids = rng.permutation(len(device) // BLOCK)[:blocks]
    host_ids = rng.permutation(len(host) // BLOCK)[:blocks]
    base = (halves.ctypes.data, halves.ctypes.data + HALF)
    slices = []
    for k in range(-(-blocks // SLICE)):
        h = (first + k) % 2
        ids = range(k * SLICE, min(blocks, (k + 1) * SLICE))
        slot = [base[h] + j * BLOCK for j in range(len(ids))]
        dev = [device.ctypes.data + int(dev_ids[i]) * BLOCK for i in ids]
        hst = [host.ctypes.data + int(host_ids[i]) * BLOCK for i in ids]
        gather = list(zip(dev, slot, [BLOCK] * len(ids))) if to_host else list(zip(slot, dev, [BLOCK] * len(ids)))
        runs = (np.array(slot), np.array(hst)) if to_host else (np.array(hst), np.array(slot))
        z = np.full(len(ids), BLOCK, dtype=np.int64)
        cuts = np.array_split(np.arange(len(ids)), min(streams, len(ids)))
        parts = tuple((runs[0][c], runs[1][c], z[c]) for c in cuts if len(c))
        slices.append(Slice(h, Device(gather), parts))
    return slices, list(zip(dev_ids.tolist(), host_ids.tolist()))


@pytest.mark.parametrize("links", [1, 3])
@pytest.mark.parametrize("to_host", [True, False])
def test_every_slice_issued_at_once_lands_every_byte_in_any_interleaving(to_host, links):
    for seed in range(40):
        rng = np.random.default_rng(seed)
        device = rng.integers(0, 256, 64 * BLOCK, dtype=np.uint8)
        host = rng.integers(0, 256, 64 * BLOCK, dtype=np.uint8)
        halves = np.zeros(2 * HALF, dtype=np.uint8)
        caller = Stream("caller")
        link_streams = tuple(Stream(f"link{i}") for i in range(links))
        pipe = Pipeline(link_streams, Event)
        expect_dev, expect_host = device.copy(), host.copy()
        turn = 0
        for blocks in (int(rng.integers(1, 20)), int(rng.integers(1, 20))):  # two jobs, the second behind the first
            slices, pairs = job(to_host, halves, turn, blocks, device, host, rng, links)
            turn = (turn + len(slices)) % 2
            pipe.issue(slices, to_host, caller, link)
            for d, h in pairs:  # the later job wins a block both wrote: they run in order
                if to_host:
                    expect_host[h * BLOCK:(h + 1) * BLOCK] = device[d * BLOCK:(d + 1) * BLOCK]
                else:
                    expect_dev[d * BLOCK:(d + 1) * BLOCK] = host[h * BLOCK:(h + 1) * BLOCK]
        seen = []
        caller.work(lambda: seen.append((host.copy(), device.copy())))  # what follows on the caller's stream
        run([caller, *link_streams], rng)
        assert np.array_equal(host, expect_host) and np.array_equal(device, expect_dev), seed
        assert np.array_equal(seen[0][0], expect_host) and np.array_equal(seen[0][1], expect_dev), seed


def _hasty_gather(self, sl, s):  # no wait for the link to let go of the half
    sl.device(s)
    self.ready[sl.half].record(s)


def _hasty_link(self, sl, link, after, then):  # no wait for the half's last user
    for (a, b, z), ls in zip(sl.links, self.links):
        link(a, b, z, ls)
    then[sl.half].record(self.links[0])


@pytest.mark.parametrize("to_host, broken", [(True, "_gather"), (False, "_link")])
def test_the_simulation_catches_a_half_reused_too_soon(monkeypatch, to_host, broken):
    """Without the wait for a half's last user to let go of it (the link, device to host;
    the scatter, host to device), some interleaving overwrites a half before it was read:
    the check above has teeth."""
    monkeypatch.setattr(Pipeline, broken, _hasty_gather if broken == "_gather" else _hasty_link)
    wrong = 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        device = rng.integers(0, 256, 64 * BLOCK, dtype=np.uint8)
        host = rng.integers(0, 256, 64 * BLOCK, dtype=np.uint8)
        halves = np.zeros(2 * HALF, dtype=np.uint8)
        caller, line = Stream("caller"), (Stream("link"),)
        slices, pairs = job(to_host, halves, 0, 16, device, host, rng, 1)
        Pipeline(line, Event).issue(slices, to_host, caller, link)
        run([caller, *line], rng)
        wrong += any(not np.array_equal(host[h * BLOCK:(h + 1) * BLOCK], device[d * BLOCK:(d + 1) * BLOCK])
                     for d, h in pairs)
    assert wrong > 0


def test_a_failed_link_cancels_the_device_sides_not_yet_issued():
    rng = np.random.default_rng(3)
    device = rng.integers(0, 256, 64 * BLOCK, dtype=np.uint8)
    host = np.zeros(64 * BLOCK, dtype=np.uint8)
    halves = np.zeros(2 * HALF, dtype=np.uint8)
    slices, _ = job(True, halves, 0, 16, device, host, rng, 1)
    calls = []

    def failing(a, b, z, stream):
        calls.append(len(z))
        if len(calls) == 2:
            raise RuntimeError("link refused")
        link(a, b, z, stream)

    with pytest.raises(RuntimeError, match="link refused"):
        Pipeline((Stream("link"),), Event).issue(slices, True, Stream("caller"), failing)
    # Device to host: the gathers of slices 0-2 were enqueued (one ahead of link 1); 3 never.
    assert [sl.device.cancelled for sl in slices] == [False, False, False, True]
