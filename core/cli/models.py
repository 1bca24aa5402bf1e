"""KV-cache shapes of real models, and the ``kvswap models`` command.

A :class:`ModelShape` is what one model's KV cache looks like to a mover: how many
per-layer tensors, and how many bytes a block of ``block_tokens`` tokens holds in each.
:meth:`ModelShape.at` gives the shape one tensor-parallel rank holds (:class:`KVCache`):
its chunk bytes (one contiguous piece of a block) and its descriptors per block (the
chunks a block id turns into, over every layer, before coalescing).

Two layouts, as vLLM allocates them per attention layer:

* ``flash`` (FlashAttention, GQA): ``(2, num_blocks, block_tokens, kv_heads, head_dim)``;
  K and V split on the leading dimension, so a block is two chunks per layer. KV heads
  shard over tensor-parallel ranks, never below one head a rank (below that, ranks
  replicate heads).
* ``mla`` (multi-head latent attention, DeepSeek-V2/V3): ``(num_blocks, block_tokens,
  latent_dim)``, one chunk per layer; the latent cache is the same on every rank, so it
  does not shard. ``head_dim`` holds the latent width (``kv_lora_rank + qk_rope_head_dim``)
  and ``kv_heads`` is 1.

The built-in shapes take layers, KV heads and head dim from each model's public
``config.json`` on the Hugging Face hub (named in :attr:`ModelShape.source`).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

from ..errors import ConfigurationError

__all__ = ["DTYPES", "LAYOUTS", "PRESETS", "KVCache", "ModelShape", "get", "names", "shapes_from_args",
           "add_shape_arguments"]

LAYOUTS = ("flash", "mla")
# dtype name -> bytes per element; the names are torch's (torch.bfloat16, ...).
DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                  "float": "float32", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
                  "fp8_e5m2": "float8_e5m2"}
DEFAULT_TP, DEFAULT_BLOCK_TOKENS = 1, 16


def dtype_name(text: str) -> str:
    """The canonical dtype name for ``text`` (``bf16`` -> ``bfloat16``)."""
    t = str(text).lower().removeprefix("torch.")
    t = _DTYPE_ALIASES.get(t, t)
    if t not in DTYPES:
        raise ConfigurationError(
            f"dtype={text!r} is not valid; choose one of {', '.join(sorted(DTYPES))} (or bf16, fp16, fp32, fp8)"
        )
    return t


@dataclass(frozen=True)
class ModelShape:
    """One model's KV cache, unsharded.

    :param layers: attention layers that hold KV (one tensor each).
    :param kv_heads: KV heads over all ranks (``flash``); 1 for ``mla``.
    :param head_dim: elements per head and token (``flash``), or the latent width (``mla``).
    :param dtype: the cache's element type (a key of :data:`DTYPES`).
    :param layout: ``"flash"`` or ``"mla"``.
    :param source: where the numbers come from.
    """

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    layout: str = "flash"
    source: str = ""

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ConfigurationError(f"ModelShape.name={self.name!r} must be a non-empty string")
        for field in ("layers", "kv_heads", "head_dim"):
            v = getattr(self, field)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigurationError(f"{self.name}: {field}={v!r} must be an int >= 1")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.layout not in LAYOUTS:
            raise ConfigurationError(
                f"{self.name}: layout={self.layout!r} is not valid; choose one of {', '.join(LAYOUTS)}"
            )
        if self.layout == "mla" and self.kv_heads != 1:
            raise ConfigurationError(f"{self.name}: an mla cache has one latent 'head' (kv_heads=1), "
                                     f"not {self.kv_heads}; head_dim is the latent width")

    def kv_heads_at(self, tp: int) -> int:
        """KV heads one of ``tp`` ranks holds: sharded for ``flash`` (at least 1), all for ``mla``."""
        _check_positive("tp", tp)
        if self.layout == "mla":
            return self.kv_heads
        if self.kv_heads > tp and self.kv_heads % tp:
            raise ConfigurationError(
                f"{self.name}: {self.kv_heads} KV heads do not shard evenly over tp={tp} ranks"
            )
        return max(1, self.kv_heads // tp)

    def splits(self, tp: int) -> bool:
        """Whether ``tp`` ranks each hold their own ``kv_heads / tp`` heads: always at
        ``tp`` 1; beyond, only a ``flash`` cache whose heads ``tp`` divides (otherwise
        ranks replicate heads, or, for ``mla``, the whole latent cache)."""
        _check_positive("tp", tp)
        return tp == 1 or (self.layout == "flash" and self.kv_heads % tp == 0)

    def at(self, tp: int = DEFAULT_TP, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> KVCache:
        """The cache one of ``tp`` ranks holds, in blocks of ``block_tokens`` tokens."""
        _check_positive("block_tokens", block_tokens)
        return KVCache(self, tp, block_tokens, self.kv_heads_at(tp))


@dataclass(frozen=True)
class KVCache:
    """The KV cache of one tensor-parallel rank: :class:`ModelShape` at a TP and block size."""

    model: ModelShape
    tp: int
    block_tokens: int
    kv_heads: int  # on this rank

    @property
    def element_bytes(self) -> int:
        return DTYPES[self.model.dtype]

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one contiguous piece of a block (one layer's K, V, or latent)."""
        return self.block_tokens * self.kv_heads * self.model.head_dim * self.element_bytes

    @property
    def chunks_per_layer(self) -> int:
        return 2 if self.model.layout == "flash" else 1

    @property
    def descriptors_per_block(self) -> int:
        """Chunks one block id turns into over every layer (before coalescing)."""
        return self.model.layers * self.chunks_per_layer

    @property
    def block_bytes(self) -> int:
        """Bytes one block id moves over every layer."""
        return self.chunk_bytes * self.descriptors_per_block

    @property
    def block_dim(self) -> int:
        """The dimension of each per-layer tensor that indexes blocks (BlockMover's ``block_dim``)."""
        return 1 if self.model.layout == "flash" else 0

    def tensor_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The shape of one layer's tensor holding ``num_blocks`` blocks."""
        _check_positive("num_blocks", num_blocks)
        if self.model.layout == "flash":
            return (2, num_blocks, self.block_tokens, self.kv_heads, self.model.head_dim)
        return (num_blocks, self.block_tokens, self.model.head_dim)

    @property
    def label(self) -> str:
        return f"{self.model.name} tp{self.tp}"

    def to_dict(self) -> dict[str, Any]:
        m = self.model
        return {
            "name": m.name, "layers": m.layers, "kv_heads": self.kv_heads, "kv_heads_total": m.kv_heads,
            "head_dim": m.head_dim, "dtype": m.dtype, "layout": m.layout, "tp": self.tp,
            "block_tokens": self.block_tokens, "chunk_bytes": self.chunk_bytes,
            "descriptors_per_block": self.descriptors_per_block, "block_bytes": self.block_bytes,
            "tensor_shape": ["num_blocks" if i == self.block_dim else v
                             for i, v in enumerate(self.tensor_shape(1))],
            "source": m.source,
        }


