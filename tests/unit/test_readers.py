"""Readers that never crash (issue 13 items 5, 6, 9, 10): every file kvswap reads, when
nested too deep, binary, broken or holding NaN/Infinity, gives exit 2 and one line naming
the file; bad checkpoints are refused before anything is allocated. Bounded inputs: a
FIFO, /dev/zero or a directory where a file belongs, or a file past its kind's cap, is
refused before it is read (no blocking, no memory growth)."""

from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from kvswap.cli import main
from kvswap.errors import ConfigError, KvSwapError
from kvswap.model.hf_config import parse_hf_config
from kvswap.model.loader import load_model
from kvswap.obs.report import RunReport
from kvswap.readers import (
    MAX_BENCH_BYTES,
    MAX_CONFIG_BYTES,
    MAX_MODEL_CONFIG_BYTES,
    MAX_NESTING_DEPTH,
    MAX_REPORT_BYTES,
    FileKind,
    parse_json,
    parse_toml,
    read_user_file,
)
from tests.unit.test_llama import TINY_HF_CONFIG

DEEP_JSON = "[" * 100_000 + "]" * 100_000
DEEP_TOML = "x = " + "[" * 5_000 + "]" * 5_000 + "\n"
BINARY = b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x01garbage"
DEADLINE_S = 60  # a bound on a child that hangs, not a performance figure


@pytest.fixture(autouse=True)
def _no_kvswap_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("KVSWAP_")]:
        monkeypatch.delenv(name)


def _fails_in_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


# --- parse_json / parse_toml -----------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (DEEP_JSON, f"nested deeper than {MAX_NESTING_DEPTH} levels"),
        ('{"a": ' * 65 + "1" + "}" * 65, "nested deeper than"),
        (BINARY, "not UTF-8 text (byte 0x89 at offset 0)"),
        ('{"a": 1,', "not valid JSON (line 1, column 9"),
        ('{"rate": NaN}', "'rate' is nan; expected a finite number"),
        ('{"rows": [1, -Infinity]}', "'rows[1]' is -inf"),
        ('{"big": 1e400}', "'big' is inf"),
        ("1" * 5000, "not valid JSON: Exceeds the limit"),
    ],
)
def test_parse_json_turns_each_crash_into_one_line(text: str | bytes, message: str) -> None:
    with pytest.raises(KvSwapError) as info:
        parse_json(text, "trace line 3")
    assert str(info.value).startswith("trace line 3: ")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_parse_json_accepts_nesting_at_the_bound_and_brackets_inside_strings() -> None:
    at_bound = "[" * MAX_NESTING_DEPTH + "]" * MAX_NESTING_DEPTH
    assert parse_json(at_bound, "x") is not None
    assert parse_json('{"s": "' + "[" * 1000 + '"}', "x") == {"s": "[" * 1000}
    assert parse_json(b'{"a": [1, 2.5]}', "x") == {"a": [1, 2.5]}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (DEEP_TOML, f"nested deeper than {MAX_NESTING_DEPTH} levels"),
        ("a" + ".a" * 100 + " = 1\n", "nested deeper than"),  # dotted keys nest too
        (BINARY, "not UTF-8 text"),
        ("x = 1\x00\n", "contains NUL bytes"),
        ("x = = 3\n", "not valid TOML"),
        ("[cache]\ngpu_mem_gib = nan\n", "'cache.gpu_mem_gib' is nan; expected a finite number"),
        ("rates = [1.0, -inf]\n", "'rates[1]' is -inf"),
    ],
)
def test_parse_toml_turns_each_crash_into_one_config_error(text: str | bytes, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_toml(text, "config file 'x.toml'")
    assert str(info.value).startswith("config file 'x.toml': ")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_parse_toml_skips_brackets_in_strings_and_comments() -> None:
    text = 'x = "' + "[" * 200 + '"  # ' + "{" * 200 + "\n[a]\nb = [[1], [2]]\n"
    assert parse_toml(text, "x") == {"x": "[" * 200, "a": {"b": [[1], [2]]}}


# --- the CLI readers: --config, --hf-config, --bench, report DIR -----------------------


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (DEEP_TOML.encode(), "nested deeper than 64 levels"),
        (BINARY, "not UTF-8 text"),
        (b"swap_out_chunk_blocks = = 3\n", "not valid TOML"),
        (b"swap_out_high_watermark = nan\n", "'swap_out_high_watermark' is nan"),
    ],
    ids=["nested", "binary", "syntax", "nan"],
)
def test_plan_config_toml_that_is_bad_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, message: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_bytes(content)
    _fails_in_one_line(capsys, ["plan", "--config", str(path)], f"config file '{path}'", message)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (DEEP_JSON.encode(), "nested deeper than 64 levels"),
        (BINARY, "not UTF-8 text"),
        (b'{"num_hidden_layers": 32,', "not valid JSON (line 1"),
        (json.dumps({**TINY_HF_CONFIG, "rms_norm_eps": math.nan}).encode(), "'rms_norm_eps'"),
        (json.dumps({**TINY_HF_CONFIG, "rope_theta": math.inf}).encode(), "'rope_theta' is inf"),
        (json.dumps({**TINY_HF_CONFIG, "vocab_size": 10**15}).encode(), "vocab_size = 10000"),
    ],
    ids=["nested", "binary", "syntax", "nan-eps", "inf-theta", "huge-vocab"],
)
def test_plan_hf_config_that_is_bad_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, message: str
) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(content)
    _fails_in_one_line(capsys, ["plan", "--hf-config", str(path)], str(path), message)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (DEEP_JSON.encode(), "nested deeper than 64 levels"),
        (BINARY, "not UTF-8 text"),
        (b'{"device": "cpu",}', "not valid JSON"),
        (b'{"schema_version": 1, "device": "cpu", "results": [{"gb_per_s_min": NaN}]}', "nan"),
    ],
    ids=["nested", "binary", "syntax", "nan"],
)
def test_plan_bench_file_that_is_bad_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, message: str
) -> None:
    path = tmp_path / "bench.json"
    path.write_bytes(content)
    _fails_in_one_line(capsys, ["plan", "--bench", str(path)], str(path), message)


