"""Seeded Mooncake-format traces with conversation-style prefix sharing.

For tests and scale benchmarks when the real trace is not at hand; NOT the
Mooncake trace, only its format and its rough shape (about 12k requests an
hour, prompts averaging ~12k tokens, outputs of a few hundred tokens):

- a new conversation opens with one of a few shared system prompts
  (`system_prompt_blocks` hash blocks) followed by its own blocks;
- a follow-up turn extends a recent conversation: the previous prompt's full
  blocks, then new blocks for the previous answer and the new message.

Prompt lengths are log-normal around `mean_input_tokens`, capped at
`max_input_tokens`. Same spec, same trace.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from kvswap.errors import ConfigError
from kvswap.units import ceil_div
from kvswap.workload.bounds import (
    MAX_DURATION_S,
    MAX_HASH_IDS_PER_REQUEST,
    MAX_REQUEST_TOKENS,
    MAX_REQUESTS,
)
from kvswap.workload.mooncake import MOONCAKE_BLOCK_TOKENS, TraceRow

B = MOONCAKE_BLOCK_TOKENS


@dataclass(frozen=True)
class TraceSpec:
    num_requests: int = 12_000
    duration_s: float = 3600.0
    mean_input_tokens: int = 12_000
    max_input_tokens: int = 64_000
    mean_output_tokens: int = 343
    follow_up_probability: float = 0.5
    num_system_prompts: int = 8
    system_prompt_blocks: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        """One-line errors naming the field; sizes within the workload bounds."""
        counts = {
            "num_requests": (1, MAX_REQUESTS),
            "mean_input_tokens": (1, MAX_REQUEST_TOKENS),
            "max_input_tokens": (1, MAX_REQUEST_TOKENS),
            "mean_output_tokens": (1, MAX_REQUEST_TOKENS),
            "num_system_prompts": (1, MAX_REQUESTS),
            "system_prompt_blocks": (0, MAX_HASH_IDS_PER_REQUEST),
        }
        for name, (low, high) in counts.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ConfigError(f"{name} = {value!r}: allowed: an integer in {low}..{high}")
        duration_s = self.duration_s
        if isinstance(duration_s, bool) or not isinstance(duration_s, int | float):
            raise ConfigError(f"duration_s = {duration_s!r}: allowed: 0 < seconds <= 30 days")
        if not 0 < duration_s <= MAX_DURATION_S:
            raise ConfigError(
                f"duration_s = {duration_s!r}: allowed: 0 < seconds <= {MAX_DURATION_S:.0f} "
                "(MAX_DURATION_S)"
            )
        probability = self.follow_up_probability
        if isinstance(probability, bool) or not isinstance(probability, int | float):
            raise ConfigError(f"follow_up_probability = {probability!r}: allowed: 0..1")
        if not 0 <= probability <= 1:
            raise ConfigError(f"follow_up_probability = {probability!r}: allowed: 0..1")


def generate_trace_rows(spec: TraceSpec) -> list[TraceRow]:
    rng = random.Random(f"kvswap-tracegen:{spec.seed}")
    next_id = spec.num_system_prompts * spec.system_prompt_blocks
    conversations: list[tuple[int, tuple[int, ...]]] = []  # (input tokens, hash ids)
    rows: list[TraceRow] = []
    timestamp_ms = 0.0
    sigma = 0.6  # log-normal spread of new prompts
    mu = math.log(spec.mean_input_tokens) - sigma**2 / 2
    for index in range(spec.num_requests):
        timestamp_ms += rng.expovariate(spec.num_requests / (spec.duration_s * 1000.0))
        if conversations and rng.random() < spec.follow_up_probability:
            slot = rng.randrange(max(0, len(conversations) - 200), len(conversations))
            previous_tokens, previous_ids = conversations[slot]
            kept = previous_ids[: previous_tokens // B]  # full blocks only
            tokens = previous_tokens + rng.randint(200, 2000)
        else:
            slot = len(conversations)
            conversations.append((0, ()))
            system = rng.randrange(spec.num_system_prompts) * spec.system_prompt_blocks
            kept = tuple(range(system, system + spec.system_prompt_blocks))
            tokens = max(len(kept) * B + 1, round(rng.lognormvariate(mu, sigma)))
        tokens = min(tokens, spec.max_input_tokens)
        num_blocks = ceil_div(tokens, B)
        kept = kept[:num_blocks]
        fresh = tuple(range(next_id, next_id + num_blocks - len(kept)))
        next_id += len(fresh)
        hash_ids = kept + fresh
        conversations[slot] = (tokens, hash_ids)
        output = max(1, round(rng.expovariate(1.0 / spec.mean_output_tokens)))
        rows.append(TraceRow(index + 1, round(timestamp_ms, 3), tokens, output, hash_ids))
    return rows


def write_trace(rows: list[TraceRow], path: str | Path) -> None:
    with Path(path).open("w", encoding="utf-8") as out:
        for row in rows:
            record = {
                "timestamp": row.timestamp_ms,
                "input_length": row.input_tokens,
                "output_length": row.output_tokens,
                "hash_ids": list(row.hash_ids),
            }
            out.write(json.dumps(record) + "\n")
