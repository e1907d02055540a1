"""benchmarks/engine.py on the tiny preset: its JSON, and that each section exercised
what it names (the pressure run preempted and swapped, recompute recomputed).

transformers is hidden from the child process, so the same run also checks that the
`hf` section is skipped in one line and the rest of the benchmark still runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Runs benchmarks/engine.py as a script with `transformers` made unimportable.
HIDE_TRANSFORMERS = """
import runpy, sys
sys.modules["transformers"] = None
sys.path.insert(0, "benchmarks")
sys.argv = ["benchmarks/engine.py", *sys.argv[1:]]
runpy.run_path("benchmarks/engine.py", run_name="__main__")
"""


def test_quick_sections_on_tiny_exercise_what_they_name() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, "-c", HIDE_TRANSFORMERS, "--quick", "--model", "tiny", "--threads", "1",
         "--sections", "hf,pressure,recompute", "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["failed"] == {}
    assert set(report["sections"]) == {"pressure", "recompute"}
    assert "pip install -e '.[bench]'" in report["skipped"]["hf"]
    skip_lines = [line for line in done.stderr.splitlines() if line.startswith("[hf]")]
    assert len(skip_lines) == 1 and "not installed" in skip_lines[0]
    assert "Traceback" not in done.stderr

    pressure = report["sections"]["pressure"]
    assert pressure["shapes"]["kv_demand_blocks"] >= 2 * pressure["shapes"]["gpu_pool_blocks"]
    figures = pressure["figures"]
    assert figures["pressure_run_preemptions"] > 0
    assert figures["pressure_run_bytes_gpu_to_cpu"] > 0
    assert figures["pressure_run_bytes_cpu_to_gpu"] > 0
    assert figures["unlimited_run_preemptions"] == 0
    assert set(pressure["goals"]) == {
        "throughput_ratio_vs_unlimited", "p99_tpot_ratio_vs_unlimited", "swap_wait_share"
    }  # fmt: skip

    recompute = report["sections"]["recompute"]
    for context in recompute["shapes"]["contexts_tokens"]:
        figures = recompute["figures"]
        assert figures[f"recompute_run_recomputed_tokens_at_{context}"] > 0
        assert figures[f"swap_run_preemptions_at_{context}"] > 0
        assert figures[f"swap_run_recomputed_tokens_at_{context}"] == 0
        assert f"throughput_ratio_swap_vs_recompute_at_{context}" in recompute["goals"]


def test_unknown_section_is_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/engine.py", "--sections", "pressure,bogus"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0
    assert "bogus" in done.stderr and "allowed: hf,pressure" in done.stderr