def _report_json(**changes: object) -> dict[str, object]:
    report: dict[str, object] = {
        "version": 1, "label": "run-a", "run": {"command": "run"}, "config": {},
        "summary": {"completed": 1}, "diagnosis": [], "link_gb_per_s": 24.0,
        "watermarks": {"gpu_high": 0.85, "gpu_low": 0.65},
        "time_series": {"points": [{"start_s": 0.0, "end_s": 1.0, "num_steps": 3}]},
    }  # fmt: skip
    report.update(changes)
    return report


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (DEEP_JSON.encode(), "nested deeper than 64 levels"),
        (BINARY, "not UTF-8 text"),
        (b'{"version": 1,', "not valid JSON"),
        (b'{"version": 1, "link_gb_per_s": Infinity}', "'link_gb_per_s' is inf"),
        (json.dumps(_report_json(label=7)).encode(), "field label = 7 is invalid"),
        (json.dumps(_report_json(diagnosis={})).encode(), "field diagnosis = {} is invalid"),
        (json.dumps(_report_json(link_gb_per_s=-1)).encode(), "field link_gb_per_s = -1"),
        (
            json.dumps(_report_json(watermarks={"gpu_high": "high"})).encode(),
            "field watermarks.gpu_high = 'high' is invalid; expected a fraction in [0, 1]",
        ),
        (
            json.dumps(_report_json(time_series={"points": [{"num_steps": -2}]})).encode(),
            "field time_series.points[0].num_steps = -2 is invalid",
        ),
    ],
    ids=["nested", "binary", "syntax", "inf", "label", "diagnosis", "link", "mark", "point"],
)
def test_report_dir_with_a_bad_report_json_is_one_line_and_left_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, message: str
) -> None:
    path = tmp_path / "report.json"
    path.write_bytes(content)
    _fails_in_one_line(capsys, ["report", str(tmp_path)], str(path), message)
    assert path.read_bytes() == content


