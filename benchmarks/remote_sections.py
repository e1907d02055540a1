"""The engine with the remote tier on a real store: a later turn's TTFT, a second process.

Every run is a fresh `Engine` (engine_support.serve) in exact mode, so the runs
of one comparison must generate the same ids; each section checks that the run
under test did what it names (hits on the tier it names, bytes from the store)
before it reports a ratio. The store is emptied (FLUSHDB) before each section:
what a run finds there was written by a run of the same section.
"""

from __future__ import annotations

import random
from typing import Any

import redis

from engine_support import (
    Bench,
    Goal,
    Result,
    blocks_for,
    explicit_requests,
    model_vocab,
    ratio,
    require,
    serve,
)
from kvswap.workload.request import FollowUp, Request, Workload

#: Settings of every run here: the exact mode (outputs comparable id for id), and a
#: store that must answer (a tier silently off would make a comparison of nothing).
EXACT: dict[str, object] = {"batch_invariant": True}
#: Per-command timeout of the store: generous, so a loaded machine times nothing out
#: (a timed-out fetch is recomputed, and the section would not measure the store).
REMOTE_TIMEOUT_MS = 2_000.0
#: Output tokens of turn 1 and of the later turn; new user tokens of the later turn.
TURN_OUTPUT_TOKENS = 4
FOLLOW_UP_IDS = (5, 6, 7, 8, 9, 10, 11, 12)


def empty_store(url: str) -> None:
    with redis.Redis.from_url(url) as client:
        client.flushdb()


def with_tier(url: str) -> dict[str, object]:
    return {"remote_url": url, "remote_required": True, "remote_timeout_ms": REMOTE_TIMEOUT_MS}


def _ids(count: int, stride: int, vocab: int) -> tuple[int, ...]:
    """Deterministic token ids in 1..vocab-1 (no two strides give the same run)."""
    return tuple((i * stride) % (vocab - 1) + 1 for i in range(count))


def _later_turn_ttft_ms(summary: Any, request_id: int) -> float:
    return round(float(summary["ttft_ms_by_request"][request_id]), 3)


def section_ttft(bench: Bench, url: str) -> Result:
    """The later turn of a long conversation, its turn 1's KV (a) nowhere: recomputed,
    (b) in the pinned CPU pool (another conversation took the GPU in between, as in
    the engine benchmark's `restore`), (c) in the store only: a new engine with the
    same pools, after a first engine served turn 1 and wrote it there (its run ends
    by flushing the writes). (a) and (c) serve the later turn as one request with its
    whole prompt: turn 1's prompt + the output that first engine generated (which (b)
    must generate too) + the new tokens. One sample each: TTFT is one prefill."""
    empty_store(url)
    context = 256 if bench.quick else 2048
    vocab = model_vocab(bench.model)
    first = _ids(context, 7919, vocab)
    filler = _ids(context, 104_729, vocab)
    blocks = blocks_for(context) + 4
    pools: dict[str, object] = {
        "max_num_seqs": 1, "gpu_kv_capacity_blocks": blocks + 2,
        "cpu_kv_capacity_blocks": 4 * blocks, **EXACT,
    }  # fmt: skip
    conversation = Workload(
        (
            Request(0, 0.0, first, TURN_OUTPUT_TOKENS, session_id=0),
            Request(1, 0.0, filler, TURN_OUTPUT_TOKENS, session_id=1),
            Request(2, 0.0, (), TURN_OUTPUT_TOKENS, session_id=0, turn=1,
                    follow_up=FollowUp(0, FOLLOW_UP_IDS, 0.0)),
        ),
        "remote-ttft-conversation",
        vocab,
    )  # fmt: skip
    # The one run not timed goes first: what a section's first run pays, it pays.
    turn_1 = Workload((Request(0, 0.0, first, TURN_OUTPUT_TOKENS),), "remote-ttft-turn-1", vocab)
    writer = serve(bench, turn_1, **pools, **with_tier(url))
    turn_1_output = tuple(writer["outputs_by_request"][0])
    later = (*first, *turn_1_output, *FOLLOW_UP_IDS)
    later_turn = Workload(
        (Request(0, 0.0, later, TURN_OUTPUT_TOKENS),), "remote-ttft-later-turn", vocab
    )
    from_cpu = serve(bench, conversation, **pools)
    recomputed = serve(bench, later_turn, **pools)
    from_remote = serve(bench, later_turn, **pools, **with_tier(url))

    require(sum(recomputed["prefix_hit_tokens"].values()) == 0, "(a) the recomputed run hit")
    require(from_cpu["prefix_hit_tokens"]["cpu"] > 0, "(b) the later turn hit nothing on the CPU")
    require(writer["remote"]["bytes_to_remote"] > 0, "(c) the first engine wrote nothing")
    require(from_remote["prefix_hit_tokens"]["remote"] > 0, "(c) the later turn missed the store")
    require(from_remote["remote"]["bytes_from_remote"] > 0, "(c) nothing came from the store")
    ttft_recompute = _later_turn_ttft_ms(recomputed, 0)
    ttft_cpu = _later_turn_ttft_ms(from_cpu, 2)
    ttft_remote = _later_turn_ttft_ms(from_remote, 0)
    later_outputs = (
        from_cpu["outputs_by_request"][2],
        recomputed["outputs_by_request"][0],
        from_remote["outputs_by_request"][0],
    )
    figures: dict[str, object] = {
        "ttft_ms_recompute": ttft_recompute,
        "ttft_ms_from_cpu": ttft_cpu,
        "ttft_ms_from_remote": ttft_remote,
        "ttft_ratio_remote_vs_recompute": ratio(ttft_remote, ttft_recompute),
        "ttft_ratio_remote_vs_cpu": ratio(ttft_remote, ttft_cpu),
        "prefix_hit_tokens_cpu": from_cpu["prefix_hit_tokens"]["cpu"],
        "prefix_hit_tokens_remote": from_remote["prefix_hit_tokens"]["remote"],
        "bytes_to_remote": writer["remote"]["bytes_to_remote"],
        "bytes_from_remote": from_remote["remote"]["bytes_from_remote"],
        "seconds_from_remote": from_remote["remote"]["seconds_from_remote"],
        "remote_fetch_failures": from_remote["remote"]["fetch_failures"],
        "recomputed_tokens_remote_run": from_remote["recomputed_tokens"],
        "outputs_identical": all(out == later_outputs[0] for out in later_outputs)
        and from_cpu["outputs_by_request"][0] == list(turn_1_output),
    }
    shapes: dict[str, object] = {
        "turn_1_prompt_tokens": context, "turn_output_tokens": TURN_OUTPUT_TOKENS,
        "later_turn_prompt_tokens": len(later), "block_bytes": from_cpu["block_bytes"],
        "remote_timeout_ms": REMOTE_TIMEOUT_MS, **pools,
    }  # fmt: skip
    return Result(shapes, figures, {"ttft_ratio_remote_vs_recompute": Goal("<=", 1.0)})


