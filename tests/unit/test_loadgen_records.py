"""`kvswap loadgen`: per-request records in report.json, the load-test page's own
sections, and a run whose every request is refused, against the stub server
(tests/unit/loadgen_stub.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvswap.commands.loadgen import MAX_REPORTED_REQUESTS
from kvswap.obs.loadgen_findings import judge
from kvswap.obs.loadgen_page import loadgen_sections
from kvswap.obs.report import load_report
from kvswap.readers import MAX_REPORT_BYTES
from kvswap.serve.loadgen.results import Outcome, RequestRecord, unwaited_ttft_ms
from kvswap.workload.mooncake import read_trace_rows, scaled_input_tokens

from .cli_checks import cli, one_error_line
from .loadgen_stub import StubOptions, StubServer

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "tests" / "data" / "mooncake_sample.jsonl"
LENGTH_SCALE = 0.2  # prompts of 8-1,076 tokens
TRACE = ("--trace", str(SAMPLE), "--time-scale", "0.01", "--length-scale", str(LENGTH_SCALE))
RECORD_FIELDS = {
    "request_id", "session_id", "turn", "intended_prompt_tokens", "sent_prompt_tokens",
    "cached_tokens", "max_tokens", "output_tokens", "ttft_ms", "outcome", "http_status",
    "error_kind",
}  # fmt: skip


def loadgen(
    capsys: pytest.CaptureFixture[str], url: str, *flags: str
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The --json summary and report.json's per-request records of one run."""
    report = Path(flags[flags.index("--report") + 1])
    code, out, err = cli(capsys, "loadgen", "--url", url, "--json", *flags)
    assert code == 0, err
    records = json.loads((report / "report.json").read_text())["requests"]
    return json.loads(out), records


# --- per-request records ----------------------------------------------------------------


def test_report_json_keeps_a_record_of_every_request(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with StubServer() as server:
        summary, records = loadgen(capsys, server.url, *TRACE, "--report", str(tmp_path / "r"))
        sent = [
            len(words) for words in server.state.prompts[summary["calibration"]["probe_requests"] :]
        ]
    assert "requests" not in summary  # the --json object stays small
    assert len(records) == 20 and all(set(r) == RECORD_FIELDS for r in records)
    rows = read_trace_rows(SAMPLE)
    assert [r["intended_prompt_tokens"] for r in records] == [
        scaled_input_tokens(row, LENGTH_SCALE) for row in rows
    ]
    assert sorted(r["sent_prompt_tokens"] for r in records) == sorted(sent)
    for record in records:
        assert record["outcome"] == "completed" and record["http_status"] == 200
        assert record["ttft_ms"] > 0 and record["output_tokens"] == record["max_tokens"]
        assert record["error_kind"] is None and record["session_id"] is None
    assert load_report(tmp_path / "r").requests == tuple(records)
    html = (tmp_path / "r" / "index.html").read_text()
    assert "holds a record of all 20 planned requests" in html


def test_the_largest_list_of_records_weighs_well_under_the_read_cap() -> None:
    """report.json is read back with a 16 MiB cap; MAX_REPORTED_REQUESTS of the widest
    records (every field at a large value) as write_report writes them take under half."""
    record = RequestRecord(
        999_999, 999_999, 999, 999_999, 0.0, Outcome.FAILED, sent_s=1e5, done_s=2e5,
        chunk_times_s=[1.234567e5], output_tokens=999_999, prompt_tokens=16_777_216,
        cached_tokens=16_777_216, http_status=413, error_kind="bad stream",
        intended_prompt_tokens=16_777_216,
    )  # fmt: skip
    one = json.dumps({"requests": [record.to_json()]}, indent=1)
    weight_bytes = MAX_REPORTED_REQUESTS * len(one)
    assert weight_bytes < MAX_REPORT_BYTES / 2, weight_bytes
    # A 12k-request trace is all kept.
    assert MAX_REPORTED_REQUESTS >= 12_000


def test_the_page_says_when_records_were_capped() -> None:
    summary: dict[str, object] = {"requests_planned": 30_000}
    sections = dict(loadgen_sections(summary, MAX_REPORTED_REQUESTS))
    assert (
        f"the first {MAX_REPORTED_REQUESTS} of 30000 planned requests"
        in (sections["Per-request records"])
    )


# --- a run whose every request is refused --------------------------------------------


def test_a_run_of_413s_shows_them_and_never_calls_itself_healthy(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out_dir = tmp_path / "r"
    with StubServer(StubOptions(max_prompt_tokens=5)) as server:
        code, out, err = cli(
            capsys, "loadgen", "--url", server.url, *TRACE, "--quiet", "--report", str(out_dir)
        )
    assert code == 2
    assert "every request sent failed (20); the first: HTTP 413: " in one_error_line(err)
    lines = out.splitlines()
    assert any(
        line.startswith("finding: goodput 0: no request counted (none of 20") for line in lines
    )
    assert any(
        line.startswith("finding: prompts too long for the server (HTTP 413)") for line in lines
    )
    assert "failed request 0: HTTP 413: " in out and "... 15 more failed requests" in out
    assert "No load-test rule fired" not in out and "healthy" not in out
    report = load_report(out_dir)
    assert [f.rule for f in report.findings] == ["goodput_zero", "requests_failed_http_413"]
    assert report.run["calibration"].startswith(
        "prompt lengths uncalibrated (about 1 word per token): the calibration probe failed: "
        "HTTP 413: "
    )
    html = (out_dir / "index.html").read_text()
    assert "goodput 0: no request counted" in html and "healthy" not in html
    assert "<h2>Failed requests</h2>" in html and "<td>HTTP 413</td><td>413</td>" in html
    assert all(r["http_status"] == 413 for r in report.requests)


def completed(request_id: int, sent_s: float, first_token_s: float, done_s: float) -> RequestRecord:
    return RequestRecord(
        request_id, request_id, 0, 8, due_s=sent_s, outcome=Outcome.COMPLETED, sent_s=sent_s,
        done_s=done_s, chunk_times_s=[first_token_s, done_s], output_tokens=2, cached_tokens=0,
    )  # fmt: skip


def test_what_a_request_costs_unwaited_comes_from_one_sent_alone_when_all_others_queued() -> None:
    """48 requests sent together to a server that delivers every first token but the
    first one's at the end: the fastest tenth waited as long as the median, the request
    sent alone (nothing else in flight) did not, and rule 7 names the queue."""
    records = [completed(0, 0.0, 0.07, 0.2)]
    records += [completed(i, 0.001 * i, 7.0, 7.1) for i in range(1, 48)]
    summary = {"ttft_ms": {"p50": 7000.0}, "ttft_fastest_ms": unwaited_ttft_ms(records)}
    assert summary["ttft_fastest_ms"] == pytest.approx(70.0)
    (finding,) = [f for f in judge(summary) if f.rule == "requests_queued"]
    assert finding.values["queue_share"] == pytest.approx(0.99)
    # Sent together, none is alone: the fastest tenth stands.
    together = [completed(i, 0.0, 0.1 * (i + 1), 1.0 + i) for i in range(10)]
    assert unwaited_ttft_ms(together) == pytest.approx(100.0)
    # One at a time, each alone: their median.
    spaced = [completed(i, 10.0 * i, 10.0 * i + 0.05 * (i + 1), 10.0 * i + 1) for i in range(5)]
    assert unwaited_ttft_ms(spaced) == pytest.approx(50.0)
