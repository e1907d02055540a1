"""Issue 13 items 10-13 in run/simulate/tune/bench/report: listeners off loopback warn,
`kvswap report` never rewrites report.json, messages name the right flag, KVSWAP_*
variables are checked everywhere, and bad workload or [model] input is one line."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from kvswap.cli import build_parser, main
from kvswap.commands import bench as bench_command
from kvswap.commands import run as run_command
from kvswap.commands import simulate as simulate_command
from kvswap.commands.common import config_from_args
from kvswap.commands.report import first_difference
from kvswap.commands.run import RUN_DEFAULTS, engine_model
from kvswap.errors import KvSwapError
from kvswap.obs.prometheus import PrometheusExporter, is_loopback_address

from .cli_checks import cli, forbid, one_error_line

SMALL_SIM = ("--num-sessions", "2", "--turns", "1", "--prompt-tokens", "64",
             "--system-prompt-tokens", "16", "--output-tokens", "4", "--quiet")  # fmt: skip
#: Every request needs more blocks than all tiers hold together: 0 complete.
ALL_REJECTED = ("--num-sessions", "2", "--turns", "1", "--prompt-tokens", "4000",
                "--system-prompt-tokens", "16", "--output-tokens", "4",
                "--gpu-kv-capacity-blocks", "64", "--cpu-kv-capacity-blocks", "16",
                "--nvme-kv-capacity-blocks", "0", "--protected-sink-blocks", "2",
                "--quiet")  # fmt: skip
TRACE_LINE = '{"timestamp": 0, "input_length": 32, "output_length": 4, "hash_ids": [1, 2]}\n'


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One small simulated run's report directory, written once for the module."""
    directory = tmp_path_factory.mktemp("reports") / "run"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["simulate", *SMALL_SIM, "--report", str(directory)]) == 0
    return directory


def copy_report(source: Path, target: Path, edit: Any = None) -> Path:
    data = json.loads((source / "report.json").read_text())
    if edit is not None:
        edit(data)
    target.mkdir()
    (target / "report.json").write_text(json.dumps(data))
    return target


# -- item 11: listeners ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "loopback"),
    [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("::ffff:127.0.0.1", True),
     ("0.0.0.0", False), ("::", False), ("192.168.1.20", False), ("localhost", False)],
)  # fmt: skip
def test_is_loopback_address_judges_the_bound_address(address: str, loopback: bool) -> None:
    assert is_loopback_address(address) is loopback


