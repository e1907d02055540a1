"""The simulator's remote tier: the modelled link, the shared store, several engines.

Link tests use 2 MB blocks on a 2.5 GB/s link with a 0.2 ms round trip, so one
block's data takes exactly 0.8 ms and a chunk rtt + n x 0.8 ms of virtual time.
The store tests count in 1-byte values so capacities read as numbers of keys.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from kvswap.base.tier import Tier
from kvswap.base.transfer import Direction, Priority, TransferChunk
from kvswap.base.write_policy import RemoteWritePolicy
from kvswap.config_load import load_config
from kvswap.control.policy import named_policy
from kvswap.control.policy_arc import ArcPolicy
from kvswap.control.policy_lru import LruPolicy
from kvswap.errors import KvSwapError
from kvswap.sim.clock import VirtualClock
from kvswap.sim.copy_model import ModelledCopyEngine
from kvswap.sim.hardware import hardware_preset, with_remote_link
from kvswap.sim.keyed_tier import KeyedLink, ModelledKeyedTier
from kvswap.sim.multi import VOLATILE_KEYS, simulate_engines
from kvswap.sim.remote_store import SharedRemoteStore, StoreCounters
from kvswap.sim.routing import Route, route_requests, split_workload
from kvswap.sim.simulator import Simulator
from kvswap.workload.request import FollowUp, Request, Workload
from tests.unit.test_eviction_policies import FifoPolicy
from tests.unit.test_sim_cli import SMALL_FLAGS, call

BLOCK_BYTES = 2_000_000


def slab_store(num_blocks: int, block_bytes: int, *, local: bool = False) -> SharedRemoteStore:
    """kvswap's NVMe slab by key as the simulator models it: `num_blocks` blocks, an LRU
    over their keys, holding keys (`local`: one engine's own)."""
    policy = named_policy(Tier.NVME, "lru", capacity_blocks=num_blocks)
    return SharedRemoteStore.holding(num_blocks, block_bytes, policy, local=local)


RTT_S = 0.2e-3
BLOCK_S = BLOCK_BYTES / 2.5e9  # 0.8 ms
KEYS = tuple(bytes([i]) * 32 for i in range(8))


def remote_engine(
    store: SharedRemoteStore, clock: VirtualClock | None = None
) -> ModelledCopyEngine:
    clock = clock if clock is not None else VirtualClock()
    view = store.view(clock, lookup_rtt_s=RTT_S)
    hardware = hardware_preset("h200")
    return ModelledCopyEngine(hardware, clock, keyed=[(view, KeyedLink.remote(hardware))])


def remote_chunk(
    tid: int, direction: Direction, keys: tuple[bytes, ...], priority: Priority = Priority.HIGH
) -> TransferChunk:
    slots = tuple(range(len(keys)))
    return TransferChunk(tid, direction, priority, slots, slots, len(keys) * BLOCK_BYTES, keys)


# ------------------------------------------------------------------ the link


def test_a_remote_chunk_takes_a_round_trip_plus_its_bytes_over_the_link() -> None:
    store = SharedRemoteStore()
    copies = remote_engine(store)
    copies.submit(remote_chunk(1, Direction.CPU_TO_REMOTE, KEYS[:4], Priority.LOW))
    written = copies.wait(1)
    assert written.end_s == pytest.approx(RTT_S + 4 * BLOCK_S) and written.success
    copies.submit(remote_chunk(2, Direction.REMOTE_TO_CPU, KEYS[:2]))
    read = copies.wait(2)
    assert read.duration_s == pytest.approx(RTT_S + 2 * BLOCK_S)
    assert read.failed_dst_slots == () and store.counters.read_hit_keys == 2


def test_the_nic_is_full_duplex_and_high_goes_first_on_each_direction() -> None:
    store = SharedRemoteStore()
    store.write(KEYS, 1, 0.0, StoreCounters())
    copies = remote_engine(store)
    copies.submit(remote_chunk(1, Direction.CPU_TO_REMOTE, KEYS[:8], Priority.LOW))
    copies.submit(remote_chunk(2, Direction.REMOTE_TO_CPU, KEYS[:1], Priority.LOW))
    copies.submit(remote_chunk(3, Direction.REMOTE_TO_CPU, KEYS[1:2], Priority.LOW))
    copies.submit(remote_chunk(4, Direction.REMOTE_TO_CPU, KEYS[2:3], Priority.HIGH))
    results = {r.transfer_id: r for r in copies.wait_all()}
    assert results[2].start_s == 0.0  # a read never waits for a write
    one_read_s = RTT_S + BLOCK_S
    assert results[4].start_s == pytest.approx(one_read_s)  # HIGH before the LOW queued first
    assert results[3].start_s == pytest.approx(2 * one_read_s)
    busy = copies.busy_s_by_link()
    assert busy["cpu_to_remote"] == pytest.approx(RTT_S + 8 * BLOCK_S)


def test_keys_the_store_does_not_hold_come_back_as_failed_destination_slots() -> None:
    store = SharedRemoteStore()
    store.write((KEYS[0], KEYS[2]), 1, 0.0, StoreCounters())
    copies = remote_engine(store)
    chunk = TransferChunk(
        1, Direction.REMOTE_TO_CPU, Priority.HIGH, (0, 1, 2), (40, 41, 42), 3 * BLOCK_BYTES,
        KEYS[:3],
    )  # fmt: skip
    copies.submit(chunk)
    result = copies.wait(1)
    assert result.success and result.failed_dst_slots == (41,)  # the chunk ran; one key is gone
    assert store.counters.read_miss_keys == 1


def test_without_a_store_there_is_no_remote_link() -> None:
    copies = ModelledCopyEngine(hardware_preset("h200"), VirtualClock())
    assert "cpu_to_remote" not in copies.busy_s_by_link()  # one engine's summary is unchanged
    with pytest.raises(ValueError, match="no such keyed tier is modelled"):
        copies.submit(remote_chunk(1, Direction.REMOTE_TO_CPU, KEYS[:1]))


def test_the_remote_link_flags_are_checked() -> None:
    base = hardware_preset("h200")
    assert (base.remote_gb_per_s, base.remote_rtt_ms) == (2.5, 0.2)  # the documented defaults
    assert with_remote_link(base, rtt_ms=0.0).remote_rtt_ms == 0.0
    for bad in ({"gb_per_s": 0.0}, {"gb_per_s": float("nan")}, {"rtt_ms": -1.0}):
        with pytest.raises(KvSwapError, match="allowed"):
            with_remote_link(base, **bad)


# ----------------------------------------------------------------- the store


def test_a_write_is_visible_when_it_ends_even_before_its_engine_polls() -> None:
    store = SharedRemoteStore()
    writer_clock, reader_clock = VirtualClock(), VirtualClock()
    writer = remote_engine(store, writer_clock)
    reader = store.view(reader_clock, lookup_rtt_s=RTT_S)
    writer.submit(remote_chunk(1, Direction.CPU_TO_REMOTE, KEYS[:2], Priority.LOW))
    end_s = RTT_S + 2 * BLOCK_S
    writer_clock.advance(1.0)  # the writer ran on without polling
    reader_clock.advance_to(end_s / 2)
    assert reader.lookup(KEYS[:2]) == 0  # still on the wire
    reader_clock.advance_to(end_s)
    assert reader.lookup(KEYS[:3]) == 2  # the leading run; the third was never written
    assert reader_clock.now_s == pytest.approx(end_s + RTT_S)  # a lookup is one round trip
    assert reader.counters.lookup_hit_keys == 2 and reader.counters.lookup_miss_keys == 2 + 1


def test_lru_eviction_at_capacity_and_lookups_do_not_touch() -> None:
    store, tally = SharedRemoteStore(capacity_bytes=3), StoreCounters()
    a, b, c, d, e = KEYS[:5]
    store.write((a, b, c), 1, 0.0, tally)
    assert store.read((a,), 1.0, tally) == []  # a GET: `a` is now the most recent
    store.write((d,), 1, 2.0, tally)
    assert b not in store and a in store  # b was the least recently used
    assert store.lookup((c,), 3.0, tally) == 1  # EXISTS leaves the LRU order alone
    store.write((e,), 1, 4.0, tally)
    assert c not in store and a in store and d in store and e in store
    assert store.counters.evictions == 2 and store.used_bytes == 3
    assert store.write((KEYS[5],), 4, 5.0, tally) == [0]  # larger than the store
    assert store.counters.write_failed_keys == 1


def test_keys_expire_after_the_ttl_and_a_rewrite_starts_it_again() -> None:
    store, tally = SharedRemoteStore(ttl_s=1.0), StoreCounters()
    store.write(KEYS[:2], 1, 0.0, tally)
    assert store.lookup(KEYS[:2], 0.5, tally) == 2
    store.write(KEYS[1:2], 1, 0.8, tally)  # SET again: a new TTL
    assert store.lookup(KEYS[:1], 1.0, tally) == 0 and store.counters.expirations == 1
    assert store.lookup(KEYS[1:2], 1.7, tally) == 1
    assert store.read(KEYS[1:2], 1.8, tally) == [0] and len(store) == 0
    assert tally.already_present == 1


def test_a_store_that_holds_keys_never_evicts_a_held_one() -> None:
    """The NVMe slab's model (`holding`): a held key is never a victim until its last
    release; with every key held a write fails. A plain store (Redis's model) ignores
    holds."""
    store, tally = slab_store(2, 1), StoreCounters()
    a, b, c, d = KEYS[:4]
    store.hold((a, b))
    store.hold((a,))
    store.write((a, b), 1, 0.0, tally)  # held before they were written
    assert store.write((c,), 1, 1.0, tally) == [0] and store.counters.write_failed_keys == 1
    store.release((b,))  # b, the one key not held, makes room
    assert store.write((c,), 1, 2.0, tally) == [] and b not in store and a in store
    store.release((a,))  # held twice: still held
    assert store.write((d,), 1, 3.0, tally) == [] and a in store and c not in store
    assert store.read((a,), 4.0, tally) == [] and store.num_held_keys == 1
    store.release((a,))
    with pytest.raises(ValueError, match="not held"):
        store.release((a,))
    plain = SharedRemoteStore(capacity_bytes=1)
    plain.hold((a,))
    plain.write((a, b), 1, 0.0, tally)
    assert a not in plain and b in plain and plain.num_held_keys == 0


# --------------------------------------------------------------- the routing


def request(rid: int, t_s: float, prompt: tuple[int, ...], new: int = 4, **kw: object) -> Request:
    return Request(rid, t_s, prompt, new, **kw)  # type: ignore[arg-type]


def test_routing_keeps_a_conversation_on_one_engine_and_renumbers() -> None:
    follow = FollowUp(previous_request_id=0, new_user_ids=(9, 9), think_time_s=0.1)
    workload = Workload(
        (
            request(0, 0.0, (1,) * 20, session_id=0),
            request(1, 0.1, (1,) * 16 + (2,) * 4, session_id=1),
            request(2, 0.2, (3,) * 20, session_id=2),
            Request(3, 0.2, (), 4, session_id=0, turn=1, follow_up=follow),
        ),
        "w", 100,
    )  # fmt: skip
    assert route_requests(workload, 2, Route.ROUND_ROBIN, 16) == (0, 1, 0, 0)
    by_hash = route_requests(workload, 2, Route.HASH, 16)
    assert by_hash[0] == by_hash[1] == by_hash[3]  # equal first blocks meet on one engine
    first, second = split_workload(workload, 2, Route.ROUND_ROBIN, 16)
    assert first.request_ids == (0, 2, 3) and second.request_ids == (1,)
    follow_up = first.workload[2].follow_up
    assert follow_up is not None and follow_up.previous_request_id == 0  # local ids


# ------------------------------------------------------------ several engines

SMALL = {
    "kv_block_tokens": 16, "gpu_kv_capacity_blocks": 120, "cpu_kv_capacity_blocks": 400,
    "protected_sink_blocks": 2, "min_residency_steps": 8, "max_num_seqs": 8,
}  # fmt: skip


def shared_prompt_workload() -> Workload:
    """Round robin: engine 0 serves a 256-token shared prompt, then keeps running a
    long request (so its write-behind goes on); engine 1 sees the shared prompt
    only at t = 1 s, long after engine 0 finished with it."""
    rng = random.Random(7)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(32_000) for _ in range(n))

    shared = tokens(256)
    return Workload(
        (
            request(0, 0.0, shared + tokens(64), 8),  # engine 0
            request(1, 0.001, tokens(40), 1),  # engine 1
            request(2, 0.002, tokens(40), 150),  # engine 0, stepping until ~2 s
            request(3, 1.0, shared + tokens(64), 8),  # engine 1: the shared prompt again
        ),
        "shared prompt", 32_000,
    )  # fmt: skip


