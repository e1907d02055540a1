"""Reports on disk: `run --report DIR`, report.json round trip, and `kvswap report A B`;
written all at once or not at all (a failure or a stop signal mid-way leaves nothing)."""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from kvswap import staged_dir
from kvswap.cli import main
from kvswap.commands import report as report_command
from kvswap.config_load import load_config
from kvswap.errors import KvSwapError
from kvswap.obs import report as report_module
from kvswap.obs import wiring
from kvswap.obs.diagnosis import diagnose
from kvswap.obs.plots import PLOT_FILES
from kvswap.obs.report import (
    RunReport,
    load_report,
    write_comparison,
    write_report,
    write_report_page,
)
from kvswap.obs.watermarks import Watermarks
from kvswap.signals import Terminated, stop_signals_raise

from .obs_fakes import TINY_CLI_ARGS, Step, one_torch_thread, record

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def synthetic_report(label: str, chunk_blocks: int, wait_s: float) -> RunReport:
    steps = [
        Step(swap_wait_s=wait_s, moved={"gpu_to_cpu": 2**20 * (i % 3), "cpu_to_gpu": 2**19},
             used={"gpu": 60 + i % 30, "cpu": min(100, i)}, ttfts_s=(0.03,) if i % 20 else ())
        for i in range(200)
    ]  # fmt: skip
    summary, series = record(steps)
    summary.update(requests_completed=10, tokens_generated=800, duration_s=2.0)
    config = load_config(environ={}, overrides={"swap_out_chunk_blocks": chunk_blocks})
    return RunReport(
        label=label,
        run={"command": "run", "workload": "synthetic"},
        config=config.model_dump(mode="json"),
        summary=summary,
        series=series,
        findings=tuple(diagnose(summary, series)),
        watermarks=Watermarks.from_config(config),
        link_gb_per_s=None,
    )


def assert_page_is_self_contained(page: Path) -> None:
    html = page.read_text()
    assert "http://" not in html and "https://" not in html  # readable offline
    sources = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert sources
    for source in sources:
        assert not Path(source).is_absolute(), source
        assert (page.parent / source).is_file(), source


def test_a_report_holds_json_plots_and_a_page(tmp_path: Path) -> None:
    report = synthetic_report("chunk-8", 8, 0.004)
    page = write_report(report, tmp_path / "run")
    assert page == tmp_path / "run" / "index.html"
    for file in PLOT_FILES.values():
        assert (tmp_path / "run" / file).read_bytes()[:8] == PNG_MAGIC
    assert_page_is_self_contained(page)
    html = page.read_text()
    assert "swap-wait share above 10%" in html  # the diagnosis, with its figure
    assert "swap.swap_out_chunk_blocks" in html and "token latency (ms)" in html
    again = load_report(tmp_path / "run")
    assert again == report
    assert again.series.itl.counts == report.series.itl.counts
    data = json.loads((tmp_path / "run" / "report.json").read_text())
    assert set(data) >= {"config", "summary", "time_series", "diagnosis", "watermarks"}


def test_comparing_two_runs_overlays_them_on_one_page(tmp_path: Path) -> None:
    dirs = [tmp_path / "a", tmp_path / "b"]
    write_report(synthetic_report("chunk-8", 8, 0.0005), dirs[0])
    write_report(synthetic_report("chunk-2", 2, 0.004), dirs[1])
    parser = argparse.ArgumentParser()
    report_command.register(parser.add_subparsers())
    args = parser.parse_args(["report", str(dirs[0]), str(dirs[1]), "--out", str(tmp_path / "c")])
    assert args.handler(args) == 0
    page = tmp_path / "c" / "index.html"
    assert_page_is_self_contained(page)
    html = page.read_text()
    assert "chunk-8 vs chunk-2" in html
    assert html.count('<tr class="diff"><td>swap.swap_out_chunk_blocks</td>') == 1
    assert '<a href="../a/index.html">' in html
    for file in PLOT_FILES.values():
        assert (tmp_path / "c" / file).read_bytes()[:8] == PNG_MAGIC


def test_a_directory_without_a_report_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(KvSwapError, match=r"no report\.json there; write one with"):
        load_report(tmp_path)
    (tmp_path / "report.json").write_text('{"version": 99}')
    with pytest.raises(KvSwapError, match="report version 99 is not supported"):
        load_report(tmp_path)
    with pytest.raises(KvSwapError, match="at least one"):
        write_comparison([], [], tmp_path / "out")


