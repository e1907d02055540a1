"""The reference engine, measured side by side in one run.

1. Multi-turn sessions whose KV is 4x the device pool vs an unlimited pool
   (same workload, same batch limit): throughput ratio, P99 TPOT ratio,
   swap-wait share.
2. Swap vs recompute preemption at 2K-token contexts: throughput and P99 TPOT.
3. A later turn at 4K context restored from CPU / NVMe vs recomputed: TTFT ratio.
4. kvswap vs transformers `generate` on the same random-weight model and batch.

Prints a table per comparison, then one JSON line with every figure.
    python benchmarks/engine.py            # about 10 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from typing import Any

import torch

from kvswap.config import load_config
from kvswap.engine.engine import Engine, EngineOptions
from kvswap.workload.request import FollowUp, Request, Workload
from kvswap.workload.synthetic import SyntheticSpec, generate_synthetic

COMMON: dict[str, object] = {"kv_block_tokens": 16, "protected_sink_blocks": 2, "device": "cpu"}


def vocab_size(model: str) -> int:
    from pathlib import Path

    from kvswap.model.loader import PRESETS, read_checkpoint_config

    config = PRESETS.get(model) or read_checkpoint_config(Path(model))
    return min(config.vocab_size, 32000)


def serve(model: str, workload: Workload, **settings: object) -> dict[str, Any]:
    """Run the workload; the summary gains `ttft_ms_by_request` (from admission)."""
    config = load_config(environ={}, overrides={**COMMON, **settings})
    with Engine(config, EngineOptions(model=model)) as engine:
        summary = engine.run(workload).to_json()
        # From admission (queueing excluded) to the first token, per request.
        summary["ttft_ms_by_request"] = {
            seq_id: 1e3 * (run.first_token_s - run.admitted_s)
            for seq_id, run in engine.scheduler.runs.items()
            if run.first_token_s is not None and run.admitted_s is not None
        }
        return summary


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def demand_4x(model: str, sessions: int) -> dict[str, float]:
    """Multi-turn sessions whose KV, kept between turns for the next one, is 4x the
    GPU pool; two sequences run at a time in both runs, so the comparison prices
    the offload (idle sessions' KV on the CPU, restored on their next turn), not
    a smaller batch."""
    spec = SyntheticSpec(
        num_sessions=sessions, turns_per_session=3, prompt_tokens=160, output_tokens=32,
        user_tokens_per_turn=32, system_prompt_tokens=32, vocab_size=vocab_size(model), seed=1,
    )  # fmt: skip
    held_blocks = sessions * (160 + 2 * 32 + 3 * 32) // 16  # every session's KV at the end
    pool = held_blocks // 4
    running: dict[str, object] = {"max_num_seqs": 2}
    unlimited = serve(model, generate_synthetic(spec), gpu_kv_capacity_blocks=2 * held_blocks,
                      cpu_kv_capacity_blocks=0, **running)  # fmt: skip
    small = serve(model, generate_synthetic(spec), gpu_kv_capacity_blocks=pool,
                  cpu_kv_capacity_blocks=2 * held_blocks, **running)  # fmt: skip
    assert small["outputs_digest"] == unlimited["outputs_digest"], "offload changed the outputs"
    return {
        "held_kv_x_pool": held_blocks / pool,
        "throughput_ratio_4x_vs_unlimited": ratio(
            small["throughput_tok_s"], unlimited["throughput_tok_s"]
        ),
        "p99_tpot_ratio_4x_vs_unlimited": ratio(
            small["tpot_ms"]["p99"], unlimited["tpot_ms"]["p99"]
        ),
        "swap_wait_share_4x": small["swap_wait_share"],
        "throughput_tok_s_unlimited": unlimited["throughput_tok_s"],
        "throughput_tok_s_4x": small["throughput_tok_s"],
        "prefix_hit_tokens_cpu_4x": small["prefix_hit_tokens"]["cpu"],
        "preemptions_4x": small["preemptions"],
    }


def swap_vs_recompute(model: str, context_tokens: int) -> dict[str, float]:
    """Four long sequences growing in a pool that holds about two and a half: the
    newest is preempted, and its blocks must leave the GPU before it resumes."""
    output_tokens = 128
    spec = SyntheticSpec(
        num_sessions=4, turns_per_session=1, prompt_tokens=context_tokens,
        output_tokens=output_tokens, vocab_size=vocab_size(model), seed=2,
    )  # fmt: skip
    blocks = (context_tokens + output_tokens) // 16 + 1
    settings: dict[str, object] = {"gpu_kv_capacity_blocks": 5 * blocks // 2, "max_num_seqs": 4}
    swap = serve(model, generate_synthetic(spec), cpu_kv_capacity_blocks=4 * blocks, **settings)
    recompute = serve(model, generate_synthetic(spec), cpu_kv_capacity_blocks=0,
                      preemption="recompute", **settings)  # fmt: skip
    assert swap["outputs_digest"] == recompute["outputs_digest"]
    return {
        "context_tokens": context_tokens,
        "throughput_ratio_swap_vs_recompute": ratio(
            swap["throughput_tok_s"], recompute["throughput_tok_s"]
        ),
        "p99_tpot_ms_swap": swap["tpot_ms"]["p99"],
        "p99_tpot_ms_recompute": recompute["tpot_ms"]["p99"],
        "preemptions_swap": swap["preemptions"],
        "preemptions_recompute": recompute["preemptions"],
        "recomputed_tokens_recompute": recompute["recomputed_tokens"],
    }


def restore_vs_recompute(model: str, context_tokens: int) -> dict[str, float]:
    vocab = vocab_size(model)
    first = tuple((i * 7919) % (vocab - 1) + 1 for i in range(context_tokens))
    filler = tuple((i * 104_729) % (vocab - 1) + 1 for i in range(context_tokens))
    workload = Workload(
        (
            Request(0, 0.0, first, 4, session_id=0),
            Request(1, 0.0, filler, 4, session_id=1),
            Request(2, 0.0, (), 4, session_id=0, turn=1, follow_up=FollowUp(0, (5, 6, 7, 8), 0.0)),
        ),
        "restore",
        vocab,
    )
    blocks = context_tokens // 16 + 4
    one = {"max_num_seqs": 1, "gpu_kv_capacity_blocks": blocks + 2}
    recomputed = serve(model, workload, cpu_kv_capacity_blocks=0, **one)
    from_cpu = serve(model, workload, cpu_kv_capacity_blocks=4 * blocks, **one)
    with tempfile.TemporaryDirectory() as directory:
        from_nvme = serve(
            model, workload, cpu_kv_capacity_blocks=blocks, nvme_kv_capacity_blocks=4 * blocks,
            nvme_dir=directory, cpu_demote_high_watermark=0.5, cpu_demote_low_watermark=0.0, **one,
        )  # fmt: skip
    for summary in (from_cpu, from_nvme):
        assert summary["outputs_digest"] == recomputed["outputs_digest"]

    def turn2_ttft(summary: dict[str, Any]) -> float:
        return float(summary["ttft_ms_by_request"][2])

    return {
        "context_tokens": context_tokens,
        "ttft_ms_recompute": turn2_ttft(recomputed),
        "ttft_ms_from_cpu": turn2_ttft(from_cpu),
        "ttft_ms_from_nvme": turn2_ttft(from_nvme),
        "ttft_speedup_cpu_vs_recompute": ratio(turn2_ttft(recomputed), turn2_ttft(from_cpu)),
        "ttft_speedup_nvme_vs_recompute": ratio(turn2_ttft(recomputed), turn2_ttft(from_nvme)),
        "prefix_hit_tokens_cpu": from_cpu["prefix_hit_tokens"]["cpu"],
        "prefix_hit_tokens_nvme": from_nvme["prefix_hit_tokens"]["nvme"],
    }


def versus_transformers(
    model: str, batch: int, prompt_tokens: int, new_tokens: int
) -> dict[str, float]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvswap.model.loader import load_model

    ours, arch = load_model(model, None, torch.device("cpu"))
    hf_config = LlamaConfig(
        vocab_size=arch.vocab_size, hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size, num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads, num_key_value_heads=arch.num_kv_heads,
        head_dim=arch.head_dim, rms_norm_eps=arch.rms_norm_eps, rope_theta=arch.rope_theta,
        tie_word_embeddings=arch.tie_word_embeddings,
        max_position_embeddings=arch.max_position_tokens,
    )  # fmt: skip
    hf = LlamaForCausalLM(hf_config).eval()
    hf.load_state_dict(ours.state_dict(), strict=False)
    vocab = vocab_size(model)
    prompts = [
        [(s * 131 + i * 17) % (vocab - 1) + 1 for i in range(prompt_tokens)] for s in range(batch)
    ]
    with torch.inference_mode():
        start_s = time.perf_counter()
        hf.generate(torch.tensor(prompts), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                    do_sample=False, pad_token_id=0)  # fmt: skip
        hf_s = time.perf_counter() - start_s
    workload = Workload(
        tuple(Request(i, 0.0, tuple(p), new_tokens) for i, p in enumerate(prompts)), "hf", vocab
    )
    blocks = batch * ((prompt_tokens + new_tokens) // 16 + 2)
    summary = serve(model, workload, gpu_kv_capacity_blocks=blocks, cpu_kv_capacity_blocks=0,
                    max_num_seqs=batch, max_num_batched_tokens=batch * prompt_tokens)  # fmt: skip
    hf_tok_s = batch * new_tokens / hf_s
    return {
        "batch": batch,
        "transformers_tok_s": hf_tok_s,
        "kvswap_tok_s": summary["throughput_tok_s"],
        "kvswap_vs_transformers_tok_s": ratio(summary["throughput_tok_s"], hf_tok_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--swap-context", type=int, default=2048)
    parser.add_argument("--restore-context", type=int, default=4096)
    parser.add_argument("--skip", default="", help="comma-separated: demand,swap,restore,hf")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    report: dict[str, Any] = {"model": args.model, "torch_threads": torch.get_num_threads()}
    sections = [
        ("demand", lambda: demand_4x(args.model, args.sessions)),
        ("swap", lambda: swap_vs_recompute(args.model, args.swap_context)),
        ("restore", lambda: restore_vs_recompute(args.model, args.restore_context)),
        ("hf", lambda: versus_transformers(args.model, 8, 128, 32)),
    ]
    for name, section in sections:
        if name in skip:
            continue
        start_s = time.perf_counter()
        figures = section()
        print(f"[{name}] ({time.perf_counter() - start_s:.0f} s)")
        for key, value in figures.items():
            print(
                f"  {key:<40} {value:.3f}" if isinstance(value, float) else f"  {key:<40} {value}"
            )
        report.update(figures)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
