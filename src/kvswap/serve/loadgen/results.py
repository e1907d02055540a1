"""What a load test measured: one record per request, and the run's summary.

Times are seconds since the replay started. Per request, from SSE chunk arrivals:

    due_s ....... sent_s ...... first text chunk ... chunk ... last chunk .. done_s
                  |<--- TTFT --->|<-- ITL -->|<- ITL ->|
                                 |<- TPOT x (output_tokens - 1) ->|

Which requests count where (invariants the summary keeps):
- latencies (TTFT, TPOT, ITL, end-to-end), output, prompt and cached tokens come
  from completed requests only, so the throughput figures and the percentiles
  describe the same set;
- sent = completed + failed + cancelled; planned = sent + not sent. A request is
  cancelled when the run stopped (--duration-s reached, Ctrl-C) while it was in
  flight; follow-ups of a turn that did not complete are never sent.
- output tokens are the server's `usage.completion_tokens` when it gives them,
  else the number of text chunks (one token per chunk, as most servers stream);
  an inter-token latency is the gap between two text chunks, so a server that
  streams k tokens per chunk shows gaps of k tokens;
- the send delay (sent_s - due_s, every request sent) shows a client held back
  by --max-concurrency or unable to keep up with the arrival times;
- a failure has one kind (`errors_by_kind`): "HTTP <status>", "timeout",
  "transport" or "bad stream" (the names `obs/loadgen_findings.py` judges);
  `errors` lists the first MAX_LISTED_ERRORS failures and the first of every kind;
- prompt lengths pair each completed request's intended length (the workload's)
  with its sent one (the server's `usage.prompt_tokens`).

Per-request records (`RequestRecord.to_json`) go to report.json, not to the
summary: a 12k-request trace is ~3 MB of them.
"""

from __future__ import annotations

import enum
import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvswap.obs.loadgen_findings import http_kind
from kvswap.percentiles import nearest_rank, percentiles_ms, ranked

MAX_LISTED_ERRORS = 20


