"""Workloads: synthetic sessions, follow-up resolution, and the Mooncake trace reader."""

from __future__ import annotations

import itertools
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from kvswap.errors import ConfigError, KvSwapError
from kvswap.workload.mooncake import (
    MOONCAKE_BLOCK_TOKENS,
    load_mooncake_trace,
    read_trace_rows,
    scaled_block_tokens,
    workload_from_rows,
)
from kvswap.workload.request import FollowUp, Request, Workload, resolve_prompt
from kvswap.workload.synthetic import SyntheticSpec, generate_synthetic
from kvswap.workload.tokens import BlockTokenSynthesizer

SAMPLE_TRACE = Path(__file__).resolve().parent.parent / "data" / "mooncake_sample.jsonl"


def small_spec(**changes: object) -> SyntheticSpec:
    values: dict[str, object] = dict(
        num_sessions=6,
        turns_per_session=3,
        prompt_tokens=96,
        output_tokens=8,
        user_tokens_per_turn=12,
        system_prompt_tokens=32,
        num_system_prompts=2,
        arrival_rate_per_s=4.0,
        think_time_s=2.0,
        length_jitter=0.0,
        vocab_size=1000,
        seed=7,
    )
    values.update(changes)
    return SyntheticSpec(**values)  # type: ignore[arg-type]


# --- synthetic -------------------------------------------------------------------------


def test_same_seed_same_workload_different_seed_different() -> None:
    assert generate_synthetic(small_spec()) == generate_synthetic(small_spec())
    assert generate_synthetic(small_spec()) != generate_synthetic(small_spec(seed=8))


def test_session_content_does_not_depend_on_session_count() -> None:
    def by_session(workload: Workload) -> dict[tuple[int | None, int], tuple[object, ...]]:
        return {
            (r.session_id, r.turn): (r.arrival_s, r.prompt_ids, r.max_new_tokens) for r in workload
        }

    small = by_session(generate_synthetic(small_spec(num_sessions=3)))
    large = by_session(generate_synthetic(small_spec(num_sessions=9)))
    assert all(large[key] == value for key, value in small.items())


def test_exact_lengths_without_jitter() -> None:
    workload = generate_synthetic(small_spec())
    assert len(workload) == 6 * 3
    for request in workload:
        assert request.max_new_tokens == 8
        if request.follow_up is None:
            assert len(request.prompt_ids) == 96
        else:
            assert len(request.follow_up.new_user_ids) == 12
        ids = request.prompt_ids or request.follow_up.new_user_ids  # type: ignore[union-attr]
        assert all(0 <= token < 1000 for token in ids)
    assert workload.total_prompt_tokens() == 6 * 96 + 6 * 2 * 12
    assert workload.total_output_tokens() == 18 * 8
    assert workload.num_sessions() == 6


def test_jitter_spreads_lengths_within_bounds() -> None:
    workload = generate_synthetic(small_spec(num_sessions=40, length_jitter=0.5))
    outputs = {r.max_new_tokens for r in workload}
    assert len(outputs) > 1
    assert all(4 <= n <= 12 for n in outputs)
    first_lengths = [len(r.prompt_ids) for r in workload.first_arrivals()]
    assert all(32 + 32 <= n <= 32 + 96 for n in first_lengths)  # 64 unique tokens +-50%


def test_poisson_arrival_rate_and_think_time_means() -> None:
    spec = small_spec(num_sessions=4000, turns_per_session=2, arrival_rate_per_s=20.0)
    workload = generate_synthetic(spec)
    starts = [r.arrival_s for r in workload.first_arrivals()]
    assert starts[0] == 0.0
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert statistics.mean(gaps) == pytest.approx(1 / 20.0, rel=0.1)
    thinks = [r.follow_up.think_time_s for r in workload if r.follow_up is not None]
    assert statistics.mean(thinks) == pytest.approx(2.0, rel=0.1)


def test_infinite_rate_starts_every_session_at_zero_first_turns_first() -> None:
    workload = generate_synthetic(small_spec(arrival_rate_per_s=math.inf, think_time_s=0.0))
    assert all(r.arrival_s == 0.0 for r in workload)
    # Ties: all first turns, then all second turns, then all third turns.
    assert [r.turn for r in workload] == [0] * 6 + [1] * 6 + [2] * 6


