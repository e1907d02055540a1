"""Narrated scenarios at vLLM's manager level: kvswap's ranking of the host tier.

    python manager_scenarios.py SCRATCH_DIR

Runs against whichever vLLM the interpreter has (0.32 in .venv-vllm, 0.33 in
.venv-vllm033), driving vLLM's own managers the way its offloading scheduler
does (on_new_request, prepare_store / complete_store, lookup, on_schedule_end,
on_request_finished); no model, no worker. Chunk k<i> of a request ends at
token 32 * (i + 1). Each scenario runs once with kvswap's ranking and once
with vLLM's own LRU (or kvswap's without the feature), and reports what each
evicted; the test compares them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from kvswap.base.eviction_policy import PolicyOptions
from kvswap.control.policy_lru import LruPolicy
from kvswap.data.tiers.nvme_tier import NvmeTier
from kvswap.integrations.vllm.cache_policy import HostRanking, KvswapCachePolicy
from kvswap.integrations.vllm.host_report import HostReport
from kvswap.integrations.vllm.manager import (
    KvswapHostManager,
    KvswapPrimaryTier,
    KvswapTieringManager,
    SharedHostRows,
)
from kvswap.integrations.vllm.tiers import KvswapNvmeTier
from tests.vllm_scripts.common import emit

TOKENS_PER_CHUNK = 32
ROW_BYTES = 4096  # one host chunk (the tier scenario moves real bytes to a real slab)


def key(name: str) -> Any:
    return make_offload_key(hashlib.sha256(name.encode()).digest(), 0)


NAMES: dict[bytes, str] = {}


def chain(prefix: str, count: int) -> list[Any]:
    keys = [key(f"{prefix}{i}") for i in range(count)]
    NAMES.update({bytes(k): f"{prefix}{i}" for i, k in enumerate(keys)})
    return keys


def names(keys: Any) -> list[str]:
    return [NAMES[bytes(k)] for k in keys]


def request(manager: Any, req_id: str, keys: list[Any]) -> Any:
    """A request whose chunks are `keys`, in prefix order (positions as vLLM records them)."""
    context = ReqContext(req_id=req_id)
    for index, offload_key in enumerate(keys):
        context.set_offload_key_position(offload_key, (index + 1) * TOKENS_PER_CHUNK)
    manager.on_new_request(context)
    return context


def store(manager: Any, context: Any, keys: list[Any]) -> list[str] | None:
    """prepare_store, then the worker's copy finishes: the chunks it evicted (None: the
    tier could not make room)."""
    output = manager.prepare_store(keys, context)
    if output is None:
        return None
    manager.complete_store(output.keys_to_store, context)
    return names(output.evicted_keys)


def step(manager: Any) -> None:
    manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))


def host_manager(num_chunks: int, policy: str, **options: Any) -> Any:
    """kvswap's host manager, or vLLM's own CPU manager with its LRU ("vllm-lru")."""
    if policy == "vllm-lru":
        return CPUOffloadingManager(num_chunks=num_chunks, cache_policy="lru")
    ranking = HostRanking(
        policy_name=policy,
        options=PolicyOptions(**options),
        protected_sink_blocks=1,
        tokens_per_chunk=TOKENS_PER_CHUNK,
    )
    report = HostReport(num_chunks, ROW_BYTES)
    return KvswapHostManager(
        num_chunks, KvswapCachePolicy(num_chunks, ranking), report, enable_events=False
    )


def tail_first(policy: str) -> dict[str, Any]:
    """A 4-chunk tier holds request r1's chain a0..a3; r1 finishes. r2 stores two new
    chunks: which two of the chain go, and how much of it can still be found (a lookup
    stops at the first miss)?"""
    manager = host_manager(4, policy)
    a = chain("a", 4)
    r1 = request(manager, "r1", a)
    store(manager, r1, a)
    manager.on_request_finished(r1)
    r2 = request(manager, "r2", chain("b", 2))
    evicted = store(manager, r2, chain("b", 2))
    r3 = request(manager, "r3", a)
    usable = 0
    for offload_key in a:
        if manager.lookup(offload_key, r3).name != "HIT":
            break
        usable += 1
    return {"evicted": evicted, "usable_prefix_chunks": usable}


def sinks_kept(policy: str) -> dict[str, Any]:
    """r1 (still running) stored s0..s3 in a 4-chunk tier; s0 is its sink (the first
    protected_sink_blocks = 1 chunk). r2 stores one new chunk: which chunk goes?"""
    manager = host_manager(4, policy)
    s = chain("s", 4)
    r1 = request(manager, "r1", s)
    store(manager, r1, s)
    r2 = request(manager, "r2", chain("n", 1))
    return {"evicted": store(manager, r2, chain("n", 1))}


#: What the tiers read of vLLM's offloading spec, for a model named "scenario".
SCENARIO_SPEC = SimpleNamespace(
    config=SimpleNamespace(
        model=SimpleNamespace(name="scenario", dtype="float32"),
        parallel=SimpleNamespace(world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1),
    ),
    tokens_per_block=(TOKENS_PER_CHUNK,),
    blocks_per_chunk=1,
)


def residency(scratch: Path, min_residency_steps: int) -> dict[str, Any]:
    """A 2-chunk host tier over kvswap's NVMe slab. r1 stores c0 (cascaded to NVMe) and
    finishes; r2 stores c1, c2, which pushes c0 out of the host tier, and finishes. r3
    finds c0 on NVMe: vLLM promotes it into the host tier (r3 holds it). r4 then needs
    both host chunks. Within c0's residency window that is refused; min_residency_steps
    scheduler steps later it is not."""
    ranking = HostRanking(
        options=PolicyOptions(min_residency_steps=min_residency_steps),
        protected_sink_blocks=0,
        tokens_per_chunk=TOKENS_PER_CHUNK,
    )
    policy = KvswapCachePolicy(2, ranking)
    rows = SharedHostRows(scratch / f"host-{min_residency_steps}", 2, ROW_BYTES)
    primary = KvswapPrimaryTier(2, rows, policy, HostReport(2, ROW_BYTES), enable_events=False)
    nvme = KvswapNvmeTier(
        SCENARIO_SPEC,
        primary.get_kv_memoryview(),
        "kvswap-nvme",
        nvme_dir=str(scratch),
        nvme_kv_capacity_bytes=8 * ROW_BYTES,
    )
    nvme.copied_below = policy.copied_below
    manager = KvswapTieringManager(primary_tier=primary, secondary_tiers=[nvme])

    def settle() -> None:
        nvme.drain_jobs()
        step(manager)

    c = chain("c", 3)
    try:
        r1 = request(manager, "r1", c[:1])
        store(manager, r1, c[:1])
        settle()
        manager.on_request_finished(r1)
        r2 = request(manager, "r2", c[1:])
        evicted_by_r2 = store(manager, r2, c[1:])
        settle()
        manager.on_request_finished(r2)
        r3 = request(manager, "r3", c[:1])
        first = manager.lookup(c[0], r3).name  # a promotion starts
        settle()  # the promotion is submitted
        settle()  # ... and lands: c0 is brought back
        promoted = manager.lookup(c[0], r3).name
        step_brought_back = manager.primary_tier.clock.step
        r4 = request(manager, "r4", chain("d", 2))
        within_window = store(manager, r4, chain("d", 2))
        for _ in range(min_residency_steps):
            step(manager)
        after_window = store(manager, r4, chain("d", 2)) if within_window is None else None
        counters = dict(nvme.counters())
    finally:
        manager.shutdown()
    return {
        "evicted_by_r2": evicted_by_r2,
        "lookup_before_promotion": first,
        "lookup_after_promotion": promoted,
        "steps_at_promotion": step_brought_back,
        "store_within_window": within_window,
        "store_after_window": after_window,
        "nvme": counters,
    }


class _SlabWithoutHolds(NvmeTier):
    """The slab, saying it cannot hold keys: how the adapter ran before holds."""

    @property
    def holds_keys(self) -> bool:
        return False


def hit_held(scratch: Path, holds: bool) -> dict[str, Any]:
    """A 2-chunk host tier over a 3-slot NVMe slab holding c0, c1, c2 (c0 the oldest,
    no longer in the host tier). r3 looks c0 up: a HIT, whose promotion vLLM submits
    at the step's end. In the same step r4 stores d0, whose cascade reaches the slab
    first and needs a slot: the slab's least recently used key is c0. Held for r3
    (`holds`), c0 stays and c1 goes; otherwise c0 goes and the promotion fails."""
    ranking = HostRanking(protected_sink_blocks=0, tokens_per_chunk=TOKENS_PER_CHUNK)
    policy = KvswapCachePolicy(2, ranking)
    rows = SharedHostRows(scratch / f"held-{holds}", 2, ROW_BYTES)
    primary = KvswapPrimaryTier(2, rows, policy, HostReport(2, ROW_BYTES), enable_events=False)
    nvme = KvswapNvmeTier(
        SCENARIO_SPEC, primary.get_kv_memoryview(), "kvswap-nvme", nvme_dir=str(scratch),
        nvme_kv_capacity_bytes=3 * ROW_BYTES,
    )  # fmt: skip
    if not holds:
        nvme.tier.__class__ = _SlabWithoutHolds
    nvme.copied_below = policy.copied_below
    manager = KvswapTieringManager(primary_tier=primary, secondary_tiers=[nvme])

    def settle() -> None:
        nvme.drain_jobs()
        step(manager)

    c = chain(f"h{int(holds)}c", 3)
    try:
        for number, keys in enumerate((c[:1], c[1:]), start=1):
            stored = request(manager, f"r{number}", keys)
            store(manager, stored, keys)
            settle()
            manager.on_request_finished(stored)
        r3 = request(manager, "r3", c[:1])
        found = manager.lookup(c[0], r3).name  # a promotion, submitted at the step's end
        r4 = request(manager, "r4", chain(f"h{int(holds)}d", 1))
        store(manager, r4, chain(f"h{int(holds)}d", 1))  # its cascade goes to the slab now
        nvme.drain_jobs()
        held_then = nvme.num_held_keys
        settle()  # the promotion is submitted
        settle()  # ... and lands, or fails
        after = manager.lookup(c[0], r3).name
        manager.on_request_finished(r3)
        manager.on_request_finished(r4)
        settle()
        counters = dict(nvme.counters())
        held_at_end = nvme.num_held_keys
    finally:
        manager.shutdown()
    return {"lookup": found, "held_while_promoting": held_then, "lookup_after": after,
            "held_at_end": held_at_end, "nvme": counters}  # fmt: skip


def arc_adapts() -> dict[str, Any]:
    """kvswap's ARC ranking the host tier through the adapter: a 2-chunk tier stores
    x0, x1, then y0 (x0 goes: a ghost in B1), then x0 again: a B1 ghost hit grows
    ARC's target for its recency list from 0."""
    manager = host_manager(2, "arc")
    policy = manager._policy.policy
    x, y = chain("x", 2), chain("y", 1)
    r1 = request(manager, "r1", x)
    store(manager, r1, x)
    manager.on_request_finished(r1)
    r2 = request(manager, "r2", y)
    evicted = store(manager, r2, y)
    manager.on_request_finished(r2)
    before = policy.state().target_t1_blocks
    r3 = request(manager, "r3", x[:1])
    store(manager, r3, x[:1])
    return {
        "evicted": evicted, "target_before": before,
        "target_after": policy.state().target_t1_blocks,
    }  # fmt: skip


