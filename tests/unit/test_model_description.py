"""One model description: the ledger and the engine's KVLayout agree on every block,
and the fingerprint names a model the same way in every process.

The configs are every config dict the other tests use: test_shapes' published
config.json excerpts (plus its inline variants), test_cli's Qwen2 config,
test_llama's tiny checkpoint config, and the three random-weight models of
test_hf_equivalence (copied here as plain dicts, so no transformers import).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvswap.data.layout import KVLayout
from kvswap.ledger import kv_bytes_per_block
from kvswap.model.description import ModelDescription
from kvswap.model.dtypes import DTYPE_BYTES
from kvswap.model.hf_config import describe_hf_dict, describe_hf_file
from kvswap.model.kv_identity import config_json
from kvswap.model.loader import PRESETS as ENGINE_PRESETS
from kvswap.model.loader import resolve_model
from kvswap.model.presets import ENGINE_PRESET_NAMES, PRESET_NAMES, preset_description
from kvswap.model.torch_dtypes import TORCH_DTYPES
from tests.unit.test_llama import TINY_HF_CONFIG
from tests.unit.test_shapes import (
    CHATGLM3_6B,
    DEEPSEEK_V3,
    FALCON_7B,
    FALCON_40B,
    GEMMA_7B,
    LLAMA_2_7B,
    LLAMA_3_8B,
    MISTRAL_7B,
    MIXTRAL_8X7B,
    QWEN2_5_7B,
    STARCODER,
)

# test_hf_equivalence's models, as their save_pretrained config.json would read.
_HF_EQUIVALENCE_COMMON: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "torch_dtype": "float32",
}  # fmt: skip
HF_EQUIVALENCE_CONFIGS: dict[str, dict[str, Any]] = {
    "equivalence-llama": {
        **_HF_EQUIVALENCE_COMMON, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "head_dim": 32, "rope_theta": 10000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    },
    "equivalence-qwen2": {
        **_HF_EQUIVALENCE_COMMON, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
        "tie_word_embeddings": True,
    },
    "equivalence-mistral": {
        **_HF_EQUIVALENCE_COMMON, "model_type": "mistral",
        "architectures": ["MistralForCausalLM"], "sliding_window": None,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    },
}  # fmt: skip
_CLI_QWEN2 = {k: v for k, v in QWEN2_5_7B.items() if k not in ("torch_dtype", "sliding_window")}
_DEEPSEEK_V2_LITE = {
    **DEEPSEEK_V3, "model_type": "deepseek_v2", "hidden_size": 2048, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None,
}  # fmt: skip
_LLAVA = {
    "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
    "text_config": {**LLAMA_2_7B, "torch_dtype": None}, "torch_dtype": "float16",
}  # fmt: skip
HF_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3-8b": LLAMA_3_8B, "qwen2.5-7b": QWEN2_5_7B, "mistral-7b": MISTRAL_7B,
    "llama-2-7b": LLAMA_2_7B, "gemma-7b": GEMMA_7B, "falcon-7b": FALCON_7B,
    "falcon-40b": FALCON_40B, "starcoder": STARCODER, "chatglm3-6b": CHATGLM3_6B,
    "mixtral-8x7b": MIXTRAL_8X7B, "deepseek-v3": DEEPSEEK_V3,
    "deepseek-v2-lite": _DEEPSEEK_V2_LITE, "llava": _LLAVA, "cli-qwen2": _CLI_QWEN2,
    "llama-tiny-checkpoint": TINY_HF_CONFIG, **HF_EQUIVALENCE_CONFIGS,
}  # fmt: skip
# Configs the engine can load (Llama family): checked through its own resolve path too.
ENGINE_CONFIGS = {"llama-tiny-checkpoint": TINY_HF_CONFIG, **HF_EQUIVALENCE_CONFIGS}

KV_DTYPES = sorted(DTYPE_BYTES)
BLOCK_TOKENS = (1, 16, 256)


def _every_description() -> list[tuple[str, ModelDescription]]:
    presets = [(f"preset {name}", preset_description(name)) for name in PRESET_NAMES]
    configs = [(name, describe_hf_dict(config, name)) for name, config in HF_CONFIGS.items()]
    return presets + configs


DESCRIPTIONS = _every_description()


# --- the ledger and the engine's layout bill the same block -------------------------


@pytest.mark.parametrize(("label", "desc"), DESCRIPTIONS, ids=[d[0] for d in DESCRIPTIONS])
def test_ledger_block_bytes_equal_the_layout_block_bytes(
    label: str, desc: ModelDescription
) -> None:
    for dtype in KV_DTYPES:
        for block_tokens in BLOCK_TOKENS:
            layout = KVLayout.for_model(desc.with_kv_dtype(dtype), block_tokens)
            ledger_bytes = kv_bytes_per_block(desc, dtype, block_tokens)
            assert layout.block_bytes == ledger_bytes, (label, dtype, block_tokens)
            # The allocated tensor really is that big: shape x itemsize.
            numel = 1
            for size in layout.block_shape:
                numel *= size
            assert numel * layout.dtype.itemsize == ledger_bytes, (label, dtype, block_tokens)


def test_an_mla_block_holds_one_latent_plane() -> None:
    layout = KVLayout.for_model(preset_description("deepseek-v3"), 16)
    assert layout.block_shape == (61, 1, 16, 1, 512 + 64)
    assert layout.block_bytes == (512 + 64) * 61 * 2 * 16


def _engine_layouts(source: str, dtype: str, block_tokens: int) -> tuple[KVLayout, KVLayout]:
    """The layout the engine builds from `resolve_model`, both ways it can."""
    arch, torch_dtype, _ = resolve_model(source, dtype)
    by_fields = KVLayout(
        arch.num_layers, arch.num_kv_heads, arch.head_dim, block_tokens, torch_dtype
    )
    return by_fields, KVLayout.for_model(arch.description, block_tokens)


@pytest.mark.parametrize("name", ENGINE_PRESET_NAMES)
def test_engine_presets_agree_with_the_ledger(name: str) -> None:
    for dtype in ("fp32", "fp16", "bf16"):
        for block_tokens in BLOCK_TOKENS:
            expected = kv_bytes_per_block(preset_description(name), dtype, block_tokens)
            for layout in _engine_layouts(name, dtype, block_tokens):
                assert layout.block_bytes == expected, (name, dtype, block_tokens)


@pytest.mark.parametrize("name", sorted(ENGINE_CONFIGS))
def test_engine_checkpoint_configs_agree_with_the_ledger(name: str, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(ENGINE_CONFIGS[name]))
    planned = describe_hf_file(tmp_path)  # what `kvswap plan --hf-config` reads
    for dtype in ("fp32", "fp16", "bf16"):
        for block_tokens in BLOCK_TOKENS:
            expected = kv_bytes_per_block(planned, dtype, block_tokens)
            for layout in _engine_layouts(str(tmp_path), dtype, block_tokens):
                assert layout.block_bytes == expected, (name, dtype, block_tokens)


def test_one_dtype_table_and_one_preset_table() -> None:
    assert {name: dtype.itemsize for name, dtype in TORCH_DTYPES.items()} == DTYPE_BYTES
    for name in ENGINE_PRESET_NAMES:
        assert ENGINE_PRESETS[name].description == preset_description(name)


# --- the identity fields (kvswap.model.kv_identity digests them) -------------------


def _identity(desc: ModelDescription, kv_dtype: str | None = None) -> str:
    return config_json(desc.identity_fields(kv_dtype))


def test_identity_fields_follow_the_kv_dtype() -> None:
    desc = preset_description("llama-3.1-8b")
    fields = _identity(desc)
    assert desc.kv_dtype == "bf16" and _identity(desc, "bfloat16") == fields
    assert _identity(desc, "fp8") == _identity(desc.with_kv_dtype("fp8")) != fields


def test_the_same_model_from_any_source_has_one_identity(tmp_path: Path) -> None:
    tiny = _identity(preset_description("tiny"))
    # The preset, the checkpoint config the tests save for it, and the engine's view.
    assert _identity(describe_hf_dict(TINY_HF_CONFIG, "elsewhere")) == tiny
    assert _identity(resolve_model("tiny", None)[0].description) == tiny
    (tmp_path / "config.json").write_text(json.dumps(TINY_HF_CONFIG))
    assert _identity(resolve_model(str(tmp_path), None)[0].description) == tiny
    # Name and parameter estimate are not part of it; the decoder-only keys (norm
    # epsilon, positions) are the decoder config's (tests/unit/test_kv_identity.py).
    renamed = {**TINY_HF_CONFIG, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096}
    assert _identity(describe_hf_dict(renamed, "other-name")) == tiny
    # transformers 4.x and 5.x spell RoPE differently; the model is the same.
    v4 = {**LLAMA_3_8B, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    v5 = {**LLAMA_3_8B, "rope_parameters": {"rope_type": "linear", "rope_theta": 5e5,
                                            "factor": 2.0}}  # fmt: skip
    assert _identity(describe_hf_dict(v4)) == _identity(describe_hf_dict(v5))


def test_every_identity_field_changes_the_identity() -> None:
    base = _identity(describe_hf_dict(DEEPSEEK_V3))
    variants: dict[str, dict[str, object]] = {
        "model_type": {"model_type": "deepseek_v2"},
        "architecture": {"architectures": ["DeepseekV2ForCausalLM"]},
        "num_layers": {"num_hidden_layers": 60},
        "hidden_size": {"hidden_size": 7680},
        "num_attention_heads": {"num_attention_heads": 64},
        "rope_theta": {"rope_theta": 20000.0},
        "rope_scaling": {"rope_scaling": {"type": "yarn", "factor": 40}},
        "vocab_size": {"vocab_size": 129281},
        "kv_lora_rank": {"kv_lora_rank": 256},
        "qk_rope_head_dim": {"qk_rope_head_dim": 32},
    }
    dense = _identity(describe_hf_dict(LLAMA_3_8B))
    dense_variants: dict[str, dict[str, object]] = {
        "num_kv_heads": {"num_key_value_heads": 4},
        "head_dim": {"head_dim": 64},
        "intermediate_size": {"intermediate_size": 14000},
        "mla vs dense": {"kv_lora_rank": 512, "qk_rope_head_dim": 64},
    }
    seen = {base, dense}
    for field, change in variants.items():
        identity = _identity(describe_hf_dict({**DEEPSEEK_V3, **change}))
        assert identity not in seen, field
        seen.add(identity)
    for field, change in dense_variants.items():
        identity = _identity(describe_hf_dict({**LLAMA_3_8B, **change}))
        assert identity not in seen, field
        seen.add(identity)
    for dtype in ("fp32", "fp16", "fp8"):  # LLAMA_3_8B's own is bf16
        assert _identity(describe_hf_dict(LLAMA_3_8B), dtype) not in seen, dtype
        seen.add(_identity(describe_hf_dict(LLAMA_3_8B), dtype))


def test_distinct_presets_have_distinct_identities() -> None:
    identities = {_identity(preset_description(name)) for name in PRESET_NAMES}
    assert len(identities) == len(PRESET_NAMES)
