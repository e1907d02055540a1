"""The command line as vLLM users type it: a positional model, vLLM's common flags mapped
onto kvswap's settings or explained in one line, no abbreviations, a help line for every
flag, `generate --prompt TEXT`, and `plan` saying what it assumed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvswap.cli import build_parser
from kvswap.commands import serve as serve_command
from kvswap.commands.engine_flags import dtype_flag, model_flag
from kvswap.config_load import load_config
from kvswap.engine import device_tier
from kvswap.engine.settings import EngineOptions, engine_settings
from kvswap.errors import KvSwapError
from kvswap.host_memory import HostMemory

from .cli_checks import cli, forbid, one_error_line

TINY: dict[str, object] = {
    "kv_block_tokens": 8, "cpu_kv_capacity_blocks": 16, "protected_sink_blocks": 1,
    "device": "cpu",
}  # fmt: skip


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_the_model_is_positional_as_in_vllm_serve_or_a_flag() -> None:
    assert model_flag(parse("serve", "tiny")) == "tiny"
    assert model_flag(parse("serve", "--model", "tiny")) == "tiny"
    assert model_flag(parse("generate", "tiny", "--prompt", "hi")) == "tiny"
    assert model_flag(parse("serve")) is None
    with pytest.raises(KvSwapError, match="given twice"):
        model_flag(parse("serve", "small", "--model", "tiny"))


def test_vllm_dtype_names_are_kvswap_dtypes_and_auto_is_the_checkpoints() -> None:
    for spelled, meant in (("half", "fp16"), ("bfloat16", "bf16"), ("float", "fp32"),
                           ("float32", "fp32"), ("bf16", "bf16"), ("auto", None)):  # fmt: skip
        assert dtype_flag(parse("serve", "--dtype", spelled)) == meant


def test_no_flag_is_taken_for_an_abbreviation(capsys: pytest.CaptureFixture[str]) -> None:
    # `--prompt-i` was once read as `--prompt-ids`, and `--prompt` too.
    with pytest.raises(SystemExit) as stop:
        parse("generate", "--prompt-ids", "1,2", "--max-new", "3")
    assert stop.value.code == 2
    assert "unrecognized arguments: --max-new" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("serve", "--max-prompt", "8")


def test_every_flag_has_a_help_line() -> None:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in commands.choices:
        for action in commands.choices[name]._actions:
            if action.option_strings and action.dest not in ("help",):
                assert action.help, f"kvswap {name} {action.option_strings[0]} has no help"


def test_vllm_flags_with_no_meaning_here_say_so_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    forbid(monkeypatch, serve_command, "_serve_on")  # every one is refused before serving
    code, _, err = cli(capsys, "serve", "tiny", "--swap-space", "4")
    assert code == 2 and "--cpu-kv-capacity-bytes" in one_error_line(err)
    code, _, err = cli(capsys, "serve", "tiny", "--no-enable-prefix-caching")
    assert code == 2 and "always shares a prefix" in one_error_line(err)
    code, _, err = cli(capsys, "serve", "tiny", "--tensor-parallel-size", "2")
    assert code == 2 and "one device" in one_error_line(err)
    code, _, err = cli(capsys, "serve", "tiny", "--gpu-memory-utilization", "1.5")
    assert code == 2 and "0 < F <= 1" in one_error_line(err)
    code, _, err = cli(capsys, "serve", "tiny", "--max-model-len", "0")
    assert code == 2 and "--max-model-len 0" in one_error_line(err)
    # One token of context: the server would start, then refuse every request.
    code, _, err = cli(capsys, "serve", "tiny", "--max-model-len", "1")
    line = one_error_line(err)
    assert code == 2 and "at least one prompt token and one new token" in line
    assert "allowed: 2 or more" in line


def test_harmless_vllm_flags_are_a_note_and_change_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvswap.commands.engine_flags import check_vllm_arguments

    check_vllm_arguments(parse("serve", "--enforce-eager", "--tensor-parallel-size", "1"))
    err = capsys.readouterr().err
    assert "note: --enforce-eager changes nothing here" in err
    assert "note: --tensor-parallel-size 1 changes nothing here" in err
    # Prefix caching is always on: asking for it is no mistake, and says nothing.
    check_vllm_arguments(parse("serve", "--enable-prefix-caching", "--block-size", "32"))
    assert capsys.readouterr().err == ""


def test_max_model_len_bounds_a_request_as_vllm_does() -> None:
    config = load_config(environ={}, overrides={**TINY, "gpu_kv_capacity_blocks": 64})
    settings = engine_settings(config, EngineOptions("tiny", max_model_len=100))
    assert settings.control.scheduler.max_sequence_tokens == 100
    positions = settings.arch.max_position_tokens
    with pytest.raises(KvSwapError, match=f"within the maximum position {positions}"):
        engine_settings(config, EngineOptions("tiny", max_model_len=positions + 1))
    with pytest.raises(KvSwapError, match=f"allowed: 2..{positions}"):  # the Python API too
        engine_settings(config, EngineOptions("tiny", max_model_len=1))


def test_gpu_memory_utilization_sizes_the_device_tier_from_the_memory_less_the_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    memory_bytes = 64 << 20
    monkeypatch.setattr(
        device_tier, "host_memory", lambda: HostMemory(memory_bytes, "a test's 64 MiB")
    )
    config = load_config(environ={}, overrides=TINY)
    settings = engine_settings(config, EngineOptions("tiny", gpu_memory_utilization=0.5))
    weights = device_tier.weight_bytes(settings.arch)
    expected = (memory_bytes // 2 - weights) // settings.layout.block_bytes
    assert settings.capacities.num_gpu_blocks == expected > 0
    # A share that leaves less than a block after the weights, in one line.
    with pytest.raises(KvSwapError, match="less than one"):
        engine_settings(config, EngineOptions("tiny", gpu_memory_utilization=1e-9))
    # Both a share and a size for one tier: which one? Refused.
    sized = load_config(environ={}, overrides={**TINY, "gpu_kv_capacity_blocks": 8})
    with pytest.raises(KvSwapError, match="give one"):
        engine_settings(sized, EngineOptions("tiny", gpu_memory_utilization=0.5))


def test_generate_takes_text_through_the_tokenizer(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "generate", "tiny", "--prompt", "Hello", "--max-new-tokens",
                       "3", "--json")  # fmt: skip
    assert code == 0
    result = json.loads(out)
    assert len(result["output_ids"]) == 3 and isinstance(result["text"], str)
    code, _, err = cli(capsys, "generate", "tiny", "--prompt", "  ")
    assert code == 2 and "--prompt is empty" in one_error_line(err)
    # $'\xff\xfe' as CPython hands it over (surrogateescape): the byte, not the tokenizer's words.
    code, _, err = cli(capsys, "generate", "tiny", "--prompt", "ok \udcff\udcfe")
    line = one_error_line(err)
    assert code == 2 and line.endswith("--prompt: not valid UTF-8 (byte 0xff at byte 3); "
                                       "allowed: UTF-8 text")  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (("--host", "a..b"), "--host a..b: not an address of this machine (encoding with 'idna'"),
        (("--host", "h" * 64), "not an address of this machine"),
        (("--host", "\udcff"), "--host: not valid UTF-8 (byte 0xff at byte 0)"),
        (("--served-model-name", "m\udcff"), "--served-model-name: not valid UTF-8 (byte 0xff"),
        (("--api-key", "\u00e9t\u00e9"), "--api-key: character 'é' at 0 cannot be sent in an "
         "HTTP header; allowed: printable ASCII characters"),
        (("--api-key", "k\udcfe"), "--api-key: not valid UTF-8 (byte 0xfe at byte 1)"),
    ],
)  # fmt: skip
def test_serve_text_flags_are_one_line_before_anything_starts(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    flags: tuple[str, ...], needle: str,
) -> None:  # fmt: skip
    # Before: --host tracebacks (UnicodeError from the IDNA codec); a name or a key
    # that no UTF-8 or HTTP header can carry started a server whose every answer was 500.
    forbid(monkeypatch, serve_command, "_serve_on")
    code, _, err = cli(capsys, "serve", "tiny", "--port", "0", *flags)
    assert code == 2 and needle in one_error_line(err)


def test_plan_bills_a_checkpoints_own_dtype_and_says_what_it_assumed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = {
        "model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512,
        "vocab_size": 1000, "torch_dtype": "bfloat16", "max_position_embeddings": 2048,
    }  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code, out, _ = cli(capsys, "plan", "--hf-config", str(path))
    assert code == 0
    assert "(bf16, 16-token blocks)" in out
    assumed = out.strip().splitlines()[-1]
    assert assumed.startswith("assumed: a 40.00 GiB GPU (the default")
    assert "KV in bf16 (config.json's torch_dtype)" in assumed
    code, out, _ = cli(capsys, "plan", "--hf-config", str(path), "--dtype", "fp16", "--json")
    assert json.loads(out)["assumptions"]["dtype"] == "fp16"
