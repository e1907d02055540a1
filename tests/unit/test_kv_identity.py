"""THE identity of a block's bytes (kvswap.model.kv_identity): every field that decides a
K or V byte changes the namespace, alone; nothing else does."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import LlamaConfig, MistralConfig, Qwen2Config

from kvswap.errors import KvSwapError
from kvswap.model.arch_config import LinearRopeScaling, Llama3RopeScaling, ModelArchConfig
from kvswap.model.description import ModelDescription, RopeSpec
from kvswap.model.kv_identity import (
    NOT_KV_CONFIG_KEYS,
    KvIdentity,
    Shard,
    config_json,
    engine_config_fields,
    hf_config_fields,
    kvswap_identity,
)
from kvswap.model.loader import PRESETS
from kvswap.model.presets import preset_description
from kvswap.model.weights_identity import preset_weights_identity, weights_identity
from tests.unit.test_weights_identity import checkpoint, tensors

TINY = PRESETS["tiny"]
WEIGHTS = preset_weights_identity("tiny", 0)


def identity(**changes: Any) -> KvIdentity:
    base = KvIdentity(
        compute="kvswap/exact/cpu", weights=WEIGHTS, config=config_json({"a": 1}),
        kv_dtype="fp32", layout="kvswap-block/planes=2", block_tokens=16, block_bytes=4096,
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


def engine(arch: ModelArchConfig = TINY, weights: str | None = WEIGHTS, **changes: Any) -> str:
    options: dict[str, Any] = {
        "batch_invariant": True, "device_type": "cpu", "block_tokens": 16, "block_bytes": 4096,
    }  # fmt: skip
    return kvswap_identity(arch, weights, **{**options, **changes}).fingerprint()


# --- the record -----------------------------------------------------------------------


def test_every_field_of_the_identity_changes_the_fingerprint_alone() -> None:
    changed: dict[str, object] = {
        "compute": "kvswap/fast/cpu",
        "weights": preset_weights_identity("tiny", 1),
        "config": config_json({"a": 2}),
        "kv_dtype": "bf16",
        "layout": "kvswap-block/planes=1",
        "block_tokens": 32,
        "block_bytes": 8192,
        "shard": Shard(tp_rank=1, tp_size=2),
    }
    assert set(changed) == {f.name for f in dataclasses.fields(KvIdentity)}  # none forgotten
    seen = {identity().fingerprint()}
    for name, value in changed.items():
        fingerprint = identity(**{name: value}).fingerprint()
        assert fingerprint not in seen, name
        seen.add(fingerprint)
    assert identity(weights=None).fingerprint() not in seen  # unknown weights are not these


def test_every_rank_and_size_of_the_shard_is_part_of_it() -> None:
    shards = [
        Shard(), Shard(tp_size=2), Shard(tp_rank=1, tp_size=2), Shard(pp_size=2),
        Shard(pp_rank=1, pp_size=2), Shard(cp_size=2), Shard(cp_rank=1, cp_size=2),
    ]  # fmt: skip
    assert len({identity(shard=shard).fingerprint() for shard in shards}) == len(shards)
    with pytest.raises(KvSwapError, match=r"tp_rank=2 of tp_size=2; allowed"):
        Shard(tp_rank=2, tp_size=2)
    with pytest.raises(KvSwapError, match="pp_rank"):
        Shard(pp_rank=-1)


def test_the_namespace_is_rooted_in_the_fingerprint_and_the_block_size() -> None:
    namespace = identity().namespace()
    assert namespace.model_fingerprint == identity().fingerprint()
    assert namespace.block_tokens == 16


def test_the_fingerprint_is_equal_across_processes() -> None:
    code = (
        "from kvswap.model.kv_identity import kvswap_identity as k;"
        "from kvswap.model.loader import PRESETS as P;"
        "print(k(P['tiny'], 'w', batch_invariant=True, device_type='cpu', block_tokens=16,"
        " block_bytes=4096).fingerprint())"
    )
    expected = engine(weights="w")
    for seed in ("0", "12345"):  # str hashing differs per process; the digest must not
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
            timeout=60,
        )  # fmt: skip
        assert result.stdout.strip() == expected


# --- kvswap's own engine: every field its K/V path reads ----------------------------------


def test_every_field_of_the_decoder_config_changes_the_engine_identity_alone() -> None:
    description = TINY.description
    changed_arch: dict[str, object] = {
        "rms_norm_eps": TINY.rms_norm_eps * 10,
        "rope_scaling": LinearRopeScaling(factor=2.0),
        "qkv_bias": not TINY.qkv_bias,
        "o_bias": not TINY.o_bias,
        "mlp_bias": not TINY.mlp_bias,
        "tie_word_embeddings": not TINY.tie_word_embeddings,
        "max_position_tokens": TINY.max_position_tokens + 1,
        "sliding_window_tokens": 64,
    }
    changed_description: dict[str, object] = {
        "model_type": "qwen2",
        "architecture": "Qwen2ForCausalLM",
        "attention": "mha",
        "num_layers": description.num_layers + 1,
        "num_attention_heads": description.num_attention_heads * 2,
        "num_kv_heads": description.num_kv_heads * 2,
        "head_dim": description.head_dim * 2,
        "hidden_size": description.hidden_size * 2,
        "intermediate_size": (description.intermediate_size or 0) + 1,
        "vocab_size": (description.vocab_size or 0) + 1,
        "kv_dtype": "bf16",
        "rope": RopeSpec(theta=description.rope.theta * 2),
    }
    # Not the model: what it is called, how big it is said to be, the dtype it was saved
    # in (the KV dtype it runs in is `kv_dtype`), and MLA (the decoder runs none).
    not_identity = {"name", "num_params", "num_params_is_estimate", "checkpoint_dtype", "mla"}
    arch_fields = {f.name for f in dataclasses.fields(ModelArchConfig)} - {"description"}
    assert set(changed_arch) == arch_fields
    assert set(changed_description) | not_identity == {
        f.name for f in dataclasses.fields(ModelDescription)
    }
    seen = {engine()}
    for name, value in changed_arch.items():
        fingerprint = engine(dataclasses.replace(TINY, **{name: value}))
        assert fingerprint not in seen, name
        seen.add(fingerprint)
    for name, value in changed_description.items():
        changed = dataclasses.replace(description, **{name: value})
        fingerprint = engine(dataclasses.replace(TINY, description=changed))
        assert fingerprint not in seen, name
        seen.add(fingerprint)
    for name in not_identity - {"mla"}:
        value = {"name": "other", "num_params": 1, "num_params_is_estimate": True,
                 "checkpoint_dtype": "bf16"}[name]  # fmt: skip
        changed = dataclasses.replace(description, **{name: value})
        assert engine(dataclasses.replace(TINY, description=changed)) == engine(), name
    llama3 = Llama3RopeScaling(8.0, 1.0, 4.0, 8192)
    scaled = [engine(dataclasses.replace(TINY, rope_scaling=s))
              for s in (llama3, dataclasses.replace(llama3, high_freq_factor=5.0))]  # fmt: skip
    assert len(set(scaled) | seen) == len(seen) + 2  # a scaling's every parameter counts


def test_the_engine_identity_names_the_weights_the_mode_the_device_and_the_block(
    tmp_path: Path,
) -> None:
    base = weights_identity(str(checkpoint(tmp_path / "base", tensors(0))), preset_seed=0)
    tuned = weights_identity(str(checkpoint(tmp_path / "tuned", tensors(1))), preset_seed=0)
    fingerprints = {
        engine(weights=base), engine(weights=tuned), engine(batch_invariant=False),
        engine(device_type="cuda"), engine(block_tokens=32), engine(block_bytes=8192),
        engine(weights=None),
    }  # fmt: skip
    assert len(fingerprints | {engine()}) == 8


def test_a_simulation_names_its_blocks_by_the_architecture_alone() -> None:
    tiny = preset_description("tiny")
    simulated = kvswap_identity(
        tiny, None, batch_invariant=True, device_type="simulated", block_tokens=16,
        block_bytes=4096,
    )  # fmt: skip
    assert simulated.compute == "simulated" and simulated.weights is None
    assert simulated.config == config_json(engine_config_fields(tiny))


# --- a Hugging Face config (vLLM, SGLang, transformers) ------------------------------------


@pytest.mark.parametrize("config_class", [LlamaConfig, Qwen2Config, MistralConfig])
def test_every_key_of_a_hf_config_but_the_listed_ones_changes_the_identity(
    config_class: Any,
) -> None:
    raw = config_class().to_dict()
    base = config_json(hf_config_fields(raw))
    for key, value in raw.items():
        changed = config_json(hf_config_fields({**raw, key: _other(value)}))
        if key.startswith("_") or key in NOT_KV_CONFIG_KEYS:
            assert changed == base, key
        else:
            assert changed != base, key
    assert config_json(hf_config_fields({**raw, "a_new_field": 1})) != base


def test_the_listed_keys_are_dropped_in_nested_configs_too() -> None:
    raw = {"text_config": {"rms_norm_eps": 1e-5, "eos_token_id": 2}, "_name_or_path": "/m"}
    assert hf_config_fields(raw) == {"text_config": {"rms_norm_eps": 1e-5}}
    assert config_json({"eps": 1e-5}) != config_json({"eps": 1e-6})  # every digit counts


def test_a_config_value_json_cannot_hold_is_a_one_line_error() -> None:
    with pytest.raises(KvSwapError, match="cannot name KV"):
        config_json({"rms_norm_eps": float("nan")})


def _other(value: object) -> object:
    """A value of the same kind that differs from `value`."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, dict):
        return {**value, "other": 1}
    if isinstance(value, list):
        return [*value, 1]
    return 1  # None
