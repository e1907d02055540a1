"""What `add_request` answers, and how the scheduler owns its runs.

A pool of 10 GPU blocks of 4 tokens, 2 of them protected sink blocks: a running
sequence has every block on the GPU, so a request may have at most 8 blocks =
32 tokens of prompt + output. With a model of 24 positions the limit is 24.
"""

from __future__ import annotations

import pytest

from kvswap.control.policy import PolicyOptions
from kvswap.control.scheduler import Scheduler
from kvswap.control.scheduler_records import (
    Admission,
    FinishReason,
    RefusalReason,
    SchedulerSettings,
)
from kvswap.control.settings import SwapSettings
from kvswap.control.store_records import StoreLayout
from kvswap.control.swapper import Swapper
from tests.manual_engine import ManualCopyEngine
from tests.unit.scheduler_support import run_step


def make_scheduler(*, max_sequence_tokens: int | None = None) -> Scheduler:
    layout = StoreLayout(block_tokens=4, num_gpu_blocks=10, num_cpu_blocks=0,
                         protected_blocks=2)  # fmt: skip
    swap = SwapSettings(
        block_bytes=64, swap_out_high_watermark=1.0, swap_out_low_watermark=1.0,
        swap_out_chunk_blocks=4, swap_in_chunk_blocks=4,
        cpu_demote_high_watermark=1.0, cpu_demote_low_watermark=1.0,
    )  # fmt: skip
    options = PolicyOptions(sink_protection=True)
    swapper = Swapper(layout, options, swap, ManualCopyEngine(), clock_s=lambda: 0.0)
    return Scheduler(swapper, SchedulerSettings(max_sequence_tokens=max_sequence_tokens))


def test_a_request_that_fits_is_accepted_and_queued() -> None:
    scheduler = make_scheduler()
    admission = scheduler.add_request(1, [1, 2, 3, 4], 28, 0.0)  # 32 tokens: the whole limit
    assert admission == Admission() and admission.accepted and admission.refusal is None
    assert list(scheduler.waiting) == [1] and scheduler.finished == []
    assert scheduler.runs[1].rejected_reason is None


def test_an_empty_prompt_is_refused() -> None:
    scheduler = make_scheduler()
    admission = scheduler.add_request(1, [], 4, 2.0)
    assert not admission.accepted and admission.refusal is not None
    assert admission.refusal.reason is RefusalReason.EMPTY_PROMPT
    assert admission.refusal.message == "empty prompt"


def test_a_request_past_the_models_positions_is_refused_naming_them() -> None:
    scheduler = make_scheduler(max_sequence_tokens=24)
    admission = scheduler.add_request(1, [1] * 20, 5, 0.0)  # 25 tokens > 24 positions
    assert admission.refusal is not None
    assert admission.refusal.reason is RefusalReason.PAST_MAX_POSITION
    assert "25 tokens (20 prompt + 5 new)" in admission.refusal.message
    assert "maximum position is 24 tokens" in admission.refusal.message


def test_a_request_larger_than_the_gpu_tier_is_refused_naming_its_blocks() -> None:
    scheduler = make_scheduler(max_sequence_tokens=100)
    admission = scheduler.add_request(1, [1] * 30, 3, 0.0)  # 33 tokens: 9 blocks > 8 usable
    assert admission.refusal is not None
    assert admission.refusal.reason is RefusalReason.EXCEEDS_GPU_TIER
    assert admission.refusal.message == (
        "needs 9 blocks of 4 tokens but a running sequence must fit the GPU tier (8 usable blocks)"
    )


def test_a_refused_request_is_recorded_as_finished_and_the_others_run() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(1, [1] * 40, 1, 3.0)
    scheduler.add_request(2, [5, 6], 1, 3.0)
    run = scheduler.runs[1]
    assert run.finish_reason is FinishReason.ABORT and run.finish_s == 3.0
    assert run.rejected_reason is not None and "must fit the GPU tier" in run.rejected_reason
    assert scheduler.finished == [1] and list(scheduler.waiting) == [2]
    _, done = run_step(scheduler, 3.0)
    assert done == [2]


def test_max_request_tokens_is_the_rule_admission_applies() -> None:
    # The GPU tier bounds it (8 blocks x 4 tokens), or the model's positions if fewer.
    assert make_scheduler().max_request_tokens() == 32
    assert make_scheduler(max_sequence_tokens=100).max_request_tokens() == 32
    assert make_scheduler(max_sequence_tokens=24).max_request_tokens() == 24
    for max_sequence_tokens in (None, 24):
        scheduler = make_scheduler(max_sequence_tokens=max_sequence_tokens)
        limit = scheduler.max_request_tokens()
        assert scheduler.admission(10, limit - 10).accepted
        assert not scheduler.admission(10, limit - 9).accepted


def test_admission_asks_without_recording_anything() -> None:
    scheduler = make_scheduler()
    assert not scheduler.admission(40, 1).accepted
    assert scheduler.runs == {} and scheduler.finished == [] and not scheduler.waiting


def test_only_a_finished_request_is_forgotten() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(1, [1, 2, 3], 2, 0.0)
    with pytest.raises(ValueError, match="request 1 has not finished"):
        scheduler.forget(1)
    run_step(scheduler)
    run_step(scheduler)
    assert scheduler.runs[1].finish_reason is FinishReason.LENGTH
    scheduler.forget(1)
    assert 1 not in scheduler.runs
    scheduler.add_request(2, [], 1, 0.0)  # refused: finished at once
    scheduler.forget(2)
    assert scheduler.runs == {}
