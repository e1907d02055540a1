"""`kvswap simulate` and `kvswap tune` through their argparse front ends."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvswap.commands import simulate as simulate_command
from kvswap.commands import tune as tune_command
from kvswap.config_load import load_config
from kvswap.errors import KvSwapError

SMALL_FLAGS = [
    "--gpu-kv-capacity-blocks", "200", "--cpu-kv-capacity-blocks", "600",
    "--nvme-kv-capacity-blocks", "0", "--num-sessions", "6", "--turns", "2",
    "--prompt-tokens", "400", "--output-tokens", "24", "--user-tokens", "40",
    "--system-prompt-tokens", "64", "--arrival-rate", "20", "--think-time-s", "0.1",
]  # fmt: skip


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvswap")
    commands = parser.add_subparsers(dest="command")
    simulate_command.register(commands)
    tune_command.register(commands)
    return parser.parse_args(argv)


def call(argv: list[str]) -> int:
    args = parse(argv)
    result: int = args.handler(args)
    return result


def test_simulate_json_has_the_run_keys_and_writes_a_time_series(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    series = tmp_path / "series.json"
    assert call(["simulate", *SMALL_FLAGS, "--json", "--timeseries", str(series)]) == 0
    summary = json.loads(capsys.readouterr().out)
    for key in ("throughput_tok_s", "itl_ms", "swap_wait_share", "bytes_gpu_to_cpu",
                "prefix_hit_rate_by_tier", "simulated_s_per_wall_s", "diagnosis"):  # fmt: skip
        assert key in summary
    assert summary["requests_completed"] == 12 and summary["hardware"] == "article-40gb"
    points = json.loads(series.read_text())["points"]
    assert points and {"usage_mean_by_tier", "gb_per_s_by_direction", "swap_wait_share"} <= set(
        points[0]
    )


def test_simulate_hit_rate_curve(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [7, 8]}\n'
        '{"timestamp": 5, "input_length": 1024, "output_length": 1, "hash_ids": [7, 8]}\n'
    )
    argv = ["simulate", "--trace", str(trace), "--hit-rate-curve", "--capacities-tokens",
            "512,1e6,inf", "--json"]  # fmt: skip
    assert call(argv) == 0
    curve = json.loads(capsys.readouterr().out)["hit_rate_curve"]
    assert curve == [
        {"capacity_tokens": 512, "hit_rate": 0.0},
        {"capacity_tokens": 1000000, "hit_rate": 0.5},
        {"capacity_tokens": "inf", "hit_rate": 0.5},
    ]


def test_simulate_bad_inputs_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(KvSwapError, match="valid hardware: article-40gb, h100-pcie5, h200"):
        call(["simulate", "--hardware", "a100", *SMALL_FLAGS])
    with pytest.raises(KvSwapError, match="gpu_kv_capacity_blocks = 90000 needs"):
        call(["simulate", *SMALL_FLAGS, "--gpu-kv-capacity-blocks", "90000"])
    with pytest.raises(KvSwapError, match="--hit-rate-curve needs --trace"):
        call(["simulate", "--hit-rate-curve"])
    with pytest.raises(KvSwapError, match="not both"):
        call(["simulate", "--hardware", "h200", "--bench", str(tmp_path / "b.json")])


def test_tune_walks_the_knobs_and_writes_a_config_run_and_simulate_accept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tuned.toml"
    argv = ["tune", *SMALL_FLAGS, "--num-sessions", "4", "--out", str(out), "--json"]
    assert call(argv) == 0
    report = json.loads(capsys.readouterr().out)
    knobs = [step["knob"] for step in report["steps"]]
    assert knobs == ["swap_out_high_watermark", "swap_out_chunk_blocks", "prefetch_stream_count"]
    assert [t["value"] for t in report["steps"][0]["trials"]] == [0.95, 0.9, 0.85, 0.8, 0.75, 0.7]
    config = load_config(out)
    assert config.cache.gpu_kv_capacity_blocks == 200
    assert config.swap.swap_out_high_watermark == report["recommended"]["swap_out_high_watermark"]
    assert "swap_out_chunk_blocks = " in out.read_text()  # the article's flat key names
    assert call(["simulate", "--config", str(out), *SMALL_FLAGS[6:], "--quiet"]) == 0
