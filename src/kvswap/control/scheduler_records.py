"""The plain records of the scheduler: a request's run, its admission, one step's plan.

`Scheduler` (`control/scheduler.py`) writes them; the backends, the driver loop,
the observers and the summary read them. Torch-free.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvswap.sampling import LogitsContext, LogitsOptions, SamplingParams


class Preemption(enum.Enum):
    SWAP = "swap"
    RECOMPUTE = "recompute"


class FinishReason(enum.Enum):
    """Why a request ended (the value is the OpenAI API's `finish_reason`)."""

    LENGTH = "length"  # max_new_tokens reached
    STOP = "stop"  # a stop token, or ended early by its client (a stop string)
    ABORT = "abort"  # cancelled, or rejected at admission


class RefusalReason(enum.Enum):
    """Why `add_request` refused a request: it can never run, whatever else runs."""

    EMPTY_PROMPT = "empty_prompt"
    PAST_MAX_POSITION = "past_max_position"  # longer than the model's maximum position
    EXCEEDS_GPU_TIER = "exceeds_gpu_tier"  # a running sequence must fit the GPU tier
    INVALID = "invalid"  # a field no sequence can be opened with (its cache salt, say)


@dataclass(frozen=True)
class Refusal:
    reason: RefusalReason
    message: str  # one line: the request's size against the limit it breaks


@dataclass(frozen=True)
class Admission:
    """What `add_request` answers: accepted (`refusal` is None), or refused and why.
    A refused request is recorded as finished (ABORT) at its arrival time."""

    refusal: Refusal | None = None

    @property
    def accepted(self) -> bool:
        return self.refusal is None


ACCEPTED = Admission()


@dataclass(frozen=True)
class SchedulerSettings:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    preemption: Preemption = Preemption.SWAP
    max_sequence_tokens: int | None = None
    """The model's longest sequence (its maximum position): a request whose prompt
    plus max_new_tokens is longer is rejected at admission. None: no model limit."""


@dataclass
class SequenceRun:
    """One request's life in the scheduler."""

    seq_id: int
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    arrival_s: float
    cache_salt: str | None = None  # tenants share prefix KV only under the same salt
    sampling: SamplingParams | None = None  # None: greedy
    options: LogitsOptions | None = None  # penalties, bias, min_tokens, logprobs; None: none
    output_ids: list[int] = field(default_factory=list)
    admitted_s: float | None = None  # first time it was scheduled (queueing ends)
    first_token_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    finish_s: float | None = None
    num_preemptions: int = 0
    prefix_hit_tokens: int = 0
    recomputed_tokens: int = 0
    tokens_to_recompute: int = 0  # computed before a recompute preemption dropped them
    refusal: Refusal | None = None  # refused at admission: it never ran
    # Why it was aborted mid-run (its sampling failed); its KV is freed on every tier.
    abort_reason: str | None = None
    # Sampling one of these ends the request (an end-of-sequence token).
    stop_token_ids: frozenset[int] = frozenset()
    finish_reason: FinishReason | None = None

    @property
    def rejected_reason(self) -> str | None:
        """The refusal's one line, or None for a request that was accepted."""
        return self.refusal.message if self.refusal is not None else None

    @property
    def all_ids(self) -> list[int]:
        return [*self.prompt_ids, *self.output_ids]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_slice(self, start: int, stop: int) -> list[int]:
        """`all_ids[start:stop]` without copying the whole history (once per step)."""
        num_prompt = len(self.prompt_ids)
        if stop <= num_prompt:
            return list(self.prompt_ids[start:stop])
        if start >= num_prompt:
            return self.output_ids[start - num_prompt : stop - num_prompt]
        return [*self.prompt_ids[start:], *self.output_ids[: stop - num_prompt]]


@dataclass(frozen=True)
class ScheduledSeq:
    """KV to compute for one sequence this step: `token_ids` at positions
    `start_position ...`; `samples` when the chunk reaches the sequence's end, with
    the request's own `sampling` (None: greedy), which the backend samples with, and,
    for a request with `LogitsOptions`, its `context` (the options with the history
    they read: prompt, output so far, stop tokens)."""

    seq_id: int
    token_ids: tuple[int, ...]
    start_position: int
    samples: bool
    sampling: SamplingParams | None = None
    context: LogitsContext | None = None


@dataclass(frozen=True)
class StepPlan:
    step: int
    seqs: tuple[ScheduledSeq, ...]
    swap_wait_s: float
    # Requests whose serving failed while this step was planned: aborted alone, each
    # with its `abort_reason` (`control.request_fault`); the step runs without them.
    aborted: tuple[int, ...] = ()
