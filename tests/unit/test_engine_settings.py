"""The engine's settings record: built once at the edge, the only thing the engine reads.

The tiny preset, 8-token blocks; nothing here loads a weight or allocates a pool.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvswap.config_load import load_config
from kvswap.data.layout import KVLayout
from kvswap.drive.settings import control_settings
from kvswap.engine.settings import EngineOptions, RemoteStoreSettings, engine_settings
from kvswap.errors import KvSwapError
from kvswap.model.kv_identity import kvswap_identity
from kvswap.model.loader import PRESET_SEED
from kvswap.model.weights_identity import weights_identity

TINY: dict[str, object] = {
    "kv_block_tokens": 8,
    "gpu_kv_capacity_blocks": 24,
    "cpu_kv_capacity_blocks": 16,
    "protected_sink_blocks": 1,
    "device": "cpu",
    "batch_invariant": True,
}


def test_the_record_holds_the_model_its_tiers_and_the_control_plane_settings() -> None:
    config = load_config(environ={}, overrides=TINY)
    settings = engine_settings(config, EngineOptions("tiny", cpu_threads=1))
    arch = settings.arch
    assert settings.options == EngineOptions("tiny", cpu_threads=1)
    assert settings.layout == KVLayout.for_model(arch.description, 8)
    block_bytes = settings.layout.block_bytes
    assert settings.capacities == config.tier_capacities(block_bytes)
    # The control plane's settings from the assembly the simulator uses too, rooted in
    # the one block fingerprint (the weights and the exact mode) and the model's positions.
    weights = weights_identity("tiny", preset_seed=PRESET_SEED)
    assert settings.control == control_settings(
        config, settings.capacities, block_bytes=block_bytes,
        model_fingerprint=kvswap_identity(
            arch, weights, batch_invariant=True, device_type="cpu", block_tokens=8,
            block_bytes=block_bytes,
        ).fingerprint(),
        max_sequence_tokens=arch.max_position_tokens,
    )  # fmt: skip
    assert settings.nvme is None and settings.remote_store is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.device = "cuda"  # type: ignore[misc]


def test_a_configured_store_is_in_the_record_under_the_control_planes_namespace() -> None:
    config = load_config(
        environ={},
        overrides={**TINY, "remote_url": "redis://127.0.0.1:1/0", "remote_timeout_ms": 20,
                   "remote_required": True},
    )  # fmt: skip
    settings = engine_settings(config, EngineOptions("tiny"))  # nothing is connected
    assert settings.control.remote is not None
    assert settings.remote_store == RemoteStoreSettings(
        url="redis://127.0.0.1:1/0", namespace=settings.control.remote.namespace,
        timeout_ms=20.0, ttl_s=0.0, max_inflight_chunks=64, required=True,
    )  # fmt: skip


def test_a_bad_policy_name_is_refused_before_the_engine_is_built() -> None:
    config = load_config(environ={}, overrides={**TINY, "gpu_eviction_policy": "no-such-policy"})
    with pytest.raises(KvSwapError, match="no-such-policy") as caught:
        engine_settings(config, EngineOptions("tiny"))
    assert "\n" not in str(caught.value)
