"""SGLang's own HiCache objects for kvswap's tests: device and host pools, the paged allocator,
HiCacheController, kvswap loaded by SGLang's plugin loader, and an oracle of where a page
lies in each host layout (read through SGLang's own ``get_data_page``, not kvswap's views).

Importing this module skips the importing test module where SGLang is absent, or fails it
with KVSWAP_REQUIRE_SGLANG=1 (CI's SGLang venv, made by .ci/sglang-setup).
"""
from __future__ import annotations

import importlib.util
import os
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import pytest

if importlib.util.find_spec("sglang") is None:
    if os.environ.get("KVSWAP_REQUIRE_SGLANG") == "1":
        pytest.fail("KVSWAP_REQUIRE_SGLANG=1 but SGLang is not installed here: run .ci/sglang-setup and use "
                    ".venv-sglang/bin/python", pytrace=False)
    pytest.skip("SGLang is not installed (bash .ci/sglang-setup makes .venv-sglang with it)",
                allow_module_level=True)

import torch  # noqa: E402
import sglang.srt.plugins as sglang_plugins  # noqa: E402
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.base import HostKVCache  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

HOOKED = ("load_to_device_per_layer_physical", "backup_from_device_all_layer_physical")
P = 4  # tokens a page
LAYERS, HEADS, HEAD_DIM = 3, 2, 8
LORA, ROPE = 16, 8  # MLA: a row of kv_lora_rank + qk_rope_head_dim
DEVICE_TOKENS = 64  # 16 pages (SGLang adds a padding page: row 0..P-1)

# The (layout, io backend) pairs SGLang's server arguments leave (kernel + page_first_direct
# becomes direct, direct + page_first becomes page_first_direct); page_head is MHA's only.
MHA_CASES = [("layer_first", "kernel"), ("page_first", "kernel"), ("page_head", "kernel"),
             ("layer_first", "direct"), ("page_first_direct", "direct")]
MLA_CASES = [("layer_first", "kernel"), ("page_first", "kernel"), ("layer_first", "direct"),
             ("page_first_direct", "direct")]
DTYPES = [torch.bfloat16, torch.float16]
CASES = [(kind, layout, io) for kind, cases in (("mha", MHA_CASES), ("mla", MLA_CASES)) for layout, io in cases]