class Outcome(enum.Enum):
    PENDING = "pending"  # not sent (yet)
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass
class RequestRecord:
    request_id: int
    session_id: int | None
    turn: int
    max_tokens: int
    due_s: float
    outcome: Outcome = Outcome.PENDING
    sent_s: float | None = None
    done_s: float | None = None
    # Text chunks, in order (the replay stores an array('d'): 8 bytes per token).
    chunk_times_s: Sequence[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    http_status: int | None = None
    error: str | None = None
    error_kind: str | None = None  # set with `error`: "HTTP 413", "timeout", ...
    intended_prompt_tokens: int | None = None  # the workload's length; None: not sent

    @property
    def ttft_s(self) -> float | None:
        if self.sent_s is None or not self.chunk_times_s:
            return None
        return self.chunk_times_s[0] - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None for a single token."""
        if self.output_tokens < 2 or len(self.chunk_times_s) < 2:
            return None
        return (self.chunk_times_s[-1] - self.chunk_times_s[0]) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        times = self.chunk_times_s
        return [later - earlier for earlier, later in itertools.pairwise(times)]

    @property
    def e2e_s(self) -> float | None:
        if self.sent_s is None or self.done_s is None:
            return None
        return self.done_s - self.sent_s

    def to_json(self) -> dict[str, object]:
        """The record as report.json keeps it (times in ms, rounded to the microsecond)."""
        ttft_s = self.ttft_s
        return {
            "request_id": self.request_id,
            "session_id": self.session_id,
            "turn": self.turn,
            "intended_prompt_tokens": self.intended_prompt_tokens,
            "sent_prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "max_tokens": self.max_tokens,
            "output_tokens": self.output_tokens,
            "ttft_ms": None if ttft_s is None else round(ttft_s * 1e3, 3),
            "outcome": self.outcome.value,
            "http_status": self.http_status,
            "error_kind": self.error_kind,
        }


@dataclass(frozen=True)
class Slo:
    """Service-level objectives a request must meet to count in the goodput."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met_by(self, record: RequestRecord) -> bool:
        return self.ttft_met_by(record) and self.tpot_met_by(record)

    def ttft_met_by(self, record: RequestRecord) -> bool:
        ttft_s = record.ttft_s
        return self.ttft_ms is None or (ttft_s is not None and ttft_s * 1e3 <= self.ttft_ms)

    def tpot_met_by(self, record: RequestRecord) -> bool:
        # A one-token reply has no TPOT: it cannot miss a TPOT objective.
        tpot_s = record.tpot_s
        return self.tpot_ms is None or tpot_s is None or tpot_s * 1e3 <= self.tpot_ms


def summarize(
    records: Sequence[RequestRecord],
    *,
    duration_s: float,
    slo: Slo,
    stopped_by: str | None,
) -> dict[str, object]:
    """The --json object of a load test (see the module docstring for what counts)."""
    by_outcome = Counter(r.outcome for r in records)
    done = [r for r in records if r.outcome is Outcome.COMPLETED]
    sent = sum(1 for r in records if r.sent_s is not None)
    output_tokens = sum(r.output_tokens for r in done)
    prompt_counts = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
    cached_counts = [r.cached_tokens for r in done if r.cached_tokens is not None]
    good = sum(1 for r in done if slo.met_by(r))
    ttfts = [t for r in done if (t := r.ttft_s) is not None]
    tpots = [t for r in done if (t := r.tpot_s) is not None]
    e2es = [t for r in done if (t := r.e2e_s) is not None]
    send_delays = [r.sent_s - r.due_s for r in records if r.sent_s is not None]
    itls = [itl for r in done for itl in r.itls_s]
    failed = [r for r in records if r.outcome is Outcome.FAILED]

    def per_s(count: float) -> float:
        return round(count / duration_s, 3) if duration_s > 0 else 0.0

    prompt_tokens = sum(prompt_counts) if prompt_counts else None
    cached_tokens = sum(cached_counts) if cached_counts else None
    return {
        "requests_planned": len(records),
        "requests_sent": sent,
        "requests_completed": by_outcome[Outcome.COMPLETED],
        "requests_failed": by_outcome[Outcome.FAILED],
        "requests_cancelled": by_outcome[Outcome.CANCELLED],
        "requests_not_sent": len(records) - sent,
        "duration_s": round(duration_s, 6),
        "tokens_generated": output_tokens,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "cached_token_share": (
            round(cached_tokens / prompt_tokens, 6)
            if cached_tokens is not None and prompt_tokens
            else None
        ),
        "requests_per_s": per_s(len(done)),
        "throughput_tok_s": per_s(output_tokens),
        "goodput_requests": good,
        "goodput_requests_per_s": per_s(good),
        "slo_ttft_ms": slo.ttft_ms,
        "slo_tpot_ms": slo.tpot_ms,
        "slo_ttft_met_requests": (
            None if slo.ttft_ms is None else sum(1 for r in done if slo.ttft_met_by(r))
        ),
        "slo_tpot_met_requests": (
            None if slo.tpot_ms is None else sum(1 for r in done if slo.tpot_met_by(r))
        ),
        "ttft_ms": percentiles_ms(ttfts),
        "ttft_fastest_ms": unwaited_ttft_ms(done),
        "tpot_ms": percentiles_ms(tpots),
        "itl_ms": percentiles_ms(itls),
        "e2e_latency_ms": percentiles_ms(e2es),
        "send_delay_ms": percentiles_ms(send_delays),
        "prompt_length": prompt_lengths(done),
        "errors_by_kind": dict(sorted(Counter(error_kind(r) for r in failed).items())),
        "errors": [
            {
                "request_id": r.request_id,
                "kind": error_kind(r),
                "status": r.http_status,
                "message": r.error or "",
            }
            for r in listed_failures(failed)
        ],
        "stopped_by": stopped_by,
    }


def unwaited_ttft_ms(done: Sequence[RequestRecord]) -> float | None:
    """What a request's first token costs when it does not wait, in ms, the rule
    "queued" compares the median with: the lower of the fastest tenth (nearest rank,
    without the one outlier) of the requests with nothing cached (a cached prompt is
    fast for another reason), and the median of those sent while no other request was
    in flight (none can have waited; when every request queued behind the first, the
    fastest tenth waited too)."""
    uncached = [r for r in done if r.ttft_s is not None and not r.cached_tokens]
    ttfts_s = [r.ttft_s for r in uncached or done if r.ttft_s is not None]
    if not ttfts_s:
        return None
    fastest_s = nearest_rank(ttfts_s, 0.10)
    alone_s = [r.ttft_s for r in alone(done) if r.ttft_s is not None and not r.cached_tokens]
    if alone_s:
        fastest_s = min(fastest_s, nearest_rank(alone_s, 0.50))
    return round(fastest_s * 1e3, 3)


def alone(records: Sequence[RequestRecord]) -> list[RequestRecord]:
    """The records sent while no other one of `records` was in flight (sent before it
    and not done, or sent at the same instant)."""
    ordered = sorted((r for r in records if r.sent_s is not None), key=lambda r: r.sent_s or 0.0)
    found = []
    busy_until_s = float("-inf")
    for index, record in enumerate(ordered):
        sent_s = record.sent_s or 0.0
        sent_with_it = index + 1 < len(ordered) and ordered[index + 1].sent_s == sent_s
        if busy_until_s <= sent_s and not sent_with_it:
            found.append(record)
        busy_until_s = max(busy_until_s, record.done_s if record.done_s is not None else sent_s)
    return found


def error_kind(record: RequestRecord) -> str:
    """The kind a failed request counts under (the replay sets it with the error)."""
    if record.error_kind is not None:
        return record.error_kind
    status = record.http_status
    return http_kind(status) if status is not None and status != 200 else "unknown"


def listed_failures(failed: Sequence[RequestRecord]) -> list[RequestRecord]:
    """The first MAX_LISTED_ERRORS failures, and the first of every other kind, in order."""
    listed = list(failed[:MAX_LISTED_ERRORS])
    kinds = {error_kind(r) for r in listed}
    for record in failed[MAX_LISTED_ERRORS:]:
        if (kind := error_kind(record)) not in kinds:
            kinds.add(kind)
            listed.append(record)
    return listed


def _spread(values: Sequence[float], digits: int) -> dict[str, float]:
    """{min, p50, p95, max} (nearest rank) of a non-empty sample."""
    ordered = sorted(values)

    def rank(fraction: float) -> float:
        return round(ranked(ordered, fraction), digits)

    return {"min": round(ordered[0], digits), "p50": rank(0.50), "p95": rank(0.95),
            "max": round(ordered[-1], digits)}  # fmt: skip


def prompt_lengths(done: Sequence[RequestRecord]) -> dict[str, object] | None:
    """Intended vs sent prompt tokens over the completed requests that have both; None
    when none has (a server that reports no usage)."""
    pairs = [
        (r.intended_prompt_tokens, r.prompt_tokens)
        for r in done
        if r.intended_prompt_tokens and r.prompt_tokens is not None
    ]
    if not pairs:
        return None
    return {
        "requests": len(pairs),
        "intended_tokens": _spread([i for i, _ in pairs], 1),
        "sent_tokens": _spread([s for _, s in pairs], 1),
        "sent_per_intended": _spread([s / i for i, s in pairs], 3),
    }
