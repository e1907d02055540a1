"""Narrated scenarios on tiny pools: what the swapper does, step by step."""

from __future__ import annotations

from kvswap.base.tier import Tier
from kvswap.base.transfer import Direction, Priority
from kvswap.control.policy import PolicyOptions
from kvswap.control.settings import SwapSettings
from kvswap.control.store_records import StoreLayout
from kvswap.control.swapper import Swapper, TierOccupancy
from tests.manual_engine import ManualCopyEngine
from tests.unit.remote_control_support import RemoteEngine, slab_tier

BT = 4  # tokens per block: tiny, so a few tokens fill a block


def make(
    gpu: int = 8,
    cpu: int = 8,
    nvme: int = 0,
    protected: int = 0,
    min_residency: int = 0,
    high: float = 0.75,
    low: float = 0.5,
    out_chunk: int = 2,
    in_chunk: int = 2,
    cost_aware: bool = True,
) -> tuple[Swapper, ManualCopyEngine]:
    """A swapper on tiny pools; `nvme` > 0: an NVMe slab of that many blocks below."""
    engine, keyed = slab_tier(nvme) if nvme else (ManualCopyEngine(), [])
    swapper = Swapper(
        StoreLayout(BT, gpu, cpu, protected),
        PolicyOptions(
            sink_protection=protected > 0, min_residency_steps=min_residency, cost_aware=cost_aware
        ),
        SwapSettings(
            block_bytes=100,
            swap_out_high_watermark=high,
            swap_out_low_watermark=low,
            swap_out_chunk_blocks=out_chunk,
            swap_in_chunk_blocks=in_chunk,
            cpu_demote_high_watermark=0.75,
            cpu_demote_low_watermark=0.5,
        ),
        engine,
        clock_s=lambda: 0.0,
        keyed=keyed,
    )
    return swapper, engine


def slab_keys(engine: ManualCopyEngine) -> set[bytes]:
    """The keys the NVMe slab below holds."""
    assert isinstance(engine, RemoteEngine)
    return engine.store.keys


def add_paused(swapper: Swapper, seq_id: int, num_blocks: int, first_token: int = 0) -> None:
    """A sequence of `num_blocks` full blocks that ran once and is now paused."""
    tokens = list(range(first_token, first_token + num_blocks * BT))
    swapper.open_sequence(seq_id, tokens)
    assert swapper.allocate(seq_id, tokens)
    swapper.set_running(seq_id, False)


def gpu_used(swapper: Swapper) -> int:
    return swapper.store.tiers[Tier.GPU].num_used_slots


def test_watermark_crossing_swaps_out_down_to_the_low_watermark_in_chunks() -> None:
    # 8 GPU slots, high 0.75 (6 slots), low 0.5 (4 slots), chunks of 2 blocks.
    swapper, engine = make()
    add_paused(swapper, 1, 3)
    add_paused(swapper, 2, 2, first_token=100)
    swapper.end_step()
    # 5 of 8 used: below the high watermark, nothing moves.
    assert engine.submitted == []
    add_paused(swapper, 3, 2, first_token=200)
    swapper.end_step()
    # 7 of 8 used (>= 6): 3 blocks go, as chunks of 2 + 1, on the low-priority queue.
    assert [c.num_blocks for c in engine.submitted] == [2, 1]
    assert all(c.direction is Direction.GPU_TO_CPU for c in engine.submitted)
    assert all(c.priority is Priority.LOW for c in engine.submitted)
    # The GPU slots stay taken until the copies are done: no slot reused mid-transfer.
    assert gpu_used(swapper) == 7
    engine.finish()
    swapper.begin_step(1)
    assert gpu_used(swapper) == 4
    swapper.check_integrity()


def test_sink_blocks_of_a_paused_sequence_stay_on_the_gpu() -> None:
    # Protect the first 2 blocks of each sequence; force everything evictable out.
    swapper, engine = make(gpu=8, protected=2, high=0.5, low=0.0)
    add_paused(swapper, 1, 4)
    add_paused(swapper, 2, 4, first_token=100)
    swapper.end_step()
    engine.finish()
    swapper.begin_step(1)
    for seq_id in (1, 2):
        blocks = swapper.store.sequence_blocks(seq_id)
        assert [Tier.GPU in b.copies for b in blocks] == [True, True, False, False]
    assert swapper.metrics.protected_block_saves == 4
    swapper.check_integrity()


