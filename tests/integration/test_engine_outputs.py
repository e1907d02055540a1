"""Offload must not change a single output token: the same digest under every tiering.

Every run here is in the exact mode (`batch_invariant`), whose promise is bit-identical
output; the fast mode's token equality on peaky models is in test_fast_path_outputs.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from kvswap.config_load import load_config
from kvswap.engine.engine import Engine
from kvswap.engine.settings import EngineOptions, engine_settings
from kvswap.model.generate import generate_reference
from kvswap.model.loader import load_model
from kvswap.model.sampler import adjust_logits, sample_token
from kvswap.obs.observer import StepObserver, StepSample
from kvswap.sampling import LogitsContext, LogitsOptions, SamplingParams, workload_request_seed
from kvswap.workload.request import FollowUp, Request, Workload
from kvswap.workload.synthetic import SyntheticSpec, generate_synthetic

# Four two-turn sessions over a shared system prompt; tiny model, 8-token blocks.
SPEC = SyntheticSpec(
    num_sessions=4,
    turns_per_session=2,
    prompt_tokens=40,
    output_tokens=12,
    user_tokens_per_turn=8,
    system_prompt_tokens=16,
    vocab_size=256,
    seed=3,
)
BASE: dict[str, object] = {
    "kv_block_tokens": 8,
    "protected_sink_blocks": 1,
    "min_residency_steps": 4,
    "swap_out_chunk_blocks": 2,
    "swap_in_chunk_blocks": 2,
    "max_num_seqs": 4,
    "device": "cpu",
    "batch_invariant": True,
}


def run(workload: Workload, **settings: object) -> dict[str, Any]:
    config = load_config(environ={}, overrides={**BASE, **settings})
    with Engine(engine_settings(config, EngineOptions(model="tiny"))) as engine:
        return engine.run(workload).to_json()


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """Everything fits on the GPU: nothing is ever swapped."""
    summary = run(generate_synthetic(SPEC), gpu_kv_capacity_blocks=200, cpu_kv_capacity_blocks=0)
    assert summary["preemptions"] == 0
    assert summary["bytes_gpu_to_cpu"] == 0
    return summary


def test_a_gpu_pool_four_times_too_small_gives_the_same_outputs(reference: dict[str, Any]) -> None:
    # Peak demand is 4 sessions x 9 blocks; the GPU holds 10.
    summary = run(generate_synthetic(SPEC), gpu_kv_capacity_blocks=10, cpu_kv_capacity_blocks=64)
    assert summary["preemptions"] > 0
    assert summary["bytes_gpu_to_cpu"] > 0 and summary["bytes_cpu_to_gpu"] > 0
    assert summary["outputs_digest"] == reference["outputs_digest"]
    assert summary["requests_completed"] == reference["requests_completed"] == 8


def test_recompute_preemption_gives_the_same_outputs(reference: dict[str, Any]) -> None:
    summary = run(
        generate_synthetic(SPEC),
        gpu_kv_capacity_blocks=10,
        cpu_kv_capacity_blocks=0,
        preemption="recompute",
    )
    assert summary["preemptions"] > 0
    assert summary["recomputed_tokens"] > 0
    assert summary["outputs_digest"] == reference["outputs_digest"]


def nvme_tiers(directory: Path) -> dict[str, object]:
    """A small CPU pool that demotes early to a larger NVMe tier."""
    return {
        "gpu_kv_capacity_blocks": 10,
        "cpu_kv_capacity_blocks": 6,
        "nvme_kv_capacity_blocks": 64,
        "nvme_dir": str(directory),
        "cpu_demote_high_watermark": 0.5,
        "cpu_demote_low_watermark": 0.2,
    }


def test_with_an_nvme_tier_the_outputs_are_the_same(
    reference: dict[str, Any], tmp_path: Path
) -> None:
    summary = run(generate_synthetic(SPEC), **nvme_tiers(tmp_path))
    assert summary["bytes_cpu_to_nvme"] > 0
    assert summary["outputs_digest"] == reference["outputs_digest"]
    assert list(tmp_path.iterdir()) == []  # the slab is removed on close
    # The slab is a keyed tier of this process: its figures are its own, not the
    # remote ones (no store here).
    slab, remote = summary["nvme_slab"], summary["remote"]
    taken = slab["written_blocks"] + slab["already_present"]  # a key two blocks share
    assert taken * summary["block_bytes"] == summary["bytes_cpu_to_nvme"]
    assert remote["enabled"] is False and remote["writes"] == remote["lookups"] == 0
    # Reported with its size and the most keys the engine placed there at once.
    assert summary["capacity_blocks_by_tier"]["nvme"] == 64
    assert 0 < summary["peak_blocks_by_tier"]["nvme"] <= 64


def later_turn_workload() -> Workload:
    """Turn 1 of one session, then (one sequence at a time) a long unrelated request
    that pushes turn 1's blocks off the GPU, then turn 2 of the session."""
    first = tuple(range(1, 41))
    filler = tuple((7 * i) % 251 + 1 for i in range(80))
    return Workload(
        requests=(
            Request(0, 0.0, first, 6, session_id=0, turn=0),
            Request(1, 0.0, filler, 6, session_id=1, turn=0),
        ),
        name="later-turn",
        vocab_size=256,
    )


