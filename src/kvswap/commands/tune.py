"""`kvswap tune`: walk the seed article's tuning order in the simulator, write the result."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvswap.commands.simulate import add_simulation_arguments, sim_workload, simulation_from_args
from kvswap.errors import KvSwapError
from kvswap.obs.progress import ProgressBar
from kvswap.sim.config_toml import config_to_toml
from kvswap.sim.setup import resolve_setup
from kvswap.sim.simulator import SimOptions
from kvswap.sim.tuner import TuneResult, tune

#: A lighter default workload than `simulate`'s: the tuner runs ~15 simulations.
TUNE_WORKLOAD_DEFAULTS: dict[str, object] = {"num_sessions": 32}


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "tune",
        help="tune watermark, swap-out chunk and prefetch streams in the simulator",
        description="Walk the seed article's tuning order one knob at a time in the "
        "simulator (block size fixed; high watermark from 0.95 down; swap-out chunk; "
        "prefetch streams), print each step, explain each choice and write the recommended "
        "configuration as TOML.",
    )
    add_simulation_arguments(parser)
    parser.set_defaults(**TUNE_WORKLOAD_DEFAULTS)
    parser.add_argument(
        "--out", metavar="FILE", default="kvswap-tuned.toml",
        help="where to write the recommended config (default kvswap-tuned.toml)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    config, hardware = simulation_from_args(args)  # an impossible config fails here
    workload = sim_workload(args)
    options = SimOptions(pinned_host=not args.pageable)
    bar = ProgressBar("tune", enabled=not (args.quiet or args.json))
    talk = not (args.quiet or args.json)

    def progress(done: int, total: int, line: str) -> None:
        bar.update(done, total)
        if talk:
            print(f"  [{done}/{total}] {line}", file=sys.stderr, flush=True)

    if talk:
        print(f"tuning on {hardware.name} with {workload.name} ({len(workload)} requests); "
              f"block size fixed at {config.cache.kv_block_tokens} tokens")  # fmt: skip
    result = tune(config, hardware, workload, options=options, progress=progress)
    setup = resolve_setup(result.config, hardware)
    header = [
        f"kvswap tune on {hardware.name}, workload {workload.name}",
        *(step.reason for step in result.steps),
    ]
    notes = {step.knob: "tuned" for step in result.steps}
    text = config_to_toml(result.config, setup.capacities, header=header, notes=notes)
    try:
        Path(args.out).write_text(text, encoding="utf-8")
    except OSError as error:
        raise KvSwapError(f"--out {args.out}: cannot write ({error.strerror})") from None
    if args.json:
        print(json.dumps(to_json(result, args.out), indent=2))
    else:
        print(render(result, args.out))
    return 0


def to_json(result: TuneResult, path: str) -> dict[str, object]:
    return {
        "baseline": result.baseline.__dict__,
        "steps": [
            {
                "knob": s.knob,
                "chosen": s.chosen,
                "reason": s.reason,
                "trials": [t.__dict__ for t in s.trials],
            }
            for s in result.steps
        ],
        "recommended": {step.knob: getattr(result.config.swap, step.knob) for step in result.steps},
        "config_path": path,
    }


def render(result: TuneResult, path: str) -> str:
    lines = [f"baseline: {result.baseline.line()}"]
    for number, step in enumerate(result.steps, start=2):
        lines.append(f"step {number}: {step.knob}")
        lines += [f"    {trial.line()}" for trial in step.trials]
        lines.append(f"  chosen: {step.reason}")
    swap = result.config.swap
    lines.append(
        f"recommended: swap_out_high_watermark = {swap.swap_out_high_watermark:g}, "
        f"swap_out_chunk_blocks = {swap.swap_out_chunk_blocks}, "
        f"prefetch_stream_count = {swap.prefetch_stream_count}; written to {path}"
    )
    return "\n".join(lines)
