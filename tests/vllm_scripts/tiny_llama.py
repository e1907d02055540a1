"""A random-weight Llama small enough for vLLM's CPU backend in seconds, with a
word-level tokenizer ("t0 t1 ...": token i is "t<i>"). Never downloads anything.

    python tiny_llama.py OUT_DIR

2 layers, hidden 128, 2 query heads and 1 KV head of 64 dims (vLLM's CPU
attention needs head_dim >= 32), vocab 512, fp32: one 32-token block of one
layer is 2 x 32 x 64 x 4 = 16 KiB, a block of both layers 32 KiB.
"""

from __future__ import annotations

import sys
from pathlib import Path

NUM_LAYERS = 2
NUM_KV_HEADS = 1
HEAD_DIM = 64
VOCAB = 512


def chunk_bytes(block_tokens: int = 32) -> int:
    """KV bytes of one block of every layer (fp32): a host-tier chunk of one block."""
    return NUM_LAYERS * 2 * block_tokens * NUM_KV_HEADS * HEAD_DIM * 4


def build(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=NUM_KV_HEADS * HEAD_DIM * 2,
        intermediate_size=256,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    word_level = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=word_level, unk_token="t0", bos_token="t1", eos_token="t2"
    )
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    from tests.vllm_scripts.common import emit

    build(Path(sys.argv[1]))
    emit({"model": sys.argv[1], "chunk_bytes": chunk_bytes()})
