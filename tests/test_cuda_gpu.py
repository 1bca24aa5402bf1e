"""``cuda.batch`` on a real CUDA GPU: every byte of every block, both directions, both paths.

Blocks are scattered in random order with random gaps through pools of random bytes on
each side; the destination pool starts as random poison, and after each copy the whole
pool is compared with what it must hold, so bytes outside the blocks are checked too.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest

import kvswap
from kvswap import Direction, DriverError, Policy

pytestmark = pytest.mark.gpu
KiB, MiB = 1024, 1 << 20
BOTH = (Direction.H2D, Direction.D2H)
ALL = (Direction.H2D, Direction.D2H, Direction.D2D)


def layout(rng: np.random.Generator, sizes: np.ndarray, max_gap: int = 4096) -> tuple[np.ndarray, int]:
    """Offsets of non-overlapping blocks placed in random order with random gaps (so
    addresses are odd as often as not), and the pool size that holds them."""
    n = len(sizes)
    order = rng.permutation(n)
    gaps = rng.integers(1, max_gap + 1, n)
    ends = np.cumsum(sizes[order] + gaps)
    offsets = np.empty(n, dtype=np.int64)
    offsets[order] = ends - sizes[order]
    return offsets, int(ends[-1] + max_gap) if n else max_gap


class Pools:
    """A random source pool and a poisoned destination pool, one pinned on the host and one
    on the GPU (both on the GPU for d2d), with scattered blocks between them."""

    def __init__(self, direction: Direction, sizes, seed: int) -> None:
        import torch

        rng = np.random.default_rng(seed)
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.src_off, src_bytes = layout(rng, self.sizes)
        self.dst_off, dst_bytes = layout(rng, self.sizes)
        def make(nbytes: int, on_host: bool):
            data = torch.from_numpy(rng.integers(0, 256, nbytes, dtype=np.uint8))
            return data.pin_memory() if on_host else data.cuda()

        self.src_t = make(src_bytes, direction.src_is_host)
        self.dst_t = make(dst_bytes, direction.dst_is_host)
        self.gpu = self.dst_t if direction.src_is_host else self.src_t  # h2d's destination, else the source
        torch.cuda.synchronize()
        self.src_bytes = self.src_t.cpu().numpy().copy()
        self.before = self.dst_t.cpu().numpy().copy()
        self.src = self.src_off + self.src_t.data_ptr()
        self.dst = self.dst_off + self.dst_t.data_ptr()

    def expected(self) -> np.ndarray:
        out = self.before.copy()
        for s, d, n in zip(self.src_off.tolist(), self.dst_off.tolist(), self.sizes.tolist()):
            out[d:d + n] = self.src_bytes[s:s + n]
        return out

    def check(self, stream=None) -> None:
        import torch

        (stream or torch.cuda).synchronize()
        got = self.dst_t.cpu().numpy()
        bad = np.flatnonzero(got != self.expected())
        assert not len(bad), f"{len(bad)} wrong bytes of {len(got)}, first at offset {bad[0]}"


@pytest.fixture(scope="module")
def cuda():
    import torch

    from kvswap.backends.cuda import batch, device, driver

    info = device.describe(None)
    assert info is not None and info.platform == "cuda", "the CUDA backend does not claim this GPU"
    torch.cuda.init()
    return types.SimpleNamespace(torch=torch, batch=batch, driver=driver.get(), info=info)


def bound(cuda, direction):
    return cuda.batch.bind(cuda.driver, direction, cuda.info.index)


@pytest.fixture()
def side(cuda):
    return cuda.torch.cuda.Stream()


def test_the_device_is_described(cuda):
    info = cuda.info
    assert info.compute_units > 0 and info.arch.startswith("sm_")
    assert info.identity.startswith("cuda-") and str(info.compute_units) in info.identity
    assert "CUDA" in info.driver_version and info.pci_bus_id != "unknown"
    assert cuda.batch.availability(info) is None


@pytest.mark.parametrize("direction", ALL, ids=str)
@pytest.mark.parametrize("size", [8, 13, 64, 100, 4096, 4100, 65536, 65537, 262143, MiB])
def test_block_sizes(cuda, side, direction, size):
    fn = bound(cuda, direction)
    pools = Pools(direction, [size] * 16, seed=size)
    fn(pools.src, pools.dst, pools.sizes, side)
    assert fn.last_path == "batch"
    pools.check(side)


@pytest.mark.parametrize("direction", ALL, ids=str)
@pytest.mark.parametrize("n", [0, 1, 16, 10_000])
def test_batch_lengths(cuda, side, direction, n):
    fn = bound(cuda, direction)
    pools = Pools(direction, np.full(n, 4 * KiB), seed=n + 1)
    fn(pools.src, pools.dst, pools.sizes, side)
    pools.check(side)


@pytest.mark.parametrize("direction", ALL, ids=str)
def test_one_mib_single_and_tiny_blocks_many(cuda, side, direction):
    fn = bound(cuda, direction)
    for sizes, seed in (([MiB], 11), (np.full(10_000, 8), 12), (np.full(3000, 13), 13)):
        pools = Pools(direction, sizes, seed=seed)
        fn(pools.src, pools.dst, pools.sizes, side)
        pools.check(side)


@pytest.mark.parametrize("direction", ALL, ids=str)
def test_mixed_sizes_in_one_batch(cuda, side, direction):
    rng = np.random.default_rng(21)
    sizes = np.concatenate([rng.choice([8, 13, 100, 4096, 4100, 65537, MiB], 300), rng.integers(1, 200_000, 700)])
    fn = bound(cuda, direction)
    pools = Pools(direction, rng.permutation(sizes), seed=22)
    fn(pools.src, pools.dst, pools.sizes, side)
    assert fn.last_path == "batch"
    pools.check(side)


@pytest.mark.parametrize("direction", ALL, ids=str)
def test_streams_choose_the_path(cuda, direction):
    torch = cuda.torch
    fn = bound(cuda, direction)
    s = torch.cuda.Stream()
    cases = [
        (s, "batch"),
        (int(s.cuda_stream), "batch"),   # a raw handle
        (0, "per-copy"),                 # the legacy default stream, by handle
        (None, "per-copy"),              # the current stream, torch's default: legacy
    ]
    for i, (stream, path) in enumerate(cases):
        pools = Pools(direction, np.random.default_rng(i).integers(1, 70_000, 500), seed=30 + i)
        fn(pools.src, pools.dst, pools.sizes, stream)
        assert fn.last_path == path, f"stream {stream!r}"
        pools.check()
    pools = Pools(direction, np.full(200, 16 * KiB), seed=40)
    with torch.cuda.stream(s):  # None inside a stream context: that stream, batch path
        fn(pools.src, pools.dst, pools.sizes, None)
    assert fn.last_path == "batch"
    pools.check(s)


@pytest.mark.parametrize("direction", ALL, ids=str)
def test_the_per_copy_path_on_a_non_default_stream(cuda, side, direction):
    d, index = cuda.driver, cuda.info.index
    fn = cuda.batch.BatchCopy(direction, index, abi=None, batch_fn=None, memcpy_fn=d.memcpy_async(),
                              error=d.error, context=d.context_guard(index), why="the test withholds the batch entry")
    assert fn.note.startswith("per-copy path")
    pools = Pools(direction, np.random.default_rng(50).integers(1, 100_000, 400), seed=51)
    fn(pools.src, pools.dst, pools.sizes, side)
    assert fn.last_path == "per-copy"
    pools.check(side)


@pytest.mark.parametrize("direction", [Direction.D2H, Direction.D2D], ids=str)
def test_a_device_source_is_read_in_stream_order(cuda, side, direction):
    """Device data written on the stream just before the copy is what arrives (STREAM order)."""
    torch = cuda.torch
    fn = bound(cuda, direction)
    pools = Pools(direction, np.full(2000, 16 * KiB), seed=60)
    fresh = torch.randint(0, 256, pools.gpu.shape, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        for _ in range(4):  # give the copy something to overtake if it could
            pools.gpu.copy_(fresh.flip(0))
        pools.gpu.copy_(fresh)
    fn(pools.src, pools.dst, pools.sizes, side)
    pools.src_bytes = fresh.cpu().numpy()
    pools.check(side)


def test_h2d_writes_after_earlier_work_on_the_stream(cuda, side):
    """ANY relaxes only source reads: a fill of the destination queued first lands first."""
    torch = cuda.torch
    fn = bound(cuda, Direction.H2D)
    pools = Pools(Direction.H2D, np.full(2000, 8 * KiB), seed=70)
    with torch.cuda.stream(side):
        pools.gpu.fill_(0x5A)
    fn(pools.src, pools.dst, pools.sizes, side)
    pools.before = np.full_like(pools.before, 0x5A)
    pools.check(side)


@pytest.mark.parametrize("direction", ALL, ids=str)
def test_resolve_forced_to_cuda_batch(cuda, side, direction):
    fn = kvswap.resolve(direction, device=f"cuda:{cuda.info.index}", policy=Policy(force="cuda.batch"))
    assert fn.plan.device.identity == cuda.info.identity and fn.impls == ("cuda.batch",)
    assert fn.requires_pinned and "cuda.batch: batch path" in fn.explain()
    pools = Pools(direction, np.random.default_rng(80).integers(1, 300_000, 300), seed=81)
    fn(pools.src, pools.dst, pools.sizes, stream=side)
    pools.check(side)


# An invalid device range runs in a child process: should the driver not refuse it up
# front, a faulting copy would poison this process's CUDA context for the other tests.
_INVALID = textwrap.dedent("""
    import ctypes, json, sys
    import numpy as np, torch
    from kvswap import Direction, DriverError
    from kvswap.backends.cuda import batch, driver
    torch.cuda.init()
    torch.empty(1, device="cuda")  # the primary context, as torch makes it
    d = driver.get()
    alloc = d.proc("cuMemAlloc", 3020, ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t))
    base = ctypes.c_uint64()
    d.check("cuMemAlloc", alloc(ctypes.byref(base), 2 << 20))
    host = torch.empty(1 << 20, dtype=torch.uint8).pin_memory()
    src = base.value + np.arange(8, dtype=np.int64) * 4096
    dst = host.data_ptr() + np.arange(8, dtype=np.int64) * 65536
    sizes = np.full(8, 4096, dtype=np.int64)
    src[5], sizes[5] = base.value + (2 << 20) - 4096, 16384  # runs 12 KiB past the allocation
    fn = batch.bind(d, Direction.D2H, 0)
    stream = torch.cuda.Stream() if sys.argv[1] == "batch" else 0
    out = {"abi": fn.abi.requested if fn.abi else None}
    try:
        fn(src, dst, sizes, stream)
        torch.cuda.synchronize()
        out["error"] = None
    except DriverError as e:
        out.update(error=e.name, code=e.code, index=e.index, call=e.call, message=str(e))
    except Exception as e:
        out.update(error=type(e).__name__, message=str(e))
    out["path"] = fn.last_path
    print(json.dumps(out))
