"""kvswap against transformers on the same checkpoint: one long request, then a batch.

The checkpoint is a random-weight Llama that transformers builds and saves
(safetensors, fp32) in a temporary directory; both sides load it from there.
Both sides get the same torch thread count, and each is run once untimed
before it is timed. Baselines: `generate` (one padded batch: every sequence
waits for the longest) and `generate_batch` (transformers' continuous
batching over a paged cache). transformers is a benchmark dependency
(`pip install -e '.[bench]'`); without it this section is skipped in one line.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import logging
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from engine_support import Bench, Goal, Result, blocks_for, explicit_requests, ratio, serve

INSTALL_HINT = "transformers is not installed; pip install -e '.[bench]' to compare with it"

#: The checkpoint's shape: the `small` preset's, untied; `--quick`: a quarter of it.
CHECKPOINTS: dict[bool, dict[str, int]] = {
    False: {"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12,
            "num_key_value_heads": 4, "intermediate_size": 2048, "vocab_size": 32000},
    True: {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 8000},
}  # fmt: skip
#: (long prompt, its new tokens, batch size, batch prompt, batch new tokens)
SHAPES: dict[bool, tuple[int, int, int, int, int]] = {
    False: (2048, 32, 16, 256, 32),
    True: (256, 16, 16, 64, 16),
}
#: Runs of each side in the batch comparison (alternating), medians reported.
BATCH_REPEATS = 3


def missing_reason() -> str | None:
    """Why the section cannot run here, or None."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return INSTALL_HINT
    return None


def section_transformers(bench: Bench) -> Result:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers: Any = importlib.import_module("transformers")  # untyped: Any

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    # Its psutil-less CPU memory report is logged as an error; it is not one here.
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    long_prompt, long_new, batch, batch_prompt, batch_new = SHAPES[bench.quick]
    checkpoint = CHECKPOINTS[bench.quick]
    vocab = checkpoint["vocab_size"]
    shapes: dict[str, object] = {
        "checkpoint": {**checkpoint, "dtype": "fp32"}, "torch_threads": bench.threads,
        "long_request": f"{long_prompt}+{long_new}",
        "batch": f"{batch} x {batch_prompt}+{batch_new}",
        "transformers": transformers.__version__,
    }  # fmt: skip
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(bench.threads)
    try:
        with tempfile.TemporaryDirectory() as directory:
            save_checkpoint(directory, checkpoint, max_positions=max(4096, 2 * long_prompt))
            hf = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
            hf = hf.to(bench.device).eval()
            ours = replace(bench, model=directory)
            figures = long_request(ours, hf, vocab, long_prompt, long_new)
            figures.update(batched(ours, hf, vocab, batch, batch_prompt, batch_new))
    finally:
        torch.set_num_threads(saved_threads)
    goals = {
        "prefill_speedup_vs_generate": Goal(">=", 1.0),
        "decode_speedup_vs_generate": Goal(">=", 1.0),
        "batch_speedup_vs_generate": Goal(">=", 1.5),
        "batch_speedup_vs_generate_batch": Goal(">=", 3.0),
    }
    return Result(shapes, figures, {k: g for k, g in goals.items() if k in figures})