def _check_positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigurationError(f"{name}={value!r} must be an int >= 1")


def _hub(repo: str) -> str:
    return f"config.json of {repo} on the Hugging Face hub"


PRESETS: dict[str, ModelShape] = {m.name: m for m in (
    ModelShape("llama-3.1-8b", 32, 8, 128, source=_hub("meta-llama/Llama-3.1-8B")),
    ModelShape("llama-3.1-70b", 80, 8, 128, source=_hub("meta-llama/Llama-3.1-70B")),
    ModelShape("qwen2.5-7b", 28, 4, 128, source=_hub("Qwen/Qwen2.5-7B-Instruct") + " (hidden 3584 / 28 heads)"),
    # MLA: kv_lora_rank 512 + qk_rope_head_dim 64 per token and layer.
    ModelShape("deepseek-v3", 61, 1, 576, layout="mla",
               source=_hub("deepseek-ai/DeepSeek-V3") + " (kv_lora_rank 512 + qk_rope_head_dim 64)"),
    # Every layer (sliding-window or full) keeps a full-size cache in vLLM's FlashAttention layout.
    ModelShape("gpt-oss-120b", 36, 8, 64, source=_hub("openai/gpt-oss-120b")),
)}


def names() -> list[str]:
    return list(PRESETS)


def get(name: str) -> ModelShape:
    """The built-in shape called ``name``."""
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ConfigurationError(f"model {name!r} is not built in; choose one of {', '.join(PRESETS)}, "
                                 f"or give --layers/--kv-heads/--head-dim for a custom shape") from None


# -- command-line ----------------------------------------------------------------------