class RaisingPolicy(LruPolicy):
    """A user's policy with a bug: its evict raises."""

    def evict(self, n: int, protected: Any) -> Any:
        raise ZeroDivisionError("a bug in the user's policy")


def policy_fails() -> dict[str, Any]:
    """A 2-chunk tier ranked by a user's policy whose evict raises. r1 stores p0, p1;
    r2's store needs an eviction: the policy raises, the store is refused (not vLLM's
    process), counted, and the tier goes on ranked by kvswap's LRU: r3's store works."""
    manager = host_manager(2, "tests.vllm_scripts.manager_scenarios:RaisingPolicy")
    p = chain("p", 2)
    r1 = request(manager, "r1", p)
    store(manager, r1, p)
    manager.on_request_finished(r1)
    refused = store(manager, request(manager, "r2", chain("q", 1)), chain("q", 1))
    after = store(manager, request(manager, "r3", chain("q", 1)), chain("q", 1))
    return {
        "refused": refused, "after": after, "failures": manager._policy.num_failures,
        "ranked_by": type(manager._policy.policy).__name__,
    }  # fmt: skip


def too_small() -> dict[str, Any]:
    """A 2-chunk tier; a request offers 4 chunks: the first 2 are kept (vLLM's own
    manager stores none), the other 2 counted as refused; then kvswap's counters, as
    the stats line and vLLM's /metrics path (`get_stats`) carry them."""
    results: dict[str, Any] = {}
    for policy in ("kvswap", "vllm-lru"):
        manager = host_manager(2, policy)
        w = chain("w", 4)
        r1 = request(manager, "r1", w)
        stored = store(manager, r1, w)
        kept = [names([k])[0] for k in w if manager.lookup(k, r1).name == "HIT"]
        results[policy] = {"stored": stored, "kept": kept}
        if policy == "kvswap":
            stats = manager.get_stats()
            results["counts"] = dataclasses.asdict(manager.report.counts)
            results["metrics"] = {k: v for k, v in stats.reduce().items() if "kvswap" in k}
            results["stats_line"] = manager.report.stats_line()
    return results