def test_a_later_turn_restored_from_cpu_or_nvme_matches_recomputing_it(tmp_path: Path) -> None:
    base = later_turn_workload()
    turn2 = Request(2, 0.0, (), 6, session_id=0, turn=1, follow_up=FollowUp(0, (9, 8, 7, 6), 0.0))
    workload = Workload((*base.requests, turn2), "restore", 256)
    one_at_a_time: dict[str, Any] = {"max_num_seqs": 1, "gpu_kv_capacity_blocks": 14}
    recomputed = run(workload, cpu_kv_capacity_blocks=0, **one_at_a_time)
    from_cpu = run(workload, cpu_kv_capacity_blocks=64, **one_at_a_time)
    from_nvme = run(
        workload,
        **one_at_a_time,
        cpu_kv_capacity_blocks=4,
        nvme_kv_capacity_blocks=64,
        nvme_dir=str(tmp_path),
        cpu_demote_high_watermark=0.25,
        cpu_demote_low_watermark=0.0,
    )
    assert recomputed["prefix_hit_tokens"] == {"gpu": 0, "cpu": 0, "nvme": 0, "remote": 0}
    assert from_cpu["prefix_hit_tokens"]["cpu"] == 40
    assert from_nvme["prefix_hit_tokens"]["nvme"] > 0
    assert from_cpu["outputs_digest"] == recomputed["outputs_digest"]
    assert from_nvme["outputs_digest"] == recomputed["outputs_digest"]


def test_a_request_too_long_for_the_gpu_tier_is_rejected_and_the_rest_served() -> None:
    huge = Request(0, 0.0, tuple(range(1, 200)), 4)
    small = Request(1, 0.0, (1, 2, 3, 4, 5), 4)
    summary = run(
        Workload((huge, small), "reject", 256), gpu_kv_capacity_blocks=8, cpu_kv_capacity_blocks=8
    )
    assert summary["requests_completed"] == 1
    assert summary["requests_rejected"] == 1
    assert "GPU tier" in summary["rejections"][0]["reason"]


class CorruptSlabAfterStep(StepObserver):
    """Flip a byte in every NVMe slot once the run passes `step`."""

    def __init__(self, engine: Engine, step: int):
        self.engine, self.step, self.done = engine, step, False

    def on_step(self, sample: StepSample) -> None:
        disk = self.engine.disk_pool
        if self.done or sample.step < self.step or disk is None:
            return
        with open(disk.path, "r+b") as slab:
            for slot in range(disk.num_slots):
                slab.seek(slot * disk.slot_stride_bytes)
                byte = slab.read(1)
                slab.seek(slot * disk.slot_stride_bytes)
                slab.write(bytes([byte[0] ^ 0xFF]))
        self.done = True