def test_sessions_share_system_prompts() -> None:
    spec = small_spec(num_sessions=30, turns_per_session=1, num_system_prompts=3)
    firsts = generate_synthetic(spec).first_arrivals()
    prefixes = [r.prompt_ids[:32] for r in firsts]
    distinct = set(prefixes)
    assert len(distinct) == 3
    assert all(prefixes.count(prefix) >= 2 for prefix in distinct)
    # Past the system prompt, sessions differ.
    assert len({r.prompt_ids[32:] for r in firsts}) == 30


def test_follow_ups_chain_and_resolve() -> None:
    workload = generate_synthetic(small_spec())
    assert len(workload.first_arrivals()) == 6
    for request in workload:
        follow_ups = workload.follow_ups_of(request.request_id)
        assert len(follow_ups) == (0 if request.turn == 2 else 1)
        for nxt in follow_ups:
            assert nxt.session_id == request.session_id and nxt.turn == request.turn + 1
            assert nxt.prompt_ids == ()
            assert nxt.request_id > request.request_id
            assert nxt.arrival_s == request.arrival_s + nxt.follow_up.think_time_s  # type: ignore[union-attr]
    # Play the scheduler: resolve every prompt in id order with made-up outputs.
    prompts: dict[int, tuple[int, ...]] = {}
    outputs: dict[int, tuple[int, ...]] = {}
    for request in workload:
        prompts[request.request_id] = resolve_prompt(request, outputs, prompts)
        outputs[request.request_id] = tuple([request.request_id] * request.max_new_tokens)
        assert len(prompts[request.request_id]) == workload.resolved_prompt_tokens(
            request.request_id
        )
    third = next(r for r in workload if r.turn == 2)
    second = workload[third.follow_up.previous_request_id]  # type: ignore[union-attr]
    first = workload[second.follow_up.previous_request_id]  # type: ignore[union-attr]
    assert prompts[third.request_id] == (
        first.prompt_ids
        + outputs[first.request_id]
        + second.follow_up.new_user_ids  # type: ignore[union-attr]
        + outputs[second.request_id]
        + third.follow_up.new_user_ids  # type: ignore[union-attr]
    )


def test_first_requests_keep_every_turn_they_follow() -> None:
    workload = generate_synthetic(small_spec())
    first = workload.first(7)
    assert first.requests == workload.requests[:7] and len(first) == 7
    for request in first:  # built again, so every follow-up's turn is inside
        if request.follow_up is not None:
            assert request.follow_up.previous_request_id < 7
    assert workload.first(len(workload)) is workload


def test_resolve_prompt_before_previous_finished_is_an_error() -> None:
    workload = generate_synthetic(small_spec())
    follow_up = next(r for r in workload if r.follow_up is not None)
    previous_id = follow_up.follow_up.previous_request_id  # type: ignore[union-attr]
    with pytest.raises(LookupError, match="output"):
        resolve_prompt(follow_up, {}, {previous_id: (1, 2)})


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"num_sessions": 0}, "num_sessions"),
        ({"turns_per_session": 1.5}, "turns_per_session"),
        ({"prompt_tokens": True}, "prompt_tokens"),
        ({"output_tokens": 0}, "output_tokens"),
        ({"user_tokens_per_turn": -1}, "user_tokens_per_turn"),
        ({"system_prompt_tokens": 97}, "system_prompt_tokens"),
        ({"num_system_prompts": 0}, "num_system_prompts"),
        ({"arrival_rate_per_s": 0.0}, "arrival_rate_per_s"),
        ({"arrival_rate_per_s": math.nan}, "arrival_rate_per_s"),
        ({"think_time_s": -1.0}, "think_time_s"),
        ({"think_time_s": math.inf}, "think_time_s"),
        ({"length_jitter": 1.5}, "length_jitter"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"seed": "x"}, "seed"),
    ],
)
def test_spec_validation_names_the_field(changes: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field) as info:
        small_spec(**changes)
    assert "\n" not in str(info.value) and "allowed" in str(info.value)


def test_request_and_workload_invariants() -> None:
    with pytest.raises(KvSwapError, match="prompt_ids must be empty"):
        Request(1, 0.0, (1,), 4, follow_up=FollowUp(0, (2,), 0.0))
    with pytest.raises(KvSwapError, match="max_new_tokens"):
        Request(0, 0.0, (1,), 0)
    with pytest.raises(KvSwapError, match=r"ids must be 0\.\.n-1"):
        Workload(requests=(Request(1, 0.0, (1,), 1),), name="w", vocab_size=10)
    with pytest.raises(KvSwapError, match="before request 0"):
        Workload(
            requests=(Request(0, 1.0, (1,), 1), Request(1, 0.5, (1,), 1)), name="w", vocab_size=10
        )


