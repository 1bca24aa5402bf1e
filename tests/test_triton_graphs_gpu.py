"""Small kernel copies replayed from CUDA graphs (backends/triton_generic/graphs.py): every
byte of every call, including calls enqueued while all of a shape's buffers are still being
read (they launch the plain way), and nothing outside the copied blocks. GPU only."""
from __future__ import annotations

import numpy as np
import pytest

import kvswap
from kvswap import Policy
from kvswap.backends.triton_generic import graphs
from kvswap.backends.triton_generic.launch import interpreting

pytestmark = pytest.mark.gpu
BLOCK = 4096
SLOTS = 2048


@pytest.fixture
def torch_gpu():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    if interpreting():
        pytest.skip("TRITON_INTERPRET=1 is set: Triton would not run on the GPU")
    return torch


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_graphed_small_copies_move_every_byte_and_nothing_else(torch_gpu, direction):
    torch = torch_gpu
    rng = np.random.default_rng(7 if direction == "h2d" else 8)
    host = torch.randint(0, 256, (SLOTS * BLOCK,), dtype=torch.uint8).pin_memory()
    dev = torch.randint(0, 256, (SLOTS * BLOCK,), dtype=torch.uint8, device="cuda:0")
    src_t, dst_t = (host, dev) if direction == "h2d" else (dev, host)
    fn = kvswap.resolve(direction, device="cuda:0", policy=Policy(force="triton.kernel"))
    stream = torch.cuda.Stream()
    burst = graphs.RING + 2  # more calls in flight than a shape has buffers
    for n in (1, 16, 64):
        for _ in range(2 * graphs.SEEN_BEFORE_CAPTURE):
            src_slots = rng.choice(SLOTS, burst * n, replace=False)
            dst_slots = rng.choice(SLOTS, burst * n, replace=False)
            # Poison: each destination block holds its source's complement before the copy.
            rows = dst_t.view(SLOTS, BLOCK)
            rows[torch.as_tensor(dst_slots, device=rows.device)] = ~src_t.view(SLOTS, BLOCK)[
                torch.as_tensor(src_slots, device=src_t.device)].to(rows.device)
            torch.cuda.synchronize()
            before = dst_t.cpu().numpy().copy()
            for k in range(burst):  # enqueued back to back, one sync at the end
                s = src_slots[k * n:(k + 1) * n].astype(np.int64) * BLOCK + src_t.data_ptr()
                d = dst_slots[k * n:(k + 1) * n].astype(np.int64) * BLOCK + dst_t.data_ptr()
                fn(s, d, np.full(n, BLOCK, dtype=np.int64), stream=stream)
            stream.synchronize()
            src, dst = src_t.cpu().numpy().reshape(SLOTS, BLOCK), dst_t.cpu().numpy().reshape(SLOTS, BLOCK)
            assert np.array_equal(dst[dst_slots], src[src_slots]), (direction, n)
            untouched = np.setdiff1d(np.arange(SLOTS), dst_slots)
            assert np.array_equal(dst[untouched], before.reshape(SLOTS, BLOCK)[untouched]), (direction, n)
    ((impl, sms, _),) = fn.assign(s, d, np.full(n, BLOCK, dtype=np.int64))
    g = fn._fns[(impl, sms)]._graphs
    assert g.failed is None and len(g._rings) == 3  # one ring per shape, each captured
    assert "replayed from CUDA graphs" in fn.explain()


def test_graphs_turned_off_launch_plainly_and_still_copy_every_byte(torch_gpu, monkeypatch):
    torch = torch_gpu
    monkeypatch.setenv(graphs.ENV, "off")
    rng = np.random.default_rng(9)
    host = torch.randint(0, 256, (SLOTS * BLOCK,), dtype=torch.uint8).pin_memory()
    dev = torch.randint(0, 256, (SLOTS * BLOCK,), dtype=torch.uint8, device="cuda:0")
    fn = kvswap.resolve("h2d", device="cuda:0", policy=Policy(force="triton.kernel"))
    n = 16
    for _ in range(2 * graphs.SEEN_BEFORE_CAPTURE):
        src_slots, dst_slots = rng.choice(SLOTS, n, replace=False), rng.choice(SLOTS, n, replace=False)
        s = src_slots.astype(np.int64) * BLOCK + host.data_ptr()
        d = dst_slots.astype(np.int64) * BLOCK + dev.data_ptr()
        fn(s, d, np.full(n, BLOCK, dtype=np.int64))
        torch.cuda.synchronize()
        got = dev.cpu().numpy().reshape(SLOTS, BLOCK)[dst_slots]
        assert np.array_equal(got, host.numpy().reshape(SLOTS, BLOCK)[src_slots])
    ((impl, sms, _),) = fn.assign(s, d, np.full(n, BLOCK, dtype=np.int64))
    g = fn._fns[(impl, sms)]._graphs
    assert not g._rings and graphs.ENV in g.failed
    assert f"CUDA graphs off ({graphs.ENV}=off)" in fn.explain()
