"""Mooncake-format request traces (kvcache-ai/Mooncake, FAST'25 release).

One JSON object per line; other keys are ignored:

    {"timestamp": 27482, "input_length": 6955, "output_length": 52,
     "hash_ids": [46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 2353, 2354]}

`timestamp` is the arrival in ms since the trace started; each hash id names
one 512-token prefix block (equal ids = equal tokens), the last block possibly
partial, so input_length <= 512 * len(hash_ids) (lines breaking that are
rejected; surplus trailing ids are tolerated and never used).

Two entry points, for two costs:
- `read_trace_rows` parses and validates only. The simulator's prefix
  analysis needs hash ids and lengths, not tokens, and an hour-long trace of
  ~12k requests with ~12k-token prompts parses in about a second this way.
- `load_mooncake_trace` also synthesizes token ids (`tokens.py`), with
  optional time and length scaling, for the engine.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvswap.errors import ConfigError, KvSwapError
from kvswap.readers import TRACE_FILE, open_user_file, parse_json
from kvswap.units import ceil_div
from kvswap.workload.bounds import (
    MAX_HASH_ID,
    MAX_HASH_IDS_PER_REQUEST,
    MAX_REQUEST_TOKENS,
    MAX_REQUESTS,
    MAX_TIMESTAMP_MS,
    MAX_TRACE_HASH_IDS,
    MAX_TRACE_LINE_BYTES,
    WorkloadBill,
    check_bill,
    check_length_scale,
    check_time_scale,
)
from kvswap.workload.request import Request, Workload
from kvswap.workload.tokens import BlockTokenSynthesizer

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per hash id in Mooncake traces."""


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One validated trace line, unscaled; `line_number` is 1-based."""

    line_number: int
    timestamp_ms: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]

    @property
    def num_blocks_used(self) -> int:
        """Hash ids the prompt actually covers (the last may be partial)."""
        return ceil_div(self.input_tokens, MOONCAKE_BLOCK_TOKENS)

    @property
    def used_hash_ids(self) -> tuple[int, ...]:
        return self.hash_ids[: self.num_blocks_used]


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: object) -> bool:
    return type(value) is int  # bool is not an int here


def _parse_row(obj: object, where: str, line_number: int) -> TraceRow:
    if not isinstance(obj, dict):
        raise KvSwapError(
            f"{where}: expected a JSON object with timestamp, input_length, output_length "
            f"and hash_ids, got {_show(obj)}"
        )
    for key in ("timestamp", "input_length", "output_length", "hash_ids"):
        if key not in obj:
            raise KvSwapError(f"{where}: missing field {key!r}")
    timestamp = obj["timestamp"]
    if (
        isinstance(timestamp, bool)
        or not isinstance(timestamp, int | float)
        or not math.isfinite(timestamp)
        or timestamp < 0
    ):
        raise KvSwapError(
            f"{where}: field 'timestamp': expected a non-negative number of milliseconds, "
            f"got {_show(timestamp)}"
        )
    if timestamp > MAX_TIMESTAMP_MS:
        # Milliseconds since the trace started: past 30 days the engine would wait
        # (effectively forever) for an arrival that never comes.
        raise KvSwapError(
            f"{where}: field 'timestamp': {_show(timestamp)} ms; allowed: at most "
            f"{MAX_TIMESTAMP_MS:.0f} ms = 30 days since the trace started (MAX_DURATION_S)"
        )
    input_tokens = _token_count(obj, "input_length", where, minimum=1)
    output_tokens = _token_count(obj, "output_length", where, minimum=0)
    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list):
        raise KvSwapError(
            f"{where}: field 'hash_ids': expected a list of integers, got {_show(hash_ids)}"
        )
    if len(hash_ids) > MAX_HASH_IDS_PER_REQUEST:
        raise KvSwapError(
            f"{where}: field 'hash_ids': {len(hash_ids)} ids; allowed: at most "
            f"{MAX_HASH_IDS_PER_REQUEST} (x {MOONCAKE_BLOCK_TOKENS} tokens = "
            f"MAX_REQUEST_TOKENS {MAX_REQUEST_TOKENS})"
        )
    bad = next(
        (i for i, h in enumerate(hash_ids) if type(h) is not int or not 0 <= h <= MAX_HASH_ID),
        None,
    )
    if bad is not None:
        kind = "an integer" if type(hash_ids[bad]) is not int else f"in 0..{MAX_HASH_ID}"
        raise KvSwapError(
            f"{where}: field 'hash_ids': item {bad} is {_show(hash_ids[bad])}, expected {kind}"
        )
    capacity_tokens = MOONCAKE_BLOCK_TOKENS * len(hash_ids)
    if input_tokens > capacity_tokens:
        raise KvSwapError(
            f"{where}: field 'input_length': {input_tokens} tokens exceed the "
            f"{len(hash_ids)} hash_ids x {MOONCAKE_BLOCK_TOKENS} = {capacity_tokens} tokens "
            "they describe"
        )
    return TraceRow(line_number, float(timestamp), input_tokens, output_tokens, tuple(hash_ids))


def _token_count(obj: dict[str, object], key: str, where: str, *, minimum: int) -> int:
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else "a non-negative integer"
        raise KvSwapError(f"{where}: field {key!r}: expected {kind}, got {_show(value)}")
    if value > MAX_REQUEST_TOKENS:
        raise KvSwapError(
            f"{where}: field {key!r}: {value} tokens; allowed: at most {MAX_REQUEST_TOKENS} "
            "(MAX_REQUEST_TOKENS)"
        )
    return value


def read_trace_rows(path: str | Path, *, max_requests: int | None = None) -> list[TraceRow]:
    """Parse and validate a trace, sorted stably by timestamp; no tokens made.

    `max_requests` keeps the earliest N rows (after sorting). Empty lines are
    skipped; any other bad line raises KvSwapError naming the line and field.
    The file is bounded as it is read (`bounds`: line bytes, requests, hash ids),
    so a hostile trace costs at most those bounds of memory.
    """
    _check_max_requests(max_requests)
    path = Path(path)
    rows: list[TraceRow] = []
    num_hash_ids = 0
    try:
        # Binary lines: exact line numbers even for undecodable bytes. A FIFO, a device
        # or a directory is refused before opening; each line is capped below.
        with open_user_file(path, str(path), TRACE_FILE) as lines:
            for line_number in itertools.count(1):
                line = lines.readline(MAX_TRACE_LINE_BYTES + 1)
                if not line:
                    break
                where = f"{path} line {line_number}"
                if len(line) > MAX_TRACE_LINE_BYTES:
                    raise KvSwapError(
                        f"{where}: longer than {MAX_TRACE_LINE_BYTES} bytes "
                        "(MAX_TRACE_LINE_BYTES); a trace line is one short JSON object"
                    )
                if not line.strip():
                    continue
                if len(rows) == MAX_REQUESTS:
                    raise KvSwapError(
                        f"{where}: the trace holds more than {MAX_REQUESTS} requests "
                        "(MAX_REQUESTS); split it"
                    )
                row = _parse_row(parse_json(line, where), where, line_number)
                num_hash_ids += len(row.hash_ids)
                if num_hash_ids > MAX_TRACE_HASH_IDS:
                    raise KvSwapError(
                        f"{where}: the trace holds more than {MAX_TRACE_HASH_IDS} hash_ids "
                        "in all (MAX_TRACE_HASH_IDS); split it"
                    )
                rows.append(row)
    except FileNotFoundError:
        raise KvSwapError(f"{path}: trace file not found") from None
    except OSError as error:
        raise KvSwapError(f"{path}: cannot read trace ({error.strerror})") from None
    if not rows:
        raise KvSwapError(f"{path}: the trace has no requests (only empty lines)")
    rows.sort(key=lambda row: row.timestamp_ms)  # stable: equal times keep file order
    return rows if max_requests is None else rows[:max_requests]


def _check_max_requests(max_requests: int | None) -> None:
    if max_requests is not None and (not _is_int(max_requests) or max_requests < 1):
        raise ConfigError(f"max_requests = {max_requests!r}: allowed: an integer >= 1, or none")


def trace_bill(
    rows: Sequence[TraceRow],
    *,
    time_scale: float = 1.0,
    length_scale: float = 1.0,
    synthesized: bool = True,
) -> WorkloadBill:
    """What the requests of `rows` (sorted by time) will cost, from arithmetic alone.

    Fresh tokens are the outputs plus, when prompts are `synthesized` (the
    engine's `load_mooncake_trace`), one block of new ids per distinct hash id
    used; the simulator's placeholder prompts reuse the hash id objects instead.
    """
    longest_tokens = held_tokens = output_tokens = 0
    distinct: set[int] = set()
    for row in rows:
        output = scaled_output_tokens(row, length_scale)
        tokens = scaled_input_tokens(row, length_scale) + output
        output_tokens += output
        longest_tokens = max(longest_tokens, tokens)
        held_tokens += tokens
        if synthesized:
            distinct.update(row.used_hash_ids)
    span_ms = rows[-1].timestamp_ms - rows[0].timestamp_ms if rows else 0.0
    return WorkloadBill(
        num_requests=len(rows),
        longest_request_tokens=longest_tokens,
        held_tokens=held_tokens,
        new_tokens=output_tokens
        + (len(distinct) * scaled_block_tokens(length_scale) if synthesized else 0),
        duration_s=span_ms / 1000.0 * time_scale,
    )


def scaled_block_tokens(length_scale: float) -> int:
    """Tokens per hash id after scaling lengths by `length_scale`."""
    return max(1, round(MOONCAKE_BLOCK_TOKENS * length_scale))


def scaled_output_tokens(row: TraceRow, length_scale: float) -> int:
    """Tokens to generate after scaling; every request generates at least one."""
    return max(1, round(row.output_tokens * length_scale))


def scaled_input_tokens(row: TraceRow, length_scale: float) -> int:
    """The prompt length after scaling, over exactly the same hash ids.

    Full blocks stay full (block_tokens each) and the partial last block is
    scaled and kept within one block, so two rows sharing a hash-id prefix
    still share the same token prefix at any scale.
    """
    block_tokens = scaled_block_tokens(length_scale)
    num_full_blocks = row.num_blocks_used - 1
    last_tokens = row.input_tokens - num_full_blocks * MOONCAKE_BLOCK_TOKENS  # 1..512
    scaled_last = min(block_tokens, max(1, round(last_tokens * length_scale)))
    return num_full_blocks * block_tokens + scaled_last


def workload_from_rows(
    rows: Sequence[TraceRow],
    *,
    vocab_size: int,
    name: str = "mooncake",
    time_scale: float = 1.0,
    length_scale: float = 1.0,
    max_requests: int | None = None,
    salt: int = 0,
) -> Workload:
    """Requests with synthesized prompts for `rows` (already sorted by time).

    Arrivals are shifted so the first row arrives at t = 0, then multiplied by
    `time_scale` (0.1 = ten times faster replay). Lengths and the block size
    are multiplied by `length_scale`; every request generates at least one
    token. Token ids depend only on (salt, hash id, position in block).
    """
    check_time_scale(time_scale)
    check_length_scale(length_scale)
    _check_max_requests(max_requests)
    if not _is_int(vocab_size) or vocab_size < 1:
        raise ConfigError(f"vocab_size = {vocab_size!r}: allowed: an integer >= 1")
    if not rows:
        raise KvSwapError(f"{name}: the trace has no requests")
    selected = rows if max_requests is None else rows[:max_requests]
    _check_sorted(selected, name)
    # Billed before a single token id is made.
    check_bill(trace_bill(selected, time_scale=time_scale, length_scale=length_scale), name)
    synthesizer = BlockTokenSynthesizer(
        vocab_size=vocab_size, block_tokens=scaled_block_tokens(length_scale), salt=salt
    )
    start_ms = selected[0].timestamp_ms
    requests = []
    for request_id, row in enumerate(selected):
        requests.append(
            Request(
                request_id=request_id,
                arrival_s=(row.timestamp_ms - start_ms) / 1000.0 * time_scale,
                prompt_ids=synthesizer.prompt(row.hash_ids, scaled_input_tokens(row, length_scale)),
                max_new_tokens=scaled_output_tokens(row, length_scale),
            )
        )
    return Workload(requests=tuple(requests), name=name, vocab_size=vocab_size)


def _check_sorted(rows: Sequence[TraceRow], name: str) -> None:
    for previous, row in itertools.pairwise(rows):
        if row.timestamp_ms < previous.timestamp_ms:
            raise KvSwapError(
                f"{name}: rows are not sorted by timestamp (line {row.line_number}); "
                "use read_trace_rows"
            )


def load_mooncake_trace(
    path: str | Path,
    *,
    vocab_size: int,
    time_scale: float = 1.0,
    length_scale: float = 1.0,
    max_requests: int | None = None,
    salt: int = 0,
) -> Workload:
    """Read a Mooncake trace and synthesize its prompts (see `workload_from_rows`)."""
    check_time_scale(time_scale)
    check_length_scale(length_scale)
    rows = read_trace_rows(path, max_requests=max_requests)
    return workload_from_rows(
        rows,
        vocab_size=vocab_size,
        name=f"mooncake:{Path(path).name}",
        time_scale=time_scale,
        length_scale=length_scale,
        salt=salt,
    )
