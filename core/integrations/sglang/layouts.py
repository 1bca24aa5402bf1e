"""An SGLang HiCache host pool's tensors, per layer, as views whose blocks are pages.

SGLang's host pools hold K and V (MHA) or the latent (MLA) of every layer in one buffer, laid
out by ``--hicache-mem-layout``; the device pool keeps one ``[rows, heads, dim]`` tensor per
layer and component, a page being ``page_size`` consecutive rows. Each layer's host part is
viewed here as ``[pages, page_size, heads, dim]`` (views of SGLang's own buffers, nothing
allocated or copied), so that a :class:`kvswap.BlockMover` pairs host page ``h`` with device
page ``d`` element by element and cuts them into the pieces both sides hold in one run:

================== ============================== ==============================================
layout             host buffer (MHA; MLA: no 2)   one layer's page on the host
================== ============================== ==============================================
layer_first        ``[2, L, S, H, D]``            one run of ``P*H*D`` per component
page_first         ``[2, S, L, H, D]``            ``P`` runs of ``H*D`` (a token's row)
page_first_direct  ``[2, pages, L, P, H, D]``     one run of ``P*H*D`` per component
page_head          ``[2, pages, H, P, L, D]``     ``P*H`` runs of ``D`` (MHA only)
================== ============================== ==============================================

Over all layers (a backup), a page's layers are adjacent on the host in ``page_first``,
``page_first_direct`` and ``page_head``: the mover then sees long host runs (see
``BlockMover.explain()``). Nothing here imports SGLang: the pool is read by its attributes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


@dataclass(frozen=True)
class LayerTensors:
    """One layer of a pool: its host and device views, component by component.

    :ivar layer_id: the id SGLang's controller passes for this layer.
    :ivar host: per component (K and V, or the MLA latent), ``[pages, page_size, ...]``.
    :ivar device: the same components on the device, ``[pages, page_size, ...]``.
    :ivar target: a target layer; a load of a draft layer comes with ``is_draft``.
    """

    layer_id: int
    host: tuple[Any, ...]
    device: tuple[Any, ...]
    target: bool


@dataclass(frozen=True)
class PoolLayout:
    """What kvswap moves for one host pool: its layers' views and how to name it."""

    name: str
    layout: str
    page_size: int
    layers: tuple[LayerTensors, ...]
    _by_id: dict[int, LayerTensors] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_id", {t.layer_id: t for t in self.layers})

    def layer(self, layer_id: int) -> Optional[LayerTensors]:
        """The layer SGLang's controller calls ``layer_id``, or None."""
        return self._by_id.get(layer_id)

    @property
    def on_device(self) -> bool:
        """Whether the device side is an accelerator (else host memory: SGLang on a CPU)."""
        return self.layers[0].device[0].device.type != "cpu"


def pool_name(pool: Any, kind: str) -> str:
    """How messages name a pool: its class, label, kind, layout and pages."""
    return (f"{type(pool).__name__} {getattr(pool, 'pool_label', '?')!r} ({kind}, layout "
            f"{getattr(pool, 'layout', '?')}, {getattr(pool, 'layer_num', '?')} layers, pages of "
            f"{getattr(pool, 'page_size', '?')} tokens)")


def host_view(buffer: Any, layout: str, layer: int, page_size: int) -> Any:
    """One layer of one component of a host buffer as ``[pages, page_size, heads, dim]``."""
    if layout == "page_first_direct":  # [pages, L, P, H, D]
        return buffer[:, layer]
    if layout == "page_head":  # [pages, H, P, L, D]
        return buffer[:, :, :, layer].transpose(1, 2)
    rows = buffer[layer] if layout == "layer_first" else buffer[:, layer]  # [S, H, D]
    return rows.unflatten(0, (rows.shape[0] // page_size, page_size))


def device_view(rows: Any, page_size: int) -> Any:
    """A device pool's per-layer ``[rows, heads, dim]`` tensor as ``[pages, page_size, heads, dim]``."""
    pages = rows.shape[0] // page_size
    return rows[: pages * page_size].unflatten(0, (pages, page_size))


def _shared(pool: Any, layouts: tuple[str, ...]) -> Optional[str]:
    """Why a pool is not served, from what every kind of pool shares, or None."""
    if pool.layout not in layouts:
        return f"layout {pool.layout!r} is not served (served: {', '.join(layouts)})"
    if getattr(pool, "dcp_size", 1) != 1:
        return f"decode context parallelism (dcp_size={pool.dcp_size}) is not served"
    if getattr(pool, "kv_buffer", None) is None:
        return "the pool holds no host buffer"
    return None


def _checked(name: str, pool: Any, layers: list[LayerTensors]) -> Union[PoolLayout, str]:
    if not layers:
        return "the pool has no layers"
    for t in layers:
        for h, d in zip(t.host, t.device):
            if h.dtype != d.dtype or tuple(h.shape[1:]) != tuple(d.shape[1:]):
                return (f"layer {t.layer_id}: a host page is {tuple(h.shape[1:])} {h.dtype}, a device page "
                        f"{tuple(d.shape[1:])} {d.dtype}")
    return PoolLayout(name, pool.layout, pool.page_size, tuple(layers))


def mha_layout(pool: Any) -> Union[PoolLayout, str]:
    """The layers of an ``MHATokenToKVPoolHost``, or why it is not served."""
    why = _shared(pool, LAYOUTS)
    if why:
        return why
    if any(getattr(info, "scales", None) is not None for info in getattr(pool, "_buffer_infos", ())):
        return "KV scales (quantized KV) are not served"
    k, v, page = pool.kv_buffer[0], pool.kv_buffer[1], pool.page_size
    layers = [LayerTensors(i, (host_view(k, pool.layout, i, page), host_view(v, pool.layout, i, page)),
                           (device_view(pool.device_k_buffers[i], page), device_view(pool.device_v_buffers[i], page)),
                           i < pool.target_layer_num)
              for i in range(pool.layer_num)]
    return _checked(pool_name(pool, "MHA"), pool, layers)


def mla_layout(pool: Any) -> Union[PoolLayout, str]:
    """The layers of an ``MLATokenToKVPoolHost``, or why it is not served."""
    why = _shared(pool, MLA_LAYOUTS)
    if why:
        return why
    if getattr(pool, "_native_buffers", None) is not None:
        return "split MLA buffers (DSA's native K/V/indexer buffers) are not served"
    if getattr(pool, "_layer_shard_enabled", False):
        return "a layer-sharded MLA pool is not served"
    page, targets = pool.page_size, set(pool._target_layer_indices)
    layers = [LayerTensors(c, (host_view(pool.kv_buffer, pool.layout, pool._host_layer_by_controller[c], page),),
                           (device_view(pool.device_kv_buffers[b], page),), c in targets)
              for c, b in sorted(pool._buffer_index_by_layer.items(), key=lambda cb: cb[1])]
    return _checked(pool_name(pool, "MLA"), pool, layers)