def engines_run(
    num_engines: int,
    store: SharedRemoteStore | None,
    own_tiers: Callable[[], list[ModelledKeyedTier]] | None = None,
) -> dict[str, object]:
    config = load_config(None, overrides=SMALL)
    result = simulate_engines(
        config, hardware_preset("article-40gb"), shared_prompt_workload(),
        num_engines=num_engines, store=store, own_tiers=own_tiers,
    )  # fmt: skip
    out = result.to_json()
    for engine in out["per_engine"]:  # type: ignore[attr-defined]
        for key in VOLATILE_KEYS:
            engine.pop(key)
    return out


def test_engines_each_with_a_slab_of_its_own_in_front_of_the_shared_store() -> None:
    """`own_tiers`: each engine gets keyed tiers of its own in front of the store (a
    keyed NVMe slab); the second engine still finds the first one's prompt in the
    store, as the store's second keyed tier, and the tokens are the same."""
    slabs: list[SharedRemoteStore] = []
    config = load_config(None, overrides=SMALL)
    block_bytes = Simulator(config, hardware_preset("article-40gb")).setup.block_bytes

    def slab() -> list[ModelledKeyedTier]:
        slabs.append(slab_store(4096, block_bytes))
        link = KeyedLink.nvme(hardware_preset("article-40gb"))
        return [ModelledKeyedTier(slabs[-1], link, "on_demote")]

    store = SharedRemoteStore(capacity_bytes=1 << 30)
    listed = engines_run(2, store, slab)
    plain = engines_run(2, SharedRemoteStore(capacity_bytes=1 << 30))
    hits: Any = listed["combined"]
    plain_hits: Any = plain["combined"]
    assert len(slabs) == 2 and store.counters.read_hit_keys > 0
    assert hits["prefix_hit_tokens"]["remote2"] == plain_hits["prefix_hit_tokens"]["remote"] > 0
    assert hits["outputs_digest"] == plain_hits["outputs_digest"]


