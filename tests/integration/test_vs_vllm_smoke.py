"""benchmarks/vs_vllm.py: its one-line refusals, and (marked `vllm`) that its pressure
section, on the quarter shape, exercised what it names on both sides: vLLM preempted
and recomputed (and, with kvswap's spec, loaded back what it offloaded), kvswap
swapped out and in and recomputed nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm_support import VLLM_VENV, vllm_venv_missing

ROOT = Path(__file__).resolve().parents[2]
# Runs benchmarks/vs_vllm.py as a script with the vLLM venv pointed somewhere empty.
NO_VENV = """
import runpy, sys
import tests.vllm_support as support
support.VLLM_VENV = support.ROOT / "no-such-venv"
sys.path.insert(0, "benchmarks")
sys.argv = ["benchmarks/vs_vllm.py", *sys.argv[1:]]
runpy.run_path("benchmarks/vs_vllm.py", run_name="__main__")
"""


def run(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=timeout_s,
    )  # fmt: skip


def test_missing_venv_is_one_line() -> None:
    done = run("-c", NO_VENV, "--quick")
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert "no-such-venv not found" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("args", "named"),
    [(("--sections", "long,bogus"), "bogus"), (("--repeats", "0"), "--repeats 0")],
)
def test_bad_argument_is_one_line(args: tuple[str, ...], named: str) -> None:
    done = run("benchmarks/vs_vllm.py", *args)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert named in done.stderr


@pytest.mark.vllm
def test_quick_pressure_exercises_what_it_names() -> None:
    if (reason := vllm_venv_missing(VLLM_VENV)) is not None:
        pytest.skip(reason)
    done = run(
        "benchmarks/vs_vllm.py", "--quick", "--sections", "pressure", "--repeats", "1",
        "--threads", "1", "--json", timeout_s=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["failed"] == {}
    section = report["sections"]["pressure"]
    assert section["shapes"]["kv_demand_tokens"] >= 3 * section["shapes"]["device_pool_tokens"]
    figures = section["figures"]
    assert figures["kvswap_preemptions_by_swap"] > 0
    assert figures["kvswap_swap_out_chunks"] > 0 and figures["kvswap_swap_in_chunks"] > 0
    assert figures["kvswap_bytes_cpu_to_gpu"] > 0
    assert figures["kvswap_recomputed_tokens"] == 0
    assert figures["vllm_recompute_preemptions"] > 0
    assert figures["vllm_recompute_recomputed_tokens"] > 0
    assert figures["vllm_offload_preemptions"] > 0
    # What vLLM offloaded through kvswap's spec came back instead of being recomputed.
    assert figures["vllm_offload_tokens_loaded"] > 0
    assert figures["vllm_offload_recomputed_tokens"] < figures["vllm_recompute_recomputed_tokens"]
    # The store-nothing side ran (the section requires that it stored nothing).
    assert figures["vllm_store_nothing_tok_s"] > 0
    # The same checkpoint on both sides: greedy outputs agree (all 8 here; two fp32
    # kernels may still part at a near tie of a random model's logits).
    assert figures["requests_same_tokens_as_vllm_recompute"] >= 6
