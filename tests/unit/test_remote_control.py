"""Narrated scenarios: the remote tier in the control plane, on tiny pools.

The store is a small in-memory fake shared by "processes" (each a scheduler
with its own pools and copy engine, as two engines on two machines would be).
`FakeStore` is the `RemoteIndex`; `RemoteEngine` is the manual copy engine of
the other scenario tests plus the store: a remote chunk's outcome is decided
when the test finishes it (a key gone means that block's slot failed; a store
that is down fails every slot). Blocks are 2 tokens; the "model" samples
`1000 + 100 * seq_id + i`, as in test_scheduler_scenarios.py.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from kvswap.config import load_config
from kvswap.control.identity import KeyNamespace, chain_key
from kvswap.control.policy import PolicyOptions
from kvswap.control.remote import RemoteIndex
from kvswap.control.scheduler import Scheduler, SchedulerSettings, StepPlan
from kvswap.control.settings import RemoteSettings, RemoteWritePolicy, SwapSettings
from kvswap.control.store import StoreLayout
from kvswap.control.swapper import Swapper
from kvswap.control.transfer import Direction, Priority, Tier, TransferChunk, TransferResult
from kvswap.drive.assembly import build_control_plane
from kvswap.drive.settings import control_settings
from kvswap.drive.summary import StepTotals, build_summary
from kvswap.errors import KvSwapError
from tests.manual_engine import ManualCopyEngine

BT = 2
NAMESPACE = KeyNamespace(model_fingerprint="model-a", block_tokens=BT)


class FakeStore(RemoteIndex):
    """Block keys held by a shared store. `vanishing` keys are reported present by a
    lookup but gone by the time they are fetched (a TTL ran out in between)."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()
        self.vanishing: set[bytes] = set()
        self.up = True
        self.down_after_lookup = False  # an outage right after the next lookup answers
        self.lookups: list[tuple[bytes, ...]] = []

    def lookup(self, keys: Sequence[bytes]) -> int:
        self.lookups.append(tuple(keys))
        if self.down_after_lookup:
            self.up = False
        held = 0
        for key in keys:
            if key not in self.keys and key not in self.vanishing:
                break
            held += 1
        return held

    @property
    def available(self) -> bool:
        return self.up


class RemoteEngine(ManualCopyEngine):
    def __init__(self, store: FakeStore) -> None:
        super().__init__()
        self.store = store

    def _result(self, chunk: TransferChunk) -> TransferResult:
        def result(success: bool, failed: tuple[int, ...], error: str | None) -> TransferResult:
            return TransferResult(
                chunk.transfer_id, success, chunk.num_bytes, 0.0, 0.001, error, failed
            )

        if chunk.direction is Direction.REMOTE_TO_CPU:
            if not self.store.up:
                return result(False, chunk.dst_slots, "store down")
            pairs = zip(chunk.dst_slots, chunk.keys, strict=True)
            return result(True, tuple(s for s, key in pairs if key not in self.store.keys), None)
        if chunk.direction is Direction.CPU_TO_REMOTE:
            if not self.store.up or chunk.transfer_id in self.fail_ids:
                return result(False, chunk.dst_slots, "skipped")  # a skipped write
            self.store.keys.update(chunk.keys)
        return super()._result(chunk)