def test_a_second_engine_finds_the_shared_prompt_in_the_store() -> None:
    with_store = engines_run(2, SharedRemoteStore(capacity_bytes=1 << 30))
    without = engines_run(2, None)
    second, second_alone = with_store["per_engine"][1], without["per_engine"][1]  # type: ignore[index]
    assert second["prefix_hit_tokens"]["remote"] >= 256  # the whole shared prompt
    assert second["prefill_tokens_computed"] < second_alone["prefill_tokens_computed"]
    assert second_alone["prefix_hit_tokens"]["remote"] == 0
    combined = with_store["combined"]
    assert combined["prefill_tokens_computed"] < without["combined"]["prefill_tokens_computed"]  # type: ignore[index]
    # The same tokens whatever the engines and the store: one workload, one digest.
    assert combined["outputs_digest"] == without["combined"]["outputs_digest"]  # type: ignore[index]
    assert combined["outputs_digest"] == engines_run(1, None)["combined"]["outputs_digest"]  # type: ignore[index]


def test_several_engines_are_deterministic() -> None:
    first = engines_run(2, SharedRemoteStore(capacity_bytes=64 * BLOCK_BYTES))
    second = engines_run(2, SharedRemoteStore(capacity_bytes=64 * BLOCK_BYTES))
    assert json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)