def test_a_corrupt_nvme_slab_is_recomputed_never_served(tmp_path: Path) -> None:
    workload = Workload(
        (
            *later_turn_workload().requests,
            Request(2, 0.0, (), 6, session_id=0, turn=1, follow_up=FollowUp(0, (9, 8), 0.0)),
        ),
        "corrupt",
        256,
    )
    settings: dict[str, Any] = {"max_num_seqs": 1, "gpu_kv_capacity_blocks": 14}
    clean = run(workload, cpu_kv_capacity_blocks=0, **settings)
    config = load_config(
        environ={},
        overrides={
            **BASE, **settings, "cpu_kv_capacity_blocks": 4, "nvme_kv_capacity_blocks": 64,
            "nvme_dir": str(tmp_path), "cpu_demote_high_watermark": 0.25,
            "cpu_demote_low_watermark": 0.0,
        },
    )  # fmt: skip
    with Engine(engine_settings(config, EngineOptions(model="tiny"))) as engine:
        summary = engine.run(workload, observers=[CorruptSlabAfterStep(engine, 10)]).to_json()
    assert summary["bytes_nvme_to_cpu"] > 0
    assert summary["lost_blocks"] > 0
    assert summary["failed_transfers"] > 0
    assert summary["outputs_digest"] == clean["outputs_digest"]


