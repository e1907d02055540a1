"""Mooncake-format traces as simulator workloads, without synthesizing text.

The control plane needs token ids only to find shared prefixes: its prefix
index chains a hash over each full block's tokens and confirms hits against
them. A trace already says which prompts share what (equal hash id = equal
512 tokens, and a hash id implies its whole prefix), so the simulator gives
every token of hash block `h` the id `h` itself:

    hash_ids [46, 47, 2353]  ->  prompt = 46 x 512, 47 x 512, 2353 x (rest)

Two prompts then share exactly the KV blocks their hash ids share: a block's
chained hash includes every block before it, so equal runs of ids at
different places never alias. This costs one tuple per prompt and no random
numbers, where per-token synthesis (the engine's `load_mooncake_trace`) keeps
512 distinct ids per hash id in memory. Parsing and validation are the shared
reader's (`read_trace_rows`): a malformed line is named by number.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvswap.units import ceil_div
from kvswap.workload.bounds import check_bill, check_length_scale, check_time_scale
from kvswap.workload.mooncake import (
    TraceRow,
    read_trace_rows,
    scaled_block_tokens,
    scaled_input_tokens,
    scaled_output_tokens,
    trace_bill,
)
from kvswap.workload.request import Request, Workload


def trace_prompt(row: TraceRow, length_scale: float = 1.0) -> tuple[int, ...]:
    """The placeholder prompt of `row`: each hash id repeated over its block."""
    block_tokens = scaled_block_tokens(length_scale)
    num_tokens = scaled_input_tokens(row, length_scale)
    num_blocks = ceil_div(num_tokens, block_tokens)
    ids: list[int] = []
    for hash_id in row.hash_ids[:num_blocks]:
        ids += (hash_id,) * block_tokens
    del ids[num_tokens:]
    return tuple(ids)


def trace_workload(
    rows: Sequence[TraceRow],
    *,
    name: str = "mooncake",
    time_scale: float = 1.0,
    length_scale: float = 1.0,
) -> Workload:
    """Requests for `rows` (sorted by time, as `read_trace_rows` returns them): arrivals
    shifted to start at 0 and multiplied by `time_scale`; lengths by `length_scale`.
    The bill (`bounds`) is checked before any prompt is made."""
    check_time_scale(time_scale)
    check_length_scale(length_scale)
    bill = trace_bill(rows, time_scale=time_scale, length_scale=length_scale, synthesized=False)
    check_bill(bill, name)
    start_ms = rows[0].timestamp_ms if rows else 0.0
    requests = tuple(
        Request(
            request_id=request_id,
            arrival_s=(row.timestamp_ms - start_ms) / 1000.0 * time_scale,
            prompt_ids=trace_prompt(row, length_scale),
            max_new_tokens=scaled_output_tokens(row, length_scale),
        )
        for request_id, row in enumerate(rows)
    )
    vocab_size = 1 + max((max(row.hash_ids, default=0) for row in rows), default=0)
    return Workload(requests=requests, name=name, vocab_size=max(vocab_size, 32_000))


def load_trace_workload(
    path: str | Path,
    *,
    time_scale: float = 1.0,
    length_scale: float = 1.0,
    max_requests: int | None = None,
) -> Workload:
    check_time_scale(time_scale)  # before the file is read
    check_length_scale(length_scale)
    rows = read_trace_rows(path, max_requests=max_requests)
    return trace_workload(
        rows, name=f"mooncake:{Path(path).name}", time_scale=time_scale, length_scale=length_scale
    )