def test_a_simulator_with_a_store_reads_the_remote_tier_settings_as_the_engine_does() -> None:
    hardware = hardware_preset("article-40gb")
    store = SharedRemoteStore(capacity_bytes=1 << 30)
    config = load_config(None, overrides={**SMALL, "remote_write_policy": "on_demote"})
    remote = Simulator(config, hardware, remote_store=store).control.settings.remote
    assert remote is not None and remote.write_policy is RemoteWritePolicy.ON_DEMOTE
    plain = Simulator(config, hardware).control.settings
    assert plain.remote is None  # no store, no URL: no remote tier
    assert remote.namespace == plain.layout.key_namespace().model_fingerprint
    named = load_config(None, overrides={**SMALL, "remote_namespace": "team-a"})
    remote = Simulator(named, hardware, remote_store=store).control.settings.remote
    assert remote is not None and remote.namespace == "team-a"


#: A 20-block pinned pool that sequences are paused (preempted by swap) faster than it
#: holds them (`paused_requests`).
PAUSING = {**SMALL, "cpu_kv_capacity_blocks": 20, "max_num_seqs": 16, "min_residency_steps": 0}


def paused_requests() -> tuple[Request, ...]:
    """24 requests of 100-300 prompt tokens arriving 2 ms apart: on `PAUSING`'s pools,
    many are paused and their blocks go below the pinned pool."""
    rng = random.Random(1)
    return tuple(
        request(i, i * 0.002, tuple(rng.randrange(32_000) for _ in range(rng.randrange(100, 300))),
                rng.randrange(60, 200))
        for i in range(24)
    )  # fmt: skip


