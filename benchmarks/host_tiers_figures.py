"""The figures of benchmarks/vllm_host_tiers.py, from what its runs wrote: no server here.

    blocks = working_set_blocks(spec, turns, block_tokens)    the chat's working set
    run = run_figures(summary, records, rise)                 one run's figures
    merged = merge_rounds([run, ...])                         median and spread per figure
    ratios, goals = judge(merged_by_config)                   (c)/(b), (d)/(b), the goals
    between_steps_ratios(merged_by_config)                    (c)/(b0), (d)/(b0), shown

The working set is kvswap.sim.policy_curve's (the KV the sessions between two turns
will reuse, plus the system prompt once), time-averaged over the run: a turn's
reusable blocks are the full blocks of what vLLM computed for it (prompt + output - 1
tokens: the last output token is never fed back) less the system prompt's, and they
are live from that turn's end to the next turn's send, which loadgen makes exactly
the follow-up's think time. The planned figure takes the lengths the workload
intends and its arrival span as the run's length (every request served at once);
a run's figure takes its own lengths and duration.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from kvswap.percentiles import nearest_rank
from kvswap.sim.policy_curve import live_blocks, reusable_blocks

#: (key, label, lower is better). TTFT from loadgen's per-request records (nearest
#: rank, as its summary), throughput from its summary, prefill computed = prompt
#: tokens - cached tokens (vLLM's usage counts).
FIGURES: tuple[tuple[str, str, bool], ...] = (
    ("ttft_p50_ms", "TTFT p50 (ms)", True),
    ("ttft_p90_ms", "TTFT p90 (ms)", True),
    ("throughput_tok_s", "output throughput (tok/s)", False),
    ("prefill_tokens_computed", "prefill tokens computed", True),
)
#: Shown beside the figures, not judged: what a request whose prompt was nearly all a
#: hit waits for its first token (fewer than `NEAR_FULL_HIT_BLOCKS` blocks computed: a
#: turn's new words and its last block), and how many such requests there were. vLLM's
#: connector loads between engine steps, so a hit from the host tier or below starts a
#: step later than one from the device pool's prefix cache.
DIAGNOSTIC_FIGURES: tuple[tuple[str, str, bool], ...] = (
    ("near_full_hit_ttft_p50_ms", "TTFT p50, near-full hits (ms)", True),
    ("near_full_hit_requests", "near-full hits (requests)", False),
)
NEAR_FULL_HIT_BLOCKS = 4
#: The issue's goals: (c) at least (b) on every figure; (d)'s TTFT p50 <= 0.7 x (b)'s.
GOAL_NVME_TTFT_P50_RATIO = 0.7


def working_set_blocks(
    turns: Sequence[tuple[int, int, float]],
    duration_s: float,
    block_tokens: int,
    system_prompt_tokens: int,
) -> float:
    """Mean reusable blocks over `duration_s` (module docstring). `turns`: per turn that
    has a follow-up, (prompt tokens, output tokens, the follow-up's think time): each is
    live for its think time, whenever that falls."""
    system_blocks = system_prompt_tokens // block_tokens
    intervals = [
        (0.0, think_s, reusable_blocks(prompt, output, block_tokens, system_blocks))
        for prompt, output, think_s in turns
    ]
    return live_blocks(intervals, duration_s, system_blocks).mean_blocks


def planned_turns(workload: Any) -> tuple[list[tuple[int, int, float]], float]:
    """The workload's turns with a follow-up, at their intended lengths (no EOS: every
    turn generates its max_new_tokens), and its arrival span (zero service time)."""
    prompt_tokens: dict[int, int] = {}
    turns: list[tuple[int, int, float]] = []
    for request in workload:  # in arrival order: a turn after the one it follows
        follow = request.follow_up
        if follow is None:
            prompt_tokens[request.request_id] = len(request.prompt_ids)
        else:
            previous = workload[follow.previous_request_id]
            prompt_tokens[request.request_id] = (
                prompt_tokens[previous.request_id] + previous.max_new_tokens
                + len(follow.new_user_ids)
            )  # fmt: skip
            turns.append((prompt_tokens[previous.request_id], previous.max_new_tokens,
                          follow.think_time_s))  # fmt: skip
    span_s = max(request.arrival_s for request in workload)
    return turns, span_s


def measured_turns(
    records: Sequence[Mapping[str, Any]], workload: Any
) -> list[tuple[int, int, float]]:
    """The same from a run's report.json records: the server's prompt and output counts."""
    by_turn = {(r["session_id"], r["turn"]): r for r in records if r["outcome"] == "completed"}
    turns = []
    for request in workload:
        follow = request.follow_up
        previous = by_turn.get((request.session_id, request.turn - 1))
        if follow is None or previous is None or (request.session_id, request.turn) not in by_turn:
            continue
        turns.append((previous["sent_prompt_tokens"], previous["output_tokens"],
                      follow.think_time_s))  # fmt: skip
    return turns


def run_figures(
    summary: Mapping[str, Any],
    records: Sequence[Mapping[str, Any]],
    rise: Mapping[str, float],
    block_tokens: int,
) -> dict[str, Any]:
    """One run's figures: loadgen's (summary, per-request records) and vLLM's (/metrics
    counters' rise over the measured chat)."""
    done = [r for r in records if r["outcome"] == "completed"]
    ttfts_ms = [float(r["ttft_ms"]) for r in done if r["ttft_ms"] is not None]
    near_full_ms = [
        float(r["ttft_ms"]) for r in done
        if r["ttft_ms"] is not None and r["cached_tokens"] is not None
        and r["sent_prompt_tokens"] is not None
        and r["sent_prompt_tokens"] - r["cached_tokens"] < NEAR_FULL_HIT_BLOCKS * block_tokens
    ]  # fmt: skip
    prompt, cached = int(summary["prompt_tokens"] or 0), int(summary["cached_tokens"] or 0)
    return {
        "ttft_p50_ms": round(nearest_rank(ttfts_ms, 0.50), 3),
        "ttft_p90_ms": round(nearest_rank(ttfts_ms, 0.90), 3),
        "near_full_hit_ttft_p50_ms": (
            round(nearest_rank(near_full_ms, 0.50), 3) if near_full_ms else None
        ),
        "near_full_hit_requests": len(near_full_ms),
        "throughput_tok_s": float(summary["throughput_tok_s"]),
        "prefill_tokens_computed": prompt - cached,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "requests_completed": int(summary["requests_completed"]),
        "requests_failed": int(summary["requests_failed"]),
        "tokens_generated": int(summary["tokens_generated"]),
        "duration_s": float(summary["duration_s"]),
        "vllm": dict(rise),
    }


