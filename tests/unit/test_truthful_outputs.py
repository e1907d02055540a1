"""Outputs that say what happened: `tune` prints its TOML to stdout (the log to stderr)
unless --out, nothing lands in the working directory unasked, ties are called ties and
the safer watermark is the lower one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import tomllib

from kvswap.sim.tuner import Trial, choose

from .cli_checks import cli, one_error_line
from .test_sim_cli import SMALL_FLAGS


def trial(value: float, tok_s: float = 100.0, p99_ms: float = 50.0) -> Trial:
    return Trial("swap_out_high_watermark", value, tok_s, 10.0, p99_ms, 0.0, 0.1, 0)


def test_a_tie_goes_to_the_lower_watermark_and_says_the_workload_does_not_separate() -> None:
    pick, reason = choose([trial(0.95), trial(0.9), trial(0.85)], lambda v: v)
    assert pick.value == 0.85
    assert "all 3 candidates tied (this workload does not separate them)" in reason
    # A real difference is no tie: the faster one wins and nothing is said of ties.
    pick, reason = choose([trial(0.95, p99_ms=20.0), trial(0.9), trial(0.85)], lambda v: v)
    assert pick.value == 0.95 and "tied" not in reason


def test_tune_without_out_prints_the_toml_and_writes_nothing_here(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(capsys, "tune", *SMALL_FLAGS, "--num-sessions", "4", "--quiet")
    assert code == 0
    config = tomllib.loads(out)  # stdout is the TOML alone: `> tuned.toml` captures it
    assert "swap_out_high_watermark" in str(config)
    assert "recommended:" in err and "written to stdout" in err
    assert os.listdir(tmp_path) == []


def test_report_of_several_runs_needs_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(capsys, "report", "a", "b")
    assert code == 2 and "needs --out DIR" in one_error_line(err)
    assert os.listdir(tmp_path) == []


def test_an_engine_runs_report_shows_the_model_it_ran_not_the_sizing_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "report"
    flags = ["--num-sessions", "1", "--turns", "1", "--prompt-tokens", "8", "--output-tokens",
             "2", "--system-prompt-tokens", "4", "--device", "cpu"]  # fmt: skip
    code, _, _ = cli(capsys, "run", "--model", "tiny", *flags, "--report", str(report), "--json")
    assert code == 0
    config = json.loads((report / "report.json").read_text())["config"]
    assert config["model"] == {"source": "tiny", "dtype": "fp32", "device": "cpu"}
    assert "simulator" not in config  # an engine run simulated nothing


def test_requests_refused_at_admission_are_a_finding_with_a_sizing_hint() -> None:
    from kvswap.obs.diagnosis_requests import requests_refused
    from kvswap.obs.timeseries import TimeSeriesRecorder

    series = TimeSeriesRecorder().series()
    summary: dict[str, object] = {"requests_completed": 6, "rejections": [
        {"request_id": 3, "reason": "needs 40 blocks of 16 tokens but a running sequence "
                                    "must fit the GPU tier (28 usable blocks)"},
        {"request_id": 5, "reason": "needs 52 blocks of 16 tokens but a running sequence "
                                    "must fit the GPU tier (28 usable blocks)"},
        {"request_id": 7, "reason": "aborted mid-run: sampling failed"},
    ]}  # fmt: skip
    finding = requests_refused(summary, series)
    assert finding is not None
    assert finding.figure.startswith("2 of 9 requests could never run: needs 40 blocks")
    assert "it needs 52 blocks" in finding.advice
    # Aborted mid-run is not a sizing matter; nothing refused, nothing said.
    assert requests_refused({"rejections": summary["rejections"][2:]}, series) is None


def test_run_keeps_metrics_up_after_the_run_so_a_scrape_sees_the_final_values() -> None:
    import re
    import subprocess
    import sys
    import time

    import httpx

    process = subprocess.Popen(
        [sys.executable, "-m", "kvswap", "run", "--model", "tiny", "--device", "cpu",
         "--num-sessions", "1", "--turns", "1", "--prompt-tokens", "8", "--output-tokens", "3",
         "--system-prompt-tokens", "4", "--metrics-port", "0", "--metrics-linger-s", "30",
         "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert process.stderr is not None
        url = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = process.stderr.readline()
            if match := re.search(r"metrics: (http://\S+/metrics)", line):
                url = match.group(1)
            if "serving the final values for 30 s more" in line:
                break
        assert url is not None
        scraped = httpx.get(url).text
        process.send_signal(2)  # SIGINT ends the wait early
        out, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    summary = json.loads(out)
    generated = re.search(r"^kvswap_generation_tokens_total (\S+)$", scraped, re.MULTILINE)
    assert generated is not None and float(generated.group(1)) == summary["tokens_generated"]


def test_a_negative_metrics_linger_is_one_line_before_any_work(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for value in ("-1", "nan", "inf"):
        code, _, err = cli(capsys, "run", "--metrics-linger-s", value)
        assert code == 2 and "--metrics-linger-s" in one_error_line(err)
