"""The live panel (in place on a terminal, plain lines elsewhere) and the monitoring wiring."""

from __future__ import annotations

import argparse
import io
import urllib.request

import pytest

from kvswap.config import load_config
from kvswap.errors import KvSwapError
from kvswap.obs.live import LivePanel, occupancy_bar
from kvswap.obs.watermarks import Watermarks
from kvswap.obs.wiring import add_monitoring_arguments, build_monitoring

from .obs_fakes import Step, samples


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_the_bar_marks_both_watermarks() -> None:
    bar = occupancy_bar(0.5, (0.85, 0.65), width=20)
    assert bar == "[##########---:---|--]"
    assert occupancy_bar(1.0, None, width=4) == "[####]"


def test_on_a_terminal_the_panel_redraws_in_place_a_few_times_a_second() -> None:
    stream, clock = Terminal(), Clock()
    panel = LivePanel(stream, watermarks=Watermarks(), clock=clock)
    assert panel.tty
    steps = [Step(moved={"gpu_to_cpu": 10**6}, used={"gpu": 90, "cpu": 40})] * 20
    for sample in samples(steps):
        panel.progress(sample.step // 2, 10)
        clock.now_s += 0.1  # ten steps a second: at most one redraw in 0.25 s
        panel.on_step(sample)
    text = stream.getvalue()
    draws = text.count("requests ")
    assert 5 <= draws <= 8
    lines = panel.render()
    assert text.count(f"\x1b[{len(lines)}F") == draws - 1  # every redraw goes back up first
    assert lines[0].startswith("requests 9/10 [")
    gpu = next(line for line in lines if line.startswith("GPU"))
    assert "|" in gpu and ":" in gpu and " 90%" in gpu and "high | 85%" in gpu
    assert any(line.startswith("CPU") for line in lines)
    assert not any(line.startswith("NVMe") for line in lines)  # no NVMe tier configured
    assert "gpu>cpu 100 MB/s" in lines[-2]
    assert lines[-1].startswith("swap-wait 0.0% of step time") and "p99 10.0 ms" in lines[-1]


def test_elsewhere_it_writes_plain_lines() -> None:
    stream, clock = io.StringIO(), Clock()
    panel = LivePanel(stream, watermarks=Watermarks(), clock=clock, log_interval_s=1.0)
    assert not panel.tty
    for sample in samples([Step(swap_wait_s=0.001)] * 30):
        clock.now_s += 0.1
        panel.on_step(sample)
    panel.on_finish({})
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3  # at 1.1 s, 2.1 s, and the end
    assert "\x1b" not in stream.getvalue()
    assert "| GPU 50% CPU 10% |" in lines[-1] and "swap-wait 10.0%" in lines[-1]


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
