"""`kvswap loadgen`: prompt text calibrated to the server's tokenizer, against the stub
server (tests/unit/loadgen_stub.py) with a "tokenizer" of 5 tokens per word, a template
of 20 tokens per request and 9 per further message.

A live `kvswap serve --model tiny` run of the same is in
tests/integration/test_loadgen_tiny.py.
"""

from __future__ import annotations

import json
import statistics
from html import escape
from pathlib import Path
from typing import Any

import pytest

from kvswap.obs.report import load_report
from kvswap.serve.loadgen.prompts import WORDS, TextScale

from .cli_checks import cli
from .loadgen_stub import StubOptions, StubServer

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "tests" / "data" / "mooncake_sample.jsonl"
LENGTH_SCALE = 0.2  # prompts of 8-1,076 tokens
TRACE = ("--trace", str(SAMPLE), "--time-scale", "0.01", "--length-scale", str(LENGTH_SCALE))
TOKENIZER = StubOptions(tokens_per_word=5, request_overhead_tokens=20, message_overhead_tokens=9)


def loadgen(
    capsys: pytest.CaptureFixture[str], url: str, *flags: str
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The --json summary and report.json's per-request records of one run."""
    report = Path(flags[flags.index("--report") + 1])
    code, out, err = cli(capsys, "loadgen", "--url", url, "--json", *flags)
    assert code == 0, err
    records = json.loads((report / "report.json").read_text())["requests"]
    return json.loads(out), records


def ratios(records: list[dict[str, Any]], min_intended_tokens: int = 0) -> list[float]:
    return [
        r["sent_prompt_tokens"] / r["intended_prompt_tokens"]
        for r in records
        if r["outcome"] == "completed" and r["intended_prompt_tokens"] > min_intended_tokens
    ]


# --- calibration ----------------------------------------------------------------------


def test_trace_prompts_are_sent_at_their_intended_length(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with StubServer(TOKENIZER) as server:
        before, raw = loadgen(
            capsys, server.url, *TRACE, "--no-calibrate", "--report", str(tmp_path / "raw")
        )
        after, calibrated = loadgen(capsys, server.url, *TRACE, "--report", str(tmp_path / "cal"))
    assert before["calibration"]["probe_requests"] == 0
    assert statistics.median(ratios(raw)) > 4.5  # 1 word per token, 5 tokens per word
    assert "prompt_length_mismatch" in {f.rule for f in load_report(tmp_path / "raw").findings}
    calibration = after["calibration"]
    assert calibration["tokens_per_word"] == 5.0
    assert calibration["request_overhead_tokens"] == 20.0
    assert calibration["probe_requests"] == 2  # one message per request: no message probe
    assert calibration["probe_output_tokens"] == 2  # max_tokens 1 each
    assert calibration["line"] == (
        "calibrated to the server's tokenizer: 5.000 tokens per word, 20.0 tokens of "
        "template per request; prompts go out as 0.200 words per intended token (2 probes)"
    )
    # Within 10 % wherever the template alone (20 tokens) leaves room for the prompt.
    assert all(0.9 <= ratio <= 1.1 for ratio in ratios(calibrated, min_intended_tokens=40))
    assert 0.98 <= after["prompt_length"]["sent_per_intended"]["p50"] <= 1.02
    assert after["cached_tokens"] > 0  # equal hash ids still give equal text prefixes
    report = load_report(tmp_path / "cal")
    assert "prompt_length_mismatch" not in {f.rule for f in report.findings}
    assert report.run["calibration"] == calibration["line"]
    html = (tmp_path / "cal" / "index.html").read_text()
    assert "Prompt lengths: intended vs sent" in html and escape(calibration["line"]) in html


def test_conversations_are_calibrated_message_by_message(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    sessions = (
        "--num-sessions", "3", "--turns", "3", "--prompt-tokens", "400",
        "--system-prompt-tokens", "100", "--user-tokens", "120", "--output-tokens", "5",
    )  # fmt: skip
    with StubServer(TOKENIZER) as server:
        summary, records = loadgen(capsys, server.url, *sessions, "--report", str(tmp_path / "r"))
    calibration = summary["calibration"]
    assert calibration["probe_requests"] == 3  # system messages and later turns: 3 messages
    assert calibration["message_overhead_tokens"] == 9.0
    assert summary["requests_completed"] == 9
    later = [r for r in records if r["turn"] > 0]
    # Turn k intends turn k-1's length + its output + the new user tokens.
    assert {r["intended_prompt_tokens"] for r in later} == {400 + 5 + 120, 400 + 2 * (5 + 120)}
    assert all(0.9 <= ratio <= 1.1 for ratio in ratios(records))


def test_a_probe_too_long_for_the_server_is_retried_at_half_the_size(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # 512 probe words are 2,580 tokens: refused; 256 words (1,300) fit.
    options = StubOptions(tokens_per_word=5, request_overhead_tokens=20, max_prompt_tokens=1500)
    with StubServer(options) as server:
        summary, _ = loadgen(
            capsys, server.url, *TRACE, "--max-requests", "2", "--report", str(tmp_path / "r")
        )
    assert summary["calibration"]["probe_requests"] == 3
    assert summary["calibration"]["tokens_per_word"] == 5.0


def test_text_keeps_equal_prefixes_at_any_rate() -> None:
    shared, ids_a, ids_b = list(range(60)), list(range(100, 140)), list(range(200, 230))
    for rate in (0.2, 1.0, 1.7):
        scale = TextScale(words_per_token=rate)
        a, b = scale.text(shared + ids_a).split(" "), scale.text(shared + ids_b).split(" ")
        assert len(a) == round(100 * rate) and len(b) == round(90 * rate)
        common = int(60 * rate)
        assert a[:common] == b[:common]  # the shared ids' words
        assert a[common + 1 :] != b[common + 1 : len(a)]
        assert scale.text(shared).split(" ") == a[: round(60 * rate)]  # a prefix's text
        assert all(word in WORDS for word in a)
    # The template's tokens come off the words; a part never vanishes.
    assert len(TextScale(0.2).text(shared, overhead_tokens=20).split(" ")) == 8
    assert TextScale(0.2).text([1, 2]) == WORDS[1]
    assert TextScale(1.0).text(shared) == " ".join(WORDS[i] for i in shared)  # --no-calibrate