def test_run_with_report_writes_it_and_puts_the_diagnosis_in_the_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real run whose 8-slot pinned pool stays full: the NVMe advice fires."""
    with one_torch_thread():
        code = main(["run", *TINY_CLI_ARGS, "--json", "--report", str(tmp_path / "r")])
    out, err = capsys.readouterr()
    assert code == 0
    summary: dict[str, Any] = json.loads(out)
    rules = [f["rule"] for f in summary["diagnosis"]]
    assert "pinned_pool_full" in rules
    assert err == f"report: {tmp_path / 'r' / 'index.html'}\n"  # --json: no panel, no bar
    report = load_report(tmp_path / "r")
    assert report.summary == summary
    assert report.run["model"] == "tiny"
    cache = report.config["cache"]
    assert isinstance(cache, dict) and cache["kv_block_tokens"] == 8
    assert report.series.points and report.series.itl.count == (
        summary["tokens_generated"] - summary["requests_completed"]
    )
    assert_page_is_self_contained(tmp_path / "r" / "index.html")


# --- all at once or not at all ---------------------------------------------------------


def everything_under(directory: Path) -> dict[str, bytes | None]:
    """Every entry below `directory`, hidden ones included: path -> bytes (None: a dir)."""
    return {
        str(path.relative_to(directory)): None if path.is_dir() else path.read_bytes()
        for path in sorted(directory.rglob("*"))
    }


def plots_that_fail(error: BaseException) -> Any:
    """A write_plots that writes one plot of the report, then fails with `error`."""

    def write_plots(runs: object, out_dir: Path, files: dict[str, str]) -> dict[str, str]:
        (out_dir / next(iter(files.values()))).write_bytes(PNG_MAGIC)
        raise error

    return write_plots


@pytest.mark.parametrize(
    "error",
    [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt(), Terminated(15)],
    ids=["disk-full", "ctrl-c", "sigterm"],
)
def test_a_report_that_fails_half_way_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    report = synthetic_report("chunk-8", 8, 0.004)
    kept = tmp_path / "kept"  # `kvswap report DIR` renders into DIR beside its report.json
    write_report(report, kept)
    before = everything_under(tmp_path)
    monkeypatch.setattr(report_module, "write_plots", plots_that_fail(error))
    with pytest.raises(type(error)):
        write_report(report, tmp_path / "new" / "nested" / "run")
    with pytest.raises(type(error)):
        write_report_page(report, kept)
    assert everything_under(tmp_path) == before  # no partial directory, no staging, no parents
    if not isinstance(error, OSError):
        notes = getattr(error, "__notes__", [])
        assert f"--report {tmp_path / 'new' / 'nested' / 'run'}: not written" in notes
        assert f"--report {kept}: not written" in notes


def test_a_report_directory_gets_the_permissions_a_plain_mkdir_gives(tmp_path: Path) -> None:
    write_report(synthetic_report("chunk-8", 8, 0.004), tmp_path / "run")
    (tmp_path / "plain").mkdir()
    assert (tmp_path / "run").stat().st_mode == (tmp_path / "plain").stat().st_mode
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_rendering_into_a_report_directory_keeps_its_other_files(tmp_path: Path) -> None:
    report = synthetic_report("chunk-8", 8, 0.004)
    write_report(report, tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    json_before = (tmp_path / "report.json").read_bytes()
    assert write_report_page(report, tmp_path) == tmp_path / "index.html"
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert (tmp_path / "report.json").read_bytes() == json_before
    assert not [p for p in tmp_path.iterdir() if staged_dir.STAGING_MARK in p.name]
    assert_page_is_self_contained(tmp_path / "index.html")


def test_a_stop_signal_while_the_report_is_moved_into_place_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_commit = staged_dir._commit

    def commit_while_signalled(staging: Path, target: Path, last: str | None) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # held until the moves are done
        real_commit(staging, target, last)

    monkeypatch.setattr(staged_dir, "_commit", commit_while_signalled)
    out = tmp_path / "run"
    with pytest.raises(Terminated) as info, stop_signals_raise():
        write_report(synthetic_report("chunk-8", 8, 0.004), out)
    assert info.value.__notes__ == [f"--report {out}: written"]
    assert_page_is_self_contained(out / "index.html")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_sigterm_while_run_writes_its_report_leaves_nothing_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real handler (kvswap.signals) raises where the signal lands: mid-plots."""

    def write_plots(runs: object, out_dir: Path, files: dict[str, str]) -> dict[str, str]:
        (out_dir / next(iter(files.values()))).write_bytes(PNG_MAGIC)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)  # the handler raises Terminated here, at once
        raise AssertionError("SIGTERM did not stop the report")

    monkeypatch.setattr(report_module, "write_plots", write_plots)
    out = tmp_path / "out"
    with one_torch_thread():
        code = main(["run", *TINY_CLI_ARGS, "--quiet", "--report", str(out)])
    err = capsys.readouterr().err
    assert code == 143 and "Traceback" not in err
    stop_line = err.strip().splitlines()[-1]
    assert stop_line.startswith(f"kvswap: stopped by SIGTERM; --report {out}: not written"), err
    assert everything_under(tmp_path) == {}


def test_a_stop_before_the_report_is_written_says_there_is_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt  # Ctrl-C at the end of the run, before the report

    monkeypatch.setattr(wiring, "diagnose", interrupted)
    out = tmp_path / "out"
    with one_torch_thread():
        code = main(["run", *TINY_CLI_ARGS, "--quiet", "--report", str(out)])
    err = capsys.readouterr().err
    assert code == 130
    assert err.strip().splitlines()[-1].startswith(f"kvswap: interrupted; --report {out}: not")
    assert everything_under(tmp_path) == {}