def make_process(
    store: FakeStore,
    *,
    num_gpu_blocks: int = 8,
    num_cpu_blocks: int = 8,
    num_nvme_blocks: int = 0,
    write_policy: RemoteWritePolicy = RemoteWritePolicy.ON_FINISH,
    max_lookup_blocks: int = 64,
    max_inflight_write_chunks: int = 4,
    swap_out_chunk_blocks: int = 4,
    swap_in_chunk_blocks: int = 4,
    cpu_demote_high_watermark: float = 1.0,
    cpu_demote_low_watermark: float = 0.99,
    remote: bool = True,
) -> tuple[Scheduler, RemoteEngine]:
    """One process: its own pools and copy engine, the shared `store`. Watermarks at
    1.0: nothing is swapped out or demoted ahead of need unless a test asks."""
    engine = RemoteEngine(store)
    layout = StoreLayout(BT, num_gpu_blocks, num_cpu_blocks, num_nvme_blocks, 0, NAMESPACE)
    swap = SwapSettings(
        block_bytes=64, swap_out_high_watermark=1.0, swap_out_low_watermark=0.99,
        swap_out_chunk_blocks=swap_out_chunk_blocks, swap_in_chunk_blocks=swap_in_chunk_blocks,
        cpu_demote_high_watermark=cpu_demote_high_watermark,
        cpu_demote_low_watermark=cpu_demote_low_watermark,
    )  # fmt: skip
    settings = RemoteSettings("model-a", write_policy, max_lookup_blocks, max_inflight_write_chunks)
    swapper = Swapper(
        layout, PolicyOptions(sink_protection=False, min_residency_steps=0), swap, engine,
        clock_s=lambda: 0.0, remote_index=store if remote else None, remote=settings,
    )  # fmt: skip
    return Scheduler(swapper, SchedulerSettings(max_num_seqs=8, max_num_batched_tokens=64)), engine


def output_token(seq_id: int, index: int) -> int:
    return 1000 + 100 * seq_id + index


def run_step(scheduler: Scheduler, now_s: float = 0.0) -> tuple[StepPlan, list[int]]:
    plan = scheduler.schedule(now_s)
    sampled = {
        item.seq_id: output_token(item.seq_id, len(scheduler.runs[item.seq_id].output_ids))
        for item in plan.seqs
        if item.samples
    }
    finished = scheduler.complete(plan, sampled, now_s)
    scheduler.swapper.check_integrity()
    return plan, finished


def computed(plan: StepPlan) -> list[tuple[int, tuple[int, ...], int]]:
    return [(item.seq_id, item.token_ids, item.start_position) for item in plan.seqs]


def chunks(engine: ManualCopyEngine, direction: Direction) -> list[TransferChunk]:
    return [chunk for chunk in engine.submitted if chunk.direction is direction]


def placement(scheduler: Scheduler, seq_id: int) -> list[str]:
    return [
        "+".join(tier.value for tier in Tier if block.ready_copy(tier) is not None)
        for block in scheduler.swapper.store.sequence_blocks(seq_id)
    ]


def between_steps(scheduler: Scheduler, engine: ManualCopyEngine, step: int) -> None:
    """Every transfer lands, then a step boundary with no work (the write-behind runs)."""
    engine.finish()
    scheduler.swapper.begin_step(step)
    scheduler.swapper.end_step()
    scheduler.swapper.check_integrity()


def serve_and_write(store: FakeStore, prompt: list[int], *, cache_salt: str | None = None) -> None:
    """Process A serves one request and writes its full blocks to the store."""
    a, engine = make_process(store)
    a.add_request(1, prompt, 1, 0.0, cache_salt=cache_salt)
    _, finished = run_step(a)
    assert finished == [1]
    for step in (2, 3):
        between_steps(a, engine, step)


# ---------------------------------------------------------------------------- reads


def test_a_second_process_restores_a_shared_prefix_from_the_store() -> None:
    store = FakeStore()
    # Process A serves [1 2] [3 4] [5] and finishes: its two full blocks go down to
    # the CPU at once (the finish offload), then behind that to the store.
    serve_and_write(store, [1, 2, 3, 4, 5])
    assert len(store.keys) == 2

    # Process B, a fresh start, gets a prompt with the same first 4 tokens. Nothing
    # is local, so the keys of its full prompt blocks before the last token ([1 2]
    # [3 4] [9 9]) are looked up in ONE call; the store holds the first two.
    b, engine = make_process(store)
    store.lookups.clear()  # A asked too, for its own prompt, and found nothing
    b.add_request(7, [1, 2, 3, 4, 9, 9, 9], 2, 0.0)
    plan, _ = run_step(b)
    assert [len(keys) for keys in store.lookups] == [3]
    # They were fetched into CPU slots on the HIGH queue, then up to the GPU, and the
    # step computes only from position 4: nothing recomputed.
    assert computed(plan) == [(7, (9, 9, 9), 4)]
    [fetch] = chunks(engine, Direction.REMOTE_TO_CPU)
    assert (fetch.priority, fetch.num_blocks, fetch.src_slots) == (Priority.HIGH, 2, (0, 1))
    # Each block goes up as soon as it lands in the CPU (as an NVMe block does).
    up = chunks(engine, Direction.CPU_TO_GPU)
    assert sum(c.num_blocks for c in up) == 2 and {c.priority for c in up} == {Priority.HIGH}
    run = b.runs[7]
    assert (run.prefix_hit_tokens, run.recomputed_tokens) == (4, 0)
    metrics = b.swapper.metrics
    assert metrics.prefix_hit_blocks_by_tier[Tier.REMOTE] == 2
    assert (metrics.remote_lookups, metrics.remote_found_blocks) == (1, 2)
    assert placement(b, 7)[:2] == ["gpu+cpu+remote"] * 2