def test_without_sink_protection_plain_lru_evicts_the_oldest_blocks_first() -> None:
    swapper, engine = make(gpu=8, protected=0, high=0.5, low=0.25, cost_aware=False)
    add_paused(swapper, 1, 4)
    add_paused(swapper, 2, 4, first_token=100)
    swapper.end_step()
    engine.finish()
    swapper.begin_step(1)
    # Sequence 1's blocks (least recently used) leave first, its head included.
    assert [Tier.GPU in b.copies for b in swapper.store.sequence_blocks(1)] == [False] * 4
    assert swapper.metrics.protected_block_saves == 0


def test_min_residency_keeps_a_swapped_in_block_for_the_window() -> None:
    swapper, engine = make(gpu=4, cpu=8, min_residency=3, high=0.5, low=0.0)
    add_paused(swapper, 1, 2)
    swapper.end_step()  # 2 of 4 used: at the watermark, both swapped out
    engine.finish()
    swapper.begin_step(1)
    assert gpu_used(swapper) == 0
    # Bring them back (resume), then pause again at once.
    swapper.prefetch([1])
    engine.finish()
    swapper.begin_step(2)
    assert gpu_used(swapper) == 2
    for step in (2, 3, 4):
        swapper.begin_step(step)
        swapper.end_step()
        engine.finish()
        assert gpu_used(swapper) == 2, f"evicted inside the residency window at step {step}"
    swapper.begin_step(5)  # window over: 2 + 3 = 5
    swapper.end_step()
    # They had a ready CPU copy, so leaving is a drop, not a second transfer.
    assert gpu_used(swapper) == 0
    assert swapper.metrics.evictions_by_reason["watermark_drop"] == 2


def test_cold_cpu_copies_are_demoted_to_nvme_past_the_cpu_watermark() -> None:
    swapper, engine = make(gpu=8, cpu=4, nvme=8, high=0.25, low=0.0)
    add_paused(swapper, 1, 4)
    swapper.end_step()  # 4 blocks GPU -> CPU
    engine.finish()
    swapper.begin_step(1)
    assert swapper.store.tiers[Tier.CPU].num_used_slots == 4
    swapper.end_step()  # CPU 4/4 >= 0.75: demote down to 0.5, written to the slab
    demotions = [c for c in engine.submitted if c.direction is Direction.CPU_TO_NVME]
    assert sum(c.num_blocks for c in demotions) == 2
    engine.finish()
    swapper.begin_step(2)
    assert swapper.store.tiers[Tier.CPU].num_used_slots == 2
    assert len(slab_keys(engine)) == 2
    # Resuming brings NVMe blocks up through the CPU.
    swapper.set_running(1, True)
    assert swapper.wait_ready([1]).not_ready == ()
    assert all(b.ready_copy(Tier.GPU) for b in swapper.store.sequence_blocks(1))
    swapper.check_integrity()


def test_a_full_pinned_pool_sends_copies_below_mid_step_for_what_must_leave_the_gpu() -> None:
    # GPU 4, CPU 2, NVMe 8. Sequence 1's two blocks fill the pinned pool (their only copies).
    swapper, engine = make(gpu=4, cpu=2, nvme=8, high=1.0, low=0.9)
    add_paused(swapper, 1, 2)
    assert swapper.ensure_gpu_slots(4)
    engine.finish()
    swapper.begin_step(1)
    assert swapper.store.tiers[Tier.CPU].num_used_slots == 2
    # Sequence 2 fills the GPU; a new block of sequence 3 finds no room: the GPU's victims
    # have nowhere to go, and end_step's demotion would come after the step, too late.
    add_paused(swapper, 2, 4, first_token=100)
    swapper.open_sequence(3, [900])
    swapper.set_running(3, True)
    assert not swapper.allocate(3, [900])
    # Mid-step, the pinned pool's coldest copy goes to NVMe now (HIGH queue), and the
    # call waits for it: one slot free, and the allocation goes through.
    assert swapper.make_cpu_room(1) == 1
    down = [c for c in engine.submitted if c.direction is Direction.CPU_TO_NVME]
    assert [(c.num_blocks, c.priority) for c in down] == [(1, Priority.HIGH)]
    assert len(slab_keys(engine)) == 1
    assert swapper.allocate(3, [900])
    # With the room there already, nothing moves.
    engine.finish()
    swapper.begin_step(2)
    assert swapper.make_cpu_room(0) == 0
    swapper.check_integrity()


