"""An offloading worker on kvswap: a block-major host cache, two movers, and its jobs.

The engine names jobs by its own ids and describes each by block lists (device blocks per
KV group; host chunks of ``blocks_per_chunk`` blocks). The worker owns the host cache
(:func:`kvswap.host_cache`: host block ``i`` holds device block ``i`` of every tensor in
one contiguous run, so chunk ``c``, host blocks ``c * k .. c * k + k - 1``, is one run of
``k`` blocks), builds one :class:`~kvswap.BlockMover` per direction over all KV groups
once, and per job only maps ids and submits. It never raises into the engine: a refused
job is logged and reported refused, a failed one logged and reported failed, and so is a
job whose end it cannot see (its mover cannot be polled or waited for): never left unreported,
nor reported done after a wait that did not hold.
"""
from __future__ import annotations

import json
import logging
import os
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Iterable, NamedTuple, Optional, Sequence

import numpy as np

from ... import BlockMover, ConfigurationError, InvalidTransferError, KVGroup, NumaWarning, host_cache
from .ids import job_block_ids
from .layout import canonical_layout
from .options import OffloadOptions

STORE, LOAD = "store", "load"
logger = logging.getLogger(__name__)


class JobResult(NamedTuple):
    """One finished job, as the engine's job id names it (a named tuple: built per job on
    the engine's thread, it costs a fraction of a dataclass).

    :ivar bytes: bytes moved (0 for a failed job).
    :ivar seconds: the copy's time, from the mover (see :class:`kvswap.TransferResult`).
    :ivar error: what failed, when ``ok`` is False.
    """

    job_id: int
    ok: bool
    bytes: int
    seconds: float
    error: Optional[str] = None


@dataclass
class Counters:
    """What one direction has done since the worker was built."""

    jobs: int = 0  # finished and ok
    failed: int = 0  # finished not ok, failed at launch, or whose end could not be seen
    refused: int = 0  # refused at submit, before any byte moved (bad ids, a job id in use)
    blocks: int = 0  # device blocks moved by the ok jobs
    bytes: int = 0
    seconds: float = 0.0


class _Side:
    """One direction's mover, counters and jobs in flight (mover job id -> (engine job id,
    device ids)): what a job touches, in one place. Finished jobs wait in ``done`` until
    the counters are read: per job the engine's thread appends once instead of updating
    four counters (after a wait, each line of Python costs microseconds)."""

    __slots__ = ("name", "mover", "counters", "jobs", "store", "done", "corrupt")

    def __init__(self, name: str, mover: BlockMover, counters: Counters, corrupt: bool = False) -> None:
        self.name, self.mover, self.counters, self.store = name, mover, counters, name == STORE
        self.corrupt = corrupt  # the test control corrupt_loads, on the load side
        self.jobs: dict[int, tuple[int, list[np.ndarray]]] = {}
        self.done: list[tuple[Any, list[np.ndarray]]] = []  # (mover result, device ids) of ok jobs

    def fold(self) -> Counters:
        """The counters, with the finished jobs not yet counted added."""
        c, done = self.counters, self.done
        for r, device_ids in done:
            c.jobs += 1
            c.blocks += sum(map(len, device_ids))
            c.bytes += r.bytes
            c.seconds += r.seconds
        done.clear()
        return c


FOLD_AT = 4096  # finished jobs kept uncounted at most
_result = tuple.__new__  # builds a JobResult without its Python-level __new__ (a per-job cost)


# A chunk id read as unsigned, so that a negative one is out of range of the chunk table.
_UNSIGNED = {np.dtype(t): np.dtype(t.replace("int", "uint")) for t in ("int8", "int16", "int32", "int64")}