def test_a_key_that_vanished_before_its_fetch_is_lost_and_recomputed() -> None:
    store = FakeStore()
    serve_and_write(store, [1, 2, 3, 4, 5])
    # The lookup will still report [3 4] present, but its value is gone by the fetch.
    gone_key = chain_key(chain_key(NAMESPACE.root_key(), [1, 2]), [3, 4])
    assert gone_key in store.keys
    store.keys.discard(gone_key)
    store.vanishing.add(gone_key)
    b, engine = make_process(store)

    # One fetch chunk of both blocks; the store fails the second block's slot only.
    # That was its only copy: lost, so the owner truncates at token 2 and the step
    # computes [3 4] again (2 recomputed tokens) and the rest for the first time.
    b.add_request(7, [1, 2, 3, 4, 9, 9, 9], 2, 0.0)
    plan, _ = run_step(b)
    assert computed(plan) == [(7, (3, 4, 9, 9, 9), 2)]
    metrics = b.swapper.metrics
    assert (metrics.remote_fetch_failures, metrics.lost_blocks) == (1, 1)
    assert b.runs[7].recomputed_tokens == 2
    assert placement(b, 7) == ["gpu+cpu+remote", "gpu", "gpu", "gpu"]
    assert not b.swapper.has_lost_blocks()
    # It goes on and finishes; the recomputed block is written back to the store.
    _, finished = run_step(b)
    assert finished == [7]
    assert b.runs[7].output_ids == [output_token(7, 0), output_token(7, 1)]
    between_steps(b, engine, 2)
    between_steps(b, engine, 3)
    assert gone_key in store.keys


def test_a_store_down_at_fetch_time_fails_the_whole_chunk_and_everything_is_recomputed() -> None:
    store = FakeStore()
    serve_and_write(store, [1, 2, 3, 4, 5])
    b, _ = make_process(store)
    b.add_request(7, [1, 2, 3, 4, 9], 1, 0.0)
    # The lookup answers (both held), then the store goes down before the fetch.
    store.down_after_lookup = True
    plan, _ = run_step(b)
    assert computed(plan) == [(7, (1, 2, 3, 4, 9), 0)]
    assert b.swapper.metrics.remote_fetch_failures == 2
    assert b.runs[7].recomputed_tokens == 4


def test_the_lookup_is_bounded_and_never_asks_for_the_block_of_the_last_token() -> None:
    store = FakeStore()
    b, _ = make_process(store, max_lookup_blocks=2)
    # 8 tokens = 4 full blocks; the last holds the last prompt token: 3 candidates,
    # of which the bound lets 2 be asked.
    b.add_request(1, list(range(8)), 1, 0.0)
    run_step(b)
    assert [len(keys) for keys in store.lookups] == [2]
    assert b.swapper.metrics.remote_lookup_misses == 1
    # A 2-token prompt has no full block before its last token: no lookup at all.
    b.add_request(2, [50, 51], 1, 0.0)
    run_step(b)
    assert len(store.lookups) == 1


