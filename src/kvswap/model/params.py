"""Parameter counts of the known decoder families, from a config and its description.

Counted: Llama, Mistral, Qwen2, Qwen3, Gemma, Mixtral and DeepSeek-V2/V3.
Anything else gets None, never a dense-model guess: the ledger then says the
weights are unknown. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvswap.model.description import ModelDescription

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


def _embedding_params(
    config: Mapping[str, object], desc: ModelDescription, tie_default: bool
) -> int:
    assert desc.vocab_size is not None  # callers checked
    tie = config.get("tie_word_embeddings", tie_default)
    return desc.vocab_size * desc.hidden_size * (1 if tie is True else 2)


def _dense_params(
    config: Mapping[str, object], desc: ModelDescription, model_type: str
) -> int | None:
    h, hd, inter = desc.hidden_size, desc.head_dim, desc.intermediate_size
    assert inter is not None  # callers checked
    q_width, kv_width = desc.num_attention_heads * hd, desc.num_kv_heads * hd
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
    return _embedding_params(config, desc, tie_default) + desc.num_layers * per_layer + h


def _deepseek_params(config: Mapping[str, object], desc: ModelDescription) -> int | None:
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
    h, heads, inter = desc.hidden_size, desc.num_attention_heads, desc.intermediate_size
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
    layers = range(desc.num_layers)
    num_moe = sum(1 for i in layers if i >= first_dense and i % moe_freq == 0)
    mlp = num_moe * moe + (desc.num_layers - num_moe) * 3 * h * inter
    return _embedding_params(config, desc, False) + desc.num_layers * attn + mlp + h


def count_params(config: Mapping[str, object], desc: ModelDescription) -> int | None:
    """Total parameters of the model `config` describes (`desc` is its description);
    None for a family without a counting rule or a config missing its size fields."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        return None
    if desc.intermediate_size is None or desc.vocab_size is None:
        return None
    if model_type in ("deepseek_v2", "deepseek_v3"):
        return _deepseek_params(config, desc)
    if desc.attention == "mla" or model_type not in _DENSE_TIE_DEFAULT:
        return None
    if model_type != "mixtral" and any(config.get(k) is not None for k in _MOE_KEYS):
        return None
    return _dense_params(config, desc, model_type)