class OffloadWorker:
    """Moves KV blocks between an engine's device caches and a host cache kvswap allocates.

    :param tensors: the device tensors, blocks on the first dimension (vLLM's canonical
        ``(num_blocks, page_bytes)`` int8 views, cut to the un-padded page).
    :param groups: per KV group, the indices into ``tensors`` of its layers.
    :param num_chunks: host chunks to allocate.
    :param blocks_per_chunk: device blocks per host chunk (``k``).
    :param options: kvswap's options (policy, NUMA node, counters file, test controls).
    :param rank: the engine worker's rank, for ``{rank}`` in ``options.stats_file``.
    :param log: where refusals, failures and the counters file's errors are logged.
    :raises ConfigurationError: bad counts or groups, or a counters file that cannot be
        written (before anything is allocated).
    :raises AllocationError: the host cache does not fit in host memory.
    :raises BlockLayoutError, TensorPlacementError: tensors a mover cannot move.
    """

    def __init__(self, tensors: Sequence[Any], groups: Sequence[Sequence[int]], num_chunks: int,
                 blocks_per_chunk: int, options: Optional[OffloadOptions] = None, *, rank: int = 0,
                 log: Optional[logging.Logger] = None) -> None:
        self.log = log or logger
        self.options = options or OffloadOptions()
        for name, value in (("num_chunks", num_chunks), ("blocks_per_chunk", blocks_per_chunk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"{name}={value!r} must be an int >= 1")
        self.tensors = list(tensors)
        self.groups = [tuple(g) for g in groups]
        if not self.tensors or not self.groups:
            raise ConfigurationError("an offloading worker needs at least one tensor and one KV group")
        for g, members in enumerate(self.groups):
            if not members or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self.tensors)
                                  for i in members):
                raise ConfigurationError(f"KV group {g} = {list(members)} must name tensors 0..{len(self.tensors) - 1}")
        self.num_chunks, self.blocks_per_chunk = num_chunks, blocks_per_chunk
        stats = self.options.stats_file
        self.stats_path = stats.replace("{rank}", str(rank)) if stats else None
        if self.stats_path:
            _check_writable(self.stats_path, stats)
        device = self.tensors[0].device
        on_host = device.type == "cpu"
        with warnings.catch_warnings():
            if on_host:  # the "device" is host memory: no node to be near, nothing to pin for
                warnings.simplefilter("ignore", NumaWarning)
            self.host = host_cache(self.tensors, num_chunks * blocks_per_chunk, block_dim=0,
                                   pin=not on_host, node=self.options.numa_node)
        # Host blocks of each chunk, row c = c * k .. c * k + k - 1: one indexing maps a job's chunks.
        # After the cache: a cache too large for memory is refused by name, not by numpy here.
        self._chunk_blocks = np.arange(num_chunks * blocks_per_chunk, dtype=np.int64).reshape(num_chunks, -1)
        views = self.host.views
        policy = self.options.policy
        dev = [[self.tensors[i] for i in g] for g in self.groups]
        host = [[views[i] for i in g] for g in self.groups]
        # One group (most models) takes a plain mover: ids go in as arrays, not lists of them.
        self._grouped = len(self.groups) > 1
        if self._grouped:
            self.store = BlockMover.groups([KVGroup(d, h, 0) for d, h in zip(dev, host)], "d2h", policy=policy)
            self.load = BlockMover.groups([KVGroup(h, d, 0) for d, h in zip(dev, host)], "h2d", policy=policy)
        else:
            self.store = BlockMover(dev[0], host[0], "d2h", block_dim=0, policy=policy)
            self.load = BlockMover(host[0], dev[0], "h2d", block_dim=0, policy=policy)
        self._stores = _Side(STORE, self.store, Counters())
        self._loads = _Side(LOAD, self.load, Counters(), corrupt=bool(self.options.corrupt_loads))
        self._sides = (self._stores, self._loads)
        self._where: dict[int, tuple[_Side, int]] = {}  # engine job id -> (its side, mover job id)
        self._lost: list[JobResult] = []  # jobs failed outside get_finished, reported by its next call
        self._closed = False
        self._write_stats()

    @property
    def counters(self) -> dict[str, Counters]:
        """What each direction (``"store"``, ``"load"``) has done since the worker was built."""
        return {STORE: self._stores.fold(), LOAD: self._loads.fold()}

    @classmethod
    def from_canonical(cls, kv_caches: Any, num_chunks: int, blocks_per_chunk: int,
                       options: Optional[OffloadOptions] = None, **kw: Any) -> OffloadWorker:
        """A worker over caches described as vLLM's ``CanonicalKVCaches`` describes them
        (:func:`kvswap.integrations.offload.layout.canonical_layout`)."""
        layout = canonical_layout(kv_caches)
        return cls(layout.tensors, layout.groups, num_chunks, blocks_per_chunk, options, **kw)

    # -- per job -------------------------------------------------------------------------
    def submit_store(self, job_id: int, device_spec: Any, host_spec: Any) -> bool:
        """Start copying the device blocks of ``device_spec`` into the chunks of ``host_spec``.

        Specs are read by their fields: ``block_ids``, ``group_sizes`` and ``block_indices``
        on the device side, ``block_ids`` (chunk ids) on the host side.

        :return: True once the job is on its way; False when it was refused (no byte moved)
            or its copy failed at launch (logged as failed; counted so).
        """
        return self._submit(self._stores, job_id, device_spec, host_spec)

    def submit_load(self, job_id: int, host_spec: Any, device_spec: Any) -> bool:
        """Start copying the chunks of ``host_spec`` into the device blocks of ``device_spec``;
        as :meth:`submit_store`."""
        return self._submit(self._loads, job_id, device_spec, host_spec)

    def _submit(self, side: _Side, job_id: int, device_spec: Any, host_spec: Any) -> bool:
        try:
            if self._closed:
                raise ConfigurationError("the worker is shut down")
            if job_id in self._where:
                raise ConfigurationError(f"job {job_id} is still in flight; a job id names one job at a time")
            device, host = self._ids(device_spec, host_spec)
            if not self._grouped:
                src, dst = (device[0], host[0]) if side.store else (host[0], device[0])
            else:
                src, dst = (device, host) if side.store else (host, device)
            mid = side.mover.submit(src, dst)
        except Exception as e:
            # Bad ids or a job id in use are refused before any byte moves; anything else is
            # the copy route failing at launch, some bytes perhaps moved.
            refused = isinstance(e, (InvalidTransferError, ConfigurationError))
            if refused:
                side.counters.refused += 1
            else:
                side.counters.failed += 1
            self.log.error("kvswap %s %s job %s (device blocks %s, chunks %s): %s: %s",
                           "refused" if refused else "failed to launch", side.name, job_id,
                           _few(getattr(device_spec, "block_ids", None)), _few(getattr(host_spec, "block_ids", None)),
                           type(e).__name__, e)
            return False
        side.jobs[mid] = (job_id, device)
        self._where[job_id] = (side, mid)
        return True

    def _ids(self, device_spec: Any, host_spec: Any) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """A job's ids per group. One group (most models) is mapped here in a few array
        operations (the engine's arrays pass as they are: the mover widens int32 once, as it
        would for a caller of its own); anything else, and anything this path does not
        recognise, goes through :func:`job_block_ids`, which checks every field and says
        what is wrong."""
        dev, chunks = getattr(device_spec, "block_ids", None), getattr(host_spec, "block_ids", None)
        # vLLM's specs hold 1-D integer numpy arrays: the short path takes only those.
        if (not self._grouped and type(dev) is np.ndarray and type(chunks) is np.ndarray and dev.ndim == 1
                and chunks.ndim == 1 and dev.dtype.kind in "iu" and chunks.dtype.kind in "iu"):
            sizes, k = device_spec.group_sizes, self.blocks_per_chunk
            if len(sizes) == 1 and sizes[0] == len(dev):
                if k == 1:
                    if len(chunks) == len(dev):
                        return [dev], [chunks]
                else:
                    skip = int(device_spec.block_indices[0])
                    skip = skip % k if skip >= 0 else -1
                    if skip >= 0 and len(chunks) == -(-(len(dev) + skip) // k):
                        try:  # read as unsigned, a negative chunk id is out of range too
                            rows = self._chunk_blocks[chunks.view(_UNSIGNED.get(chunks.dtype, chunks.dtype))]
                        except IndexError:
                            rows = None  # the checked path names the bad id
                        if rows is not None:
                            return [dev], [rows.ravel()[skip:skip + len(dev)]]
        return job_block_ids(device_spec, host_spec, self.blocks_per_chunk, len(self.groups))

    def get_finished(self) -> list[JobResult]:
        """Jobs finished since the last call, stores first, each direction in submission order
        (jobs failed by :meth:`wait` first of all)."""
        out: list[JobResult] = []
        if self._lost:
            out, self._lost = self._lost, out
        where = self._where
        for side in self._sides:
            jobs = side.jobs
            if not jobs:
                continue  # nothing of this direction in flight: no poll
            try:
                results = side.mover.poll()
            except Exception as e:  # never raised into the engine, nor left for it to wait for forever
                out += self._fail(side, list(jobs), f"could not poll its {side.name} jobs: {type(e).__name__}: {e}")
                continue
            done = side.done
            for r in results:
                job = jobs.pop(r.job_id, None)
                if job is None:
                    continue  # its submit failed and was reported then
                job_id, device_ids = job
                del where[job_id]
                ok, error = r.ok, r.error
                if ok and side.corrupt:
                    try:
                        self._corrupt(device_ids)
                    except Exception as e:
                        ok, error = False, f"{type(e).__name__}: {e}"
                if ok:
                    done.append((r, device_ids))
                    out.append(_result(JobResult, (job_id, True, r.bytes, r.seconds, None)))
                else:
                    side.counters.failed += 1
                    self.log.error("kvswap %s job %s failed: %s", side.name, job_id, error)
                    out.append(JobResult(job_id, False, 0, r.seconds, error))
            if len(done) >= FOLD_AT:
                side.fold()
        if out and self.stats_path:
            self._write_stats()
        return out

    def _corrupt(self, device_ids: list[np.ndarray]) -> None:
        """The test control ``corrupt_loads``: random bytes over every loaded block."""
        import torch

        for members, ids in zip(self.groups, device_ids):
            if len(ids):
                for i in members:
                    t = self.tensors[i]
                    index = torch.as_tensor(ids, device=t.device)
                    t[index] = torch.randint(-128, 128, (len(ids), t.shape[1]), dtype=t.dtype, device=t.device)

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until each of ``job_ids`` that is in flight has finished (its result still
        comes from :meth:`get_finished`); ids of refused or finished jobs are skipped. A job
        that cannot be waited for is reported failed: the engine may reuse its blocks next."""
        for job_id in job_ids:
            where = self._where.get(job_id)
            if where is None:
                continue
            side, mid = where
            try:
                side.mover.wait(mid)
            except Exception as e:
                self._lost += self._fail(side, [mid], f"could not wait for it: {type(e).__name__}: {e}")

    def _fail(self, side: _Side, mids: list[int], why: str) -> list[JobResult]:
        """Jobs in flight (by mover job id) whose end cannot be seen, as failed results; logged."""
        out = []
        for mid in mids:
            job_id, _ = side.jobs.pop(mid)
            del self._where[job_id]
            out.append(JobResult(job_id, False, 0, 0.0, why))
        side.counters.failed += len(out)
        self.log.error("kvswap %s job(s) %s failed: %s", side.name, _few([r.job_id for r in out]), why)
        return out

    def shutdown(self) -> None:
        """Wait for every job, close both movers, write the counters a last time. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for side in self._sides:
            try:
                side.mover.close()
            except Exception as e:
                self.log.error("kvswap could not close its %s mover: %s: %s", side.name, type(e).__name__, e)
        self._write_stats()

    # -- what it is ----------------------------------------------------------------------
    def describe(self) -> str:
        """One line: the layout, the host cache, and the route of each direction."""
        h = self.host
        pinned = "pinned" if h.buffer.is_pinned() else "not pinned"
        node = "" if self.options.numa_node is None else f", NUMA node {self.options.numa_node}"
        sizes = ", ".join(f"{n} B" for n in sorted({int(t.shape[1]) for t in self.tensors}))
        return (f"{len(self.tensors)} tensors in {len(self.groups)} KV group(s), pages of {sizes}; "
                f"host cache block-major, {self.num_chunks} chunks of {self.blocks_per_chunk} block(s), "
                f"{h.block_bytes} B a block, {_mib(h.num_blocks * h.block_bytes)} ({pinned}{node}); "
                f"store d2h: {route_summary(self.store)}; load h2d: {route_summary(self.load)}")

    def explain(self) -> str:
        """Both movers' resolve decisions, as :meth:`kvswap.BlockMover.explain` gives them."""
        return f"store:\n{self.store.explain()}\nload:\n{self.load.explain()}"

    def stats(self) -> dict[str, Any]:
        """The counters, per direction, and what the cache holds."""
        return {
            STORE: asdict(self._stores.fold()),
            LOAD: asdict(self._loads.fold()),
            "num_chunks": self.num_chunks,
            "blocks_per_chunk": self.blocks_per_chunk,
            "host_block_bytes": self.host.block_bytes,
            "groups": [list(g) for g in self.groups],
        }

    def _write_stats(self) -> None:
        path = self.stats_path
        if not path:
            return
        try:
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(self.stats(), f)
            os.replace(tmp, path)  # a reader never sees half a file
        except OSError as e:
            self.log.error("kvswap could not write its counters to %s: %s", path, e)


def _check_writable(path: str, option: str) -> None:
    """Refuse a counters file that cannot be written, at start rather than at every job."""
    if os.path.isdir(path):
        raise ConfigurationError(f"stats_file={option!r}: {path} is a directory; name a file")
    tmp = f"{path}.tmp{os.getpid()}"  # as _write_stats writes it
    try:
        with open(tmp, "w"):
            pass
        os.remove(tmp)
    except OSError as e:
        raise ConfigurationError(f"stats_file={option!r}: cannot write {path}: {e.strerror or e}") from e


def route_summary(mover: BlockMover) -> str:
    """A mover's decision in a few words: the route per block size, whether a staged route
    moves whole host runs (and why not), and the calibration it was decided by."""
    plan = mover.swap_fn.plan
    routes = []
    for r in plan.routes:
        text = f"{r.at_bytes} B -> {r.impl}"
        if r.small_batch_impl and r.min_batch > 1:
            text += f" ({r.small_batch_impl} under {r.min_batch} descriptors)"
        routes.append(text)
    # The mover's own notes in explain(): the staged route, host memory on a far NUMA node.
    notes = [line.strip()[len("note: "):] for line in mover.explain().splitlines()
             if line.strip().startswith("note: ") and ("staged" in line or "have pages on NUMA" in line)]
    extra = "".join(f"; {n}" for n in notes)
    forced = f", forced {plan.forced}" if plan.forced else ""
    return f"{', '.join(routes)}{extra} [calibration: {plan.calibration.get('source')}{forced}]"


def _few(ids: Any, shown: int = 8) -> str:
    """A job's ids for a log line: the first few."""
    try:
        values = [int(i) for i in ids]
    except (TypeError, ValueError):
        return repr(ids)
    more = f", ... ({len(values)} in all)" if len(values) > shown else ""
    return "[" + ", ".join(map(str, values[:shown])) + more + "]"


def _mib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"