def test_different_cache_salts_never_share_remote_kv() -> None:
    store = FakeStore()
    serve_and_write(store, [1, 2, 3, 4, 5], cache_salt="alice")
    # Bob sends the same prompt: his keys are rooted in another salt, so the store
    # holds none of them, and nothing is restored.
    bob, _ = make_process(store)
    bob.add_request(7, [1, 2, 3, 4, 5], 1, 0.0, cache_salt="bob")
    plan, _ = run_step(bob)
    assert computed(plan) == [(7, (1, 2, 3, 4, 5), 0)]
    assert set(store.lookups[-1]).isdisjoint(store.keys)
    # Without a salt it is another tenant again; with Alice's, her blocks come back.
    bob.add_request(8, [1, 2, 3, 4, 5], 1, 0.0)
    assert computed(run_step(bob)[0]) == [(8, (1, 2, 3, 4, 5), 0)]
    alice, _ = make_process(store)
    alice.add_request(9, [1, 2, 3, 4, 5], 1, 0.0, cache_salt="alice")
    assert computed(run_step(alice)[0]) == [(9, (5,), 4)]


def test_a_store_that_is_down_is_neither_asked_nor_written() -> None:
    store = FakeStore()
    store.up = False
    a, engine = make_process(store)
    a.add_request(1, [1, 2, 3, 4, 5], 1, 0.0)
    plan, _ = run_step(a)
    assert store.lookups == []  # no lookup while unavailable
    assert computed(plan) == [(1, (1, 2, 3, 4, 5), 0)]
    between_steps(a, engine, 2)
    between_steps(a, engine, 3)
    assert chunks(engine, Direction.CPU_TO_REMOTE) == []
    assert a.swapper.metrics.remote_writes_skipped == 2
    assert store.keys == set()


def test_without_a_remote_index_there_is_no_remote_tier() -> None:
    store = FakeStore()
    a, engine = make_process(store, remote=False)
    a.add_request(1, [1, 2, 3, 4, 5], 1, 0.0)
    run_step(a)
    between_steps(a, engine, 2)
    assert store.lookups == [] and store.keys == set()
    assert a.swapper.remote is None


# --------------------------------------------------------------------------- writes


def test_on_finish_full_blocks_are_written_behind_their_cpu_copy_on_the_low_queue() -> None:
    store = FakeStore()
    a, engine = make_process(store, swap_out_chunk_blocks=2)
    # [1 2] [3 4] [5 6] [7]: three full blocks and a partial one.
    a.add_request(1, [1, 2, 3, 4, 5, 6, 7], 1, 0.0)
    _, finished = run_step(a)
    assert finished == [1]
    # The finish offload copies the full blocks down (GPU -> CPU); nothing goes to the
    # store before a block has a ready CPU copy to read from.
    assert [c.num_blocks for c in chunks(engine, Direction.GPU_TO_CPU)] == [2, 1]
    assert chunks(engine, Direction.CPU_TO_REMOTE) == []

    # The offload lands; at the next step's end the write-behind sends them, in
    # swap-out chunks, on the LOW queue, each chunk naming its blocks' keys.
    engine.finish()
    a.swapper.begin_step(2)
    a.swapper.end_step()
    writes = chunks(engine, Direction.CPU_TO_REMOTE)
    assert [(c.priority, c.num_blocks) for c in writes] == [(Priority.LOW, 2), (Priority.LOW, 1)]
    assert writes[0].dst_slots == (0, 1) and len(writes[0].keys) == 2
    # The CPU copies are read until the results are polled: reserved, not evictable.
    blocks = [a.swapper.store.blocks[i] for i in sorted(a.swapper.store.blocks)]
    full = [b for b in blocks if b.key is not None]
    assert [b.copies[Tier.CPU].num_readers for b in full] == [1, 1, 1]
    assert all(not b.copies[Tier.REMOTE].ready for b in full)

    # Written: each block now has a ready remote copy, so it is clean below the CPU.
    engine.finish()
    a.swapper.begin_step(3)
    assert [b.copies[Tier.CPU].num_readers for b in full] == [0, 0, 0]
    assert all(b.ready_copy(Tier.REMOTE) for b in full)
    assert all(b.has_ready_copy_below(Tier.CPU) for b in full)
    assert store.keys == {b.key for b in full}
    assert a.swapper.metrics.remote_writes == 3
    assert a.swapper.metrics.bytes_by_direction[Direction.CPU_TO_REMOTE] == 3 * 64


