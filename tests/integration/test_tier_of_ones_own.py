"""A secondary tier of one's own, through the `SecondaryTier` interface alone.

`DictTier` (`tests/unit/dict_tier_support.py`: a dict of bytes, jobs done at
submit) is all a user writes: the adapter makes it a keyed tier of the control plane
(`TierCopyEngine`), and the engine takes it as its key-addressed tier, or as one more
tier below the Redis store (`EngineOptions.secondary_tiers`: each tier of the list its
own). No module of `kvswap.control` knows it exists. Exact mode, tiny model: outputs
are compared digest for digest with a run that offloads nothing.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvswap.base.tier import Tier
from kvswap.base.transfer import Direction, Priority, TransferChunk
from kvswap.config_load import load_config
from kvswap.control.policy import named_policy
from kvswap.data.disk_pool import DiskPool
from kvswap.data.layout import KVLayout
from kvswap.data.tiers.base import HostSlots, SecondaryTier
from kvswap.data.tiers.copy_adapter import TierCopyEngine
from kvswap.data.tiers.nvme_tier import NvmeTier
from kvswap.engine.engine import Engine
from kvswap.engine.settings import EngineOptions, engine_settings
from kvswap.errors import KvSwapError
from kvswap.workload.request import Request, Workload
from tests.redis_server import RedisServer, redis_server_missing
from tests.unit.dict_tier_support import SHARED_VALUES, DictTier, RaisingTier

# --- the adapter: chunks in, jobs to the tier, results back ------------------------------

BLOCK_BYTES = 64
KEYS = tuple(hashlib.sha256(f"own-{i}".encode()).digest() for i in range(4))


def chunk(tid: int, direction: Direction, host_slots: tuple[int, ...]) -> TransferChunk:
    n = len(host_slots)
    remote = tuple(range(n))
    loading = direction is Direction.REMOTE_TO_CPU
    src, dst = (remote, host_slots) if loading else (host_slots, remote)
    return TransferChunk(tid, direction, Priority.LOW, src, dst, n * BLOCK_BYTES, KEYS[:n])


def test_the_adapter_turns_chunks_into_jobs_and_failed_keys_into_failed_slots() -> None:
    host = np.arange(6 * BLOCK_BYTES, dtype=np.uint64).astype(np.uint8).reshape(6, BLOCK_BYTES)
    original = host.copy()
    values: dict[bytes, bytes] = {}
    with TierCopyEngine(DictTier(host, values)) as engine:
        engine.submit(chunk(1, Direction.CPU_TO_REMOTE, (0, 1)))  # store keys 0, 1
        assert [(r.transfer_id, r.success, r.failed_dst_slots) for r in engine.poll()] == [
            (1, True, ())
        ]
        assert engine.lookup(KEYS) == 2 and engine.available
        # Keys 0 and 1 load into host slots 5 and 4; keys 2 and 3 are not held.
        engine.submit(chunk(2, Direction.REMOTE_TO_CPU, (5, 4, 3, 2)))
        result = engine.wait(2)
        assert result.success and result.failed_dst_slots == (3, 2)  # only those untrusted
        assert np.array_equal(host[5], original[0]) and np.array_equal(host[4], original[1])
        engine.submit(chunk(3, Direction.REMOTE_TO_CPU, (0, 1, 2)))
        assert [r.failed_dst_slots for r in engine.wait_all()] == [(2,)]
        with pytest.raises(ValueError, match="not pending"):
            engine.wait(3)
        with pytest.raises(ValueError, match="not a remote direction"):
            engine.submit(TransferChunk(4, Direction.CPU_TO_GPU, Priority.HIGH, (0,), (0,), 64))
        with pytest.raises(ValueError, match="leave"):
            engine.submit(chunk(4, Direction.REMOTE_TO_CPU, (6,)))
    with pytest.raises(ValueError, match="closed"):
        engine.submit(chunk(5, Direction.REMOTE_TO_CPU, (0,)))


# --- the engine: a run restores its shared prompt from the tier -----------------------------

BASE: dict[str, object] = {
    "kv_block_tokens": 8,
    "protected_sink_blocks": 1,
    "gpu_kv_capacity_blocks": 14,  # four requests growing to 11 blocks each: preemptions
    "cpu_kv_capacity_blocks": 16,
    "swap_out_chunk_blocks": 2,
    "swap_in_chunk_blocks": 2,
    "max_num_seqs": 4,
    "device": "cpu",
    "batch_invariant": True,
}
SYSTEM = tuple((11 * i) % 240 + 3 for i in range(48))  # six full blocks shared by all


def workload() -> Workload:
    """Four requests that share the system prompt, each with its own question."""
    questions = [tuple(((n + 5) * 7 + i) % 200 + 1 for i in range(10)) for n in range(4)]
    requests = tuple(
        Request(n, 0.0, (*SYSTEM, *question), 30) for n, question in enumerate(questions)
    )
    return Workload(requests, "shared", 256)


def run(values: dict[bytes, bytes] | None, **settings: object) -> dict[str, Any]:
    def dict_tier(host_slots: HostSlots, _layout: KVLayout) -> SecondaryTier:
        assert values is not None
        return DictTier(host_slots, values)

    config = load_config(environ={}, overrides={**BASE, **settings})
    options = EngineOptions(model="tiny", secondary_tiers=() if values is None else (dict_tier,))
    with Engine(engine_settings(config, options)) as engine:
        return engine.run(workload()).to_json()


def test_an_engine_restores_blocks_from_a_tier_of_ones_own_bit_for_bit() -> None:
    reference = run(None, gpu_kv_capacity_blocks=64, cpu_kv_capacity_blocks=0)
    assert reference["bytes_gpu_to_cpu"] == 0  # nothing offloaded: the reference
    values: dict[bytes, bytes] = {}
    first = run(values)  # writes the finished requests' blocks to the tier
    assert 0 < len(values) <= first["remote"]["writes"]  # a key written twice is kept once
    assert first["preemptions"] > 0  # the pools were tight
    second = run(values)  # a new engine: its prompt's prefix comes from the tier
    assert second["prefix_hit_tokens"]["remote"] >= len(SYSTEM)
    assert second["remote"]["loaded_blocks"] > 0 and second["remote"]["fetch_failures"] == 0
    for summary in (first, second):
        assert summary["outputs_digest"] == reference["outputs_digest"]
        assert summary["requests_completed"] == 4


def test_a_tier_built_over_other_slots_is_refused_in_one_line() -> None:
    def wrong(host_slots: HostSlots, _layout: KVLayout) -> SecondaryTier:
        return DictTier(host_slots[:1], {})  # one slot of the pool's 16

    config = load_config(environ={}, overrides=BASE)
    with pytest.raises(KvSwapError) as refused:
        Engine(engine_settings(config, EngineOptions(model="tiny", secondary_tiers=(wrong,))))
    message = str(refused.value)
    assert message.startswith("secondary_tiers[0]: the tier has 1 host slots")
    assert "\n" not in message


# --- five tiers: GPU, pinned CPU, NVMe, the Redis store, and one's own below it -------------


@pytest.mark.skipif(redis_server_missing() is not None, reason="no redis-server")
def test_a_fifth_tier_below_the_store_serves_what_the_store_lost(tmp_path: Path) -> None:
    """The tier list of the engine: `DictTier` appended below the Redis store (and the
    NVMe slab, the pinned pool and the device above), a keyed tier of its own
    (`remote2`). Every stored block reaches both keyed tiers; once the store is
    emptied, a new engine's prefix misses there and comes from the tier below. No
    module of `kvswap.control` changed for it."""
    reference = run(None, gpu_kv_capacity_blocks=64, cpu_kv_capacity_blocks=0)
    values: dict[bytes, bytes] = {}
    nvme = {"nvme_dir": str(tmp_path), "nvme_kv_capacity_blocks": 32, "cpu_kv_capacity_blocks": 8}
    with RedisServer(tmp_path / "redis").start() as server:
        first = run(values, remote_url=server.url, **nvme)
        stored = server.client().dbsize()
        assert stored > 0 and len(values) == stored  # each block in both keyed tiers
        assert first["remote"]["tier0_written_blocks"] == stored
        server.client().flushall()
        second = run(values, remote_url=server.url, **nvme)
    assert first["preemptions"] > 0 and first["bytes_cpu_to_nvme"] > 0  # every tier in use
    assert list(tmp_path.glob("kvswap-*")) == []  # each engine's NVMe slab went at close
    # Each keyed tier is a tier of the control plane: the hits are the one below's.
    hits = second["prefix_hit_tokens"]
    assert hits["remote"] == 0 and hits["remote2"] >= len(SYSTEM)
    assert second["bytes_remote2_to_cpu"] > 0 and second["bytes_remote_to_cpu"] == 0
    remote = second["remote"]
    # Read only from the tier that holds each block (the store is never asked to load
    # what its lookup lacked), and the prefix goes back to the store at finish.
    assert remote["tier0_hits_blocks"] == remote["tier0_misses_blocks"] == 0
    assert remote["tier1_loaded_blocks"] == remote["loaded_blocks"] > 0
    assert remote["tier0_written_blocks"] >= len(SYSTEM) // 8
    for summary in (first, second):
        assert summary["outputs_digest"] == reference["outputs_digest"]
        assert summary["requests_completed"] == 4


def test_a_tier_that_raises_stops_the_engine_in_one_line_naming_it() -> None:
    """An exception is not a result: kvswap stops (the tier may still be writing into the
    pinned pool), with a line naming the entry, the call and the cause."""
    values: dict[bytes, bytes] = {}
    run(values)  # fills the dict through a well-behaved tier

    def raising(host_slots: HostSlots, _layout: KVLayout) -> SecondaryTier:
        return RaisingTier(host_slots, values)

    config = load_config(environ={}, overrides=BASE)
    options = EngineOptions(model="tiny", secondary_tiers=(raising,))
    with pytest.raises(KvSwapError) as stopped, Engine(engine_settings(config, options)) as engine:
        engine.run(workload())
    assert str(stopped.value) == (
        "secondary_tiers[0] (RaisingTier).submit_load raised OSError: the archive went away; "
        "a tier reports a failure as a failed key, never an exception (kvswap.data.tiers.base)"
    )


# --- each keyed tier written by the policy it asks for ---------------------------------------


class _PoolExtension(DictTier):
    """A tier that asks for what the pinned pool lets go only (`write_policy`)."""

    policy: str | None = "on_demote"

    @property
    def write_policy(self) -> str | None:
        return self.policy


def stored_keys(tier: DictTier) -> list[bytes]:
    return [key for job in tier.jobs_seen if not job.is_load for key in job.keys]


def run_two_tiers(**settings: object) -> tuple[dict[str, Any], DictTier, DictTier]:
    """A `DictTier` written as configured (on_finish), then a `_PoolExtension` below it."""
    built: list[DictTier] = []

    def shared(host_slots: HostSlots, _layout: KVLayout) -> SecondaryTier:
        built.append(DictTier(host_slots, {}))
        return built[-1]

    def extension(host_slots: HostSlots, _layout: KVLayout) -> SecondaryTier:
        built.append(_PoolExtension(host_slots, {}))
        return built[-1]

    config = load_config(environ={}, overrides={**BASE, **settings})
    options = EngineOptions(model="tiny", secondary_tiers=(shared, extension))
    with Engine(engine_settings(config, options)) as engine:
        summary = engine.run(workload()).to_json()
    return summary, built[0], built[1]


def test_each_keyed_tier_is_written_by_the_policy_it_asks_for() -> None:
    """With a pinned pool that never fills, the tier asking for `on_demote` is never
    written while the one above it gets every finished block; with a small pool it
    gets what the pool lets go."""
    reference = run(None, gpu_kv_capacity_blocks=64, cpu_kv_capacity_blocks=0)
    roomy, shared, extension = run_two_tiers(cpu_kv_capacity_blocks=64)
    assert stored_keys(extension) == [] and len(stored_keys(shared)) > 0
    assert roomy["preemptions"] > 0 and roomy["bytes_cpu_to_remote2"] == 0
    tight, shared, extension = run_two_tiers(cpu_kv_capacity_blocks=8)
    assert len(stored_keys(shared)) > 0 and len(stored_keys(extension)) > 0
    assert tight["bytes_cpu_to_remote2"] == len(stored_keys(extension)) * tight["block_bytes"]
    for summary in (roomy, tight):
        assert summary["outputs_digest"] == reference["outputs_digest"]


def test_a_write_policy_a_tier_cannot_ask_for_is_one_line() -> None:
    _PoolExtension.policy = "sometimes"
    try:
        with pytest.raises(KvSwapError) as refused:
            run_two_tiers()
    finally:
        _PoolExtension.policy = "on_demote"
    assert str(refused.value) == (
        "secondary_tiers[1] (_PoolExtension).write_policy = 'sometimes'; allowed: None (as "
        "tiers.remote_write_policy says), on_finish, on_demote, off"
    )


# --- holds: a keyed NVMe slab keeps a paused sequence's only copies -------------------------


class _NvmeTierWithoutHolds(NvmeTier):
    """The same slab, saying it cannot hold keys (as a shared store says)."""

    @property
    def holds_keys(self) -> bool:
        return False


class _NvmeTierOfNoSize(NvmeTier):
    """The same slab, saying it holds no block at all."""

    @property
    def capacity_blocks(self) -> int:
        return 0


def paused_run(
    directory: Path,
    *,
    holds: bool,
    local: bool = False,
    kind: type[NvmeTier] | None = None,
    **settings: object,
) -> tuple[dict[str, Any], NvmeTier]:
    """Eight requests in a 30-block device pool and a 6-block pinned pool: preempted
    sequences' blocks are demoted on to a 6-slot NVMe slab by key (on_demote); `local`:
    the engine's own (`SecondaryTier.local`); `kind`: a slab of that class."""
    tiers: list[NvmeTier] = []

    def slab(host_slots: HostSlots, _layout: KVLayout) -> SecondaryTier:
        cls = kind or (NvmeTier if holds else _NvmeTierWithoutHolds)
        disk = DiskPool(directory, host_slots.shape[1], 6)
        tier = cls(host_slots, disk, policy=named_policy(Tier.NVME, "lru"), local=local)
        tiers.append(tier)
        return tier

    rng = random.Random(5)
    requests = tuple(
        Request(n, 0.0, tuple(rng.randrange(1, 250) for _ in range(40)), 40) for n in range(8)
    )
    settings = {"cpu_kv_capacity_blocks": 6, "gpu_kv_capacity_blocks": 30, "max_num_seqs": 8,
                "remote_write_policy": "on_demote", **settings}  # fmt: skip
    config = load_config(environ={}, overrides={**BASE, **settings})
    with Engine(engine_settings(config, EngineOptions(model="tiny", secondary_tiers=(slab,)))) as e:
        summary = e.run(Workload(requests, "paused", 256)).to_json()
    return summary, tiers[0]


