"""``kvswap.host_empty``: a pinned host tensor on the NUMA node of the GPU it feeds.

How the pages land on the node, and why this way:

* The memory is a private anonymous mapping, faulted in (zeroed) by threads bound with
  ``sched_setaffinity`` to the node's CPUs. Linux places a page on the node of the CPU that
  first touches it, so the pages land there; where that node is full the kernel takes the
  next one instead of failing. ``numa_alloc_onnode`` (libnuma) binds with ``MPOL_BIND``
  instead, which on a full node ends in the OOM killer rather than a slower page, and would
  add a library to what kvswap loads; first touch needs nothing but sysfs.
* Only then is the range pinned, with ``cudaHostRegister`` (``hipHostRegister`` on ROCm):
  registering pins the pages where they already are and moves none (pages not yet touched
  it would fault in from the registering thread, on that thread's node).
* Not torch's pinned allocator inside a bound thread: its cache hands back blocks freed
  by any thread on any node, it rounds each allocation up to a power of two (a 40 GiB
  KV cache takes 64), and with ``pinned_use_cuda_host_register`` it touches the pages from
  its own unbound threads.

Where the node is placed is then asked back of the kernel (``move_pages``), and a warning
says when the pages landed elsewhere. On a machine of one node there is nothing to place;
where the node is unknown, or there is no accelerator to pin for, the tensor is still
correct (zeroed, the shape and dtype asked) and a warning says, once, what was skipped.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
import warnings
from typing import Any, Optional, Sequence, Union

from ..errors import AllocationError, ConfigurationError, DriverError
from ..types import DeviceInfo
from .numa import PAGE, NumaWarning, PagePlacement, page_nodes, topology

# cudaHostRegisterPortable | cudaHostRegisterMapped (the same bits for hipHostRegister):
# pinned for every device's context (one KV pool may serve several GPUs' movers), and
# mapped so that a copy kernel can read and write it through unified addressing.
REGISTER_FLAGS = 0x1 | 0x2
# Threads faulting the pages in: the node's memory bandwidth is reached with a few.
TOUCH_THREADS = 8

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, NumaWarning, stacklevel=3)


class _Mapping:
    """Owns the pages behind a tensor from :func:`host_empty`: on collection, after the
    last view of the tensor is gone, unpins them, then the mapping unmaps."""

    def __init__(self, nbytes: int) -> None:
        self.registered: Optional[Any] = None  # the cudart module that pinned it (first: __del__ reads it)
        self.size = -(-nbytes // PAGE) * PAGE
        self.mm = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.array = (ctypes.c_ubyte * self.size).from_buffer(self.mm)
        self.addr = ctypes.addressof(self.array)
        self.array._kvswap_owner = self  # the tensor holds the array, the array holds this

    def __del__(self) -> None:
        if self.registered is not None:
            try:
                self.registered.cudaHostUnregister(self.addr)
            except Exception:  # interpreter shutdown: the driver may be gone already
                pass


def _touch(addr: int, nbytes: int, cpus: frozenset[int]) -> None:
    """Bind the calling thread to ``cpus`` and fault ``[addr, addr + nbytes)`` in."""
    os.sched_setaffinity(0, cpus)  # 0: this thread alone, not the process
    ctypes.memset(addr, 0, nbytes)  # ctypes lets go of the GIL: the threads run at once


def _first_touch(addr: int, nbytes: int, cpus: frozenset[int]) -> None:
    pages = nbytes // PAGE
    threads = max(1, min(TOUCH_THREADS, len(cpus), pages))
    bounds = [addr + (pages * i // threads) * PAGE for i in range(threads)] + [addr + nbytes]
    errors: list[BaseException] = []

    def work(lo: int, hi: int) -> None:
        try:
            _touch(lo, hi - lo, cpus)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    workers = [threading.Thread(target=work, args=(bounds[i], bounds[i + 1]), name=f"kvswap-touch-{i}")
               for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]


def _device_info(device: Any) -> tuple[Optional[DeviceInfo], str]:
    if isinstance(device, DeviceInfo):
        return device, ""
    from ..registry.platform import detect, device_spec, torch_platform
    from ..registry.plugins import plugin_host

    device_spec(device)  # a malformed spec is the caller's mistake on any machine
    try:
        return detect(plugin_host(), device), ""
    except ConfigurationError as e:
        if torch_platform() != "cpu":
            raise
        return None, f"device {device!r} is not here ({e})"


def _shape(shape: Union[int, Sequence[int]]) -> tuple[int, ...]:
    try:
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
    except TypeError:
        dims = (shape,)  # type: ignore[assignment]
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in dims):
        raise ConfigurationError(f"shape={shape!r} must be an int >= 0 or a sequence of them")
    return dims


def host_empty(shape: Union[int, Sequence[int]], dtype: Any = None, *, device: Any, pin: bool = True,
               node: Optional[int] = None) -> Any:
    """A zeroed host tensor on the NUMA node of ``device``, pinned for copies to and from it.

    :param shape: the tensor's shape.
    :param dtype: a torch dtype (default: torch's default dtype).
    :param device: the GPU the tensor is copied to and from: ``"cuda:N"``, an index, a
        torch.device, or a :class:`~kvswap.DeviceInfo`.
    :param pin: page-lock (and map) it, as every device route needs.
    :param node: place it on this NUMA node instead of the device's (measuring the cost
        of the wrong node, for one).
    :raises ConfigurationError: a bad shape (one of more bytes than a process can address
        included), dtype, device or node.
    :raises AllocationError: the memory could not be mapped.
    :raises DriverError: the pages could not be pinned.

    Placement is skipped, with a :class:`~kvswap.memory.numa.NumaWarning` once per reason, where the
    device's node is unknown or the node has no CPU this process may run on; on a machine
    without an accelerator the tensor is not pinned (nothing could use the pinning).
    """
    import torch

    dims = _shape(shape)
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if not isinstance(dtype, torch.dtype):
        raise ConfigurationError(f"dtype={dtype!r} must be a torch.dtype")
    numel = 1
    for d in dims:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes > sys.maxsize:
        raise ConfigurationError(f"shape={dims!r} of {dtype} is {nbytes:,} bytes, more than a process can address")

    info, why = _device_info(device)
    topo = topology()
    if node is not None:
        known = topo.memory_nodes()
        if isinstance(node, bool) or not isinstance(node, int) or node < 0 or (known and node not in known):
            raise ConfigurationError(f"node={node!r} is not a NUMA node with memory here; nodes: {list(known)}")
    elif info is not None:
        node, why = topo.placement_target(info)
    if why:
        _warn_once(f"skip:{why}", f"host memory placed without regard to NUMA: {why}")
    accelerator = torch.cuda.is_available()
    if pin and not accelerator:
        _warn_once("nopin", "host memory not pinned: torch sees no CUDA or ROCm device to pin it for")
    if nbytes == 0:
        return torch.empty(dims, dtype=dtype, pin_memory=pin and accelerator)

    try:
        owner = _Mapping(nbytes)
    except OSError as e:  # ENOMEM: more than the address space or the overcommit policy allows
        raise AllocationError(f"a host tensor of shape {dims!r}", nbytes, "host", f"mmap: {e.strerror}") from e
    if node is not None:
        cpus = frozenset(topo.node_cpus(node)) & frozenset(os.sched_getaffinity(0))
        if cpus:
            _first_touch(owner.addr, owner.size, cpus)
        else:
            _warn_once(f"nocpu:{node}", f"host memory not placed on NUMA node {node}: none of its CPUs "
                       f"({list(topo.node_cpus(node)) or 'none'}) is one this process may run on")
            node = None
    if pin and accelerator:
        _register(owner)
    tensor = torch.frombuffer(owner.array, dtype=dtype, count=numel).view(dims)
    if node is not None:
        placed = page_nodes(owner.addr, owner.size)
        if placed is not None and placed.off(node):
            _warn_once(f"elsewhere:{node}", f"host memory asked for on NUMA node {node} landed partly elsewhere "
                       f"({placed.describe()}): the node may be short of free memory")
    return tensor


def _register(owner: _Mapping) -> None:
    import torch

    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(owner.addr, owner.size, REGISTER_FLAGS)
    code = int(getattr(err, "value", err))
    if code != 0:
        text = None
        try:
            text = cudart.cudaGetErrorString(err)
        except Exception:
            pass
        raise DriverError("cudaHostRegister", code, None, text)
    owner.registered = cudart


def host_placement(tensor: Any) -> Optional[PagePlacement]:
    """Where a host tensor's pages sit (sampled), or None where this machine cannot say."""
    from .numa import tensor_nodes

    return tensor_nodes(tensor)
