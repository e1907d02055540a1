"""`kvswap run`: serve a workload on the reference engine over the tiered store."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from kvswap.commands.common import add_config_arguments, config_from_args
from kvswap.commands.outputs import check_output_dir
from kvswap.config import KvSwapConfig
from kvswap.engine.engine import Engine
from kvswap.engine.settings import EngineOptions, engine_settings
from kvswap.errors import KvSwapError
from kvswap.model.choice import ENGINE_DTYPES, ConfiguredModel, ModelChoice, choose_engine_model
from kvswap.obs.wiring import (
    add_monitoring_arguments,
    build_monitoring,
    check_monitoring_arguments,
)
from kvswap.sampling import sampling_or_greedy
from kvswap.units import format_bytes
from kvswap.workload.mooncake import load_mooncake_trace
from kvswap.workload.request import Workload
from kvswap.workload.synthetic import SyntheticSpec, generate_synthetic

#: The engine's model when neither --model nor [model] preset names one.
DEFAULT_RUN_MODEL = "small"

#: The demo: 8 two-turn sessions sharing a system prompt, whose KV at its peak
#: is 4x the 30-block device pool; the pinned CPU pool absorbs the rest.
RUN_DEFAULTS: dict[str, object] = {
    "gpu_kv_capacity_blocks": 30,
    "cpu_kv_capacity_blocks": 256,
    "protected_sink_blocks": 2,
    "max_num_seqs": 8,
}


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "run",
        help="serve a synthetic or trace workload on the reference engine",
        description="Run a Llama-family model over the tiered KV store and report throughput, "
        "latency percentiles, swap traffic and stalls. Default: the built-in `small` model on a "
        "multi-turn workload whose KV demand is 4x the device pool.",
    )
    parser.add_argument(
        "--model", default=None,
        help="preset (tiny, small) or checkpoint dir (default: [model] preset, else small)",
    )  # fmt: skip
    parser.add_argument(
        "--dtype", choices=ENGINE_DTYPES, default=None,
        help="weights and KV dtype (default: [model] dtype, else the checkpoint's)",
    )  # fmt: skip
    add_workload_arguments(parser)
    parser.add_argument("--temperature", type=float, default=None, help="sample (default greedy)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or live panel")
    add_monitoring_arguments(parser, linger=True)
    add_config_arguments(parser, ("cache", "swap", "tiers", "engine"))
    parser.set_defaults(handler=run)


#: Workload flags that shape only a synthetic workload, and only a trace's.
SYNTHETIC_ONLY = ("num_sessions", "turns", "prompt_tokens", "output_tokens", "user_tokens",
                  "system_prompt_tokens", "arrival_rate", "think_time_s")  # fmt: skip
TRACE_ONLY = ("time_scale", "length_scale")
_GIVEN = "given_workload_flags"  # the namespace attribute `_Given` fills


class _Given(argparse.Action):
    """Store the value and note that the user gave the flag (a value equal to the
    default is given too): a flag that cannot apply is refused, not ignored."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        given = getattr(namespace, _GIVEN, None)
        setattr(namespace, _GIVEN, (*(given or ()), self.dest))


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload (synthetic unless --trace)")
    group.add_argument(
        "--num-sessions", type=int, default=8, metavar="N", action=_Given,
        help="conversations (default %(default)s)",
    )  # fmt: skip
    group.add_argument(
        "--turns", type=int, default=2, metavar="N", action=_Given,
        help="turns per conversation (default %(default)s)",
    )  # fmt: skip
    group.add_argument(
        "--prompt-tokens", type=int, default=160, metavar="N", action=_Given,
        help="first prompt's tokens after the system prompt (default %(default)s)",
    )  # fmt: skip
    group.add_argument(
        "--output-tokens", type=int, default=32, metavar="N", action=_Given,
        help="tokens generated per turn (default %(default)s)",
    )  # fmt: skip
    group.add_argument(
        "--user-tokens", type=int, default=32, action=_Given, help="new tokens per later turn"
    )
    group.add_argument(
        "--system-prompt-tokens", type=int, default=32, metavar="N", action=_Given,
        help="a system prompt every conversation shares (default %(default)s)",
    )  # fmt: skip
    group.add_argument(
        "--arrival-rate", type=float, default=math.inf, action=_Given, help="sessions per second"
    )
    group.add_argument(
        "--think-time-s", type=float, default=0.0, metavar="S", action=_Given,
        help="pause between a reply and the next turn (default %(default)s)",
    )  # fmt: skip
    group.add_argument(
        "--seed", type=int, default=0, metavar="N", help="the workload's seed (default %(default)s)"
    )
    group.add_argument("--trace", metavar="FILE", help="Mooncake-format JSONL trace")
    group.add_argument(
        "--time-scale", type=float, default=1.0, action=_Given, help="trace timestamps x this"
    )
    group.add_argument(
        "--length-scale", type=float, default=1.0, action=_Given, help="trace lengths x this"
    )
    group.add_argument(
        "--max-requests", type=int, default=None, metavar="N",
        help="stop after the first N requests (default: all)",
    )  # fmt: skip


