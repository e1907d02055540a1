"""The shape of a model, as far as its KV cache and weights are concerned.

The memory ledger needs only a handful of numbers: layers, KV heads, head
width, and how many values one token leaves in each layer's cache. They come
from a built-in preset or a Hugging Face `config.json`. Anything this module
cannot size honestly (state-space and hybrid models, encoders, per-layer
differences) is refused with a `KvSwapError`, never answered with a guess.

Values cached per token per layer:

    MHA/GQA/MQA   K and V, one head_dim-wide vector per KV head:
                  2 * num_kv_heads * head_dim
    MLA           one latent vector shared by K and V plus the decoupled
                  RoPE key: kv_lora_rank + qk_rope_head_dim

A uniform sliding window (Mistral) leaves the per-token size unchanged; the
ledger counts every token of context, an upper bound for windowed layers.

Torch-free on purpose: `kvswap plan` runs where torch is not installed.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvswap.errors import KvSwapError

AttentionKind = Literal["mha", "gqa", "mqa", "mla"]

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
_DTYPE_ALIASES: dict[str, str] = {
    "float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16",
    "float8_e4m3fn": "fp8", "float8_e4m3fnuz": "fp8", "float8_e5m2": "fp8",
    "float8_e5m2fnuz": "fp8",
}  # fmt: skip
_ALLOWED_DTYPES = "fp32, fp16, bf16, fp8 (or float32, float16, bfloat16, float8_e4m3fn)"


def normalise_dtype(name: str) -> str:
    """Map a dtype name ("bf16", "bfloat16", "torch.float16") to a DTYPE_BYTES key."""
    key = name.strip().lower().removeprefix("torch.")
    if key in DTYPE_BYTES:
        return key
    if key in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[key]
    raise KvSwapError(f"unknown dtype {name!r}; allowed: {_ALLOWED_DTYPES}")


def dtype_bytes(dtype: str) -> int:
    """Bytes per value of `dtype`."""
    return DTYPE_BYTES[normalise_dtype(dtype)]


@dataclass(frozen=True)
class ModelShape:
    """What the ledger needs to know about a model; see the module docstring."""

    name: str
    architecture: str
    attention: AttentionKind
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int  # MLA: 1, the latent vector
    head_dim: int  # MLA: kv_lora_rank + qk_rope_head_dim
    kv_values_per_token_per_layer: int
    hidden_size: int
    intermediate_size: int | None
    vocab_size: int | None
    num_params: int | None
    num_params_is_estimate: bool
    default_dtype: str

    def kv_bytes_per_token(self, dtype: str) -> int:
        """KV cache bytes one token occupies across all layers, in `dtype`."""
        return self.kv_values_per_token_per_layer * self.num_layers * dtype_bytes(dtype)


# --- reading a Hugging Face config -------------------------------------------------

_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_HEAD_KEYS = ("num_attention_heads", "n_head")
_HIDDEN_KEYS = ("hidden_size", "n_embd")
_INTERMEDIATE_KEYS = ("intermediate_size", "n_inner", "ffn_hidden_size")
_VOCAB_KEYS = ("vocab_size", "padded_vocab_size")
_SSM_HINT_KEYS = ("state_size", "ssm_state_size", "d_state", "ssm_cfg", "mamba_d_state")
_ENCODER_ONLY_TYPES = frozenset(
    {"bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta",
     "deberta-v2", "modernbert", "mpnet", "camembert", "nomic_bert", "esm"}
)  # fmt: skip
# Models whose layers are not all self-attention layers with one KV shape.
_HYBRID_TYPES = frozenset(
    {"mamba", "mamba2", "falcon_mamba", "rwkv", "jamba", "zamba", "zamba2", "bamba",
     "falcon_h1", "nemotron_h", "granitemoehybrid", "recurrent_gemma", "qwen3_next",
     "lfm2", "minimax", "xlstm"}
)  # fmt: skip
_HYBRID_KEYS = (
    "layers_block_type", "hybrid_override_pattern", "block_configs", "attn_layer_period",
    "cross_attention_layers", "num_kv_shared_layers", "index_head_dim",
)  # fmt: skip
_ATTENTION_LAYER_TYPES = frozenset(
    {"attention", "full_attention", "sliding_attention", "chunked_attention"}
)
_CAPABILITY = "kvswap sizes decoder-only transformers with MHA, GQA, MQA or MLA attention"


class _Reader:
    """Typed look-ups in one config mapping; every error names the source and key."""

    def __init__(self, config: Mapping[str, object], source: str, prefix: str, arch: str):
        self.config, self.source, self.prefix, self.arch = config, source, prefix, arch

    def fail(self, what: str) -> KvSwapError:
        return KvSwapError(f"{self.source}: {self.arch}: {what}")

    def present(self, keys: tuple[str, ...]) -> tuple[str, object] | None:
        """The first of `keys` set to something other than null."""
        for key in keys:
            if self.config.get(key) is not None:
                return key, self.config[key]
        return None

    def positive_int(self, keys: tuple[str, ...], *, required: bool) -> int | None:
        found = self.present(keys)
        if found is None:
            if not required:
                return None
            alternatives = f" (nor {', '.join(keys[1:])})" if len(keys) > 1 else ""
            hint = ""
            ssm_keys = [k for k in _SSM_HINT_KEYS if k in self.config]
            if ssm_keys:
                hint = f"; {ssm_keys[0]} suggests a state-space model, which keeps no KV cache"
            raise self.fail(
                f"config has no {self.prefix}{keys[0]}{alternatives}{hint}; {_CAPABILITY}"
            )
        key, value = found
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise self.fail(f"{self.prefix}{key} = {value!r} is not a positive integer")
        return value

    def required_int(self, keys: tuple[str, ...]) -> int:
        value = self.positive_int(keys, required=True)
        assert value is not None  # required=True raises instead of returning None
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.config.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(f"{self.prefix}{key} = {value!r} is not true or false")
        return value


def _architecture(outer: Mapping[str, object], text: Mapping[str, object]) -> str:
    for config in (outer, text):
        archs = config.get("architectures")
        if isinstance(archs, list) and archs and isinstance(archs[0], str):
            return archs[0]
    for config in (text, outer):
        model_type = config.get("model_type")
        if isinstance(model_type, str):
            return f"model_type {model_type}"
    return "unknown architecture"


def _default_dtype(outer: Mapping[str, object], text: Mapping[str, object]) -> str:
    for config in (text, outer):
        for key in ("torch_dtype", "dtype"):
            value = config.get(key)
            if isinstance(value, str):
                try:
                    dtype = normalise_dtype(value)
                except KvSwapError:
                    continue  # "auto" and the like say nothing about the cache
                if dtype in ("fp32", "fp16", "bf16"):
                    return dtype
    return "fp16"


def _reject_non_decoder(r: _Reader, outer: Mapping[str, object], model_type: str | None) -> None:
    if outer.get("is_encoder_decoder") is True or r.config.get("is_encoder_decoder") is True:
        raise r.fail(f"is an encoder-decoder model; {_CAPABILITY}")
    if model_type in _ENCODER_ONLY_TYPES or r.arch.endswith("ForMaskedLM"):
        raise r.fail(f"is an encoder-only model and keeps no KV cache; {_CAPABILITY}")


def _reject_mixed_layers(r: _Reader, model_type: str | None) -> None:
    """Refuse models whose layers do not all hold the same self-attention KV."""
    if model_type in _HYBRID_TYPES:
        raise r.fail(f"model_type {model_type} mixes in non-attention layers; {_CAPABILITY}")
    for key in _HYBRID_KEYS:
        value = r.config.get(key)
        if value not in (None, 0, [], {}, False):
            raise r.fail(
                f"{r.prefix}{key} means layers differ in their KV cache, which kvswap "
                "cannot size honestly yet"
            )
    layer_types = r.config.get("layer_types")
    if isinstance(layer_types, list):
        odd = sorted({str(t) for t in layer_types} - _ATTENTION_LAYER_TYPES)
        if odd:
            raise r.fail(f"{r.prefix}layer_types has non-attention layers {odd}; {_CAPABILITY}")


def _kv_heads(r: _Reader, model_type: str | None, num_heads: int) -> int:
    """KV heads for the non-MLA kinds, from whichever spelling the config uses."""
    explicit = r.positive_int(("num_key_value_heads",), required=False)
    if explicit is not None:
        return explicit
    if r.flag("new_decoder_architecture", False):  # Falcon-40B/180B: grouped KV heads
        return r.required_int(("num_kv_heads",))
    if r.flag("multi_query_attention", False):  # ChatGLM
        return r.required_int(("multi_query_group_num",))
    # Falcon and GPTBigCode default to multi-query when the key is absent.
    mq_default = model_type in ("falcon", "RefinedWeb", "RefinedWebModel", "gpt_bigcode")
    if r.flag("multi_query", mq_default):
        return 1
    return num_heads


def _geometry(config: Mapping[str, object], name: str, source: str) -> ModelShape:
    """The shape read from `config`, without its parameter count."""
    inner = config.get("text_config")
    text = inner if isinstance(inner, Mapping) else config
    prefix = "text_config." if text is not config else ""
    model_type_value = text.get("model_type", config.get("model_type"))
    model_type = model_type_value if isinstance(model_type_value, str) else None
    r = _Reader(text, source, prefix, _architecture(config, text))
    _reject_non_decoder(r, config, model_type)
    # Counts first, so a config without attention names the key it lacks.
    num_layers = r.required_int(_LAYER_KEYS)
    num_heads = r.required_int(_HEAD_KEYS)
    hidden_size = r.required_int(_HIDDEN_KEYS)
    _reject_mixed_layers(r, model_type)
    attention: AttentionKind
    if text.get("kv_lora_rank") is not None:
        # MLA caches the compressed latent (shared by K and V) and the RoPE key.
        kv_lora_rank = r.required_int(("kv_lora_rank",))
        rope_dim = r.required_int(("qk_rope_head_dim",))
        attention, num_kv_heads = "mla", 1
        head_dim = kv_values = kv_lora_rank + rope_dim
    else:
        num_kv_heads = _kv_heads(r, model_type, num_heads)
        if num_heads % num_kv_heads:
            raise r.fail(
                f"num_attention_heads ({num_heads}) is not a multiple of the KV head count "
                f"({num_kv_heads})"
            )
        explicit_dim = r.positive_int(("head_dim", "kv_channels"), required=False)
        if explicit_dim is not None:
            head_dim = explicit_dim
        elif hidden_size % num_heads == 0:
            head_dim = hidden_size // num_heads
        else:
            raise r.fail(
                f"head_dim is not given and hidden_size ({hidden_size}) is not divisible by "
                f"num_attention_heads ({num_heads}); add head_dim to the config"
            )
        attention = "mha" if num_kv_heads == num_heads else "mqa" if num_kv_heads == 1 else "gqa"
        kv_values = 2 * num_kv_heads * head_dim
    return ModelShape(
        name=name,
        architecture=r.arch,
        attention=attention,
        num_layers=num_layers,
        num_attention_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        kv_values_per_token_per_layer=kv_values,
        hidden_size=hidden_size,
        intermediate_size=r.positive_int(_INTERMEDIATE_KEYS, required=False),
        vocab_size=r.positive_int(_VOCAB_KEYS, required=False),
        num_params=None,
        num_params_is_estimate=False,
        default_dtype=_default_dtype(config, text),
    )


def _shape(config: Mapping[str, object], name: str, source: str) -> ModelShape:
    if not isinstance(config, Mapping):
        raise KvSwapError(f"{source}: expected a JSON object, got {type(config).__name__}")
    num_params = estimate_num_params(config)
    shape = _geometry(config, name, source)
    return dataclasses.replace(
        shape, num_params=num_params, num_params_is_estimate=num_params is not None
    )


def shape_from_hf_dict(config: Mapping[str, object], name: str = "hf-config") -> ModelShape:
    """The shape described by a parsed Hugging Face config (errors name `name`)."""
    return _shape(config, name, name)


def shape_from_hf_config(path: str | os.PathLike[str]) -> ModelShape:
    """The shape described by a `config.json` file, or a directory holding one."""
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise KvSwapError(f"{file}: no such file; expected a Hugging Face config.json") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise KvSwapError(f"{file}: cannot read it ({exc})") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise KvSwapError(
            f"{file}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        ) from None
    if not isinstance(config, dict):
        raise KvSwapError(f"{file}: expected a JSON object, got {type(config).__name__}")
    name = file.parent.name if file.name == "config.json" and file.parent.name else file.stem
    return _shape(config, name, str(file))


# --- parameter count ---------------------------------------------------------------

# model_type -> tie_word_embeddings when the config does not say (transformers defaults).
_DENSE_TIE_DEFAULT = {
    "llama": False, "mistral": False, "qwen2": False, "qwen3": False, "gemma": True,
    "mixtral": False,
}  # fmt: skip
_MOE_KEYS = ("num_local_experts", "n_routed_experts", "num_experts", "moe_intermediate_size")


def _opt_int(config: Mapping[str, object], key: str) -> int | None:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def _embedding_params(config: Mapping[str, object], geo: ModelShape, tie_default: bool) -> int:
    assert geo.vocab_size is not None  # callers checked
    tie = config.get("tie_word_embeddings", tie_default)
    return geo.vocab_size * geo.hidden_size * (1 if tie is True else 2)


def _dense_params(config: Mapping[str, object], geo: ModelShape, model_type: str) -> int | None:
    h, hd, inter = geo.hidden_size, geo.head_dim, geo.intermediate_size
    assert inter is not None  # callers checked
    q_width, kv_width = geo.num_attention_heads * hd, geo.num_kv_heads * hd
    attn = h * q_width + 2 * h * kv_width + q_width * h
    if model_type == "qwen2":
        attn += q_width + 2 * kv_width  # q/k/v biases, always on in Qwen2
    elif model_type != "mistral" and config.get("attention_bias") is True:
        attn += q_width + 2 * kv_width + h  # q/k/v/o biases
    norms = 2 * h + (2 * hd if model_type == "qwen3" else 0)  # Qwen3 adds q_norm, k_norm
    mlp = 3 * h * inter  # gate, up, down
    if config.get("mlp_bias") is True:
        mlp += 2 * inter + h
    if model_type == "mixtral":
        num_experts = _opt_int(config, "num_local_experts")
        if not num_experts:
            return None
        mlp = num_experts * mlp + h * num_experts  # experts + router
    per_layer = attn + norms + mlp
    tie_default = _DENSE_TIE_DEFAULT[model_type]
    return _embedding_params(config, geo, tie_default) + geo.num_layers * per_layer + h


def _deepseek_params(config: Mapping[str, object], geo: ModelShape) -> int | None:
    """DeepSeek-V2/V3: MLA attention, dense first layers, then shared + routed experts.

    The multi-token-prediction module (`num_nextn_predict_layers`) is left out,
    as in the published totals (DeepSeek-V3: 671B; 685B with it).
    """
    keys = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
            "moe_intermediate_size", "n_routed_experts", "n_shared_experts")  # fmt: skip
    values = [_opt_int(config, k) for k in keys]
    first_dense = _opt_int(config, "first_k_dense_replace")
    moe_freq = _opt_int(config, "moe_layer_freq") or 1
    if any(v is None for v in values) or first_dense is None or config.get("attention_bias"):
        return None
    kv_rank, rope, nope, v_dim, moe_inter, routed, shared = (int(v or 0) for v in values)
    h, heads, inter = geo.hidden_size, geo.num_attention_heads, geo.intermediate_size
    assert inter is not None  # callers checked
    q_rank = _opt_int(config, "q_lora_rank")
    if q_rank:  # low-rank query: down-projection, its norm, up-projection
        q = h * q_rank + q_rank + q_rank * heads * (nope + rope)
    else:
        q = h * heads * (nope + rope)
    kv = h * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v_dim)
    attn = q + kv + heads * v_dim * h + 2 * h  # + o_proj and the two layer norms
    score_bias = routed if config.get("topk_method") == "noaux_tc" else 0
    moe = (routed + shared) * 3 * h * moe_inter + routed * h + score_bias
    layers = range(geo.num_layers)
    num_moe = sum(1 for i in layers if i >= first_dense and i % moe_freq == 0)
    mlp = num_moe * moe + (geo.num_layers - num_moe) * 3 * h * inter
    return _embedding_params(config, geo, False) + geo.num_layers * attn + mlp + h


def estimate_num_params(config: Mapping[str, object]) -> int | None:
    """Total parameters of a known decoder family; None when it cannot be counted.

    Counted: Llama, Mistral, Qwen2, Qwen3, Gemma, Mixtral and DeepSeek-V2/V3.
    Multimodal wrappers give None: their vision towers are not counted here.
    """
    if isinstance(config.get("text_config"), Mapping):
        return None
    try:
        geo = _geometry(config, "hf-config", "hf-config")
    except KvSwapError:
        return None
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        return None
    if geo.intermediate_size is None or geo.vocab_size is None:
        return None
    if model_type in ("deepseek_v2", "deepseek_v3"):
        return _deepseek_params(config, geo)
    if geo.attention == "mla" or model_type not in _DENSE_TIE_DEFAULT:
        return None
    if model_type != "mixtral" and any(config.get(k) is not None for k in _MOE_KEYS):
        return None
    return _dense_params(config, geo, model_type)


# --- presets ---------------------------------------------------------------------

# Numbers from the published config.json files; totals from their safetensors.
# "tiny" and "small" are the engine's random-weight models (kvswap.model.loader).
# name: (model_type, layers, heads, kv_heads, hidden, intermediate, vocab, tied, dtype, params)
_DENSE_PRESETS: dict[str, tuple[str, int, int, int, int, int, int, bool, str, int]] = {
    "article-8b": ("llama", 32, 32, 8, 4096, 14336, 128256, False, "float16", 8_030_261_248),
    "llama-3.1-8b": ("llama", 32, 32, 8, 4096, 14336, 128256, False, "bfloat16", 8_030_261_248),
    "llama-3.1-70b": ("llama", 80, 64, 8, 8192, 28672, 128256, False, "bfloat16", 70_553_706_496),
    "qwen2.5-7b": ("qwen2", 28, 28, 4, 3584, 18944, 152064, False, "bfloat16", 7_615_616_512),
    "qwen2.5-72b": ("qwen2", 80, 64, 8, 8192, 29568, 152064, False, "bfloat16", 72_706_203_648),
    "mistral-7b": ("mistral", 32, 32, 8, 4096, 14336, 32000, False, "bfloat16", 7_241_732_096),
    "tiny": ("llama", 2, 4, 2, 64, 128, 256, False, "float32", 106_816),
    "small": ("llama", 12, 12, 4, 768, 2048, 32000, True, "float32", 100_092_672),
}  # fmt: skip
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "mistral": "MistralForCausalLM"}  # fmt: skip
_DEEPSEEK_V3: dict[str, object] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "hidden_size": 7168, "intermediate_size": 18432, "vocab_size": 129280,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
    "v_head_dim": 128, "moe_intermediate_size": 2048, "n_routed_experts": 256,
    "n_shared_experts": 1, "first_k_dense_replace": 3, "moe_layer_freq": 1,
    "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}  # fmt: skip
PRESET_NAMES: tuple[str, ...] = (
    "article-8b", "llama-3.1-8b", "llama-3.1-70b", "qwen2.5-7b", "qwen2.5-72b", "mistral-7b",
    "deepseek-v3", "tiny", "small",
)  # fmt: skip


def _preset_config(name: str) -> tuple[dict[str, object], int]:
    if name == "deepseek-v3":
        return _DEEPSEEK_V3, 671_026_419_200
    model_type, layers, heads, kv_heads, hidden, inter, vocab, tied, dtype, params = _DENSE_PRESETS[
        name
    ]
    config: dict[str, object] = {
        "architectures": [_ARCHITECTURES[model_type]], "model_type": model_type,
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "hidden_size": hidden, "intermediate_size": inter,
        "vocab_size": vocab, "torch_dtype": dtype, "tie_word_embeddings": tied,
    }  # fmt: skip
    return config, params


def preset_shape(name: str) -> ModelShape:
    """The shape of a built-in preset (see PRESET_NAMES); names are case-insensitive."""
    key = name.strip().lower()
    if key not in PRESET_NAMES:
        close = difflib.get_close_matches(key, PRESET_NAMES, n=1, cutoff=0.4)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise KvSwapError(
            f"unknown model preset {name!r}; {hint}valid presets: {', '.join(PRESET_NAMES)}"
        )
    config, num_params = _preset_config(key)
    shape = shape_from_hf_dict(config, key)
    return dataclasses.replace(shape, num_params=num_params, num_params_is_estimate=False)