def add_shape_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that describe a custom shape, or change a built-in one."""
    g = p.add_argument_group("custom shape (alone: a model called 'custom'; with a model name: changes it)")
    g.add_argument("--layers", type=int, metavar="N", help="attention layers")
    g.add_argument("--kv-heads", type=int, metavar="N", help="KV heads over all ranks (mla: 1)")
    g.add_argument("--head-dim", type=int, metavar="N", help="elements per head and token (mla: the latent width)")
    g.add_argument("--dtype", metavar="T", help="bfloat16 (default), float16, float32, float8_e4m3fn, ...")
    g.add_argument("--layout", choices=LAYOUTS, help="flash: (2, blocks, tokens, heads, dim) per layer; "
                   "mla: (blocks, tokens, latent) per layer")


CUSTOM_FIELDS = {"layers": "layers", "kv_heads": "kv_heads", "head_dim": "head_dim", "dtype": "dtype",
                 "layout": "layout"}


def shapes_from_args(model_names: Optional[Sequence[str]], args: argparse.Namespace,
                     default_all: bool = True) -> list[ModelShape]:
    """The shapes named (``"all"``: every preset), each changed by the custom flags; with
    no name, a custom shape from the flags, or (``default_all``) every preset."""
    given = {f: getattr(args, a) for a, f in CUSTOM_FIELDS.items() if getattr(args, a, None) is not None}
    wanted = [n for n in (model_names or ()) if n]
    if any(n.lower() == "all" for n in wanted):
        wanted = names()
    if wanted:
        shapes = [get(n) for n in wanted]
        if given:
            shapes = [replace(s, name=f"{s.name}*", source=f"{s.name} with {_changes(given)}", **given)
                      for s in shapes]
        return list(dict.fromkeys(shapes))
    if given:
        layout = given.get("layout", "flash")
        if layout == "mla":
            given.setdefault("kv_heads", 1)
        missing = [f"--{f.replace('_', '-')}" for f in ("layers", "kv_heads", "head_dim") if f not in given]
        if missing:
            raise ConfigurationError(f"a custom shape needs {', '.join(missing)} (or a model name: "
                                     f"{', '.join(PRESETS)})")
        return [ModelShape("custom", source=f"custom: {_changes(given)}", **given)]
    if default_all:
        return list(PRESETS.values())
    raise ConfigurationError(f"name a model ({', '.join(PRESETS)}, or all) or give a custom shape "
                             f"(--layers, --kv-heads, --head-dim)")


def _changes(given: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in given.items())


HELP = "the KV-cache shapes of built-in models: chunk bytes and descriptors per block"
DESCRIPTION = (
    "List built-in KV-cache shapes (layers, KV heads, head dim, dtype, layout) and, for the "
    "tensor-parallel degree and block size given, the bytes of one contiguous chunk and the "
    "descriptors one block id turns into. KV heads shard over TP ranks (never below one); an "
    "MLA latent cache does not shard. Custom shapes come from --layers/--kv-heads/--head-dim/"
    "--dtype/--layout, alone or changing a named model."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from . import positive

    p.add_argument("models", nargs="*", metavar="MODEL", help=f"models to show (default: all): {', '.join(PRESETS)}")
    p.add_argument("--tp", type=positive, default=DEFAULT_TP, metavar="N", help="tensor-parallel ranks (default 1)")
    p.add_argument("--block-tokens", type=positive, default=DEFAULT_BLOCK_TOKENS, metavar="N",
                   help="tokens per KV block (default 16)")
    p.add_argument("--json", action="store_true", help="print a JSON list of objects instead of a table")
    add_shape_arguments(p)


COLUMNS = (("name", "model"), ("layout", "layout"), ("layers", "layers"), ("kv_heads", "kv heads/rank"),
           ("head_dim", "head dim"), ("dtype", "dtype"), ("tp", "tp"), ("block_tokens", "tokens"),
           ("chunk_bytes", "chunk bytes"), ("descriptors_per_block", "descriptors/block"),
           ("block_bytes", "block bytes"))


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    cells = [[h for _, h in COLUMNS]] + [[str(r[k]) for k, _ in COLUMNS] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) if i < 2 or i == 5 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    return "\n".join(lines[:1] + ["  ".join("-" * w for w in widths)] + lines[1:])


def run(args: argparse.Namespace) -> int:
    import sys

    shapes = shapes_from_args(args.models, args)
    # Every preset (no name, or all): those whose heads --tp does not split are left out, as
    # kvswap bench --model does; a model named is shown or refused.
    listed = not [n for n in args.models if n.lower() != "all"] and not any(
        getattr(args, a, None) is not None for a in CUSTOM_FIELDS)
    rows, skipped = [], []
    for s in shapes:
        try:
            rows.append(s.at(args.tp, args.block_tokens).to_dict())
        except ConfigurationError as e:
            if not listed:
                raise
            skipped.append(str(e))
    if skipped:
        print(f"kvswap models: left out: {'; '.join(skipped)}", file=sys.stderr)
    if not rows:
        raise ConfigurationError(f"no built-in model's KV heads shard evenly over tp={args.tp}")
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(format_table(rows))
    return 0