""")


@pytest.mark.parametrize("path", ["batch", "per-copy"])
def test_an_invalid_device_range_is_a_driver_error_with_its_name(path):
    run = subprocess.run([sys.executable, "-c", _INVALID, path], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"child died ({run.returncode}): {run.stderr[-2000:]}"
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["error"] and out["error"].startswith("CUDA_ERROR_"), out
    assert out["code"] > 0 and out["error"] in out["message"], out
    if path == "per-copy":
        assert (out["call"], out["index"]) == ("cuMemcpyAsync", 5), out
    else:
        assert out["call"] == "cuMemcpyBatchAsync", out
        assert out["index"] == (5 if out["abi"] == 12080 else None), out


# -- huge batches -------------------------------------------------------------------------

@pytest.mark.parametrize("direction", ALL, ids=str)
def test_200000_descriptors_in_calls_of_at_most_the_cap(cuda, side, direction):
    """Split into ordered cuMemcpyBatchAsync calls of <= 32,768 (vLLM issue 49276: a hang at
    51,828 in one call), of <= 512 host to device and 4,096 otherwise for mixed sizes as these
    (the driver's faults on long mixed-size batches, batch.MIXED_CHUNK_H2D and MIXED_CHUNK);
    every byte of every block checked."""
    fn = bound(cuda, direction)
    counts = []
    call = fn._batch
    fn._batch = lambda *args: (counts.append(args[3]), call(*args))[1]
    sizes = np.random.default_rng(90).integers(1, 257, 200_000)
    pools = Pools(direction, sizes, seed=91)
    fn(pools.src, pools.dst, pools.sizes, side)
    cap = fn.mixed_chunk
    assert cap == (cuda.batch.MIXED_CHUNK_H2D if str(direction) == "h2d" else cuda.batch.MIXED_CHUNK)
    assert counts == [cap] * (200_000 // cap) + [200_000 % cap] and fn.last_path == "batch"
    pools.check(side)


@pytest.mark.parametrize("direction", ALL, ids=str)
def test_200000_descriptors_through_resolve_on_the_batch_route(cuda, side, direction):
    fn = kvswap.resolve(direction, device=f"cuda:{cuda.info.index}", policy=Policy(force="cuda.batch"))
    pools = Pools(direction, np.random.default_rng(92).integers(1, 4097, 200_000), seed=93)
    fn(pools.src, pools.dst, pools.sizes, stream=side)
    pools.check(side)


# -- driver-error recovery ----------------------------------------------------------------

# A batch the driver refuses in its argument checks (attrsIdxs[0] must be 0; the source
# order must be a valid CUmemcpySrcAccessOrder), so nothing is enqueued and the context
# stays healthy. It still runs in a child process, so that a driver which did not refuse
# it up front could not leave this process's context broken for the other tests.
_RECOVER = textwrap.dedent("""
    import json, sys
    import numpy as np, torch
    import kvswap
    from kvswap import Direction, DriverError, Policy
    from kvswap.backends.cuda import batch, driver
    torch.cuda.init()
    rng = np.random.default_rng(7)
    n, size = 512, 4096
    host = torch.from_numpy(rng.integers(0, 256, 2 * n * size, dtype=np.uint8)).pin_memory()
    dev = torch.from_numpy(rng.integers(0, 256, 2 * n * size, dtype=np.uint8)).cuda()
    before = dev.cpu().numpy().copy()
    src = host.data_ptr() + rng.permutation(2 * n)[:n].astype(np.int64) * size
    dst = dev.data_ptr() + rng.permutation(2 * n)[:n].astype(np.int64) * size
    sizes = np.full(n, size, dtype=np.int64)
    stream = torch.cuda.Stream()
    fn = batch.bind(driver.get(), Direction.H2D, torch.cuda.current_device())
    out = {"abi": fn.abi.requested if fn.abi else None, "refused": []}

    def poison_index():
        fn._attr_idx[0] = 1
        return lambda: fn._attr_idx.__setitem__(0, 0)

    def poison_order():
        fn._attr.srcAccessOrder = 0  # CU_MEMCPY_SRC_ACCESS_ORDER_INVALID
        return lambda: setattr(fn._attr, "srcAccessOrder", batch.access_order(Direction.H2D))

    for label, poison in (("attrsIdxs", poison_index), ("srcAccessOrder", poison_order)):
        undo = poison()
        try:
            fn(src, dst, sizes, stream)
        except DriverError as e:
            out["refused"].append(dict(poison=label, name=e.name, code=e.code, call=e.call, message=str(e)))
        finally:
            undo()
    stream.synchronize()
    out["untouched"] = bool((dev.cpu().numpy() == before).all())
    fn(src, dst, sizes, stream)  # the next transfer, on the same bound function
    stream.synchronize()
    want = before.copy()
    hb = host.numpy()
    for s, d in zip((src - host.data_ptr()).tolist(), (dst - dev.data_ptr()).tolist()):
        want[d:d + size] = hb[s:s + size]
    out["next_ok"] = bool((dev.cpu().numpy() == want).all())
    back = torch.empty(n * size, dtype=torch.uint8).pin_memory()  # and a resolved one, the other way
    swap = kvswap.resolve("d2h", policy=Policy(force="cuda.batch"))
    swap(dst, back.data_ptr() + np.arange(n, dtype=np.int64) * size, sizes, stream=stream)
    stream.synchronize()
    got = back.numpy().reshape(n, size)
    out["resolved_ok"] = all((got[i] == want[d:d + size]).all() for i, d in enumerate((dst - dev.data_ptr()).tolist()))
    print(json.dumps(out))
""")


def test_a_refused_batch_is_a_named_driver_error_and_the_next_transfer_works():
    run = subprocess.run([sys.executable, "-c", _RECOVER], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, f"child died ({run.returncode}): {run.stderr[-2000:]}"
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["abi"] is not None, out  # the batch path is what is under test
    assert out["refused"], f"the driver accepted every malformed attribute: {out}"
    for r in out["refused"]:
        assert r["name"].startswith("CUDA_ERROR_") and r["code"] > 0 and r["call"] == "cuMemcpyBatchAsync", r
    assert out["untouched"], "a refused batch moved bytes"
    assert out["next_ok"] and out["resolved_ok"], out
