"""The decoder's config: a `ModelDescription` plus what only the torch model needs.

Shapes (layers, heads, KV heads, head width, vocabulary), the RoPE settings
and the dtype come from the description, read once by `kvswap.model.hf_config`;
this module adds the Llama-family settings the ledger never needs (norm
epsilon, biases, tied embeddings, position limit, sliding window) and turns
the description's RoPE settings into the scalings the decoder implements.

Supported: the Llama family as transformers spells it (`llama`, `mistral`,
`qwen2`): RMSNorm, RoPE (plain, `linear` and Llama-3 `llama3` scaling),
grouped-query attention, SwiGLU MLP, optional q/k/v (Qwen2) or q/k/v/o
(`attention_bias`) biases, explicit `head_dim`, tied embeddings. Torch-free,
so the CLI can validate a checkpoint's config without importing torch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

from kvswap.errors import KvSwapError
from kvswap.model.description import ModelDescription, RopeSpec

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# transformers' per-model defaults for keys a config.json may omit.
_DEFAULT_MAX_POSITION_TOKENS = {"llama": 2048, "mistral": 131072, "qwen2": 32768}


@dataclass(frozen=True)
class LinearRopeScaling:
    """Position interpolation: every frequency divided by `factor`."""

    factor: float


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's frequency-band-dependent RoPE scaling (rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_tokens: int


RopeScaling = LinearRopeScaling | Llama3RopeScaling


@dataclass(frozen=True)
class ModelArchConfig:
    """Everything the decoder needs to build its modules; immutable once parsed."""

    description: ModelDescription
    rms_norm_eps: float
    rope_scaling: RopeScaling | None
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    max_position_tokens: int
    # Contexts longer than this need sliding-window attention, which the paged
    # attention does not implement: the model refuses them. None = no window.
    sliding_window_tokens: int | None

    def __post_init__(self) -> None:
        d = self.description
        if d.model_type not in SUPPORTED_MODEL_TYPES or d.mla is not None:
            raise KvSwapError(f"{d.name}: the decoder runs only {', '.join(SUPPORTED_MODEL_TYPES)}")
        for key, size in (("intermediate_size", d.intermediate_size), ("vocab_size", d.vocab_size)):
            if size is None:
                raise KvSwapError(f"config.json: '{key}' must be a positive integer, got None")
        if d.head_dim % 2 != 0:
            raise KvSwapError(f"config: head_dim={d.head_dim} must be even for RoPE")

    # The shape, as the decoder's modules name it; all of it from the description.
    @property
    def model_type(self) -> str:
        assert self.description.model_type is not None  # checked in __post_init__
        return self.description.model_type

    @property
    def vocab_size(self) -> int:
        assert self.description.vocab_size is not None  # checked in __post_init__
        return self.description.vocab_size

    @property
    def intermediate_size(self) -> int:
        assert self.description.intermediate_size is not None  # checked in __post_init__
        return self.description.intermediate_size

    @property
    def hidden_size(self) -> int:
        return self.description.hidden_size

    @property
    def num_layers(self) -> int:
        return self.description.num_layers

    @property
    def num_heads(self) -> int:
        return self.description.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.description.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.description.head_dim

    @property
    def rope_theta(self) -> float:
        return self.description.rope.theta

    @property
    def dtype_name(self) -> str:
        """The dtype weights and KV are held in (the checkpoint's until `with_dtype`)."""
        return self.description.kv_dtype

    def with_dtype(self, dtype: str) -> ModelArchConfig:
        return dataclasses.replace(self, description=self.description.with_kv_dtype(dtype))


def _positive_int(raw: Mapping[str, object], key: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if value is None and default is not None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise KvSwapError(f"config.json: '{key}' must be a positive integer, got {value!r}")
    return value


def _positive_float(raw: Mapping[str, object], key: str, default: float) -> float:
    value = raw.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise KvSwapError(f"config.json: '{key}' must be a positive number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise KvSwapError(f"config.json: '{key}' must be a positive number, got {value!r}")
    return float(value)


def _flag(raw: Mapping[str, object], key: str, default: bool) -> bool:
    value = raw.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise KvSwapError(f"config.json: '{key}' must be true or false, got {value!r}")
    return value


def rope_scaling_of(rope: RopeSpec) -> RopeScaling | None:
    """The scaling the decoder implements for `rope`; a one-line error for others."""
    params = dict(rope.params)
    if rope.rope_type == "default":
        return None
    if rope.rope_type == "linear":
        return LinearRopeScaling(factor=_positive_float(params, "factor", 1.0))
    if rope.rope_type == "llama3":
        low = _positive_float(params, "low_freq_factor", 1.0)
        high = _positive_float(params, "high_freq_factor", 4.0)
        if high <= low:
            raise KvSwapError(
                f"config.json: llama3 rope scaling needs high_freq_factor ({high}) > "
                f"low_freq_factor ({low})"
            )
        return Llama3RopeScaling(
            factor=_positive_float(params, "factor", 8.0),
            low_freq_factor=low,
            high_freq_factor=high,
            original_max_position_tokens=_positive_int(params, "original_max_position_embeddings"),
        )
    raise KvSwapError(
        f"config.json: rope scaling type {rope.rope_type!r} is not supported; "
        f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def _sliding_window(
    raw: Mapping[str, object], model_type: str, max_position_tokens: int
) -> int | None:
    if model_type == "llama":
        return None
    if model_type == "qwen2" and not _flag(raw, "use_sliding_window", False):
        return None
    if raw.get("sliding_window") is None:
        return None
    window_tokens = _positive_int(raw, "sliding_window")
    # A window at least as long as any allowed context never masks anything.
    return window_tokens if window_tokens < max_position_tokens else None


def build_arch_config(raw: Mapping[str, object], description: ModelDescription) -> ModelArchConfig:
    """The decoder's config for `description`, read from the same config dict `raw`."""
    model_type = description.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise KvSwapError(
            f"unsupported model architecture {model_type!r}; supported model_type values: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise KvSwapError(f"config.json: hidden_act {hidden_act!r} is not supported; only 'silu'")
    max_position_tokens = _positive_int(
        raw, "max_position_embeddings", _DEFAULT_MAX_POSITION_TOKENS[model_type]
    )
    attention_bias = _flag(raw, "attention_bias", False)
    return ModelArchConfig(
        description=description,
        rms_norm_eps=_positive_float(raw, "rms_norm_eps", 1e-6),
        rope_scaling=rope_scaling_of(description.rope),
        # Qwen2 always biases q/k/v and never o; Llama's attention_bias covers all four.
        qkv_bias=attention_bias or model_type == "qwen2",
        o_bias=attention_bias and model_type != "qwen2",
        mlp_bias=_flag(raw, "mlp_bias", False),
        tie_word_embeddings=_flag(raw, "tie_word_embeddings", False),
        max_position_tokens=max_position_tokens,
        sliding_window_tokens=_sliding_window(raw, model_type, max_position_tokens),
    )