def test_metrics_host_off_loopback_warns_even_with_quiet(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tests listen on loopback only: pretend the socket bound every interface.
    def serve_everywhere(self: PrometheusExporter, host: str = "", port: int = 0) -> int:
        self.bound_address, self.port = "0.0.0.0", 9400
        return 9400

    monkeypatch.setattr(PrometheusExporter, "serve", serve_everywhere)
    code, _, err = cli(
        capsys, "simulate", *SMALL_SIM, "--metrics-port", "0", "--metrics-host", "0.0.0.0"
    )
    assert code == 0
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1
    assert "--metrics-host 0.0.0.0 is not a loopback address" in warnings[0]


def test_metrics_host_on_loopback_gives_no_warning(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(
        capsys, "simulate", *SMALL_SIM, "--metrics-port", "0", "--metrics-host", "127.0.0.1"
    )
    assert code == 0
    assert "warning" not in err


# -- item 12: report.json is read-only ----------------------------------------------------------


def test_report_leaves_report_json_byte_identical(
    capsys: pytest.CaptureFixture[str], report_dir: Path, tmp_path: Path
) -> None:
    def add_unknown_key(data: dict[str, Any]) -> None:
        data["written_by_a_newer_kvswap"] = {"kept": True}

    directory = copy_report(report_dir, tmp_path / "run", add_unknown_key)
    before = (directory / "report.json").read_bytes()
    code, out, err = cli(capsys, "report", str(directory))
    assert code == 0, err
    assert out.strip() == str(directory / "index.html")
    assert (directory / "report.json").read_bytes() == before


def test_report_with_an_invalid_field_names_the_field(
    capsys: pytest.CaptureFixture[str], report_dir: Path, tmp_path: Path
) -> None:
    def corrupt(data: dict[str, Any]) -> None:
        data["diagnosis"] = "not a list"

    directory = copy_report(report_dir, tmp_path / "run", corrupt)
    before = (directory / "report.json").read_bytes()
    code, out, err = cli(capsys, "report", str(directory))
    assert code == 2 and out == ""
    assert "diagnosis" in one_error_line(err)
    assert (directory / "report.json").read_bytes() == before
    assert not (directory / "index.html").exists()


def test_report_with_a_missing_field_names_the_field(
    capsys: pytest.CaptureFixture[str], report_dir: Path, tmp_path: Path
) -> None:
    def drop(data: dict[str, Any]) -> None:
        del data["watermarks"]

    directory = copy_report(report_dir, tmp_path / "run", drop)
    code, _, err = cli(capsys, "report", str(directory))
    assert code == 2
    assert "watermarks" in one_error_line(err)


def test_first_difference_names_a_defaulted_nested_field() -> None:
    understood = {"summary": {"ttft_ms": {"p50": 0.0}}, "diagnosis": []}
    raw = {"summary": {"ttft_ms": {"p50": "fast"}}, "diagnosis": [], "unknown": 1}
    assert first_difference(understood, raw, "") == ("summary.ttft_ms.p50", "fast")
    assert first_difference(understood, {**raw, "summary": understood["summary"]}, "") is None


# -- item 13: messages and KVSWAP_* ---------------------------------------------------------------


def test_report_out_under_proc_names_the_out_flag(
    capsys: pytest.CaptureFixture[str], report_dir: Path
) -> None:
    code, _, err = cli(capsys, "report", str(report_dir), "--out", "/proc/nope")
    assert code == 2
    line = one_error_line(err)
    assert "--out /proc/nope" in line and "--report" not in line


def test_report_out_that_is_a_file_names_the_out_flag(
    capsys: pytest.CaptureFixture[str], report_dir: Path, tmp_path: Path
) -> None:
    a_file = tmp_path / "page"
    a_file.write_text("x")
    code, _, err = cli(capsys, "report", str(report_dir), str(report_dir), "--out", str(a_file))
    assert code == 2
    line = one_error_line(err)
    assert "--out" in line and "--report" not in line and "not a directory" in line


def test_report_rejects_an_unknown_kvswap_variable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, report_dir: Path
) -> None:
    monkeypatch.setenv("KVSWAP_NOT_A_SETTING", "1")
    code, _, err = cli(capsys, "report", str(report_dir))
    assert code == 2
    assert "KVSWAP_NOT_A_SETTING is not a kvswap setting" in one_error_line(err)


def test_bench_rejects_an_unknown_kvswap_variable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    forbid(monkeypatch, bench_command, "run_bandwidth_bench")
    monkeypatch.setenv("KVSWAP_SWAP_OUT_CHUNK_BLOKS", "8")
    code, out, err = cli(capsys, "bench")
    assert code == 2 and out == ""
    assert "KVSWAP_SWAP_OUT_CHUNK_BLOKS" in one_error_line(err)


def test_bench_accepts_a_known_kvswap_variable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSWAP_SWAP_OUT_CHUNK_BLOCKS", "8")
    monkeypatch.setattr(bench_command, "run_bandwidth_bench", _no_measurement)
    code, _, err = cli(capsys, "bench", "--json")
    assert code == 0, err


def _no_measurement(**_kwargs: object) -> Any:
    from kvswap.bench.report import BenchReport

    return BenchReport("cpu", "fake", None, (), 1.7e9, "test")


# -- item 10: run/simulate/tune input -----------------------------------------------------------


def run_settings(tmp_path: Path, toml: str, *flags: str) -> tuple[str, str | None]:
    path = tmp_path / "kvswap.toml"
    path.write_text(toml)
    args = build_parser().parse_args(["run", "--config", str(path), *flags])
    return engine_model(args.model, args.dtype, config_from_args(args, RUN_DEFAULTS))


def test_run_config_model_dtype_fp8_is_refused_naming_the_dtype_flag(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    forbid(monkeypatch, run_command, "Engine")
    path = tmp_path / "fp8.toml"
    path.write_text('[model]\ndtype = "fp8"\n')
    code, out, err = cli(capsys, "run", "--config", str(path), "--quiet")
    assert code == 2 and out == ""
    line = one_error_line(err)
    assert "dtype = 'fp8'" in line and "--dtype" in line


def test_run_config_model_section_is_honoured(tmp_path: Path) -> None:
    assert run_settings(tmp_path, '[model]\npreset = "tiny"\ndtype = "bf16"\n') == ("tiny", "bf16")


def test_run_flags_win_over_the_config_model_section(tmp_path: Path) -> None:
    toml = '[model]\npreset = "tiny"\ndtype = "fp8"\n'
    assert run_settings(tmp_path, toml, "--model", "small", "--dtype", "fp32") == ("small", "fp32")


def test_run_without_a_model_section_keeps_the_default_model(tmp_path: Path) -> None:
    assert run_settings(tmp_path, "[swap]\nswap_out_chunk_blocks = 8\n") == ("small", None)


def test_run_config_model_preset_the_engine_cannot_run_names_the_model_flag(
    tmp_path: Path,
) -> None:
    with pytest.raises(KvSwapError, match=r"preset = 'article-8b'.*--model"):
        run_settings(tmp_path, '[model]\npreset = "article-8b"\n')


@pytest.mark.parametrize("with_trace", [False, True])
@pytest.mark.parametrize(
    ("flag", "value"), [("--time-scale", "-5"), ("--length-scale", "nan"), ("--time-scale", "inf")]
)
def test_run_bad_trace_scale_is_one_line(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    flag: str,
    value: str,
    with_trace: bool,
) -> None:
    forbid(monkeypatch, run_command, "Engine")
    trace = tmp_path / "trace.jsonl"
    trace.write_text(TRACE_LINE)
    extra = ("--trace", str(trace)) if with_trace else ()
    code, out, err = cli(capsys, "run", "--model", "tiny", "--quiet", flag, value, *extra)
    assert code == 2 and out == ""
    assert f"{flag} = " in one_error_line(err) and "allowed: a finite number > 0" in err


def test_simulate_nan_length_scale_is_one_line_before_simulating(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    forbid(monkeypatch, simulate_command, "Simulator")
    code, out, err = cli(capsys, "simulate", *SMALL_SIM, "--length-scale", "nan")
    assert code == 2 and out == ""
    assert "--length-scale = nan" in one_error_line(err)


@pytest.mark.parametrize("command", ["simulate", "tune", "run"])
@pytest.mark.parametrize("value", ["0", "-1"])
def test_max_requests_below_one_is_one_line_with_or_without_a_trace(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: str,
    value: str,
) -> None:
    """A synthetic workload used to ignore --max-requests, whatever its value."""
    forbid(monkeypatch, simulate_command, "Simulator")
    forbid(monkeypatch, run_command, "Engine")
    extra = ("--model", "tiny") if command == "run" else ()
    code, out, err = cli(capsys, command, *SMALL_SIM, *extra, "--max-requests", value)
    assert code == 2 and out == ""
    assert f"--max-requests {value}: allowed: an integer >= 1" in one_error_line(err)


@pytest.mark.parametrize("command", ["simulate", "run", "loadgen"])
def test_a_workload_flag_that_cannot_apply_is_one_line_not_ignored(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    command: str,
) -> None:
    """--time-scale without a trace, and a synthetic shape with one, used to be dropped
    silently. A flag given at its default value counts as given too."""
    forbid(monkeypatch, simulate_command, "Simulator")
    forbid(monkeypatch, run_command, "Engine")
    trace = tmp_path / "trace.jsonl"
    trace.write_text(TRACE_LINE)
    extra = {"run": ("--model", "tiny"), "loadgen": ("--url", "http://127.0.0.1:9")}.get(
        command, ()
    )
    code, out, err = cli(capsys, command, *extra, "--quiet", "--time-scale", "1")
    assert code == 2 and out == ""
    assert "--time-scale applies only to --trace FILE" in one_error_line(err)
    code, out, err = cli(capsys, command, *extra, "--quiet", "--trace", str(trace), "--turns", "3")
    assert code == 2 and out == ""
    assert "--turns shapes only a synthetic workload" in one_error_line(err)


def test_simulate_max_requests_keeps_the_first_synthetic_requests(
    capsys: pytest.CaptureFixture[str],
) -> None:
    sessions = ("--num-sessions", "3", "--turns", "2")
    code, out, _err = cli(
        capsys, "simulate", *SMALL_SIM, *sessions, "--max-requests", "4", "--json"
    )
    assert code == 0 and json.loads(out)["requests_completed"] == 4


def test_tune_with_zero_completed_requests_writes_no_config(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "tuned.toml"
    code, out, err = cli(capsys, "tune", *ALL_REJECTED, "--out", str(path))
    assert code == 2 and out == ""
    assert "0 of 2 requests completed" in one_error_line(err)
    assert not path.exists()


def test_metrics_host_not_on_this_machine_names_the_host_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 192.0.2.1 is TEST-NET-1 (RFC 5737): never a local address, so bind() fails at once.
    code, out, err = cli(
        capsys, "simulate", *SMALL_SIM, "--metrics-port", "0", "--metrics-host", "192.0.2.1"
    )
    assert code == 2 and out == ""
    assert "--metrics-host 192.0.2.1: not an address of this machine" in one_error_line(err)


def test_run_config_model_hf_config_names_the_model_flag(tmp_path: Path) -> None:
    hf_config = tmp_path / "config.json"
    hf_config.write_text("{}")
    with pytest.raises(KvSwapError, match=r"hf_config = .*--model DIR"):
        run_settings(tmp_path, f'[model]\nhf_config = "{hf_config}"\n')
