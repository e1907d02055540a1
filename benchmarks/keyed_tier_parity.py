"""NVMe as a slot tier against a keyed tier in its place, simulated side by side.

The engine's NVMe is a slot tier of the control plane; vLLM's shape puts every
tier below the pinned pool behind a key-addressed interface, in one list. Before
kvswap's own NVMe moves there, a keyed tier must find what the slot tier finds,
alone and in front of a shared store. This runs `sim_scale.py`'s trace and
configuration (article-8b on h200, 100k pinned blocks, 200k NVMe blocks) five ways:

    slot            the NVMe slot tier (the engine's today)
    keyed           no slot tier; a keyed NVMe tier of the same capacity in its place:
                    this engine's own store (`SharedRemoteStore(holds_keys=True,
                    local=True)`: a plain LRU passing over paused sequences' keys,
                    saying which keys it evicted), so the engine remembers the blocks
                    it holds and forgets them as it evicts them, as it does the slot
                    tier's (`Tier.KEYED_NVME`, reported as `nvme`); reached over the
                    drive (`KeyedLink.nvme`: its read and write rates and latency, one
                    link both ways, looked up in this process), written as blocks
                    leave the pinned pool (`on_demote`), 64 write chunks in flight
                    (`remote_max_inflight_chunks`' default)
    keyed_bounded   the same with 4 write chunks in flight (the default before: 32
                    blocks written a step, since results are polled between steps)
    slot_and_store  the slot tier, and a shared store of 50k blocks below it (the
                    profile's network link), written as sequences finish (`on_finish`)
    keyed_list      the keyed tier, then the same store: a list of two keyed tiers,
                    each written by its own policy (`on_demote`, then `on_finish`)

Each keyed side also counts fetches that found their key gone, writes refused
(every key held), and the slab's evictions against the copies the engine dropped
for them (`nvme_discard`; it checks that no block the engine keeps claims a copy
the slab evicted). Each side checks it wrote to the tiers it names and
got prefix hits from its NVMe tier (at 300 requests the keyed side has none
yet; one engine's store, written on finish, serves only what the engine forgot). Prints
each side's prefix hit rates and speed, the ratios keyed / slot and keyed_list /
slot_and_store, then one JSON line. Throughput is kept but not compared: a run's
duration ends when its last transfer does, and the sides' last writes differ.

    .venv/bin/python benchmarks/keyed_tier_parity.py                     # ~5 minutes
    .venv/bin/python benchmarks/keyed_tier_parity.py --max-requests 600
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from kvswap.base.tier import Tier
from kvswap.config_load import load_config
from kvswap.sim.hardware import HardwareProfile, hardware_preset
from kvswap.sim.keyed_tier import KeyedLink, ModelledKeyedTier
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
#: The NVMe tier's capacity, and so the keyed tier's.
NVME_BLOCKS = cast(int, CONFIG["nvme_kv_capacity_blocks"])
#: The shared store's capacity on the sides that have one.
STORE_BLOCKS = 50_000
#: The figures of each side kept (the summary's keys; a side lacking one keeps None).
KEPT = ("duration_s", "throughput_tok_s", "ttft_ms", "itl_ms", "prefix_hit_rate_by_tier",
        "num_steps", "bytes_cpu_to_nvme", "bytes_nvme_to_cpu", "bytes_cpu_to_remote",
        "bytes_remote_to_cpu", "simulated_s_per_wall_s")  # fmt: skip


@dataclass(frozen=True)
class Side:
    """One way to run: the NVMe as a keyed tier or a slot tier, a store below or none,
    and the keyed tier's bound on write chunks in flight."""

    keyed_nvme: bool
    store: bool
    write_chunks: int = UNBOUNDED_WRITE_CHUNKS


SIDES = {
    "slot": Side(keyed_nvme=False, store=False),
    "keyed": Side(keyed_nvme=True, store=False),
    "keyed_bounded": Side(keyed_nvme=True, store=False, write_chunks=4),
    "slot_and_store": Side(keyed_nvme=False, store=True),
    "keyed_list": Side(keyed_nvme=True, store=True),
}
#: What each side is compared with.
BASELINES = {"keyed": "slot", "keyed_bounded": "slot", "keyed_list": "slot_and_store"}


