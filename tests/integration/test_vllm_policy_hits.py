"""benchmarks/vllm_policy_hits.py at its smoke scale (8 sessions of 3 turns) in a real vLLM:
it exercised what it names. Each policy ran as named (kvswap's manager and policy,
ranked by kvswap or reuse; vLLM's own manager with vLLM's LRUCachePolicy /
ARCCachePolicy); every request finished; the host tier's hits are blocks the worker
really loaded, and the tier was full where the unlimited run evicted nothing: it
replaced (evictions) or, ranked by reuse, admitted less than every block. The hit figures are
the benchmark's, not checked here: 24 requests say nothing about a policy."""

from __future__ import annotations

from typing import Any

import pytest

from tests.vllm_support import VLLM_VENV, run_script, vllm_venv_missing

pytestmark = pytest.mark.vllm

BLOCK_TOKENS = 32
EXPECTED = {
    "kvswap": ("KvswapHostManager", "KvswapCachePolicy"),
    "reuse": ("KvswapHostManager", "KvswapCachePolicy"),
    "lru": ("CPUOffloadingManager", "LRUCachePolicy"),
    "arc": ("CPUOffloadingManager", "ARCCachePolicy"),
}


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    if (reason := vllm_venv_missing(VLLM_VENV)) is not None:
        pytest.skip(reason)
    return run_script(VLLM_VENV, "benchmarks/vllm_policy_hits.py", "--quick", timeout_s=300)


def test_the_unlimited_run_loads_from_the_host_tier_and_evicts_nothing(
    report: dict[str, Any],
) -> None:
    unlimited = report["unlimited"]
    assert unlimited["requests"] == 24 and unlimited["failed_transfers"] == 0
    assert unlimited["host_evictions"] == 0 and unlimited["refused_stores"] == 0
    assert 0 < unlimited["host_hit_tokens"] <= BLOCK_TOKENS * unlimited["host_blocks_loaded"]
    assert report["working_set_blocks"]["mean"] > 0


def test_each_policy_runs_as_named_and_its_host_hits_were_loaded(report: dict[str, Any]) -> None:
    (sized,) = report["sized"]
    runs = {run["policy"]: run for run in sized["runs"]}
    assert set(runs) == set(EXPECTED)
    for policy, (manager, cache_policy) in EXPECTED.items():
        run = runs[policy]
        assert (run["manager"], run["cache_policy"]) == (manager, cache_policy)
        assert run["requests"] == 24 and run["failed_transfers"] == 0
        assert run["hit_tokens"] == run["device_hit_tokens"] + run["host_hit_tokens"]
        assert run["prefill_tokens_computed"] == run["prompt_tokens"] - run["hit_tokens"]
        assert 0 < run["host_hit_tokens"] <= BLOCK_TOKENS * run["host_blocks_loaded"]
        # The host tier, the working set's size, was full: it replaced or refused.
        stored_less = run["host_blocks_stored"] < report["unlimited"]["host_blocks_stored"]
        assert run["host_evictions"] > 0 or (policy == "reuse" and stored_less)
    best = max(runs["lru"]["hit_tokens"], runs["arc"]["hit_tokens"])
    for ours in ("kvswap", "reuse"):
        wanted = runs[ours]["hit_tokens"] / best
        assert sized[f"ratio_{ours}_over_best"] == pytest.approx(wanted, abs=1e-4)