def dtype_id(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


# -- kvswap loaded by SGLang's plugin loader --------------------------------------------------
def restore_hooks() -> None:
    """Undo every patch on HostKVCache (``HookRegistry.reset`` forgets hooks but leaves the
    patched methods) and let ``load_plugins`` run again."""
    for name in HOOKED:
        method = HostKVCache.__dict__[name]
        while hasattr(method, "__wrapped__"):
            method = method.__wrapped__
        setattr(HostKVCache, name, method)
    HookRegistry.reset()
    sglang_plugins._plugins_loaded = False


def hooked(name: str) -> bool:
    return hasattr(HostKVCache.__dict__[name], "__wrapped__")


@pytest.fixture
def plugin(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """kvswap's hooks, installed the way a server gets them: SGLANG_PLUGINS=kvswap and SGLang's
    own ``load_plugins()``; restored afterwards."""
    restore_hooks()
    monkeypatch.setenv("SGLANG_PLUGINS", "kvswap")
    monkeypatch.delenv("KVSWAP_SGLANG", raising=False)
    sglang_plugins.load_plugins()
    assert all(hooked(name) for name in HOOKED), "SGLang's plugin loader did not apply kvswap's hooks"
    yield
    restore_hooks()


# -- SGLang's pools and controller ------------------------------------------------------------
@dataclass
class HiCache:
    """One HiCache set-up: device pool, host pool, allocator, controller."""

    kind: str
    device_pool: Any
    host: Any
    allocator: Any
    controller: Any

    @property
    def device_tensors(self) -> list[Any]:
        d = self.device_pool
        return list(d.k_buffer) + list(d.v_buffer) if self.kind == "mha" else list(d.kv_buffer)

    @property
    def page_size(self) -> int:
        return self.host.page_size

    def device_page(self, page: int) -> Any:
        """Device page ``page`` as ``[2, L, P, H, D]`` (MHA) or ``[L, P, 1, D']`` (MLA), a copy."""
        rows = slice(page * self.page_size, (page + 1) * self.page_size)
        d = self.device_pool
        if self.kind == "mha":
            return torch.stack([torch.stack([t[rows] for t in d.k_buffer]),
                                torch.stack([t[rows] for t in d.v_buffer])])
        return torch.stack([t[rows] for t in d.kv_buffer])

    def host_page(self, page: int) -> Any:
        """Host page ``page`` as SGLang's ``get_data_page`` reads it (the layout's order), a copy."""
        return self.host.get_data_page(page * self.page_size, flat=False).clone()

    def in_host_order(self, device_page: Any) -> Any:
        """A :meth:`device_page` arranged as :meth:`host_page` returns it in this layout."""
        layout = self.host.layout
        if self.kind == "mha":  # [2, L, P, H, D]
            return {"layer_first": device_page, "page_first": device_page.permute(0, 2, 1, 3, 4),
                    "page_first_direct": device_page.unsqueeze(1),
                    "page_head": device_page.permute(0, 3, 2, 1, 4).unsqueeze(1)}[layout]
        return {"layer_first": device_page, "page_first": device_page.permute(1, 0, 2, 3),  # [L, P, 1, D']
                "page_first_direct": device_page.unsqueeze(0)}[layout]

    def host_mask(self, pages: list[int]) -> Any:
        """True where the host buffer holds one of ``pages``, found through SGLang's ``get_data_page``."""
        buffer = self.host.kv_buffer
        mask = torch.zeros(buffer.shape, dtype=torch.bool, device=buffer.device)
        self.host.kv_buffer = mask
        try:
            for page in pages:
                self.host.get_data_page(page * self.page_size, flat=False).fill_(True)
        finally:
            self.host.kv_buffer = buffer
        return mask

    def host_pages_in_order(self, order: list[int]) -> None:
        """Make the host pool hand out ``order``'s pages first, in that order: every page taken,
        then these freed one by one (SGLang's own alloc and free)."""
        taken = self.host.alloc(self.host.available_size())
        size = self.page_size
        for page in order:
            self.host.free(taken[page * size:(page + 1) * size])


# Host pools built pinned: SGLang registers them with cudaHostRegister and unregisters them only in
# ``destroy()``. A test must call it (``destroy_pinned``) before their memory goes back: a later
# pool at the same addresses would otherwise fail to register.
PINNED: list[Any] = []


def destroy_pinned() -> None:
    """Unregister every pinned host pool built so far, once the device is done with them."""
    torch.cuda.synchronize()
    while PINNED:
        PINNED.pop().destroy()


def build(kind: str, layout: str, io: str, dtype: Any, *, device: str = "cpu", pin: bool = False,
          storage: Optional[str] = None, host_class: Any = None, page_size: int = P,
          device_tokens: int = DEVICE_TOKENS, layers: int = LAYERS, heads: int = HEADS, head_dim: int = HEAD_DIM,
          lora: int = LORA, rope: int = ROPE) -> HiCache:
    """SGLang's pools and controller for one case, as SGLang's assembler builds them."""
    if kind == "mha":
        dev = MHATokenToKVPool(size=device_tokens, page_size=page_size, dtype=dtype, head_num=heads,
                               head_dim=head_dim, layer_num=layers, device=device, enable_memory_saver=False)
        info = dev.get_device_pool_infos()[0].buffer_info
        host = (host_class or MHATokenToKVPoolHost)(
            info, host_to_device_ratio=2.0, host_size=0, page_size=page_size, layout=layout, pin_memory=pin,
            device="cpu", device_capacity_tokens=dev.size, start_layer=dev.start_layer, end_layer=dev.end_layer)
    else:
        dev = MLATokenToKVPool(size=device_tokens, page_size=page_size, dtype=dtype, kv_lora_rank=lora,
                               qk_rope_head_dim=rope, layer_num=layers, device=device, enable_memory_saver=False)
        info = dev.get_device_pool_infos()[0].buffer_info
        host = (host_class or MLATokenToKVPoolHost)(
            info, host_to_device_ratio=2.0, host_size=0, page_size=page_size, layout=layout, pin_memory=pin,
            device="cpu", device_capacity_tokens=dev.size, start_layer=dev.start_layer, end_layer=dev.end_layer,
            target_layer_num=dev.layer_num, override_kv_cache_dim=dev.kv_cache_dim)
    alloc = PagedTokenToKVPoolAllocator(size=device_tokens, page_size=page_size, dtype=dtype, device=device,
                                        kvcache=dev, need_sort=False)
    # A controller outside a server: one rank, nothing published, as SGLang's own tests state it.
    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1):
        ctl = HiCacheController(alloc, host, page_size, tp_group=None, load_cache_event=threading.Event(), io_backend=io,
                                storage_backend=storage, model_name="kvswap-e2e" if storage else None)
    if pin:
        PINNED.append(host)
    return HiCache(kind, dev, host, alloc, ctl)


def random_bits(shape: Any, dtype: Any, device: Any = "cpu", generator: Any = None) -> Any:
    """Random 16-bit patterns (NaNs among them) viewed as ``dtype``: compare them bitwise."""
    return torch.randint(-(1 << 15), 1 << 15, tuple(shape), dtype=torch.int16, generator=generator).view(dtype).to(device)


def bits(t: Any) -> Any:
    return t.contiguous().view(torch.int16).cpu()


def tokens(pages: list[int], page_size: int = P) -> Any:
    """The token indices of ``pages``, page after page."""
    return (torch.tensor(pages, dtype=torch.int64)[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def pages_of(indices: Any, page_size: int = P) -> list[int]:
    return (indices.cpu().reshape(-1, page_size)[:, 0] // page_size).tolist()


# -- the round trip: device -> host -> device through HiCacheController ------------------------
DEVICE_PAGES = [7, 2, 11, 4]  # written from, in this order
HOST_ORDER = [9, 2, 14, 5]  # the host pool hands these out first, in this order


def fill_device(cache: HiCache, gen: Any) -> list[Any]:
    """Random bits in every device row; their bits, to compare with later."""
    for t in cache.device_tensors:
        t.copy_(random_bits(t.shape, t.dtype, t.device, gen))
    return [bits(t) for t in cache.device_tensors]


def check_host(cache: HiCache, host_pages: list[int], device_pages: list[int], before: Any) -> None:
    """Host page ``host_pages[i]`` holds device page ``device_pages[i]``; the rest is as before."""
    for h, d in zip(host_pages, device_pages):
        assert torch.equal(bits(cache.host_page(h)), bits(cache.in_host_order(cache.device_page(d)))), \
            f"host page {h} does not hold device page {d}"
    outside = ~cache.host_mask(host_pages)
    assert torch.equal(bits(cache.host.kv_buffer)[outside], before[outside]), "host bytes outside the job changed"


def check_device(cache: HiCache, device_pages: list[int], expected_pages: list[Any], before: list[Any]) -> None:
    """Device page ``device_pages[i]`` holds ``expected_pages[i]``; every other row is as before."""
    for d, want in zip(device_pages, expected_pages):
        assert torch.equal(bits(cache.device_page(d)), bits(want)), f"device page {d} is wrong"
    rows = torch.ones(cache.device_tensors[0].shape[0], dtype=torch.bool)
    for d in device_pages:
        rows[d * P:(d + 1) * P] = False
    for t, b in zip(cache.device_tensors, before):
        assert torch.equal(bits(t)[rows], b[rows]), "device rows outside the job changed"


def round_trip(kind: str, layout: str, io: str, dtype: Any, *, device: str = "cpu", pin: bool = False) -> HiCache:
    """Write device pages (out of order) to host pages (out of order) with ``controller.write``,
    then load them back in yet another order with ``load`` and ``start_loading``, waiting on
    SGLang's own finish events; every byte checked, and every byte outside each job."""
    gen = torch.Generator().manual_seed(sum(map(ord, f"{kind}{layout}{io}{dtype}")))
    cache = build(kind, layout, io, dtype, device=device, pin=pin)
    ctl, host = cache.controller, cache.host
    fill_device(cache, gen)
    host.kv_buffer.copy_(random_bits(host.kv_buffer.shape, dtype, "cpu", gen))
    host_before = bits(host.kv_buffer)
    cache.host_pages_in_order(HOST_ORDER)

    # Write: device pages out of order -> the host pages the pool hands out (out of order too).
    written = {d: cache.device_page(d) for d in DEVICE_PAGES}
    host_indices = ctl.write(tokens(DEVICE_PAGES).to(device))  # a server's are on the device
    ctl.ack_write_queue[-1].finish_event.synchronize()
    assert pages_of(host_indices) == HOST_ORDER
    check_host(cache, HOST_ORDER, DEVICE_PAGES, host_before)

    # Load: host pages in another order -> the device pages the allocator hands out.
    device_before = fill_device(cache, gen)
    load_order = [HOST_ORDER[i] for i in (2, 0, 3, 1)]
    device_indices = ctl.load(tokens(load_order))
    ctl.start_loading()
    ctl.ack_load_queue[-1].finish_event.synchronize()
    source = {h: written[d] for h, d in zip(HOST_ORDER, DEVICE_PAGES)}
    check_device(cache, pages_of(device_indices), [source[h] for h in load_order], device_before)

    return cache
