"""Agent loops over shared system prompts: the host-tier replay's second workload.

Issue 31 asks for "shared system prompts plus agent loops that call tools and
come back". An agent session starts from one of a few shared system prompts
(instructions and tool descriptions) and runs `tasks_per_session` tasks, one after
another in the same context; a task is `calls_per_task` model calls:

    [system | task 1] -> call -> tool runs (~tool_time_s) -> [+ call + result] -> call
    -> ... -> answer -> the user thinks (~think_time_s) -> [+ answer + task 2] -> ...

so a request's prompt is the request before it + that request's output + the new
tokens (a tool's result, or the user's next task): a `Workload` of follow-ups that
the driver resolves as it replays a chat. Reuse comes back twice over: within a
task after a short tool call, between tasks after a long think, and every agent
reuses its system prompt. `kvswap.workload.synthetic` draws one think time and
one follow-up length per session, so this is a small generator of its own, keyed
like it (seed, purpose, session): the same spec gives the same workload.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvswap.workload.request import Workload
from kvswap.workload.synthetic import DraftTurn, in_arrival_order, jittered
from kvswap.workload.tokens import random_token_ids, seeded_rng


@dataclass(frozen=True)
class AgentSpec:
    """What to generate; lengths in tokens, times in seconds (means of exponentials),
    each length drawn from n * [1 - length_jitter, 1 + length_jitter]. The names
    `num_sessions`, `system_prompt_tokens`, `num_system_prompts` are SyntheticSpec's
    (the working-set measure reads them)."""

    num_sessions: int = 96
    tasks_per_session: int = 3
    calls_per_task: int = 3
    num_system_prompts: int = 3
    system_prompt_tokens: int = 192
    task_tokens: int = 48
    call_output_tokens: int = 16
    tool_result_tokens: int = 48
    tool_time_s: float = 2.0
    think_time_s: float = 30.0
    arrival_rate_per_s: float = 0.2
    length_jitter: float = 0.3
    vocab_size: int = 512
    seed: int = 0


def _session_calls(
    spec: AgentSpec, session_id: int, start_s: float, system_prompts: list[tuple[int, ...]]
) -> list[DraftTurn]:
    shape_rng = seeded_rng("agents", spec.seed, "shape", session_id)
    token_rng = seeded_rng("agents", spec.seed, "tokens", session_id)
    system_ids = system_prompts[shape_rng.randrange(spec.num_system_prompts)]
    calls: list[DraftTurn] = []
    arrival_s = start_s
    for task in range(spec.tasks_per_session):
        for call in range(spec.calls_per_task):
            if call == 0:  # a task from the user: after a think, except the first
                wait_s = 0.0 if task == 0 else shape_rng.expovariate(1.0 / spec.think_time_s)
                length = jittered(shape_rng, spec.task_tokens, spec.length_jitter, minimum=1)
            else:  # the last call's tool ran and its result comes back
                wait_s = shape_rng.expovariate(1.0 / spec.tool_time_s)
                length = jittered(shape_rng, spec.tool_result_tokens, spec.length_jitter, minimum=1)
            new_ids = random_token_ids(token_rng, length, spec.vocab_size)
            if not calls:
                new_ids = system_ids + new_ids
            arrival_s += wait_s
            output = jittered(shape_rng, spec.call_output_tokens, spec.length_jitter, minimum=1)
            # arrival_s is the earliest: as if every earlier call took no time.
            calls.append(DraftTurn(arrival_s, len(calls), session_id, new_ids, output, wait_s))
    return calls


def generate_agents(spec: AgentSpec) -> Workload:
    """The workload `spec` describes (deterministic in `spec`)."""
    system_prompts = [
        random_token_ids(
            seeded_rng("agents", spec.seed, "system", index),
            spec.system_prompt_tokens,
            spec.vocab_size,
        )
        for index in range(spec.num_system_prompts)
    ]
    arrivals_rng = seeded_rng("agents", spec.seed, "arrivals")
    calls: list[DraftTurn] = []
    start_s = 0.0
    for session_id in range(spec.num_sessions):
        calls.extend(_session_calls(spec, session_id, start_s, system_prompts))
        start_s += arrivals_rng.expovariate(spec.arrival_rate_per_s)
    name = f"agents(sessions={spec.num_sessions}, tasks={spec.tasks_per_session}, seed={spec.seed})"
    return Workload(requests=in_arrival_order(calls), name=name, vocab_size=spec.vocab_size)
