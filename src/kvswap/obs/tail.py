"""Who is in the latency tail: token latencies filed under what their step was doing.

The run's P99 says how bad the tail is, not why. `TailRecorder` (a `StepObserver`)
files every inter-token latency under the class of the step that emitted it, one
`LogHistogram` per class, so memory stays a few hundred buckets whatever the run
length:

    swap_wait   the step waited for a swap-in (swap_wait_s > 0) or had a sync stall
    prefill     it did not wait, but also computed prompt tokens (a prefill chunk or a
                recomputation) beside the decodes, which all wait for them
    decode      neither: a plain decode step

A step is filed under the first class that applies, in that order. A token whose
sequence sat paused between two tokens (preempted, not scheduled) lands under
whatever its emitting step was, usually `decode`: that step was quick, the pause
was not.

`TailLatencies.attribution()` then reads the tail: the tokens at or above the run's
P99 (to the histograms' 2% resolution), which class their steps were in, and the
P99 of tokens from steps with vs without a swap wait.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvswap.obs.jsonvalues import int_map, lookup
from kvswap.obs.observer import StepObserver, StepSample
from kvswap.obs.quantiles import LogHistogram

SWAP_WAIT, PREFILL, DECODE = "swap_wait", "prefill", "decode"
STEP_CLASSES: tuple[str, ...] = (SWAP_WAIT, PREFILL, DECODE)


#: A step "waited for a swap-in" when the wait was at least this share of the step:
#: the engine's wait_ready reads a wall clock, so every step shows some microseconds
#: of bookkeeping, which must not count as blocking.
MIN_SWAP_WAIT_SHARE = 0.05


def step_class(sample: StepSample, *, sync_stalled: bool) -> str:
    """The class of the step `sample` reports; `sync_stalled`: its step had a sync stall."""
    waited = sample.swap_wait_s > 0 and sample.swap_wait_s >= MIN_SWAP_WAIT_SHARE * sample.step_s
    if waited or sync_stalled:
        return SWAP_WAIT
    if sample.num_prefill_tokens > 0:
        return PREFILL
    return DECODE


@dataclass(frozen=True)
class TailAttribution:
    """The tail of a run's token latencies, by the class of the step each came from."""

    num_tokens: int
    p50_ms: float
    p99_ms: float
    num_tail_tokens: int  # at or above p99_ms
    num_tail_tokens_by_class: dict[str, int]
    num_tokens_by_class: dict[str, int]
    num_steps_by_class: dict[str, int]
    p99_ms_with_swap_wait: float | None  # None: no token came from a step that waited
    p99_ms_without_swap_wait: float | None  # None: every token came from one

    def share_of_tail(self, step_class: str) -> float:
        tail = self.num_tail_tokens
        return self.num_tail_tokens_by_class.get(step_class, 0) / tail if tail else 0.0

    def share_of_tokens(self, step_class: str) -> float:
        total = self.num_tokens
        return self.num_tokens_by_class.get(step_class, 0) / total if total else 0.0

    @property
    def tail_ratio(self) -> float:
        """P99 / P50; 1.0 when P50 is 0 (every latency below the histogram's floor)."""
        return self.p99_ms / self.p50_ms if self.p50_ms > 0 else 1.0

    @property
    def share_of_tail_tokens_waiting(self) -> float:
        return self.share_of_tail(SWAP_WAIT)

    def to_json(self) -> dict[str, object]:
        """The summary's `tail_attribution` object."""

        def ms(value: float | None) -> float | None:
            return None if value is None else round(value, 3)

        return {
            "share_of_tail_tokens_waiting": round(self.share_of_tail_tokens_waiting, 6),
            "share_of_tail_tokens_prefill": round(self.share_of_tail(PREFILL), 6),
            "share_of_tail_tokens_decode": round(self.share_of_tail(DECODE), 6),
            "share_of_tokens_waiting": round(self.share_of_tokens(SWAP_WAIT), 6),
            "p50_ms": round(self.p50_ms, 3),
            "p99_ms": round(self.p99_ms, 3),
            "p99_over_p50": round(self.tail_ratio, 3),
            "p99_ms_with_swap_wait": ms(self.p99_ms_with_swap_wait),
            "p99_ms_without_swap_wait": ms(self.p99_ms_without_swap_wait),
            "num_tokens": self.num_tokens,
            "num_tail_tokens": self.num_tail_tokens,
            "num_tail_tokens_by_class": dict(self.num_tail_tokens_by_class),
            "num_steps_by_class": dict(self.num_steps_by_class),
        }


