"""Step helpers the narrated scheduler scenarios share (local tiers and the remote tier).

A step is `schedule -> (the model) -> complete`; the "model" samples
`1000 + 100 * seq_id + i` as sequence `seq_id`'s i-th output token, so the token
ids in an assertion tell whose token is where.
"""

from __future__ import annotations

from kvswap.base.tier import tier_rank
from kvswap.base.transfer import Direction, TransferChunk
from kvswap.control.scheduler import Scheduler
from kvswap.control.scheduler_records import StepPlan
from tests.manual_engine import ManualCopyEngine


def output_token(seq_id: int, index: int) -> int:
    return 1000 + 100 * seq_id + index


def run_step(scheduler: Scheduler, now_s: float = 0.0) -> tuple[StepPlan, list[int]]:
    """One engine step; returns the plan and the sequences that finished."""
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
    """(seq_id, token ids, first position) of every sequence the step computes."""
    return [(item.seq_id, item.token_ids, item.start_position) for item in plan.seqs]


def placement(scheduler: Scheduler, seq_id: int) -> list[str]:
    """Where each block of the sequence has a ready copy, e.g. ["gpu+cpu", "cpu"]."""
    blocks = scheduler.swapper.store.sequence_blocks(seq_id)
    ready = [[t for t in sorted(b.copies, key=tier_rank) if b.ready_copy(t) is not None]
             for b in blocks]  # fmt: skip
    return ["+".join(tier.value for tier in tiers) for tiers in ready]


def chunks(engine: ManualCopyEngine, direction: Direction) -> list[TransferChunk]:
    return [chunk for chunk in engine.submitted if chunk.direction is direction]
