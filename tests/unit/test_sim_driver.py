"""The simulator end to end: setup checks, traces, the hit-rate curve, determinism."""

from __future__ import annotations

import gc
import math
from pathlib import Path

import pytest

from kvswap.config_load import load_config
from kvswap.errors import ConfigError, KvSwapError
from kvswap.model.kv_identity import kvswap_identity
from kvswap.sim.hardware import hardware_preset
from kvswap.sim.hit_rate import hit_rate_curve, parse_capacities_tokens
from kvswap.sim.simulator import Simulator
from kvswap.sim.trace import load_trace_workload, trace_prompt
from kvswap.sim.tracegen import TraceSpec, generate_trace_rows, write_trace
from kvswap.workload.mooncake import read_trace_rows
from kvswap.workload.synthetic import SyntheticSpec, generate_synthetic

SMALL = {
    "kv_block_tokens": 16, "gpu_kv_capacity_blocks": 120, "cpu_kv_capacity_blocks": 400,
    "protected_sink_blocks": 2, "min_residency_steps": 8, "max_num_seqs": 8,
}  # fmt: skip
HAND_TRACE = (
    '{"timestamp": 0, "input_length": 1500, "output_length": 5, "hash_ids": [1, 2, 3]}\n'
    '{"timestamp": 10, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]}\n'
    '{"timestamp": 20, "input_length": 1200, "output_length": 5, "hash_ids": [1, 2, 4]}\n'
)
RUN_KEYS = {
    "requests_completed", "tokens_generated", "duration_s", "throughput_tok_s", "ttft_ms",
    "tpot_ms", "itl_ms", "num_steps", "swap_wait_s", "swap_wait_share", "bytes_gpu_to_cpu",
    "bytes_cpu_to_gpu", "sync_stalls", "preemptions", "prefix_hit_tokens", "outputs_digest",
    "pinned_pool_configured_bytes", "pinned_pool_resident_bytes", "device", "model",
}  # fmt: skip


def small_sim(**overrides: object) -> Simulator:
    config = load_config(None, overrides={**SMALL, **overrides})
    return Simulator(config, hardware_preset("article-40gb"))


def chat(seed: int = 0) -> object:
    return generate_synthetic(
        SyntheticSpec(num_sessions=10, turns_per_session=2, prompt_tokens=300, output_tokens=40,
                      user_tokens_per_turn=40, system_prompt_tokens=64, arrival_rate_per_s=20.0,
                      think_time_s=0.2, seed=seed)
    )  # fmt: skip


def test_the_simulator_names_its_blocks_with_the_engines_block_fingerprint() -> None:
    sim = small_sim()
    namespace = sim.control.settings.layout.key_namespace()
    # No weights run in a simulation: the architecture in its KV dtype names the blocks.
    assert namespace.model_fingerprint == kvswap_identity(
        sim.setup.shape, None, batch_invariant=False, device_type="simulated",
        block_tokens=namespace.block_tokens, block_bytes=sim.setup.block_bytes,
    ).fingerprint()  # fmt: skip


def test_same_seed_same_run_and_the_engine_keys() -> None:
    first = small_sim().run(chat()).to_json()  # type: ignore[arg-type]
    second = small_sim().run(chat()).to_json()  # type: ignore[arg-type]
    for volatile in ("wall_s", "simulated_s_per_wall_s"):
        first.pop(volatile), second.pop(volatile)
    assert first == second
    assert set(first) >= RUN_KEYS
    assert first["requests_completed"] == 20 and first["device"] == "simulated"
    assert first["bytes_gpu_to_cpu"] != 0 and first["bytes_cpu_to_gpu"] != 0  # it swapped
    rates = first["prefix_hit_rate_by_tier"]
    assert isinstance(rates, dict) and set(rates) == {"gpu", "cpu", "nvme", "remote"}


def test_the_virtual_clock_accounts_swap_waits() -> None:
    summary = small_sim(gpu_kv_capacity_blocks=60).run(chat(1)).to_json()  # type: ignore[arg-type]
    assert 0 < float(summary["swap_wait_s"]) < float(summary["duration_s"])  # type: ignore[arg-type]


def test_impossible_configs_fail_before_simulating() -> None:
    with pytest.raises(ConfigError, match=r"gpu_kv_capacity_blocks = 20000 needs .* allowed"):
        small_sim(gpu_kv_capacity_blocks=20_000)
    with pytest.raises(ConfigError, match=r"cpu_kv_capacity_blocks = 60000 .* of RAM"):
        small_sim(cpu_kv_capacity_blocks=60_000)
    with pytest.raises(ConfigError, match="swap_out_chunk_blocks = 500"):
        small_sim(swap_out_chunk_blocks=500)


