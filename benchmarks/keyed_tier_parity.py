"""NVMe as a slot tier against a keyed tier in its place, simulated side by side.

The engine's NVMe is a slot tier of the control plane; vLLM's shape puts every
tier below the pinned pool behind a key-addressed interface. Before kvswap's own
NVMe moves there, a keyed tier must find what the slot tier finds. This runs
`sim_scale.py`'s trace and configuration (article-8b on h200, 100k pinned blocks,
200k NVMe blocks) three ways:

    slot            the NVMe slot tier (the engine's today)
    keyed           no NVMe; a store of the same capacity in its place, written as
                    blocks leave the pinned pool (`remote_write_policy = on_demote`),
                    its link at the NVMe's write rate and latency, 64 write chunks
                    in flight (`remote_max_inflight_chunks`' default)
    keyed_bounded   the same with 4 write chunks in flight (the default before: 32
                    blocks written a step, since results are polled between steps)

The keyed sides model a keyed NVMe tier (`SharedRemoteStore(holds_keys=True)`):
its own plain LRU, passing over the keys the control plane holds (a paused or
waiting sequence's blocks, `SecondaryTier.hold`), and one link rate both ways
(NVMe reads at its write rate: an approximation against the keyed side). Each
keyed side also counts fetches that found their key gone and writes refused
(every key held). Each side checks it wrote to the tier it names and got prefix
hits from it (at 300 requests the keyed side has none yet). Prints each side's
prefix hit rates and speed, the ratios keyed / slot, then one JSON line. Throughput is kept
but not compared: a run's duration ends when its last transfer does, and the
sides' last writes differ (the slot tier's demotions still in flight).

    .venv/bin/python benchmarks/keyed_tier_parity.py                     # ~3 minutes
    .venv/bin/python benchmarks/keyed_tier_parity.py --max-requests 600
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any, cast

from kvswap.config_load import load_config
from kvswap.sim.hardware import HardwareProfile, hardware_preset
from kvswap.sim.remote_store import SharedRemoteStore
from kvswap.sim.setup import resolve_setup
from kvswap.sim.simulator import Simulator
from kvswap.sim.trace import load_trace_workload
from kvswap.sim.tracegen import TraceSpec, generate_trace_rows, write_trace
from kvswap.workload.request import Workload
from machine import add_out_argument, keep_result
from sim_scale import CONFIG

#: Write chunks in flight on the keyed side (the config's default): enough that the
#: bound does not hold the pinned pool's demotion back at this shape (the slot tier's
#: demotion has no such bound).
UNBOUNDED_WRITE_CHUNKS = 64
#: The NVMe tier's capacity, and so the store's on the keyed sides.
NVME_BLOCKS = cast(int, CONFIG["nvme_kv_capacity_blocks"])
#: The figures of each side kept (the summary's keys).
KEPT = ("duration_s", "throughput_tok_s", "ttft_ms", "itl_ms", "prefix_hit_rate_by_tier",
        "num_steps", "bytes_cpu_to_nvme", "bytes_nvme_to_cpu", "bytes_cpu_to_remote",
        "bytes_remote_to_cpu", "simulated_s_per_wall_s")  # fmt: skip


def run_side(
    name: str, write_chunks: int | None, hardware: HardwareProfile, workload: Workload
) -> dict[str, Any]:
    """One side: the slot tier (`write_chunks` None), or the store in NVMe's place with
    at most `write_chunks` write chunks in flight."""
    keyed = write_chunks is not None
    overrides = dict(CONFIG)
    if keyed:
        del overrides["nvme_dir"]
        overrides |= {"nvme_kv_capacity_blocks": 0, "remote_write_policy": "on_demote",
                      "remote_max_inflight_chunks": write_chunks}  # fmt: skip
    config = load_config(None, overrides=overrides)
    store = None
    if keyed:
        block_bytes = resolve_setup(config, hardware).block_bytes
        store = SharedRemoteStore(capacity_bytes=NVME_BLOCKS * block_bytes, holds_keys=True)
        hardware = dataclasses.replace(
            hardware, remote_gb_per_s=hardware.nvme_write_gb_per_s,
            remote_rtt_ms=hardware.nvme_latency_s * 1e3,
        )  # fmt: skip
    summary = Simulator(config, hardware, remote_store=store).run(workload).to_json()
    side = {key: summary[key] for key in KEPT}
    rates = summary["prefix_hit_rate_by_tier"]
    side["prefix_hit_rate"] = round(sum(rates.values()), 6)
    side["below_pinned_hit_rate"] = round(rates["nvme"] + rates["remote"], 6)
    remote = summary["remote"]
    side["store_evictions"] = remote.get("evictions", 0)
    side["store_fetch_failures"] = remote.get("fetch_failures", 0)
    side["store_write_failures"] = remote.get("write_failures", 0)
    wrote_nvme, wrote_store = summary["bytes_cpu_to_nvme"], summary["bytes_cpu_to_remote"]
    used = wrote_store > 0 and wrote_nvme == 0 if keyed else wrote_nvme > 0 and wrote_store == 0
    served = rates["remote" if keyed else "nvme"] > 0
    if not (used and served):
        raise SystemExit(
            f"{name}: did not use the tier it names (bytes to NVMe {wrote_nvme}, to the "
            f"store {wrote_store}; prefix hits from NVMe {rates['nvme']}, from the store "
            f"{rates['remote']})"
        )
    return side


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-requests", type=int, default=1500)
    add_out_argument(parser)
    args = parser.parse_args()
    if args.max_requests < 1:
        parser.error(f"--max-requests {args.max_requests}: allowed: >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.jsonl"
        write_trace(generate_trace_rows(TraceSpec()), path)
        workload = load_trace_workload(path, max_requests=args.max_requests)
    hardware = hardware_preset("h200")
    sides = {"slot": None, "keyed": UNBOUNDED_WRITE_CHUNKS, "keyed_bounded": 4}
    results: dict[str, Any] = {}
    for name, write_chunks in sides.items():
        side = results[name] = run_side(name, write_chunks, hardware, workload)
        print(
            f"{name:>14}: prefix hits {side['prefix_hit_rate']:.4f} (below the pinned pool "
            f"{side['below_pinned_hit_rate']:.4f}), {side['throughput_tok_s']} tok/s, TTFT p50 "
            f"{side['ttft_ms']['p50'] / 1e3:.1f} s",
            flush=True,
        )
    slot = results["slot"]
    ratios = {
        name: {
            figure: round(results[name][figure] / slot[figure], 3)
            for figure in ("prefix_hit_rate", "below_pinned_hit_rate")
        }
        | {
            f"{figure}_{q}": round(results[name][figure][q] / slot[figure][q], 3)
            for figure, q in (("ttft_ms", "p50"), ("ttft_ms", "p99"), ("itl_ms", "p99"))
        }
        for name in ("keyed", "keyed_bounded")
    }
    for name, ratio in ratios.items():
        print(f"{name} / slot: {ratio}")
    figures = {"requests": len(workload), "hardware": "h200", **results,
               **{f"{name} / slot": ratio for name, ratio in ratios.items()}}  # fmt: skip
    print(json.dumps(figures))
    keep_result(args.out, "keyed_tier_parity", "keyed_tier_parity.py", None, figures)


if __name__ == "__main__":
    main()