def test_identical_prefixes_share_blocks_and_a_later_turn_finds_them_on_cpu() -> None:
    swapper, engine = make(gpu=8, cpu=8)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    swapper.open_sequence(1, prompt)
    assert swapper.allocate(1, prompt)
    swapper.end_step()  # the step computed sequence 1's blocks: now they can be shared
    assert swapper.open_sequence(2, prompt) == 2 * BT
    assert swapper.allocate(2, prompt[2 * BT :])
    shared = swapper.store.sequence_blocks(1)[:2]
    assert shared == swapper.store.sequence_blocks(2)[:2]
    assert [b.ref_count for b in shared] == [2, 2]
    swapper.finish(1)
    swapper.finish(2)  # finished: offloaded at once, low priority
    assert sum(c.num_blocks for c in engine.submitted) == 2
    engine.finish()
    swapper.begin_step(1)
    # Push them off the GPU, then a later turn with the same prefix finds them on the CPU.
    swapper.ensure_gpu_slots(8)
    turn2 = [*prompt, 50, 51, 52]
    assert swapper.open_sequence(3, turn2) == 2 * BT
    assert swapper.metrics.prefix_hit_blocks_by_tier[Tier.CPU] == 2
    swapper.check_integrity()


def test_full_gpu_with_only_dirty_victims_is_a_counted_sync_stall_not_a_crash() -> None:
    swapper, _ = make(gpu=4, cpu=8, high=1.0, low=0.9)
    add_paused(swapper, 1, 4)
    swapper.open_sequence(2, [900])
    swapper.set_running(2, True)
    assert swapper.allocate(2, [900])  # needs a slot: waits for one swap-out
    assert swapper.metrics.sync_stalls == 1
    swapper.check_integrity()


def test_when_nothing_can_leave_allocation_says_no_and_changes_nothing() -> None:
    swapper, _ = make(gpu=2, cpu=0)
    swapper.open_sequence(1, list(range(8)))
    swapper.set_running(1, True)
    assert swapper.allocate(1, list(range(8)))
    assert not swapper.allocate(1, [99])
    assert swapper.store.sequences[1].num_tokens == 8
    swapper.check_integrity()


def test_a_failed_swap_out_keeps_the_gpu_copy() -> None:
    swapper, engine = make(gpu=4, cpu=8, high=0.5, low=0.0, out_chunk=4)
    add_paused(swapper, 1, 2)
    swapper.end_step()
    engine.fail_ids.add(engine.submitted[0].transfer_id)
    engine.finish()
    swapper.begin_step(1)
    blocks = swapper.store.sequence_blocks(1)
    assert all(b.ready_copy(Tier.GPU) for b in blocks)
    assert all(Tier.CPU not in b.copies for b in blocks)
    assert swapper.metrics.failed_transfers == 1
    swapper.check_integrity()


# --- a full NVMe slab evicts: the newest finished conversations reach it ----------------


def make_nvme_tiers() -> tuple[Swapper, ManualCopyEngine]:
    """4 GPU, 4 CPU slots, an NVMe slab of 4 blocks; whatever the GPU holds past half
    goes down to the CPU, and whatever the CPU holds past half is written to the slab,
    all of it."""
    engine, keyed = slab_tier(4)
    swapper = Swapper(
        StoreLayout(BT, 4, 4, 0),
        PolicyOptions(sink_protection=False, min_residency_steps=0),
        SwapSettings(
            block_bytes=100,
            swap_out_high_watermark=0.5,
            swap_out_low_watermark=0.0,
            swap_out_chunk_blocks=4,
            swap_in_chunk_blocks=4,
            cpu_demote_high_watermark=0.5,
            cpu_demote_low_watermark=0.0,
        ),
        engine,
        clock_s=lambda: 0.0,
        keyed=keyed,
    )
    return swapper, engine


def settle(swapper: Swapper, engine: ManualCopyEngine) -> None:
    """Steps with every transfer finishing at once, until the KV has moved down."""
    for _ in range(3):
        swapper.end_step()
        engine.finish()
        swapper.begin_step(0)
    swapper.check_integrity()


def add_finished(swapper: Swapper, engine: ManualCopyEngine, seq_id: int, first: int) -> None:
    """A request of 2 full blocks that ran once and finished; its KV settles down."""
    tokens = list(range(first, first + 2 * BT))
    swapper.open_sequence(seq_id, tokens)
    swapper.set_running(seq_id, True)
    assert swapper.allocate(seq_id, tokens)
    swapper.end_step()  # computed: published for prefix reuse
    swapper.finish(seq_id)
    settle(swapper, engine)


