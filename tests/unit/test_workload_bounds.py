"""Bounded workloads (issue 13, items 4 and 8): every bill is checked before it is built.

A request longer than the model's maximum position is rejected at admission
(counted, with a reason), never a crash in the forward pass; a workload larger
than the bounds in `kvswap.workload.bounds` (requests, tokens per request,
duration, memory) is refused in one line naming the limit before any token id
is made; trace lines that are hostile (deep, binary, huge, out of range) are
named by line. Every case is small: the bounds are hit by arithmetic, not by
building what they forbid.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvswap.cli import main
from kvswap.config_load import load_config
from kvswap.control.policy import PolicyOptions
from kvswap.control.scheduler import Scheduler
from kvswap.control.scheduler_records import SchedulerSettings
from kvswap.control.settings import SwapSettings
from kvswap.control.store_records import StoreLayout
from kvswap.control.swapper import Swapper
from kvswap.drive.settings import control_settings
from kvswap.errors import ConfigError, KvSwapError
from kvswap.sampling import SamplingParams
from kvswap.sim.trace import load_trace_workload, trace_workload
from kvswap.sim.tracegen import TraceSpec
from kvswap.workload import bounds, mooncake
from kvswap.workload.bounds import (
    MAX_DURATION_S,
    MAX_HASH_IDS_PER_REQUEST,
    MAX_REQUEST_TOKENS,
    MAX_REQUESTS,
    WorkloadBill,
    check_bill,
)
from kvswap.workload.mooncake import load_mooncake_trace, read_trace_rows, trace_bill
from kvswap.workload.synthetic import SyntheticSpec, generate_synthetic
from tests.manual_engine import ManualCopyEngine

LINE = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}


def write_trace(path: Path, *lines: object) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def one_line_error(error: pytest.ExceptionInfo[BaseException], *needles: str) -> str:
    message = str(error.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message
    return message


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_usage_error(code: int, err: str, *needles: str) -> None:
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


# --- item 4: requests past the model's maximum position ------------------------------------


def scheduler_with_max_sequence(max_sequence_tokens: int | None) -> Scheduler:
    layout = StoreLayout(block_tokens=4, num_gpu_blocks=64, num_cpu_blocks=0,
                         protected_blocks=0)  # fmt: skip
    swap = SwapSettings(
        block_bytes=64, swap_out_high_watermark=1.0, swap_out_low_watermark=1.0,
        swap_out_chunk_blocks=4, swap_in_chunk_blocks=4,
        cpu_demote_high_watermark=1.0, cpu_demote_low_watermark=1.0,
    )  # fmt: skip
    swapper = Swapper(layout, PolicyOptions(), swap, ManualCopyEngine(), clock_s=lambda: 0.0)
    return Scheduler(swapper, SchedulerSettings(max_sequence_tokens=max_sequence_tokens))


def test_request_past_the_models_max_position_is_rejected_at_admission() -> None:
    scheduler = scheduler_with_max_sequence(32)
    scheduler.add_request(0, list(range(30)), 3, 0.0)  # 33 tokens > 32: fits the GPU tier
    scheduler.add_request(1, list(range(30)), 2, 0.0)  # exactly 32: admitted
    reason = scheduler.runs[0].rejected_reason
    assert reason is not None and "maximum position is 32 tokens" in reason
    assert "33 tokens (30 prompt + 3 new)" in reason
    assert scheduler.finished == [0]
    assert scheduler.runs[1].rejected_reason is None and list(scheduler.waiting) == [1]


def test_request_without_a_max_position_is_not_limited_by_one() -> None:
    scheduler = scheduler_with_max_sequence(None)
    scheduler.add_request(0, list(range(200)), 50, 0.0)  # 63 blocks of the GPU's 64
    assert scheduler.runs[0].rejected_reason is None


def test_control_settings_hands_the_max_sequence_tokens_to_the_scheduler() -> None:
    config = load_config(None, overrides={"gpu_kv_capacity_blocks": 64})
    capacities = config.tier_capacities(1024)
    settings = control_settings(
        config, capacities, block_bytes=1024, model_fingerprint="m", max_sequence_tokens=4096
    )
    assert settings.scheduler.max_sequence_tokens == 4096
    default = control_settings(config, capacities, block_bytes=1024, model_fingerprint="m")
    assert default.scheduler.max_sequence_tokens is None
    with pytest.raises(KvSwapError, match="max_sequence_tokens = 0"):
        control_settings(
            config, capacities, block_bytes=1024, model_fingerprint="m", max_sequence_tokens=0
        )


def test_run_trace_with_one_request_past_max_position_counts_it_rejected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The tiny preset's maximum position is 8192: line 2 asks for 9000 + 8 tokens. The
    # GPU tier is large enough for it, so only the model's limit can reject it.
    too_long = {"timestamp": 1, "input_length": 9000, "output_length": 8,
                "hash_ids": list(range(100, 118))}  # fmt: skip
    short = {"timestamp": 0, "input_length": 40, "output_length": 4, "hash_ids": [1]}
    trace = write_trace(tmp_path / "trace.jsonl", short, too_long)
    code, out, err = cli(
        capsys, "run", "--model", "tiny", "--device", "cpu", "--trace", str(trace),
        "--gpu-kv-capacity-blocks", "1200", "--cpu-kv-capacity-blocks", "0",
        "--protected-sink-blocks", "0", "--json", "--quiet",
    )  # fmt: skip
    assert code == 0, err
    summary = json.loads(out)
    assert summary["requests_rejected"] == 1
    assert summary["requests_completed"] == 1
    [rejection] = summary["rejections"]
    assert rejection["request_id"] == 1 and "maximum position" in rejection["reason"]


def test_generate_max_new_tokens_past_max_position_fails_up_front(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = cli(capsys, "generate", "--prompt-ids", "1,2,3", "--max-new-tokens", "10000")
    assert_one_line_usage_error(code, err, "--max-new-tokens = 10000", "8192", "<= 8189")


def test_generate_max_new_tokens_1e8_fails_up_front(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "generate", "--prompt-ids", "1", "--max-new-tokens", "100000000")
    assert_one_line_usage_error(code, err, "--max-new-tokens = 100000000")


def test_generate_seed_1e23_names_the_seed_range(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(
        capsys, "generate", "--prompt-ids", "1", "--temperature", "1",
        "--seed", str(10**23),
    )  # fmt: skip
    assert_one_line_usage_error(code, err, "seed", f"0..{2**63 - 1}")


def test_generate_with_a_top_p_that_rounds_to_zero_keeps_the_likeliest_token(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 1e-50 is 0 in float32: it once dropped every token ("invalid multinomial
    # distribution", a traceback); now it samples greedily, the likeliest token kept.
    code, out, err = cli(
        capsys, "generate", "--prompt-ids", "1,2,3", "--max-new-tokens", "4",
        "--temperature", "1", "--top-p", "1e-50",
    )  # fmt: skip
    assert code == 0, err
    _, greedy, _ = cli(capsys, "generate", "--prompt-ids", "1,2,3", "--max-new-tokens", "4")
    assert out == greedy


def test_generate_refuses_a_temperature_too_small_for_the_sampler(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = cli(capsys, "generate", "--prompt-ids", "1", "--temperature", "1e-9")
    assert_one_line_usage_error(code, err, "temperature = 1e-09", "0 (greedy) or")


@pytest.mark.parametrize("seed", [-1, 2**63, True])
def test_sampling_seed_outside_0_to_2_63_is_rejected(seed: int) -> None:
    with pytest.raises(KvSwapError) as info:
        SamplingParams(temperature=1.0, seed=seed)
    one_line_error(info, "seed", "(2**63-1)" if seed is not True else "0..")


# --- item 8: the bill of a workload, before it is built -----------------------------------


def test_length_scale_1e6_on_a_two_line_trace_names_the_limit(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", LINE, {**LINE, "timestamp": 10})
    with pytest.raises(KvSwapError) as info:
        load_mooncake_trace(trace, vocab_size=100, length_scale=1e6)
    one_line_error(info, "MAX_REQUEST_TOKENS", str(MAX_REQUEST_TOKENS))
    with pytest.raises(KvSwapError) as info:
        load_trace_workload(trace, length_scale=1e6)
    one_line_error(info, "MAX_REQUEST_TOKENS", str(MAX_REQUEST_TOKENS))


def test_length_scale_past_the_request_bound_names_length_scale(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", LINE)
    with pytest.raises(ConfigError) as info:
        load_trace_workload(trace, length_scale=1e300)
    one_line_error(info, "length_scale = 1e+300", str(MAX_REQUEST_TOKENS))


def test_trace_line_with_millions_of_hash_ids_names_the_limit(tmp_path: Path) -> None:
    # 2 million ids in a 4 MB line: parsed in a blink, refused before any token is made.
    line = json.dumps({**LINE, "hash_ids": [7] * 2_000_000})
    trace = write_trace(tmp_path / "t.jsonl", LINE, line)
    with pytest.raises(KvSwapError) as info:
        read_trace_rows(trace)
    one_line_error(
        info, "line 2: field 'hash_ids': 2000000 ids", f"at most {MAX_HASH_IDS_PER_REQUEST}"
    )


def test_trace_line_longer_than_the_line_bound_names_the_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mooncake, "MAX_TRACE_LINE_BYTES", 200)
    trace = write_trace(tmp_path / "t.jsonl", LINE, {**LINE, "note": "x" * 300}, LINE)
    with pytest.raises(KvSwapError) as info:
        read_trace_rows(trace)
    one_line_error(info, "line 2: longer than 200 bytes", "MAX_TRACE_LINE_BYTES")


def test_trace_with_more_requests_than_the_bound_names_max_requests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mooncake, "MAX_REQUESTS", 3)
    trace = write_trace(tmp_path / "t.jsonl", LINE, LINE, "", LINE, LINE)
    with pytest.raises(KvSwapError) as info:
        read_trace_rows(trace)
    one_line_error(info, "line 5: the trace holds more than 3 requests", "MAX_REQUESTS")


def test_trace_with_more_hash_ids_in_all_than_the_bound_names_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mooncake, "MAX_TRACE_HASH_IDS", 5)
    trace = write_trace(tmp_path / "t.jsonl", LINE, LINE, LINE)
    with pytest.raises(KvSwapError) as info:
        read_trace_rows(trace)
    one_line_error(info, "line 3", "MAX_TRACE_HASH_IDS")


def test_trace_input_length_past_the_request_bound_names_the_field(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", {**LINE, "input_length": MAX_REQUEST_TOKENS + 1})
    with pytest.raises(KvSwapError) as info:
        read_trace_rows(trace)
    one_line_error(info, "line 1: field 'input_length'", "MAX_REQUEST_TOKENS")


def test_trace_timestamp_1e308_names_the_limit(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", LINE, {**LINE, "timestamp": 1e308})
    with pytest.raises(KvSwapError) as info:
        read_trace_rows(trace)
    one_line_error(info, "line 2: field 'timestamp'", "30 days")


def test_run_with_a_trace_timestamp_1e308_fails_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_trace(tmp_path / "t.jsonl", LINE, {**LINE, "timestamp": 1e308})
    code, _, err = cli(capsys, "run", "--device", "cpu", "--trace", str(trace), "--quiet")
    assert_one_line_usage_error(code, err, "timestamp", "30 days")


def test_time_scale_stretching_the_trace_past_30_days_names_the_limit(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", LINE, {**LINE, "timestamp": 1000})
    with pytest.raises(KvSwapError) as info:
        load_trace_workload(trace, time_scale=1e10)
    one_line_error(info, "arrivals span 1e+10 s", "MAX_DURATION_S")


@pytest.mark.parametrize("time_scale", [0, -5, math.nan, math.inf, "1"])
def test_bad_time_scale_is_rejected_by_the_workload_builders(
    tmp_path: Path, time_scale: object
) -> None:
    trace = write_trace(tmp_path / "t.jsonl", LINE)
    rows = read_trace_rows(trace)
    scale: float = time_scale  # type: ignore[assignment]  # a str too, as a caller might
    builders = (
        lambda: load_trace_workload(trace, time_scale=scale),
        lambda: trace_workload(rows, time_scale=scale),
        lambda: mooncake.workload_from_rows(rows, vocab_size=10, time_scale=scale),
        lambda: load_mooncake_trace(trace, vocab_size=10, time_scale=scale),
    )
    for build in builders:
        with pytest.raises(ConfigError) as info:
            build()
        one_line_error(info, "time_scale =", "a finite number > 0")


@pytest.mark.parametrize("length_scale", [math.nan, math.inf, -1, 0])
def test_bad_length_scale_is_rejected_by_the_workload_builders(
    tmp_path: Path, length_scale: float
) -> None:
    trace = write_trace(tmp_path / "t.jsonl", LINE)
    for build in (
        lambda: load_trace_workload(trace, length_scale=length_scale),
        lambda: load_mooncake_trace(trace, vocab_size=10, length_scale=length_scale),
        lambda: trace_workload(read_trace_rows(trace), length_scale=length_scale),
    ):
        with pytest.raises(ConfigError) as info:
            build()
        one_line_error(info, "length_scale =", "a finite number in (0, ")


def test_simulate_prompt_tokens_1e9_names_the_limit(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError) as info:
        SyntheticSpec(prompt_tokens=10**9)
    one_line_error(info, "prompt_tokens = 1000000000", "MAX_REQUEST_TOKENS")
    code, _, err = cli(capsys, "simulate", "--prompt-tokens", str(10**9), "--quiet")
    assert_one_line_usage_error(code, err, "prompt_tokens", "MAX_REQUEST_TOKENS")


def test_num_sessions_1e8_names_the_limit(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError) as info:
        SyntheticSpec(num_sessions=10**8)
    one_line_error(info, "num_sessions = 100000000", f"at most {MAX_REQUESTS}")
    code, _, err = cli(capsys, "simulate", "--num-sessions", str(10**8), "--quiet")
    assert_one_line_usage_error(code, err, "num_sessions", "MAX_REQUESTS")


def test_run_with_num_sessions_1e8_fails_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "run", "--device", "cpu", "--num-sessions", str(10**8), "--quiet")
    assert_one_line_usage_error(code, err, "num_sessions", "MAX_REQUESTS")


def test_sessions_times_turns_past_the_request_bound_names_the_limit() -> None:
    spec = SyntheticSpec(num_sessions=10**5, turns_per_session=11, prompt_tokens=4,
                         output_tokens=1, user_tokens_per_turn=1)  # fmt: skip
    with pytest.raises(KvSwapError) as info:
        generate_synthetic(spec)
    one_line_error(info, "1100000 requests", "MAX_REQUESTS")


def test_long_conversation_past_the_request_bound_names_the_limit() -> None:
    # Each turn is small, but turn 1000 resolves to the whole conversation before it.
    spec = SyntheticSpec(num_sessions=1, turns_per_session=1000, prompt_tokens=512,
                         output_tokens=10_000, user_tokens_per_turn=10_000)  # fmt: skip
    with pytest.raises(KvSwapError) as info:
        generate_synthetic(spec)
    one_line_error(info, "a request of", "MAX_REQUEST_TOKENS")


def test_arrival_rate_spreading_sessions_past_30_days_names_the_limit() -> None:
    spec = SyntheticSpec(num_sessions=3, arrival_rate_per_s=1e-9)
    with pytest.raises(KvSwapError) as info:
        generate_synthetic(spec)
    one_line_error(info, "arrivals span", "MAX_DURATION_S")


def test_workload_needing_more_memory_than_available_names_the_limit() -> None:
    bill = WorkloadBill(num_requests=2, longest_request_tokens=100, held_tokens=200,
                        new_tokens=150, duration_s=1.0)  # fmt: skip
    assert bill.memory_bytes == 200 * 8 + 150 * 32
    check_bill(bill, "w", available_memory_bytes=2 * bill.memory_bytes)
    with pytest.raises(KvSwapError) as info:
        check_bill(bill, "w", available_memory_bytes=2 * bill.memory_bytes - 2)
    one_line_error(info, "w: its 200 token ids need about 6400 bytes", "50% of the")


def test_workload_past_the_held_token_bound_names_the_limit() -> None:
    bill = WorkloadBill(num_requests=1000, longest_request_tokens=MAX_REQUEST_TOKENS,
                        held_tokens=2**33, new_tokens=0, duration_s=0.0)  # fmt: skip
    with pytest.raises(KvSwapError) as info:
        check_bill(bill, "w", available_memory_bytes=2**60)
    one_line_error(info, "MAX_WORKLOAD_TOKENS")


def test_synthetic_bill_is_exact_without_jitter() -> None:
    spec = SyntheticSpec(num_sessions=5, turns_per_session=4, prompt_tokens=50, output_tokens=7,
                         user_tokens_per_turn=9, system_prompt_tokens=16, vocab_size=500,
                         arrival_rate_per_s=2.0, think_time_s=1.0)  # fmt: skip
    workload = generate_synthetic(spec)
    bill = spec.bill()
    totals = [workload.resolved_prompt_tokens(r.request_id) + r.max_new_tokens for r in workload]
    assert bill.num_requests == len(workload)
    assert bill.held_tokens == sum(totals)
    assert bill.longest_request_tokens == max(totals)


def test_trace_bill_matches_the_built_workload() -> None:
    rows = read_trace_rows(Path(__file__).resolve().parent.parent / "data/mooncake_sample.jsonl")
    workload = trace_workload(rows, time_scale=0.5, length_scale=0.25)
    bill = trace_bill(rows, time_scale=0.5, length_scale=0.25)
    totals = [len(r.prompt_ids) + r.max_new_tokens for r in workload]
    assert bill.held_tokens == sum(totals) and bill.longest_request_tokens == max(totals)
    assert bill.duration_s == pytest.approx(workload.requests[-1].arrival_s)


def test_trace_spec_fields_are_bounded() -> None:
    for changes, field in (
        ({"num_requests": MAX_REQUESTS + 1}, "num_requests"),
        ({"duration_s": MAX_DURATION_S * 2}, "duration_s"),
        ({"max_input_tokens": 0}, "max_input_tokens"),
        ({"follow_up_probability": math.nan}, "follow_up_probability"),
    ):
        with pytest.raises(ConfigError) as info:
            TraceSpec(**changes)  # type: ignore[arg-type]
        one_line_error(info, f"{field} =", "allowed")


def test_host_memory_is_read_or_left_out() -> None:
    available = bounds.host_memory_bytes()
    assert available is None or available > 0


# --- the trace reader: hostile lines, named by line ----------------------------------------


@pytest.mark.parametrize("hash_id", [-1, 2**63, 2**70])
def test_hash_id_outside_0_to_2_63_is_rejected_naming_hash_ids(
    tmp_path: Path, hash_id: int
) -> None:
    trace = write_trace(tmp_path / "t.jsonl", {**LINE, "hash_ids": [1, hash_id]})
    with pytest.raises(KvSwapError) as info:
        read_trace_rows(trace)
    one_line_error(info, "line 1: field 'hash_ids': item 1", f"in 0..{2**63 - 1}")


def test_deeply_nested_trace_line_names_the_line(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", LINE, "[" * 100_000 + "]" * 100_000)
    with pytest.raises(KvSwapError) as info:
        read_trace_rows(trace)
    one_line_error(info, "line 2: nested deeper than")


def test_binary_trace_line_names_the_line(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(json.dumps(LINE).encode() + b"\n\x89PNG\r\x00\xff\xfe\n")
    with pytest.raises(KvSwapError) as info:
        read_trace_rows(trace)
    one_line_error(info, "line 2: not UTF-8")


def test_unterminated_string_message_does_not_say_at_at(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", '{"timestamp": "0')
    with pytest.raises(KvSwapError) as info:
        read_trace_rows(trace)
    message = one_line_error(info, "line 1: not valid JSON", "column")
    assert "at at" not in message
