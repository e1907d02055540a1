"""THE `config.json` reader: a Hugging Face config -> a `ModelDescription`.

Every consumer reads a config through here: the ledger and `kvswap plan`
(`describe_hf_dict`, `describe_hf_file`), the presets (they are config dicts
too), and the torch decoder (`parse_hf_config`, which adds the settings only
the decoder needs on top of the same description). So a layer count, a KV
head count or a head width is read by one piece of code.

Read: MHA, GQA, MQA (Falcon, GPTBigCode, ChatGLM spellings), explicit
`head_dim`, MLA latent KV (DeepSeek), `text_config` wrappers, both RoPE
spellings (transformers 4.x `rope_theta` + `rope_scaling`; 5.x one
`rope_parameters` dict). Refused (`hf_fields`): state-space and hybrid models,
encoders, per-layer differences. Torch-free on purpose.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

from kvswap.errors import KvSwapError
from kvswap.model.arch_config import (
    SUPPORTED_MODEL_TYPES,
    SUPPORTED_ROPE_TYPES,
    LinearRopeScaling,
    Llama3RopeScaling,
    ModelArchConfig,
    RopeScaling,
    build_arch_config,
)
from kvswap.model.description import (
    AttentionKind,
    MlaShape,
    ModelDescription,
    RopeSpec,
    RopeValue,
)
from kvswap.model.dtypes import weight_dtype_or_none
from kvswap.model.hf_fields import (
    HEAD_KEYS,
    HIDDEN_KEYS,
    INTERMEDIATE_KEYS,
    LAYER_KEYS,
    VOCAB_KEYS,
    FieldReader,
    architecture_name,
    kv_heads,
    reject_bad_floats,
    reject_mixed_layers,
    reject_non_decoder,
)
from kvswap.model.params import count_params
from kvswap.readers import MODEL_CONFIG_FILE, parse_json, read_user_file

__all__ = [
    "SUPPORTED_MODEL_TYPES", "SUPPORTED_ROPE_TYPES", "LinearRopeScaling", "Llama3RopeScaling",
    "ModelArchConfig", "RopeScaling", "describe_hf_dict", "describe_hf_file",
    "estimate_num_params", "parse_hf_config", "read_config_json",
]  # fmt: skip


def _checkpoint_dtype(outer: Mapping[str, object], text: Mapping[str, object]) -> str | None:
    for config in (text, outer):
        for key in ("torch_dtype", "dtype"):
            dtype = weight_dtype_or_none(config.get(key))
            if dtype is not None:  # "auto" and fp8 say nothing about the weights
                return dtype
    return None


def _rope_value(value: object) -> RopeValue | None:
    if isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list) and all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in value
    ):
        return tuple(value)  # e.g. longrope's per-frequency factors
    return None  # nested objects carry nothing a fingerprint or the decoder reads


def _rope(r: FieldReader) -> RopeSpec:
    """The RoPE settings in either spelling; the decoder decides later what it can run."""
    params = r.config.get("rope_parameters")
    theta = r.positive_float(r.config, "rope_theta", 10000.0)
    if isinstance(params, Mapping):
        scaling: object = params
        theta = r.positive_float(params, "rope_theta", theta)
    else:
        scaling = r.config.get("rope_scaling")
    if scaling is None:
        return RopeSpec(theta=theta)
    if not isinstance(scaling, Mapping):
        raise r.fail(f"{r.prefix}rope_scaling = {scaling!r} is not an object")
    rope_type = scaling.get("rope_type", scaling.get("type")) or "default"
    if not isinstance(rope_type, str):
        raise r.fail(f"{r.prefix}rope_scaling rope_type = {rope_type!r} is not a name")
    if rope_type == "default":
        return RopeSpec(theta=theta)
    values = {
        key: _rope_value(value)
        for key, value in scaling.items()
        if key not in ("rope_type", "type", "rope_theta")
    }
    kept = tuple(sorted((k, v) for k, v in values.items() if v is not None))
    return RopeSpec(theta=theta, rope_type=rope_type, params=kept)


def _describe(config: Mapping[str, object], name: str, source: str) -> ModelDescription:
    """The description read from `config`, without its parameter count."""
    inner = config.get("text_config")
    text = inner if isinstance(inner, Mapping) else config
    prefix = "text_config." if text is not config else ""
    model_type_value = text.get("model_type", config.get("model_type"))
    model_type = model_type_value if isinstance(model_type_value, str) else None
    r = FieldReader(text, source, prefix, architecture_name(config, text))
    reject_non_decoder(r, config, model_type)
    reject_bad_floats(r, config)
    # Counts first, so a config without attention names the key it lacks.
    num_layers = r.required_int(LAYER_KEYS)
    num_heads = r.required_int(HEAD_KEYS)
    hidden_size = r.required_int(HIDDEN_KEYS)
    reject_mixed_layers(r, model_type)
    attention: AttentionKind
    mla: MlaShape | None = None
    if text.get("kv_lora_rank") is not None:
        # MLA caches the compressed latent (shared by K and V) and the RoPE key.
        mla = MlaShape(r.required_int(("kv_lora_rank",)), r.required_int(("qk_rope_head_dim",)))
        attention, num_kv_heads = "mla", 1
        head_dim = mla.kv_lora_rank + mla.qk_rope_head_dim
    else:
        num_kv_heads = kv_heads(r, model_type, num_heads)
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
    checkpoint_dtype = _checkpoint_dtype(config, text)
    return ModelDescription(
        name=name,
        architecture=r.arch,
        model_type=model_type,
        attention=attention,
        num_layers=num_layers,
        num_attention_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_size=hidden_size,
        intermediate_size=r.positive_int(INTERMEDIATE_KEYS, required=False),
        vocab_size=r.positive_int(VOCAB_KEYS, required=False),
        num_params=None,
        num_params_is_estimate=False,
        checkpoint_dtype=checkpoint_dtype,
        kv_dtype=checkpoint_dtype or "fp16",
        rope=_rope(r),
        mla=mla,
    )


def _described(config: Mapping[str, object], name: str, source: str) -> ModelDescription:
    if not isinstance(config, Mapping):
        raise KvSwapError(f"{source}: expected a JSON object, got {type(config).__name__}")
    description = _describe(config, name, source)
    num_params = _count(config, description)
    return dataclasses.replace(
        description, num_params=num_params, num_params_is_estimate=num_params is not None
    )


def _count(config: Mapping[str, object], description: ModelDescription) -> int | None:
    # Multimodal wrappers: their vision towers are not counted, so no total is claimed.
    if isinstance(config.get("text_config"), Mapping):
        return None
    return count_params(config, description)


def describe_hf_dict(config: Mapping[str, object], name: str = "hf-config") -> ModelDescription:
    """The model described by a parsed Hugging Face config (errors name `name`)."""
    return _described(config, name, name)


def read_config_json(file: Path) -> dict[str, object]:
    """The JSON object in `file`; one-line errors naming the path."""
    try:
        data = read_user_file(file, str(file), MODEL_CONFIG_FILE)
    except FileNotFoundError:
        raise KvSwapError(f"{file}: no such file; expected a Hugging Face config.json") from None
    except OSError as exc:
        raise KvSwapError(f"{file}: cannot read it ({exc})") from None
    # parse_json turns binary, deep nesting, bad syntax and NaN/Infinity into one line each.
    config = parse_json(data, str(file))
    if not isinstance(config, dict):
        raise KvSwapError(f"{file}: expected a JSON object, got {type(config).__name__}")
    return config


def describe_hf_file(path: str | os.PathLike[str]) -> ModelDescription:
    """The model described by a `config.json` file, or a directory holding one."""
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    config = read_config_json(file)
    name = file.parent.name if file.name == "config.json" and file.parent.name else file.stem
    return _described(config, name, str(file))


def estimate_num_params(config: Mapping[str, object]) -> int | None:
    """Total parameters of a known decoder family; None when it cannot be counted
    (see `kvswap.model.params`)."""
    try:
        description = _describe(config, "hf-config", "hf-config")
    except KvSwapError:
        return None
    return _count(config, description)


def parse_hf_config(
    raw: Mapping[str, object], source: str = "config.json", name: str = "hf-config"
) -> ModelArchConfig:
    """The decoder's config: the family is checked first (so an unsupported model is
    named as such), then the one description, then the decoder-only settings."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = raw.get("architectures")
        named = f"{model_type!r}" + (f" ({archs})" if archs else "")
        raise KvSwapError(
            f"unsupported model architecture {named}; supported model_type values: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return build_arch_config(raw, _described(raw, name, source))