def test_a_full_disk_and_a_failing_copy_worker_cost_transfers_not_outputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference: dict[str, Any]
) -> None:
    import errno

    import kvswap.data.block_copy as block_copy
    from kvswap.base.transfer import Direction

    def no_space(*args: object, **kwargs: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    real_copy = block_copy.copy_block
    calls = {"gpu_to_cpu": 0}

    def flaky_copy(pools: Any, direction: Direction, *args: Any, **kwargs: Any) -> None:
        if direction is Direction.GPU_TO_CPU:
            calls["gpu_to_cpu"] += 1
            if calls["gpu_to_cpu"] % 5 == 0:
                raise RuntimeError("injected copy failure")
        real_copy(pools, direction, *args, **kwargs)

    monkeypatch.setattr("os.pwritev", no_space)
    monkeypatch.setattr(block_copy, "copy_block", flaky_copy)
    summary = run(generate_synthetic(SPEC), **nvme_tiers(tmp_path))
    assert summary["failed_transfers"] > 0
    assert summary["outputs_digest"] == reference["outputs_digest"]


# --- each request samples with its own params -------------------------------------------

COLD = SamplingParams(temperature=0.7, seed=11)
HOT = SamplingParams(temperature=1.6, seed=12345)
PROMPT_A = tuple(range(3, 23))
PROMPT_B = tuple(range(40, 53))


def roomy_engine() -> Engine:
    """The tiny model with room on the GPU for every request at once."""
    overrides = {**BASE, "gpu_kv_capacity_blocks": 64, "cpu_kv_capacity_blocks": 0}
    return Engine(
        engine_settings(load_config(environ={}, overrides=overrides), EngineOptions("tiny"))
    )


def sampled_outputs(
    requests: list[tuple[int, tuple[int, ...], SamplingParams | None]],
    *,
    options: LogitsOptions | None = None,
    stop_token_ids: frozenset[int] = frozenset(),
) -> tuple[dict[int, list[int]], int]:
    """Serve `requests` (seq id, prompt, sampling), all arriving at once, stepping the
    scheduler and the engine by hand: each one's 8 output tokens, and the most requests
    that sampled in one step."""
    with roomy_engine() as engine:
        scheduler = engine.scheduler
        for seq_id, prompt, sampling in requests:
            assert scheduler.add_request(
                seq_id, prompt, 8, 0.0, sampling=sampling, options=options,
                stop_token_ids=stop_token_ids,
            ).accepted  # fmt: skip
        most_sampling = 0
        while scheduler.has_work():
            plan = scheduler.schedule(0.0)
            most_sampling = max(most_sampling, sum(item.samples for item in plan.seqs))
            scheduler.complete(plan, engine.execute(plan).sampled, 0.0)
        outputs = {seq_id: list(run.output_ids) for seq_id, run in scheduler.runs.items()}
    return outputs, most_sampling


def test_two_requests_in_one_batch_sample_as_each_would_alone() -> None:
    together, most_sampling = sampled_outputs([(0, PROMPT_A, COLD), (1, PROMPT_B, HOT)])
    assert most_sampling == 2  # they sampled in the same steps
    assert sampled_outputs([(0, PROMPT_A, COLD)])[0] == {0: together[0]}
    assert sampled_outputs([(1, PROMPT_B, HOT)])[0] == {1: together[1]}
    greedy, _ = sampled_outputs([(0, PROMPT_A, None), (1, PROMPT_B, None)])
    assert greedy[0] != together[0] and greedy[1] != together[1]  # their params were used
    # The sequence id a request gets (the server assigns it) and its order change nothing.
    renamed, _ = sampled_outputs([(7, PROMPT_B, HOT), (3, PROMPT_A, COLD)])
    assert renamed == {3: together[0], 7: together[1]}


def test_options_see_each_requests_own_history() -> None:
    """logit_bias forces token 9; min_tokens holds it back (a stop token) for 3 tokens."""
    forced = LogitsOptions(logit_bias=((9, 100.0),), min_tokens=3)
    outputs, _ = sampled_outputs(
        [(0, PROMPT_A, None), (1, PROMPT_B, HOT)], options=forced, stop_token_ids=frozenset({9})
    )
    for output in outputs.values():
        assert len(output) == 4 and 9 not in output[:3] and output[3] == 9


def test_penalties_read_the_history_a_reference_loop_would() -> None:
    """Greedy with every penalty and a bias, served by the engine, equals a loop that
    prefills prompt + output afresh for each token and adjusts its logits by hand."""
    options = LogitsOptions(
        presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3,
        logit_bias=((64, 4.0), (83, -4.0)),
    )  # fmt: skip
    served, _ = sampled_outputs([(0, PROMPT_A, None), (1, PROMPT_B, HOT)], options=options)
    plain, _ = sampled_outputs([(0, PROMPT_A, None)])
    assert served[0] != plain[0]  # the options changed the output
    model = load_model("tiny", None, torch.device("cpu"), batch_invariant=True)[0]
    expected: list[int] = []
    for _ in range(8):
        logits = generate_reference(model, [*PROMPT_A, *expected], 1).logits[0]
        context = LogitsContext(options, PROMPT_A, tuple(expected))
        expected.append(sample_token(adjust_logits(logits, context), None, None))
    assert served[0] == expected


def test_a_run_wide_sampling_is_every_request_carrying_it() -> None:
    workload = Workload((Request(0, 0.0, PROMPT_A, 8), Request(1, 0.0, PROMPT_B, 8)), "two", 256)
    with roomy_engine() as engine:
        engine.run(workload, sampling=HOT)
        run_wide = {seq_id: list(run.output_ids) for seq_id, run in engine.scheduler.runs.items()}
    # Each request carries the run's sampling with its own seed, derived from the run's
    # seed and its id: a seeded run is reproducible, and equal prompts still draw apart.
    own = [replace(HOT, seed=workload_request_seed(HOT.seed, i)) for i in (0, 1)]
    assert run_wide == sampled_outputs([(0, PROMPT_A, own[0]), (1, PROMPT_B, own[1])])[0]
    twins = Workload((Request(0, 0.0, PROMPT_A, 8), Request(1, 0.0, PROMPT_A, 8)), "twins", 256)
    with roomy_engine() as engine:
        engine.run(twins, sampling=HOT)
        outputs = [list(run.output_ids) for run in engine.scheduler.runs.values()]
    assert outputs[0] != outputs[1]
