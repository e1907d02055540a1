"""What the driver loop needs from a data plane: a clock, idling, and one step.

    loop                         Backend
    ----                         -------
    start()                  ->  the run's time origin (wall clock or virtual 0)
    now_s()                  ->  seconds since start
    idle_until(t_s)          ->  nothing to run before t_s: sleep, or jump the clock
    execute(plan)            ->  compute the step: the sampled token per sampling seq,
                                 the logprobs of those that asked for them, and the
                                 seqs whose sampling failed (each aborts alone)
    summary_extras(duration) ->  the backend's own summary keys (device, model, ...)

The engine implements it with the model and a wall clock, the simulator with
a cost model and a virtual clock. Idling may return early (the engine
sleeps in short slices to notice arrivals); the loop simply asks again.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvswap.control.scheduler_records import StepPlan
from kvswap.sampling import TokenLogprobs


@dataclass(frozen=True)
class StepOutput:
    """What one step produced: seq id -> sampled token; seq id -> why its sampling
    failed (a NaN in its logits, say): that sequence is aborted, the step's others go on;
    seq id -> the sampled token's logprobs, for each sequence whose options ask for them."""

    sampled: Mapping[int, int]
    failed: Mapping[int, str] = field(default_factory=dict)
    logprobs: Mapping[int, TokenLogprobs] = field(default_factory=dict)


class Backend(ABC):
    @abstractmethod
    def start(self) -> None:
        """The run begins now (called once, before the first `now_s`)."""

    @abstractmethod
    def now_s(self) -> float:
        """Seconds since `start`."""

    @abstractmethod
    def idle_until(self, t_s: float) -> None:
        """Nothing can run before `t_s` (seconds since start)."""

    @abstractmethod
    def execute(self, plan: StepPlan) -> StepOutput:
        """Run one step; a sampled token (or why sampling failed) per item that samples."""

    @abstractmethod
    def summary_extras(self, duration_s: float) -> Mapping[str, object]:
        """The backend's keys for the run summary."""
