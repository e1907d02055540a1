"""benchmarks/host_tier_replay.py at its smoke scale (8 sessions of each workload): the replay
drives each host-tier manager as named, every policy sees the same prompts, its figures
add up, and a host tier the size of the working set replaces while an unlimited one does
not. The hit figures themselves are the benchmark's, not checked here."""

from __future__ import annotations

from typing import Any

import pytest

from tests.vllm_support import VLLM_VENV, run_script, vllm_venv_missing

pytestmark = pytest.mark.vllm

BLOCK_TOKENS = 32
USER_POLICY = "kvswap:kvswap.control.policy_lru:LruPolicy"
EXPECTED = {
    "lru": ("CPUOffloadingManager", "LRUCachePolicy", None),
    "arc": ("CPUOffloadingManager", "ARCCachePolicy", None),
    "kvswap": ("KvswapHostManager", "KvswapCachePolicy", "KvSwapGpuPolicy"),
    USER_POLICY: ("KvswapHostManager", "KvswapCachePolicy", "LruPolicy"),
}
#: Requests at the smoke scale: 8 chats of 3 turns; 8 agents of 2 tasks of 2 calls.
REQUESTS = {"chat": 24, "agents": 32}


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    if (reason := vllm_venv_missing(VLLM_VENV)) is not None:
        pytest.skip(reason)
    return run_script(
        VLLM_VENV, "benchmarks/host_tier_replay.py", "--quick", "--policies", *EXPECTED,
        timeout_s=300,
    )  # fmt: skip


def all_runs(workload: dict[str, Any]) -> list[dict[str, Any]]:
    return [workload["unlimited"]] + [run for sized in workload["sized"] for run in sized["runs"]]


def test_both_workloads_run_every_policy_as_named(report: dict[str, Any]) -> None:
    assert [w["workload"] for w in report["workloads"]] == list(REQUESTS)
    for workload in report["workloads"]:
        (sized,) = workload["sized"]
        runs = {run["policy"]: run for run in sized["runs"]}
        assert set(runs) == set(EXPECTED)
        for policy, named in EXPECTED.items():
            run = runs[policy]
            assert (run["manager"], run["cache_policy"], run["ranking"]) == named
        best = max(runs["lru"]["hit_tokens"], runs["arc"]["hit_tokens"])
        assert sized["ratios_over_best_vllm"]["kvswap"] == pytest.approx(
            runs["kvswap"]["hit_tokens"] / best, abs=1e-4
        )


def test_every_policy_sees_the_same_prompts_and_the_hits_add_up(report: dict[str, Any]) -> None:
    for workload in report["workloads"]:
        runs = all_runs(workload)
        assert len({run["prompts_digest"] for run in runs}) == 1
        assert len({run["prompt_tokens"] for run in runs}) == 1
        for run in runs:
            assert run["requests"] == REQUESTS[workload["workload"]]
            assert run["hit_tokens"] == run["device_hit_tokens"] + run["host_hit_tokens"]
            assert 0 <= run["hit_tokens"] <= run["prompt_tokens"]
            assert run["prefill_tokens_computed"] == run["prompt_tokens"] - run["hit_tokens"]
            # A host hit is a block loaded from the host tier.
            assert run["host_hit_tokens"] <= BLOCK_TOKENS * run["host_blocks_loaded"]


def test_a_small_host_tier_replaces_and_an_unlimited_one_does_not(
    report: dict[str, Any],
) -> None:
    for workload in report["workloads"]:
        unlimited = workload["unlimited"]
        assert unlimited["host_evictions"] == 0 and unlimited["refused_stores"] == 0
        assert unlimited["host_hit_tokens"] > 0
        assert workload["working_set_blocks"]["mean"] > 0
        (sized,) = workload["sized"]
        assert sized["host_chunks"] < unlimited["host_chunks"]
        for run in sized["runs"]:
            assert run["host_chunks"] == sized["host_chunks"]
            assert run["host_evictions"] > 0
