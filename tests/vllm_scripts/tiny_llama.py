"""A random-weight Llama small enough for vLLM's CPU backend in seconds, with a
word-level tokenizer. Never downloads anything.

    python tiny_llama.py OUT_DIR [--shape JSON] [--no-eos]

2 layers, hidden 128, 2 query heads and 1 KV head of 64 dims (vLLM's CPU
attention needs head_dim >= 32), vocab 512, fp32: one 32-token block of one
layer is 2 x 32 x 64 x 4 = 16 KiB, a block of both layers 32 KiB.

The tokenizer splits on whitespace, one word one token: ids 0, 1, 2 are "t0" (also
the unknown word), "t1" (BOS) and "t2" (EOS); ids 3-258 are the 256 words of
`kvswap loadgen`'s prompts, so its text keeps the trace's prefix sharing token for
token; every other id i is "t<i>". `--shape` saves another shape (a benchmark's,
LlamaConfig's names) with the same tokenizer; `--no-eos` leaves out the stop
token, so every request generates its `max_tokens` on any server.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path

from kvswap.serve.loadgen.prompts import WORDS

NUM_LAYERS = 2
NUM_KV_HEADS = 1
HEAD_DIM = 64
VOCAB = 512
TINY_SHAPE: dict[str, int] = {
    "vocab_size": VOCAB, "hidden_size": NUM_KV_HEADS * HEAD_DIM * 2,
    "intermediate_size": 256, "num_hidden_layers": NUM_LAYERS,
    "num_attention_heads": 2, "num_key_value_heads": NUM_KV_HEADS,
    "max_position_embeddings": 1024,
}  # fmt: skip
NUM_SPECIAL_TOKENS = 3  # t0 (unknown), t1 (BOS), t2 (EOS)


def chunk_bytes(block_tokens: int = 32) -> int:
    """KV bytes of one block of every layer (fp32): a host-tier chunk of one block."""
    return NUM_LAYERS * 2 * block_tokens * NUM_KV_HEADS * HEAD_DIM * 4


def vocabulary(vocab_size: int) -> dict[str, int]:
    """Word -> id: the special tokens, loadgen's words, then "t<i>" up to `vocab_size`."""
    words = [f"t{i}" for i in range(NUM_SPECIAL_TOKENS)] + list(WORDS)
    words += [f"t{i}" for i in range(len(words), vocab_size)]
    assert len(words) == vocab_size, f"a vocabulary of {vocab_size} has no room for loadgen's"
    return {word: i for i, word in enumerate(words)}


def build(
    out: Path, shape: Mapping[str, int] = TINY_SHAPE, *, eos: bool = True, seed: int = 0
) -> None:
    """Save a random Llama of `shape` (LlamaConfig's names), fp32, its weights drawn from
    `seed`, and its tokenizer; without `eos`, neither the tokenizer nor the configs name a
    stop token."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"],
        max_position_embeddings=shape["max_position_embeddings"],
        eos_token_id=2 if eos else None,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    word_level = Tokenizer(models.WordLevel(vocab=vocabulary(shape["vocab_size"]), unk_token="t0"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=word_level, unk_token="t0", bos_token="t1", eos_token="t2" if eos else None
    )
    tokenizer.save_pretrained(out)


def main(argv: list[str]) -> None:
    from tests.vllm_scripts.common import emit

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", type=json.loads, default=TINY_SHAPE)
    parser.add_argument("--no-eos", dest="eos", action="store_false")
    args = parser.parse_args(argv)
    build(args.out, args.shape, eos=args.eos)
    emit({"model": str(args.out), "chunk_bytes": chunk_bytes()})


if __name__ == "__main__":
    main(sys.argv[1:])