def test_a_tier_that_holds_keys_keeps_every_paused_sequences_blocks(tmp_path: Path) -> None:
    """Without holds the slab evicts blocks whose only copy it had (lost: recomputed);
    with them (`SecondaryTier.hold`, asked by the control plane) it refuses newer
    writes instead, no block is lost, and every hold is released by the end."""
    plain, plain_tier = paused_run(tmp_path, holds=False)
    held, held_tier = paused_run(tmp_path, holds=True)
    assert plain["lost_blocks"] > 0 and plain_tier.stats().misses_blocks > 0
    stats = held_tier.stats()
    assert held["lost_blocks"] == 0 and stats.misses_blocks == 0 and stats.hits_blocks > 0
    assert stats.no_room_blocks > 0 and held_tier.num_held_keys == 0
    assert held["outputs_digest"] == plain["outputs_digest"]
    assert list(tmp_path.iterdir()) == []  # each slab went with its engine


def test_the_engines_own_slab_by_key_is_its_nvme_tier(tmp_path: Path) -> None:
    """The slab opened `local` (the engine's own): the engine reports it as its `nvme`
    tier (its size and occupancy too), remembers the blocks only it holds, and drops the
    copies it says it evicted; outputs as without it. Beside the NVMe slab the engine
    opens itself it is refused in one line, as is a size it cannot have."""
    held, _ = paused_run(tmp_path, holds=True)
    own, tier = paused_run(tmp_path, holds=True, local=True)
    assert own["outputs_digest"] == held["outputs_digest"] and own["lost_blocks"] == 0
    stats = tier.stats()
    assert own["bytes_cpu_to_nvme"] == stats.written_blocks * tier.block_bytes > 0
    assert own["bytes_nvme_to_cpu"] == stats.hits_blocks * tier.block_bytes > 0
    assert own["bytes_cpu_to_remote"] == 0 and own["prefix_hit_tokens"].get("remote", 0) == 0
    assert 0 < own["evictions_by_reason"]["nvme_discard"] <= stats.evicted_blocks
    assert own["capacity_blocks_by_tier"]["nvme"] == own["peak_blocks_by_tier"]["nvme"] == 6
    with pytest.raises(KvSwapError) as refused:
        paused_run(tmp_path, holds=True, local=True, nvme_kv_capacity_blocks=8,
                   nvme_dir=str(tmp_path))  # fmt: skip
    assert str(refused.value) == (
        "secondary_tiers[0]: a second tier of this process (local) beside the NVMe slab "
        "(nvme_kv_capacity_blocks > 0); allowed: one, the NVMe slab by key"
    )
    with pytest.raises(KvSwapError) as refused:
        paused_run(tmp_path, holds=True, local=True, kind=_NvmeTierOfNoSize)
    assert str(refused.value) == (
        "secondary_tiers[0] (_NvmeTierOfNoSize).capacity_blocks = 0; allowed: None (not "
        "known) or an integer >= 1"
    )
    assert list(tmp_path.iterdir()) == []


