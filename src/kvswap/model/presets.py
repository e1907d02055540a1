"""THE preset table: one frozen `Preset` per built-in model, named fields only.

A preset is written as the size fields of its published config.json and goes
through the same reader as any config (`kvswap.model.hf_config`), so a preset
and its real config.json cannot be sized differently. Totals are from the
published safetensors. `tiny` and `small` are the engine's random-weight
models (`runs_in_engine`): the loader builds them with seeded weights, the
ledger and the simulator size them from this same table. Torch-free.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from kvswap.errors import KvSwapError
from kvswap.model.arch_config import ModelArchConfig, build_arch_config
from kvswap.model.description import ModelDescription
from kvswap.model.hf_config import describe_hf_dict, describe_hf_file

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}  # fmt: skip
#: The preset a config without `preset` or `hf_config` describes (the seed article's model).
DEFAULT_PRESET = "article-8b"


@dataclass(frozen=True)
class Preset:
    """A built-in model: the size fields of its config.json, by name."""

    name: str
    model_type: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    dtype: str  # as the config.json spells it ("bfloat16")
    num_params: int  # the published total
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, object] | None = None
    max_position_tokens: int | None = None
    runs_in_engine: bool = False
    # Family-specific config.json keys (DeepSeek's MLA and MoE sizes), as spelled there.
    family_fields: Mapping[str, object] = field(default_factory=dict)

    def hf_config(self) -> dict[str, object]:
        """The preset as a Hugging Face config dict, for the one reader."""
        config: dict[str, object] = {
            "architectures": [_ARCHITECTURES[self.model_type]], "model_type": self.model_type,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_kv_heads, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
            "torch_dtype": self.dtype, "tie_word_embeddings": self.tie_word_embeddings,
            "rope_theta": self.rope_theta,
        }  # fmt: skip
        if self.rope_scaling is not None:
            config["rope_scaling"] = dict(self.rope_scaling)
        if self.max_position_tokens is not None:
            config["max_position_embeddings"] = self.max_position_tokens
        config.update(self.family_fields)
        return config


_LLAMA_3_1_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
_DEEPSEEK_V3_FIELDS: dict[str, object] = {
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
    "v_head_dim": 128, "moe_intermediate_size": 2048, "n_routed_experts": 256,
    "n_shared_experts": 1, "first_k_dense_replace": 3, "moe_layer_freq": 1,
    "topk_method": "noaux_tc",
}  # fmt: skip
_DEEPSEEK_V3_ROPE = {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}  # fmt: skip

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("article-8b", "llama", num_layers=32, num_attention_heads=32, num_kv_heads=8,
               hidden_size=4096, intermediate_size=14336, vocab_size=128256,
               tie_word_embeddings=False, dtype="float16", num_params=8_030_261_248,
               rope_theta=500000.0),
        Preset("llama-3.1-8b", "llama", num_layers=32, num_attention_heads=32, num_kv_heads=8,
               hidden_size=4096, intermediate_size=14336, vocab_size=128256,
               tie_word_embeddings=False, dtype="bfloat16", num_params=8_030_261_248,
               rope_theta=500000.0, rope_scaling=_LLAMA_3_1_ROPE),
        Preset("llama-3.1-70b", "llama", num_layers=80, num_attention_heads=64, num_kv_heads=8,
               hidden_size=8192, intermediate_size=28672, vocab_size=128256,
               tie_word_embeddings=False, dtype="bfloat16", num_params=70_553_706_496,
               rope_theta=500000.0, rope_scaling=_LLAMA_3_1_ROPE),
        Preset("qwen2.5-7b", "qwen2", num_layers=28, num_attention_heads=28, num_kv_heads=4,
               hidden_size=3584, intermediate_size=18944, vocab_size=152064,
               tie_word_embeddings=False, dtype="bfloat16", num_params=7_615_616_512,
               rope_theta=1000000.0),
        Preset("qwen2.5-72b", "qwen2", num_layers=80, num_attention_heads=64, num_kv_heads=8,
               hidden_size=8192, intermediate_size=29568, vocab_size=152064,
               tie_word_embeddings=False, dtype="bfloat16", num_params=72_706_203_648,
               rope_theta=1000000.0),
        Preset("mistral-7b", "mistral", num_layers=32, num_attention_heads=32, num_kv_heads=8,
               hidden_size=4096, intermediate_size=14336, vocab_size=32000,
               tie_word_embeddings=False, dtype="bfloat16", num_params=7_241_732_096),
        Preset("deepseek-v3", "deepseek_v3", num_layers=61, num_attention_heads=128,
               num_kv_heads=128, hidden_size=7168, intermediate_size=18432, vocab_size=129280,
               tie_word_embeddings=False, dtype="bfloat16", num_params=671_026_419_200,
               rope_scaling=_DEEPSEEK_V3_ROPE, family_fields=_DEEPSEEK_V3_FIELDS),
        Preset("tiny", "llama", num_layers=2, num_attention_heads=4, num_kv_heads=2,
               hidden_size=64, intermediate_size=128, vocab_size=256, tie_word_embeddings=False,
               dtype="float32", num_params=106_816, max_position_tokens=8192,
               runs_in_engine=True),
        Preset("small", "llama", num_layers=12, num_attention_heads=12, num_kv_heads=4,
               hidden_size=768, intermediate_size=2048, vocab_size=32000,
               tie_word_embeddings=True, dtype="float32", num_params=100_092_672,
               max_position_tokens=8192, runs_in_engine=True),  # ~100M parameters
    )
}  # fmt: skip
PRESET_NAMES: tuple[str, ...] = tuple(PRESETS)
#: The presets the engine can run (seeded random weights; see kvswap.model.loader).
ENGINE_PRESET_NAMES: tuple[str, ...] = tuple(n for n, p in PRESETS.items() if p.runs_in_engine)


def get_preset(name: str) -> Preset:
    """The preset called `name` (case-insensitive); a one-line error with a suggestion."""
    key = name.strip().lower()
    if key not in PRESETS:
        close = difflib.get_close_matches(key, PRESET_NAMES, n=1, cutoff=0.4)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise KvSwapError(
            f"unknown model preset {name!r}; {hint}valid presets: {', '.join(PRESET_NAMES)}"
        )
    return PRESETS[key]


def preset_description(name: str) -> ModelDescription:
    """The description of a built-in preset, with its published parameter total."""
    preset = get_preset(name)
    description = describe_hf_dict(preset.hf_config(), preset.name)
    return replace(description, num_params=preset.num_params, num_params_is_estimate=False)


def preset_arch_config(name: str) -> ModelArchConfig:
    """The decoder's config for an engine preset (its description is `preset_description`)."""
    preset = get_preset(name)
    return build_arch_config(preset.hf_config(), preset_description(preset.name))


def describe_model(
    preset: str | None, hf_config: str | os.PathLike[str] | None = None
) -> ModelDescription:
    """The model a configuration names: `hf_config` when given, else `preset`
    (else DEFAULT_PRESET)."""
    if hf_config is not None:
        return describe_hf_file(hf_config)
    return preset_description(preset or DEFAULT_PRESET)