def factories() -> dict[str, Any]:
    """The names vLLM's own factories resolve from a config: our classes, each a
    subclass of vLLM's base (the factories check that)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    from kvswap.integrations.vllm import connector
    from kvswap.integrations.vllm.settings import KVSWAP_CONNECTOR

    module = "kvswap.integrations.vllm"
    connector_class = KVConnectorFactory.get_connector_class(SimpleNamespace(**KVSWAP_CONNECTOR))
    spec = OffloadingSpecFactory.get_spec_cls(
        {"spec_name": "KvswapOffloadingSpec", "spec_module_path": module}
    )
    policy = CachePolicyFactory.get_cache_policy_cls("KvswapCachePolicy", module)
    standalone = policy(cache_capacity=4)  # what vLLM's own CPU spec would build
    tiers = [
        SecondaryTierFactory.get_tier_class({"type": name, "module_path": module}).__name__
        for name in ("KvswapNvmeTier", "KvswapRedisTier")
    ]
    return {
        "spec": spec.__name__,
        "cache_policy": type(standalone).__name__,
        "standalone_sinks": standalone.ranking.tokens_per_chunk is not None,
        "tiers": tiers,
        "connector": connector_class.__name__,
        "connector_loads_within_step_itself": connector.NATIVE_SYNC_LOADS,
        # whether a spec built outside kvswap's connector finds sync_load_budget_bytes read
        # (kvswap's spec warns where it is not)
        "budget_read_by_vllm_s_connector": connector.loads_within_step_read(),
    }


def poll_interval() -> dict[str, Any]:
    """vLLM's `tier_poll_interval_s` under kvswap's spec: handed to 0.33's tiering
    manager, refused in one line by 0.32's, which polls every step."""
    from kvswap.errors import ConfigError
    from kvswap.integrations.vllm.settings import adapter_settings
    from kvswap.integrations.vllm.spec import KvswapOffloadingSpec

    settings = adapter_settings(
        {"secondary_tiers": [{"type": "fs", "root_dir": "/unused"}], "tier_poll_interval_s": 0.5}
    )
    spec = SimpleNamespace(settings=settings)  # what `_manager_options` reads of the spec
    try:
        return {"options": KvswapOffloadingSpec._manager_options(spec)}  # type: ignore[arg-type]
    except ConfigError as refused:
        return {"refused": str(refused)}


def bad_tier_entry() -> str:
    """A `secondary_tiers` entry vLLM's factory cannot build: one line naming it."""
    from kvswap.errors import ConfigError
    from kvswap.integrations.vllm.tiers import build_vllm_tiers

    try:
        build_vllm_tiers(None, memoryview(bytearray(64)), [{"type": "NoSuchTier"}], print)
    except ConfigError as refused:
        return str(refused)
    return "built"


def main(scratch: Path) -> None:
    import vllm

    emit(
        {
            "vllm_version": vllm.__version__,
            "factories": factories(),
            "poll_interval": poll_interval(),
            "bad_tier_entry": bad_tier_entry(),
            "tail_first": {p: tail_first(p) for p in ("kvswap", "vllm-lru")},
            "sinks_kept": {p: sinks_kept(p) for p in ("kvswap", "vllm-lru")},
            "arc_adapts": arc_adapts(),
            "policy_fails": policy_fails(),
            "too_small": too_small(),
            "residency": {
                "kvswap": residency(scratch, 3),
                "no_window": residency(scratch, 0),
            },
            "hit_held": {"held": hit_held(scratch, True), "plain": hit_held(scratch, False)},
        }
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