# --- Mooncake traces -------------------------------------------------------------------


def test_sample_trace_parses() -> None:
    rows = read_trace_rows(SAMPLE_TRACE)
    assert len(rows) == 20
    assert rows[0].timestamp_ms == 0 and rows[0].input_tokens == 2048
    assert rows[0].hash_ids == (0, 1, 2, 3) and rows[0].output_tokens == 120
    assert [row.line_number for row in rows] == list(range(1, 21))
    workload = load_mooncake_trace(SAMPLE_TRACE, vocab_size=32_000)
    assert len(workload) == 20 and workload.name == "mooncake:mooncake_sample.jsonl"
    for row, request in zip(rows, workload, strict=True):
        assert len(request.prompt_ids) == row.input_tokens
        assert request.max_new_tokens == max(1, row.output_tokens)
        assert request.arrival_s == row.timestamp_ms / 1000
        assert request.follow_up is None and request.session_id is None
        assert all(0 <= token < 32_000 for token in request.prompt_ids)


def shared_prefix_blocks(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


@pytest.mark.parametrize("length_scale", [1.0, 0.25, 0.01])
def test_equal_hash_prefixes_give_equal_token_prefixes(length_scale: float) -> None:
    rows = read_trace_rows(SAMPLE_TRACE)
    workload = load_mooncake_trace(SAMPLE_TRACE, vocab_size=32_000, length_scale=length_scale)
    block_tokens = scaled_block_tokens(length_scale)
    for i, row_i in enumerate(rows):
        for j, row_j in enumerate(rows[:i]):
            prompt_i, prompt_j = workload[i].prompt_ids, workload[j].prompt_ids
            shared = shared_prefix_blocks(row_i.used_hash_ids, row_j.used_hash_ids)
            shared_tokens = min(shared * block_tokens, len(prompt_i), len(prompt_j))
            assert prompt_i[:shared_tokens] == prompt_j[:shared_tokens]
            if shared < min(row_i.num_blocks_used, row_j.num_blocks_used) and block_tokens > 1:
                # The first differing block differs in tokens too (32k vocab: no collisions).
                start = shared * block_tokens
                assert prompt_i[start : start + 2] != prompt_j[start : start + 2]


def test_length_and_time_scaling() -> None:
    workload = load_mooncake_trace(
        SAMPLE_TRACE, vocab_size=100, length_scale=0.25, time_scale=0.1, max_requests=5
    )
    assert len(workload) == 5
    assert [r.arrival_s for r in workload] == pytest.approx([0.0, 0.0, 0.025, 0.06, 0.12])
    assert len(workload[0].prompt_ids) == 2048 // 4  # 4 full blocks of 128
    assert workload[0].max_new_tokens == 30
    assert workload[5 - 1].max_new_tokens == round(96 * 0.25)
    # 90 tokens in one partial block -> 22 (rounded) at scale 0.25; 1 output token stays 1.
    tiny = load_mooncake_trace(SAMPLE_TRACE, vocab_size=100, length_scale=0.25)
    assert len(tiny[9].prompt_ids) == round(90 * 0.25)
    assert tiny[5].max_new_tokens == 1


def test_unsorted_trace_is_sorted_stably_and_shifted_to_zero(tmp_path: Path) -> None:
    lines = [
        {"timestamp": 5000, "input_length": 10, "output_length": 1, "hash_ids": [1]},
        {"timestamp": 3000.5, "input_length": 20, "output_length": 2, "hash_ids": [2]},
        {"timestamp": 5000, "input_length": 30, "output_length": 3, "hash_ids": [3]},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n" + "\n\n".join(json.dumps(line) for line in lines) + "\n   \n")
    rows = read_trace_rows(path)
    assert [row.hash_ids[0] for row in rows] == [2, 1, 3]
    assert [row.line_number for row in rows] == [4, 2, 6]
    workload = workload_from_rows(rows, vocab_size=50)
    assert [r.arrival_s for r in workload] == pytest.approx([0.0, 1.9995, 1.9995])


GOOD = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ({**GOOD, "timestamp": -1}, "field 'timestamp': expected a non-negative number"),
        ({**GOOD, "timestamp": "0"}, "field 'timestamp'"),
        ({**GOOD, "input_length": "abc"}, "field 'input_length': expected a positive integer"),
        ({**GOOD, "input_length": 0}, "field 'input_length'"),
        ({**GOOD, "input_length": 12.5}, "field 'input_length'"),
        ({**GOOD, "output_length": -3}, "field 'output_length': expected a non-negative"),
        ({**GOOD, "output_length": True}, "field 'output_length'"),
        ({**GOOD, "hash_ids": 7}, "field 'hash_ids': expected a list of integers"),
        ({**GOOD, "hash_ids": [1, "2"]}, "field 'hash_ids': item 1 is '2'"),
        ({**GOOD, "input_length": 1025}, "field 'input_length': 1025 tokens exceed"),
        ({k: v for k, v in GOOD.items() if k != "hash_ids"}, "missing field 'hash_ids'"),
    ],
)
def test_malformed_line_names_line_and_field(
    tmp_path: Path, line: str | dict[str, object], expected: str
) -> None:
    path = tmp_path / "trace.jsonl"
    bad = line if isinstance(line, str) else json.dumps(line)
    path.write_text(f"{json.dumps(GOOD)}\n\n{bad}\n{json.dumps(GOOD)}\n")
    with pytest.raises(KvSwapError) as info:
        read_trace_rows(path)
    message = str(info.value)
    assert message.startswith(f"{path} line 3: ")
    assert expected in message and "\n" not in message


