"""A secondary tier of one's own, through the `SecondaryTier` interface alone.

`DictTier` below (a dict of bytes, jobs done at submit) is all a user writes: the
adapter makes it the control plane's remote tier (`TierCopyEngine`), and the engine
takes it in place of the Redis store (`EngineOptions.secondary_tier`). No module of
`kvswap.control` knows it exists. Exact mode, tiny model: outputs are compared
digest for digest with a run that offloads nothing.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from kvswap.base.transfer import Direction, Priority, TransferChunk
from kvswap.config_load import load_config
from kvswap.data.layout import KVLayout
from kvswap.data.tiers.base import HostSlots, JobResult, SecondaryTier, TransferJob, job_result
from kvswap.data.tiers.copy_adapter import TierCopyEngine
from kvswap.engine.engine import Engine
from kvswap.engine.settings import EngineOptions, engine_settings
from kvswap.errors import KvSwapError
from kvswap.workload.request import Request, Workload


class DictTier(SecondaryTier):
    """Blocks in a dict (shared by every engine given it), copied at submit."""

    def __init__(self, host_slots: HostSlots, values: dict[bytes, bytes]) -> None:
        super().__init__(host_slots)
        self.values = values
        self.num_loaded_blocks = 0
        self._finished: dict[int, JobResult] = {}

    def lookup(self, keys: Sequence[bytes]) -> int:
        return next((i for i, key in enumerate(keys) if key not in self.values), len(keys))

    def submit_store(self, job: TransferJob) -> None:
        for key, slot in zip(job.keys, job.host_slots, strict=True):
            self.values.setdefault(key, self.host_slots[slot].tobytes())
        self._finish(job, failed=())

    def submit_load(self, job: TransferJob) -> None:
        failed = {key for key in job.keys if key not in self.values}
        for key, slot in zip(job.keys, job.host_slots, strict=True):
            if key not in failed:
                self.host_slots[slot] = np.frombuffer(self.values[key], np.uint8)
                self.num_loaded_blocks += 1
        self._finish(job, failed)

    def _finish(self, job: TransferJob, failed: Collection[bytes]) -> None:
        moved_bytes = (job.num_blocks - len(failed)) * self.block_bytes
        now_s = time.perf_counter()
        self._finished[job.job_id] = job_result(
            job, failed, transfer_bytes=moved_bytes, start_s=now_s, end_s=now_s
        )

    def get_finished_jobs(self) -> list[JobResult]:
        done, self._finished = list(self._finished.values()), {}
        return done

    def wait(self, job_id: int) -> JobResult:
        return self._finished.pop(job_id)

    def drain(self) -> None:
        pass  # every job finished at submit

    def close(self) -> None:
        pass

    def counters(self) -> Mapping[str, int]:
        return {"loaded_blocks": self.num_loaded_blocks}


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
    options = EngineOptions(model="tiny", secondary_tier=None if values is None else dict_tier)
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
        Engine(engine_settings(config, EngineOptions(model="tiny", secondary_tier=wrong)))
    message = str(refused.value)
    assert message.startswith("secondary_tier: the tier has 1 host slots") and "\n" not in message