def test_a_written_block_leaves_the_pool_for_free_and_a_later_turn_finds_it_remotely() -> None:
    store = FakeStore()
    # One pinned slot and two GPU blocks: [1 2] is served, offloaded and written.
    a, engine = make_process(store, num_gpu_blocks=3, num_cpu_blocks=1)
    a.add_request(1, [1, 2, 3], 1, 0.0)
    run_step(a)
    between_steps(a, engine, 2)
    between_steps(a, engine, 3)
    [written] = [b for b in a.swapper.store.blocks.values() if b.key is not None]
    assert written.ready_copy(Tier.REMOTE) is not None
    # Another request needs the GPU and the pinned slot: the written block's copies
    # are dropped without a transfer (a copy is below them), and this process forgets
    # it (it is referenced by nobody and held only remotely).
    a.add_request(2, [40, 41, 42, 43, 44], 1, 0.0)
    run_step(a)
    assert written.block_id not in a.swapper.store.blocks
    assert a.swapper.metrics.evictions_by_reason["sync_drop"] == 1  # GPU: no transfer
    assert a.swapper.metrics.evictions_by_reason["cpu_drop"] == 1  # pinned: none either
    between_steps(a, engine, 4)
    between_steps(a, engine, 5)  # request 2's own blocks are written behind
    # A later turn of the first conversation finds [1 2] in the store again.
    store.lookups.clear()
    a.add_request(3, [1, 2, 3, 1100, 7], 1, 0.0)
    plan, _ = run_step(a)
    [asked] = store.lookups  # [1 2] [3 1100]: the store holds the first
    assert len(asked) == 2 and asked[0] == written.key
    assert computed(plan) == [(3, (3, 1100, 7), 2)]
    assert a.runs[3].prefix_hit_tokens == 2
    assert a.swapper.metrics.prefix_hit_blocks_by_tier[Tier.REMOTE] == 1


def test_a_block_already_in_the_store_is_not_written_again() -> None:
    store = FakeStore()
    serve_and_write(store, [1, 2, 3, 4, 5])
    # B restores [1 2] [3 4] and computes [9 9] [9]; at its finish only [9 9] is new.
    b, engine = make_process(store)
    b.add_request(7, [1, 2, 3, 4, 9, 9, 9], 1, 0.0)
    run_step(b)
    between_steps(b, engine, 2)
    between_steps(b, engine, 3)
    writes = chunks(engine, Direction.CPU_TO_REMOTE)
    assert sum(c.num_blocks for c in writes) == 1
    assert b.swapper.metrics.remote_writes == 1
    assert len(store.keys) == 3


def test_a_write_the_store_fails_or_skips_gives_no_remote_copy_and_loses_nothing() -> None:
    store = FakeStore()
    a, engine = make_process(store)
    a.add_request(1, [1, 2, 3, 4, 5], 1, 0.0)
    run_step(a)
    engine.finish()
    a.swapper.begin_step(2)
    a.swapper.end_step()
    [write] = chunks(engine, Direction.CPU_TO_REMOTE)
    engine.fail_ids.add(write.transfer_id)  # the store client skipped it
    between_steps(a, engine, 3)
    full = [b for b in a.swapper.store.blocks.values() if b.key is not None]
    assert all(Tier.REMOTE not in b.copies for b in full)
    assert all(b.ready_copy(Tier.CPU) for b in full)  # the CPU copies are intact
    metrics = a.swapper.metrics
    assert (metrics.remote_writes, metrics.remote_write_failures) == (0, 2)
    assert metrics.failed_transfers == 0 and metrics.lost_blocks == 0