def test_trace_file_errors(tmp_path: Path) -> None:
    with pytest.raises(KvSwapError, match="trace file not found"):
        read_trace_rows(tmp_path / "missing.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(KvSwapError, match="no requests"):
        read_trace_rows(empty)
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(json.dumps(GOOD).encode() + b"\n\xff\xfe\x00garbage\n")
    with pytest.raises(KvSwapError, match="line 2"):
        read_trace_rows(binary)
    with pytest.raises(ConfigError, match="time_scale"):
        load_mooncake_trace(SAMPLE_TRACE, vocab_size=10, time_scale=0)
    with pytest.raises(ConfigError, match="length_scale"):
        load_mooncake_trace(SAMPLE_TRACE, vocab_size=10, length_scale=math.inf)
    with pytest.raises(ConfigError, match="max_requests"):
        read_trace_rows(SAMPLE_TRACE, max_requests=0)


def test_large_trace_parses_without_tokens(tmp_path: Path) -> None:
    # An hour-long trace at the Mooncake scale: 12k requests, ~12k-token prompts.
    path = tmp_path / "big.jsonl"
    next_id = 1
    with path.open("w") as out:
        for index in range(12_000):
            num_blocks = 2 + index % 46
            hash_ids = [0, *range(next_id, next_id + num_blocks - 1)]
            next_id += num_blocks - 1
            row = {
                "timestamp": index * 300,
                "input_length": MOONCAKE_BLOCK_TOKENS * num_blocks - index % 500,
                "output_length": 1 + index % 700,
                "hash_ids": hash_ids,
            }
            out.write(json.dumps(row) + "\n")
    rows = read_trace_rows(path)
    assert len(rows) == 12_000
    assert rows[-1].timestamp_ms == 11_999 * 300
    assert sum(row.input_tokens for row in rows) > 12_000 * 10_000
    assert all(row.hash_ids[0] == 0 for row in rows)
    assert len(read_trace_rows(path, max_requests=100)) == 100


# --- token synthesis -------------------------------------------------------------------


def test_block_tokens_are_keyed_by_salt_hash_and_position() -> None:
    full = BlockTokenSynthesizer(vocab_size=50_000, block_tokens=512)
    short = BlockTokenSynthesizer(vocab_size=50_000, block_tokens=100)
    salted = BlockTokenSynthesizer(vocab_size=50_000, block_tokens=512, salt=1)
    assert short.block(42) == full.block(42)[:100]
    assert full.block(42) != full.block(43)
    assert full.block(42) != salted.block(42)
    assert full.block(2**70) != full.block(-5)  # any Python int is a valid hash id
    assert full.prompt([7, 8], 600) == full.block(7) + full.block(8)[:88]
    assert full.num_cached_blocks == 6  # 42, 43, 2**70, -5, 7, 8
    assert all(0 <= token < 50_000 for token in full.block(42))
    with pytest.raises(KvSwapError, match="2 hash ids given"):
        full.prompt([7, 8], 1025)


def test_workload_modules_do_not_import_torch() -> None:
    code = (
        "import sys, kvswap.workload.request, kvswap.workload.synthetic, "
        "kvswap.workload.mooncake, kvswap.workload.tokens; print('torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "False"
