"""The decoder's architecture, parsed once from a Hugging Face `config.json` dict.

Torch-free on purpose: the CLI can validate a checkpoint's config (and name what
is unsupported) without importing torch. Supported: the Llama family as
transformers spells it (`llama`, `mistral`, `qwen2`): RMSNorm, RoPE (plain,
`linear` and Llama-3 `llama3` scaling), grouped-query attention, SwiGLU MLP,
optional q/k/v (Qwen2) or q/k/v/o (`attention_bias`) biases, explicit
`head_dim`, tied embeddings.

Both RoPE spellings are read: transformers 4.x writes `rope_theta` plus
`rope_scaling`; 5.x writes one `rope_parameters` dict holding both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvswap.errors import KvSwapError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# checkpoint spelling -> kvswap spelling (the names `--dtype` accepts)
DTYPE_NAMES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}

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

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    max_position_tokens: int
    # Contexts longer than this need sliding-window attention, which the paged
    # attention does not implement: the model refuses them. None = no window.
    sliding_window_tokens: int | None
    # The checkpoint's own dtype in kvswap spelling ("fp32"/"fp16"/"bf16"); None if unstated.
    dtype_name: str | None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise KvSwapError(
                f"config: num_attention_heads={self.num_heads} must be a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2 != 0:
            raise KvSwapError(f"config: head_dim={self.head_dim} must be even for RoPE")


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
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise KvSwapError(f"config.json: '{key}' must be a positive number, got {value!r}")
    return float(value)


def _flag(raw: Mapping[str, object], key: str, default: bool) -> bool:
    value = raw.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise KvSwapError(f"config.json: '{key}' must be true or false, got {value!r}")
    return value


def _parse_rope(raw: Mapping[str, object]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from either the 4.x or the 5.x spelling."""
    params = raw.get("rope_parameters")
    if isinstance(params, Mapping):
        scaling_raw: object = params
        theta = _positive_float(params, "rope_theta", _positive_float(raw, "rope_theta", 10000.0))
    else:
        scaling_raw = raw.get("rope_scaling")
        theta = _positive_float(raw, "rope_theta", 10000.0)
    if scaling_raw is None:
        return theta, None
    if not isinstance(scaling_raw, Mapping):
        raise KvSwapError(f"config.json: 'rope_scaling' must be an object, got {scaling_raw!r}")
    rope_type = scaling_raw.get("rope_type", scaling_raw.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type == "linear":
        return theta, LinearRopeScaling(factor=_positive_float(scaling_raw, "factor", 1.0))
    if rope_type == "llama3":
        low = _positive_float(scaling_raw, "low_freq_factor", 1.0)
        high = _positive_float(scaling_raw, "high_freq_factor", 4.0)
        if high <= low:
            raise KvSwapError(
                f"config.json: llama3 rope scaling needs high_freq_factor ({high}) > "
                f"low_freq_factor ({low})"
            )
        return theta, Llama3RopeScaling(
            factor=_positive_float(scaling_raw, "factor", 8.0),
            low_freq_factor=low,
            high_freq_factor=high,
            original_max_position_tokens=_positive_int(
                scaling_raw, "original_max_position_embeddings"
            ),
        )
    raise KvSwapError(
        f"config.json: rope scaling type {rope_type!r} is not supported; "
        f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def _parse_sliding_window(
    raw: Mapping[str, object], model_type: str, max_position_tokens: int
) -> int | None:
    if model_type == "llama":
        return None
    if model_type == "qwen2" and not _flag(raw, "use_sliding_window", False):
        return None
    window = raw.get("sliding_window")
    if window is None:
        return None
    window_tokens = _positive_int(raw, "sliding_window")
    # A window at least as long as any allowed context never masks anything.
    return window_tokens if window_tokens < max_position_tokens else None


def _parse_dtype_name(raw: Mapping[str, object]) -> str | None:
    value = raw.get("dtype", raw.get("torch_dtype"))
    if value is None:
        return None
    if not isinstance(value, str) or value not in DTYPE_NAMES:
        raise KvSwapError(
            f"config.json: dtype {value!r} is not supported; supported: {', '.join(DTYPE_NAMES)}"
        )
    return DTYPE_NAMES[value]


def parse_hf_config(raw: Mapping[str, object]) -> ModelArchConfig:
    """Validate a Hugging Face config dict and return the architecture it describes."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = raw.get("architectures")
        named = f"{model_type!r}" + (f" ({archs})" if archs else "")
        raise KvSwapError(
            f"unsupported model architecture {named}; supported model_type values: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    assert isinstance(model_type, str)
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise KvSwapError(f"config.json: hidden_act {hidden_act!r} is not supported; only 'silu'")
    hidden_size = _positive_int(raw, "hidden_size")
    num_heads = _positive_int(raw, "num_attention_heads")
    if raw.get("head_dim") is None and hidden_size % num_heads != 0:
        raise KvSwapError(
            f"config.json: hidden_size={hidden_size} is not a multiple of "
            f"num_attention_heads={num_heads} and no head_dim is given"
        )
    max_position_tokens = _positive_int(
        raw, "max_position_embeddings", _DEFAULT_MAX_POSITION_TOKENS[model_type]
    )
    attention_bias = _flag(raw, "attention_bias", False)
    rope_theta, rope_scaling = _parse_rope(raw)
    return ModelArchConfig(
        model_type=model_type,
        vocab_size=_positive_int(raw, "vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=_positive_int(raw, "intermediate_size"),
        num_layers=_positive_int(raw, "num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=_positive_int(raw, "num_key_value_heads", num_heads),
        head_dim=_positive_int(raw, "head_dim", hidden_size // num_heads),
        rms_norm_eps=_positive_float(raw, "rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        # Qwen2 always biases q/k/v and never o; Llama's attention_bias covers all four.
        qkv_bias=attention_bias or model_type == "qwen2",
        o_bias=attention_bias and model_type != "qwen2",
        mlp_bias=_flag(raw, "mlp_bias", False),
        tie_word_embeddings=_flag(raw, "tie_word_embeddings", False),
        max_position_tokens=max_position_tokens,
        sliding_window_tokens=_parse_sliding_window(raw, model_type, max_position_tokens),
        dtype_name=_parse_dtype_name(raw),
    )
