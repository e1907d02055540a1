"""`kvswap simulate`: the engine's control plane on a hardware model and a virtual clock.

One engine by default (the output of `kvswap run --json` plus the simulator's
keys). With `--engines N` the workload's sessions are split over N engines
(`--route`), interleaved on their clocks; `--shared-remote-gib X` (or
`tiers.remote_url` in the config: then the store is unbounded) gives them one
modelled shared store, and `--compare-remote` runs the same engines without it
too and prints the ratios: what a shared tier saves for N engines.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
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
from kvswap.obs.progress import ProgressBar
from kvswap.obs.wiring import add_monitoring_arguments, build_monitoring
from kvswap.sim.hardware import (
    HARDWARE_NAMES,
    HardwareProfile,
    describe_hardware,
    describe_remote_link,
    hardware_from_bench,
    hardware_preset,
    with_remote_link,
)
from kvswap.sim.hit_rate import DEFAULT_CAPACITIES_TOKENS, hit_rate_curve, parse_capacities_tokens
from kvswap.sim.multi import MAX_ENGINES, compare_remote, simulate_engines
from kvswap.sim.multi_render import render_engines, render_store
from kvswap.sim.remote_store import SharedRemoteStore
from kvswap.sim.routing import ROUTE_NAMES, Route, parse_route
from kvswap.sim.simulator import SimOptions, Simulator
from kvswap.sim.trace import load_trace_workload
from kvswap.units import GIB, format_bytes, gib_to_bytes
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
    add_engine_arguments(parser)
    add_monitoring_arguments(parser)
    parser.set_defaults(handler=run)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("several engines and a shared remote store")
    group.add_argument(
        "--engines", type=int, default=1, metavar="N",
        help="split the workload's sessions over N simulated engines, each with its own "
        f"control plane, copy engine and clock (default 1; at most {MAX_ENGINES})",
    )  # fmt: skip
    group.add_argument(
        "--route", default=None, metavar="NAME",
        help=f"{' or '.join(ROUTE_NAMES)} (default round-robin): a session's engine; hash: "
        "of its first KV block's tokens, so equal first blocks meet on one engine",
    )  # fmt: skip
    group.add_argument(
        "--shared-remote-gib", type=float, default=None, metavar="GIB",
        help="model one remote store of GIB GiB (LRU eviction, tiers.remote_ttl_s) shared by "
        "every engine; without it, tiers.remote_url models an unbounded one (the simulator "
        "never connects)",
    )  # fmt: skip
    group.add_argument(
        "--compare-remote", action="store_true",
        help="also run the same engines without the shared store; print both and the ratios",
    )  # fmt: skip
    group.add_argument(
        "--remote-gb-per-s", type=float, default=None, metavar="X",
        help="the remote link's bandwidth per direction (default 2.5, a 25 GbE-class NIC)",
    )  # fmt: skip
    group.add_argument(
        "--remote-rtt-ms", type=float, default=None, metavar="MS",
        help="the remote link's round trip per chunk and per lookup (default 0.2)",
    )  # fmt: skip


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


@dataclass(frozen=True)
class Fleet:
    """How many engines, how they are routed, and the shared store (if any)."""

    num_engines: int
    route: Route
    store_capacity_bytes: int | None  # None: unbounded
    has_store: bool
    compare: bool

    @property
    def is_single(self) -> bool:
        """Today's one-engine run (with or without a store): the full summary."""
        return self.num_engines == 1 and not self.compare

    def new_store(self, config: KvSwapConfig) -> SharedRemoteStore | None:
        if not self.has_store:
            return None
        return SharedRemoteStore(self.store_capacity_bytes, ttl_s=config.tiers.remote_ttl_s)


def fleet_from_args(args: argparse.Namespace, config: KvSwapConfig, block_bytes: int) -> Fleet:
    """The engine flags, checked (one line per mistake)."""
    num_engines = args.engines
    if not 1 <= num_engines <= MAX_ENGINES:
        raise KvSwapError(f"--engines {num_engines}: allowed: 1..{MAX_ENGINES}")
    if args.route is not None and num_engines == 1:
        raise KvSwapError("--route chooses among engines: give --engines N (N >= 2) with it")
    route = parse_route(args.route) if args.route is not None else Route.ROUND_ROBIN
    capacity_bytes = None
    if args.shared_remote_gib is not None:
        capacity_bytes = gib_to_bytes(args.shared_remote_gib, "--shared-remote-gib")
        if capacity_bytes < block_bytes:
            raise KvSwapError(
                f"--shared-remote-gib {args.shared_remote_gib} holds no KV block of "
                f"{format_bytes(block_bytes)}; allowed: at least {block_bytes / GIB:.6g} GiB"
            )
    has_store = capacity_bytes is not None or config.tiers.remote_url is not None
    for flag, value in (("--remote-gb-per-s", args.remote_gb_per_s),
                        ("--remote-rtt-ms", args.remote_rtt_ms),
                        ("--compare-remote", args.compare_remote or None)):  # fmt: skip
        if value is not None and not has_store:
            raise KvSwapError(
                f"{flag} is about the shared remote store: give --shared-remote-gib GIB "
                "(or tiers.remote_url) with it"
            )
    fleet = Fleet(num_engines, route, capacity_bytes, has_store, bool(args.compare_remote))
    if not fleet.is_single:
        for flag, given in (("--report", args.report), ("--timeseries", args.timeseries),
                            ("--metrics-port", args.metrics_port)):  # fmt: skip
            if given is not None:
                raise KvSwapError(
                    f"{flag} follows one engine's control plane: drop it, or run one engine "
                    "without --compare-remote"
                )
    return fleet


