"""The step benchmark's reference: one contiguous copy of a job's bytes across the link,
beside the same compute, launched as a job is.

A job of ``B`` blocks moves ``B x block_bytes`` bytes. The reference moves as many bytes in
one contiguous copy between a pinned host buffer and a device buffer, on a stream of its own:
what moving those bytes over the link at all costs a step, which no route can beat. A
contender's makespan is read over the reference's, repetition by repetition
(``span/contiguous``).

:class:`ContiguousCopy` answers a job's calls (``submit``, ``wait_issued``, ``wait``, ``poll``,
``stream``) and a pool's (``poison``, ``check``), so :func:`kvswap.calibration.step.one_step`
and :func:`~kvswap.calibration.step.transfer_alone` run it exactly as a BlockMover job: the
compute launched first from the same thread, then the copy; host to device waiting for
nothing, device to host for the work queued before the step. The step benchmark and its
interference part (:mod:`.step_interference`) both measure it this way.

The buffers hold at most :data:`BUFFER_MAX` bytes each and are allocated once per run: a job
can be 1 GiB or more, and buffers that large beside the model's KV pools could run the device
out of memory. A larger job's bytes go as back-to-back copies of :data:`BUFFER_MAX` on the one
stream, each from the same buffer: launching one takes microseconds and moving it
milliseconds, so the link sees no gap, and each is far above the size at which a copy reaches
the link's speed.
"""
from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from kvswap import TransferResult
from kvswap.types import Direction

from .step_workload import POISON, WrongBytes
from .timing import median

MiB = 1 << 20
BUFFER_MAX = 256 * MiB  # each contiguous buffer, at most: the ceiling's copy, and the reference's pieces
CONTIGUOUS = "contiguous"  # the reference's name among a case's contenders


def pieces(nbytes: int, size: int) -> list[int]:
    """``nbytes`` as back-to-back copies of at most ``size`` bytes."""
    return [min(size, nbytes - i) for i in range(0, nbytes, size)]


class ContiguousBuffers:
    """A pinned host buffer and a device buffer of ``size`` bytes (at most :data:`BUFFER_MAX`),
    the random bytes a source is filled with (next to the device, where checks run), and a
    stream of kvswap's own (a stream from torch's pool may be the compute stream)."""

    def __init__(self, env: Any, size: int, seed: int = 0) -> None:
        self.env = env
        self.size = max(1, min(size, BUFFER_MAX))
        self.host = env.alloc(self.size, host=True)
        self.dev = env.alloc(self.size, host=False)
        self.want = env.alloc(self.size, host=False)
        env.random_(self.want, seed * 1_000_003 + 7)
        self.stream = env.side_stream(self)

    def sides(self, direction: Direction) -> tuple[Any, Any]:
        """``(source, destination)`` in ``direction``."""
        return (self.host, self.dev) if direction.src_is_host else (self.dev, self.host)

    def ceiling(self, direction: Direction, nbytes: int, reps: int = 5) -> float:
        """GB/s of one contiguous copy of ``nbytes`` (at most the buffers' size) across the
        link in ``direction``, from an idle device (median of ``reps``)."""
        env = self.env
        n = max(1, min(nbytes, self.size))
        src, dst = self.sides(direction)
        times = []
        with env.context():
            for i in range(reps + 1):
                env.sync()
                a = env.mark()
                dst[:n].copy_(src[:n], non_blocking=True)
                b = env.mark()
                env.sync()
                if i:
                    times.append(env.elapsed(a, b))
        return n / max(median(times), 1e-9) / 1e9


class ContiguousCopy:
    """One case's reference: a job of ``len(sid)`` blocks is one contiguous copy of
    ``len(sid) x block_bytes`` bytes in ``direction`` on the buffers' stream (the ids name
    no bytes: only their count counts). Built, it fills the source with random bytes."""

    def __init__(self, buffers: ContiguousBuffers, direction: Direction, block_bytes: int) -> None:
        self.buffers, self.direction, self.block_bytes = buffers, direction, block_bytes
        self.env, self.stream = buffers.env, buffers.stream
        self._ids = itertools.count()
        self._jobs: dict[int, tuple[int, int, Any, Any]] = {}
        src, _ = buffers.sides(direction)
        src.copy_(buffers.want)
        self.env.sync()

    def label(self, blocks: int) -> str:
        """The route column: a copy of more bytes than the buffers hold says in how many pieces."""
        size = self.buffers.size
        n = len(pieces(blocks * self.block_bytes, size))
        each = f"{size // MiB} MiB" if size % MiB == 0 else f"{size:,} B"
        return "contiguous copy" + (f" in {n} pieces of {each}" if n > 1 else "")

    # -- a job's calls ----------------------------------------------------------------------

    def submit(self, sid: Any, did: Any, after: Any = None) -> int:
        """Enqueue the copy on the buffers' stream, after ``after`` (an event) where given."""
        env, b = self.env, self.buffers
        nbytes = len(sid) * self.block_bytes
        src, dst = b.sides(self.direction)
        parts = pieces(nbytes, b.size)
        with env.on(self.stream):
            if after is not None:
                env.wait(self.stream, after)
            start = env.mark(self.stream)
            for n in parts:
                dst[:n].copy_(src[:n], non_blocking=True)
            end = env.mark(self.stream)
        job = next(self._ids)
        self._jobs[job] = (nbytes, len(parts), start, end)
        return job

    def wait_issued(self, job: int) -> None:
        pass  # enqueued in submit

    def wait(self, job: int) -> None:
        self.env.sync()

    def poll(self) -> list[TransferResult]:
        done = [TransferResult(job, True, nbytes, self.env.elapsed(start, end), n)
                for job, (nbytes, n, start, end) in self._jobs.items()]
        self._jobs.clear()
        return done

    def close(self) -> None:
        self._jobs.clear()

    # -- a pool's calls ---------------------------------------------------------------------

    def poison(self, direction: Direction) -> None:
        """Every byte of the destination buffer set to :data:`POISON` before a copy."""
        _, dst = self.buffers.sides(direction)
        dst.fill_(POISON)
        self.env.sync()

    def check(self, direction: Direction, sid: np.ndarray, did: np.ndarray) -> int:
        """Bytes verified: the destination holds the source's bytes as far as the copy
        reached (every piece lands on the buffer's start), and poison past it.

        :raises WrongBytes: naming the first byte that differs.
        """
        b, torch = self.buffers, self.env.torch
        _, dst = b.sides(direction)
        got = dst if dst is b.dev else self.env.mirror_of(dst)
        n = min(len(sid) * self.block_bytes, b.size)
        if not torch.equal(got[:n], b.want[:n]):
            i = int(torch.nonzero(got[:n] != b.want[:n])[0, 0])
            raise WrongBytes(f"{direction}: the contiguous copy's destination byte {i} does not hold its source's")
        if n < b.size and not bool((got[n:] == POISON).all()):
            i = n + int(torch.nonzero(got[n:] != POISON)[0, 0])
            raise WrongBytes(f"{direction}: the contiguous copy of {n} bytes wrote its destination's byte {i}")
        return n
