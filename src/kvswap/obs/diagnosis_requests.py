"""The diagnosis's rules about requests and their KV's source: rule 7 (remote hits that
failed to arrive), rule 8 (requests refused at admission), rule 9 (the remote store
was down) and rule 10 (requests queued); `obs.diagnosis` runs them."""

from __future__ import annotations

import re
from collections.abc import Mapping

from kvswap.obs.finding import Finding, Thresholds
from kvswap.obs.jsonvalues import integer_or, number_or
from kvswap.obs.timeseries import TimeSeries


def remote_fetches_failing(
    summary: Mapping[str, object], series: TimeSeries, t: Thresholds = Thresholds()
) -> Finding | None:
    found = integer_or(summary, "remote", "found_blocks")
    failed = integer_or(summary, "remote", "fetch_failures")
    if found < max(1, t.min_remote_blocks) or failed <= t.remote_failure_share * found:
        return None
    share = failed / found
    corrupt = integer_or(summary, "remote", "corrupt")
    outages = integer_or(summary, "remote", "outages")
    return Finding(
        rule="remote_fetches_failing",
        symptom=f"over {100 * t.remote_failure_share:.0f}% of remote hits recomputed",
        metric='kvswap_remote_misses_total{kind="fetch"} (remote.fetch_failures)',
        figure=f"{failed} of {found} blocks found in the remote store failed to arrive "
        f"({100 * share:.0f}%): {corrupt} corrupt values, {outages} outages",
        cause="the store drops keys between lookup and fetch (TTL, maxmemory eviction), "
        "returns values that fail their checks, or is unreachable: those blocks were "
        "computed again",
        advice="raise remote_ttl_s or the store's maxmemory, check remote_timeout_ms and "
        'kvswap_remote_store_events_total{event="outage"}',
        values={
            "found_blocks": float(found),
            "fetch_failures": float(failed),
            "share": share,
            "corrupt": float(corrupt),
            "outages": float(outages),
        },
    )


def remote_store_down(
    summary: Mapping[str, object], series: TimeSeries, t: Thresholds = Thresholds()
) -> Finding | None:
    outages = integer_or(summary, "remote", "outages")
    if outages < 1:
        return None
    written = integer_or(summary, "remote", "writes")
    skipped = integer_or(summary, "remote", "writes_skipped")
    lookups = integer_or(summary, "remote", "lookups")
    return Finding(
        rule="remote_store_down",
        symptom="the remote store was unreachable",
        metric='kvswap_remote_store_events_total{event="outage"} (remote.outages)',
        figure=f"{outages} outage{'s' if outages > 1 else ''}; {written} blocks written, "
        f"{skipped} writes skipped, {lookups} lookups",
        cause="while the store is down the remote tier is off: every lookup is a miss and "
        "finished prefixes are not written, so other engines cannot reuse them",
        advice="check remote_url and that the store is running and reachable; the warning "
        "logged at the first outage names the error",
        values={
            "outages": float(outages),
            "writes": float(written),
            "writes_skipped": float(skipped),
            "lookups": float(lookups),
        },
    )


_NEEDS_BLOCKS = re.compile(r"needs (\d+) blocks")


def requests_refused(
    summary: Mapping[str, object], series: TimeSeries, t: Thresholds = Thresholds()
) -> Finding | None:
    rejections = summary.get("rejections")
    reasons = [
        str(r.get("reason", "")) for r in rejections if isinstance(r, Mapping)
    ] if isinstance(rejections, list) else []  # fmt: skip
    refused = [reason for reason in reasons if not reason.startswith("aborted")]
    if not refused:
        return None
    total = integer_or(summary, "requests_completed") + len(reasons)
    needs = [int(m.group(1)) for reason in refused if (m := _NEEDS_BLOCKS.search(reason))]
    advice = (
        f"size the GPU tier for the longest request: it needs {max(needs)} blocks beside the "
        "protected sink blocks (gpu_kv_capacity_blocks), or cap request length "
        "(max_tokens, --max-model-len, a trace's --length-scale)"
        if needs
        else "shorten the requests to the model's maximum position (--max-model-len, "
        "max_tokens, a trace's --length-scale)"
    )
    return Finding(
        rule="requests_refused",
        symptom="requests refused before running",
        metric="requests_rejected (rejections)",
        figure=f"{len(refused)} of {total} requests could never run: {refused[0]}",
        cause="the tiers or the model are sized for shorter requests than the workload sends",
        advice=advice,
        values={"refused": float(len(refused)), "requests": float(total)}
        | ({"max_blocks_needed": float(max(needs))} if needs else {}),
    )


def requests_queued(
    summary: Mapping[str, object], series: TimeSeries, t: Thresholds = Thresholds()
) -> Finding | None:
    """Rule 10: the time to first token went mostly to waiting for admission: the
    engine was over capacity, which no swap setting cures (and which hides behind
    healthy token latencies)."""
    share = number_or(summary, "queue_share_of_ttft")
    wait_p50 = number_or(summary, "queue_wait_ms", "p50")
    ttft_p50 = number_or(summary, "ttft_ms", "p50")
    if share < t.queue_share or wait_p50 < t.min_queue_wait_ms:
        return None
    return Finding(
        rule="requests_queued",
        symptom=f"requests waited: {100 * share:.0f}% of the time to first token was queueing",
        metric="queue_wait_ms, queue_share_of_ttft (ttft_ms)",
        figure=f"queue wait P50 {wait_p50:.0f} ms of a TTFT P50 {ttft_p50:.0f} ms; "
        f"{100 * share:.0f}% of all time to first token was spent before admission",
        cause="requests arrived faster than the engine finished them, so they waited in the "
        "queue: the engine was over capacity (the token latencies of those running can "
        "look healthy meanwhile)",
        advice="serve less load or more capacity: raise max_num_seqs if the GPU tier has room "
        "for more running sequences, add engines, or lower the arrival rate; the swap "
        "settings cannot shorten a queue",
        values={
            "queue_share_of_ttft": share,
            "queue_wait_p50_ms": wait_p50,
            "ttft_p50_ms": ttft_p50,
        },
    )
