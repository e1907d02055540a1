"""A load test's own sections of its report page, after the summary table.

Prompt lengths     intended (the workload's) vs sent (the server's count):
                   min / P50 / P95 / max of each and of their ratio per request,
                   and how the text was calibrated
Failed requests    the listed failures: request, kind, HTTP status, message
Per-request records what report.json keeps of each request (and whether it is
                   all of them)
"""

from __future__ import annotations

from collections.abc import Mapping
from html import escape

from kvswap.obs.html import table
from kvswap.obs.jsonvalues import integer_or, lookup, number_or

_STATISTICS = ("min", "p50", "p95", "max")
RECORD_FIELDS = (
    "request id, session, turn, intended and sent prompt tokens, cached tokens, max_tokens, "
    "output tokens, TTFT (ms), outcome, HTTP status and failure kind"
)


def _prompt_lengths(summary: Mapping[str, object]) -> str:
    line = lookup(summary, "calibration", "line")
    calibration = f"<p>{escape(line)}</p>" if isinstance(line, str) else ""
    lengths = lookup(summary, "prompt_length")
    if not isinstance(lengths, Mapping):
        return calibration + (
            "<p>No completed request has both lengths: the server reported no "
            "usage.prompt_tokens.</p>"
        )
    rows = [
        (
            name,
            f"{number_or(lengths, 'intended_tokens', name):.0f}",
            f"{number_or(lengths, 'sent_tokens', name):.0f}",
            f"{number_or(lengths, 'sent_per_intended', name):.3f}",
        )
        for name in _STATISTICS
    ]
    header = ("over the completed requests", "intended tokens", "sent tokens", "sent / intended")
    count = integer_or(lengths, "requests")
    return (
        f"{calibration}{table(header, rows)}<p class='muted'>{count} requests; each column "
        "is its own ranking (sent / intended is paired per request). Intended: the "
        "workload's length (a later turn: the turn before + its output + the new user "
        "tokens); sent: the server's usage.prompt_tokens.</p>"
    )


def _failures(summary: Mapping[str, object]) -> str:
    errors = lookup(summary, "errors")
    listed = [e for e in errors if isinstance(e, Mapping)] if isinstance(errors, list) else []
    if not listed:
        return "<p>None.</p>"
    rows = [
        (
            str(e.get("request_id")),
            str(e.get("kind", "")),
            "-" if e.get("status") is None else str(e.get("status")),
            str(e.get("message", "")),
        )
        for e in listed
    ]
    failed = integer_or(summary, "requests_failed")
    more = (
        f"<p class='muted'>{failed - len(listed)} more not listed here; report.json has "
        "every request's record.</p>"
        if failed > len(listed)
        else ""
    )
    return table(("request", "kind", "HTTP status", "message"), rows) + more


def _records(summary: Mapping[str, object], num_records: int) -> str:
    planned = integer_or(summary, "requests_planned")
    if num_records == 0:
        return "<p>This report.json holds no per-request records (an older kvswap wrote it).</p>"
    which = (
        f"all {num_records} planned requests"
        if num_records >= planned
        else f"the first {num_records} of {planned} planned requests (capped to keep the "
        "file small)"
    )
    return (
        f'<p><a href="report.json">report.json</a> "requests" holds a record of {which}: '
        f"{RECORD_FIELDS}.</p>"
    )


def loadgen_sections(summary: Mapping[str, object], num_records: int) -> list[tuple[str, str]]:
    """(title, HTML) of a load test's sections, for `run_page`."""
    return [
        ("Prompt lengths: intended vs sent", _prompt_lengths(summary)),
        ("Failed requests", _failures(summary)),
        ("Per-request records", _records(summary, num_records)),
    ]