def paused_in_the_store(holds_keys: bool) -> tuple[dict[str, Any], SharedRemoteStore]:
    """Sequences paused faster than a 20-block pinned pool holds them: their blocks go
    on to a store of 20 blocks (written on demotion)."""
    config = load_config(None, overrides={**PAUSING, "remote_write_policy": "on_demote"})
    hardware = hardware_preset("article-40gb")
    block_bytes = Simulator(config, hardware).control.settings.swap.block_bytes
    store = slab_store(20, block_bytes) if holds_keys else SharedRemoteStore(20 * block_bytes)
    simulator = Simulator(config, hardware, remote_store=store)
    out = simulator.run(Workload(paused_requests(), "paused", 32_000)).to_json()
    simulator.control.swapper.check_integrity()  # every hold in step with its block
    return out, store


def test_a_store_that_holds_keys_keeps_every_paused_sequences_blocks() -> None:
    """A plain store evicts paused sequences' only copies (their blocks are recomputed);
    one that holds keys never does: it refuses newer writes instead, and every hold is
    released by the end. The same tokens either way."""
    plain, plain_store = paused_in_the_store(holds_keys=False)
    held, held_store = paused_in_the_store(holds_keys=True)
    assert plain["preemptions"] == held["preemptions"] > 10
    assert plain_store.counters.read_miss_keys > 0 and plain["recomputed_tokens"] > 0
    assert held_store.counters.read_miss_keys == 0 and held["recomputed_tokens"] == 0
    assert held_store.counters.read_hit_keys > plain_store.counters.read_hit_keys
    assert held_store.counters.write_failed_keys > 0 and held_store.num_held_keys == 0
    assert held["lost_blocks"] == 0 and held["outputs_digest"] == plain["outputs_digest"]


def test_the_simulated_slab_evicts_by_the_engines_nvme_eviction_policy() -> None:
    """The simulator's NVMe slab is ranked as the engine's is: by `nvme_eviction_policy`
    (built by name for the slab's size, a class of one's own included), over the slab's
    own index. The tokens do not depend on it."""
    workload = Workload(paused_requests(), "paused", 32_000)
    fifo = "tests.unit.test_eviction_policies:FifoPolicy"
    digests = set()
    slab = {**PAUSING, "nvme_kv_capacity_blocks": 24, "nvme_dir": "/var/tmp/kvswap"}  # modelled
    for name, cls in (("lru", LruPolicy), ("arc", ArcPolicy), (fifo, FifoPolicy)):
        config = load_config(None, overrides={**slab, "nvme_eviction_policy": name})
        simulator = Simulator(config, hardware_preset("article-40gb"))
        store = simulator.views[0].store
        policy = store.eviction_policy
        assert type(policy) is cls and policy.options.capacity_blocks == 24
        out = simulator.run(workload).to_json()
        simulator.control.swapper.check_integrity()
        assert out["nvme_slab"]["evictions"] > 0 and out["lost_blocks"] == 0
        digests.add(out["outputs_digest"])
    assert len(digests) == 1