def run(args: argparse.Namespace) -> int:
    if args.hit_rate_curve:
        return _hit_rate_curve(args)
    check_output_dir(args.report, "--report")
    check_output_file(args.timeseries, "--timeseries")
    check_workload_arguments(args)
    config, hardware = simulation_from_args(args)
    if config.tiers.secondary_tiers is not None:
        print(
            "kvswap: warning: secondary_tiers are not modelled (the simulator models the Redis "
            "store: --shared-remote-gib or tiers.remote_url); simulating without them",
            file=sys.stderr,
        )
    if args.remote_gb_per_s is not None or args.remote_rtt_ms is not None:
        hardware = with_remote_link(
            hardware, gb_per_s=args.remote_gb_per_s, rtt_ms=args.remote_rtt_ms
        )
    options = SimOptions(pinned_host=not args.pageable)
    simulator = Simulator(config, hardware, options=options)
    fleet = fleet_from_args(args, config, simulator.setup.block_bytes)
    if not fleet.is_single:
        return _run_engines(args, config, hardware, fleet, sim_workload(args))
    store = fleet.new_store(config)
    if store is not None:
        simulator = Simulator(config, hardware, options=options, remote_store=store)
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
        summary = result.to_json()
        if store is not None:
            summary |= {"shared_remote_store": store.to_json(), **remote_link_json(hardware)}
        summary = monitoring.finish(summary)
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


def _run_engines(
    args: argparse.Namespace,
    config: KvSwapConfig,
    hardware: HardwareProfile,
    fleet: Fleet,
    workload: Workload,
) -> int:
    """N engines (with the shared store when there is one; with --compare-remote, again
    without it): per-engine and combined summaries, and the ratios."""
    options = SimOptions(pinned_host=not args.pageable)
    talk = not (args.json or args.quiet)
    if talk:
        print(describe(Simulator(config, hardware, options=options), workload))
        print(describe_fleet(fleet, hardware))
    passes = [fleet.new_store(config)] + ([None] if fleet.compare else [])
    results = []
    for store in passes:
        label = (
            "requests"
            if not fleet.compare
            else "requests, " + ("no store" if store is None else "shared store")
        )
        with ProgressBar(label, enabled=talk) as bar:
            run = simulate_engines(
                config, hardware, workload, num_engines=fleet.num_engines, route=fleet.route,
                store=store, options=options, progress=bar.update,
            )  # fmt: skip
            results.append(run)
    out: dict[str, object] = {"hardware": hardware.name, "workload": workload.name,
                              "requests": len(workload), **results[0].to_json()}  # fmt: skip
    if fleet.has_store:
        out |= remote_link_json(hardware)
    if fleet.compare:
        without = results[1].combined()
        out["without_remote"] = without
        out["remote_vs_without"] = compare_remote(results[0].combined(), without)
    print(json.dumps(out, indent=2) if args.json else render_engines(out))
    return 0


def remote_link_json(hardware: HardwareProfile) -> dict[str, object]:
    """The modelled remote link, as the summaries name it."""
    return {"remote_link": {"gb_per_s": hardware.remote_gb_per_s, "rtt_ms": hardware.remote_rtt_ms}}


def describe_fleet(fleet: Fleet, hardware: HardwareProfile) -> str:
    engines = f"{fleet.num_engines} engine(s), {fleet.route.value} by session"
    if not fleet.has_store:
        return f"{engines}; no shared remote store"
    capacity = fleet.store_capacity_bytes
    size = "unbounded" if capacity is None else format_bytes(capacity)
    return f"{engines}; shared remote store {size}, {describe_remote_link(hardware)}"


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
    text = render(summary) + "\n" + "\n".join(f"{label:<20}  {value}" for label, value in extra)
    if "shared_remote_store" in summary:
        text += "\n" + render_store(summary["shared_remote_store"])
    return text


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
