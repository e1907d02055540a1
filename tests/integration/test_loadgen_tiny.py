"""`kvswap loadgen` against a live `kvswap serve --model tiny`: sent prompt lengths.

The tiny model's built-in byte-level tokenizer spends about 5 tokens on each of the
load generator's words, so one word per intended token (`--no-calibrate`) sends
prompts ~5x the trace's lengths. Calibrated (the default), every prompt the chat
template leaves room for is sent within 10 % of its intended length, as the
per-request records in report.json show.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests import alone_then_burst
from tests.unit.serve_fakes import kvswap_server

REPO = Path(__file__).resolve().parents[2]
TRACE = ("--trace", str(REPO / "tests" / "data" / "mooncake_sample.jsonl"),
         "--time-scale", "0.01", "--length-scale", "0.2")  # fmt: skip  # 8-1,076 tokens


@contextmanager
def tiny_server() -> Iterator[str]:
    """A running `kvswap serve --model tiny` on a free loopback port; SIGTERM at the end."""
    with kvswap_server("--model", "tiny", "--device", "cpu", "--port", "0") as url:
        yield url


def loadgen(url: str, report: Path, *flags: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the --json summary, report.json) of one run."""
    run = subprocess.run(
        [sys.executable, "-m", "kvswap", "loadgen", "--url", url, "--json", *TRACE,
         "--report", str(report), *flags],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout), json.loads((report / "report.json").read_text())


def ratios(report: dict[str, Any], min_intended_tokens: int = 0) -> list[float]:
    return [
        r["sent_prompt_tokens"] / r["intended_prompt_tokens"]
        for r in report["requests"]
        if r["outcome"] == "completed" and r["intended_prompt_tokens"] > min_intended_tokens
    ]


def test_calibrated_prompts_match_the_trace_within_10_percent(tmp_path: Path) -> None:
    with tiny_server() as url:
        _, raw = loadgen(url, tmp_path / "raw", "--no-calibrate")
        summary, calibrated = loadgen(url, tmp_path / "calibrated")
    # Uncalibrated: about 5 tokens per word, and the page says so.
    assert statistics.median(ratios(raw)) > 4
    assert "prompt_length_mismatch" in {f["rule"] for f in raw["diagnosis"]}
    calibration = summary["calibration"]
    assert 4 < calibration["tokens_per_word"] < 6, calibration
    assert calibration["line"].startswith("calibrated to the server's tokenizer: ")
    assert summary["requests_completed"] == 20  # none too long for the server any more
    # The template alone is ~20 tokens: a prompt shorter than a few times that cannot be
    # sent at its length; every other one is within 10 %.
    room = 5 * calibration["request_overhead_tokens"]
    kept = ratios(calibrated, min_intended_tokens=round(room))
    assert len(kept) >= 15 and all(0.9 <= ratio <= 1.1 for ratio in kept), kept
    assert abs(summary["prompt_length"]["sent_per_intended"]["p50"] - 1) <= 0.05
    assert "prompt_length_mismatch" not in {f["rule"] for f in calibrated["diagnosis"]}


def test_an_overloaded_server_is_diagnosed_as_queueing(tmp_path: Path) -> None:
    """On a real server: `kvswap serve tiny` running one request at a time, one chat
    alone, then 47 arriving together, each generating 64 tokens. The burst queues, and
    the load test's report says so from the client's TTFTs alone (rule 7: the median
    against what a request costs when it does not wait, which the lone one shows)."""
    trace = alone_then_burst.write(tmp_path / "alone_then_burst.jsonl")
    with kvswap_server("--model", "tiny", "--device", "cpu", "--port", "0",
                       "--max-num-seqs", "1") as url:  # fmt: skip
        run = subprocess.run(
            [sys.executable, "-m", "kvswap", "loadgen", "--url", url, "--json",
             "--trace", str(trace), "--report", str(tmp_path / "lg")],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    report = json.loads((tmp_path / "lg" / "report.json").read_text())
    assert summary["requests_completed"] == alone_then_burst.NUM_REQUESTS
    (queued,) = [f for f in report["diagnosis"] if f["rule"] == "requests_queued"]
    assert queued["values"]["queue_share"] > 0.5