def save_checkpoint(directory: str, checkpoint: dict[str, int], max_positions: int) -> None:
    """A random-weight Llama of this shape (seed 0), untied, saved by transformers as
    safetensors in fp32 into `directory`; no special tokens, so nothing ends early."""
    transformers: Any = importlib.import_module("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        **checkpoint, max_position_embeddings=max_positions, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(directory)


def prompts_for(num: int, num_tokens: int, vocab: int, seed: int) -> list[list[int]]:
    return [
        [(seed * 7919 + s * 131 + i * 17) % (vocab - 1) + 1 for i in range(num_tokens)]
        for s in range(num)
    ]


def timed(device: str, work: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds `work` takes, the device idle at both ends."""

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    sync()
    start_s = time.perf_counter()
    out = work()
    sync()
    return time.perf_counter() - start_s, out


class TokenClock:
    """A `generate` streamer that notes when each token arrives: `put` is called with
    the prompt first, then with every new token."""

    def __init__(self) -> None:
        self.times_s: list[float] = []

    def put(self, value: Any) -> None:
        self.times_s.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_generate(
    hf: Any, prompts: list[list[int]], num_new: int, streamer: TokenClock | None = None
) -> list[list[int]]:
    """Greedy `generate` over one batch of equal-length prompts, exactly `num_new` tokens."""
    ids = torch.tensor(prompts, device=hf.device)
    with torch.inference_mode():
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_new,
            min_new_tokens=num_new, do_sample=False, pad_token_id=0, streamer=streamer,
        )  # fmt: skip
    return [row[ids.shape[1] :] for row in out.tolist()]


def long_request(
    bench: Bench, hf: Any, vocab: int, prompt_tokens: int, num_new: int
) -> dict[str, object]:
    """Prefill rate and decode time per token of one request, on both sides, each from
    one run: prompt to first token, and the median gap between later tokens (P50
    TPOT), so neither side's figure is a difference of two noisy runs."""
    prompt = prompts_for(1, prompt_tokens, vocab, seed=1)
    hf_generate(hf, prompts_for(1, 32, vocab, seed=9), 2)  # untimed
    clock = TokenClock()
    _, hf_ids = timed(bench.device, lambda: hf_generate(hf, prompt, num_new, clock))
    arrivals_s = clock.times_s  # the prompt's put, then one per new token
    if len(arrivals_s) != num_new + 1:
        raise RuntimeError(f"generate streamed {len(arrivals_s) - 1} of {num_new} tokens")
    hf_prefill_tok_s = prompt_tokens / (arrivals_s[1] - arrivals_s[0])
    gaps_s = [later - earlier for earlier, later in itertools.pairwise(arrivals_s[1:])]
    hf_decode_ms = 1e3 * statistics.median(gaps_s)
    workload = explicit_requests(prompt, num_new, vocab)
    pool: dict[str, object] = {
        "gpu_kv_capacity_blocks": blocks_for(prompt_tokens + num_new) + 2,
        "cpu_kv_capacity_blocks": 0, "max_num_seqs": 1, "max_num_batched_tokens": prompt_tokens,
    }  # fmt: skip
    serve(bench, explicit_requests(prompts_for(1, 32, vocab, seed=9), 2, vocab), **pool)
    ours = serve(bench, workload, **pool)
    ours_prefill_tok_s = prompt_tokens / (1e-3 * ours["ttft_ms_by_request"][0])
    ours_decode_ms = ours["tpot_ms"]["p50"]
    return {
        "kvswap_prefill_tok_s": round(ours_prefill_tok_s, 1),
        "generate_prefill_tok_s": round(hf_prefill_tok_s, 1),
        "prefill_speedup_vs_generate": ratio(ours_prefill_tok_s, hf_prefill_tok_s),
        "kvswap_decode_ms_per_token": ours_decode_ms,
        "generate_decode_ms_per_token": round(hf_decode_ms, 3),
        "decode_speedup_vs_generate": ratio(hf_decode_ms, ours_decode_ms),
        "long_request_same_tokens": ours["outputs_by_request"][0] == hf_ids[0],
    }


def batched(
    bench: Bench, hf: Any, vocab: int, num: int, prompt_tokens: int, num_new: int
) -> dict[str, object]:
    """Tokens per second for `num` concurrent requests: ours and `generate` alternately,
    BATCH_REPEATS times each (medians: one run of either varied +-15 % on a shared
    machine), then `generate_batch` once."""
    prompts = prompts_for(num, prompt_tokens, vocab, seed=2)
    pool: dict[str, object] = {
        "gpu_kv_capacity_blocks": num * (blocks_for(prompt_tokens + num_new) + 1),
        "cpu_kv_capacity_blocks": 0, "max_num_seqs": num,
        "max_num_batched_tokens": num * prompt_tokens,
    }  # fmt: skip
    generate_runs_tok_s: list[float] = []
    ours_runs_tok_s: list[float] = []
    for _ in range(BATCH_REPEATS):
        generate_s, hf_ids = timed(bench.device, lambda: hf_generate(hf, prompts, num_new))
        generate_runs_tok_s.append(num * num_new / generate_s)
        ours = serve(bench, explicit_requests(prompts, num_new, vocab), **pool)
        ours_runs_tok_s.append(float(ours["throughput_tok_s"]))
    generate_tok_s = statistics.median(generate_runs_tok_s)
    ours_tok_s = statistics.median(ours_runs_tok_s)
    figures: dict[str, object] = {
        "kvswap_batch_tok_s": round(ours_tok_s, 3),
        "generate_batch_padded_tok_s": round(generate_tok_s, 3),
        "batch_speedup_vs_generate": ratio(ours_tok_s, generate_tok_s),
        "batch_runs_each": BATCH_REPEATS,
        "kvswap_batch_tok_s_runs": [round(x, 2) for x in ours_runs_tok_s],
        "generate_batch_padded_tok_s_runs": [round(x, 2) for x in generate_runs_tok_s],
        "batch_requests_same_tokens_as_generate": sum(
            ours["outputs_by_request"][i] == hf_ids[i] for i in range(num)
        ),
    }
    try:
        paged_tok_s = continuous_batching_tok_s(bench, hf, prompts, num_new)
    except Exception as error:  # a baseline API that changed between versions: say so
        figures["generate_batch_error"] = f"{type(error).__name__}: {error}"[:300]
        return figures
    figures["generate_batch_tok_s"] = round(paged_tok_s, 3)
    figures["batch_speedup_vs_generate_batch"] = ratio(ours_tok_s, paged_tok_s)
    return figures


def continuous_batching_tok_s(
    bench: Bench, hf: Any, prompts: list[list[int]], num_new: int
) -> float:
    """transformers' `generate_batch` (paged cache, continuous batching), sized for
    exactly these requests; timed on its second call, the first having warmed a
    persistent manager (CUDA graphs, compiled paths) that the second reuses."""
    transformers: Any = importlib.import_module("transformers")
    gen_config = transformers.GenerationConfig(
        max_new_tokens=num_new, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    options: dict[str, object] = {"generation_config": gen_config, "max_new_tokens": num_new}
    accepted_call = inspect.signature(hf.generate_batch).parameters
    config_type = getattr(transformers, "ContinuousBatchingConfig", None)
    if config_type is not None and "continuous_batching_config" in accepted_call:
        # Only the fields this version has; the page size stays its own default.
        accepted = inspect.signature(config_type).parameters
        default_page = accepted["page_size"].default if "page_size" in accepted else None
        page_tokens = default_page if isinstance(default_page, int) else 256
        wanted = {
            "num_blocks": len(prompts) * (math.ceil((len(prompts[0]) + num_new) / page_tokens) + 1),
            "max_batch_tokens": len(prompts) * len(prompts[0]),
            "max_requests_per_batch": len(prompts),
        }
        options["continuous_batching_config"] = config_type(
            **{k: v for k, v in wanted.items() if k in accepted}
        )
    warm = {"persistent_manager": True} if "persistent_manager" in accepted_call else {}
    hf.generate_batch(prompts, **options, **warm)  # untimed
    elapsed_s, outputs = timed(bench.device, lambda: hf.generate_batch(prompts, **options))
    if "persistent_manager" in accepted_call:
        hf.destroy_cached_continuous_batching_manager()
    num_tokens = sum(len(out.generated_tokens) for out in outputs.values())
    if num_tokens != len(prompts) * num_new:
        raise RuntimeError(f"generate_batch made {num_tokens} of {len(prompts) * num_new} tokens")
    return num_tokens / elapsed_s
