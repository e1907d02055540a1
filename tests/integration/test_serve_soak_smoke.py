"""benchmarks/serve_soak.py in two small bursts: it exercised what it says (streams
sent, left mid-stream, completed, ended on the server), and the server it started
printed no traceback and stopped cleanly. The RSS ratio is the benchmark's figure,
not checked here: two bursts say nothing about a plateau."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_soak_exercises_what_it_reports() -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/serve_soak.py", "--bursts", "2", "--burst-size", "6",
         "--max-tokens", "12", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["requests_sent"] == 12
    assert report["disconnects_done"] + report["streams_completed"] == 12
    assert report["disconnects_done"] >= 1 and report["failed"] == 0
    assert sum(report["server_ended_by_reason"].values()) == 12
    assert len(report["rss_mib_by_burst"]) == 2
    assert report["server_tracebacks"] == 0 and report["server_socket_send_warnings"] == 0
    assert report["server_exit_code"] == 0
    assert "exercised: 12 streaming requests in 2 bursts of 6" in done.stderr
