"""The reference engine, measured side by side in one run; every section checks it
exercised what it names before it reports a ratio.

  hf         vs transformers on the same checkpoint: prefill tok/s and decode ms/token
             of one long request; tok/s of concurrent requests vs `generate` (one padded
             batch) and `generate_batch` (continuous batching, paged)
  pressure   every request at once, KV 3x the GPU pool: preemptions by swap, bytes
             swapped, throughput and P99 TPOT vs an unlimited pool (and vs one running
             only as many at once as the small pool holds), swap-wait share
  recompute  swap vs recompute preemption at two context lengths, with a pool too
             small to keep preempted blocks (recomputed tokens reported, never 0)
  restore    a later turn's context restored from CPU / NVMe vs recomputed (TTFT)
  modes      exact mode (batch_invariant) vs the fast path: throughput, same outputs?

Prints each section's shapes and figures, goals beside the ratios; `--json` prints
one JSON object instead (tables go to stderr), `--out FILE` also writes it after
every section, so a run stopped part-way keeps what it measured. Exit status 1
when a section failed. Timings from a shared machine are noise: take final
figures on a quiet one.

    python benchmarks/engine.py --quick            # validation, minutes on 2 CPU cores
    python benchmarks/engine.py --device cuda --json --out engine.json
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import torch

from engine_hf import missing_reason, section_transformers
from engine_sections import section_modes, section_pressure, section_recompute, section_restore
from engine_support import Bench, Result, section_names, warm_up
from kvswap.commands.outputs import check_output_file
from kvswap.errors import KvSwapError
from machine import load_average, result_header

#: name -> (section, why it cannot run here or None); run in this order.
SECTIONS: dict[str, tuple[Callable[[Bench], Result], Callable[[], str | None]]] = {
    "hf": (section_transformers, missing_reason),
    "pressure": (section_pressure, lambda: None),
    "recompute": (section_recompute, lambda: None),
    "restore": (section_restore, lambda: None),
    "modes": (section_modes, lambda: None),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="small shapes, for validation")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset")
    parser.add_argument("--model", default="small", help="engine model of all but `hf`")
    default_threads = os.cpu_count() or 1  # the engine's own default on a CPU
    parser.add_argument("--threads", type=int, default=default_threads,
                        help=f"torch threads, both sides ({default_threads})")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", metavar="FILE", help="also write the JSON object here")
    args = parser.parse_args(argv)
    names = section_names(args.sections, SECTIONS)
    check_output_file(args.out, "--out")  # before minutes of runs, not after
    if args.threads < 1:
        raise KvSwapError(f"--threads {args.threads}: allowed: >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise KvSwapError("--device cuda but CUDA is not available here; use --device cpu")
    args.names = names
    return args


def render(name: str, result: Result, seconds: float, stream: TextIO) -> None:
    print(f"[{name}] ({seconds:.0f} s)", file=stream)
    for key, value in result.shapes.items():
        print(f"  shape  {key:<38} {value}", file=stream)
    for key, value in result.figures.items():
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        goal = result.goals.get(key)
        verdict = ""
        if goal is not None:
            verdict = f"goal {goal}: {'met' if goal.met(value) else 'NOT met'}"
        print(f"  {key:<45} {shown:>12}  {verdict}", file=stream, flush=True)


def to_json(report: dict[str, Any]) -> str:
    """Strict JSON: a ratio of nothing (NaN) is written as null."""

    def finite(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {key: finite(item) for key, item in value.items()}
        if isinstance(value, list):
            return [finite(item) for item in value]
        return value

    return json.dumps(finite(report), indent=1, allow_nan=False)


def record_failure(report: dict[str, Any], name: str, error: Exception) -> None:
    """A section (or the warm-up) that broke: loud, recorded, never a figure."""
    print(f"[{name}] FAILED: {error}", file=sys.stderr, flush=True)
    report["failed"][name] = f"{type(error).__name__}: {error}"


def run_section(
    report: dict[str, Any],
    name: str,
    section: Callable[[], Result],
    stream: TextIO,
    out: str | None,
) -> None:
    """Run one section into `report`; a failure is recorded and the caller goes on.
    With `out`, the report so far is rewritten after the section (a cut run keeps it)."""
    start_s = time.perf_counter()
    try:
        result = section()
    except Exception as error:
        # Loud, and the other sections still run: a benchmark that did not exercise
        # what it names (NotExercised) or broke is a failed section, never a figure.
        if not isinstance(error, KvSwapError):
            traceback.print_exc()
        record_failure(report, name, error)
    else:
        seconds = time.perf_counter() - start_s
        render(name, result, seconds, stream)
        report["sections"][name] = {"seconds": round(seconds, 1), **result.to_json()}
    if "machine" in report:  # the load while it ran, not only before
        report["machine"]["load_average_1_5_15"] = load_average()
    if out:
        Path(out).write_text(to_json(report) + "\n")


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except KvSwapError as error:
        print(f"engine.py: error: {error}", file=sys.stderr)
        return 2
    stream = sys.stderr if args.json else sys.stdout
    bench = Bench(args.model, args.device, args.threads, args.quick)
    report: dict[str, Any] = {
        **result_header("engine", "engine.py", argv),
        "device": args.device, "quick": args.quick, "model": args.model,
        "torch": torch.__version__, "torch_threads": args.threads,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "sections": {}, "skipped": {}, "failed": {},
    }  # fmt: skip
    try:
        warm_up(bench)
    except Exception as error:  # every section would meet it again: record it once here
        record_failure(report, "warm_up", error)
    for name in args.names:
        section, reason = SECTIONS[name]
        why_not = reason()
        if why_not is not None:
            print(f"[{name}] skipped: {why_not}", file=stream, flush=True)
            report["skipped"][name] = why_not
            continue
        run_section(report, name, functools.partial(section, bench), stream, args.out)
    if args.json:
        print(to_json(report))
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
