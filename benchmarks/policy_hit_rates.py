"""kvswap's host-tier policy against vLLM's LRU and ARC: prefix hits per host-tier size.

One seeded multi-turn chat (kvswap.sim.policy_curve.CHAT: 240 sessions of 6
turns over 4 shared system prompts, 30 s think time, 8B model on an H200, a
GPU tier of 1024 blocks with kvswap's policy in every run) runs through the
simulator's control plane once per `cpu_eviction_policy` (kvswap, lru, arc)
and host-tier size. The sizes are the working set (the live reusable KV,
measured on a run with an unlimited host tier) divided by 8, 4, 3, 2 and 1:
the 2-4x band the comparison is about, with points either side for the curve.

The host tier replaces as vLLM's does only with somewhere to put its victims,
so these runs give it a 64-block NVMe spill (its hits are listed apart). A
second table runs the pool with nothing below it at the 3x size: there it holds
more than half the GPU tier's blocks, so the GPU's victims displace its cache
entries as its policy ranks them (a smaller pool keeps what it holds; see
kvswap.sim.policy_curve).

Prints both tables, the ratio kvswap / max(lru, arc) at each size, then one JSON
line. Hit tokens and prefill tokens are counts in virtual time: runs may go in
parallel (`--jobs`) without changing a figure.

    .venv/bin/python benchmarks/policy_hit_rates.py                  # ~10 min on 2 cores
    .venv/bin/python benchmarks/policy_hit_rates.py --quick           # test scale, ~30 s
    .venv/bin/python benchmarks/policy_hit_rates.py --plot curve.png  # and the curve
    .venv/bin/python benchmarks/policy_hit_rates.py --seed 1 --also 'reuse(once=oldest)'

`--seed` draws another chat of the same shape; `--also` adds host-tier policies
(any `cpu_eviction_policy` value, parameters included), each reported like kvswap's
own as its hit tokens over the better of lru and arc.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from kvswap.control.policy import policy_class
from kvswap.errors import KvSwapError
from kvswap.sim.policy_curve import (
    CHAT,
    CHAT_QUICK,
    OURS,
    POLICIES,
    CurveShape,
    PolicyRun,
    chat_workload,
    live_reuse_blocks,
    simulate_policy,
    unlimited_host_blocks,
)
from machine import result_header
from policy_ratios import ratios as over_lru_arc

#: Host-tier sizes as the working set over these factors (2-4: the band asked about).
WORKING_SET_FACTORS = (8.0, 4.0, 3.0, 2.0, 1.0)
QUICK_FACTORS = (4.0, 3.0, 2.0)
#: The size where the pool is also run with nothing below it.
NOTHING_BELOW_FACTOR = 3.0


def run_one(job: tuple[CurveShape, str, int, bool]) -> PolicyRun:
    shape, policy, host_blocks, spill = job
    return simulate_policy(shape, chat_workload(shape), policy, host_blocks, spill=spill)[0]


def ratios(runs: Sequence[PolicyRun], ours: Sequence[str] = OURS) -> dict[str, float]:
    """{"ratio_<ours>_over_best": ...}: each of `ours`'s hit tokens over the better of
    lru and arc's (`policy_ratios.ratios`; 0.0 when neither hit)."""
    over_best = over_lru_arc([{"policy": run.policy, "hit_tokens": run.hit_tokens} for run in runs])
    return {f"ratio_{name}_over_best": over_best.get(name, 0.0) for name in ours}


def render(
    rows: Sequence[tuple[float, list[PolicyRun]]], block_tokens: int, ours: Sequence[str] = OURS
) -> str:
    width = max(7, *(len(run.policy) + 1 for _, runs in rows for run in runs))
    lines = [
        f"{'host blocks':>11} {'WS/host':>7}  {'policy':<{width}}{'hit tokens':>11}  "
        f"{'gpu / cpu / nvme':<26}{'hit rate':>9}{'prefill computed':>17}"
        f"{'host evictions':>15}"
    ]
    for factor, runs in rows:
        for run in runs:
            tiers = run.hit_tokens_by_tier
            split = f"{tiers['gpu']} / {tiers['cpu']} / {tiers['nvme']}"
            policy = f"{run.policy:<{width}}"
            lines.append(
                f"{run.host_blocks:>11} {factor:>6.1f}x  {policy}{run.hit_tokens:>11}  "
                f"{split:<26}{100 * run.point.hit_rate:>8.1f}%{run.prefill_tokens_computed:>17}"
                f"{run.host_evictions:>15}"
            )
        for key, value in ratios(runs, ours).items():
            name = key.removeprefix("ratio_").removesuffix("_over_best")
            lines.append(f"{'':>21}{name} / max(lru, arc) = {value:.3f}")
    lines.append(f"(blocks of {block_tokens} tokens)")
    return "\n".join(lines)


