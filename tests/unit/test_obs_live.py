"""The live panel and progress bar (rich: in place on a terminal, plain lines elsewhere)
and the monitoring wiring."""

from __future__ import annotations

import argparse
import io
import urllib.request
from dataclasses import replace

import pytest
from rich.console import Console

from kvswap.config_load import load_config
from kvswap.errors import KvSwapError
from kvswap.obs.live import LivePanel, occupancy_bar
from kvswap.obs.progress import ProgressBar
from kvswap.obs.rates import format_rate
from kvswap.obs.watermarks import Watermarks
from kvswap.obs.wiring import add_monitoring_arguments, build_monitoring

from .obs_fakes import Step, samples

CURSOR_UP = "\x1b[1A"  # rich's Live goes back up one line per line it drew last time


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def console(*, terminal: bool) -> tuple[Console, io.StringIO]:
    """A console on a string: a terminal (in place, no colours) or a plain file."""
    stream = io.StringIO()
    return Console(file=stream, force_terminal=terminal, color_system=None, width=120), stream


def panel_lines(panel: LivePanel) -> list[str]:
    """What the panel would show now, as plain text lines."""
    out, stream = console(terminal=False)
    out.print(panel.renderable())
    return [line.rstrip() for line in stream.getvalue().splitlines()]


def test_the_bar_marks_both_watermarks() -> None:
    bar = occupancy_bar(0.5, (0.85, 0.65), width=20)
    assert bar == "[##########---:---|--]"
    assert occupancy_bar(1.0, None, width=4) == "[####]"


def test_on_a_terminal_the_panel_redraws_in_place_a_few_times_a_second() -> None:
    out, stream = console(terminal=True)
    clock = Clock()
    panel = LivePanel(out, watermarks=Watermarks(), clock=clock, link_gb_per_s=1.0)
    assert panel.tty
    moved = {"gpu_to_cpu": 10**6, "cpu_to_gpu": 5 * 10**5}
    steps = [Step(moved=moved, used={"gpu": 90, "cpu": 95}, swap_wait_s=0.002)] * 20
    for sample in samples(steps):
        panel.progress(sample.step // 2, 10)
        clock.now_s += 0.1  # ten steps a second: at most one redraw in 0.25 s
        panel.on_step(sample)
    draws = stream.getvalue().count("host<->device ")
    assert 5 <= draws <= 8
    assert stream.getvalue().count("\r\x1b[2K" + CURSOR_UP) == draws - 1  # back up, redraw
    panel.on_finish({})
    text = stream.getvalue()
    assert text.count("host<->device ") == draws + 1  # the final state, once
    assert text.endswith("\x1b[?25h")  # the cursor is given back

    lines = panel_lines(panel)
    # The article's four numbers come first: link read / write, swap-wait, P50/P95/P99, pinned.
    assert lines[:4] == [
        "host<->device  read 50 MB/s  write 100 MB/s (10% of link)",
        "swap-wait      20.0% of step time",
        "token latency  p50 10.0 ms  p95 10.0 ms  p99 10.0 ms",
        "pinned pool    95%  95/100 blk",
    ]
    assert lines[4].startswith("requests 9/10 ") and "step 19" in lines[4]
    gpu = next(line for line in lines if line.startswith(" GPU"))
    assert "[##################:####|#---]" in gpu and " 90%" in gpu and "high | 85%" in gpu
    assert any(line.startswith(" CPU") for line in lines)
    assert not any(line.startswith(" NVMe") for line in lines)  # no NVMe tier configured
    assert lines[-1] == "link  gpu>cpu 100 MB/s  cpu>gpu 50 MB/s  cpu>nvme 0 B/s  nvme>cpu 0 B/s"


def test_figures_past_the_articles_thresholds_are_drawn_red() -> None:
    stream = io.StringIO()
    out = Console(file=stream, force_terminal=True, color_system="standard", width=120)
    panel = LivePanel(out, watermarks=Watermarks(), clock=Clock())
    for sample in samples([Step(used={"gpu": 50, "cpu": 95}, swap_wait_s=0.005)] * 3):
        panel.on_step(sample)
    panel.close()
    red = "\x1b[1;31m"
    assert f"{red}50.0% of step time" in stream.getvalue()  # swap-wait share over 10 %
    assert f"{red}95%  95/100 blk" in stream.getvalue()  # pinned pool over 90 %
    assert f"{red}read" not in stream.getvalue()  # no link given: no share, no alarm


def test_elsewhere_it_writes_plain_lines() -> None:
    out, stream = console(terminal=False)
    clock = Clock()
    panel = LivePanel(out, watermarks=Watermarks(), clock=clock, log_interval_s=1.0)
    assert not panel.tty
    for sample in samples([Step(swap_wait_s=0.001)] * 30):
        clock.now_s += 0.1
        panel.on_step(sample)
    panel.on_finish({})
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3  # at 1.1 s, 2.1 s, and the end
    assert "\x1b" not in stream.getvalue()
    assert lines[-1].startswith("[    0.3 s] requests 0/0 | read 0 B/s  write 0 B/s |")
    assert "| swap-wait 10.0% | p50 10.0 p95 10.0 p99 10.0 ms |" in lines[-1]
    assert "| pinned 10%  10/100 blk |" in lines[-1]
    assert lines[-1].endswith("| GPU 50% CPU 10%")


def test_a_dumb_terminal_gets_plain_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TERM", "dumb")
    out, _ = console(terminal=True)
    assert not LivePanel(out, watermarks=Watermarks()).tty
    assert not ProgressBar("tune", out).is_tty


def test_the_progress_bar_draws_in_place_on_a_terminal() -> None:
    out, stream = console(terminal=True)
    clock = Clock()
    bar = ProgressBar("tune", out, clock=clock)
    for done in range(16):
        clock.now_s += 0.05  # twenty updates a second: every other one is drawn
        bar.update(done, 15)
    text = stream.getvalue()
    assert 7 <= text.count("tune ") <= 9
    assert "15/15" in text and "━" in text  # rich's bar, full
    assert text.count("15/15") == 1  # the final state once, though reported again
    assert text.endswith("\x1b[?25h")  # stopped at the end: the cursor is back


def test_the_progress_bar_writes_a_line_per_tenth_elsewhere() -> None:
    out, stream = console(terminal=False)
    clock = Clock()
    bar = ProgressBar("tune", out, clock=clock)
    for done in range(41):
        clock.now_s += 1.0
        bar.update(done, 40, "sim")
    bar.update(40, 40)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "tune: 0/40 (0%) 1.0s sim"
    assert lines[-1] == "tune: 40/40 (100%) 41.0s sim"
    assert len(lines) == 11
    assert "\x1b" not in stream.getvalue()


def test_a_closed_progress_bar_gives_the_terminal_back() -> None:
    out, stream = console(terminal=True)
    with ProgressBar("tune", out) as bar:
        bar.update(1, 4)
    assert stream.getvalue().endswith("\x1b[?25h")
    bar.update(2, 4)  # drawing again after an early close is harmless
    disabled, quiet = console(terminal=True)
    ProgressBar("tune", disabled, enabled=False).update(1, 4)
    assert quiet.getvalue() == ""


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    add_monitoring_arguments(parser)
    return parser.parse_args(argv)


CONFIG = load_config(environ={}, overrides={"swap_out_high_watermark": 0.9})


def test_quiet_and_json_get_no_panel_and_no_progress() -> None:
    for flag in ("--quiet", "--json"):
        stream = Terminal()
        with build_monitoring(parse(flag), CONFIG, block_bytes=4096, stream=stream) as m:
            assert m.panel is None and m.progress is None
            assert len(m.observers) == 1  # the time series, for the diagnosis
        assert stream.getvalue() == ""


def test_a_terminal_gets_the_panel_instead_of_the_bar() -> None:
    with build_monitoring(parse(), CONFIG, block_bytes=4096, stream=Terminal()) as m:
        assert m.panel is not None and m.progress == m.panel.progress
        assert m.panel.watermarks.gpu_high == 0.9
    stream = io.StringIO()
    with build_monitoring(parse(), CONFIG, block_bytes=4096, stream=stream) as m:
        assert m.panel is not None and not m.panel.tty and m.progress is not None
        m.progress(1, 4)
        assert stream.getvalue().startswith("requests: 1/4 (25%)")


def test_metrics_port_serves_until_the_block_ends() -> None:
    stream = io.StringIO()
    with build_monitoring(
        parse("--metrics-port", "0"), CONFIG, block_bytes=4096, stream=stream
    ) as m:
        assert m.exporter is not None and m.exporter.port
        url = f"http://127.0.0.1:{m.exporter.port}/metrics"
        assert stream.getvalue().startswith(f"metrics: {url}")
        with urllib.request.urlopen(url, timeout=10) as response:
            assert b"kvswap_tier_watermark_ratio" in response.read()
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=2)
    with pytest.raises(KvSwapError, match=r"--metrics-port 70000: allowed 0\.\.65535"):
        build_monitoring(parse("--metrics-port", "70000"), CONFIG, block_bytes=1, stream=stream)