def test_a_list_of_keyed_tiers_each_reached_over_its_link_and_written_by_its_policy() -> None:
    """A keyed NVMe slab of the engine's own (on_demote, the drive's one link, holding
    paused sequences' keys) in front of a shared store (on_finish, the network's two):
    each tier is written by its own policy, read from where the block is, reported
    as a tier of its own; the tokens are those of the run without either."""
    requests = paused_requests()
    workload = Workload(requests, "paused", 32_000)
    config = load_config(None, overrides=PAUSING)
    hardware = hardware_preset("article-40gb")
    plain = Simulator(config, hardware)
    block_bytes = plain.control.settings.swap.block_bytes
    reference = plain.run(workload).to_json()
    slab = slab_store(60, block_bytes)
    shared = SharedRemoteStore()
    keyed = (ModelledKeyedTier(slab, KeyedLink.nvme(hardware), "on_demote"),
             ModelledKeyedTier(shared, write_policy="on_finish"))  # fmt: skip
    simulator = Simulator(config, hardware, keyed=keyed)
    out = simulator.run(workload).to_json()
    simulator.control.swapper.check_integrity()
    assert out["outputs_digest"] == reference["outputs_digest"] and out["lost_blocks"] == 0
    assert out["preemptions"] > 10  # paused sequences' blocks went down to the slab
    assert slab.counters.read_hit_keys > 0 and slab.counters.read_miss_keys == 0
    assert slab.counters.written_keys * block_bytes == out["bytes_cpu_to_remote"]
    assert shared.counters.written_keys * block_bytes == out["bytes_cpu_to_remote2"] > 0
    assert out["keyed_tiers"]["remote2"]["written_keys"] == shared.counters.written_keys
    # The slab's one link both ways (a drive); the store's one link each way (a NIC).
    assert {"remote", "cpu_to_remote2", "remote2_to_cpu"} <= set(out["link_utilization"])
    # A second engine, with a slab of its own, finds the finished prefixes in the store
    # (the same prompts, once the first engine's writes are visible on the clock).
    later = out["duration_s"]
    repeat = Workload(tuple(replace(r, arrival_s=later + r.arrival_s) for r in requests[:4]),
                      "again", 32_000)  # fmt: skip
    fresh = slab_store(60, block_bytes)
    again = Simulator(config, hardware, keyed=(replace(keyed[0], store=fresh), keyed[1]))
    hits = again.run(repeat).to_json()["prefix_hit_rate_by_tier"]
    assert hits["remote2"] > 0.5 and hits["remote"] == 0.0
    with pytest.raises(ValueError, match="allowed: None, on_finish, on_demote, off"):
        ModelledKeyedTier(shared, write_policy="sometimes")


def test_one_engine_without_a_store_is_the_plain_simulator() -> None:
    config = load_config(None, overrides=SMALL)
    hardware = hardware_preset("article-40gb")
    plain = Simulator(config, hardware).run(shared_prompt_workload()).to_json()
    engine = engines_run(1, None)["per_engine"][0]  # type: ignore[index]
    for key in VOLATILE_KEYS:
        plain.pop(key)
    assert {k: v for k, v in engine.items() if k not in ("engine", "prefill_tokens_computed")} == (
        plain
    )
    assert "cpu_to_remote" not in plain["link_utilization"]  # type: ignore[operator]


# ----------------------------------------------------------------- the command


