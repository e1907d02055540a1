"""docs/benchmarks.md shows exactly what benchmarks/results/ holds (issue 33: figures as
data): its measured section is rendered from the result files, each with its machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_page_and_the_results_agree() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "render_results.py"), "--check"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_every_result_names_its_machine_and_command() -> None:
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        result = json.loads(path.read_text())
        machine = result["machine"]
        assert result["benchmark"] and result["command"], path
        assert machine["cpu_model"] and "avx2" in machine["isa_flags"], path
        assert machine["cores"] and machine["date_utc"] and machine["commit"], path
