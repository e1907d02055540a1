"""A built-in preset saved as a Hugging Face checkpoint any engine loads (`kvswap checkpoint`).

vLLM, SGLang and transformers need a model directory; a user trying kvswap inside
them should not have to find one. This writes a preset's seeded random weights
(the same ones `kvswap run --model small` computes with) as a Llama checkpoint:

    config.json              LlamaForCausalLM, the preset's shape, dtype, norm epsilon
    model.safetensors        the weights under transformers' names (a tied LM head is
                             left out, as transformers saves it)
    tokenizer.json           the built-in byte-level tokenizer (`serve.builtin_text`)
    tokenizer_config.json    its special tokens and ChatML chat template
    generation_config.json   its BOS and EOS ids

Everything is written into a staging directory and moved into place at the end
(`staged_dir`): a stop mid-way leaves nothing behind.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvswap.errors import KvSwapError
from kvswap.model.loader import load_model
from kvswap.model.presets import ENGINE_PRESET_NAMES, get_preset
from kvswap.serve.builtin_text import (
    BOS_TOKEN,
    BUILTIN_CHAT_TEMPLATE,
    EOS_TOKEN,
    builtin_tokenizer,
)
from kvswap.staged_dir import staged_dir

FILES = (
    "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    "generation_config.json",
)  # fmt: skip


def write_checkpoint(preset: str, directory: Path) -> list[Path]:
    """Save engine preset `preset` into `directory` (new, or empty); the files written."""
    if preset not in ENGINE_PRESET_NAMES:
        raise KvSwapError(
            f"preset {preset!r} has no weights to save; allowed: {', '.join(ENGINE_PRESET_NAMES)}"
        )
    if directory.is_dir() and any(directory.iterdir()):
        raise KvSwapError(f"{directory} is not empty; allowed: a new or empty directory")
    model, arch = load_model(preset, None, torch.device("cpu"), batch_invariant=True)
    tokenizer = builtin_tokenizer(arch.vocab_size)
    bos_id, eos_id = tokenizer.token_to_id(BOS_TOKEN), tokenizer.token_to_id(EOS_TOKEN)
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if arch.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # transformers ties it back to the embedding
    config = {
        **get_preset(preset).hf_config(),
        "head_dim": arch.head_dim,
        "rms_norm_eps": arch.rms_norm_eps,
        "max_position_embeddings": arch.max_position_tokens,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "chat_template": BUILTIN_CHAT_TEMPLATE,
        "model_max_length": arch.max_position_tokens,
    }
    generation = {"bos_token_id": bos_id, "eos_token_id": eos_id}
    with staged_dir(directory, "checkpoint directory") as staging:
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save(str(staging / "tokenizer.json"))
        for name, content in (
            ("config.json", config),
            ("tokenizer_config.json", tokenizer_config),
            ("generation_config.json", generation),
        ):
            (staging / name).write_text(json.dumps(content, indent=2) + "\n")
    return [directory / name for name in FILES]