@dataclass(frozen=True)
class TailLatencies:
    """Token latencies per step class (histograms) and steps per class; mergeable.
    Only `TailRecorder` fills one; treat any other as read-only (`merged` copies)."""

    latencies_by_class: dict[str, LogHistogram]
    num_steps_by_class: dict[str, int]

    @classmethod
    def empty(cls) -> TailLatencies:
        return cls({c: LogHistogram() for c in STEP_CLASSES}, dict.fromkeys(STEP_CLASSES, 0))

    def histogram(self, step_class: str) -> LogHistogram:
        return self.latencies_by_class.get(step_class, LogHistogram())

    def merged(self, *others: TailLatencies) -> TailLatencies:
        """A copy holding this and `others` (histograms are copied, never shared)."""
        return TailLatencies(
            {c: self.histogram(c).merged(*(o.histogram(c) for o in others)) for c in STEP_CLASSES},
            {
                c: self.num_steps_by_class.get(c, 0)
                + sum(o.num_steps_by_class.get(c, 0) for o in others)
                for c in STEP_CLASSES
            },
        )

    def attribution(
        self, percentiles_ms: tuple[float, float] | None = None
    ) -> TailAttribution | None:
        """The tail by class; None when no token latency was recorded. `percentiles_ms`:
        the run's exact (P50, P99) as its summary states them, so the tail is read at
        the P99 the summary quotes; else the histograms' own (to their resolution)."""
        every = LogHistogram().merged(*(self.histogram(c) for c in STEP_CLASSES))
        p50_s, p99_s = every.quantile_s(0.50), every.quantile_s(0.99)
        if p50_s is None or p99_s is None:
            return None
        if percentiles_ms is not None:
            p50_s, p99_s = percentiles_ms[0] / 1e3, percentiles_ms[1] / 1e3
        waited = self.histogram(SWAP_WAIT)
        not_waited = self.histogram(PREFILL).merged(self.histogram(DECODE))
        return TailAttribution(
            num_tokens=every.count,
            p50_ms=p50_s * 1e3,
            p99_ms=p99_s * 1e3,
            num_tail_tokens=every.count_at_or_above_s(p99_s),
            num_tail_tokens_by_class={
                c: self.histogram(c).count_at_or_above_s(p99_s) for c in STEP_CLASSES
            },
            num_tokens_by_class={c: self.histogram(c).count for c in STEP_CLASSES},
            num_steps_by_class={c: self.num_steps_by_class.get(c, 0) for c in STEP_CLASSES},
            p99_ms_with_swap_wait=waited.quantile_ms(0.99),
            p99_ms_without_swap_wait=not_waited.quantile_ms(0.99),
        )

    def to_json(self) -> dict[str, object]:
        return {
            "latency_histograms": {c: self.histogram(c).to_json() for c in STEP_CLASSES},
            "num_steps_by_class": {c: self.num_steps_by_class.get(c, 0) for c in STEP_CLASSES},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> TailLatencies:
        def histogram(step_class: str) -> LogHistogram:
            value = lookup(data, "latency_histograms", step_class)
            return LogHistogram.from_json(value) if isinstance(value, Mapping) else LogHistogram()

        steps = int_map(data, "num_steps_by_class")
        return cls(
            {c: histogram(c) for c in STEP_CLASSES},
            {c: steps.get(c, 0) for c in STEP_CLASSES},
        )


class TailRecorder(StepObserver):
    """Files each step's token latencies under its class; `latencies()` at any time."""

    def __init__(self) -> None:
        self._latencies = TailLatencies.empty()
        self._sync_stalls = 0  # the cumulative count at the previous step

    def on_step(self, sample: StepSample) -> None:
        # Samples carry the cumulative count: a rise since the last step is this step's.
        stalled = sample.sync_stalls > self._sync_stalls
        self._sync_stalls = sample.sync_stalls
        cls = step_class(sample, sync_stalled=stalled)
        self._latencies.latencies_by_class[cls].add_all(sample.token_latencies_s)
        self._latencies.num_steps_by_class[cls] += 1

    def latencies(self) -> TailLatencies:
        return self._latencies.merged()  # a copy: recording goes on in our own
