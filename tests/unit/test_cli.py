"""The command line: the article's plan, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvswap.cli import main

ROOT = Path(__file__).resolve().parents[2]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_json_prints_the_article_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(
        capsys,
        "plan",
        "--preset",
        "article-8b",
        "--context-tokens",
        "4096",
        "--concurrency",
        "8",
        "--json",
    )
    assert code == 0
    plan = json.loads(out)
    assert plan["kv_bytes_per_token"] == 131072
    assert plan["kv_bytes_per_block"] == 2 * 1024**2
    assert plan["kv_demand_bytes"] == 4 * 1024**3
    for key in (
        "kv_bytes_per_request",
        "weights_bytes",
        "gpu_kv_budget_bytes",
        "gpu_kv_capacity_blocks",
        "cpu_kv_capacity_blocks",
        "nvme_kv_capacity_blocks",
        "max_concurrency_gpu",
        "max_concurrency_with_cpu",
        "swap_out_chunk_bytes",
        "swap_out_chunk_ms",
        "swap_in_chunk_bytes",
        "swap_in_chunk_ms",
        "warnings",
    ):
        assert key in plan


def test_plan_with_the_article_config_and_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "plan", "--config", str(ROOT / "configs/article-8b-40gb.toml"))
    assert code == 0
    assert "131,072 B" in out and "3,000 blocks" in out and "0.671 ms" in out


def test_plan_hf_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 3584,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "num_hidden_layers": 28,
        "intermediate_size": 18944,
        "vocab_size": 152064,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code, out, _ = run_cli(capsys, "plan", "--hf-config", str(path), "--json")
    assert code == 0
    assert json.loads(out)["kv_bytes_per_token"] == 57344


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["plan", "--config", "/nonexistent.toml"], "does not exist"),
        (["plan", "--hf-config", "/nonexistent/config.json"], "nonexistent"),
        (["plan", "--preset", "llama-9"], "llama-9"),
        (["plan", "--swap-out-chunk-blocks", "0"], "swap_out_chunk_blocks"),
        (["plan", "--block-tokens", "24"], "power of two"),
        (["plan", "--context-tokens", "0"], "--context-tokens"),
        (["plan", "--link-gb-per-s", "-3"], "--link-gb-per-s"),
        (["plan", "--bench", "/nonexistent.json"], "nonexistent"),
        (["bench", "--block-bytes", "2 potatoes"], "--block-bytes"),
        (["bench", "--chunk-blocks", "a,b"], "--chunk-blocks"),
        (["run", "--cpu-kv-capacity-bytes", "9TiB"], "pinned memory"),
        (["run", "--nvme-kv-capacity-blocks", "9", "--nvme-dir", "/nonexistent"], "does not exist"),
        (["run", "--nvme-kv-capacity-blocks", "9"], "needs nvme_dir"),
        (["run", "--model", "/nonexistent-model"], "neither a preset"),
        (["run", "--trace", "/nonexistent.jsonl"], "nonexistent"),
        (["run", "--num-sessions", "0"], "num_sessions"),
        (["generate", "--prompt-ids", "1,x"], "--prompt-ids"),
        (["generate", "--prompt-ids", "1,99999"], "vocabulary"),
    ],
)
def test_user_errors_are_one_line_with_exit_code_2(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    assert needle in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_malformed_inputs_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("[swap\n")
    bad_json = tmp_path / "config.json"
    bad_json.write_text("{not json")
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("gpu_kv_capacity_block = 10\n")
    for argv in (
        ["plan", "--config", str(bad_toml)],
        ["plan", "--hf-config", str(bad_json)],
        ["plan", "--config", str(unknown)],
    ):
        code, _, err = run_cli(capsys, *argv)
        assert code == 2 and err.count("\n") == 1, err


def test_argparse_mistakes_are_one_line_too() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvswap", "plan", "--no-such-flag"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "--no-such-flag" in done.stderr
