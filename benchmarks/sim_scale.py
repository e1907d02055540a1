"""How fast the simulator runs at full scale: an hour-long Mooncake-format trace.

Generates a seeded Mooncake-like trace (`kvswap.sim.tracegen`: ~12k requests in an
hour, ~12k-token prompts, conversation-style prefix sharing; NOT the real
Mooncake trace, which is not bundled) or reads `--trace FILE`, and simulates it
on an H200 with the GPU tier sized from its memory, 100k CPU blocks and 200k
NVMe blocks (8B model, 16-token blocks). Shows a progress bar on stderr
(`--quiet`: none); prints simulated seconds per wall second and steps per
second, then one JSON line.

    .venv/bin/python benchmarks/sim_scale.py                    # about 15 minutes on 2 cores
    .venv/bin/python benchmarks/sim_scale.py --max-requests 1000
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from kvswap.config_load import load_config
from kvswap.obs.progress import ProgressBar
from kvswap.sim.hardware import hardware_preset
from kvswap.sim.simulator import Simulator
from kvswap.sim.trace import load_trace_workload
from kvswap.sim.tracegen import TraceSpec, generate_trace_rows, write_trace
from machine import add_out_argument, keep_result
from wall_share import WallShare

#: The eviction policies and the store's door to them: every re-rank, insert, removal
#: and victim, the part of the run a batched ranking could make cheaper.
POLICY_MODULES = ("control/store_policies.py", "control/policy", "base/eviction_policy.py")

CONFIG: dict[str, object] = {
    "kv_block_tokens": 16, "cpu_kv_capacity_blocks": 100_000,
    "nvme_kv_capacity_blocks": 200_000, "nvme_dir": "/var/tmp/kvswap",
    "max_num_batched_tokens": 8192, "preset": "article-8b", "dtype": "fp16",
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", metavar="FILE", help="a Mooncake-format trace to replay")
    parser.add_argument("--max-requests", type=int, default=None)
    parser.add_argument("--hardware", default="h200")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_out_argument(parser)
    args = parser.parse_args()
    start_s = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.trace) if args.trace else Path(tmp) / "trace.jsonl"
        if args.trace is None:
            write_trace(generate_trace_rows(TraceSpec()), path)
        workload = load_trace_workload(path, max_requests=args.max_requests)
    load_s = time.perf_counter() - start_s
    config = load_config(None, overrides=CONFIG)
    simulator = Simulator(config, hardware_preset(args.hardware))
    with ProgressBar("simulated requests", enabled=not args.quiet) as bar, WallShare() as share:
        summary = simulator.run(workload, bar.update).to_json()
    policy_share = share.of(POLICY_MODULES)
    wall_s = float(summary["wall_s"])  # type: ignore[arg-type]
    steps = int(summary["num_steps"])  # type: ignore[call-overload]
    figures = {
        "requests": len(workload),
        "trace_load_s": round(load_s, 1),
        "simulate_wall_s": wall_s,
        "simulated_s": summary["duration_s"],
        "simulated_s_per_wall_s": summary["simulated_s_per_wall_s"],
        "num_steps": steps,
        "steps_per_wall_s": round(steps / wall_s, 1),
        "gpu_blocks": simulator.setup.capacities.num_gpu_blocks,
        "throughput_tok_s": summary["throughput_tok_s"],
        "itl_ms": summary["itl_ms"],
        "ttft_ms": summary["ttft_ms"],
        "prefix_hit_rate_by_tier": summary["prefix_hit_rate_by_tier"],
        # Where the wall time went (sampled), and what that bounds: with eviction
        # policies that cost nothing the run would be at most this much faster.
        "wall_samples": share.num_samples,
        "wall_share_by_module": share.by_module(),
        "policy_wall_share": policy_share,
        "speedup_bound_free_policies": round(1 / (1 - policy_share), 2),
    }
    print(
        f"{len(workload)} requests: {summary['duration_s']:.0f} simulated s in {wall_s:.0f} wall s "
        f"= {summary['simulated_s_per_wall_s']} simulated s per wall s, "
        f"{figures['steps_per_wall_s']} steps/s (trace loaded in {load_s:.1f} s)"
    )
    print(
        f"eviction policies and their door: {policy_share:.0%} of the wall time sampled; "
        f"free, they would make it at most {figures['speedup_bound_free_policies']}x faster"
    )
    print(json.dumps(figures))
    keep_result(args.out, "sim_scale", "sim_scale.py", None, figures)


if __name__ == "__main__":
    main()