def test_writes_in_flight_are_bounded_the_rest_wait_their_turn() -> None:
    store = FakeStore()
    a, engine = make_process(store, swap_out_chunk_blocks=1, max_inflight_write_chunks=1)
    a.add_request(1, [1, 2, 3, 4, 5, 6, 7], 1, 0.0)
    run_step(a)
    engine.finish()
    for step in range(2, 6):
        a.swapper.begin_step(step)
        a.swapper.end_step()
        # Never more than one write chunk in flight; one lands between steps.
        pending = [c for c in engine.pending.values() if c.direction is Direction.CPU_TO_REMOTE]
        assert len(pending) <= 1
        engine.finish()
    assert len(chunks(engine, Direction.CPU_TO_REMOTE)) == 3
    assert len(store.keys) == 3


def test_write_policy_off_reads_but_never_writes() -> None:
    store = FakeStore()
    serve_and_write(store, [1, 2, 3, 4, 5])
    b, engine = make_process(store, write_policy=RemoteWritePolicy.OFF)
    b.add_request(7, [1, 2, 3, 4, 9, 9, 9], 1, 0.0)
    plan, _ = run_step(b)
    assert computed(plan) == [(7, (9, 9, 9), 4)]  # read: yes
    between_steps(b, engine, 2)
    between_steps(b, engine, 3)
    assert chunks(engine, Direction.CPU_TO_REMOTE) == []  # written: never


def test_on_demote_writes_what_the_pinned_pool_demotes_to_nvme() -> None:
    store = FakeStore()
    # 4 pinned slots, demotion from 0.75 down to 0.25; an NVMe tier below.
    a, engine = make_process(
        store, num_cpu_blocks=4, num_nvme_blocks=8, write_policy=RemoteWritePolicy.ON_DEMOTE,
        cpu_demote_high_watermark=0.75, cpu_demote_low_watermark=0.25,
    )  # fmt: skip
    a.add_request(1, [1, 2, 3, 4, 5, 6, 7], 1, 0.0)
    run_step(a)
    # Finishing is no reason to write under on_demote.
    engine.finish()
    a.swapper.begin_step(2)
    assert chunks(engine, Direction.CPU_TO_REMOTE) == []
    # 3 of 4 pinned slots used: demotion takes the 2 coldest to NVMe, and each is
    # written to the store alongside (both LOW); the CPU copy goes once both landed.
    a.swapper.end_step()
    demoted = chunks(engine, Direction.CPU_TO_NVME)
    writes = chunks(engine, Direction.CPU_TO_REMOTE)
    assert sum(c.num_blocks for c in demoted) == sum(c.num_blocks for c in writes) == 2
    assert all(c.priority is Priority.LOW for c in writes)
    between_steps(a, engine, 3)
    assert a.swapper.store.tiers[Tier.CPU].num_used_slots == 1
    assert len(store.keys) == 2
    assert a.swapper.metrics.evictions_by_reason["demote_remote"] == 2


def test_on_demote_without_nvme_the_store_is_the_tier_below_the_pinned_pool() -> None:
    store = FakeStore()
    a, engine = make_process(
        store, num_cpu_blocks=4, write_policy=RemoteWritePolicy.ON_DEMOTE,
        cpu_demote_high_watermark=0.75, cpu_demote_low_watermark=0.25,
    )  # fmt: skip
    a.add_request(1, [1, 2, 3, 4, 5, 6, 7], 1, 0.0)
    run_step(a)
    engine.finish()
    a.swapper.begin_step(2)
    a.swapper.end_step()
    # No NVMe: the 2 coldest CPU copies are written, and dropped once written.
    assert sum(c.num_blocks for c in chunks(engine, Direction.CPU_TO_REMOTE)) == 2
    assert a.swapper.store.tiers[Tier.CPU].num_used_slots == 3  # until the write lands
    between_steps(a, engine, 3)
    assert a.swapper.store.tiers[Tier.CPU].num_used_slots == 1
    assert len(store.keys) == 2
    [kept] = [b for b in a.swapper.store.blocks.values() if b.ready_copy(Tier.CPU)]
    # The next request's offload fills the pool again (1 + 3 of 4): the demotion
    # pass writes the one cold block it can take now. The store skips that write:
    # the block keeps its CPU copy, nothing is dropped unwritten.
    a.add_request(2, [20, 21, 22, 23, 24, 25, 26], 1, 0.0)
    run_step(a)
    [write] = chunks(engine, Direction.CPU_TO_REMOTE)[1:]  # after the first pass's one
    assert write.keys == (kept.key,)
    engine.fail_ids.add(write.transfer_id)
    engine.finish()
    a.swapper.begin_step(4)
    assert kept.ready_copy(Tier.CPU) is not None and Tier.REMOTE not in kept.copies
    assert a.swapper.store.tiers[Tier.CPU].num_used_slots == 4
    # While the store is down nothing leaves the pool for it.
    store.up = False
    a.swapper.end_step()
    assert len(chunks(engine, Direction.CPU_TO_REMOTE)) == 2
    assert a.swapper.store.tiers[Tier.CPU].num_used_slots == 4


