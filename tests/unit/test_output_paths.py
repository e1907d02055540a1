"""Issue 13 item 3: output paths are checked before any work, and results are never thrown
away when the write at the end fails (the summary is printed, then one error line, exit 2)."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest

from kvswap.bench.report import BenchReport, BenchResult
from kvswap.commands import bench as bench_command
from kvswap.commands import run as run_command
from kvswap.commands import simulate as simulate_command
from kvswap.commands import tune as tune_command
from kvswap.commands.outputs import check_output_dir, check_output_file
from kvswap.errors import KvSwapError
from kvswap.obs import wiring
from kvswap.sim.tuner import Trial, TuneResult

from .cli_checks import cli, forbid, one_error_line

#: A simulation that finishes in well under a second.
SMALL_SIM = ("--num-sessions", "2", "--turns", "1", "--prompt-tokens", "64",
             "--system-prompt-tokens", "16", "--output-tokens", "4", "--quiet")  # fmt: skip
#: A run of the tiny model with two short requests.
SMALL_RUN = ("--model", "tiny", "--num-sessions", "2", "--turns", "1", "--prompt-tokens", "32",
             "--system-prompt-tokens", "16", "--output-tokens", "4", "--quiet")  # fmt: skip


def fake_bench_report() -> BenchReport:
    row = BenchResult("h2d", "pinned", 1 << 20, 10.0, 9.0, 11.0, 1)
    return BenchReport("cpu", "fake device", None, (row,), 1.7e9, "test")


def disk_full(*_args: object, **_kwargs: object) -> Any:
    raise OSError(errno.ENOSPC, "No space left on device")


# -- checked before any work -------------------------------------------------------------------


def test_run_report_under_proc_fails_before_the_engine_starts(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    forbid(monkeypatch, run_command, "Engine")
    code, out, err = cli(capsys, "run", *SMALL_RUN, "--report", "/proc/nope")
    assert code == 2 and out == ""
    assert "--report /proc/nope" in one_error_line(err)


def test_run_report_that_is_a_file_fails_before_the_engine_starts(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    forbid(monkeypatch, run_command, "Engine")
    a_file = tmp_path / "report"
    a_file.write_text("not a directory")
    code, out, err = cli(capsys, "run", *SMALL_RUN, "--report", str(a_file))
    assert code == 2 and out == ""
    assert "not a directory" in one_error_line(err)
    assert a_file.read_text() == "not a directory"


def test_simulate_report_under_proc_fails_before_simulating(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    forbid(monkeypatch, simulate_command, "Simulator")
    code, out, err = cli(capsys, "simulate", *SMALL_SIM, "--report", "/proc/nope")
    assert code == 2 and out == ""
    assert "--report /proc/nope" in one_error_line(err)


def test_simulate_timeseries_that_is_a_directory_fails_before_simulating(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    forbid(monkeypatch, simulate_command, "Simulator")
    code, out, err = cli(capsys, "simulate", *SMALL_SIM, "--timeseries", str(tmp_path))
    assert code == 2 and out == ""
    assert "--timeseries" in one_error_line(err) and "is a directory" in err


def test_simulate_timeseries_in_a_missing_folder_fails_before_simulating(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    forbid(monkeypatch, simulate_command, "Simulator")
    path = tmp_path / "missing" / "series.json"
    code, out, err = cli(capsys, "simulate", *SMALL_SIM, "--timeseries", str(path))
    assert code == 2 and out == ""
    assert "does not exist" in one_error_line(err)
    assert not (tmp_path / "missing").exists()


def test_tune_out_under_proc_fails_before_tuning(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    forbid(monkeypatch, tune_command, "tune")
    code, out, err = cli(capsys, "tune", *SMALL_SIM, "--out", "/proc/kvswap-tuned.toml")
    assert code == 2 and out == ""
    assert "--out /proc/kvswap-tuned.toml" in one_error_line(err)


def test_bench_out_in_a_missing_folder_fails_before_measuring(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    forbid(monkeypatch, bench_command, "run_bandwidth_bench")
    path = tmp_path / "missing" / "bench.json"
    code, out, err = cli(capsys, "bench", "--out", str(path))
    assert code == 2 and out == ""
    assert "--out" in one_error_line(err)


def test_bench_out_empty_is_refused_before_measuring(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    forbid(monkeypatch, bench_command, "run_bandwidth_bench")
    code, out, err = cli(capsys, "bench", "--out", "")
    assert code == 2 and out == ""
    assert "empty" in one_error_line(err)


def test_check_output_dir_creates_nothing_and_leaves_no_probe(tmp_path: Path) -> None:
    target = tmp_path / "new" / "deeper"
    assert check_output_dir(str(target), "--report") == target
    assert list(tmp_path.iterdir()) == []  # neither the directory nor a probe file


def test_check_output_file_leaves_an_existing_file_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "kept.toml"
    path.write_text("old = 1\n")
    check_output_file(str(path), "--out")
    assert path.read_text() == "old = 1\n"
    assert [p.name for p in tmp_path.iterdir()] == ["kept.toml"]


def test_check_output_dir_below_a_file_is_refused(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(KvSwapError, match="is not a directory"):
        check_output_dir(str(a_file / "sub"), "--report")


# -- a failure at the end still prints the result -----------------------------------------------


def test_run_report_write_failure_still_prints_the_summary(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(wiring, "write_report", disk_full)
    code, out, err = cli(capsys, "run", *SMALL_RUN, "--report", str(tmp_path / "r"))
    assert code == 2
    assert "requests completed" in out and "outputs digest" in out
    assert "No space left on device" in one_error_line(err)


def test_simulate_timeseries_write_failure_still_prints_the_summary(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(simulate_command, "write_text_output", disk_full)
    path = tmp_path / "series.json"
    code, out, err = cli(capsys, "simulate", *SMALL_SIM, "--json", "--timeseries", str(path))
    assert code == 2
    assert '"requests_completed": 2' in out
    assert f"--timeseries {path}: cannot write (No space left" in one_error_line(err)


def test_simulate_report_write_failure_still_prints_the_summary(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(wiring, "write_report", disk_full)
    code, out, err = cli(capsys, "simulate", *SMALL_SIM, "--report", str(tmp_path / "r"))
    assert code == 2
    assert "requests completed" in out and "prefix hit rate" in out
    assert "--report" in one_error_line(err)


def test_tune_out_write_failure_still_prints_the_tuning(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def one_trial_tune(config: Any, *_args: object, **_kwargs: object) -> TuneResult:
        baseline = Trial("baseline", 0.0, 100.0, 1.0, 2.0, 0.0, 0.1, 0)
        return TuneResult(baseline=baseline, steps=(), config=config)

    monkeypatch.setattr(tune_command, "tune", one_trial_tune)
    monkeypatch.setattr(tune_command, "write_text_output", disk_full)
    path = tmp_path / "tuned.toml"
    code, out, err = cli(capsys, "tune", *SMALL_SIM, "--out", str(path))
    assert code == 2
    assert "baseline: the given config: 100.0 tok/s" in out and "not written" in out
    assert f"--out {path}: cannot write (No space left" in one_error_line(err)
    assert not path.exists()


def test_bench_out_write_failure_still_prints_the_figures(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(bench_command, "run_bandwidth_bench", lambda **_: fake_bench_report())
    monkeypatch.setattr(bench_command, "save_report", disk_full)
    code, out, err = cli(capsys, "bench", "--out", str(tmp_path / "bench.json"))
    assert code == 2
    assert "fake device" in out and "10.00" in out and "saved to" not in out
    assert "--out" in one_error_line(err)
