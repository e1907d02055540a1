"""The memory bill reproduces the article's numbers."""

from __future__ import annotations

import pytest

from kvswap.commands.plan import render
from kvswap.errors import KvSwapError
from kvswap.ledger import PlanInputs, make_plan, transfer_ms
from kvswap.model.presets import preset_description as preset_shape
from kvswap.units import GIB, MIB


def article_plan(**changes: object) -> PlanInputs:
    values: dict[str, object] = dict(
        shape=preset_shape("article-8b"),
        dtype="fp16",
        block_tokens=16,
        context_tokens=4096,
        concurrency=8,
        gpu_mem_bytes=40 * GIB,
        reserve_bytes=6 * GIB,
        weights_bytes=None,
        num_gpu_blocks=3000,
        num_cpu_blocks=12000,
        num_nvme_blocks=40000,
        swap_out_chunk_blocks=8,
        swap_in_chunk_blocks=4,
        swap_out_high_watermark=0.85,
    )
    values.update(changes)
    return PlanInputs(**values)  # type: ignore[arg-type]


def test_article_numbers() -> None:
    plan = make_plan(article_plan())
    assert plan.kv_bytes_per_token == 131_072
    assert plan.kv_bytes_per_block == 2 * MIB
    assert plan.kv_demand_bytes == 4 * GIB
    assert plan.swap_out_chunk_bytes == 16 * MIB
    assert abs(plan.swap_out_chunk_ms - 0.671) < 0.001
    assert plan.swap_in_chunk_bytes == 8 * MIB
    assert abs(plan.weights_bytes / 1e9 - 16.06) < 0.01  # "about 16 GB"
    assert plan.max_concurrency_gpu == 3000 // 256
    assert plan.max_concurrency_with_cpu == 15000 // 256


def test_32k_context_times_8_is_32_gib() -> None:
    plan = make_plan(article_plan(context_tokens=32768))
    assert plan.kv_bytes_per_request == 4 * GIB
    assert plan.kv_demand_bytes == 32 * GIB


def test_cost_grows_linearly_in_context_and_concurrency() -> None:
    base = make_plan(article_plan()).kv_demand_bytes
    assert make_plan(article_plan(concurrency=16)).kv_demand_bytes == 2 * base
    assert make_plan(article_plan(context_tokens=32768)).kv_demand_bytes == 8 * base


def test_a_partial_block_is_billed_whole() -> None:
    plan = make_plan(article_plan(context_tokens=17, concurrency=1))
    assert plan.kv_bytes_per_request == 2 * 2 * MIB


def test_article_pitfalls_are_warned() -> None:
    plan = make_plan(
        article_plan(swap_out_chunk_blocks=512, swap_out_high_watermark=1.0, concurrency=10_000)
    )
    text = "\n".join(plan.warnings)
    assert "holds the link for 42.9 ms" in text  # 1 GiB at 25 GB/s
    assert "swap_out_high_watermark = 1.0" in text
    assert "exceeds every tier" in text


def test_gpu_tier_derived_from_gpu_memory_when_not_configured() -> None:
    plan = make_plan(article_plan(num_gpu_blocks=None, weights_bytes=16 * GIB))
    assert plan.gpu_kv_budget_bytes == 18 * GIB
    assert plan.gpu_kv_capacity_blocks == 18 * GIB // (2 * MIB)


def test_transfer_times_match_the_article() -> None:
    assert abs(transfer_ms(20_000_000, 25) - 0.8) < 1e-9
    assert abs(transfer_ms(1_000_000_000, 25) - 40) < 1e-9
    assert abs(transfer_ms(2_000_000_000, 25) - 80) < 1e-9


def test_a_remote_link_shows_a_chunks_time_over_it() -> None:
    plain = make_plan(article_plan())
    assert plain.remote_gb_per_s is None and plain.remote_fetch_chunk_ms is None
    # A 10 GbE store, 1.25 GB/s: a swap-in chunk (8 MiB) takes ~6.7 ms to come back,
    # 20x the 0.34 ms it takes over PCIe; the write-behind chunk (16 MiB) ~13.4 ms.
    plan = make_plan(article_plan(remote_gb_per_s=1.25))
    assert plan.remote_fetch_chunk_ms == round(transfer_ms(8 * MIB, 1.25), 4)
    assert plan.remote_write_chunk_ms == round(transfer_ms(16 * MIB, 1.25), 4)
    assert (
        plan.remote_fetch_chunk_ms is not None and abs(plan.remote_fetch_chunk_ms - 6.711) < 0.001
    )
    assert plan.to_json_dict()["remote_gb_per_s"] == 1.25
    rendered = render(plan)
    assert "remote fetch chunk (4 blocks)" in rendered and "6.711 ms at 1.25 GB/s" in rendered
    assert "remote" not in render(plain)
    with pytest.raises(KvSwapError, match="remote_gb_per_s"):
        make_plan(article_plan(remote_gb_per_s=0.0))
