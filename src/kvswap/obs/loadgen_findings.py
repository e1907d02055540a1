"""A load test judged by its own figures: rules over `kvswap loadgen`'s summary.

The engine-side rules (`obs/diagnosis.py`) read swap wait, link and pinned pool,
none of which a client sees over HTTP. These read only what the client measured
(`serve/loadgen/results.py` writes the keys) and return the same `Finding`
records, so a load test's page and `kvswap report` show them like a diagnosis:

1. Requests failed, one finding per kind (`errors_by_kind`), with that kind's
   cause and advice: HTTP 413 (prompt + max_tokens longer than the server's
   context), 429 (over capacity: back off), 400 (a body the server refuses),
   401/403, 5xx, any other status, timeouts, transport errors (refused, reset or
   closed connections) and broken streams; the figure quotes the kind's first
   message.
2. Goodput 0: no planned request counted, because none completed or because
   every completed one missed an SLO (then as rule 3 says it).
3. SLOs set and goodput above 0 but below the completed count: how many met each
   objective, and which objective was missed most (its cause and advice).
4. Requests cancelled in flight or never sent: what stopped the run.
5. Sent prompt lengths (the server's `usage.prompt_tokens`) off the intended ones
   by more than `prompt_length_tolerance` at the median: the workload's lengths
   were not what the server saw.
6. Client-bound: the send delay's P95 at least `send_delay_ttft_ratio` x the
   TTFT P50 (and `min_send_delay_ms`): requests left late, held by
   --max-concurrency or a client that could not keep up, so the offered load was
   not the workload's.
7. Queued at the server: the TTFT P50 at least `queue_ttft_ratio` (4x) what a
   request's first token costs when it does not wait (`ttft_fastest_ms`: the fastest
   tenth of the requests with nothing cached, or the median of those sent while no
   other request was in flight, the lower), and longer by `min_queue_ms` (1 s): the
   server was over capacity and requests waited for it; the share of the time to
   first token spent waiting is estimated as 1 - fastest / P50.

A run where no rule fires gets `CHECKED`, which says what was looked at; since
rules 1 and 2 fire on any failure and on a goodput of 0, it is never shown for
such a run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvswap.obs.finding import Finding
from kvswap.obs.jsonvalues import integer_or, lookup, number

#: Failure kinds besides "HTTP <status>" (`errors_by_kind` keys).
TIMEOUT = "timeout"
TRANSPORT = "transport"
BAD_STREAM = "bad stream"

CHECKED = (
    "No load-test rule fired. Checked: failed requests by kind (HTTP 413, 429, 400, other "
    "statuses, timeouts, transport errors, broken streams), goodput against the completed "
    "requests and any SLO, requests cancelled or never sent, sent against intended prompt "
    "lengths, the send delay against TTFT, and TTFT against the fastest requests' (a "
    "queue). The server's swap wait, link and pinned "
    "pool are not visible over HTTP, so the engine-side rules do not apply."
)


def http_kind(status: int) -> str:
    return f"HTTP {status}"


@dataclass(frozen=True)
class LoadgenThresholds:
    send_delay_ttft_ratio: float = 0.5
    min_send_delay_ms: float = 10.0
    prompt_length_tolerance: float = 0.10
    queue_ttft_ratio: float = 4.0
    min_queue_ms: float = 1000.0


@dataclass(frozen=True)
class _Kind:
    slug: str
    symptom: str
    cause: str
    advice: str


_KINDS: dict[str, _Kind] = {
    http_kind(413): _Kind(
        "http_413",
        "prompts too long for the server (HTTP 413)",
        "the server refused prompt + max_tokens as longer than its context",
        "serve a longer context (--max-model-len), or send shorter requests (--length-scale, "
        "--prompt-tokens); with --no-calibrate a prompt may be several times its intended "
        "length",
    ),
    http_kind(429): _Kind(
        "http_429",
        "server over capacity (HTTP 429)",
        "the server's queue was full and it told the client to back off",
        "offer less load (a larger --time-scale, --max-concurrency N) or give the server more "
        "capacity (its waiting-queue limit, KV tiers, replicas)",
    ),
    http_kind(400): _Kind(
        "http_400",
        "requests refused as invalid (HTTP 400)",
        "the server refused the request body: a field or value it does not take, or a "
        "prompt past its context",
        "read the message; check --model and --endpoint against what the server serves",
    ),
    http_kind(401): _Kind(
        "http_401",
        "requests refused: no valid key (HTTP 401)",
        "the server requires an API key the requests did not carry",
        "give the server's key with --api-key KEY or OPENAI_API_KEY",
    ),
    http_kind(403): _Kind(
        "http_403",
        "requests forbidden (HTTP 403)",
        "the server refused the key or the model for these requests",
        "check the key (--api-key, OPENAI_API_KEY) and --model",
    ),
    TIMEOUT: _Kind(
        "timeout",
        "requests timed out",
        "no complete answer came within --timeout-s: the server is overloaded, stuck, or "
        "generating longer than the limit allows",
        "offer less load, or raise --timeout-s when outputs are long",
    ),
    TRANSPORT: _Kind(
        "transport",
        "connections failed",
        "connections were refused, reset or closed before the answer ended: the server "
        "crashed, restarted, or hit its connection limit",
        "check that the server stayed up (its log) and its connection limits; "
        "--max-concurrency bounds the client's connections",
    ),
    BAD_STREAM: _Kind(
        "bad_stream",
        "answers were not valid event streams",
        "an answer had no `data:` lines, data that is not JSON, or an error chunk mid-stream",
        "check that the server streams this endpoint (stream=true with "
        "stream_options.include_usage); the message says what came instead",
    ),
}


def _kind(name: str) -> _Kind:
    if name in _KINDS:
        return _KINDS[name]
    status = name.removeprefix("HTTP ")
    if status.isdigit() and status.startswith("5"):
        return _Kind(
            f"http_{status}",
            f"server errors ({name})",
            "the server failed while answering",
            "read the server's log at the time of the failures",
        )
    return _Kind(
        "other" if not status.isdigit() else f"http_{status}",
        f"requests failed ({name})",
        "the server answered with an error the load generator does not classify",
        "read the message and the server's log",
    )


def _count(summary: Mapping[str, object], key: str) -> int:
    return integer_or(summary, key)


def _first_message(summary: Mapping[str, object], kind: str) -> str | None:
    errors = lookup(summary, "errors")
    for error in errors if isinstance(errors, list) else []:
        if isinstance(error, Mapping) and error.get("kind") == kind:
            return f"request {error.get('request_id')}: {error.get('message')}"
    return None


def requests_failed(summary: Mapping[str, object]) -> list[Finding]:
    """One finding per kind of failure, the most frequent first."""
    by_kind = lookup(summary, "errors_by_kind")
    counts = {
        str(k): v
        for k, v in (by_kind.items() if isinstance(by_kind, Mapping) else ())
        if isinstance(v, int) and not isinstance(v, bool) and v > 0
    }
    sent = _count(summary, "requests_sent")
    found = []
    for name, failed in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        kind = _kind(name)
        first = _first_message(summary, name)
        found.append(
            Finding(
                rule=f"requests_failed_{kind.slug}",
                symptom=kind.symptom,
                metric=f"errors_by_kind[{name}]",
                figure=f"{failed} of {sent} requests sent failed with {name}"
                + (f"; the first, {first}" if first else ""),
                cause=kind.cause,
                advice=kind.advice,
                values={"failed": float(failed), "sent": float(sent)},
            )
        )
    return found


def _slos(summary: Mapping[str, object]) -> list[tuple[str, float, int]]:
    """(objective, limit in ms, completed requests that met it) per SLO given."""
    found = []
    for name, key in (("TTFT", "ttft"), ("TPOT", "tpot")):
        limit = number(summary, f"slo_{key}_ms")
        if limit is not None:
            found.append((name, limit, _count(summary, f"slo_{key}_met_requests")))
    return found


def _slo_text(slos: list[tuple[str, float, int]], completed: int) -> str:
    return ", ".join(
        f"{name} <= {limit:g} ms met by {met} of {completed}" for name, limit, met in slos
    )


_SLO_CAUSE = {
    "TTFT": "first tokens came late: requests queued for prefill behind others, or "
    "prompts are long (check the sent prompt lengths and cached tokens)",
    "TPOT": "decoding slowed: too many sequences decode together, or steps stall "
    "(on kvswap serve, the swap wait on /metrics)",
}
_SLO_ADVICE = {
    "TTFT": "offer less load or cap concurrency (--max-concurrency); on the server, "
    "keep prefixes cached and prefill chunked; relax --slo-ttft-ms if it is stricter "
    "than the use needs",
    "TPOT": "cap concurrent sequences (--max-concurrency here, max_num_seqs on the "
    "server) or serve on faster hardware; relax --slo-tpot-ms if it is stricter than "
    "the use needs",
}


def _most_missed(summary: Mapping[str, object], completed: int) -> tuple[str, str, str]:
    """(figure, cause, advice) of the objectives: how many met each, which was missed most."""
    slos = _slos(summary)
    name, limit, met = min(slos, key=lambda slo: slo[2])
    figure = (
        f"{_slo_text(slos, completed)}; {name} was missed most ({completed - met} requests "
        f"over {limit:g} ms)"
    )
    return figure, _SLO_CAUSE[name], _SLO_ADVICE[name]


def _slo_values(summary: Mapping[str, object]) -> dict[str, float]:
    return {f"{name.lower()}_met": float(met) for name, _, met in _slos(summary)}


def slo_missed(summary: Mapping[str, object]) -> Finding | None:
    """Some, not all, completed requests missed an SLO (none: `goodput_zero`)."""
    completed = _count(summary, "requests_completed")
    good = _count(summary, "goodput_requests")
    if not _slos(summary) or good == 0 or good >= completed:
        return None
    figure, cause, advice = _most_missed(summary, completed)
    return Finding(
        rule="slo_missed",
        symptom="completed requests missed the SLOs",
        metric="goodput_requests (slo_ttft_met_requests, slo_tpot_met_requests)",
        figure=f"{good} of {completed} completed requests met every SLO: {figure}",
        cause=cause,
        advice=advice,
        values={"goodput_requests": float(good), "completed": float(completed)}
        | _slo_values(summary),
    )


def goodput_zero(summary: Mapping[str, object]) -> Finding | None:
    """No planned request counted: none completed, or every completed one missed an SLO."""
    planned = _count(summary, "requests_planned")
    if planned == 0 or _count(summary, "goodput_requests") > 0:
        return None
    completed = _count(summary, "requests_completed")
    if completed == 0:
        figure = (
            f"none of {planned} planned requests completed: "
            f"{_count(summary, 'requests_failed')} failed, "
            f"{_count(summary, 'requests_cancelled')} cancelled, "
            f"{_count(summary, 'requests_not_sent')} not sent"
        )
        cause = "no request got a whole answer (the findings below say why)"
        advice = "fix the failures first; a load test measures nothing until requests complete"
    else:
        missed, cause, advice = _most_missed(summary, completed)
        figure = f"every one of {completed} completed requests missed an SLO: {missed}"
    return Finding(
        rule="goodput_zero",
        symptom="goodput 0: no request counted",
        metric="goodput_requests",
        figure=figure,
        cause=cause,
        advice=advice,
        values={"planned": float(planned), "completed": float(completed)} | _slo_values(summary),
    )


def requests_not_completed(summary: Mapping[str, object]) -> Finding | None:
    cancelled = _count(summary, "requests_cancelled")
    not_sent = _count(summary, "requests_not_sent")
    if cancelled == 0 and not_sent == 0:
        return None
    stopped_by = lookup(summary, "stopped_by")
    if stopped_by == "duration":
        cause = "--duration-s ended the run before the workload did"
        advice = "raise --duration-s, or send fewer requests (--max-requests) to measure them all"
    elif isinstance(stopped_by, str):
        cause = f"the run was stopped by {stopped_by}"
        advice = "let the run finish for figures over the whole workload"
    else:
        cause = "later turns of conversations whose earlier turn did not complete are never sent"
        advice = "fix the failed requests: their conversations ended there"
    return Finding(
        rule="requests_not_completed",
        symptom="requests cancelled or never sent",
        metric="requests_cancelled, requests_not_sent",
        figure=f"{cancelled} requests cancelled in flight and {not_sent} never sent, of "
        f"{_count(summary, 'requests_planned')} planned",
        cause=cause,
        advice=advice,
        values={"cancelled": float(cancelled), "not_sent": float(not_sent)},
    )


def prompt_length_mismatch(
    summary: Mapping[str, object], t: LoadgenThresholds = LoadgenThresholds()
) -> Finding | None:
    median = number(summary, "prompt_length", "sent_per_intended", "p50")
    if median is None or abs(median - 1.0) <= t.prompt_length_tolerance:
        return None
    low = number(summary, "prompt_length", "sent_per_intended", "min") or 0.0
    high = number(summary, "prompt_length", "sent_per_intended", "max") or 0.0
    requests = integer_or(summary, "prompt_length", "requests")
    calibrated = number(summary, "calibration", "tokens_per_word") is not None
    return Finding(
        rule="prompt_length_mismatch",
        symptom=f"prompts {'longer' if median > 1 else 'shorter'} than the workload intends",
        metric="prompt_length.sent_per_intended (usage.prompt_tokens / intended)",
        figure=f"sent prompts are {median:.2f}x their intended length at the median "
        f"({low:.2f}x to {high:.2f}x over {requests} requests)",
        cause=(
            "the calibration did not carry over: the template adds more per message than "
            "probed, or replies re-encode to other lengths"
            if calibrated
            else "lengths were uncalibrated (--no-calibrate, or the server reports no "
            "usage): a word is not one token for this tokenizer"
        ),
        advice="calibrate (drop --no-calibrate); read latencies against the sent lengths",
        values={"median": median, "min": low, "max": high},
    )


def client_bound(
    summary: Mapping[str, object],
    max_concurrency: int | None,
    t: LoadgenThresholds = LoadgenThresholds(),
) -> Finding | None:
    delay_ms = number(summary, "send_delay_ms", "p95")
    ttft_ms = number(summary, "ttft_ms", "p50")
    if delay_ms is None or not ttft_ms:
        return None
    if delay_ms < max(t.min_send_delay_ms, t.send_delay_ttft_ratio * ttft_ms):
        return None
    held = (
        f"requests waited for one of --max-concurrency {max_concurrency} slots"
        if max_concurrency is not None
        else "the client could not send requests at their arrival times (a busy CPU, or "
        "many requests due at once)"
    )
    return Finding(
        rule="client_bound",
        symptom="requests left the client late",
        metric="send_delay_ms",
        figure=f"send delay P95 {delay_ms:.1f} ms against a TTFT P50 of {ttft_ms:.1f} ms",
        cause=f"{held}: the server saw less load than the workload offers, and TTFT "
        "(timed from the send) leaves the wait out",
        advice="raise --max-concurrency or drop it"
        if max_concurrency is not None
        else "run the load generator on an idle machine, or replay fewer requests at once",
        values={"send_delay_p95_ms": delay_ms, "ttft_p50_ms": ttft_ms},
    )


def requests_queued(
    summary: Mapping[str, object], t: LoadgenThresholds = LoadgenThresholds()
) -> Finding | None:
    ttft_ms = number(summary, "ttft_ms", "p50")
    fastest_ms = number(summary, "ttft_fastest_ms")
    if ttft_ms is None or fastest_ms is None or fastest_ms <= 0:
        return None
    if ttft_ms < t.queue_ttft_ratio * fastest_ms or ttft_ms - fastest_ms < t.min_queue_ms:
        return None
    share = 1.0 - fastest_ms / ttft_ms
    return Finding(
        rule="requests_queued",
        symptom=f"requests waited: about {100 * share:.0f}% of the time to first token",
        metric="ttft_ms, ttft_fastest_ms",
        figure=f"TTFT P50 {ttft_ms:.0f} ms against {fastest_ms:.0f} ms for a request that did "
        "not wait (nothing cached)",
        cause="the server was over capacity: requests queued before it computed them (their "
        "token latencies can look healthy meanwhile)",
        advice="offer less load (a lower --time-scale rate, fewer requests at once) or give "
        "the server more capacity (more running sequences, more replicas); the server's "
        "own diagnosis, where it has one, measures the queue exactly",
        values={"ttft_p50_ms": ttft_ms, "ttft_fastest_ms": fastest_ms, "queue_share": share},
    )


def judge(
    summary: Mapping[str, object],
    *,
    max_concurrency: int | None = None,
    thresholds: LoadgenThresholds = LoadgenThresholds(),
) -> list[Finding]:
    """Every rule that fires: goodput 0, failures, SLOs, cut runs, lengths, the client."""
    found = [
        goodput_zero(summary),
        *requests_failed(summary),
        slo_missed(summary),
        requests_not_completed(summary),
        prompt_length_mismatch(summary, thresholds),
        client_bound(summary, max_concurrency, thresholds),
        requests_queued(summary, thresholds),
    ]
    return [f for f in found if f is not None]