def check_workload_arguments(args: argparse.Namespace) -> None:
    """The workload flags that no reader checks, before anything is built (trace or not)."""
    for name in ("time_scale", "length_scale"):
        value = getattr(args, name)
        if not math.isfinite(value) or value <= 0:
            raise KvSwapError(f"--{name.replace('_', '-')} = {value}: allowed: a finite number > 0")
    if args.max_requests is not None and args.max_requests < 1:
        raise KvSwapError(f"--max-requests {args.max_requests}: allowed: an integer >= 1")
    given = getattr(args, _GIVEN, None) or ()
    with_trace = args.trace is not None
    for name in SYNTHETIC_ONLY if with_trace else TRACE_ONLY:
        if name in given:
            flag = "--" + name.replace("_", "-")
            raise KvSwapError(
                f"{flag} shapes only a synthetic workload; with --trace the trace does "
                "(drop the flag)"
                if with_trace
                else f"{flag} applies only to --trace FILE; a synthetic workload is shaped by "
                "--num-sessions, --turns, --prompt-tokens, ..."
            )


def workload_from_args(args: argparse.Namespace, vocab_size: int) -> Workload:
    check_workload_arguments(args)
    if args.trace is not None:
        return load_mooncake_trace(
            args.trace,
            vocab_size=vocab_size,
            time_scale=args.time_scale,
            length_scale=args.length_scale,
            max_requests=args.max_requests,
        )
    workload = generate_synthetic(
        SyntheticSpec(
            num_sessions=args.num_sessions,
            turns_per_session=args.turns,
            prompt_tokens=args.prompt_tokens,
            output_tokens=args.output_tokens,
            user_tokens_per_turn=args.user_tokens,
            system_prompt_tokens=args.system_prompt_tokens,
            arrival_rate_per_s=args.arrival_rate,
            think_time_s=args.think_time_s,
            vocab_size=vocab_size,
            seed=args.seed,
        )
    )
    return workload if args.max_requests is None else workload.first(args.max_requests)


def engine_model(
    model_flag: str | None,
    dtype_flag: str | None,
    config: KvSwapConfig,
    default_model: str = DEFAULT_RUN_MODEL,
) -> ModelChoice:
    """The model and dtype to run (`kvswap.model.choice`): the flags, else what --config
    or KVSWAP_* set in [model], else `default_model`."""
    given = config.model.model_fields_set  # what a file or variable set, not the defaults
    section = config.model
    configured = ConfiguredModel(
        preset=section.preset if "preset" in given else None,
        hf_config=section.hf_config if "hf_config" in given else None,
        dtype=section.dtype if "dtype" in given else None,
    )
    return choose_engine_model(model_flag, dtype_flag, configured, default_model=default_model)


