"""benchmarks/vllm_soak.py: its one-line refusals, and (marked `vllm`) a soak at a tiny
size through the real vLLM with kvswap's spec: the host tier full and evicting, loads
from below, the store restarted midway, clients that leave; nothing asserted, nothing
left on disk, the same tokens as vLLM without offload.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.redis_server import redis_server_missing
from tests.vllm_support import VLLM_VENV, vllm_venv_missing

ROOT = Path(__file__).resolve().parents[2]
SMOKE_REQUESTS = 48


def run(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    return subprocess.run(
        [sys.executable, "benchmarks/vllm_soak.py", *args], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("--requests", "5"), "--requests 5"),
        (("--compare-every", "0"), "--compare-every 0"),
        (("--out", "/no/such/dir/soak.json"), "/no/such/dir"),
    ],
)
def test_bad_argument_is_one_line(args: tuple[str, ...], named: str) -> None:
    done = run(*args)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert named in done.stderr and "Traceback" not in done.stderr


@pytest.mark.vllm
def test_tiny_soak_keeps_its_invariants(tmp_path: Path) -> None:
    if (reason := vllm_venv_missing(VLLM_VENV) or redis_server_missing()) is not None:
        pytest.skip(reason)
    out = tmp_path / "soak.json"
    done = run("--requests", str(SMOKE_REQUESTS), "--out", str(out), timeout_s=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failures"] == []
    assert report["log"]["assertion_errors"] == 0 and report["log"]["tracebacks"] == 0
    assert report["files_left"] == {"nvme_dir": [], "dev_shm": []}
    assert report["outputs"]["compared"] > 0
    assert report["outputs"]["equal"] == report["outputs"]["compared"]
    # The host tier filled and evicted; what it dropped came back from below.
    assert report["evictions"]["host_tier_chunks"] >= 1
    assert report["loads"]["nvme_to_host_chunks"] + report["loads"]["store_to_host_chunks"] > 0
    # The store went away midway and kvswap's client saw it go and come back.
    assert report["store_restart"]["outages"] >= 1
    assert report["store_restart"]["reconnects"] >= 1
    assert sum(report["requests"]["disconnected"].values()) >= 1
    # What the result must record about the machine it ran on.
    machine = report["machine"]
    assert machine["cpu_model"] and machine["cores"] and "commit" in machine
    assert {"avx2", "avx512f", "amx_tile"} <= machine["isa_flags"].keys()
    assert report["versions"]["vllm"] and report["versions"]["torch"]
