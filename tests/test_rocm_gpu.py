"""ROCm backend on an AMD GPU: real HIP runtime, real copies, every byte checked.

These need a ROCm build of torch and an AMD GPU; elsewhere they are skipped with the
reason (on a CPU by the ``gpu`` marker, on an NVIDIA machine because torch.version.hip
is unset). None of them has run yet: no AMD GPU was available to the project.
"""
from __future__ import annotations

import ctypes
import mmap

import numpy as np
import pytest
import torch

from kvswap import InvalidTransferError, Policy, resolve
from kvswap.backends.rocm.batch import CHUNK_ENV, DEFAULT_CHUNK

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not getattr(torch.version, "hip", None),
                       reason="needs a ROCm build of torch and an AMD GPU (torch.version.hip is unset)"),
]
HOST_REGISTER_MAPPED = 0x2  # hipHostRegisterMapped
MEMCPY_DEVICE_TO_DEVICE = 3


@pytest.fixture(scope="module")
def hip():
    from kvswap.backends.rocm.hip import load_hip

    return load_hip()


def _pools(direction: str, nbytes: int, rng: np.random.Generator):
    """(source tensor, destination tensor): random source, poisoned destination."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    data = torch.from_numpy(rng.integers(0, 256, nbytes, dtype=np.uint8))
    if direction == "h2d":
        host.copy_(data)
        dev.fill_(0xA5)
        return host, dev
    dev.copy_(data.cuda())
    if direction == "d2d":
        return dev, torch.full((nbytes,), 0xA5, dtype=torch.uint8, device="cuda")
    host.fill_(0xA5)
    return dev, host


@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
@pytest.mark.parametrize("n, chunk", [(100, None), (DEFAULT_CHUNK + 808, None), (1000, "64")])
def test_batch_copy_moves_exactly_the_blocks(direction, n, chunk, monkeypatch):
    if chunk:
        monkeypatch.setenv(CHUNK_ENV, chunk)
    rng = np.random.default_rng()
    size, slot = 4096, 8192
    src_t, dst_t = _pools(direction, n * slot, rng)
    sizes = rng.integers(1, size + 1, n)
    src_off = rng.permutation(n) * slot + rng.integers(0, slot - size, n)
    dst_off = rng.permutation(n) * slot + rng.integers(0, slot - size, n)
    want = dst_t.cpu().numpy().copy()
    src_np = src_t.cpu().numpy()
    for s, d, k in zip(src_off.tolist(), dst_off.tolist(), sizes.tolist()):
        want[d:d + k] = src_np[s:s + k]
    fn = resolve(direction, device="cuda:0", policy=Policy(force="rocm.batch"))
    stream = torch.cuda.Stream()
    fn(src_t.data_ptr() + src_off, dst_t.data_ptr() + dst_off, sizes, stream=stream)
    stream.synchronize()
    assert np.array_equal(dst_t.cpu().numpy(), want)  # every byte, copied and untouched
    assert "rocm.batch" in fn.explain()


def test_runtime_matches_torch(hip):
    major, minor = (int(x) for x in str(torch.version.hip).split(".")[:2])
    v = hip.runtime_version()
    assert (v.major, v.minor) == (major, minor), hip.origin


def test_device_description():
    fn = resolve("h2d", device="cuda:0")
    d = fn.plan.device
    assert d.platform == "rocm" and d.arch.startswith("gfx") and d.compute_units > 0
    assert d.identity.startswith("rocm-") and d.details["source"] == "kvswap.backends.rocm"
    if not fn.plan.calibration["calibrated"]:
        assert "kvswap calibrate" in fn.explain()


def _translator():
    from kvswap.registry.platform import detect
    from kvswap.registry.plugins import plugin_host

    host = plugin_host()
    dev = detect(host, "cuda:0")
    fns = [f for _, f in host.call_each("kvswap_host_address_translator", device=dev) if f is not None]
    assert fns, "the rocm plugin offered no translator"
    return fns[0]


def test_torch_pinned_memory_translates_to_itself():
    buf = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    addrs = buf.data_ptr() + np.array([0, 4096, (1 << 20) - 64])
    assert np.array_equal(_translator()(addrs), addrs)


class Registered:
    """Page-aligned host memory registered with hipHostRegister (mapped), random bytes."""

    def __init__(self, hip, nbytes: int) -> None:
        self.lib, self.hip, self.nbytes = ctypes.CDLL(hip.origin), hip, nbytes
        self.area = mmap.mmap(-1, nbytes)
        self.view = np.frombuffer(self.area, dtype=np.uint8)
        self.view[:] = np.random.default_rng().integers(0, 256, nbytes, dtype=np.uint8)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.area))
        hip.check("hipHostRegister", self.lib.hipHostRegister(
            ctypes.c_void_p(self.base), ctypes.c_size_t(nbytes), ctypes.c_uint(HOST_REGISTER_MAPPED)))

    def close(self) -> None:
        self.lib.hipHostUnregister(ctypes.c_void_p(self.base))
        del self.view
        self.area.close()


def test_registered_memory_maps_to_addresses_the_device_reads(hip):
    reg = Registered(hip, 1 << 22)
    try:
        offs = np.array([0, 12345, reg.nbytes - 4096])
        mapped = _translator()(reg.base + offs, np.full(3, 4096))
        out = torch.empty(4096, dtype=torch.uint8, device="cuda")
        for off, addr in zip(offs.tolist(), mapped.tolist()):
            hip.check("hipMemcpy", reg.lib.hipMemcpy(ctypes.c_void_p(out.data_ptr()), ctypes.c_void_p(addr),
                                                     ctypes.c_size_t(4096), MEMCPY_DEVICE_TO_DEVICE))
            assert np.array_equal(out.cpu().numpy(), reg.view[off:off + 4096])
    finally:
        reg.close()


def test_kernel_route_reads_registered_memory_through_the_translator(hip):
    from kvswap import ResolutionError

    try:
        fn = resolve("h2d", device="cuda:0", policy=Policy(force="triton.kernel"))
    except ResolutionError as e:
        pytest.skip(f"no kernel route here: {e}")
    reg = Registered(hip, 1 << 22)
    try:
        rng = np.random.default_rng()
        n, size = 200, 8192
        dev = torch.full((n * 2 * size,), 0xA5, dtype=torch.uint8, device="cuda")
        src_off = rng.permutation(reg.nbytes // size)[:n] * size
        dst_off = rng.permutation(2 * n)[:n] * size
        want = dev.cpu().numpy().copy()
        for s, d in zip(src_off.tolist(), dst_off.tolist()):
            want[d:d + size] = reg.view[s:s + size]
        fn(reg.base + src_off, dev.data_ptr() + dst_off, np.full(n, size), stream=torch.cuda.current_stream())
        torch.cuda.synchronize()
        assert np.array_equal(dev.cpu().numpy(), want)
    finally:
        reg.close()


def test_unregistered_memory_is_refused():
    plain = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(InvalidTransferError, match="cannot reach it"):
        _translator()(np.array([plain.ctypes.data]))