def run(args: argparse.Namespace) -> int:
    check_output_dir(args.report, "--report")
    check_workload_arguments(args)
    check_monitoring_arguments(args)
    config = config_from_args(args, RUN_DEFAULTS)
    model, dtype = engine_model(args.model, args.dtype, config)
    sampling = sampling_or_greedy(args.temperature, args.seed)
    with Engine(engine_settings(config, EngineOptions(model, dtype))) as engine:
        workload = workload_from_args(args, min(engine.arch.vocab_size, 32_000))
        if not args.json and not args.quiet:
            print(describe(engine, workload))
        run_info = {"command": "run", "model": model, "workload": workload.name,
                    "requests": len(workload)}  # fmt: skip
        with build_monitoring(
            args, config, block_bytes=engine.layout.block_bytes,
            kv_metrics=engine.swapper.metrics, remote_counters=engine.remote_counters,
            run_info=run_info,
            engine_model={"source": model, "dtype": engine.arch.dtype_name,
                          "device": str(engine.device)},
        ) as monitoring:  # fmt: skip
            result = engine.run(
                workload, monitoring.progress, monitoring.observers, sampling=sampling
            )
            summary = monitoring.finish(result.to_json())
            print(json.dumps(summary, indent=2) if args.json else render(summary), flush=True)
            monitoring.linger()  # the summary is out: a stop now loses nothing
    if monitoring.report_error is not None:
        raise monitoring.report_error  # after the summary: the result is never lost
    return 0


def describe(engine: Engine, workload: Workload) -> str:
    caps = engine.capacities
    block = engine.layout.block_bytes
    demand_tokens = max(
        (workload.resolved_prompt_tokens(r.request_id) + r.max_new_tokens for r in workload),
        default=0,
    )
    return (
        f"model {engine.model_name} on {engine.device.type}; blocks of "
        f"{engine.layout.block_tokens} tokens = {format_bytes(block)}\n"
        f"tiers: GPU {caps.num_gpu_blocks} blocks, CPU {caps.num_cpu_blocks} (pinned pool "
        f"{format_bytes(caps.num_cpu_blocks * block)}), NVMe {caps.num_nvme_blocks}\n"
        f"workload {workload.name}: {len(workload)} requests, "
        f"longest context {demand_tokens} tokens"
    )


def render(summary: dict[str, Any]) -> str:
    def pct(name: str) -> str:
        values = summary[name]
        return f"p50 {values['p50']:.1f}  p95 {values['p95']:.1f}  p99 {values['p99']:.1f}"

    rows = [
        ("requests completed", f"{summary['requests_completed']}"
         f" ({summary['requests_rejected']} rejected)"),
        ("tokens generated", str(summary["tokens_generated"])),
        ("duration", f"{summary['duration_s']:.2f} s"),
        ("throughput", f"{summary['throughput_tok_s']:.1f} tok/s"),
        ("TTFT ms", pct("ttft_ms")),
        ("TPOT ms", pct("tpot_ms")),
        ("token latency ms", pct("itl_ms")),
        ("swap-wait share", f"{100 * summary['swap_wait_share']:.2f} % of step time"),
        ("GPU -> CPU", f"{format_bytes(summary['bytes_gpu_to_cpu'])} "
         f"at {summary['gpu_to_cpu_gb_per_s']:.2f} GB/s"),
        ("CPU -> GPU", f"{format_bytes(summary['bytes_cpu_to_gpu'])} "
         f"at {summary['cpu_to_gpu_gb_per_s']:.2f} GB/s"),
        ("CPU -> NVMe / back", f"{format_bytes(summary['bytes_cpu_to_nvme'])} / "
         f"{format_bytes(summary['bytes_nvme_to_cpu'])}"),
        ("pinned pool peak", f"{100 * summary['pinned_pool_utilization_peak']:.1f} %"),
        ("sync stalls", str(summary["sync_stalls"])),
        ("preemptions", str(summary["preemptions"])),
        ("prefix hits (tokens)",
         ", ".join(f"{k} {v}" for k, v in summary["prefix_hit_tokens"].items())),
        ("recomputed tokens", str(summary["recomputed_tokens"])),
        ("outputs digest", str(summary["outputs_digest"])[:16]),
    ]  # fmt: skip
    width = max(len(label) for label, _ in rows)
    lines = [f"{label:<{width}}  {value}" for label, value in rows]
    lines += [f"rejected request {r['request_id']}: {r['reason']}" for r in summary["rejections"]]
    findings = summary.get("diagnosis", [])
    lines += [f"diagnosis: {f['symptom']} ({f['figure']}); {f['advice']}" for f in findings]
    if not findings:
        lines.append(
            "diagnosis: no warning sign (swap-wait, link, latency, latency tail, pinned pool, "
            "remote fetches, refused requests, remote outages)"
        )
    return "\n".join(lines)