def merge_rounds(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per figure: the median over rounds and the spread (min, max); None where no round
    has the figure (no near-full hit at all)."""
    merged: dict[str, Any] = {}
    for key, _, _ in (*FIGURES, *DIAGNOSTIC_FIGURES):
        values = [float(run[key]) for run in runs if run.get(key) is not None]
        merged[key] = None if not values else {
            "median": round(statistics.median(values), 3),
            "min": round(min(values), 3), "max": round(max(values), 3),
        }  # fmt: skip
    return merged


def _median(merged: Mapping[str, Mapping[str, Any]], config: str, key: str) -> float | None:
    figures = merged.get(config)
    return None if figures is None else float(figures[key]["median"])


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    if ours is None or theirs is None or theirs == 0:
        return None
    return round(ours / theirs, 3)


def judge(
    merged: Mapping[str, Mapping[str, Any]],
) -> tuple[dict[str, float | None], dict[str, bool | None]]:
    """(c)/(b) per figure and (d)/(b) TTFT p50 on the medians; whether each goal was met
    (None where a config did not run)."""
    ratios: dict[str, float | None] = {}
    goals: dict[str, bool | None] = {}
    for key, _, lower_is_better in FIGURES:
        kvswap, vllm = _median(merged, "kvswap", key), _median(merged, "vllm", key)
        ratios[f"kvswap_over_vllm_{key}"] = _ratio(kvswap, vllm)
        if kvswap is None or vllm is None:
            goals[f"kvswap_at_least_vllm_{key}"] = None
        else:
            goals[f"kvswap_at_least_vllm_{key}"] = (
                kvswap <= vllm if lower_is_better else kvswap >= vllm
            )
    nvme = _ratio(
        _median(merged, "kvswap_nvme", "ttft_p50_ms"), _median(merged, "vllm", "ttft_p50_ms")
    )
    ratios["kvswap_nvme_over_vllm_ttft_p50_ms"] = nvme
    goals["kvswap_nvme_ttft_p50_at_most_0.7_vllm"] = (
        None if nvme is None else nvme <= GOAL_NVME_TTFT_P50_RATIO
    )
    return ratios, goals


def between_steps_ratios(merged: Mapping[str, Mapping[str, Any]]) -> dict[str, float | None]:
    """Shown, not judged: (c)/(b0) and (d)/(b0) TTFT p50 and p90, against vLLM's host
    tier through vLLM 0.32's own connector (every load between steps)."""
    return {
        f"{config}_over_vllm_between_{key}": _ratio(
            _median(merged, config, key), _median(merged, "vllm_between", key)
        )
        for config in ("kvswap", "kvswap_nvme")
        for key in ("ttft_p50_ms", "ttft_p90_ms")
    }


def table(
    labels: Mapping[str, str],
    merged: Mapping[str, Mapping[str, Any]],
    ratios: Mapping[str, float | None],
) -> list[str]:
    """The printed table: per figure, each config's median [min-max], then (c)/(b)."""
    configs = [config for config in labels if config in merged]
    width = 24
    lines = [f"{'figure':<31}" + "".join(f"{labels[c]:>{width}}" for c in configs)
             + f"{'(c)/(b)':>9}"]  # fmt: skip
    for key, label, _ in (*FIGURES, *DIAGNOSTIC_FIGURES):
        cells = []
        for config in configs:
            figure = merged[config][key]
            spread = "" if figure is None else f"[{figure['min']:.0f}-{figure['max']:.0f}]"
            cells.append("-" if figure is None else f"{figure['median']:.1f} {spread}")
        shown = ratios.get(f"kvswap_over_vllm_{key}")
        lines.append(f"{label:<31}" + "".join(f"{cell:>{width}}" for cell in cells)
                     + f"{'-' if shown is None else f'{shown:.3f}':>9}")  # fmt: skip
    return lines
