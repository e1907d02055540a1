"""Typed look-ups and refusal rules for the `config.json` reader (`hf_config`).

Every error names the source, the architecture and the key, in one line.
Anything the reader cannot size honestly (state-space and hybrid models,
encoders, per-layer differences) is refused here, never answered with a guess.
Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from kvswap.errors import KvSwapError

LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
HEAD_KEYS = ("num_attention_heads", "n_head")
HIDDEN_KEYS = ("hidden_size", "n_embd")
INTERMEDIATE_KEYS = ("intermediate_size", "n_inner", "ffn_hidden_size")
VOCAB_KEYS = ("vocab_size", "padded_vocab_size")
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
# Upper bounds on a config's counts: far above any released decoder (Llama 3.1 405B has
# 126 layers, hidden size 16384, intermediate size 53248; vocabularies reach ~256k), far
# below the sizes that would make building the model hang or its tensors overflow a machine
# (`vocab_size: 1e15`, `num_hidden_layers: 1e9`). Checked before anything is built.
MAX_NUM_LAYERS = 2048
_MAX_BY_KEY: dict[str, int] = {
    **dict.fromkeys(LAYER_KEYS, MAX_NUM_LAYERS),
    **dict.fromkeys(HIDDEN_KEYS, 1 << 18),
    **dict.fromkeys(INTERMEDIATE_KEYS, 1 << 20),
    **dict.fromkeys(VOCAB_KEYS, 1 << 23),
}
_MAX_COUNT = 1 << 16  # heads, KV heads, head_dim, latent ranks
# Floats that scale every activation: NaN, infinity, zero or a negative value gives garbage.
_EPSILON_KEYS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon")
CAPABILITY = "kvswap sizes decoder-only transformers with MHA, GQA, MQA or MLA attention"


class FieldReader:
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
                f"config has no {self.prefix}{keys[0]}{alternatives}{hint}; {CAPABILITY}"
            )
        key, value = found
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise self.fail(f"{self.prefix}{key} = {value!r} is not a positive integer")
        maximum = _MAX_BY_KEY.get(key, _MAX_COUNT)
        if value > maximum:
            raise self.fail(
                f"{self.prefix}{key} = {value} is larger than kvswap accepts (at most {maximum})"
            )
        return value

    def required_int(self, keys: tuple[str, ...]) -> int:
        value = self.positive_int(keys, required=True)
        assert value is not None  # required=True raises instead of returning None
        return value

    def positive_float(self, config: Mapping[str, object], key: str, default: float) -> float:
        value = config.get(key)
        if value is None:
            return default
        # `not value > 0` (rather than `value <= 0`) also refuses NaN.
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise self.fail(f"{self.prefix}{key} = {value!r} is not a positive number")
        try:
            finite = math.isfinite(value)  # an int past float's range overflows here
        except OverflowError:
            finite = False
        if not finite:
            raise self.fail(f"{self.prefix}{key} = {value!r:.40} is not a finite number")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.config.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(f"{self.prefix}{key} = {value!r} is not true or false")
        return value


def _non_finite(value: object) -> tuple[str, float] | None:
    """The key path and value of the first NaN or infinity under `value` (configs are small)."""
    stack: list[tuple[str, object]] = [("", value)]
    while stack:
        here, item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return here, item
        if isinstance(item, Mapping):
            stack.extend((f"{here}.{k}" if here else str(k), v) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((f"{here}[{i}]", v) for i, v in enumerate(item))
    return None


def reject_bad_floats(r: FieldReader, outer: Mapping[str, object]) -> None:
    """Refuse NaN or infinity anywhere, and a norm epsilon that is not a positive number.

    A dict built in memory (not read through `kvswap.readers`) can hold them, and a NaN
    epsilon or an infinite RoPE theta runs without an error, producing garbage tokens.
    """
    found = _non_finite(outer)
    if found is not None:
        raise r.fail(f"{found[0]} = {found[1]} is not a finite number")
    for key in _EPSILON_KEYS:
        r.positive_float(r.config, key, 1.0)


def architecture_name(outer: Mapping[str, object], text: Mapping[str, object]) -> str:
    for config in (outer, text):
        archs = config.get("architectures")
        if isinstance(archs, list) and archs and isinstance(archs[0], str):
            return archs[0]
    for config in (text, outer):
        model_type = config.get("model_type")
        if isinstance(model_type, str):
            return f"model_type {model_type}"
    return "unknown architecture"


def reject_non_decoder(r: FieldReader, outer: Mapping[str, object], model_type: str | None) -> None:
    if outer.get("is_encoder_decoder") is True or r.config.get("is_encoder_decoder") is True:
        raise r.fail(f"is an encoder-decoder model; {CAPABILITY}")
    if model_type in _ENCODER_ONLY_TYPES or r.arch.endswith("ForMaskedLM"):
        raise r.fail(f"is an encoder-only model and keeps no KV cache; {CAPABILITY}")


def reject_mixed_layers(r: FieldReader, model_type: str | None) -> None:
    """Refuse models whose layers do not all hold the same self-attention KV."""
    if model_type in _HYBRID_TYPES:
        raise r.fail(f"model_type {model_type} mixes in non-attention layers; {CAPABILITY}")
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
            raise r.fail(f"{r.prefix}layer_types has non-attention layers {odd}; {CAPABILITY}")


def kv_heads(r: FieldReader, model_type: str | None, num_heads: int) -> int:
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
