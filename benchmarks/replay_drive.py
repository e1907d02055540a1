"""The replay's clock: a workload through the modelled vLLM, as policy_hits.py drives the real one.

tests/vllm_scripts/policy_hits.py's driver, with `ReplayScheduler` for the engine:
a tick is an engine step that scheduled work (`step_s` virtual seconds); a
workload's seconds are read as ticks of `step_s`. A session's first request
arrives at its arrival tick; each later one arrives its think time after the one
before it FINISHED, its prompt resolved then (`resolve_prompt`: that prompt + its
output + the new tokens). With nothing in the engine the clock jumps to the next
arrival; a step that scheduled nothing (requests waiting on a load) takes no tick.

The model is absent: a request's output is `planned_output` (seeded by session,
turn), the same in every run, so every policy sees the same prompts
(`prompts_digest` proves it). Every SAMPLE_TICKS ticks it notes what the host tier
holds, by what its chunks are to the workload (policy_hits.py's `Holdings`).
"""

from __future__ import annotations

import hashlib
import heapq
import json
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.kv_offload.base import ReqContext

from kvswap.errors import KvSwapError
from kvswap.workload.request import Workload, resolve_prompt
from kvswap.workload.tokens import random_token_ids, seeded_rng
from replay_connector import ReplayConnector
from replay_request import ReplayRequest
from replay_scheduler import EngineShape, ReplayScheduler

SAMPLE_TICKS = 50
HELD_CLASSES = ("system", "thinking", "running", "done")
#: Steps in a row that schedule nothing before the replay calls itself stuck.
MAX_IDLE_STEPS = 1000


def planned_output(session_id: int, turn: int, num_tokens: int, vocab_size: int) -> tuple[int, ...]:
    """What the absent model "generates" for a turn: the same for every policy."""
    rng = seeded_rng("host-tier-replay", "output", session_id, turn)
    return random_token_ids(rng, num_tokens, vocab_size)


@dataclass
class Holdings:
    """What the host tier holds, sampled: a shared system prompt's chunks; a session's
    whose next request is to come ("thinking": reuse ahead); one in the engine now
    ("running"); one that has ended ("done": dead weight)."""

    system_tokens: int
    session_of: dict[int, int] = field(default_factory=dict)  # request id -> session
    state: dict[int, str] = field(default_factory=dict)  # session -> running | thinking | done
    totals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(HELD_CLASSES, 0))
    samples: int = 0

    def sample(self, connector: ReplayConnector) -> None:
        self.samples += 1
        policy = connector.manager._policy
        for key, (request_id, position) in connector.first_stored_by.items():
            if policy.get(key) is None:
                continue
            if position <= self.system_tokens:
                self.totals["system"] += 1
            else:
                self.totals[self.state[self.session_of[request_id]]] += 1

    def means(self) -> dict[str, float]:
        return {name: round(total / max(1, self.samples), 1) for name, total in self.totals.items()}


@dataclass
class DriveResult:
    records: list[dict[str, Any]]  # per request, in id order
    ticks: int
    steps: int
    preemptions: int
    device_evictions: int  # cached device blocks handed out again
    held_mean_chunks: dict[str, float]
    prompts_digest: str
    prompts: dict[int, tuple[int, ...]]  # each request's prompt, as resolved at its arrival


#: The replay's current tick, for a policy that reads the clock (replay_oracle.py).
NOW: list[int] = [0]


def drive(
    workload: Workload,
    shape: EngineShape,
    connector: ReplayConnector,
    step_s: float,
    system_tokens: int,
) -> DriveResult:
    """`workload` through a fresh `ReplayScheduler` over `connector` (module docstring)."""
    scheduler = ReplayScheduler(shape, connector)
    arrivals = [(round(r.arrival_s / step_s), r.request_id) for r in workload.first_arrivals()]
    heapq.heapify(arrivals)  # (tick, request id)
    prompts: dict[int, tuple[int, ...]] = {}
    outputs: dict[int, tuple[int, ...]] = {}
    records: dict[int, dict[str, Any]] = {}
    holdings = Holdings(system_tokens)
    tick = idle_steps = 0
    while len(outputs) < len(workload):
        while arrivals and arrivals[0][0] <= tick:
            arrival_tick, request_id = heapq.heappop(arrivals)
            request = workload[request_id]
            prompt = prompts[request_id] = resolve_prompt(request, outputs, prompts)
            if len(prompt) + request.max_new_tokens > shape.max_model_len:
                raise KvSwapError(
                    f"request {request_id}: {len(prompt)} prompt + {request.max_new_tokens} "
                    f"output tokens; allowed: at most max_model_len = {shape.max_model_len}"
                )
            session = request.session_id if request.session_id is not None else request_id
            scheduler.add(ReplayRequest(
                request_id=request_id, session_id=session, turn=request.turn, prompt=prompt,
                planned_output=planned_output(
                    session, request.turn, request.max_new_tokens, workload.vocab_size
                ),
                block_tokens=shape.block_tokens, context=ReqContext(req_id=str(request_id)),
            ))  # fmt: skip
            holdings.session_of[request_id] = session
            holdings.state[session] = "running"
            records[request_id] = {
                "session": session, "turn": request.turn, "prompt_tokens": len(prompt),
                "arrival_tick": arrival_tick,
            }  # fmt: skip
        if not scheduler.has_unfinished():
            tick = max(tick, arrivals[0][0])  # idle: jump to the next arrival
            continue
        NOW[0] = tick
        result = scheduler.step(tick)
        for done in result.finished:
            outputs[done.request_id] = done.output
            assert done.local_hit_tokens is not None and done.external_hit_tokens is not None
            records[done.request_id] |= {
                "output_tokens": len(done.output), "admitted_tick": done.admitted_tick,
                "finish_tick": tick, "local_cached_tokens": done.local_hit_tokens,
                "external_cached_tokens": done.external_hit_tokens,
                "cached_tokens": done.local_hit_tokens + done.external_hit_tokens,
                "preemptions": done.num_preemptions,
            }  # fmt: skip
            follows = workload.follow_ups_of(done.request_id)
            holdings.state[done.session_id] = "thinking" if follows else "done"
            for follow in follows:
                assert follow.follow_up is not None
                think_ticks = round(follow.follow_up.think_time_s / step_s)
                heapq.heappush(arrivals, (tick + think_ticks, follow.request_id))
        if result.scheduled_tokens:
            tick += 1
            idle_steps = 0
            if tick % SAMPLE_TICKS == 0:
                holdings.sample(connector)
            continue
        idle_steps += 1
        if idle_steps > MAX_IDLE_STEPS:
            raise KvSwapError(
                f"the replay scheduled nothing for {MAX_IDLE_STEPS} steps at tick {tick} "
                f"({len(scheduler.waiting) + len(scheduler.holding)} waiting): a request "
                f"cannot fit in {shape.device_blocks} device blocks"
            )
    # Every request finished: its blocks are back on the free queue, none lost or held.
    scheduler.pool.check_integrity()
    assert scheduler.pool.num_free_blocks() == shape.device_blocks
    digest = hashlib.sha256(json.dumps([prompts[i] for i in sorted(prompts)]).encode())
    return DriveResult(
        records=[records[i] for i in sorted(records)],
        ticks=tick,
        steps=scheduler.num_steps,
        preemptions=scheduler.num_preemptions,
        device_evictions=scheduler.pool.num_evicted_blocks,
        held_mean_chunks=holdings.means(),
        prompts_digest=digest.hexdigest()[:16],
        prompts=prompts,
    )
