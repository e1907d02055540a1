"""The engine against itself: offload under pressure, swap vs recompute, restore, modes.

Every comparison runs the same workload twice (or three times) in one process
and checks that the run under test did what the comparison names; the shapes
are printed with the figures.
"""

from __future__ import annotations

import tempfile

from engine_support import (
    BLOCK_TOKENS,
    Bench,
    Goal,
    Result,
    blocks_for,
    independent_requests,
    model_vocab,
    ratio,
    require,
    run_figures,
    serve,
)
from kvswap.workload.request import FollowUp, Request, Workload


def section_pressure(bench: Bench) -> Result:
    """Every request runs at once (one burst, `max_num_seqs` = all of them), and their
    KV at the end is 3x the GPU pool: sequences are preempted by swapping out and
    resumed from the pinned pool. Baselines: the same batch limit in a pool that
    holds everything (the goals), and in that pool only as many sequences at once
    as the small pool holds at full length (what the swapping itself costs)."""
    num, prompt, output = (8, 64, 64) if bench.quick else (16, 512, 256)
    demand_blocks = num * blocks_for(prompt + output)
    pool_blocks = demand_blocks // 3
    workload = independent_requests(num, prompt, output, model_vocab(bench.model), seed=1)
    limits: dict[str, object] = {"max_num_seqs": num}
    unlimited = serve(
        bench, workload, gpu_kv_capacity_blocks=demand_blocks + num, cpu_kv_capacity_blocks=0,
        **limits,
    )  # fmt: skip
    small = serve(
        bench, workload, gpu_kv_capacity_blocks=pool_blocks,
        cpu_kv_capacity_blocks=2 * demand_blocks, **limits,
    )  # fmt: skip
    # The batch the small pool holds at full length, in a pool that holds everything:
    # what running fewer at once costs, apart from what moving their KV costs.
    concurrency = max(1, pool_blocks // blocks_for(prompt + output))
    same_batch = serve(
        bench, workload, gpu_kv_capacity_blocks=demand_blocks + num, cpu_kv_capacity_blocks=0,
        max_num_seqs=concurrency,
    )  # fmt: skip
    require(small["preemptions"] > 0, "the small pool preempted no sequence")
    require(small["bytes_gpu_to_cpu"] > 0, "the small pool swapped nothing out")
    require(small["bytes_cpu_to_gpu"] > 0, "the small pool swapped nothing back in")
    shapes: dict[str, object] = {
        "requests": num, "prompt_tokens": prompt, "output_tokens": output,
        "kv_demand_blocks": demand_blocks, "gpu_pool_blocks": pool_blocks,
        "cpu_pool_blocks": 2 * demand_blocks, "max_num_seqs": num,
        "same_concurrency_max_num_seqs": concurrency,
    }  # fmt: skip
    figures: dict[str, object] = {
        "kv_demand_x_pool": ratio(demand_blocks, pool_blocks),
        "throughput_ratio_vs_unlimited": ratio(
            small["throughput_tok_s"], unlimited["throughput_tok_s"]
        ),
        "p99_tpot_ratio_vs_unlimited": ratio(small["tpot_ms"]["p99"], unlimited["tpot_ms"]["p99"]),
        "throughput_ratio_vs_same_concurrency": ratio(
            small["throughput_tok_s"], same_batch["throughput_tok_s"]
        ),
        "swap_wait_share": small["swap_wait_share"],
        "outputs_identical": small["outputs_digest"] == unlimited["outputs_digest"],
        **run_figures(small, "pressure_run"),
        **run_figures(unlimited, "unlimited_run"),
        "same_concurrency_run_throughput_tok_s": same_batch["throughput_tok_s"],
    }
    goals = {
        "throughput_ratio_vs_unlimited": Goal(">=", 0.9),
        "p99_tpot_ratio_vs_unlimited": Goal("<=", 1.25),
        "swap_wait_share": Goal("<=", 0.05),
    }
    return Result(shapes, figures, goals)


#: Free token slots left in each prompt's last block of the recompute section: more
#: than the steps its four prompts take to prefill, so none needs a block before all are.
HEADROOM_TOKENS = 8


def swap_vs_recompute(bench: Bench, context_tokens: int) -> Result:
    """Four sequences of about `context_tokens` (prompt + output) whose prompts fill the
    GPU pool but for one block. Each prompt leaves its last block HEADROOM_TOKENS
    short, so every prompt is computed before any sequence needs a new block; when
    they grow, the newest is preempted with its whole prompt computed. Swap moves
    its blocks to the CPU and back; recompute (no CPU tier) drops them: the pool
    stays past its high watermark, so the prefix cache cannot keep them, and its
    context is computed again when it resumes (at least half a prompt, or the
    section fails)."""
    output = 16 if bench.quick else 64
    num = 4
    prompt_blocks = blocks_for(context_tokens - output)
    prompt = prompt_blocks * BLOCK_TOKENS - HEADROOM_TOKENS
    pool_blocks = num * prompt_blocks + 1
    workload = independent_requests(num, prompt, output, model_vocab(bench.model), seed=2)
    limits: dict[str, object] = {
        "gpu_kv_capacity_blocks": pool_blocks, "max_num_seqs": num,
        "max_num_batched_tokens": 2048,
    }  # fmt: skip
    # Room on the CPU for the finished sequences' offloads and the preempted one.
    cpu_blocks = 2 * num * blocks_for(context_tokens)
    swap = serve(bench, workload, cpu_kv_capacity_blocks=cpu_blocks, **limits)
    recompute = serve(bench, workload, cpu_kv_capacity_blocks=0, preemption="recompute", **limits)
    require(swap["preemptions"] > 0, f"{context_tokens}: swap preempted no sequence")
    require(recompute["preemptions"] > 0, f"{context_tokens}: recompute preempted no sequence")
    require(
        recompute["recomputed_tokens"] >= prompt // 2,
        f"{context_tokens}: recompute preempted {recompute['preemptions']} times but recomputed "
        f"{recompute['recomputed_tokens']} tokens, under half a {prompt}-token prompt (the "
        "preempted blocks stayed in the GPU prefix cache, or it was preempted mid-prefill)",
    )
    shapes: dict[str, object] = {
        "sequences": num, "prompt_tokens": prompt, "output_tokens": output,
        "prompt_blocks": prompt_blocks, "swap_cpu_pool_blocks": cpu_blocks, **limits,
    }  # fmt: skip
    figures: dict[str, object] = {
        "throughput_ratio_swap_vs_recompute": ratio(
            swap["throughput_tok_s"], recompute["throughput_tok_s"]
        ),
        "p99_tpot_ratio_recompute_vs_swap": ratio(
            recompute["tpot_ms"]["p99"], swap["tpot_ms"]["p99"]
        ),
        "outputs_identical": swap["outputs_digest"] == recompute["outputs_digest"],
        **run_figures(swap, "swap_run"),
        **run_figures(recompute, "recompute_run"),
    }
    goals = {
        "throughput_ratio_swap_vs_recompute": Goal(">=", 1.0),
        "p99_tpot_ratio_recompute_vs_swap": Goal(">=", 1.0),
    }
    return Result(shapes, figures, goals)


def section_recompute(bench: Bench) -> Result:
    contexts = (256, 512) if bench.quick else (2048, 8192)
    merged = Result({"contexts_tokens": list(contexts)})
    for context in contexts:
        result = swap_vs_recompute(bench, context)
        merged.shapes[f"at_{context}"] = result.shapes
        merged.figures.update({f"{k}_at_{context}": v for k, v in result.figures.items()})
        merged.goals.update({f"{k}_at_{context}": g for k, g in result.goals.items()})
    return merged


def section_restore(bench: Bench) -> Result:
    """A later turn of a long conversation, after another conversation took the GPU:
    its context restored from the CPU / NVMe tier vs recomputed (TTFT)."""
    context = 256 if bench.quick else 4096
    vocab = model_vocab(bench.model)
    first = tuple((i * 7919) % (vocab - 1) + 1 for i in range(context))
    filler = tuple((i * 104_729) % (vocab - 1) + 1 for i in range(context))
    workload = Workload(
        (
            Request(0, 0.0, first, 4, session_id=0),
            Request(1, 0.0, filler, 4, session_id=1),
            Request(2, 0.0, (), 4, session_id=0, turn=1, follow_up=FollowUp(0, (5, 6, 7, 8), 0.0)),
        ),
        "restore",
        vocab,
    )
    blocks = blocks_for(context) + 4
    one: dict[str, object] = {"max_num_seqs": 1, "gpu_kv_capacity_blocks": blocks + 2}
    recomputed = serve(bench, workload, cpu_kv_capacity_blocks=0, **one)
    from_cpu = serve(bench, workload, cpu_kv_capacity_blocks=4 * blocks, **one)
    with tempfile.TemporaryDirectory() as directory:
        from_nvme = serve(
            bench, workload, cpu_kv_capacity_blocks=blocks, nvme_kv_capacity_blocks=4 * blocks,
            nvme_dir=directory, cpu_demote_high_watermark=0.5, cpu_demote_low_watermark=0.0, **one,
        )  # fmt: skip
    require(from_cpu["prefix_hit_tokens"]["cpu"] > 0, "the later turn hit nothing on the CPU")
    require(from_nvme["prefix_hit_tokens"]["nvme"] > 0, "the later turn hit nothing on NVMe")
    require(
        recomputed["prefix_hit_tokens"]["gpu"] < context // 2,
        "the baseline kept the first conversation on the GPU: it recomputed nothing",
    )

    def ttft_ms(summary: dict[str, object]) -> float:
        return float(summary["ttft_ms_by_request"][2])  # type: ignore[index]

    figures: dict[str, object] = {
        "ttft_ms_recompute": round(ttft_ms(recomputed), 3),
        "ttft_ms_from_cpu": round(ttft_ms(from_cpu), 3),
        "ttft_ms_from_nvme": round(ttft_ms(from_nvme), 3),
        "ttft_speedup_cpu_vs_recompute": ratio(ttft_ms(recomputed), ttft_ms(from_cpu)),
        "ttft_speedup_nvme_vs_recompute": ratio(ttft_ms(recomputed), ttft_ms(from_nvme)),
        "prefix_hit_tokens_cpu": from_cpu["prefix_hit_tokens"]["cpu"],
        "prefix_hit_tokens_nvme": from_nvme["prefix_hit_tokens"]["nvme"],
        "outputs_identical": from_cpu["outputs_digest"]
        == from_nvme["outputs_digest"]
        == recomputed["outputs_digest"],
    }
    goals = {
        "ttft_speedup_cpu_vs_recompute": Goal(">=", 5.0),
        "ttft_speedup_nvme_vs_recompute": Goal(">=", 5.0),
    }
    shapes: dict[str, object] = {
        "context_tokens": context,
        "gpu_pool_blocks": blocks + 2,
        "max_num_seqs": 1,
    }
    return Result(shapes, figures, goals)


def section_modes(bench: Bench) -> Result:
    """The exact mode (`batch_invariant` True: fixed tiles) against the fast path on
    the same batch; whether their outputs were identical is reported, not required."""
    num, prompt, output = (8, 64, 16) if bench.quick else (16, 256, 32)
    workload = independent_requests(num, prompt, output, model_vocab(bench.model), seed=3)
    pool: dict[str, object] = {
        "gpu_kv_capacity_blocks": num * (blocks_for(prompt + output) + 1),
        "cpu_kv_capacity_blocks": 0, "max_num_seqs": num,
        "max_num_batched_tokens": num * prompt,
    }  # fmt: skip
    exact = serve(bench, workload, batch_invariant=True, **pool)
    fast = serve(bench, workload, batch_invariant=False, **pool)
    figures: dict[str, object] = {
        "throughput_ratio_fast_vs_exact": ratio(
            fast["throughput_tok_s"], exact["throughput_tok_s"]
        ),
        "outputs_identical": fast["outputs_digest"] == exact["outputs_digest"],
        "exact_throughput_tok_s": exact["throughput_tok_s"],
        "fast_throughput_tok_s": fast["throughput_tok_s"],
        "exact_p99_tpot_ms": exact["tpot_ms"]["p99"],
        "fast_p99_tpot_ms": fast["tpot_ms"]["p99"],
        # What the engine says it ran (None: it does not report its mode).
        "exact_mode_reported": exact.get("batch_invariant"),
        "fast_mode_reported": fast.get("batch_invariant"),
    }
    shapes: dict[str, object] = {
        "requests": num,
        "prompt_tokens": prompt,
        "output_tokens": output,
        **pool,
    }
    return Result(shapes, figures, {"throughput_ratio_fast_vs_exact": Goal(">=", 1.0)})
