"""Narrated scenarios on tiny pools: what the scheduler does, step by step.

Every pool here is a handful of 2-token blocks and the copy engine is the
manual one: a chunk completes only when the test says `engine.finish()` (or
when the scheduler itself waits for it, which the manual engine grants at
once). A step is `schedule -> (the model) -> complete`; the "model" samples
`1000 + 100 * seq_id + i` as sequence `seq_id`'s i-th output token, so the
token ids in the assertions tell whose token is where. The scheduler is
driven only through its public API; block placement is read from the store,
never changed. Tests marked DISCREPANCY pin down behaviour that differs from
the documented intent; when the code is fixed, flip their assertions.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvswap.base.tier import Tier
from kvswap.base.transfer import Direction, Priority
from kvswap.control.policy import PolicyOptions
from kvswap.control.remote_tier import KeyedTier
from kvswap.control.scheduler import Scheduler
from kvswap.control.scheduler_records import FinishReason, Preemption, SchedulerSettings
from kvswap.control.settings import SwapSettings
from kvswap.control.store_records import StoreLayout
from kvswap.control.swapper import Swapper
from tests.manual_engine import ManualCopyEngine
from tests.unit.remote_control_support import slab_tier
from tests.unit.scheduler_support import chunks, computed, output_token, placement, run_step

BLOCK_TOKENS = 2


def make_scheduler(
    *,
    num_gpu_blocks: int,
    num_cpu_blocks: int = 0,
    protected_blocks: int = 0,
    min_residency_steps: int = 0,
    swap_out_high_watermark: float = 1.0,
    swap_out_low_watermark: float = 1.0,
    swap_in_chunk_blocks: int = 4,
    swap_out_chunk_blocks: int = 4,
    cpu_demote_high_watermark: float = 1.0,
    cpu_demote_low_watermark: float = 1.0,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    preemption: Preemption = Preemption.SWAP,
    engine: ManualCopyEngine | None = None,
    keyed: Sequence[KeyedTier] = (),
) -> tuple[Scheduler, ManualCopyEngine]:
    """The one place that builds a control plane for these tests (keywords only, so a
    constructor change is fixed here). Defaults: watermarks at 1.0, so nothing is
    swapped out or demoted ahead of need and admission may use the whole GPU."""
    engine = engine if engine is not None else ManualCopyEngine()
    layout = StoreLayout(
        block_tokens=BLOCK_TOKENS,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=num_cpu_blocks,
        protected_blocks=protected_blocks,
    )
    options = PolicyOptions(
        sink_protection=protected_blocks > 0,
        min_residency_steps=min_residency_steps,
        cost_aware=True,
    )
    swap = SwapSettings(
        block_bytes=64,
        swap_out_high_watermark=swap_out_high_watermark,
        swap_out_low_watermark=swap_out_low_watermark,
        swap_out_chunk_blocks=swap_out_chunk_blocks,
        swap_in_chunk_blocks=swap_in_chunk_blocks,
        cpu_demote_high_watermark=cpu_demote_high_watermark,
        cpu_demote_low_watermark=cpu_demote_low_watermark,
    )
    swapper = Swapper(layout, options, swap, engine, clock_s=lambda: 0.0, keyed=keyed)
    settings = SchedulerSettings(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        preemption=preemption,
    )
    return Scheduler(swapper, settings), engine


def num_used_blocks(scheduler: Scheduler, tier: Tier) -> int:
    return scheduler.swapper.store.tiers[tier].num_used_slots


def test_admission_keeps_the_blocks_nobody_can_evict_under_the_low_watermark() -> None:
    # 8 GPU blocks, low watermark 0.5: running blocks (nobody can evict them) may
    # fill at most 4 blocks after a newcomer joins; the newcomer counts its prompt
    # blocks plus one to grow into.
    scheduler, _ = make_scheduler(num_gpu_blocks=8, swap_out_low_watermark=0.5)
    scheduler.add_request(1, [1, 2, 3, 4], 4, 0.0)
    scheduler.add_request(2, [11], 1, 1.0)
    scheduler.add_request(3, [21, 22, 23, 24], 1, 1.0)

    # Step 1: the GPU is empty; the first sequence may always run if it fits at all.
    plan, _ = run_step(scheduler, 0.0)
    assert computed(plan) == [(1, (1, 2, 3, 4), 0)]
    assert placement(scheduler, 1) == ["gpu", "gpu"]

    # Step 2: sequence 1 holds 2 running blocks. Sequence 2 needs 1 + 1 = 2:
    # 2 + 2 = 4 <= 4, admitted. Sequence 3 needs 2 + 1 = 3: 2 + 3 = 5 > 4, so it
    # waits, although 6 of the 8 GPU blocks are free.
    plan, finished = run_step(scheduler, 1.0)
    assert computed(plan) == [(1, (1100,), 4), (2, (11,), 0)]
    assert finished == [2]  # one token wanted, one sampled
    assert list(scheduler.waiting) == [3]
    assert scheduler.runs[3].admitted_s is None

    # Steps 3-4: sequence 1 now holds 3 running blocks (3 + 3 > 4): 3 still waits.
    # Sequence 1 samples its 4th token in step 4 and finishes.
    for now_s in (2.0, 3.0):
        plan, finished = run_step(scheduler, now_s)
        assert [item.seq_id for item in plan.seqs] == [1]
        assert list(scheduler.waiting) == [3]
    assert finished == [1]

    # Step 5: sequence 1's full blocks stay as prefix cache, but unreferenced they
    # are evictable, so they no longer count: sequence 3 is admitted.
    plan, _ = run_step(scheduler, 4.0)
    assert computed(plan) == [(3, (21, 22, 23, 24), 0)]
    assert scheduler.runs[3].admitted_s == 4.0
    assert num_used_blocks(scheduler, Tier.GPU) == 3 + 2  # cache + sequence 3


def test_requests_admitted_in_one_step_are_checked_one_at_a_time() -> None:
    # Each waiting request is checked against the low watermark on its own: the
    # blocks of a request admitted earlier in the same step are allocated only
    # after admission, so a burst may overshoot the ceiling and preemption then
    # makes room. (Counting them made admission stricter and cost throughput.)
    scheduler, _ = make_scheduler(num_gpu_blocks=8, swap_out_low_watermark=0.5)
    scheduler.add_request(1, [1, 2, 3, 4], 4, 0.0)
    scheduler.add_request(2, [11, 12, 13, 14], 4, 0.0)

    # The first runs alone (ceil(5 / 2) = 3 blocks); the second needs 2 + 1 = 3
    # more and is checked against 0 pinned blocks: 3 <= 0.5 x 8, so both run.
    plan, _ = run_step(scheduler, 0.0)
    assert [item.seq_id for item in plan.seqs] == [1, 2]
    run_step(scheduler, 1.0)
    # Both grew into a third block: 6 running blocks, past the 4-block ceiling.
    assert num_used_blocks(scheduler, Tier.GPU) == 6
    assert scheduler.running == [1, 2]


def test_a_request_accepted_at_intake_is_admitted_on_an_empty_gpu() -> None:
    # Regression: `add_request` accepts a request if prompt + max_new_tokens fit
    # the GPU tier (ceil((7 + 1) / 2) = 4 <= 4 blocks), but `_admit` once asked for
    # ceil(7 / 2) + 1 = 5 blocks (a whole block to grow, though the prompt's last
    # block has room for the next token), so it waited forever on an empty GPU.
    # Alone on the GPU a request now asks for its exact bill.
    scheduler, _ = make_scheduler(num_gpu_blocks=4)
    scheduler.add_request(1, [1, 2, 3, 4, 5, 6, 7], 1, 0.0)
    assert scheduler.runs[1].rejected_reason is None

    plan, finished = run_step(scheduler, 0.0)
    assert computed(plan) == [(1, (1, 2, 3, 4, 5, 6, 7), 0)]
    assert finished == [1]


def test_a_preempted_sequence_resumes_before_a_new_request_is_admitted() -> None:
    # 6 GPU blocks, 8 CPU blocks. Sequence 2 is preempted by sequence 1's growth;
    # sequence 3 arrives later and would fit, but must wait for sequence 2.
    scheduler, engine = make_scheduler(num_gpu_blocks=6, num_cpu_blocks=8)
    scheduler.add_request(1, [1, 2, 3, 4], 6, 0.0)
    scheduler.add_request(2, [11, 12, 13, 14], 4, 1.0)
    scheduler.add_request(3, [21], 2, 4.0)

    # Steps 1-3: 1 runs, 2 joins at step 2; by step 3 they hold 3 + 3 = 6 blocks.
    for now_s in (0.0, 1.0, 2.0):
        run_step(scheduler, now_s)
    assert scheduler.running == [1, 2]
    assert num_used_blocks(scheduler, Tier.GPU) == 6

    # Step 4: sequence 1's 7th token needs a 4th block; the GPU is full of running
    # blocks, so the newest, sequence 2, is swapped out to the CPU.
    plan, _ = run_step(scheduler, 3.0)
    assert computed(plan) == [(1, (1102,), 6)]
    assert list(scheduler.preempted) == [2]
    assert placement(scheduler, 2) == ["cpu", "cpu", "cpu"]

    # Steps 5-6: sequence 3 has arrived. Alone it would fit (4 running blocks + 1
    # prompt block + 1 to grow = 6 <= 6), but a preempted sequence is ahead of it:
    # sequence 2 needs its 3 blocks back + 1 (4 + 4 > 6), so nobody joins.
    plan, _ = run_step(scheduler, 4.0)
    assert [item.seq_id for item in plan.seqs] == [1]
    assert scheduler.swapper.may_join_running(2, batch_is_empty=False)
    assert list(scheduler.preempted) == [2]
    assert list(scheduler.waiting) == [3]
    plan, finished = run_step(scheduler, 5.0)
    assert finished == [1]
    assert list(scheduler.waiting) == [3]

    # Sequence 1's full blocks are being offloaded (busy, so not yet evictable);
    # the copy lands before the next step.
    engine.finish()

    # Step 7: sequence 2 resumes first, where it left off (position 5, nothing
    # recomputed), its blocks swapped in on the HIGH queue; then 3 is admitted.
    plan, _ = run_step(scheduler, 6.0)
    assert computed(plan) == [(2, (1201,), 5), (3, (21,), 0)]
    assert scheduler.running == [2, 3]
    swap_ins = chunks(engine, Direction.CPU_TO_GPU)
    assert swap_ins and all(chunk.priority is Priority.HIGH for chunk in swap_ins)
    assert scheduler.recomputed_tokens == 0


def test_preemption_swaps_out_the_newest_running_sequence() -> None:
    # 6 GPU blocks, 8 CPU blocks; three sequences arrive one step apart.
    scheduler, engine = make_scheduler(num_gpu_blocks=6, num_cpu_blocks=8)
    scheduler.add_request(1, [1, 2], 8, 0.0)
    scheduler.add_request(2, [11, 12], 3, 1.0)
    scheduler.add_request(3, [21, 22, 23], 2, 2.0)

    # Steps 1-3: all three join; after step 3 they hold 2 + 2 + 2 = 6 blocks.
    for now_s in (0.0, 1.0, 2.0):
        run_step(scheduler, now_s)
    assert scheduler.running == [1, 2, 3]
    assert num_used_blocks(scheduler, Tier.GPU) == 6

    # Step 4: sequence 1 (the oldest) reaches position 4 and needs a third block.
    # Every GPU block is running, so the newest, sequence 3, is preempted by swap:
    # its 2 blocks go down on the LOW queue, and sequence 1's allocation waits for
    # that copy (a counted synchronous stall). Sequence 2, older, keeps running.
    plan, finished = run_step(scheduler, 3.0)
    assert computed(plan) == [(1, (1102,), 4), (2, (1201,), 3)]
    assert finished == [2]
    assert list(scheduler.preempted) == [3]
    assert scheduler.runs[3].num_preemptions == 1
    assert scheduler.runs[1].num_preemptions == scheduler.runs[2].num_preemptions == 0
    assert placement(scheduler, 3) == ["cpu", "cpu"]
    swap_out = chunks(engine, Direction.GPU_TO_CPU)[0]  # then 2's offload (finished)
    assert (swap_out.priority, swap_out.num_blocks) == (Priority.LOW, 2)
    metrics = scheduler.swapper.metrics
    assert metrics.evictions_by_reason["preempt_swap_out"] == 2
    assert metrics.sync_stalls == 1

    # From here every copy lands between steps. Sequence 3 resumes at position 3
    # with its own KV (nothing recomputed), and everyone finishes.
    now_s = 4.0
    while scheduler.has_work():
        engine.finish()
        run_step(scheduler, now_s)
        now_s += 1.0
    assert scheduler.runs[3].output_ids == [output_token(3, 0), output_token(3, 1)]
    assert scheduler.runs[3].num_preemptions == 1
    assert scheduler.recomputed_tokens == 0
    assert sorted(scheduler.finished) == [1, 2, 3]


def test_recompute_preemption_drops_the_kv_and_recomputes_it() -> None:
    # The same three sequences, preemption = recompute, no CPU tier at all.
    scheduler, engine = make_scheduler(num_gpu_blocks=6, preemption=Preemption.RECOMPUTE)
    scheduler.add_request(1, [1, 2], 8, 0.0)
    scheduler.add_request(2, [11, 12], 3, 1.0)
    scheduler.add_request(3, [21, 22, 23], 2, 2.0)
    for now_s in (0.0, 1.0, 2.0):
        run_step(scheduler, now_s)
    assert placement(scheduler, 3) == ["gpu", "gpu"]  # [21 22] full, [23] partial

    # Step 4: sequence 1 needs a block; the newest, sequence 3, is preempted by
    # dropping its KV: no transfer, its table is gone. Its full block [21 22]
    # stays as unreferenced prefix cache; the partial block [23] is freed, and
    # that is the slot sequence 1 gets.
    plan, _ = run_step(scheduler, 3.0)
    assert [item.seq_id for item in plan.seqs] == [1, 2]
    assert list(scheduler.preempted) == [3]
    assert not scheduler.swapper.holds_kv(3)
    assert engine.submitted == []

    # Step 5: sequence 3 starts over (back to the waiting queue, then admitted).
    # Its prefix [21 22] is still cached, so the step computes from position 2:
    # 23 again (recomputed: 1 token) and its output 1300 (never computed before).
    plan, finished = run_step(scheduler, 4.0)
    assert (3, (23, output_token(3, 0)), 2) in computed(plan)
    run = scheduler.runs[3]
    assert run.prefix_hit_tokens == 2
    assert run.recomputed_tokens == 1
    assert scheduler.recomputed_tokens == 1
    assert finished == [3]
    assert run.output_ids == [output_token(3, 0), output_token(3, 1)]


def test_recompute_fallback_when_paused_sequences_hold_the_gpu_and_nothing_below_fits() -> None:
    # 4 GPU blocks and no CPU or NVMe tier: a swap-out has nowhere to go.
    scheduler, engine = make_scheduler(num_gpu_blocks=4)
    scheduler.add_request(1, [1, 2], 5, 0.0)
    scheduler.add_request(2, [11, 12], 4, 1.0)

    # Steps 1-3: both run; after step 3 they hold 2 + 2 = 4 blocks (GPU full).
    for now_s in (0.0, 1.0, 2.0):
        run_step(scheduler, now_s)
    assert scheduler.running == [1, 2]

    # Step 4, in one schedule() call:
    #   sequence 1 needs a third block -> preempt the newest, 2, by swap; its
    #     blocks have nowhere to go, so they stay on the GPU, paused;
    #   still no room -> the newest running sequence is now 1 itself: preempted;
    #   nothing runs, nothing moves -> fallback: drop the KV of the newest paused
    #     sequence. NOTE: that is sequence 1 (paused last), the OLDEST request;
    #   sequence 2's blocks are all on the GPU: it resumes and runs.
    plan, _ = run_step(scheduler, 3.0)
    assert computed(plan) == [(2, (1201,), 3)]
    assert scheduler.num_preemptions == 2
    assert scheduler.swapper.metrics.evictions_by_reason["fallback_recompute"] == 1
    assert not scheduler.swapper.holds_kv(1)
    assert list(scheduler.waiting) == [1]
    assert engine.submitted == []
    # Sequence 1's full blocks [1 2] [1100 1101] survive as prefix cache for now.
    assert num_used_blocks(scheduler, Tier.GPU) == 4

    # Step 5: sequence 2 grows into a third block: the coldest cache block, 1's
    # tail [1100 1101], is discarded for it (nowhere below to keep it). 2 finishes.
    _, finished = run_step(scheduler, 4.0)
    assert finished == [2]
    assert scheduler.swapper.metrics.evictions_by_reason["sync_discard"] == 1

    # Step 6: sequence 1 is admitted again: [1 2] is a prefix hit, 1100 1101 are
    # recomputed and 1102 (its newest output) is computed for the first time.
    plan, _ = run_step(scheduler, 5.0)
    assert computed(plan) == [(1, (1100, 1101, 1102), 2)]
    assert scheduler.runs[1].prefix_hit_tokens == 2
    assert scheduler.runs[1].recomputed_tokens == 2


def test_a_block_whose_every_copy_failed_is_recomputed_by_its_owner() -> None:
    # 4 GPU, 2 CPU blocks, an NVMe slab of 8; the CPU demotes everything to NVMe once
    # full; swap-in moves one block per chunk, so one bad block fails alone.
    engine, keyed = slab_tier(8)
    scheduler, _ = make_scheduler(
        num_gpu_blocks=4,
        num_cpu_blocks=2,
        cpu_demote_high_watermark=0.5,
        cpu_demote_low_watermark=0.0,
        swap_in_chunk_blocks=1,
        engine=engine,
        keyed=keyed,
    )
    scheduler.add_request(1, [1, 2], 5, 0.0)
    scheduler.add_request(2, [11, 12, 13], 4, 1.0)
    for now_s in (0.0, 1.0, 2.0):
        run_step(scheduler, now_s)

    # Step 4: sequence 1 grows, sequence 2 ([11 12] [13 1200]) is swapped out to the
    # CPU; at the step's end the full CPU tier writes both blocks to the slab.
    run_step(scheduler, 3.0)
    engine.finish()
    # Step 5: sequence 1 finishes. The writes landed: 2 lives only on NVMe.
    _, finished = run_step(scheduler, 4.0)
    assert finished == [1]
    assert placement(scheduler, 2) == ["nvme", "nvme"]
    engine.finish()

    # The slab's copy of sequence 2's second block goes bad (its check fails on read).
    second = scheduler.swapper.store.sequence_blocks(2)[1]
    assert second.key is not None
    engine.store.keys.discard(second.key)

    # Step 6: sequence 2 resumes. Its first block comes up NVMe -> CPU -> GPU; the
    # second block's read fails and that was its last copy: it is lost. The
    # owner truncates its table at the lost block (token 2) and re-runs from
    # there: 13 and 1200 are recomputed, 1201 computed for the first time.
    plan, _ = run_step(scheduler, 5.0)
    assert computed(plan) == [(2, (13, 1200, 1201), 2)]
    metrics = scheduler.swapper.metrics
    # The read chunk came back with that block's slot failed (the rest of it good).
    assert (metrics.failed_transfers, metrics.lost_blocks) == (0, 1)
    assert scheduler.runs[2].recomputed_tokens == 2
    # The first block kept its (good) NVMe copy; the second is a new GPU block, and
    # 1201 starts a third.
    assert placement(scheduler, 2) == ["gpu+nvme", "gpu", "gpu"]
    assert not scheduler.swapper.has_lost_blocks()

    # It then finishes normally.
    _, finished = run_step(scheduler, 6.0)
    assert finished == [2]
    assert scheduler.runs[2].output_ids == [output_token(2, i) for i in range(4)]


def test_a_long_prompt_is_prefilled_in_chunks_of_the_step_token_budget() -> None:
    # A budget of 4 tokens per step; a 10-token prompt takes three steps.
    scheduler, _ = make_scheduler(num_gpu_blocks=8, max_num_batched_tokens=4)
    scheduler.add_request(1, list(range(1, 11)), 2, 0.0)
    scheduler.add_request(2, [51, 52], 2, 1.0)

    # Step 1: tokens 1-4. The chunk does not reach the prompt's end: no sample.
    plan, _ = run_step(scheduler, 0.0)
    assert computed(plan) == [(1, (1, 2, 3, 4), 0)]
    assert [item.samples for item in plan.seqs] == [False]
    assert scheduler.runs[1].output_ids == []

    # Step 2: tokens 5-8. Sequence 2 is admitted but the budget is spent on 1:
    # it is running and gets nothing this step.
    plan, _ = run_step(scheduler, 1.0)
    assert computed(plan) == [(1, (5, 6, 7, 8), 4)]
    assert scheduler.running == [1, 2]
    assert scheduler.runs[1].first_token_s is None

    # Step 3: the last 2 prompt tokens sample sequence 1's first token; the 2
    # left in the budget go to sequence 2's whole prompt.
    plan, _ = run_step(scheduler, 2.0)
    assert computed(plan) == [(1, (9, 10), 8), (2, (51, 52), 0)]
    assert [item.samples for item in plan.seqs] == [True, True]
    assert scheduler.runs[1].first_token_s == 2.0
    assert sum(len(item.token_ids) for item in plan.seqs) == 4


def test_a_finished_request_is_offloaded_at_once_and_a_later_turn_hits_it_on_cpu() -> None:
    # 4 GPU blocks, 8 CPU blocks; watermarks at 1.0, so only the finish offloads.
    scheduler, engine = make_scheduler(num_gpu_blocks=4, num_cpu_blocks=8)
    scheduler.add_request(1, [1, 2, 3], 2, 0.0)

    # Steps 1-2: sequence 1 computes [1 2] [3 1100] and samples 1101: finished.
    run_step(scheduler, 0.0)
    _, finished = run_step(scheduler, 1.0)
    assert finished == [1]
    # Its 2 full blocks go down at once, on the LOW queue, and keep their GPU copy.
    [offload] = chunks(engine, Direction.GPU_TO_CPU)
    assert (offload.priority, offload.num_blocks) == (Priority.LOW, 2)
    assert num_used_blocks(scheduler, Tier.GPU) == 2
    engine.finish()

    # Steps 3-4: another request fills the GPU. Sequence 1's blocks are clean (a
    # CPU copy exists), so making room drops them for free, no transfer.
    scheduler.add_request(2, [31, 32, 33, 34, 35, 36], 2, 2.0)
    run_step(scheduler, 2.0)
    run_step(scheduler, 3.0)
    assert scheduler.swapper.metrics.evictions_by_reason["sync_drop"] == 2
    assert len(chunks(engine, Direction.GPU_TO_CPU)) == 2  # 1's offload, then 2's
    engine.finish()

    # Step 5: the next turn of the conversation: the previous prompt + output + 9.
    # Its first 4 tokens hit sequence 1's blocks on the CPU; they are swapped in
    # (HIGH) and the step computes only from position 4.
    turn2 = [*scheduler.runs[1].all_ids, 9]
    assert turn2 == [1, 2, 3, 1100, 1101, 9]
    scheduler.add_request(3, turn2, 1, 4.0)
    plan, _ = run_step(scheduler, 4.0)
    assert computed(plan) == [(3, (1101, 9), 4)]
    assert scheduler.runs[3].prefix_hit_tokens == 4
    assert scheduler.swapper.metrics.prefix_hit_blocks_by_tier[Tier.CPU] == 2
    swap_ins = chunks(engine, Direction.CPU_TO_GPU)
    assert sum(chunk.num_blocks for chunk in swap_ins) == 2
    assert all(chunk.priority is Priority.HIGH for chunk in swap_ins)


def test_a_failed_sampling_aborts_only_its_own_sequence() -> None:
    # Two sequences share a step; sequence 1's sampling fails (its logits held a NaN,
    # say). It ends alone, as ABORT with the reason, its KV freed on every tier;
    # sequence 2 gets its token and goes on.
    scheduler, _ = make_scheduler(num_gpu_blocks=8, num_cpu_blocks=8)
    scheduler.add_request(1, [1, 2, 3, 4, 5], 4, 0.0)
    scheduler.add_request(2, [11, 12, 13], 4, 0.0)
    plan = scheduler.schedule(0.0)
    assert [item.seq_id for item in plan.seqs] == [1, 2]
    finished = scheduler.complete(
        plan, {2: output_token(2, 0)}, 0.0, failed={1: "sampling failed: nan"}
    )
    scheduler.swapper.check_integrity()
    assert finished == [1]
    run = scheduler.runs[1]
    assert run.finish_reason is FinishReason.ABORT and run.abort_reason == "sampling failed: nan"
    assert run.output_ids == [] and not scheduler.swapper.holds_kv(1)
    assert scheduler.running == [2] and scheduler.runs[2].output_ids == [output_token(2, 0)]
    assert set(placement(scheduler, 2)) == {"gpu"}
    for step in range(1, 4):
        plan, finished = run_step(scheduler, float(step))
    assert finished == [2] and len(scheduler.runs[2].output_ids) == 4
