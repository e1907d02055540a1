"""The article's five findings, measured side by side in one run of the simulator.

Each finding runs the article's configuration (8B model, article-40gb hardware:
40 GB GPU, PCIe 4.0 at 25 GB/s with ONE copy engine shared by both directions,
its watermarks and chunks) with and without the one change, on the same seeded
workloads, and reports worse / better:

    1  swap_out_chunk_blocks 512 vs 8         P99 token latency
    2  swap_out_high_watermark 1.0 vs 0.85    synchronous stalls (P99 in the note)
    3  pageable vs pinned host memory         P99 token latency
    4  LRU without vs with sink protection    swap-ins of sink blocks
    5  min_residency_steps 0 vs 64            re-swaps (ping-pong)

Findings 1-3 use a decode-heavy multi-turn chat (the token-latency tail is set
by conversations swapped back in), 4-5 a burst of sessions that keeps the
scheduler preempting and resuming (see kvswap.sim.findings). Finding 1 is also
run on the same machine with one copy engine per direction (in its note). Each
row names the profile and copy engines it ran on. P99 values are means over the
seeds, counts are sums. Prints a table, then one JSON line.

    .venv/bin/python benchmarks/article_findings.py              # ~5 minutes on 2 cores
    .venv/bin/python benchmarks/article_findings.py --quick      # test scale, ~30 s
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvswap.sim.findings import (
    BURST,
    BURST_VARIANTS,
    CHAT,
    CHAT_VARIANTS,
    Finding,
    FindingsScale,
    findings,
    run_variants,
)
from machine import add_out_argument, keep_result

CHAT_QUICK = FindingsScale(num_sessions=24, turns_per_session=6, prompt_tokens=3000,
                           output_tokens=256, user_tokens_per_turn=64, arrival_rate_per_s=2.0,
                           think_time_s=1.0)  # fmt: skip
BURST_QUICK = FindingsScale(num_sessions=40, turns_per_session=2, prompt_tokens=3000,
                            output_tokens=128, user_tokens_per_turn=300, arrival_rate_per_s=8.0,
                            think_time_s=1.0)  # fmt: skip


def render(rows: list[Finding]) -> str:
    lines = [f"{'#':<3}{'finding':<40}{'metric':<34}{'worse':>10}{'better':>10}{'ratio':>8}  "
             "reproduced"]  # fmt: skip
    for f in rows:
        ratio = "inf" if f.ratio is None else f"{f.ratio:.2f}"
        lines.append(
            f"{f.number:<3}{f.title:<40}{f.metric[:33]:<34}{f.worse_value:>10.1f}"
            f"{f.better_value:>10.1f}{ratio:>8}  {'yes' if f.reproduced else 'NO'}"
        )
        lines.append(f"   on: {f.hardware}")
        if f.note:
            lines.append(f"   note: {f.note}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2", help="workload seeds (default 0,1,2)")
    parser.add_argument("--quick", action="store_true", help="the test-scale workloads")
    add_out_argument(parser)
    args = parser.parse_args()
    seeds = tuple(int(part) for part in args.seeds.split(","))
    chat_scale, burst_scale = (CHAT_QUICK, BURST_QUICK) if args.quick else (CHAT, BURST)
    start_s = time.perf_counter()

    def progress(line: str) -> None:
        print(f"  {time.perf_counter() - start_s:6.1f}s {line}", file=sys.stderr, flush=True)

    chat = run_variants(chat_scale, CHAT_VARIANTS, seeds, progress=progress)
    burst = run_variants(burst_scale, BURST_VARIANTS, seeds, progress=progress)
    rows = findings(chat, burst)
    print(render(rows))
    per_seed = {
        name: [{"p99_itl_ms": s["itl_ms"]["p99"], "sync_stalls": s["sync_stalls"],  # type: ignore[index]
                "preemptions": s["preemptions"], "sink_block_swap_ins": s["sink_block_swap_ins"],
                "re_swaps": s["re_swaps"], "throughput_tok_s": s["throughput_tok_s"],
                "swap_wait_share": s["swap_wait_share"],
                "swap_in_blocked_by_swap_out": s["swap_in_blocked_by_swap_out"],
                "swap_in_blocked_by_link": s["swap_in_blocked_by_link"],
                "hardware": s["hardware"], "copy_engines": s["copy_engines"]}
               for s in summaries]
        for name, summaries in {**{f"chat/{k}": v for k, v in chat.items()},
                                **{f"burst/{k}": v for k, v in burst.items()}}.items()
    }  # fmt: skip
    report = {
        "seeds": list(seeds), "quick": args.quick,
        "wall_s": round(time.perf_counter() - start_s, 1),
        "findings": [f.to_json() for f in rows], "runs": per_seed,
    }  # fmt: skip
    print(json.dumps(report))
    keep_result(args.out, "article_findings", "article_findings.py", None, report)


if __name__ == "__main__":
    main()
