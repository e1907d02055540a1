"""`kvswap simulate`: the engine's control plane on a hardware model and a virtual clock."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from kvswap.commands.common import add_config_arguments, config_from_args
from kvswap.commands.outputs import (
    attempt_write,
    check_output_dir,
    check_output_file,
    write_text_output,
)
from kvswap.commands.run import (
    add_workload_arguments,
    check_workload_arguments,
    render,
    workload_from_args,
)
from kvswap.config import KvSwapConfig
from kvswap.errors import KvSwapError
from kvswap.obs.wiring import add_monitoring_arguments, build_monitoring
from kvswap.sim.hardware import (
    HARDWARE_NAMES,
    HardwareProfile,
    describe_hardware,
    hardware_from_bench,
    hardware_preset,
)
from kvswap.sim.hit_rate import DEFAULT_CAPACITIES_TOKENS, hit_rate_curve, parse_capacities_tokens
from kvswap.sim.simulator import SimOptions, Simulator
from kvswap.sim.trace import load_trace_workload
from kvswap.units import format_bytes
from kvswap.workload.mooncake import read_trace_rows
from kvswap.workload.request import Workload

#: Below --config: the seed article's CPU and NVMe tiers (the GPU tier is sized from the
#: hardware unless configured). The simulator never touches nvme_dir.
SIM_DEFAULTS: dict[str, object] = {
    "cpu_kv_capacity_blocks": 12000,
    "nvme_kv_capacity_blocks": 40000,
    "nvme_dir": "/var/tmp/kvswap",
}
#: The default synthetic workload: multi-turn sessions with a shared system prompt,
#: sized for an 8B model on a 40 GB card (its KV at peak exceeds the GPU tier).
WORKLOAD_DEFAULTS: dict[str, object] = {
    "num_sessions": 64, "turns": 3, "prompt_tokens": 2000, "output_tokens": 200,
    "user_tokens": 200, "system_prompt_tokens": 512, "arrival_rate": 8.0, "think_time_s": 2.0,
}  # fmt: skip


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "simulate",
        help="simulate a configuration on a hardware model (same scheduler and swapper)",
        description="Drive kvswap's own scheduler, swapper and residency policy with a modelled "
        "copy engine and a roofline step cost on a virtual clock; print the keys of "
        "`kvswap run --json` plus prefix hit rate by tier. With --hit-rate-curve: the prefix "
        "cache hit rate of a trace at several capacities (request order only).",
    )
    add_simulation_arguments(parser)
    parser.add_argument("--timeseries", metavar="FILE", help="write the time series as JSON")
    parser.add_argument(
        "--hit-rate-curve", action="store_true",
        help="prefix hit rate of --trace at each of --capacities-tokens (no simulation)",
    )  # fmt: skip
    parser.add_argument(
        "--capacities-tokens", default=DEFAULT_CAPACITIES_TOKENS, metavar="N,N,...",
        help=f"cache capacities for --hit-rate-curve (default {DEFAULT_CAPACITIES_TOKENS})",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quiet", action="store_true", help="no progress or live panel")
    add_monitoring_arguments(parser)
    parser.set_defaults(handler=run)


def add_simulation_arguments(parser: argparse.ArgumentParser) -> None:
    """Hardware, host memory, workload and config flags (shared with `kvswap tune`)."""
    group = parser.add_argument_group("hardware model")
    group.add_argument(
        "--hardware", dest="cfg_hardware", metavar="NAME", default=None,
        help=f"hardware preset: {', '.join(HARDWARE_NAMES)} (default: [simulator] hardware)",
    )  # fmt: skip
    group.add_argument(
        "--bench", metavar="FILE",
        help="take the host<->device link from `kvswap bench --out FILE` (compute and "
        "memory from the [simulator] hardware preset)",
    )  # fmt: skip
    group.add_argument(
        "--pageable", action="store_true",
        help="model pageable host memory (lower bandwidth, jitter) instead of a pinned pool",
    )  # fmt: skip
    group.add_argument(
        "--sim-seed",
        dest="cfg_seed",
        metavar="N",
        default=None,
        help="seed of the simulator's jitter (default: [simulator] seed)",
    )
    add_workload_arguments(parser)
    parser.set_defaults(**WORKLOAD_DEFAULTS)
    add_config_arguments(parser, ("model", "cache", "swap", "tiers", "engine"))


def hardware_from_args(args: argparse.Namespace, config: KvSwapConfig) -> HardwareProfile:
    if args.bench is not None and args.cfg_hardware is not None:
        raise KvSwapError("give --hardware NAME or --bench FILE, not both")
    base = hardware_preset(config.simulator.hardware)
    return base if args.bench is None else hardware_from_bench(args.bench, base)


def simulation_from_args(args: argparse.Namespace) -> tuple[KvSwapConfig, HardwareProfile]:
    """The validated config and hardware; fails before anything is simulated."""
    config = config_from_args(args, SIM_DEFAULTS)
    hardware = hardware_from_args(args, config)
    Simulator(config, hardware)  # sizes and checks every tier against the hardware
    return config, hardware


def sim_workload(args: argparse.Namespace) -> Workload:
    check_workload_arguments(args)
    if args.trace is not None:
        return load_trace_workload(
            args.trace, time_scale=args.time_scale, length_scale=args.length_scale,
            max_requests=args.max_requests,
        )  # fmt: skip
    return workload_from_args(args, vocab_size=32_000)


def run(args: argparse.Namespace) -> int:
    if args.hit_rate_curve:
        return _hit_rate_curve(args)
    check_output_dir(args.report, "--report")
    check_output_file(args.timeseries, "--timeseries")
    check_workload_arguments(args)
    config, hardware = simulation_from_args(args)
    simulator = Simulator(config, hardware, options=SimOptions(pinned_host=not args.pageable))
    workload = sim_workload(args)
    if not args.json and not args.quiet:
        print(describe(simulator, workload))
    run_info = {"command": "simulate", "hardware": hardware.name, "workload": workload.name,
                "requests": len(workload)}  # fmt: skip
    with build_monitoring(
        args, config, block_bytes=simulator.setup.block_bytes,
        kv_metrics=simulator.swapper.metrics, run_info=run_info,
        link_gb_per_s=min(hardware.h2d_gb_per_s, hardware.d2h_gb_per_s),
    ) as monitoring:  # fmt: skip
        result = simulator.run(workload, monitoring.progress, monitoring.observers)
        summary = monitoring.finish(result.to_json())
        failures = [monitoring.report_error]
        if args.timeseries is not None:
            text = json.dumps(monitoring.recorder.series().to_json()) + "\n"
            path = args.timeseries
            failures.append(
                attempt_write(
                    lambda: write_text_output(path, text, "--timeseries"), "--timeseries", path
                )
            )
    print(json.dumps(summary, indent=2) if args.json else render_simulation(summary))
    raise_first(failures)
    return 0


def raise_first(failures: list[KvSwapError | None]) -> None:
    """After the summary is printed: the first output that failed, as the one error line."""
    for failure in failures:
        if failure is not None:
            raise failure


def describe(simulator: Simulator, workload: Workload) -> str:
    setup = simulator.setup
    caps = setup.capacities
    return (
        f"{describe_hardware(setup.hardware)}\n"
        f"model {setup.shape.name} ({setup.dtype}): weights {format_bytes(setup.weights_bytes)}, "
        f"blocks of {setup.config.cache.kv_block_tokens} tokens = {format_bytes(setup.block_bytes)}"
        f"\ntiers: GPU {caps.num_gpu_blocks} blocks, CPU {caps.num_cpu_blocks}, NVMe "
        f"{caps.num_nvme_blocks}; workload {workload.name}: {len(workload)} requests"
    )


def render_simulation(summary: dict[str, Any]) -> str:
    links = ", ".join(f"{k} {100 * v:.1f} %" for k, v in summary["link_utilization"].items())
    hits = ", ".join(f"{k} {100 * v:.1f} %" for k, v in summary["prefix_hit_rate_by_tier"].items())
    extra = [
        ("prefix hit rate", hits),
        ("link utilisation", links),
        ("sink-block swap-ins", str(summary["sink_block_swap_ins"])),
        ("re-swaps (ping-pong)", str(summary["re_swaps"])),
        ("simulated s / wall s", f"{summary['simulated_s_per_wall_s']:.1f}"),
    ]
    return render(summary) + "\n" + "\n".join(f"{label:<20}  {value}" for label, value in extra)


def _hit_rate_curve(args: argparse.Namespace) -> int:
    if args.trace is None:
        raise KvSwapError("--hit-rate-curve needs --trace FILE (a Mooncake-format JSONL trace)")
    capacities = parse_capacities_tokens(args.capacities_tokens)
    rows = read_trace_rows(args.trace, max_requests=args.max_requests)
    points = hit_rate_curve(rows, capacities)
    if args.json:
        print(json.dumps({"hit_rate_curve": [point.to_json_dict() for point in points]}))
        return 0
    print(f"{'capacity (tokens)':>18}  hit rate")
    for point in points:
        capacity = "inf" if math.isinf(point.capacity_tokens) else f"{point.capacity_tokens:,.0f}"
        print(f"{capacity:>18}  {100 * point.hit_rate:6.2f} %")
    return 0