def test_an_unset_gpu_tier_is_sized_from_the_hardware() -> None:
    config = load_config(None, overrides={"cpu_kv_capacity_blocks": 10})
    sim = Simulator(config, hardware_preset("article-40gb"))
    weights = 8_030_261_248 * 2
    expected = (40_000_000_000 - weights - 4 * 1024**3) // (2 * 1024**2)
    assert sim.setup.capacities.num_gpu_blocks == expected


def test_hit_rate_curve_on_a_hand_checked_trace(tmp_path: Path) -> None:
    # Capacity 1024 tokens = 2 blocks of 512. Request 1: nothing cached; leaves [2, 3].
    # Request 2 ([1, 2]): 1 is missing, so no leading hit; leaves [1, 2].
    # Request 3 ([1, 2, 4]): 2 leading blocks = 1024 tokens. 1024 / 3700 prompt tokens.
    # Unlimited: request 2 reuses 1024 capped at its 1000 tokens, request 3 1024 -> 2024.
    path = tmp_path / "hand.jsonl"
    path.write_text(HAND_TRACE)
    rows = read_trace_rows(path)
    points = hit_rate_curve(rows, parse_capacities_tokens("0, 1024, inf"))
    assert [p.reused_tokens for p in points] == [0, 1024, 2024]
    assert points[1].hit_rate == pytest.approx(1024 / 3700)
    assert points[2].to_json_dict() == {"capacity_tokens": "inf", "hit_rate": 0.547027}


def test_bad_capacities_name_the_item() -> None:
    with pytest.raises(KvSwapError, match="item 2 is 'lots'"):
        parse_capacities_tokens("1e6,lots")
    assert parse_capacities_tokens("1e5,inf") == (100_000.0, math.inf)


def test_a_malformed_trace_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(HAND_TRACE + '{"timestamp": 30, "input_length": "many"}\n')
    with pytest.raises(KvSwapError, match=r"bad.jsonl line 4"):
        load_trace_workload(path)


def test_trace_prompts_share_exactly_their_hash_blocks(tmp_path: Path) -> None:
    path = tmp_path / "hand.jsonl"
    path.write_text(HAND_TRACE)
    rows = read_trace_rows(path)
    first, second = trace_prompt(rows[0]), trace_prompt(rows[1])
    assert len(first) == 1500 and first[:1000] == second and first[1024] == 3
    sim = small_sim(gpu_kv_capacity_blocks=400, kv_block_tokens=16)
    summary = sim.run(load_trace_workload(path)).to_json()
    hits = summary["prefix_hit_tokens"]
    assert isinstance(hits, dict) and sum(hits.values()) == 992 + 1024  # all but the last token


def test_a_generated_trace_round_trips_and_simulates(tmp_path: Path) -> None:
    rows = generate_trace_rows(TraceSpec(num_requests=12, duration_s=2.0, mean_input_tokens=600,
                                         mean_output_tokens=8, max_input_tokens=1500,
                                         system_prompt_blocks=1, seed=3))  # fmt: skip
    path = tmp_path / "gen.jsonl"
    write_trace(rows, path)
    assert read_trace_rows(path) == rows
    summary = small_sim().run(load_trace_workload(path)).to_json()
    assert summary["requests_completed"] == 12


def test_a_run_leaves_no_cyclic_garbage_for_the_paused_collector(tmp_path: Path) -> None:
    # `Simulator.run` pauses the cycle collector (`paused_gc`): safe only while a run
    # makes no reference cycles, or a long run would keep every cycle until it ends.
    # Every path runs here: swaps both ways, NVMe demotions, evictions on every tier.
    sim = small_sim(gpu_kv_capacity_blocks=60, cpu_kv_capacity_blocks=80,
                    nvme_kv_capacity_blocks=120, nvme_dir=str(tmp_path))  # fmt: skip
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds stays in gc.garbage
    try:
        summary = sim.run(chat(2)).to_json()
        assert gc.isenabled()  # restored after the run
        gc.collect()
        ours = [type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith("kvswap")]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert summary["bytes_cpu_to_nvme"] != 0 and summary["bytes_cpu_to_gpu"] != 0
    assert ours == []
