"""Prefix-cache capacity analysis of a trace (the Mooncake paper's Figure 9).

Request order only, no timing. Requests arrive in trace order; a request
reuses 512 x (the number of its leading hash ids found in the cache) tokens,
capped at its prompt length; then every block of its prompt is inserted, or
refreshed as most recently used, in prompt order. The cache holds
floor(capacity / 512) blocks and evicts the least recently used one.

    hit rate = reused tokens / all prompt tokens
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvswap.errors import KvSwapError
from kvswap.workload.mooncake import MOONCAKE_BLOCK_TOKENS, TraceRow

DEFAULT_CAPACITIES_TOKENS = "1e5,1e6,3e6,1e7,5e7,inf"


@dataclass(frozen=True)
class HitRatePoint:
    capacity_tokens: float  # math.inf: unlimited
    hit_rate: float
    reused_tokens: int
    prompt_tokens: int

    def to_json_dict(self) -> dict[str, object]:
        capacity: object = "inf" if math.isinf(self.capacity_tokens) else int(self.capacity_tokens)
        return {"capacity_tokens": capacity, "hit_rate": round(self.hit_rate, 6)}


def parse_capacities_tokens(text: str) -> tuple[float, ...]:
    """'1e5,1e6,inf' -> (100000.0, 1000000.0, inf); KvSwapError naming a bad item."""
    capacities: list[float] = []
    for index, item in enumerate(text.split(","), start=1):
        item = item.strip()
        try:
            value = math.inf if item.lower() == "inf" else float(item)
        except ValueError:
            value = math.nan
        if math.isnan(value) or value < 0 or (math.isinf(value) and item.lower() != "inf"):
            raise KvSwapError(
                f"--capacities-tokens item {index} is {item!r}; allowed: token counts >= 0 "
                "such as 1e6, or inf, separated by commas"
            )
        capacities.append(value if math.isinf(value) else float(math.floor(value)))
    return tuple(capacities)


def prefix_hit_rate(rows: Sequence[TraceRow], capacity_tokens: float) -> HitRatePoint:
    """Replay `rows` through an LRU prefix cache of `capacity_tokens` tokens."""
    limit = None if math.isinf(capacity_tokens) else int(capacity_tokens) // MOONCAKE_BLOCK_TOKENS
    cache: OrderedDict[int, None] = OrderedDict()
    reused = total = 0
    for row in rows:
        blocks = row.used_hash_ids
        leading = 0
        for hash_id in blocks:
            if hash_id not in cache:
                break
            leading += 1
        reused += min(leading * MOONCAKE_BLOCK_TOKENS, row.input_tokens)
        total += row.input_tokens
        if limit == 0:
            continue
        for hash_id in blocks:
            if hash_id in cache:
                cache.move_to_end(hash_id)
            else:
                cache[hash_id] = None
                if limit is not None and len(cache) > limit:
                    cache.popitem(last=False)
    return HitRatePoint(capacity_tokens, reused / total if total else 0.0, reused, total)


def hit_rate_curve(
    rows: Sequence[TraceRow], capacities_tokens: Sequence[float]
) -> list[HitRatePoint]:
    return [prefix_hit_rate(rows, capacity) for capacity in capacities_tokens]
