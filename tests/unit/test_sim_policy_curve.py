"""The host-tier policy curve (sim/policy_curve.py): its working-set measure on a
hand-made run, and one simulated run per policy doing what the comparison names."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvswap.base.eviction_policy import EvictionPolicy
from kvswap.base.tier import Tier
from kvswap.control.policy_arc import ArcPolicy
from kvswap.control.policy_kvswap import KvSwapGpuPolicy, KvSwapLowerTierPolicy
from kvswap.control.policy_lru import LruPolicy
from kvswap.control.policy_reuse import ReusePolicy
from kvswap.control.scheduler_records import SequenceRun
from kvswap.sim.policy_curve import (
    CHAT_QUICK,
    POLICIES,
    CurveShape,
    chat_workload,
    live_reuse_blocks,
    simulate_policy,
)
from kvswap.workload.request import FollowUp, Request, Workload
from kvswap.workload.synthetic import SyntheticSpec


def test_the_working_set_is_the_reusable_kv_held_between_turns_averaged_over_the_run() -> None:
    # Blocks of 4 tokens; one system prompt of 4 tokens (1 block), counted once.
    spec = SyntheticSpec(num_sessions=2, turns_per_session=2, prompt_tokens=8,
                         system_prompt_tokens=4, num_system_prompts=1)  # fmt: skip
    workload = Workload(
        requests=(
            Request(0, 0.0, (1,) * 8, max_new_tokens=5, session_id=0),
            Request(1, 0.0, (2,) * 8, max_new_tokens=1, session_id=1),
            Request(2, 2.0, (), 1, session_id=0, turn=1, follow_up=FollowUp(0, (3,), 2.0)),
            Request(3, 4.0, (), 1, session_id=1, turn=1, follow_up=FollowUp(1, (4,), 4.0)),
        ),
        name="two sessions",
        vocab_size=8,
    )

    def run(
        seq_id: int, prompt: int, output: int, admitted_s: float, finish_s: float
    ) -> SequenceRun:
        done = SequenceRun(seq_id, (0,) * prompt, output, 0.0, admitted_s=admitted_s,
                           finish_s=finish_s)  # fmt: skip
        done.output_ids = [0] * output
        return done

    runs = {
        # Session 0: 8 + 5 - 1 = 12 tokens of KV after turn 0 = 3 blocks, 1 of them the
        # system prompt: 2 live blocks from t=2 (its end) to t=4 (turn 1 admitted).
        0: run(0, 8, 5, 0.0, 2.0),
        2: run(2, 14, 1, 4.0, 5.0),
        # Session 1: 8 + 1 - 1 = 8 tokens = 2 blocks, 1 live from t=1 to t=9.
        1: run(1, 8, 1, 0.0, 1.0),
        3: run(3, 10, 1, 9.0, 10.0),
    }
    working_set = live_reuse_blocks(workload, runs, spec, block_tokens=4)
    # (2 blocks x 2 s + 1 block x 8 s) / 10 s, plus the system prompt's block.
    assert working_set.mean_blocks == pytest.approx(12 / 10 + 1)
    assert working_set.peak_blocks == 3 + 1


CPU_POLICY_CLASSES: dict[str, type[EvictionPolicy]] = {
    "kvswap": KvSwapLowerTierPolicy, "lru": LruPolicy, "arc": ArcPolicy,
    "reuse": ReusePolicy,
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_shape() -> CurveShape:
    return dataclasses.replace(
        CHAT_QUICK, workload=dataclasses.replace(CHAT_QUICK.workload, num_sessions=8)
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_a_replacing_host_tier_evicts_and_serves_hits_with_every_policy(
    tiny_shape: CurveShape, policy: str
) -> None:
    workload = chat_workload(tiny_shape)
    run, simulator = simulate_policy(tiny_shape, workload, policy, 64, spill=True)
    policies = simulator.control.swapper.store.policies
    assert isinstance(policies[Tier.CPU], CPU_POLICY_CLASSES[policy])
    assert isinstance(policies[Tier.GPU], KvSwapGpuPolicy)  # the GPU tier's in every run
    assert run.host_evictions > 0, "the host tier never let a copy go"
    assert run.hit_tokens_by_tier["cpu"] > 0, "no hit came from the host tier"
    assert run.hit_tokens == sum(run.hit_tokens_by_tier.values())
    assert run.prefill_tokens_computed == run.point.prompt_tokens - run.hit_tokens
    assert run.point.capacity_tokens == 64 * tiny_shape.block_tokens


def run_benchmark(*args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """benchmarks/policy_hit_rates.py at test scale (`--quick`), with `args`."""
    root = Path(__file__).resolve().parents[2]
    return subprocess.run(
        [sys.executable, "benchmarks/policy_hit_rates.py", "--quick", *args],
        cwd=root, env={**os.environ, "PYTHONPATH": str(root / "src")},
        capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip


def test_the_benchmark_at_test_scale_prints_both_tables_and_what_they_exercised() -> None:
    done = run_benchmark("--jobs", "2", timeout_s=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kvswap / max(lru, arc)" in done.stdout
    report = json.loads(done.stdout.splitlines()[-1])
    working_set = report["working_set_blocks"]["mean"]
    for row in report["replacing"]:
        runs = row["runs"]
        assert [run["policy"] for run in runs] == list(POLICIES)
        (host_blocks,) = {run["host_blocks"] for run in runs}  # one size per row
        assert abs(host_blocks - working_set / row["working_set_over_host"]) <= 0.501
        for run in runs:
            assert (
                run["spill"] and run["host_evictions"] > 0 and run["hit_tokens_by_tier"]["cpu"] > 0
            )
        best = max(runs[1]["hit_tokens"], runs[2]["hit_tokens"])
        assert row["ratio_kvswap_over_best"] == round(runs[0]["hit_tokens"] / best, 4)
    assert {row["working_set_over_host"] for row in report["replacing"]} >= {2.0, 3.0, 4.0}
    (nothing_below,) = report["nothing_below"]
    for run in nothing_below["runs"]:
        assert not run["spill"] and run["hit_tokens_by_tier"]["nvme"] == 0
    assert report["unlimited"]["hit_rate"] > max(
        run["hit_rate"] for row in report["replacing"] for run in row["runs"]
    )


def test_the_benchmark_refuses_a_policy_it_cannot_build_in_one_line_before_any_run() -> None:
    done = run_benchmark("--also", "reuse(once=up)", timeout_s=60)
    assert done.returncode == 2 and done.stdout == ""
    last = done.stderr.strip().splitlines()[-1]
    assert last.endswith("error: --also = 'reuse(once=up)': once = 'up': allowed: 'newest' "
                         "(the default) or 'oldest'"), last  # fmt: skip
    assert "Traceback" not in done.stderr