# ------------------------------------------------------------------ settings, summary


def test_control_settings_read_the_remote_tier_and_name_its_namespace() -> None:
    base = load_config(environ={})
    capacities = base.tier_capacities(1024, slab_needed=False)
    plain = control_settings(base, capacities, block_bytes=1024, model_fingerprint="fp")
    assert plain.remote is None  # no remote_url: no remote tier
    config = load_config(
        environ={},
        overrides={"remote_url": "redis://127.0.0.1:6379/0", "remote_write_policy": "on_demote",
                   "remote_max_inflight_chunks": 3},
    )  # fmt: skip
    settings = control_settings(config, capacities, block_bytes=1024, model_fingerprint="fp")
    assert settings.remote == RemoteSettings(
        namespace="fp", write_policy=RemoteWritePolicy.ON_DEMOTE, max_inflight_write_chunks=3
    )
    named = load_config(
        environ={}, overrides={"remote_url": "redis://h:1/0", "remote_namespace": "team-a"}
    )
    remote = control_settings(named, capacities, block_bytes=1024, model_fingerprint="fp").remote
    assert remote is not None and remote.namespace == "team-a"
    # The plane is built with the index the edge hands it, or without a remote tier.
    plane = build_control_plane(settings, ManualCopyEngine(), lambda: 0.0, FakeStore())
    assert plane.swapper.remote is not None
    assert plane.swapper.remote.settings.write_policy is RemoteWritePolicy.ON_DEMOTE
    assert build_control_plane(settings, ManualCopyEngine(), lambda: 0.0).swapper.remote is None


def test_remote_settings_refuse_what_cannot_work() -> None:
    with pytest.raises(KvSwapError, match="namespace"):
        RemoteSettings("")
    with pytest.raises(KvSwapError, match="max_lookup_blocks"):
        RemoteSettings("fp", max_lookup_blocks=0)


def test_the_summary_has_one_remote_object_with_the_data_planes_counters() -> None:
    store = FakeStore()
    serve_and_write(store, [1, 2, 3, 4, 5])
    b, engine = make_process(store)
    b.add_request(7, [1, 2, 3, 4, 9, 9, 9], 1, 0.0)
    run_step(b)
    between_steps(b, engine, 2)
    between_steps(b, engine, 3)
    extras = {"device": "cpu", "remote": {"outages": 2, "corrupt": 1, "reconnects": 5}}
    summary = build_summary(b, 1.0, StepTotals(1, 1.0, 0.0), extras).to_json()
    remote = summary["remote"]
    assert isinstance(remote, dict)
    assert remote["enabled"] is True
    assert (remote["hit_tokens"], remote["lookups"], remote["found_blocks"]) == (4, 1, 2)
    assert remote["bytes_from_remote"] == 2 * 64 and remote["bytes_to_remote"] == 64
    assert (remote["writes"], remote["misses"], remote["hit_rate"]) == (1, 0, round(2 / 3, 6))
    assert (remote["outages"], remote["corrupt"], remote["reconnects"]) == (2, 1, 5)
    assert (remote["skipped_writes"], remote["already_present"]) == (0, 0)
    assert summary["device"] == "cpu"
    prefix = summary["prefix_hit_tokens"]
    assert isinstance(prefix, dict) and prefix["remote"] == 4
    # Without a remote tier the object is there, all zero and disabled.
    a, _ = make_process(store, remote=False)
    plain = build_summary(a, 1.0, StepTotals(0, 0.0, 0.0), {}).to_json()["remote"]
    assert isinstance(plain, dict) and plain["enabled"] is False and plain["lookups"] == 0