def test_simulate_engines_compare_remote_prints_both_and_the_ratios(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["simulate", *SMALL_FLAGS, "--engines", "2", "--shared-remote-gib", "1",
            "--compare-remote", "--json"]  # fmt: skip
    assert call(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["engines"] == 2 and len(out["per_engine"]) == 2
    assert out["combined"]["requests_completed"] == 12
    assert out["shared_remote_store"]["capacity_bytes"] == 1 << 30
    ratios = out["remote_vs_without"]
    assert set(ratios) == {"ttft_p50_ms", "ttft_p99_ms", "throughput_tok_s",
                           "prefill_tokens_computed"}  # fmt: skip
    assert ratios["prefill_tokens_computed"]["ratio"] <= 1.0
    assert call(["simulate", *SMALL_FLAGS, "--engines", "2", "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "2 engines, round-robin" in text and "\nall " in text


def test_simulate_engine_flag_mistakes_are_one_line_errors() -> None:
    cases = [
        (["--engines", "0"], "--engines 0: allowed: 1..256"),
        (["--route", "hash"], "--route chooses among engines"),
        (["--engines", "2", "--route", "random"], "allowed: round-robin, hash"),
        (["--compare-remote"], "--compare-remote is about the shared remote store"),
        (["--remote-rtt-ms", "1"], "--remote-rtt-ms is about the shared remote store"),
        (["--shared-remote-gib", "1e-9"], "holds no KV block"),
        (["--shared-remote-gib", "1", "--remote-gb-per-s", "-2"], "allowed: a finite rate in"),
        (["--shared-remote-gib", "1", "--remote-gb-per-s", "inf"], "allowed: a finite rate in"),
        (["--shared-remote-gib", "1", "--remote-rtt-ms", "-1"], "allowed: a finite number >= 0"),
        (["--engines", "2", "--timeseries", "x.json"], "--timeseries follows one engine"),
    ]
    for flags, message in cases:
        with pytest.raises(KvSwapError, match=message):
            call(["simulate", *SMALL_FLAGS, "--quiet", *flags])


def test_one_engine_with_a_store_keeps_the_full_summary(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert call(["simulate", *SMALL_FLAGS, "--shared-remote-gib", "1", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert "diagnosis" in summary and summary["shared_remote_store"]["written_keys"] > 0
    assert {"cpu_to_remote", "remote_to_cpu"} <= set(summary["link_utilization"])
    assert summary["remote"]["enabled"] and summary["remote_link"]["gb_per_s"] == 2.5
    # A URL in the config models an unbounded store; the simulator never connects to it.
    assert call(["simulate", *SMALL_FLAGS, "--remote-url", "redis://127.0.0.1:1/0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["shared_remote_store"]["capacity_bytes"] is None


def test_a_local_slab_is_the_nvme_tier_and_its_evictions_are_forgotten() -> None:
    """A keyed NVMe slab of the engine's own (`local`): reported as the `nvme` tier; a
    block whose only copy it holds is remembered until the slab evicts its key, and
    then forgotten, so no block the engine keeps claims a copy the slab lacks."""
    workload = Workload(paused_requests(), "paused", 32_000)
    config = load_config(None, overrides=PAUSING)
    hardware = hardware_preset("article-40gb")
    plain = Simulator(config, hardware)
    block_bytes = plain.control.settings.swap.block_bytes
    reference = plain.run(workload).to_json()
    slab = slab_store(24, block_bytes, local=True)
    simulator = Simulator(
        config, hardware, keyed=(ModelledKeyedTier(slab, KeyedLink.nvme(hardware), "on_demote"),)
    )
    out = simulator.run(workload).to_json()
    swapper = simulator.control.swapper
    swapper.check_integrity()
    assert out["outputs_digest"] == reference["outputs_digest"] and out["lost_blocks"] == 0
    assert slab.counters.written_keys * block_bytes == out["bytes_cpu_to_nvme"] > 0
    assert out["bytes_nvme_to_cpu"] > 0 and "bytes_cpu_to_remote" in out
    # Reported with its size, and full at its peak (it evicted).
    assert out["capacity_blocks_by_tier"]["nvme"] == out["peak_blocks_by_tier"]["nvme"] == 24
    # The next step boundary hears of the evictions since the last one: then every
    # copy the engine keeps is in the slab.
    swapper.begin_step(out["num_steps"] + 1)
    assert swapper.metrics.evictions_by_reason["nvme_discard"] > 0 < slab.counters.evictions
    on_slab = [b for b in swapper.store.blocks.values() if b.ready_copy(Tier.NVME)]
    assert on_slab and all(block.key in slab for block in on_slab)
    with pytest.raises(ValueError, match="one view only"):
        slab.view(simulator.clock)
