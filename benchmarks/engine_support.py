"""What the engine benchmark's sections share: serving a workload, ratios, goals.

A section is a function `(Bench) -> Result`: the shapes it ran, its figures and
the goals some of them are held to. A section that did not exercise what it
names (no preemption under "pressure", no recomputed token under "recompute")
raises `NotExercised` instead of reporting a comparison of nothing.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvswap.config_load import load_config
from kvswap.engine.engine import Engine
from kvswap.engine.settings import EngineOptions, engine_settings
from kvswap.errors import KvSwapError
from kvswap.units import ceil_div
from kvswap.workload.request import Request, Workload
from kvswap.workload.synthetic import SyntheticSpec, generate_synthetic

BLOCK_TOKENS = 16
#: Settings every run shares; a section adds pools, batch limits and the mode.
COMMON: dict[str, object] = {"kv_block_tokens": BLOCK_TOKENS, "protected_sink_blocks": 2}
#: The largest vocabulary a workload draws from (32,000 ids fit every model here).
MAX_WORKLOAD_VOCAB = 32_000


class NotExercised(KvSwapError):
    """A section's runs did not do what the section names; its ratios would mislead."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise NotExercised(message)


@dataclass(frozen=True)
class Bench:
    """How this invocation runs: the engine's model (a preset or a checkpoint
    directory), the device, torch threads, the size."""

    model: str
    device: str
    threads: int
    quick: bool


@dataclass(frozen=True)
class Goal:
    """`figure <op> bound`, e.g. throughput ratio >= 0.9."""

    op: str  # ">=" or "<="
    bound: float

    def met(self, value: object) -> bool:
        """False for anything but a finite number (a ratio of nothing meets no goal)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        compare: Callable[[float, float], bool] = operator.ge if self.op == ">=" else operator.le
        return math.isfinite(value) and compare(value, self.bound)

    def __str__(self) -> str:
        return f"{self.op} {self.bound:g}"


@dataclass
class Result:
    """One section's record: printed as a table and written to the JSON report."""

    shapes: dict[str, object]
    figures: dict[str, object] = field(default_factory=dict)
    goals: dict[str, Goal] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        goals = {
            name: {"goal": str(goal), "met": goal.met(self.figures[name])}
            for name, goal in self.goals.items()
        }
        return {"shapes": self.shapes, "figures": self.figures, "goals": goals}


def section_names(text: str, allowed: Iterable[str]) -> list[str]:
    """The sections a `--sections` value names, in its order; one line naming what is
    unknown and what is allowed otherwise."""
    allowed = list(allowed)
    names = [name for name in text.split(",") if name]
    unknown = [name for name in names if name not in allowed]
    if unknown or not names:
        raise KvSwapError(
            f"--sections {text!r}: unknown {', '.join(unknown) or 'empty list'}; "
            f"allowed: {','.join(allowed)}"
        )
    return names


def round_order(configs: list[str], round_index: int) -> list[str]:
    """The order of one round of interleaved runs: a b c, then c b a, and so on, so
    that no config is always first or last while a shared machine's speed drifts."""
    return configs if round_index % 2 == 0 else configs[::-1]


def ratio(numerator: float, denominator: float) -> float:
    return round(numerator / denominator, 4) if denominator else float("nan")


def model_vocab(model: str) -> int:
    """The vocabulary a workload for `model` draws from (a preset or a checkpoint)."""
    from kvswap.model.loader import PRESETS, read_checkpoint_config

    config = PRESETS.get(model) or read_checkpoint_config(Path(model))
    return min(config.vocab_size, MAX_WORKLOAD_VOCAB)


def blocks_for(num_tokens: int) -> int:
    return ceil_div(num_tokens, BLOCK_TOKENS)


def independent_requests(
    num_requests: int, prompt_tokens: int, output_tokens: int, vocab_size: int, seed: int
) -> Workload:
    """`num_requests` single-turn requests, all arriving at t = 0, no shared prefix."""
    return generate_synthetic(
        SyntheticSpec(
            num_sessions=num_requests, turns_per_session=1, prompt_tokens=prompt_tokens,
            output_tokens=output_tokens, vocab_size=vocab_size, seed=seed,
        )
    )  # fmt: skip


def explicit_requests(prompts: list[list[int]], output_tokens: int, vocab_size: int) -> Workload:
    """A workload of these exact prompts (shared with a baseline), all at t = 0."""
    requests = tuple(Request(i, 0.0, tuple(p), output_tokens) for i, p in enumerate(prompts))
    return Workload(requests, "benchmark", vocab_size)


def serve(bench: Bench, workload: Workload, **settings: object) -> Any:
    """Run `workload` on a fresh engine; `RunSummary.to_json()` plus three keys:
    `ttft_ms_by_request` (admission to first token: queueing excluded),
    `outputs_by_request` (generated ids) and `transfers_by_direction` (chunks
    moved, e.g. {"gpu_to_cpu": 12}: swap-outs and swap-ins counted as copies)."""
    overrides = {**COMMON, "device": bench.device, **settings}
    config = load_config(environ={}, overrides=overrides)
    options = EngineOptions(model=bench.model, cpu_threads=bench.threads)
    with Engine(engine_settings(config, options)) as engine:
        summary = engine.run(workload).to_json()
        runs = engine.scheduler.runs
        summary["ttft_ms_by_request"] = {
            seq_id: 1e3 * (run.first_token_s - run.admitted_s)
            for seq_id, run in runs.items()
            if run.first_token_s is not None and run.admitted_s is not None
        }
        summary["outputs_by_request"] = {seq: list(run.output_ids) for seq, run in runs.items()}
        moved = engine.scheduler.swapper.metrics.transfers_by_direction
        summary["transfers_by_direction"] = {d.value: n for d, n in moved.items()}
    return summary


def warm_up(bench: Bench) -> None:
    """One short run, so a device's one-time start (CUDA context, kernels, allocator)
    is paid before anything is timed."""
    workload = independent_requests(2, 48, 4, model_vocab(bench.model), seed=99)
    serve(bench, workload, gpu_kv_capacity_blocks=32, cpu_kv_capacity_blocks=0)


def run_figures(summary: Any, prefix: str) -> dict[str, object]:
    """The figures of one run every comparison reports, under `prefix`."""
    return {
        f"{prefix}_throughput_tok_s": summary["throughput_tok_s"],
        f"{prefix}_p99_tpot_ms": summary["tpot_ms"]["p99"],
        f"{prefix}_duration_s": summary["duration_s"],
        f"{prefix}_preemptions": summary["preemptions"],
        f"{prefix}_recomputed_tokens": summary["recomputed_tokens"],
        f"{prefix}_swap_wait_share": summary["swap_wait_share"],
        f"{prefix}_bytes_gpu_to_cpu": summary["bytes_gpu_to_cpu"],
        f"{prefix}_bytes_cpu_to_gpu": summary["bytes_cpu_to_gpu"],
    }
