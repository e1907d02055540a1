"""Model shapes from presets and Hugging Face configs, checked against hand arithmetic.

The config dicts below copy the size-relevant fields of the published
config.json files; every expected byte count is worked out in a comment.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvswap.errors import KvSwapError
from kvswap.model.dtypes import DTYPE_BYTES, dtype_bytes, normalise_dtype
from kvswap.model.hf_config import describe_hf_dict as shape_from_hf_dict
from kvswap.model.hf_config import describe_hf_file as shape_from_hf_config
from kvswap.model.hf_config import estimate_num_params
from kvswap.model.presets import PRESET_NAMES, PRESETS
from kvswap.model.presets import preset_description as preset_shape

LLAMA_3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
    "attention_bias": False, "torch_dtype": "bfloat16",
}  # fmt: skip
QWEN2_5_7B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
    "intermediate_size": 18944, "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False,
    "sliding_window": None, "use_sliding_window": False, "torch_dtype": "bfloat16",
}  # fmt: skip
MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "sliding_window": 4096, "vocab_size": 32000,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}  # fmt: skip
LLAMA_2_7B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 11008, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 32, "vocab_size": 32000, "tie_word_embeddings": False,
    "torch_dtype": "float16",
}  # fmt: skip
GEMMA_7B = {
    "architectures": ["GemmaForCausalLM"], "model_type": "gemma", "hidden_size": 3072,
    "head_dim": 256, "intermediate_size": 24576, "num_attention_heads": 16,
    "num_hidden_layers": 28, "num_key_value_heads": 16, "vocab_size": 256000,
    "torch_dtype": "bfloat16",
}  # fmt: skip
FALCON_7B = {
    "architectures": ["FalconForCausalLM"], "model_type": "falcon", "hidden_size": 4544,
    "num_attention_heads": 71, "num_hidden_layers": 32, "multi_query": True,
    "new_decoder_architecture": False, "parallel_attn": True, "vocab_size": 65024,
    "torch_dtype": "bfloat16",
}  # fmt: skip
FALCON_40B = {
    "architectures": ["FalconForCausalLM"], "model_type": "falcon", "hidden_size": 8192,
    "num_attention_heads": 128, "num_hidden_layers": 60, "num_kv_heads": 8,
    "new_decoder_architecture": True, "vocab_size": 65024,
}  # fmt: skip
STARCODER = {
    "architectures": ["GPTBigCodeForCausalLM"], "model_type": "gpt_bigcode", "n_embd": 6144,
    "n_head": 48, "n_inner": 24576, "n_layer": 40, "multi_query": True, "vocab_size": 49152,
    "torch_dtype": "float32",
}  # fmt: skip
CHATGLM3_6B = {
    "architectures": ["ChatGLMModel"], "model_type": "chatglm", "hidden_size": 4096,
    "kv_channels": 128, "num_attention_heads": 32, "num_layers": 28,
    "multi_query_attention": True, "multi_query_group_num": 2, "padded_vocab_size": 65024,
}  # fmt: skip
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
    "vocab_size": 32000, "tie_word_embeddings": False,
}  # fmt: skip
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "moe_layer_freq": 1, "num_nextn_predict_layers": 1,
    "topk_method": "noaux_tc", "vocab_size": 129280, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}  # fmt: skip
MAMBA_2_8B = {
    "architectures": ["MambaForCausalLM"], "model_type": "mamba", "hidden_size": 2560,
    "num_hidden_layers": 64, "state_size": 16, "vocab_size": 50280,
}  # fmt: skip


def within(actual: int | None, expected: float, tolerance: float) -> bool:
    return actual is not None and abs(actual - expected) <= tolerance * expected


# --- dtypes -------------------------------------------------------------------------


def test_dtype_bytes_accept_short_and_hugging_face_spellings() -> None:
    assert DTYPE_BYTES == {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
    hf_names = ("float32", "float16", "bfloat16", "float8_e4m3fn")
    assert [dtype_bytes(d) for d in hf_names] == [4, 2, 2, 1]
    assert normalise_dtype("torch.bfloat16") == "bf16"
    assert normalise_dtype("FP16") == "fp16"


def test_unknown_dtype_lists_the_allowed_names() -> None:
    with pytest.raises(KvSwapError, match=r"'int4'.*fp32, fp16, bf16, fp8"):
        dtype_bytes("int4")


# --- the article's model and the presets --------------------------------------------


def test_article_8b_preset_matches_the_article() -> None:
    shape = preset_shape("article-8b")
    # 2 (K, V) x 32 layers x 8 KV heads x 128 x 2 bytes = 131,072 B = 128 KiB.
    assert shape.kv_bytes_per_token("fp16") == 131_072
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (32, 8, 128)
    assert shape.attention == "gqa"
    # 16-token block: 2 MiB; 4K context x 8 requests: 4 GiB; fp16 weights ~16 GB.
    assert 16 * shape.kv_bytes_per_token("fp16") == 2 * 1024**2
    assert 4096 * 8 * shape.kv_bytes_per_token("fp16") == 4 * 1024**3
    assert shape.num_params is not None and not shape.num_params_is_estimate
    assert within(shape.num_params * 2, 16e9, 0.01)


def test_every_preset_builds_and_unknown_is_rejected_with_a_suggestion() -> None:
    for name in PRESET_NAMES:
        assert preset_shape(name).name == name
    assert preset_shape("Llama-3.1-8B").kv_bytes_per_token("bf16") == 131_072
    with pytest.raises(KvSwapError, match=r"did you mean 'llama-3.1-8b'\?.*valid presets"):
        preset_shape("llama-3.1-8")


@pytest.mark.parametrize(
    ("name", "fp16_bytes_per_token", "num_params"),
    [
        ("llama-3.1-70b", 2 * 80 * 8 * 128 * 2, 70.55e9),
        ("qwen2.5-7b", 57_344, 7.62e9),
        ("qwen2.5-72b", 2 * 80 * 8 * 128 * 2, 72.7e9),
        ("mistral-7b", 131_072, 7.24e9),
        ("deepseek-v3", (512 + 64) * 61 * 2, 671e9),
    ],
)
def test_large_presets(name: str, fp16_bytes_per_token: int, num_params: float) -> None:
    shape = preset_shape(name)
    assert shape.kv_bytes_per_token("fp16") == fp16_bytes_per_token
    assert within(shape.num_params, num_params, 0.01)


def test_small_presets_match_the_engine_models() -> None:
    tiny, small = preset_shape("tiny"), preset_shape("small")
    assert tiny.num_layers == 2 and tiny.num_attention_heads == 4
    assert (tiny.num_kv_heads, tiny.head_dim) == (2, 16)
    assert (tiny.hidden_size, tiny.intermediate_size, tiny.vocab_size) == (64, 128, 256)
    assert tiny.kv_bytes_per_token("fp32") == 2 * 2 * 2 * 16 * 4
    assert tiny.default_dtype == small.default_dtype == "fp32"
    assert small.num_layers == 12 and small.hidden_size == 768
    assert (small.num_kv_heads, small.head_dim) == (4, 64)
    # Tied embeddings: about 100M parameters.
    assert not small.num_params_is_estimate and within(small.num_params, 100e6, 0.01)


def test_preset_totals_agree_with_the_estimator() -> None:
    for name in PRESET_NAMES:
        preset = PRESETS[name]
        assert estimate_num_params(preset.hf_config()) == preset.num_params, name


# --- Hugging Face configs -----------------------------------------------------------


def test_llama_3_8b_gqa() -> None:
    shape = shape_from_hf_dict(LLAMA_3_8B, "llama-3-8b")
    assert shape.attention == "gqa" and shape.architecture == "LlamaForCausalLM"
    assert shape.kv_values_per_token_per_layer == 2 * 8 * 128
    assert shape.kv_bytes_per_token("fp16") == 131_072
    assert shape.default_dtype == "bf16"
    assert shape.num_params_is_estimate and within(shape.num_params, 8.03e9, 0.02)


def test_qwen2_5_7b_gqa_with_qkv_biases() -> None:
    shape = shape_from_hf_dict(QWEN2_5_7B)
    # 2 x 28 layers x 4 KV heads x (3584 / 28 = 128) x 2 bytes.
    assert shape.kv_bytes_per_token("fp16") == 57_344
    assert within(shape.num_params, 7.62e9, 0.02)


def test_mistral_7b_uniform_sliding_window_is_sized_per_token() -> None:
    shape = shape_from_hf_dict(MISTRAL_7B)
    assert shape.kv_bytes_per_token("fp16") == 131_072
    assert within(shape.num_params, 7.24e9, 0.02)


def test_llama_2_7b_mha_and_absent_kv_heads_means_mha() -> None:
    shape = shape_from_hf_dict(LLAMA_2_7B)
    # 2 x 32 layers x 32 heads x 128 x 2 bytes.
    assert shape.attention == "mha" and shape.kv_bytes_per_token("fp16") == 524_288
    assert shape.default_dtype == "fp16"
    assert within(shape.num_params, 6.74e9, 0.02)
    without_key = {k: v for k, v in LLAMA_2_7B.items() if k != "num_key_value_heads"}
    assert shape_from_hf_dict(without_key).kv_bytes_per_token("fp16") == 524_288


def test_gemma_7b_explicit_head_dim_wins() -> None:
    shape = shape_from_hf_dict(GEMMA_7B)
    # hidden 3072 / 16 heads would say 192; the config says 256.
    assert shape.head_dim == 256 and shape.attention == "mha"
    assert shape.kv_bytes_per_token("fp16") == 2 * 28 * 16 * 256 * 2 == 458_752
    # Gemma ties its embeddings by default: 8.54B in total.
    assert within(shape.num_params, 8.54e9, 0.02)


def test_falcon_7b_and_starcoder_are_mqa() -> None:
    falcon = shape_from_hf_dict(FALCON_7B)
    # One KV head of 4544 / 71 = 64: 2 x 32 x 1 x 64 x 2 bytes.
    assert (falcon.attention, falcon.num_kv_heads, falcon.head_dim) == ("mqa", 1, 64)
    assert falcon.kv_bytes_per_token("fp16") == 8_192
    assert falcon.num_params is None and not falcon.num_params_is_estimate
    starcoder = shape_from_hf_dict(STARCODER)
    # GPT-style keys (n_layer, n_head, n_embd): 2 x 40 x 1 x (6144 / 48 = 128) x 2.
    assert starcoder.attention == "mqa" and starcoder.kv_bytes_per_token("fp16") == 20_480
    assert starcoder.intermediate_size == 24576 and starcoder.default_dtype == "fp32"
    # Falcon and GPTBigCode are multi-query when the key is absent (transformers' default).
    implicit = {k: v for k, v in FALCON_7B.items() if k != "multi_query"}
    assert shape_from_hf_dict(implicit).num_kv_heads == 1


def test_falcon_40b_new_decoder_architecture_groups_kv_heads() -> None:
    shape = shape_from_hf_dict(FALCON_40B)
    assert (shape.attention, shape.num_kv_heads) == ("gqa", 8)
    assert shape.kv_bytes_per_token("fp16") == 2 * 60 * 8 * 64 * 2


def test_chatglm_multi_query_groups() -> None:
    shape = shape_from_hf_dict(CHATGLM3_6B)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (28, 2, 128)
    assert shape.kv_bytes_per_token("fp16") == 2 * 28 * 2 * 128 * 2
    assert shape.vocab_size == 65024 and shape.num_params is None


def test_deepseek_v3_mla_caches_one_latent_vector() -> None:
    shape = shape_from_hf_dict(DEEPSEEK_V3)
    assert shape.attention == "mla" and shape.num_kv_heads == 1
    assert shape.head_dim == shape.kv_values_per_token_per_layer == 512 + 64
    assert shape.kv_bytes_per_token("bf16") == (512 + 64) * 61 * 2 == 70_272
    assert within(shape.num_params, 671e9, 0.03)


def test_deepseek_v2_lite_without_query_compression() -> None:
    lite = {
        **DEEPSEEK_V3,
        "model_type": "deepseek_v2",
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "q_lora_rank": None,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "first_k_dense_replace": 1,
        "topk_method": "greedy",
        "vocab_size": 102400,
    }
    shape = shape_from_hf_dict(lite)
    assert shape.kv_bytes_per_token("bf16") == (512 + 64) * 27 * 2
    assert within(shape.num_params, 15.7e9, 0.02)


def test_moe_totals() -> None:
    assert within(estimate_num_params(MIXTRAL_8X7B), 46.7e9, 0.02)
    # An MoE family without a counting rule gets None, not a dense-model guess.
    qwen_moe = {**QWEN2_5_7B, "model_type": "qwen2_moe", "num_experts": 60}
    assert estimate_num_params(qwen_moe) is None
    assert estimate_num_params({**LLAMA_3_8B, "model_type": "llama", "num_experts": 8}) is None


def test_text_config_wrapper_is_read_from_the_inner_config() -> None:
    wrapper = {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "vision_config": {"hidden_size": 1024, "num_hidden_layers": 24},
        "text_config": {**LLAMA_2_7B, "torch_dtype": None},
        "torch_dtype": "float16",
    }
    shape = shape_from_hf_dict(wrapper)
    assert shape.architecture == "LlavaForConditionalGeneration"
    assert shape.kv_bytes_per_token("fp16") == 524_288 and shape.default_dtype == "fp16"
    # The vision tower is not counted, so no total is claimed.
    assert shape.num_params is None
    partial = {**wrapper, "text_config": {"model_type": "llama", "vocab_size": 32064}}
    with pytest.raises(KvSwapError, match=r"text_config\.num_hidden_layers"):
        shape_from_hf_dict(partial)


def test_default_dtype_reads_torch_dtype_or_dtype_else_fp16() -> None:
    base = {k: v for k, v in LLAMA_3_8B.items() if k != "torch_dtype"}
    assert shape_from_hf_dict(base).default_dtype == "fp16"
    assert shape_from_hf_dict({**base, "dtype": "float32"}).default_dtype == "fp32"
    assert shape_from_hf_dict({**base, "torch_dtype": "auto"}).default_dtype == "fp16"


@given(
    num_layers=st.integers(1, 128),
    num_kv_heads=st.sampled_from([1, 2, 4, 8]),
    group=st.integers(1, 8),
    head_dim=st.sampled_from([32, 64, 80, 128, 256]),
    dtype=st.sampled_from(sorted(DTYPE_BYTES)),
)
def test_kv_bytes_follow_the_formula(
    num_layers: int, num_kv_heads: int, group: int, head_dim: int, dtype: str
) -> None:
    heads = num_kv_heads * group
    config = {
        "model_type": "llama",
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": num_kv_heads,
        "hidden_size": heads * head_dim,
    }
    shape = shape_from_hf_dict(config)
    expected = 2 * num_layers * num_kv_heads * head_dim * DTYPE_BYTES[dtype]
    assert shape.kv_bytes_per_token(dtype) == expected


def test_shape_is_frozen() -> None:
    shape = preset_shape("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        shape.num_layers = 3  # type: ignore[misc]


# --- configs it must refuse ---------------------------------------------------------


def _error(config: dict[str, object]) -> str:
    with pytest.raises(KvSwapError) as info:
        shape_from_hf_dict(config, "model/config.json")
    message = str(info.value)
    assert "\n" not in message and message.startswith("model/config.json: ")
    return message


def test_mamba_names_architecture_and_missing_key() -> None:
    message = _error(MAMBA_2_8B)
    assert "MambaForCausalLM" in message and "num_attention_heads" in message
    assert "state-space" in message
    assert estimate_num_params(MAMBA_2_8B) is None


def test_missing_layer_count() -> None:
    config = {k: v for k, v in LLAMA_3_8B.items() if k != "num_hidden_layers"}
    assert "num_hidden_layers" in _error(config)


def test_head_dim_not_derivable() -> None:
    message = _error({**LLAMA_2_7B, "hidden_size": 4100})
    assert "head_dim" in message and "4100" in message


@pytest.mark.parametrize("value", ["32", -4, 0, True, 3.5])
def test_wrong_values_name_the_key(value: object) -> None:
    message = _error({**LLAMA_3_8B, "num_hidden_layers": value})
    assert f"num_hidden_layers = {value!r}" in message


def test_kv_heads_must_divide_heads() -> None:
    assert "not a multiple" in _error({**LLAMA_3_8B, "num_key_value_heads": 5})


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"model_type": "bert", "architectures": ["BertForMaskedLM"]}, "encoder-only"),
        ({"is_encoder_decoder": True, "model_type": "t5"}, "encoder-decoder"),
        ({"model_type": "jamba", "attn_layer_period": 8}, "jamba"),
        ({"layer_types": ["linear_attention", "full_attention"]}, "linear_attention"),
        ({"cross_attention_layers": [3, 8]}, "cross_attention_layers"),
    ],
)
def test_unsizable_architectures_are_refused(extra: dict[str, object], words: str) -> None:
    assert words in _error({**LLAMA_2_7B, **extra})


def test_sliding_and_full_layer_types_are_accepted() -> None:
    config = {**LLAMA_3_8B, "layer_types": ["sliding_attention", "full_attention"] * 16}
    assert shape_from_hf_dict(config).kv_bytes_per_token("fp16") == 131_072


# --- reading files ------------------------------------------------------------------


def test_reads_a_file_or_its_directory(tmp_path: Path) -> None:
    model_dir = tmp_path / "Qwen2.5-7B"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(QWEN2_5_7B))
    assert shape_from_hf_config(model_dir / "config.json").kv_bytes_per_token("fp16") == 57_344
    assert shape_from_hf_config(str(model_dir)).name == "Qwen2.5-7B"


def test_file_errors_are_one_line_with_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(KvSwapError, match="no such file") as info:
        shape_from_hf_config(missing)
    assert str(missing) in str(info.value)
    broken = tmp_path / "broken.json"
    broken.write_text('{"num_hidden_layers": 32,')
    with pytest.raises(KvSwapError, match=r"not valid JSON \(line 1") as info:
        shape_from_hf_config(broken)
    assert str(broken) in str(info.value) and "\n" not in str(info.value)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(KvSwapError, match="expected a JSON object, got list"):
        shape_from_hf_config(listed)
    mamba = tmp_path / "config.json"
    mamba.write_text(json.dumps(MAMBA_2_8B))
    with pytest.raises(KvSwapError, match="MambaForCausalLM") as info:
        shape_from_hf_config(mamba)
    assert str(info.value).startswith(str(mamba))


def test_importing_shapes_does_not_import_torch() -> None:
    code = (
        "import sys, kvswap.model.presets, kvswap.model.hf_config, "
        "kvswap.model.params, kvswap.model.arch_config; print('torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "False"