def plot(
    path: Path,
    rows: Sequence[tuple[float, list[PolicyRun]]],
    nothing_below: Sequence[PolicyRun],
    unlimited_rate: float,
    working_set_blocks: float,
    policies: Sequence[str] = POLICIES,
) -> None:
    """Hit rate against host-tier size, a line per policy, the pool with nothing below
    it as crosses (matplotlib's object API, as kvswap.obs.plots draws)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7.0, 4.2), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for index, policy in enumerate(policies):
        points = sorted(
            (run.host_blocks, 100 * run.point.hit_rate)
            for _, runs in rows
            for run in runs
            if run.policy == policy
        )
        axes.plot(*zip(*points, strict=True), marker="o", color=f"C{index}", label=policy)
        for run in nothing_below:
            if run.policy == policy:
                axes.plot(run.host_blocks, 100 * run.point.hit_rate, marker="x",
                          markersize=9, color=f"C{index}", linestyle="none")  # fmt: skip
    axes.plot([], [], marker="x", color="black", linestyle="none", label="nothing below the pool")
    axes.axhline(100 * unlimited_rate, color="grey", linestyle=":", label="unlimited host tier")
    low, high = working_set_blocks / 4, working_set_blocks / 2
    axes.axvspan(low, high, color="grey", alpha=0.12, label="working set 2-4x the tier")
    axes.set_xlabel("host (CPU) tier, blocks")
    axes.set_ylabel("prefix-hit tokens / prompt tokens, %")
    axes.set_title("Prefix-hit rate by host-tier policy (simulated, GPU tier: kvswap)")
    axes.grid(True, alpha=0.3)
    axes.legend(loc="best", fontsize="small")
    figure.tight_layout()
    figure.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the test-scale workload")
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel (default 2)")
    parser.add_argument("--plot", type=Path, metavar="FILE.png", help="draw the curve here")
    parser.add_argument("--out", type=Path, metavar="FILE.json", help="write the JSON here too")
    parser.add_argument("--seed", type=int, default=0, help="the chat's seed (default 0)")
    parser.add_argument("--also", nargs="+", default=[], metavar="POLICY",
                        help="more host-tier policies, e.g. 'reuse(once=oldest)'")  # fmt: skip
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: allowed: >= 1")
    shape = CHAT_QUICK if args.quick else CHAT
    shape = dataclasses.replace(shape, workload=dataclasses.replace(shape.workload, seed=args.seed))
    also = [name for name in dict.fromkeys(args.also) if name not in POLICIES]
    try:
        for name in also:
            policy_class("--also", name, top=False)
    except KvSwapError as error:
        parser.error(str(error))
    policies, ours = (*POLICIES, *also), (*OURS, *also)
    start_s = time.perf_counter()

    def progress(line: str) -> None:
        print(f"  {time.perf_counter() - start_s:6.1f}s {line}", file=sys.stderr, flush=True)

    workload = chat_workload(shape)
    unlimited, simulator = simulate_policy(
        shape, workload, "kvswap", unlimited_host_blocks(shape), spill=False
    )
    working_set = live_reuse_blocks(
        workload, simulator.scheduler.runs, shape.workload, shape.block_tokens
    )
    progress(
        f"working set {working_set.mean_blocks:.0f} blocks (peak {working_set.peak_blocks}); "
        f"unlimited host tier: hit rate {100 * unlimited.point.hit_rate:.1f} %"
    )
    factors = QUICK_FACTORS if args.quick else WORKING_SET_FACTORS
    sizes = {factor: round(working_set.mean_blocks / factor) for factor in factors}
    jobs = [(shape, policy, sizes[f], True) for f in factors for policy in policies]
    jobs += [(shape, policy, sizes[NOTHING_BELOW_FACTOR], False) for policy in policies]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        results = []
        for run in pool.map(run_one, jobs):
            results.append(run)
            progress(f"{run.policy} on {run.host_blocks} blocks (spill {run.spill}) done")
    replacing = [(f, [r for r in results if r.spill and r.host_blocks == sizes[f]]) for f in sizes]
    nothing_below = [(NOTHING_BELOW_FACTOR, [r for r in results if not r.spill])]

    print(f"workload: {workload.name}, {len(workload)} requests; GPU tier {shape.gpu_blocks} "
          f"blocks, gpu_eviction_policy = kvswap in every run")  # fmt: skip
    print(f"working set (live reusable KV): {working_set.mean_blocks:.0f} blocks on average, "
          f"{working_set.peak_blocks} at peak; an unlimited host tier hits "
          f"{100 * unlimited.point.hit_rate:.1f} % ({unlimited.hit_tokens} tokens)")  # fmt: skip
    print("\nhost tier that replaces (a 64-block NVMe spill below it):")
    print(render(replacing, shape.block_tokens, ours))
    print("\nhost tier with nothing below it (the GPU's victims displace its cache entries):")
    print(render(nothing_below, shape.block_tokens, ours))
    if args.plot is not None:
        plot(
            args.plot,
            replacing,
            nothing_below[0][1],
            unlimited.point.hit_rate,
            working_set.mean_blocks,
            policies,
        )
        print(f"\ncurve: {args.plot}")
    report = {
        **result_header("policy_hit_rates", "policy_hit_rates.py", None),
        "shape": shape.to_json(),
        "working_set_blocks": {
            "mean": round(working_set.mean_blocks, 3), "peak": working_set.peak_blocks
        },
        "unlimited": unlimited.to_json(),
        "replacing": [
            {"working_set_over_host": f, **ratios(runs, ours),
             "runs": [run.to_json() for run in runs]}
            for f, runs in replacing
        ],
        "nothing_below": [
            {"working_set_over_host": f, **ratios(runs, ours),
             "runs": [run.to_json() for run in runs]}
            for f, runs in nothing_below
        ],
    }  # fmt: skip
    print(json.dumps(report))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
