"""`kvswap tune`: walk the seed article's tuning order in the simulator, write the result."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvswap.commands.outputs import attempt_write, check_output_file, write_text_output
from kvswap.commands.run import check_workload_arguments
from kvswap.commands.simulate import add_simulation_arguments, sim_workload, simulation_from_args
from kvswap.errors import KvSwapError
from kvswap.obs.progress import ProgressBar
from kvswap.sim.config_toml import config_to_toml
from kvswap.sim.setup import resolve_setup
from kvswap.sim.simulator import SimOptions
from kvswap.sim.tuner import Trial, TuneResult, tune

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
        "--out", metavar="FILE", default=None,
        help="write the recommended config (TOML) to FILE; default: print it to stdout, "
        "with the log on stderr (so `kvswap tune ... > tuned.toml` captures the TOML)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.out is not None:
        check_output_file(args.out, "--out")  # before ~15 simulations, not after
    check_workload_arguments(args)
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
              f"block size fixed at {config.cache.kv_block_tokens} tokens",
              file=sys.stderr)  # fmt: skip
    result = tune(config, hardware, workload, options=options, progress=progress)
    if final_trial(result).throughput_tok_s <= 0:
        # Nothing completed: every candidate ties at zero, so a "recommendation" would be
        # the first candidate of each sweep dressed up as a measurement.
        raise KvSwapError(
            f"tune: 0 of {len(workload)} requests completed with the given config, so there is "
            "nothing to tune and no config was written; see why with `kvswap simulate` and "
            "the same flags (the tiers must fit the workload's requests)"
        )
    setup = resolve_setup(result.config, hardware)
    header = [
        f"kvswap tune on {hardware.name}, workload {workload.name}",
        *(step.reason for step in result.steps),
    ]
    notes = {step.knob: "tuned" for step in result.steps}
    text = config_to_toml(result.config, setup.capacities, header=header, notes=notes)
    path = args.out
    failure = None
    if path is not None:
        failure = attempt_write(lambda: write_text_output(path, text, "--out"), "--out", path)
    written = path if path is not None and failure is None else None
    if args.json:
        print(json.dumps(to_json(result, written) | {"config_toml": text}, indent=2))
    elif path is None:
        print(render(result, "stdout"), file=sys.stderr)
        print(text, end="" if text.endswith("\n") else "\n")
    else:
        print(render(result, written))
    if failure is not None:
        raise failure  # after the result: the tuning is printed even when the file fails
    return 0


def final_trial(result: TuneResult) -> Trial:
    """The measurement of the recommended config: the last sweep's pick, else the baseline."""
    if not result.steps:
        return result.baseline
    last = result.steps[-1]
    return next((t for t in last.trials if t.value == last.chosen), result.baseline)


def to_json(result: TuneResult, path: str | None) -> dict[str, object]:
    """The --json object; `config_path` is None when the file could not be written."""
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


def render(result: TuneResult, path: str | None) -> str:
    lines = [f"baseline: {result.baseline.line()}"]
    for number, step in enumerate(result.steps, start=2):
        lines.append(f"step {number}: {step.knob}")
        lines += [f"    {trial.line()}" for trial in step.trials]
        lines.append(f"  chosen: {step.reason}")
    swap = result.config.swap
    lines.append(
        f"recommended: swap_out_high_watermark = {swap.swap_out_high_watermark:g}, "
        f"swap_out_chunk_blocks = {swap.swap_out_chunk_blocks}, "
        f"prefetch_stream_count = {swap.prefetch_stream_count}; "
        + (f"written to {path}" if path is not None else "not written")
    )
    return "\n".join(lines)
