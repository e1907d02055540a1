"""`kvswap loadgen` against a stub OpenAI-compatible server (tests/unit/loadgen_stub.py).

The stub answers request n with `max_tokens` words "r{n}w{i}", one SSE chunk each,
and a usage chunk; it records every body and counts what it served to the end, so
every figure the load generator reports can be checked against what was served.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvswap.errors import KvSwapError
from kvswap.obs.plots import LOADGEN_PLOT_FILES
from kvswap.obs.report import load_report
from kvswap.serve.loadgen.client import StreamResult, api_base, apply_chunk, sse_data
from kvswap.serve.loadgen.prompts import VOCAB_SIZE, WORDS, PromptBook
from kvswap.serve.loadgen.results import Outcome, RequestRecord
from kvswap.serve.loadgen.series import loadgen_series, token_arrivals
from kvswap.workload.mooncake import load_mooncake_trace, read_trace_rows, scaled_output_tokens
from tests import alone_then_burst
from tests.redis_server import free_port

from .cli_checks import cli, one_error_line
from .loadgen_stub import MODEL, StubOptions, StubServer

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "tests" / "data" / "mooncake_sample.jsonl"
LENGTH_SCALE = 0.05  # 26 words per hash id: prompts of ~25-280 words
FAST_TRACE = ("--trace", str(SAMPLE), "--time-scale", "0.01", "--length-scale", str(LENGTH_SCALE))
SESSIONS = (
    "--num-sessions", "3", "--turns", "3", "--prompt-tokens", "24", "--system-prompt-tokens",
    "8", "--user-tokens", "6", "--output-tokens", "5",
)  # fmt: skip
STANDARD_FIELDS = {"model", "max_tokens", "stream", "stream_options", "temperature"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def stub() -> Iterator[StubServer]:
    with StubServer() as server:
        yield server


def loadgen_json(
    capsys: pytest.CaptureFixture[str], url: str, *flags: str
) -> tuple[dict[str, Any], str]:
    code, out, err = cli(capsys, "loadgen", "--url", url, "--json", *flags)
    assert code == 0, err
    return json.loads(out), err


def probes(summary: dict[str, Any]) -> int:
    """The calibration's requests, which the stub served before the replay's."""
    count = summary["calibration"]["probe_requests"]
    assert isinstance(count, int)
    return count


# --- what is reported equals what was served ---------------------------------------


def test_a_trace_replay_reports_exactly_what_the_stub_served(
    stub: StubServer, capsys: pytest.CaptureFixture[str]
) -> None:
    summary, err = loadgen_json(capsys, stub.url, *FAST_TRACE)
    assert probes(summary) == 2  # one token per word: the stub's counts are the words
    assert summary["calibration"]["tokens_per_word"] == 1.0
    served = stub.state.replayed(probes(summary))
    assert err == ""  # --json: no progress bar, no header line
    assert summary["requests_completed"] == summary["requests_sent"] == len(served) == 20
    assert summary["requests_failed"] == summary["requests_cancelled"] == 0
    assert summary["tokens_generated"] == sum(len(s.reply.split()) for s in served)
    rows = read_trace_rows(SAMPLE)
    expected = sorted(scaled_output_tokens(row, LENGTH_SCALE) for row in rows)
    assert sorted(int(s.body["max_tokens"]) for s in served) == expected  # type: ignore[call-overload]
    assert summary["prompt_tokens"] == sum(len(p) for p in stub.state.prompts[probes(summary) :])
    assert summary["cached_tokens"] > 0  # rows sharing hash id 0 share a text prefix
    assert summary["model"] == MODEL and summary["endpoint"] == "chat"
    for s in served:
        assert set(s.body) == STANDARD_FIELDS | {"messages"}  # nothing a server could refuse
        assert s.body["stream_options"] == {"include_usage": True}
        assert s.body["temperature"] == 0 and s.body["stream"] is True


def test_without_usage_the_output_tokens_are_the_chunks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with StubServer(StubOptions(with_usage=False)) as server:
        summary, _ = loadgen_json(capsys, server.url, *FAST_TRACE, "--max-requests", "6")
        served = server.state.replayed(probes(summary))
        assert summary["tokens_generated"] == sum(len(s.reply.split()) for s in served)
    assert summary["requests_completed"] == 6
    assert summary["prompt_tokens"] is None and summary["cached_tokens"] is None
    assert summary["prompt_length"] is None
    assert summary["calibration"]["tokens_per_word"] is None
    assert summary["calibration"]["line"] == (
        "prompt lengths uncalibrated (about 1 word per token): the server reports no "
        "usage.prompt_tokens"
    )


def test_failed_requests_are_counted_with_their_status_and_message(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with StubServer(StubOptions(fail_every=3)) as server:
        # Uncalibrated: the stub's request numbers are the replay's.
        summary, _ = loadgen_json(capsys, server.url, *FAST_TRACE, "--no-calibrate")
        completed = len(server.state.completed)
    assert summary["requests_failed"] == 7  # stub requests 0, 3, ..., 18
    assert summary["requests_completed"] == completed == 13
    assert summary["errors_by_kind"] == {"HTTP 500": 7}
    first = summary["errors"][0]
    assert first["status"] == 500 and re.fullmatch(
        r"HTTP 500: stub failure for request \d+", first["message"]
    )


def test_when_every_request_fails_the_summary_is_printed_then_one_error_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with StubServer(StubOptions(fail_every=1)) as server:
        code, out, err = cli(capsys, "loadgen", "--url", server.url, *FAST_TRACE, "--quiet")
    assert code == 2
    assert "0 completed, 20 failed" in out
    assert "every request sent failed (20); the first: HTTP 500" in one_error_line(err)


def test_an_answer_that_is_not_an_event_stream_is_a_failed_request(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with StubServer(StubOptions(ignore_stream=True)) as server:
        code, out, err = cli(capsys, "loadgen", "--url", server.url, *FAST_TRACE, "--json")
    assert code == 2 and json.loads(out)["requests_failed"] == 20
    assert "not an event stream: the answer has no `data:` lines" in one_error_line(err)


def test_goodput_counts_the_requests_within_the_slos(
    stub: StubServer, capsys: pytest.CaptureFixture[str]
) -> None:
    loose, _ = loadgen_json(capsys, stub.url, *FAST_TRACE, "--slo-ttft-ms", "1e7")
    assert loose["goodput_requests"] == loose["requests_completed"] == 20
    # No real first token arrives within a nanosecond.
    strict, _ = loadgen_json(capsys, stub.url, *FAST_TRACE, "--slo-ttft-ms", "1e-6")
    assert strict["goodput_requests"] == 0 and strict["goodput_requests_per_s"] == 0
    assert strict["slo_ttft_ms"] == 1e-6 and strict["slo_tpot_ms"] is None


# --- conversations and prompts ------------------------------------------------------


def test_later_turns_send_the_conversation_with_the_servers_replies(
    stub: StubServer, capsys: pytest.CaptureFixture[str]
) -> None:
    summary, _ = loadgen_json(capsys, stub.url, *SESSIONS)
    assert probes(summary) == 3  # a system message and later turns: the 3-message probe too
    served = stub.state.replayed(probes(summary))
    assert summary["requests_completed"] == len(served) == 9
    first_turns = [s for s in served if len(s.body["messages"]) == 2]  # type: ignore[arg-type]
    assert len(first_turns) == 3
    systems = {json.dumps(s.body["messages"][0]) for s in first_turns}  # type: ignore[index]
    assert len(systems) == 1  # one shared system prompt
    assert json.loads(systems.pop())["role"] == "system"
    later = [s for s in served if s not in first_turns]
    for turn in later:
        messages: list[dict[str, str]] = turn.body["messages"]  # type: ignore[assignment]
        previous = [s for s in served if s.body["messages"] == messages[:-2]]
        assert len(previous) == 1, "a later turn extends exactly one earlier request"
        assert previous[0].number < turn.number
        assert messages[-2] == {"role": "assistant", "content": previous[0].reply}
        assert messages[-1]["role"] == "user" and len(messages[-1]["content"].split()) == 6


def test_completions_send_later_turns_as_the_prompt_so_far(
    stub: StubServer, capsys: pytest.CaptureFixture[str]
) -> None:
    summary, _ = loadgen_json(capsys, stub.url, *SESSIONS, "--endpoint", "completions")
    served = stub.state.replayed(probes(summary))
    assert summary["requests_completed"] == 9 and summary["endpoint"] == "completions"
    assert all(s.path == "/v1/completions" for s in served)
    assert all(set(s.body) == STANDARD_FIELDS | {"prompt"} for s in served)
    prompts = {str(s.body["prompt"]): s for s in served}
    followers = 0
    for prompt in prompts:
        parents = [p for p in prompts if p != prompt and prompt.startswith(p + prompts[p].reply)]
        followers += bool(parents)
    assert followers == 6  # turns 1 and 2 of each of the 3 sessions


def test_equal_hash_ids_give_equal_text_prefixes(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 1536, "output_length": 4, "hash_ids": [7, 8, 9]},
        {"timestamp": 1, "input_length": 1536, "output_length": 4, "hash_ids": [7, 8, 5]},
        {"timestamp": 2, "input_length": 600, "output_length": 4, "hash_ids": [5, 8]},
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))

    def texts() -> list[str]:
        workload = load_mooncake_trace(trace, vocab_size=VOCAB_SIZE, length_scale=0.02)
        book = PromptBook(workload, "completions")
        return [str(book.input_for(i).fields["prompt"]) for i in range(len(workload))]

    first, second, third = (text.split(" ") for text in texts())
    assert texts() == texts()  # the same trace gives the same text on every run
    block = 10  # 512 x 0.02 words per hash id
    assert len(first) == len(second) == 3 * block and len(third) == block + 2
    assert first[: 2 * block] == second[: 2 * block]  # hash ids 7, 8
    assert first[2 * block :] != second[2 * block :]  # 9 vs 5
    assert third[:block] == second[2 * block :]  # hash id 5 is the same words anywhere
    assert all(word in WORDS for word in first)


# --- bounds -------------------------------------------------------------------------


def test_max_requests_bounds_what_is_sent(
    stub: StubServer, capsys: pytest.CaptureFixture[str]
) -> None:
    summary, _ = loadgen_json(capsys, stub.url, *SESSIONS, "--max-requests", "4")
    assert len(stub.state.served) == probes(summary) + 4
    assert summary["requests_planned"] == summary["requests_sent"] == 4
    assert summary["requests_completed"] == 4


def test_duration_stops_the_run_and_counts_the_cancelled(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Each reply takes 1000 x 50 ms: only the deadline can end this run.
    with StubServer(StubOptions(chunk_delay_s=0.05)) as server:
        summary, _ = loadgen_json(
            capsys, server.url, "--num-sessions", "2", "--turns", "2", "--output-tokens",
            "1000", "--duration-s", "0.3",
        )  # fmt: skip
        assert len(server.state.served) == probes(summary) + 2
        assert not server.state.replayed(probes(summary))
    assert summary["stopped_by"] == "duration" and summary["duration_s"] == 0.3
    assert summary["requests_cancelled"] == summary["requests_sent"] == 2
    assert summary["requests_completed"] == 0 and summary["requests_not_sent"] == 2


def test_a_request_past_timeout_s_fails_with_that_reason(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with StubServer(StubOptions(chunk_delay_s=0.05)) as server:
        code, out, err = cli(
            capsys, "loadgen", "--url", server.url, "--num-sessions", "1", "--turns", "1",
            "--output-tokens", "1000", "--timeout-s", "0.2", "--json",
        )  # fmt: skip
    assert code == 2
    summary = json.loads(out)
    assert summary["requests_failed"] == 1 and summary["errors_by_kind"] == {"timeout": 1}
    assert "no complete answer within --timeout-s 0.2" in one_error_line(err)


def test_max_concurrency_bounds_requests_in_flight(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with StubServer(StubOptions(chunk_delay_s=0.002)) as server:
        summary, _ = loadgen_json(
            capsys, server.url, *FAST_TRACE, "--max-concurrency", "2", "--report",
            str(tmp_path / "r"),
        )  # fmt: skip
    assert summary["requests_completed"] == 20
    series = load_report(tmp_path / "r").series
    assert max(p.num_running for p in series.points) <= 2


# --- user mistakes: one line, nothing sent -------------------------------------------


def test_an_unreachable_url_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    code, out, err = cli(capsys, "loadgen", "--url", url, *FAST_TRACE)
    assert code == 2 and out == ""
    assert f"cannot reach {url}: " in one_error_line(err)


def test_a_server_without_the_openai_api_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with StubServer(StubOptions(openai=False)) as server:
        code, _, err = cli(capsys, "loadgen", "--url", server.url, "--quiet")
    assert code == 2
    line = one_error_line(err)
    assert "is not an OpenAI-compatible server: GET" in line and "answered HTTP 404" in line


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--url", "ftp://127.0.0.1:1"), "allowed: an http:// or https:// URL"),
        (("--max-concurrency", "0"), "--max-concurrency 0: allowed: an integer >= 1"),
        (("--max-requests", "0"), "--max-requests 0: allowed: an integer >= 1"),
        (("--duration-s", "nan"), "--duration-s nan: allowed: a finite number > 0"),
        (("--slo-tpot-ms", "-1"), "--slo-tpot-ms -1.0: allowed: a finite number > 0"),
        (("--synthetic", "--trace", str(SAMPLE)), "give one workload, not both"),
        (("--model", "other"), "--model 'other': not served by"),
        (("--trace", "/nonexistent.jsonl"), "trace file not found"),
    ],
)
def test_bad_flags_are_one_line_and_send_nothing(
    stub: StubServer, capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], message: str
) -> None:
    code, _, err = cli(capsys, "loadgen", "--url", stub.url, "--quiet", *flags)
    assert code == 2
    assert message in one_error_line(err)
    assert stub.state.served == []


def test_the_api_key_is_sent_and_never_shown(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    key = "sk-secret-loadgen"
    with StubServer(StubOptions(api_key=key)) as server:
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        code, _, err = cli(capsys, "loadgen", "--url", server.url, "--quiet")
        assert code == 2 and "HTTP 401 (invalid api key); give" in one_error_line(err)
        monkeypatch.setenv("OPENAI_API_KEY", key)
        report = tmp_path / "r"
        summary, _ = loadgen_json(capsys, server.url, *FAST_TRACE, "--report", str(report))
    assert summary["requests_completed"] == 20
    assert key not in json.dumps(summary) and key not in (report / "report.json").read_text()
    assert load_report(report).config["loadgen"]["api_key_given"] is True  # type: ignore[index]


# --- output: --json, the text table, --report, kvswap report ------------------------


def test_json_has_the_documented_keys(stub: StubServer, capsys: pytest.CaptureFixture[str]) -> None:
    summary, _ = loadgen_json(capsys, stub.url, *FAST_TRACE, "--max-requests", "3")
    assert set(summary) == {
        "command", "url", "model", "endpoint", "workload", "requests_planned", "requests_sent",
        "requests_completed", "requests_failed", "requests_cancelled", "requests_not_sent",
        "duration_s", "tokens_generated", "prompt_tokens", "cached_tokens",
        "cached_token_share", "requests_per_s", "throughput_tok_s", "goodput_requests",
        "goodput_requests_per_s", "slo_ttft_ms", "slo_tpot_ms", "slo_ttft_met_requests",
        "slo_tpot_met_requests", "ttft_ms", "ttft_fastest_ms", "tpot_ms", "itl_ms",
        "e2e_latency_ms",
        "send_delay_ms", "prompt_length", "errors_by_kind", "errors", "stopped_by",
        "calibration",
    }  # fmt: skip
    assert "requests" not in summary  # per-request records go to report.json only
    assert set(summary["send_delay_ms"]) == {"p50", "p95", "p99"}
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
        assert set(summary[key]) == {"p50", "p95", "p99"}
        assert 0 < summary[key]["p50"] <= summary[key]["p95"] <= summary[key]["p99"]


def test_the_text_summary_names_every_figure(
    stub: StubServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = cli(capsys, "loadgen", "--url", stub.url, *FAST_TRACE)
    assert code == 0
    assert out.startswith(f"loadgen: mooncake:{SAMPLE.name}: 20 requests to {stub.url}")
    for label in ("requests", "goodput (req/s)", "TTFT (ms)", "TPOT (ms)",
                  "inter-token latency (ms)", "cached prompt tokens"):  # fmt: skip
        assert re.search(rf"^{re.escape(label)}\s", out, re.MULTILINE), label
    assert "20 completed, 0 failed, 0 cancelled (20 sent of 20)" in out


def assert_page_is_self_contained(page: Path) -> None:
    html = page.read_text()
    assert "http://" not in html.replace("http://127.0.0.1", "") and "https://" not in html
    for source in re.findall(r'(?:src|href)="([^"]+)"', html):
        assert not Path(source).is_absolute() and (page.parent / source).is_file(), source


def test_report_writes_a_page_with_the_client_side_plots(
    stub: StubServer, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "kvswap-run"
    summary, err = loadgen_json(capsys, stub.url, *SESSIONS, "--report", str(out))
    assert err == f"report: {out / 'index.html'}\n"
    for file in LOADGEN_PLOT_FILES.values():
        assert (out / file).read_bytes()[:8] == PNG_MAGIC
    assert_page_is_self_contained(out / "index.html")
    html = (out / "index.html").read_text()
    assert "kvswap loadgen report: kvswap-run" in html and "goodput (req/s)" in html
    assert "loadgen.max_concurrency" in html and "healthy" not in html
    report = load_report(out)
    assert report.is_loadgen and report.watermarks is None
    # Every request completed in full and lengths match: at most the client may be slow
    # on a busy host; nothing else fires, and an empty diagnosis says what was checked.
    assert {f.rule for f in report.findings} <= {"client_bound"}
    if not report.findings:
        assert "No load-test rule fired. Checked: failed requests by kind" in html
    assert report.summary == summary
    assert report.series.points[-1].tokens_generated == summary["tokens_generated"]
    assert report.series.ttft.count == summary["requests_completed"]


def test_kvswap_report_compares_two_loadgen_runs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    runs = {"fast-server": 0.0, "slow-server": 0.003}
    for name, delay_s in runs.items():
        with StubServer(StubOptions(chunk_delay_s=delay_s)) as server:
            loadgen_json(capsys, server.url, *FAST_TRACE, "--report", str(tmp_path / name))
    code, out, err = cli(
        capsys, "report", *(str(tmp_path / n) for n in runs), "--out", str(tmp_path / "cmp")
    )
    assert code == 0, err
    page = tmp_path / "cmp" / "index.html"
    assert out.strip() == str(page)
    assert_page_is_self_contained(page)
    html = page.read_text()
    assert "fast-server vs slow-server" in html and '<a href="../slow-server/index.html">' in html
    assert html.count("<td>goodput (req/s)</td>") == 1 and "swap-wait" not in html
    assert '<tr class="diff"><td>loadgen.url</td>' in html  # two servers, two URLs
    for file in LOADGEN_PLOT_FILES.values():
        assert (tmp_path / "cmp" / file).read_bytes()[:8] == PNG_MAGIC
    # One run alone renders its own page again, report.json untouched.
    before = (tmp_path / "fast-server" / "report.json").read_bytes()
    assert cli(capsys, "report", str(tmp_path / "fast-server"))[0] == 0
    assert (tmp_path / "fast-server" / "report.json").read_bytes() == before


def test_ctrl_c_stops_sending_cancels_in_flight_and_prints_what_was_measured(
    tmp_path: Path,
) -> None:
    """SIGINT to a real `python -m kvswap loadgen`: exit 130, the summary on stdout."""
    report = tmp_path / "r"
    with StubServer(StubOptions(chunk_delay_s=0.02)) as server:
        command = [
            sys.executable, "-m", "kvswap", "loadgen", "--url", server.url, "--json",
            "--num-sessions", "500", "--turns", "1", "--output-tokens", "5",
            "--max-concurrency", "1", "--report", str(report), "--no-calibrate",
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        try:
            deadline = time.monotonic() + 240  # startup imports torch: slow on a busy host
            # The stub holding request 4 means the client finished request 3 (concurrency 1).
            while len(server.state.served) < 4 and time.monotonic() < deadline:
                assert child.poll() is None, child.communicate()
                time.sleep(0.05)
            child.send_signal(signal.SIGINT)
            out, err = child.communicate(timeout=120)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        num_served = len(server.state.served)
    assert child.returncode == 130, err
    summary = json.loads(out)
    assert summary["stopped_by"] == "SIGINT"
    assert summary["requests_completed"] >= 3
    # It stopped sending; the last request may have been cancelled before it arrived.
    assert num_served <= summary["requests_sent"] <= num_served + 1 < 500
    assert summary["requests_cancelled"] <= 1  # --max-concurrency 1
    assert summary["requests_completed"] + summary["requests_cancelled"] == summary["requests_sent"]
    assert err.decode().strip().splitlines()[-1].startswith("kvswap: interrupted; ")
    assert load_report(report).summary["stopped_by"] == "SIGINT"


# --- the parts -----------------------------------------------------------------------


def test_sse_lines_and_chunks() -> None:
    assert sse_data("data: {}") == "{}" and sse_data("data:[DONE]") == "[DONE]"
    assert sse_data(": keep-alive") is None and sse_data("event: x") is None
    result = StreamResult()
    apply_chunk(result, {"choices": [{"delta": {"role": "assistant"}}]}, "chat", 1.0)
    apply_chunk(result, {"choices": [{"delta": {"content": "Hi"}}]}, "chat", 2.0)
    apply_chunk(result, {"choices": [{"delta": {"reasoning_content": "hm"}}]}, "chat", 2.5)
    usage = {"completion_tokens": 3, "prompt_tokens": 9,
             "prompt_tokens_details": {"cached_tokens": 4}}  # fmt: skip
    apply_chunk(result, {"choices": [], "usage": usage}, "chat", 3.0)
    assert result.text == "Hi" and result.chunk_times_s == [2.0, 2.5]
    assert (result.completion_tokens, result.prompt_tokens, result.cached_tokens) == (3, 9, 4)
    apply_chunk(result, {"error": {"message": "boom"}}, "chat", 4.0)
    assert result.error == "error in stream: boom"


def test_api_base_accepts_the_server_or_its_v1_root() -> None:
    assert api_base("http://h:8000") == api_base("http://h:8000/v1/") == "http://h:8000/v1"
    with pytest.raises(KvSwapError, match="allowed: an http:// or https:// URL"):
        api_base("localhost:8000")


def test_the_series_spreads_tokens_over_chunks_and_keeps_the_total() -> None:
    record = RequestRecord(0, None, 0, max_tokens=7, due_s=0.0, outcome=Outcome.COMPLETED,
                           sent_s=0.0, done_s=1.0, chunk_times_s=[0.1, 0.5, 0.9],
                           output_tokens=7)  # fmt: skip
    assert token_arrivals(record) == [(0.1, 3), (0.5, 2), (0.9, 2)]
    cancelled = RequestRecord(1, None, 0, 5, 0.0, Outcome.CANCELLED, sent_s=0.2)
    series = loadgen_series([record, cancelled], duration_s=1.0, max_points=4)
    assert [p.tokens_generated for p in series.points] == [3, 5, 5, 7]
    assert [p.num_running for p in series.points] == [2, 2, 2, 0]
    assert series.ttft.count == 1 and series.itl.count == 2


def test_a_server_whose_requests_queue_is_diagnosed_as_queueing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Issue 33: a load test was green while every request waited many seconds for its
    first token. A server that admits one request at a time (0.25 s each): one request
    alone, then 16 together a second later; the median of the burst waits ~2 s against
    ~0.25 s for the lone one. (Sent all at once, a busy 2-core CI run held even the
    fastest tenth back for several admissions, and nothing showed an unqueued first
    token: the lone request is what does, as in the vLLM twin of this test.)"""
    trace = alone_then_burst.write(
        tmp_path / "alone_then_burst.jsonl", num_requests=1 + 16, burst_at_ms=1000
    )
    with StubServer(StubOptions(admit_s=0.25)) as server:
        summary, _ = loadgen_json(
            capsys, server.url, "--trace", str(trace), "--time-scale", "1",
            "--report", str(tmp_path / "report"),
        )  # fmt: skip
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    (queued,) = [f for f in report["diagnosis"] if f["rule"] == "requests_queued"]
    assert summary["ttft_ms"]["p50"] >= 4 * summary["ttft_fastest_ms"]
    assert "of the time to first token" in queued["symptom"]
    assert queued["values"]["queue_share"] > 0.75
