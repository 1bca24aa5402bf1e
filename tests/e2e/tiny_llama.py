"""Build a tiny Llama with random weights and a byte-level tokenizer, saved locally.

vLLM loads it like any model folder (``LLM(model=path)``); nothing is downloaded. Four
layers, grouped-query attention, float32: small enough that a CPU runs a whole engine in
seconds, shaped like the real thing so vLLM takes its ordinary Llama path.

    python tests/e2e/tiny_llama.py OUT_DIR
"""
from __future__ import annotations

import sys
from pathlib import Path

SPECIALS = ["<s>", "</s>"]


def byte_tokenizer():
    """A tokenizer of 256 byte tokens (no merges) plus BOS and EOS: any text encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for s in SPECIALS:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def build(out: Path, *, seed: int = 0) -> Path:
    """Write the model and its tokenizer to ``out``; return ``out``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
        initializer_range=0.1, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    # Weights five times wider than Llama's default (0.02): the default's greedy output
    # falls into a loop of two tokens whatever the prompt, and a test must see the context
    # (a corrupted block) change it.
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__.strip().splitlines()[-1].strip())
    print(build(Path(sys.argv[1])))