def run_side(
    name: str, side: Side, hardware: HardwareProfile, workload: Workload
) -> dict[str, Any]:
    """One side (`SIDES`), its kept figures."""
    overrides = dict(CONFIG) | {"remote_max_inflight_chunks": side.write_chunks}
    if side.keyed_nvme:
        del overrides["nvme_dir"]
        overrides["nvme_kv_capacity_blocks"] = 0
    config = load_config(None, overrides=overrides)
    block_bytes = resolve_setup(config, hardware).block_bytes
    keyed: list[ModelledKeyedTier] = []
    if side.keyed_nvme:
        slab = SharedRemoteStore(
            capacity_bytes=NVME_BLOCKS * block_bytes, holds_keys=True, local=True
        )
        keyed.append(ModelledKeyedTier(slab, KeyedLink.nvme(hardware), "on_demote"))
    if side.store:
        store = SharedRemoteStore(capacity_bytes=STORE_BLOCKS * block_bytes)
        keyed.append(ModelledKeyedTier(store, write_policy="on_finish"))
    simulator = Simulator(config, hardware, keyed=keyed)
    summary: dict[str, Any] = simulator.run(workload).to_json()
    kept = {key: summary.get(key) for key in KEPT}
    rates: dict[str, float] = summary["prefix_hit_rate_by_tier"]
    kept["prefix_hit_rate"] = round(sum(rates.values()), 6)
    kept["below_pinned_hit_rate"] = round(
        sum(rate for tier, rate in rates.items() if tier not in ("gpu", "cpu")), 6
    )
    remote: dict[str, int] = summary["remote"]
    kept["store_evictions"] = store.counters.evictions if side.store else 0
    kept["store_fetch_failures"] = remote.get("fetch_failures", 0)
    kept["store_write_failures"] = remote.get("write_failures", 0)
    kept["nvme_discard"] = summary["evictions_by_reason"].get("nvme_discard", 0)
    if side.keyed_nvme:
        # By the next step the engine has heard of every eviction: no block it keeps
        # claims an idle copy the slab lacks (an eviction finds some copies busy, or
        # blocks already gone: it drops fewer copies than the slab evicted keys).
        swapper = simulator.swapper
        swapper.begin_step(summary["num_steps"] + 1)
        kept["slab_evictions"] = slab.counters.evictions
        kept["nvme_discard_heard"] = swapper.metrics.evictions_by_reason["nvme_discard"]
        stale = sum(
            1 for block in swapper.store.blocks.values()
            if block.ready_copy(Tier.KEYED_NVME) is not None and block.key not in slab
        )  # fmt: skip
        if stale:
            raise SystemExit(f"{name}: {stale} blocks claim a copy the slab evicted")
    # The tiers this side names, each written; the NVMe one serving prefix hits (in one
    # engine a store written on finish serves what this engine forgot only: at times none).
    named = ["nvme"] + (["remote"] if side.store else [])
    for tier in ("nvme", "remote"):
        wrote = summary.get(f"bytes_cpu_to_{tier}") or 0
        if (wrote > 0) != (tier in named) or (tier == "nvme" and rates.get(tier, 0) <= 0):
            raise SystemExit(
                f"{name}: did not use the tiers it names ({', '.join(named)}): bytes written "
                f"to {tier} {wrote}, prefix hits from it {rates.get(tier, 0)}"
            )
    return kept


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
    results: dict[str, Any] = {}
    for name, spec in SIDES.items():
        side = results[name] = run_side(name, spec, hardware, workload)
        print(
            f"{name:>14}: prefix hits {side['prefix_hit_rate']:.4f} (below the pinned pool "
            f"{side['below_pinned_hit_rate']:.4f}), {side['throughput_tok_s']} tok/s, TTFT p50 "
            f"{side['ttft_ms']['p50'] / 1e3:.1f} s",
            flush=True,
        )
    ratios = {
        f"{name} / {base}": {
            figure: round(results[name][figure] / results[base][figure], 3)
            for figure in ("prefix_hit_rate", "below_pinned_hit_rate")
        }
        | {
            f"{figure}_{q}": round(results[name][figure][q] / results[base][figure][q], 3)
            for figure, q in (("ttft_ms", "p50"), ("ttft_ms", "p99"), ("itl_ms", "p99"))
        }
        for name, base in BASELINES.items()
    }
    for label, ratio in ratios.items():
        print(f"{label}: {ratio}")
    figures = {"requests": len(workload), "hardware": "h200", **results, **ratios}
    print(json.dumps(figures))
    keep_result(args.out, "keyed_tier_parity", "keyed_tier_parity.py", None, figures)


if __name__ == "__main__":
    main()
