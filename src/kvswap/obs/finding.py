"""One finding of a diagnosis (the symptom, the figure behind it, the cause, the advice),
and the thresholds the engine's rules judge by (`obs.diagnosis` says what each means).

The engine's rules (`obs.diagnosis`) and the load generator's (`obs.loadgen_findings`)
both return these; reports store them as JSON.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvswap.obs.jsonvalues import float_map


@dataclass(frozen=True)
class Finding:
    rule: str  # stable id
    symptom: str
    metric: str  # the Prometheus metric (and summary key) behind it
    figure: str  # the numbers, in words
    cause: str
    advice: str
    values: dict[str, float] = field(default_factory=dict)

    def one_line(self) -> str:
        return f"{self.symptom} ({self.figure}): {self.cause}; {self.advice}"

    def to_json(self) -> dict[str, object]:
        return {
            "rule": self.rule,
            "symptom": self.symptom,
            "metric": self.metric,
            "figure": self.figure,
            "cause": self.cause,
            "advice": self.advice,
            "values": dict(self.values),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> Finding:
        def text(key: str) -> str:
            value = data.get(key)
            return value if isinstance(value, str) else ""

        return cls(
            rule=text("rule"),
            symptom=text("symptom"),
            metric=text("metric"),
            figure=text("figure"),
            cause=text("cause"),
            advice=text("advice"),
            values=float_map(data, "values"),
        )


@dataclass(frozen=True)
class Thresholds:
    rising_ratio: float = 1.5
    holding_ratio: float = 1.2
    min_phase_tokens: int = 20
    write_link_share: float = 0.60
    swap_wait_share: float = 0.10
    pinned_pool_usage: float = 0.90
    sustained_share: float = 0.20
    min_sustained_windows: int = 3
    tail_ratio: float = 2.0
    # A P99 read off fewer tokens than this flips between identical runs: at least 20
    # tail tokens, i.e. a run of ~2,000 token latencies, before the tail rule speaks.
    min_tail_tokens: int = 20
    tail_cause_share: float = 0.5
    remote_failure_share: float = 0.10
    min_remote_blocks: int = 8
    # Requests mostly waited before they ran: at least this share of the time to
    # first token was queueing, and the median wait at least `min_queue_wait_ms`.
    queue_share: float = 0.5
    min_queue_wait_ms: float = 1000.0
