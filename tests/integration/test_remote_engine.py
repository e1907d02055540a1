"""The engine with a shared remote tier on a real redis-server (started on loopback).

Exact mode, tiny model: every run's outputs are compared with a run without
the remote tier, digest for digest. The store is the only thing that changes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from redis import Redis
from safetensors.torch import save_file

from kvswap.config_load import load_config
from kvswap.engine.engine import Engine
from kvswap.engine.settings import EngineOptions, engine_settings
from kvswap.errors import KvSwapError
from kvswap.model.loader import load_model
from kvswap.workload.request import Request, Workload
from tests.integration.remote_store_support import runs_sharing_a_prefix
from tests.redis_server import RedisServer, redis_server_missing
from tests.unit.test_llama import TINY_HF_CONFIG

pytestmark = pytest.mark.skipif(redis_server_missing() is not None, reason="no redis-server")

BASE: dict[str, object] = {
    "kv_block_tokens": 8,
    "protected_sink_blocks": 1,
    "gpu_kv_capacity_blocks": 32,
    "cpu_kv_capacity_blocks": 32,
    "max_num_seqs": 2,
    "device": "cpu",
    "batch_invariant": True,
}
SYSTEM = tuple((11 * i) % 240 + 3 for i in range(48))  # six full blocks shared by all


def workload(variant: int, salt: str | None = None) -> Workload:
    """Two requests that share the system prompt, each with its own question."""
    questions = [tuple(((n + variant + 5) * 7 + i) % 200 + 1 for i in range(10)) for n in (0, 1)]
    requests = tuple(
        Request(n, 0.0, (*SYSTEM, *question), 6, cache_salt=salt)
        for n, question in enumerate(questions)
    )
    return Workload(requests, f"shared-{variant}", 256)


def run(load: Workload, **settings: object) -> dict[str, Any]:
    config = load_config(environ={}, overrides={**BASE, **settings})
    with Engine(engine_settings(config, EngineOptions(model="tiny"))) as engine:
        return engine.run(load).to_json()


def test_a_second_process_restores_the_shared_prompt_from_the_store(tmp_path: Path) -> None:
    """Two `kvswap run` processes in sequence: the second's prefix hits come from
    the remote tier, and both outputs equal runs without the tier."""
    with RedisServer(tmp_path / "redis").start() as server:
        alone, first, second = runs_sharing_a_prefix(server.url)
    assert first["outputs_digest"] == second["outputs_digest"] == alone["outputs_digest"]
    assert first["prefix_hit_tokens"]["remote"] == 0 and first["remote"]["writes"] > 0
    assert second["prefix_hit_tokens"]["remote"] >= 32  # the system prompt's four blocks
    assert second["remote"]["hit_tokens"] == second["prefix_hit_tokens"]["remote"]


def filled_store(redis_server: RedisServer) -> tuple[dict[str, Any], Redis, list[bytes]]:
    """A run without the tier (the reference), then the same run filling the store: the
    reference summary, a plain client of the store and its keys (at least two)."""
    reference = run(workload(0))
    run(workload(0), remote_url=redis_server.url)
    plain = redis_server.client()
    names = sorted(plain.keys("*"))
    assert len(names) >= 2
    return reference, plain, names


def test_a_corrupt_value_is_detected_recomputed_and_changes_nothing(
    redis_server: RedisServer,
) -> None:
    reference, plain, names = filled_store(redis_server)
    for name in names[:3]:
        plain.setrange(name, 40, b"\xff\x00\xff")  # payload bytes: the CRC no longer holds
    again = run(workload(0), remote_url=redis_server.url)
    assert again["outputs_digest"] == reference["outputs_digest"]
    assert again["remote"]["corrupt"] >= 1
    assert again["recomputed_tokens"] > 0 or again["remote"]["fetch_failures"] > 0


def test_values_rotated_between_keys_are_rejected_and_change_nothing(
    redis_server: RedisServer,
) -> None:
    # Regression: a value carried its layout and its payload's CRC but not its key,
    # so a well-formed value found under another key (RENAME, values swapped by an
    # operator's script) was restored as that block's KV and changed the outputs.
    reference, plain, names = filled_store(redis_server)
    values = [plain.get(name) for name in names]
    for name, value in zip(names, values[1:] + values[:1], strict=True):
        assert isinstance(value, bytes)
        plain.set(name, value)  # every key now holds the next key's (intact) value
    again = run(workload(0), remote_url=redis_server.url)
    assert again["outputs_digest"] == reference["outputs_digest"]
    remote = again["remote"]
    assert remote["corrupt"] > 0 and remote["corrupt"] == remote["fetch_failures"]
    # The lookups found every key, but not one value was served: every token the
    # store seemed to hold was computed again, and none counts as a hit.
    assert remote["found_blocks"] > 0 and remote["hits_blocks"] == 0
    assert remote["hit_tokens"] == 0
    assert sum(again["prefix_hit_tokens"].values()) == 0  # served from nowhere
    assert again["recomputed_tokens"] >= remote["found_blocks"] * BASE["kv_block_tokens"]


def test_a_store_killed_mid_run_changes_no_output(tmp_path: Path) -> None:
    reference = run(workload(0))
    server = RedisServer(tmp_path / "redis").start()
    config = load_config(environ={}, overrides={**BASE, "remote_url": server.url})
    with Engine(engine_settings(config, EngineOptions(model="tiny"))) as engine:
        engine.run(workload(0))  # the store holds the shared prompt now
        server.kill()
        after = engine.run(workload(10)).to_json()
    assert after["outputs_digest"] == run(workload(10))["outputs_digest"]
    assert after["remote"]["outages"] >= 1
    assert reference["requests_completed"] == 2


def test_tenants_with_different_salts_share_nothing(redis_server: RedisServer) -> None:
    run(workload(0, salt="tenant-a"), remote_url=redis_server.url)
    other = run(workload(0, salt="tenant-b"), remote_url=redis_server.url)
    same = run(workload(0, salt="tenant-a"), remote_url=redis_server.url)
    assert other["prefix_hit_tokens"]["remote"] == 0
    assert same["prefix_hit_tokens"]["remote"] > 0


def test_a_password_works_and_its_absence_is_one_line(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis", password="s3cret-pw").start() as server:
        assert "s3cret-pw" in server.url
        with_password = run(workload(0), remote_url=server.url, remote_required=True)
        bare = server.url.replace(":s3cret-pw@", "@").replace("//@", "//")
        with pytest.raises(KvSwapError) as refused:
            run(workload(0), remote_url=bare, remote_required=True)
    assert with_password["requests_completed"] == 2
    message = str(refused.value)
    assert "\n" not in message and "password" in message and "s3cret-pw" not in message


def test_an_unreachable_store_is_an_error_only_when_required(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis").start()
    url = server.url
    server.stop()
    with pytest.raises(KvSwapError) as refused:
        run(workload(0), remote_url=url, remote_required=True)
    assert "\n" not in str(refused.value)
    alone = run(workload(0), remote_url=url)  # one warning, the tier off
    assert alone["outputs_digest"] == run(workload(0))["outputs_digest"]


def _checkpoint(directory: Path, **config: object) -> str:
    """The tiny preset's weights saved as a checkpoint whose config.json differs from the
    preset's only in `config`."""
    model, _ = load_model("tiny", None, torch.device("cpu"))
    directory.mkdir()
    tensors = {name: t.clone() for name, t in model.state_dict().items()}
    save_file(tensors, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps({**TINY_HF_CONFIG, **config}))
    return str(directory)


def test_checkpoints_of_one_weights_and_another_config_field_share_no_block(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Issue 30, finding 2: the same weights under another norm epsilon compute other KV.
    Through one store, the second model's output is its own, and it found nothing."""

    def run_model(model: str, **settings: object) -> dict[str, Any]:
        config = load_config(environ={}, overrides={**BASE, **settings})
        with Engine(engine_settings(config, EngineOptions(model=model))) as engine:
            return engine.run(workload(0)).to_json()

    first = _checkpoint(tmp_path / "a", rms_norm_eps=1e-6)
    other = _checkpoint(tmp_path / "a-eps", rms_norm_eps=1e-1)
    alone = run_model(other)
    assert alone["outputs_digest"] != run_model(first)["outputs_digest"]  # it matters
    filled = run_model(first, remote_url=redis_server.url)
    assert filled["remote"]["writes"] > 0
    shared = run_model(other, remote_url=redis_server.url)
    assert shared["prefix_hit_tokens"]["remote"] == 0
    assert shared["outputs_digest"] == alone["outputs_digest"]
    again = run_model(first, remote_url=redis_server.url)  # the same model still hits
    assert again["prefix_hit_tokens"]["remote"] > 0