def test_finish_adds_the_diagnosis_to_the_summary() -> None:
    with build_monitoring(parse("--quiet"), CONFIG, block_bytes=4096) as m:
        for sample in samples([Step(swap_wait_s=0.005)] * 300):
            for observer in m.observers:
                observer.on_step(sample)
        summary = m.finish({"swap_wait_share": 0.5, "swap_wait_s": 1.5})
    diagnosis = summary["diagnosis"]
    assert isinstance(diagnosis, list) and [f["rule"] for f in diagnosis] == ["swap_wait_high"]


def test_a_remote_tier_gets_its_own_row_and_nothing_without_one() -> None:
    out, _ = console(terminal=False)
    panel = LivePanel(out, watermarks=Watermarks())
    plain = samples([Step()] * 3)
    panel.on_step(plain[-1])
    assert not any(line.startswith("remote") for line in panel_lines(panel))
    assert "remote" not in panel.log_line()
    remote = replace(
        plain[-1], remote_enabled=True, remote_hit_tokens=384, remote_misses=2,
        remote_writes=12, remote_known_blocks=40,
    )  # fmt: skip
    panel.on_step(remote)
    [row] = [line for line in panel_lines(panel) if line.startswith("remote")]
    assert row.startswith("remote  hits 384 tok  misses 2  written 12 blk  known 40 blk  in ")
    assert panel.log_line().endswith("| remote hits 384 tok misses 2")
    # Bytes from a keyed tier past the first (remote2) count as the row's "in".
    panel = LivePanel(out, watermarks=Watermarks())
    for sample in samples([Step(moved={"remote2_to_cpu": 10**6})] * 4):
        panel.on_step(replace(sample, remote_enabled=True))
    [row] = [line for line in panel_lines(panel) if line.startswith("remote")]
    assert f"in {format_rate(0.0)}" not in row and f"out {format_rate(0.0)}" in row
