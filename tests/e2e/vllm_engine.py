"""Run one offline vLLM engine over prompts that share prefixes, with or without kvswap.

Each run is its own process (vLLM starts its engine core in a child process and keeps
global state), so the test calls this script once per configuration:

    python tests/e2e/vllm_engine.py --model DIR --out OUT.json [--kvswap] [--blocks-per-chunk K]
        [--corrupt-loads] [--stats-file FILE]

The prompts come in two waves. The first wave stores every prefix; the KV budget
(``num_gpu_blocks_override``) is too small to keep them all, so by the second wave most
prefixes are gone from the engine's own cache, and with offloading they are loaded back.
OUT.json holds the greedy token ids of every prompt and how many prompt tokens each found
cached.
"""
from __future__ import annotations

import argparse
import json
import random
import time

BLOCK_SIZE = 32  # tokens per KV block (vLLM's CPU backend takes multiples of 32)
GPU_BLOCKS = 28  # the KV budget: about two requests' worth
PREFIXES = 6
PREFIX_TOKENS = 11 * BLOCK_SIZE  # the byte tokenizer: one token per character
MAX_TOKENS = 16
CPU_BYTES = 64 << 20


def prompts(seed: int = 0) -> tuple[list[str], list[str]]:
    """Two waves: the same prefixes, each wave with its own question after them."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz     "
    prefixes = ["".join(rng.choice(letters) for _ in range(PREFIX_TOKENS)) for _ in range(PREFIXES)]
    first = [f"{p} first question {i}?" for i, p in enumerate(prefixes)]
    second = [f"{p} second question {i}?" for i, p in enumerate(prefixes)]
    return first, second


def kv_transfer_config(blocks_per_chunk: int, kvswap_options: dict) -> dict:
    """The OffloadingConnector with kvswap's spec, as docs/using-kvswap-in-vllm.md gives it."""
    extra = {
        "spec_name": "KvswapOffloadingSpec",
        "spec_module_path": "kvswap.integrations.vllm",
        "cpu_bytes_to_use": CPU_BYTES,
        "blocks_per_chunk": blocks_per_chunk,
        "kvswap": kvswap_options,
    }
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def run(model: str, *, kvswap: bool, blocks_per_chunk: int = 1, kvswap_options: dict | None = None) -> dict:
    from vllm import LLM, SamplingParams

    start = time.monotonic()
    llm = LLM(
        model=model, dtype="float32", seed=0, block_size=BLOCK_SIZE, gpu_memory_utilization=0.5,
        num_gpu_blocks_override=GPU_BLOCKS, max_model_len=512, max_num_seqs=2, enforce_eager=True,
        enable_prefix_caching=True,
        kv_transfer_config=kv_transfer_config(blocks_per_chunk, kvswap_options or {}) if kvswap else None,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    waves = []
    for wave in prompts():
        outputs = llm.generate(wave, params, use_tqdm=False)
        waves.append([{"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens,
                       "prompt": len(o.prompt_token_ids)} for o in outputs])
    seconds = time.monotonic() - start
    del llm
    return {"waves": waves, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--kvswap", action="store_true", help="offload through kvswap's spec")
    ap.add_argument("--blocks-per-chunk", type=int, default=1)
    ap.add_argument("--corrupt-loads", action="store_true", help="kvswap's test control: poison every load")
    ap.add_argument("--stats-file", help="where kvswap's worker writes its counters")
    args = ap.parse_args()
    options: dict = {}
    if args.corrupt_loads:
        options["corrupt_loads"] = True
    if args.stats_file:
        options["stats_file"] = args.stats_file
    result = run(args.model, kvswap=args.kvswap, blocks_per_chunk=args.blocks_per_chunk, kvswap_options=options)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