# --- a tier named in the configuration: `secondary_tiers` / --secondary-tiers ---------------

SUPPORT = "tests.unit.dict_tier_support"


def test_a_tier_named_by_import_path_in_the_config_serves_a_second_engine() -> None:
    SHARED_VALUES.clear()
    reference = run(None, gpu_kv_capacity_blocks=64, cpu_kv_capacity_blocks=0)
    first = run(None, secondary_tiers=f"{SUPPORT}:shared_tier")
    assert 0 < len(SHARED_VALUES) <= first["remote"]["writes"]
    second = run(None, secondary_tiers=f" {SUPPORT}:shared_tier ")  # spaces are trimmed
    assert second["prefix_hit_tokens"]["remote"] >= len(SYSTEM)
    assert first["outputs_digest"] == second["outputs_digest"] == reference["outputs_digest"]
    SHARED_VALUES.clear()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("dict_tier_support", "(from command line): 'dict_tier_support' is not an import path"),
        (f"{SUPPORT}:shared_tier,", "'' is not an import path; allowed: package.module:factory"),
        ("no_such_module_xyz:tier", "= 'no_such_module_xyz:tier': cannot import"),
        (f"{SUPPORT}:missing", f"= '{SUPPORT}:missing': {SUPPORT}.missing is nothing"),
        (f"{SUPPORT}:SHARED_VALUES", "is a dict, not callable"),
        (f"{SUPPORT}:not_a_tier", "[0]: the factory returned a dict, not a SecondaryTier"),
        (f"{SUPPORT}:failing_tier", "[0]: building the tier failed (OSError: no room on"),
    ],
)  # fmt: skip
def test_a_wrong_tier_path_is_one_line(value: str, message: str) -> None:
    with pytest.raises(KvSwapError) as refused:
        run(None, secondary_tiers=value)
    text = str(refused.value)
    assert text.startswith("secondary_tiers") and message in text and "\n" not in text