def test_a_sequence_released_while_its_blocks_come_from_the_store_leaves_nothing_behind() -> None:
    store = FakeStore()
    serve_and_write(store, [1, 2, 3, 4, 5])
    b, engine = make_process(store)
    swapper = b.swapper
    # Opened with both blocks found in the store, their fetch started (HIGH)...
    assert swapper.open_sequence(7, [1, 2, 3, 4, 9]) == 4
    swapper.prefetch([7])
    [fetch] = chunks(engine, Direction.REMOTE_TO_CPU)
    # ...and released before it lands (a recompute preemption): the blocks are cache
    # entries now. One key vanished meanwhile, so its read fails.
    swapper.release(7)
    store.keys.discard(fetch.keys[1])
    engine.finish()
    swapper.begin_step(1)
    swapper.check_integrity()
    # The block that arrived stays as cache (CPU + remote); the one that failed had
    # only its remote copy left and nobody needs it: forgotten, not lost.
    kept = [b for b in swapper.store.blocks.values() if b.key is not None]
    assert [(b.token_ids, b.ready_copy(Tier.CPU) is not None) for b in kept] == [([1, 2], True)]
    assert swapper.metrics.lost_blocks == 0 and swapper.metrics.remote_fetch_failures == 1


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("policy", list(RemoteWritePolicy))
def test_random_conversations_over_three_processes_all_complete(
    seed: int, policy: RemoteWritePolicy
) -> None:
    # Seeded: shared system prompts, transfers landing at random, keys vanishing and
    # outages. Every request completes with exactly its own tokens, the store stays
    # consistent at every step, and nothing is counted twice.
    rng = random.Random(seed)
    store = FakeStore()
    found_total = 0
    for process in range(3):
        scheduler, engine = make_process(
            store, num_gpu_blocks=10, num_cpu_blocks=rng.choice([2, 4, 8]),
            num_nvme_blocks=rng.choice([0, 6]), write_policy=policy,
            swap_out_chunk_blocks=2, swap_in_chunk_blocks=2,
            cpu_demote_high_watermark=0.75, cpu_demote_low_watermark=0.5,
        )  # fmt: skip
        for seq_id in range(8):
            system = [rng.choice([1, 2]), 0, 0, 0]
            prompt = [*system, *(rng.randrange(100) for _ in range(rng.randrange(1, 7)))]
            scheduler.add_request(100 * process + seq_id, prompt, rng.randrange(1, 4), 0.0)
        for step in range(400):
            if not scheduler.has_work():
                break
            if store.keys and rng.random() < 0.1:
                store.keys.discard(rng.choice(sorted(store.keys)))  # a TTL ran out
            store.up = rng.random() > 0.1
            for transfer_id in list(engine.pending):
                if rng.random() < 0.5:
                    engine.finish(transfer_id)
            plan, _ = run_step(scheduler, float(step))
            if not plan.seqs and not scheduler.swapper.wait_any():
                engine.finish()
        assert not scheduler.has_work(), f"process {process} stalled"
        store.up = True
        scheduler.swapper.drain()
        scheduler.swapper.check_integrity()
        for seq_id, run in scheduler.runs.items():
            assert run.output_ids == [output_token(seq_id, i) for i in range(run.max_new_tokens)]
        metrics = scheduler.swapper.metrics
        # Found blocks are hits; so are later sequences sharing them before they land.
        assert metrics.prefix_hit_blocks_by_tier[Tier.REMOTE] >= metrics.remote_found_blocks
        found_total += metrics.remote_found_blocks
    if policy is RemoteWritePolicy.OFF:
        assert found_total == 0 and store.keys == set()  # nobody ever wrote
