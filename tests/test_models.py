"""kvswap.cli.models: built-in KV shapes, TP sharding, and ``kvswap models``."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
import torch

import kvswap
from kvswap.cli import models
from kvswap.errors import ConfigurationError


def kvswap_cli(*args):
    return subprocess.run([sys.executable, "-m", "kvswap", *args], capture_output=True, text=True, timeout=120)


def by_name(rows):
    return {r["name"]: r for r in rows}


def test_models_json_tp8_gives_llama70b_4096_bytes_and_160_descriptors():
    out = kvswap_cli("models", "--json", "--tp", "8")
    assert out.returncode == 0, out.stderr
    rows = by_name(json.loads(out.stdout))
    assert set(models.PRESETS) <= set(rows)
    r = rows["llama-3.1-70b"]
    assert (r["chunk_bytes"], r["descriptors_per_block"], r["tp"], r["kv_heads"]) == (4096, 160, 8, 1)
    for row in rows.values():
        assert {"name", "layers", "kv_heads", "head_dim", "dtype", "layout", "tp", "block_tokens", "chunk_bytes",
                "descriptors_per_block"} <= set(row)
        assert row["block_tokens"] == 16


def test_models_json_defaults_to_tp1_and_16_tokens():
    out = kvswap_cli("models", "--json")
    assert out.returncode == 0, out.stderr
    rows = by_name(json.loads(out.stdout))
    assert (rows["llama-3.1-8b"]["chunk_bytes"], rows["llama-3.1-8b"]["descriptors_per_block"]) == (32768, 64)
    assert (rows["qwen2.5-7b"]["chunk_bytes"], rows["qwen2.5-7b"]["descriptors_per_block"]) == (16384, 56)
    assert rows["gpt-oss-120b"]["layers"] == 36 and rows["gpt-oss-120b"]["head_dim"] == 64
    assert all(r["tp"] == 1 and r["dtype"] == "bfloat16" for r in rows.values())


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16, 64])
def test_deepseek_mla_latent_cache_does_not_shard(tp):
    c = models.get("deepseek-v3").at(tp)
    assert (c.chunk_bytes, c.descriptors_per_block, c.kv_heads, c.model.layout) == (18432, 61, 1, "mla")
    assert c.tensor_shape(10) == (10, 16, 576) and c.block_dim == 0


def test_kv_heads_shard_by_tp_never_below_one():
    m = models.get("llama-3.1-8b")
    assert [m.at(tp).kv_heads for tp in (1, 2, 4, 8, 16, 32)] == [8, 4, 2, 1, 1, 1]
    assert m.at(32).chunk_bytes == m.at(8).chunk_bytes == 16 * 128 * 2
    assert m.splits(8) and m.splits(1) and not m.splits(16)
    assert models.get("deepseek-v3").splits(1) and not models.get("deepseek-v3").splits(8)
    assert models.get("qwen2.5-7b").splits(4) and not models.get("qwen2.5-7b").splits(8)
    with pytest.raises(ConfigurationError, match="do not shard evenly"):
        m.at(3)
    assert m.at(1, block_tokens=32).chunk_bytes == 2 * m.at(1).chunk_bytes


def test_text_table_names_every_preset_and_tp():
    out = kvswap_cli("models", "--tp", "4", "--block-tokens", "32")
    assert out.returncode == 0, out.stderr
    for name in models.PRESETS:
        assert name in out.stdout
    assert "descriptors/block" in out.stdout and "chunk bytes" in out.stdout
    # llama-3.1-70b at tp 4, 32 tokens: 2 heads x 128 x 2 B x 32 tokens
    line = next(line for line in out.stdout.splitlines() if line.startswith("llama-3.1-70b"))
    assert "16384" in line.split() and "160" in line.split()


def test_custom_shape_from_flags_and_flags_change_a_preset():
    out = kvswap_cli("models", "--json", "--layers", "3", "--kv-heads", "2", "--head-dim", "64", "--dtype", "fp16")
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)
    assert (row["name"], row["layers"], row["dtype"], row["chunk_bytes"], row["descriptors_per_block"]) == \
        ("custom", 3, "float16", 16 * 2 * 64 * 2, 6)
    out = kvswap_cli("models", "qwen2.5-7b", "--json", "--layers", "10", "--tp", "2")
    (row,) = json.loads(out.stdout)
    assert (row["layers"], row["kv_heads"], row["descriptors_per_block"]) == (10, 2, 20)
    assert row["name"] == "qwen2.5-7b*"
    out = kvswap_cli("models", "--json", "--layout", "mla", "--layers", "2", "--head-dim", "576", "--tp", "8")
    (row,) = json.loads(out.stdout)
    assert (row["kv_heads"], row["chunk_bytes"], row["descriptors_per_block"]) == (1, 18432, 2)


@pytest.mark.parametrize("args, message", [
    (("--layers", "2"), "needs --kv-heads, --head-dim"),
    (("nope",), "not built in"),
    (("--layers", "2", "--kv-heads", "1", "--head-dim", "8", "--dtype", "int3"), "dtype='int3' is not valid"),
    (("--layers", "0", "--kv-heads", "1", "--head-dim", "8"), "layers=0"),
    (("--layout", "mla", "--layers", "2", "--kv-heads", "2", "--head-dim", "8"), "one latent"),
])
def test_bad_shapes_fail_with_one_line(args, message):
    out = kvswap_cli("models", *args)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("name", list(models.PRESETS))
@pytest.mark.parametrize("tp", [1, 8])
def test_tensor_shape_is_what_a_block_mover_cuts_into_those_chunks(name, tp):
    """The shape's numbers are the mover's: a BlockMover over tensors of
    ``tensor_shape`` sees ``descriptors_per_block`` chunks of ``chunk_bytes``."""
    c = models.get(name).at(tp)
    src = [torch.empty(c.tensor_shape(3), dtype=torch.bfloat16) for _ in range(c.model.layers)]
    dst = [torch.empty(c.tensor_shape(2), dtype=torch.bfloat16) for _ in range(c.model.layers)]
    with kvswap.BlockMover(src, dst, "h2d", block_dim=c.block_dim) as mover:
        assert mover.chunks_per_block == c.descriptors_per_block
        assert mover.block_bytes == c.block_bytes == c.chunk_bytes * c.descriptors_per_block
        s, d, sizes = mover.descriptors([2], [0])
        assert len(sizes) <= c.descriptors_per_block and int(sizes.sum()) == c.block_bytes


def test_shapes_from_args_all_and_default():
    ns = argparse.Namespace(layers=None, kv_heads=None, head_dim=None, dtype=None, layout=None)
    assert [s.name for s in models.shapes_from_args(["all"], ns)] == models.names()
    assert [s.name for s in models.shapes_from_args(None, ns)] == models.names()
    with pytest.raises(ConfigurationError, match="name a model"):
        models.shapes_from_args(None, ns, default_all=False)


def test_every_preset_at_a_tp_that_splits_only_some_lists_those_and_says_which_are_left_out():
    out = kvswap_cli("models", "--json", "--tp", "3")
    assert out.returncode == 0, out.stderr
    shown = set(by_name(json.loads(out.stdout)))
    left = {n for n, s in models.PRESETS.items() if s.layout == "flash" and s.kv_heads > 3 and s.kv_heads % 3}
    assert left and shown == set(models.PRESETS) - left
    assert out.stderr.startswith("kvswap models: left out: ") and all(n in out.stderr for n in left)
    named = kvswap_cli("models", "llama-3.1-8b", "--tp", "3")  # a model named is shown or refused
    assert named.returncode == 2 and "do not shard evenly over tp=3" in named.stderr
    custom = kvswap_cli("models", "--layers", "2", "--kv-heads", "8", "--head-dim", "64", "--tp", "3")
    assert custom.returncode == 2 and "custom: 8 KV heads do not shard evenly" in custom.stderr
