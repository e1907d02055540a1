"""Narrated scenarios: the remote tier's write-behind, on tiny pools
(the fake store and processes: remote_control_support.py)."""

from __future__ import annotations

import pytest

from kvswap.base.eviction_policy import BlockKey
from kvswap.base.tier import Tier
from kvswap.base.transfer import Direction, Priority, TransferChunk
from kvswap.base.write_policy import RemoteWritePolicy
from kvswap.control.scheduler import Scheduler
from tests.manual_engine import ManualCopyEngine
from tests.unit.remote_control_support import (
    FakeStore,
    LocalSlab,
    between_steps,
    extend_a_stored_prefix,
    make_process,
    serve_and_write,
)
from tests.unit.scheduler_support import chunks, computed, run_step

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


def test_a_pinned_block_the_store_holds_still_goes_to_nvme_when_nvme_has_room() -> None:
    """The store's copy makes a pinned copy free to drop only when no local tier below
    takes it: the store evicts by its own rules and reads slower than the NVMe slab."""
    store = FakeStore()
    a, engine = make_process(store, num_cpu_blocks=4, slab=LocalSlab(8))
    a.add_request(1, [1, 2, 3, 4, 5, 6, 7], 1, 0.0)
    run_step(a)
    between_steps(a, engine, 2)
    between_steps(a, engine, 3)
    full = [b for b in a.swapper.store.blocks.values() if b.key is not None]
    assert len(full) == 3 and all(b.ready_copy(Tier.REMOTE) for b in full)  # on finish
    a.swapper.demoter.make_room_now(Tier.CPU, 3)  # 3 of 4 slots used: 2 must leave
    assert [c.num_blocks for c in chunks(engine, Direction.CPU_TO_NVME)] == [2]
    assert dict(a.swapper.metrics.evictions_by_reason) == {"demote_remote": 2}  # no free drop
    between_steps(a, engine, 4)
    assert sum(b.ready_copy(Tier.NVME) is not None for b in full) == 2
    assert a.swapper.store.tiers[Tier.CPU].num_used_slots == 1


def test_a_block_already_in_the_store_is_not_written_again() -> None:
    store = FakeStore()
    # B restores [1 2] [3 4] and computes [9 9] [9]; at its finish only [9 9] is new.
    b, engine = extend_a_stored_prefix(store)
    writes = chunks(engine, Direction.CPU_TO_REMOTE)
    assert sum(c.num_blocks for c in writes) == 1
    assert b.swapper.metrics.remote_writes == 1
    assert len(store.keys) == 3


def finished_request_write() -> tuple[FakeStore, Scheduler, ManualCopyEngine, TransferChunk]:
    """One 5-token request finished; its two full blocks' write to the store submitted
    (not yet done): the store, the process, its copy engine and the write chunk."""
    store = FakeStore()
    a, engine = make_process(store)
    a.add_request(1, [1, 2, 3, 4, 5], 1, 0.0)
    run_step(a)
    engine.finish()
    a.swapper.begin_step(2)
    a.swapper.end_step()
    [write] = chunks(engine, Direction.CPU_TO_REMOTE)
    return store, a, engine, write


def test_a_write_the_store_fails_or_skips_gives_no_remote_copy_and_loses_nothing() -> None:
    _, a, engine, write = finished_request_write()
    engine.fail_ids.add(write.transfer_id)  # the store client skipped it
    between_steps(a, engine, 3)
    full = [b for b in a.swapper.store.blocks.values() if b.key is not None]
    assert all(Tier.REMOTE not in b.copies for b in full)
    assert all(b.ready_copy(Tier.CPU) for b in full)  # the CPU copies are intact
    metrics = a.swapper.metrics
    assert (metrics.remote_writes, metrics.remote_write_failures) == (0, 2)
    assert metrics.failed_transfers == 0 and metrics.lost_blocks == 0
    # Regression: the bytes of a write that failed were counted as moved.
    assert metrics.bytes_by_direction[Direction.CPU_TO_REMOTE] == 0
    assert metrics.snapshot()["bytes_cpu_to_remote"] == 0
    assert metrics.transfers_by_direction[Direction.CPU_TO_REMOTE] == 1  # it was tried


def test_only_the_blocks_a_write_stored_count_as_bytes_to_the_store() -> None:
    # Regression: bytes_cpu_to_remote counted every block of a write chunk, also
    # those the store refused. A two-block write, the second block refused (OOM):
    # one block (64 bytes) moved.
    store, a, engine, write = finished_request_write()
    assert write.num_blocks == 2
    store.refused.add(write.keys[1])
    between_steps(a, engine, 3)
    assert store.keys == {write.keys[0]}
    metrics = a.swapper.metrics
    assert (metrics.remote_writes, metrics.remote_write_failures) == (1, 1)
    assert metrics.snapshot()["bytes_cpu_to_remote"] == 64


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
    # 4 pinned slots, demotion from 0.75 down to 0.25; an NVMe slab below.
    a, engine = make_process(
        store, num_cpu_blocks=4, slab=LocalSlab(8), write_policy=RemoteWritePolicy.ON_DEMOTE,
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


def test_on_demote_without_nvme_a_pass_stops_once_the_store_has_no_room_for_writes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = FakeStore()
    # One write of one block in flight at most; the pinned pool demotes past 6 of 12.
    a, engine = make_process(
        store, num_gpu_blocks=16, num_cpu_blocks=12, swap_out_chunk_blocks=1,
        max_inflight_write_chunks=1, write_policy=RemoteWritePolicy.ON_DEMOTE,
        cpu_demote_high_watermark=0.5, cpu_demote_low_watermark=0.25,
    )  # fmt: skip
    a.add_request(1, list(range(1, 22)), 1, 0.0)  # 10 full blocks and a partial one
    run_step(a)
    engine.finish()  # the finish offload lands: 10 ready CPU copies, none written yet
    a.swapper.begin_step(2)
    policy = a.swapper.store.policies[Tier.CPU]
    asked: list[int] = []
    evict = policy.evict

    def counted(n: int, **kwargs: bool) -> list[BlockKey] | None:
        asked.append(n)
        return evict(n, **kwargs)

    monkeypatch.setattr(policy, "evict", counted)
    a.swapper.end_step()
    # The coldest block is written (the room for one write); the next victim could
    # only leave by a write too, so the pass stops there instead of looking past
    # every copy of the pool (each looked at is ranked again when the pass ends).
    assert sum(c.num_blocks for c in chunks(engine, Direction.CPU_TO_REMOTE)) == 1
    assert len(asked) == 2
    a.swapper.check_integrity()
    # Each landed write makes room for the next: a block a step leaves, each pass
    # looking at two victims at most, until the pool is under its high watermark.
    for step in range(3, 9):
        asked.clear()
        between_steps(a, engine, step)
        assert len(asked) <= 2
    assert a.swapper.store.tiers[Tier.CPU].num_used_slots == 5
    assert len(store.keys) == 5