def shared_prompt_sessions(
    num: int,
    system_ids: tuple[int, ...],
    user_tokens: int,
    output_tokens: int,
    batch: int,
    vocab: int,
) -> Workload:
    """`num` sessions at t = 0, each `system_ids` + its own question (questions differ
    between batches: the prefix two batches share is the system prompt only)."""
    prompts = []
    for n in range(num):
        rng = random.Random(f"remote-second:{batch}:{n}")
        prompts.append([*system_ids, *(rng.randrange(1, vocab) for _ in range(user_tokens))])
    return explicit_requests(prompts, output_tokens, vocab)


def section_second(bench: Bench, url: str) -> Result:
    """Sessions over one long shared system prompt, all arriving at once: engine #1
    with the tier serves a batch of them (and fills the store); then new sessions,
    the same system prompt with other questions, are served by a fresh engine #2
    with the tier (a second process: the system prompt comes from the store) and by
    a fresh engine without it (each concurrent session computes the prompt)."""
    empty_store(url)
    num, system, output = (4, 128, 8) if bench.quick else (8, 1024, 32)
    user = 64
    vocab = model_vocab(bench.model)
    system_ids = _ids(system, 7919, vocab)
    first_batch = shared_prompt_sessions(num, system_ids, user, output, 0, vocab)
    workload = shared_prompt_sessions(num, system_ids, user, output, 1, vocab)
    per_seq_blocks = blocks_for(system + user + output) + 1
    pools: dict[str, object] = {
        "max_num_seqs": num, "gpu_kv_capacity_blocks": num * per_seq_blocks,
        "cpu_kv_capacity_blocks": num * per_seq_blocks, **EXACT,
    }  # fmt: skip
    first = serve(bench, first_batch, **pools, **with_tier(url))  # not timed: goes first
    without = serve(bench, workload, **pools)
    second = serve(bench, workload, **pools, **with_tier(url))

    require(first["remote"]["bytes_to_remote"] > 0, "engine #1 wrote nothing to the store")
    require(second["prefix_hit_tokens"]["remote"] > 0, "engine #2 hit nothing in the store")
    require(second["remote"]["bytes_from_remote"] > 0, "nothing came from the store to #2")
    require(
        second["prefix_hit_tokens"]["remote"] <= num * system,
        "engine #2 hit past the system prompt: the batches share more than it",
    )
    figures: dict[str, object] = {
        "throughput_ratio_with_vs_without": ratio(
            second["throughput_tok_s"], without["throughput_tok_s"]
        ),
        "ttft_p50_ratio_with_vs_without": ratio(
            second["ttft_ms"]["p50"], without["ttft_ms"]["p50"]
        ),
        "with_tier_throughput_tok_s": second["throughput_tok_s"],
        "without_tier_throughput_tok_s": without["throughput_tok_s"],
        "with_tier_ttft_p50_ms": second["ttft_ms"]["p50"],
        "without_tier_ttft_p50_ms": without["ttft_ms"]["p50"],
        "remote_hit_tokens": second["prefix_hit_tokens"]["remote"],
        "gpu_hit_tokens_with_tier": second["prefix_hit_tokens"]["gpu"],
        "gpu_hit_tokens_without_tier": without["prefix_hit_tokens"]["gpu"],
        # Sessions admitted together each compute (and write) the shared prompt; the
        # store already holds all but the first copy of each block.
        "bytes_to_remote_engine_1": first["remote"]["bytes_to_remote"],
        "already_present_engine_1": first["remote"]["already_present"],
        "bytes_from_remote_engine_2": second["remote"]["bytes_from_remote"],
        "remote_fetch_failures": second["remote"]["fetch_failures"],
        "outputs_identical": second["outputs_digest"] == without["outputs_digest"],
    }
    goals = {
        "throughput_ratio_with_vs_without": Goal(">=", 1.0),
        "ttft_p50_ratio_with_vs_without": Goal("<=", 1.0),
    }
    shapes: dict[str, object] = {
        "sessions": num, "system_prompt_tokens": system, "user_tokens": user,
        "output_tokens": output, "block_bytes": second["block_bytes"],
        "remote_timeout_ms": REMOTE_TIMEOUT_MS, **pools,
    }  # fmt: skip
    return Result(shapes, figures, goals)
