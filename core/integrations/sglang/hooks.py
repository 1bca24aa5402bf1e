"""The two AROUND hooks kvswap installs on SGLang's HiCache host pools, and what they serve.

SGLang's plugin loader (``sglang.srt.plugins.load_plugins``) calls kvswap's entry point,
which registers two AROUND hooks with SGLang's ``HookRegistry``; the loader then applies
them to ``HostKVCache`` (an AROUND hook is called as ``hook(original, self, *args)``). Every
HiCache copy between the device and the host goes through the two methods hooked:
``load_to_device_per_layer_physical`` (one layer of a load, inside SGLang's host-to-device
stream) and ``backup_from_device_all_layer_physical`` (a backup, inside its device-to-host
stream).

A call is served by the pool's kvswap movers (:mod:`.movers`) where the pool is an
``MHATokenToKVPoolHost`` or ``MLATokenToKVPoolHost`` (the classes themselves: subclasses
keep pages of their own) in a served layout, the io backend is ``kernel`` or ``direct``, and
the indices are whole pages. Anything else goes to SGLang's own method, unchanged, with a
debug line saying why. This module is the only one of kvswap that imports SGLang.
"""
from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any, Callable, Union

import sglang
from sglang.srt.mem_cache.pool_host.base import HostKVCache
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from ... import ConfigurationError
from .layouts import PoolLayout, mha_layout, mla_layout
from .movers import PoolMovers
from .pages import transfer_pages

TESTED_SGLANG = "0.5.23"
ENV = "KVSWAP_SGLANG"  # "off": the entry point installs no hook
ON, OFF = ("on", "1", "true", "yes"), ("off", "0", "false", "no")
IO_BACKENDS = ("kernel", "direct")
_BASE = f"{HostKVCache.__module__}.{HostKVCache.__qualname__}"
LOAD_TARGET = f"{_BASE}.load_to_device_per_layer_physical"
BACKUP_TARGET = f"{_BASE}.backup_from_device_all_layer_physical"

log = logging.getLogger("kvswap.sglang")

_LAYOUTS: dict[type, Callable[[Any], Union[PoolLayout, str]]] = {
    MHATokenToKVPoolHost: mha_layout,
    MLATokenToKVPoolHost: mla_layout,
}
# Per host pool: its movers, or why it is not served (decided once, at its first call).
_POOLS: weakref.WeakKeyDictionary[Any, Union[PoolMovers, str]] = weakref.WeakKeyDictionary()
_POOLS_LOCK = threading.Lock()


def enabled() -> bool:
    """Whether :data:`ENV` lets the hooks in (unset: yes).

    :raises ConfigurationError: a value that is neither on nor off.
    """
    value = os.environ.get(ENV, "on").strip().lower()
    if value in ON:
        return True
    if value in OFF:
        return False
    raise ConfigurationError(f"{ENV}={os.environ.get(ENV)!r} is not valid; choose 'on' or 'off'")


def register() -> None:
    """Register kvswap's hooks with SGLang's ``HookRegistry`` (SGLang's plugin loader applies
    them), unless ``KVSWAP_SGLANG=off``."""
    if not enabled():
        log.info("kvswap: %s=off, HiCache copies stay SGLang's own", ENV)
        return
    if sglang.__version__.split(".")[:2] != TESTED_SGLANG.split(".")[:2]:
        log.warning("kvswap's SGLang hooks are tested with SGLang %s; this is SGLang %s, whose HiCache host "
                    "pools may differ", TESTED_SGLANG, sglang.__version__)
    HookRegistry.register(LOAD_TARGET, load_layer, HookType.AROUND)
    HookRegistry.register(BACKUP_TARGET, backup_all_layers, HookType.AROUND)


def pool_state(pool: Any) -> Union[PoolMovers, str]:
    """The pool's movers, or why kvswap does not serve it; decided at the first call."""
    state = _POOLS.get(pool)
    if state is not None:
        return state
    with _POOLS_LOCK:
        state = _POOLS.get(pool)
        if state is None:
            describe = _LAYOUTS.get(type(pool))
            if describe is None:
                state = f"pool class {type(pool).__name__} is not served (served: MHATokenToKVPoolHost, " \
                        f"MLATokenToKVPoolHost)"
            else:
                found = describe(pool)
                state = PoolMovers(found, log) if isinstance(found, PoolLayout) else found
            if isinstance(state, str):
                log.debug("kvswap does not serve SGLang host pool %s %r: %s", type(pool).__name__,
                          getattr(pool, "pool_label", "?"), state)
            _POOLS[pool] = state
    return state


def explain(pool: Any) -> str:
    """What kvswap does with ``pool``'s loads and backups, and why (or why it does not serve it)."""
    state = _POOLS.get(pool)
    if state is None:
        return f"kvswap has not seen SGLang host pool {type(pool).__name__} yet (it decides at the first copy)"
    if isinstance(state, str):
        return f"kvswap does not serve SGLang host pool {type(pool).__name__}: {state}"
    return state.explain()


def _fall_through(why: str, pool: Any, what: str) -> None:
    log.debug("kvswap leaves %s of SGLang host pool %s %r to SGLang: %s", what, type(pool).__name__,
              getattr(pool, "pool_label", "?"), why)


def load_layer(original: Callable[..., Any], pool: Any, device_pool: Any, host_indices: Any, device_indices: Any,
               layer_id: int, io_backend: str, *, is_draft: bool = False) -> Any:
    """AROUND hook of ``HostKVCache.load_to_device_per_layer_physical``: one layer of a load."""
    state = pool_state(pool)
    why = None
    if isinstance(state, str):
        why = state  # logged once, when decided
    elif io_backend not in IO_BACKENDS:
        why = f"io backend {io_backend!r} is not served (served: {', '.join(IO_BACKENDS)})"
        _fall_through(why, pool, f"layer {layer_id}")
    else:
        layer = state.layout.layer(layer_id)
        if layer is None or not (layer.target or is_draft):
            why = f"layer {layer_id} (is_draft={is_draft}) is none this pool loads"
            _fall_through(why, pool, f"layer {layer_id}")
        else:
            pages, first = state.last.pages(host_indices, device_indices, state.layout.page_size)
            if isinstance(pages, str):
                why = pages
                if first:  # once a transfer, not once a layer
                    _fall_through(why, pool, "a load")
            elif len(pages.host):
                state.load(layer, pages)
                return None
            else:
                return None  # no page to move
    return original(pool, device_pool, host_indices, device_indices, layer_id, io_backend, is_draft=is_draft)


def backup_all_layers(original: Callable[..., Any], pool: Any, device_pool: Any, host_indices: Any,
                      device_indices: Any, io_backend: str) -> Any:
    """AROUND hook of ``HostKVCache.backup_from_device_all_layer_physical``: a backup."""
    state = pool_state(pool)
    why = state if isinstance(state, str) else None
    if why is None and io_backend not in IO_BACKENDS:
        why = f"io backend {io_backend!r} is not served (served: {', '.join(IO_BACKENDS)})"
        _fall_through(why, pool, "a backup")
    if why is None:
        pages = transfer_pages(host_indices, device_indices, state.layout.page_size)  # type: ignore[union-attr]
        if isinstance(pages, str):
            _fall_through(pages, pool, "a backup")
        else:
            if len(pages.host):
                state.backup(pages)  # type: ignore[union-attr]
            return None
    return original(pool, device_pool, host_indices, device_indices, io_backend)