def test_a_valid_report_json_still_reads() -> None:
    report = RunReport.from_json(_report_json(), "d/report.json")
    assert report.label == "run-a" and report.link_gb_per_s == 24.0
    assert report.watermarks.gpu_high == 0.85 and len(report.series.points) == 1


# --- bounded inputs: a file that is not a regular file, or too large, is never read ------

NODE_KINDS = {"dev-zero": "a character device", "fifo": "a FIFO", "directory": "a directory"}


def _node(path: Path, kind: str) -> Path:
    """`path` made a FIFO, a directory or a link to /dev/zero (os.stat follows links)."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")
    return path


def _sparse(path: Path, num_bytes: int) -> Path:
    """A file of `num_bytes` that takes no disk and no time to make."""
    with path.open("wb") as file:
        file.truncate(num_bytes)
    return path


@pytest.mark.parametrize("kind", list(NODE_KINDS))
@pytest.mark.parametrize(
    ("argv", "name", "expected"),
    [
        (["plan", "--config"], "x.toml", "give a TOML file"),
        (["plan", "--hf-config"], "config.json", "give a Hugging Face config JSON file"),
        (["plan", "--bench"], "bench.json", "give a JSON file written by `kvswap bench --out`"),
        (["simulate", "--bench"], "bench.json", "give a JSON file written by `kvswap bench"),
        (["simulate", "--quiet", "--trace"], "t.jsonl", "give a JSONL trace file"),
        (["report"], "report.json", "give a report.json written by `kvswap run --report`"),
    ],
    ids=["plan-config", "plan-hf-config", "plan-bench", "simulate-bench", "trace", "report"],
)
def test_what_is_not_a_regular_file_is_refused_before_it_is_read(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    fail_if_blocked: None,
    argv: list[str],
    name: str,
    expected: str,
    kind: str,
) -> None:
    path = _node(tmp_path / name, kind)
    # `report` takes the directory holding report.json; --hf-config takes either (so
    # a directory given is taken to hold config.json: it must be one inside it).
    holder = name == "report.json" or (name == "config.json" and kind == "directory")
    given = tmp_path if holder else path
    needle = f": not a regular file ({NODE_KINDS[kind]}); {expected}"
    _fails_in_one_line(capsys, [*argv, str(given)], str(path), needle)


def test_a_config_that_is_dev_zero_is_one_line_naming_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = _fails_in_one_line(capsys, ["plan", "--config", "/dev/zero"])
    assert err == (
        "kvswap: error: config file '/dev/zero': not a regular file (a character device); "
        "give a TOML file\n"
    )


@pytest.mark.parametrize(
    ("argv", "name", "max_bytes", "cap_name"),
    [
        (["plan", "--config"], "x.toml", MAX_CONFIG_BYTES, "MAX_CONFIG_BYTES"),
        (["plan", "--hf-config"], "config.json", MAX_MODEL_CONFIG_BYTES, "MAX_MODEL_CONFIG_BYTES"),
        (["plan", "--bench"], "bench.json", MAX_BENCH_BYTES, "MAX_BENCH_BYTES"),
        (["report"], "report.json", MAX_REPORT_BYTES, "MAX_REPORT_BYTES"),
    ],
    ids=["config", "hf-config", "bench", "report"],
)
def test_a_file_past_its_cap_is_refused_before_it_is_read(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    name: str,
    max_bytes: int,
    cap_name: str,
) -> None:
    path = _sparse(tmp_path / name, max_bytes + 1)
    given = tmp_path if name == "report.json" else path
    cap = f"{max_bytes // 2**20} MiB"
    needle = f": more than {cap}; allowed: at most {cap} ({cap_name})"
    _fails_in_one_line(capsys, [*argv, str(given)], str(path), needle)


def test_read_user_file_reads_up_to_the_cap_and_no_further(tmp_path: Path) -> None:
    kind = FileKind("a test file", 2**20, "TEST_CAP")
    assert read_user_file(_sparse(tmp_path / "at-cap", 2**20), "at-cap", kind) == bytes(2**20)
    big = _sparse(tmp_path / "big.toml", 3_355_443)
    with pytest.raises(ConfigError) as info:
        read_user_file(big, "--config big.toml", kind, ConfigError)
    assert str(info.value) == "--config big.toml: 3.2 MiB; allowed: at most 1 MiB (TEST_CAP)"


def test_a_file_longer_than_its_size_says_is_still_bounded() -> None:
    # /proc files report a size of 0 and hold more: as a file growing while it is read.
    kind = FileKind("a test file", 16, "TEST_CAP")
    assert os.stat("/proc/self/status").st_size == 0
    with pytest.raises(KvSwapError) as info:
        read_user_file("/proc/self/status", "status", kind)
    assert str(info.value) == "status: more than 16 bytes; allowed: at most 16 bytes (TEST_CAP)"


def _limit_address_space() -> None:
    # Far more than kvswap needs to start (torch included); an unbounded read of
    # /dev/zero reaches it in seconds and dies with a MemoryError traceback.
    limit_bytes = 6 << 30
    resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, resource.RLIM_INFINITY))


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "directory"])
def test_the_real_command_refuses_dev_zero_a_fifo_or_a_directory_in_one_line(
    tmp_path: Path, kind: str
) -> None:
    path = "/dev/zero" if kind == "dev-zero" else str(_node(tmp_path / "x.toml", kind))
    result = subprocess.run(
        [sys.executable, "-m", "kvswap", "plan", "--config", path],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        preexec_fn=_limit_address_space,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        f"kvswap: error: config file {path!r}: not a regular file ({NODE_KINDS[kind]}); "
        "give a TOML file\n"
    )


# --- config.json floats that must be finite and positive -------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"rms_norm_eps": math.nan}, "rms_norm_eps = nan is not a finite number"),
        ({"rope_theta": math.inf}, "rope_theta = inf is not a finite number"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps = 0.0 is not a positive number"),
        ({"rope_theta": -1.0}, "rope_theta = -1.0 is not a positive number"),
        ({"rope_scaling": {"type": "linear", "factor": math.nan}}, "rope_scaling.factor = nan"),
        ({"num_hidden_layers": 10**9}, "num_hidden_layers = 1000000000 is larger than"),
        ({"num_hidden_layers": 1e9}, "num_hidden_layers = 1000000000.0 is not a positive int"),
        ({"hidden_size": 64.5}, "hidden_size = 64.5 is not a positive integer"),
    ],
)
def test_config_dict_with_non_finite_or_huge_values_is_refused(
    changes: dict[str, object], message: str
) -> None:
    with pytest.raises(KvSwapError) as info:
        parse_hf_config({**TINY_HF_CONFIG, **changes})
    assert message in str(info.value) and "\n" not in str(info.value)


# --- checkpoints: kvswap generate --model DIR ------------------------------------------


@pytest.fixture(scope="module")
def tiny_tensors() -> dict[str, torch.Tensor]:
    model, _ = load_model("tiny", None, torch.device("cpu"))
    return {name: t.clone() for name, t in model.state_dict().items()}


def _checkpoint(
    directory: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any] | None = None
) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config or TINY_HF_CONFIG))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def _generate(directory: Path) -> list[str]:
    return ["generate", "--model", str(directory), "--prompt-ids", "1,2,3",
            "--max-new-tokens", "2", "--device", "cpu"]  # fmt: skip


def test_a_good_tiny_checkpoint_still_generates(
    tmp_path: Path, tiny_tensors: dict[str, torch.Tensor], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_generate(_checkpoint(tmp_path / "ckpt", tiny_tensors))) == 0
    assert "Traceback" not in capsys.readouterr().err


def _with_index(weight_map: object) -> Callable[[Path], None]:
    def write(directory: Path) -> None:
        index = {"metadata": {}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))

    return write


def _outside_link(directory: Path) -> None:
    outside = directory.parent / "other"
    outside.mkdir()
    (directory / "model.safetensors").rename(outside / "model.safetensors")
    (directory / "model.safetensors").symlink_to(outside / "model.safetensors")


def _config(**changes: object) -> Callable[[Path], None]:
    def write(directory: Path) -> None:
        (directory / "config.json").write_text(json.dumps({**TINY_HF_CONFIG, **changes}))

    return write


def _raw_config(content: bytes) -> Callable[[Path], None]:
    def write(directory: Path) -> None:
        (directory / "config.json").write_bytes(content)

    return write


def _fifo(name: str) -> Callable[[Path], None]:
    def write(directory: Path) -> None:
        (directory / name).unlink(missing_ok=True)
        os.mkfifo(directory / name)

    return write


def _header(content: bytes) -> Callable[[Path], None]:
    def write(directory: Path) -> None:
        (directory / "model.safetensors").write_bytes(len(content).to_bytes(8, "little") + content)

    return write


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_with_index(["model.safetensors"]), "weight_map is list; expected an object"),
        (_with_index(7), "weight_map is int"),
        (_with_index({"lm_head.weight": ["a"]}), "weight_map['lm_head.weight'] is list"),
        (_with_index({"x": "../other/model.safetensors"}), "leaves the model directory"),
        (_with_index({"x": "/etc/passwd"}), "leaves the model directory"),
        (_outside_link, "outside the model directory; refusing to follow it"),
        (_config(vocab_size=1e15), "vocab_size = 1000000000000000.0 is not a positive"),
        (_config(vocab_size=10**15), "vocab_size = 1000000000000000 is larger than"),
        (_config(num_hidden_layers=1e9), "num_hidden_layers = 1000000000.0 is not a positive"),
        (_config(num_hidden_layers=1000), "checkpoint holds tensors for 2 layers"),
        (_config(vocab_size=100_000), "model.embed_tokens.weight in model.safetensors has shape"),
        (_config(intermediate_size=4096), "mlp.gate_proj.weight in model.safetensors has shape"),
        (_config(rms_norm_eps=math.nan), "'rms_norm_eps' is nan"),
        (_config(rope_theta=math.inf), "'rope_theta' is inf"),
        (_raw_config(DEEP_JSON.encode()), "nested deeper than 64 levels"),
        (_raw_config(BINARY), "not UTF-8 text"),
        (_header(b"[" * 10_000), "safetensors header of"),
        (_header(b'{"x": {"shape": "big"}}'), "tensor x has no valid shape"),
        (_fifo("config.json"), "config.json: not a regular file (a FIFO)"),
        (_fifo("model.safetensors"), "model.safetensors: not a regular file (a FIFO)"),
        (_fifo("model.safetensors.index.json"), "index.json: not a regular file (a FIFO)"),
    ],
    ids=[
        "weight-map-list", "weight-map-int", "weight-map-list-values", "index-dotdot",
        "index-absolute", "symlink-outside", "vocab-1e15", "vocab-int-huge", "layers-1e9",
        "layers-vs-tensors", "vocab-vs-tensors", "intermediate-vs-tensors", "eps-nan",
        "theta-inf", "config-nested", "config-binary", "header-nested", "header-shape",
        "config-fifo", "shard-fifo", "index-fifo",
    ],
)  # fmt: skip
def test_generate_refuses_a_bad_checkpoint_in_one_line(
    tmp_path: Path,
    tiny_tensors: dict[str, torch.Tensor],
    capsys: pytest.CaptureFixture[str],
    fail_if_blocked: None,
    damage: Callable[[Path], None],
    message: str,
) -> None:
    directory = _checkpoint(tmp_path / "ckpt", tiny_tensors)
    damage(directory)
    _fails_in_one_line(capsys, _generate(directory), message)