def nvme_tokens(swapper: Swapper) -> list[int]:
    """The first token of every block on NVMe, sorted: whose KV the slab holds."""
    return sorted(b.token_ids[0] for b in swapper.store.blocks.values() if Tier.NVME in b.copies)


def hits_on(swapper: Swapper, seq_id: int, first: int) -> int:
    """Blocks a later turn (the 2 blocks from `first`, then one new token) finds; the
    turn ends at once, so its blocks are cache entries again."""
    hit_tokens = swapper.open_sequence(seq_id, [*range(first, first + 2 * BT), 9999])
    swapper.release(seq_id)
    return hit_tokens // BT


def test_a_full_nvme_tier_evicts_its_oldest_cache_entries_for_newer_demotions() -> None:
    swapper, engine = make_nvme_tiers()
    metrics = swapper.metrics.evictions_by_reason
    # Two finished conversations (tokens 0.. and 100..) go GPU -> CPU -> NVMe:
    # the slab is full of unreferenced blocks, nothing else holds a copy.
    add_finished(swapper, engine, 1, first=0)
    add_finished(swapper, engine, 2, first=100)
    assert nvme_tokens(swapper) == [0, 4, 100, 104]
    assert len(slab_keys(engine)) == 4  # full
    assert swapper.occupancy()[Tier.NVME] == TierOccupancy(4, 4, 4)  # reported as a tier
    assert (metrics["demote_remote"], metrics["nvme_discard"]) == (4, 0)

    # A third conversation finishes. Its writes find the slab full: the slab's least
    # recently used keys (conversation 1's) are evicted, and the store forgets those
    # blocks at the next step (they had no other copy); conversation 3 takes their room.
    add_finished(swapper, engine, 3, first=200)
    assert nvme_tokens(swapper) == [100, 104, 200, 204]
    assert (metrics["demote_remote"], metrics["nvme_discard"]) == (6, 2)

    # A later turn of the newest conversation finds its prefix on NVMe; the oldest
    # conversation's is gone.
    newest = [b for b in swapper.store.blocks.values() if b.token_ids[0] in (200, 204)]
    assert [list(b.copies) for b in newest] == [[Tier.NVME], [Tier.NVME]]
    assert hits_on(swapper, 10, first=200) == 2
    assert hits_on(swapper, 11, first=0) == 0
    swapper.check_integrity()


def test_a_paused_sequence_takes_nvme_room_from_cache_entries_and_is_never_dropped() -> None:
    swapper, engine = make_nvme_tiers()
    metrics = swapper.metrics.evictions_by_reason
    add_finished(swapper, engine, 1, first=0)
    add_finished(swapper, engine, 2, first=100)
    assert nvme_tokens(swapper) == [0, 4, 100, 104]  # full, of unreferenced blocks only

    # A paused sequence (300..) is swapped out and demoted: the slab holds its keys
    # (the store asks it to), and its least recently used free keys (conversation 1's)
    # leave.
    add_paused(swapper, 3, 2, first_token=300)
    settle(swapper, engine)
    assert nvme_tokens(swapper) == [100, 104, 300, 304]
    paused = swapper.store.sequence_blocks(3)
    assert [sorted(t.value for t in b.copies) for b in paused] == [["nvme"], ["nvme"]]

    # A newer conversation of 4 blocks finishes and demotes: only conversation 2's
    # cache entries and its own may leave the slab. The paused sequence's blocks,
    # whose NVMe copy is their only one, are held there and never do.
    tokens = list(range(400, 400 + 4 * BT))
    swapper.open_sequence(4, tokens)
    swapper.set_running(4, True)
    assert swapper.allocate(4, tokens)
    swapper.end_step()
    swapper.finish(4)
    settle(swapper, engine)
    # Its blocks landed on the CPU tail first (the head most recent), so its tail
    # (408, 412) left the pinned pool first and took conversation 2's room. Its head
    # (400, 404) followed and, the least recently used free keys then, displaced its
    # own tail: the head, through which the tail is found, stays.
    assert nvme_tokens(swapper) == [300, 304, 400, 404]
    assert metrics["nvme_discard"] == 6
    assert [sorted(t.value for t in b.copies) for b in paused] == [["nvme"], ["nvme"]]

    # The paused sequence resumes with all its KV.
    swapper.set_running(3, True)
    assert swapper.wait_ready([3]).not_ready == ()
    assert all(b.ready_copy(Tier.GPU) for b in paused)
    swapper.check_integrity()
