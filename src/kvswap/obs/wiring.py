"""Monitoring for any long-running command: flags, observers, and the end of the run.

A command (run, simulate, tune) does:

    add_monitoring_arguments(parser)                    # --metrics-port/-host, --report
    ...
    with build_monitoring(args, config, block_bytes=..., kv_metrics=...) as monitoring:
        summary = driver.run(workload, monitoring.progress, monitoring.observers)
        summary = monitoring.finish(summary)            # + "diagnosis"; writes --report
    # leaving the block stops the /metrics server

What is built: a time-series recorder (always: the diagnosis needs it), the
Prometheus exporter (with --metrics-port), and unless --quiet or --json the
live panel (rich), which replaces the progress bar on a terminal and writes
plain lines beside it elsewhere. With --quiet or --json no panel or bar is
built at all, so nothing is drawn. Everything writes to stderr; stdout stays
the command's own.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import TextIO

from rich.console import Console

from kvswap.config import KvSwapConfig
from kvswap.control.metrics import KVMetrics
from kvswap.errors import KvSwapError
from kvswap.obs.diagnosis import diagnose, resolve_link_gb_per_s, tail_summary
from kvswap.obs.live import LivePanel
from kvswap.obs.observer import StepObserver
from kvswap.obs.progress import ProgressBar
from kvswap.obs.prometheus import PrometheusExporter
from kvswap.obs.report import RunReport, write_report
from kvswap.obs.timeseries import TimeSeriesRecorder
from kvswap.obs.watermarks import Watermarks
from kvswap.progress import RequestProgress
from kvswap.signals import Terminated
from kvswap.staged_dir import note_not_written

#: How long `run --metrics-port` keeps serving after the run, so a scrape sees the end.
DEFAULT_METRICS_LINGER_S = 5.0


def add_monitoring_arguments(
    parser: argparse.ArgumentParser, *, report: bool = True, linger: bool = False
) -> None:
    """--metrics-port/-host and --report; `linger`: --metrics-linger-s too (a run in real
    time, whose last values a scraper would otherwise miss)."""
    group = parser.add_argument_group("monitoring")
    group.add_argument(
        "--metrics-port", type=int, metavar="PORT", default=None,
        help="serve Prometheus metrics at http://HOST:PORT/metrics while running (0: any port)",
    )  # fmt: skip
    group.add_argument(
        "--metrics-host", metavar="HOST", default="127.0.0.1",
        help="address for --metrics-port (default 127.0.0.1; 0.0.0.0 exposes it to the network)",
    )  # fmt: skip
    if linger:
        group.add_argument(
            "--metrics-linger-s", type=float, default=DEFAULT_METRICS_LINGER_S, metavar="S",
            help="with --metrics-port: keep serving the final values this long after the run "
            "(default %(default)s; a stop signal ends it early)",
        )  # fmt: skip
    if report:
        group.add_argument(
            "--report", metavar="DIR", default=None,
            help="write report.json, PNG plots and index.html into DIR",
        )  # fmt: skip


def check_monitoring_arguments(args: argparse.Namespace) -> None:
    """The monitoring flags no reader checks, before any work starts."""
    linger_s = getattr(args, "metrics_linger_s", 0.0)
    if not math.isfinite(linger_s) or linger_s < 0:
        raise KvSwapError(f"--metrics-linger-s {linger_s}: allowed: a number of seconds >= 0")


class Monitoring:
    """The observers and progress callback for one run, and what happens after it."""

    def __init__(
        self,
        *,
        config: KvSwapConfig,
        recorder: TimeSeriesRecorder,
        exporter: PrometheusExporter | None,
        panel: LivePanel | None,
        progress: RequestProgress | None,
        report_dir: str | None,
        run_info: Mapping[str, object],
        watermarks: Watermarks,
        link_gb_per_s: float | None,
        stream: TextIO | None,
        engine_model: Mapping[str, str] | None = None,
        linger_s: float = 0.0,
    ):
        self.linger_s = linger_s
        self.config = config
        # The configuration a report shows: an engine run's model is the one it ran
        # (source, dtype, device), not [model]'s sizing defaults, and it simulated nothing.
        self.config_view: dict[str, object] = config.model_dump(mode="json")
        if engine_model is not None:
            self.config_view["model"] = dict(engine_model)
            self.config_view.pop("simulator", None)
        self.recorder = recorder
        self.exporter = exporter
        self.panel = panel
        self.progress = progress
        self.report_dir = report_dir
        self.run_info = dict(run_info)
        self.watermarks = watermarks
        self.link_gb_per_s = link_gb_per_s
        self.stream = stream  # None: say nothing (--quiet)
        self.observers: tuple[StepObserver, ...] = tuple(
            o for o in (recorder, exporter, panel) if o is not None
        )
        # A report that could not be written: the command prints its summary first,
        # then raises this, so a failed write never throws the run's result away.
        self.report_error: KvSwapError | None = None
        self.report_written = False

    def finish(self, summary: dict[str, object]) -> dict[str, object]:
        """The summary plus `diagnosis` (a list of findings); writes the report if asked.

        A failure to write the report is kept in `report_error`, not raised.
        """
        series = self.recorder.series()
        findings = diagnose(summary, series, link_gb_per_s=self.link_gb_per_s)
        tail = tail_summary(series, summary)
        out = {
            **summary,
            **({"tail_attribution": tail} if tail is not None else {}),
            "diagnosis": [f.to_json() for f in findings],
        }
        if self.report_dir is not None:
            label = self.run_info.get("label")
            report = RunReport(
                label=label if isinstance(label, str) else Path(self.report_dir).resolve().name,
                run=self.run_info,
                config=self.config_view,
                summary=out,
                series=series,
                findings=tuple(findings),
                watermarks=self.watermarks,
                link_gb_per_s=resolve_link_gb_per_s(out, self.link_gb_per_s)[
                    0
                ],  # as the diagnosis used
            )
            try:
                page = write_report(report, self.report_dir)
            except KvSwapError as error:
                self.report_error = error
            except OSError as error:
                reason = error.strerror or str(error)
                self.report_error = KvSwapError(
                    f"--report {self.report_dir}: cannot write ({reason})"
                )
            else:
                self.report_written = True
                self._say(f"report: {page}")
        return out

    def _say(self, text: str) -> None:
        if self.stream is not None:
            self.stream.write(text + "\n")
            self.stream.flush()

    def linger(self) -> None:
        """With --metrics-port: keep /metrics up `linger_s` more, once the run is over and
        its summary printed, so a scraper sees the final values. A stop signal ends it
        early, like any stop."""
        if self.exporter is not None and self.linger_s > 0:
            self._say(f"metrics: serving the final values for {self.linger_s:g} s more")
            time.sleep(self.linger_s)

    def close(self) -> None:
        if self.panel is not None:
            self.panel.close()  # a run that raised leaves no half-drawn panel behind
        if self.exporter is not None:
            self.exporter.close()

    def __enter__(self) -> Monitoring:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
        # A stop before or while the report was written: the stop line says there is none
        # (`write_report` left nothing on disk).
        stopped = isinstance(exc, KeyboardInterrupt | Terminated)
        if stopped and exc is not None and self.report_dir is not None and not self.report_written:
            note_not_written(exc, "--report", self.report_dir)


def build_monitoring(
    args: argparse.Namespace,
    config: KvSwapConfig,
    *,
    block_bytes: int,
    kv_metrics: KVMetrics | None = None,
    remote_counters: Callable[[], Mapping[str, int]] | None = None,
    run_info: Mapping[str, object] | None = None,
    link_gb_per_s: float | None = None,
    label: str = "requests",
    stream: TextIO | None = None,
    engine_model: Mapping[str, str] | None = None,
) -> Monitoring:
    """Observers for a run from the parsed flags (`metrics_port`, `metrics_host`, `report`,
    `quiet`, `json`; missing ones count as unset). Starts the /metrics server at once.

    `block_bytes` sizes tiers in bytes; `kv_metrics` (the swapper's registry) feeds the
    counters that steps do not carry; `link_gb_per_s` is the host<->device link for the
    diagnosis (None: the summary's `link_gb_per_s`, else 25 GB/s); `stream` defaults to stderr.
    `engine_model`: the model an engine run ran ({"source", "dtype", "device"}), shown in
    the report instead of the configuration's [model] (which sizes simulations).
    """
    out = stream if stream is not None else sys.stderr
    quiet = bool(getattr(args, "quiet", False))
    as_json = bool(getattr(args, "json", False))
    watermarks = Watermarks.from_config(config)
    recorder = TimeSeriesRecorder()
    exporter = _exporter(args, config, block_bytes, kv_metrics, watermarks, remote_counters)
    if exporter is not None and not exporter.on_loopback:
        # Said even with --quiet: an open port is a security decision, not progress.
        out.write(
            f"kvswap: warning: --metrics-host {args.metrics_host} is not a loopback address; "
            f"/metrics on port {exporter.port} is reachable from other machines\n"
        )
    if exporter is not None and not quiet:
        out.write(f"metrics: http://{_host_for_url(args.metrics_host)}:{exporter.port}/metrics\n")
    panel: LivePanel | None = None
    progress: RequestProgress | None = None
    if not (quiet or as_json):
        console = Console(file=out)
        panel = LivePanel(console, watermarks=watermarks, label=label, link_gb_per_s=link_gb_per_s)
        if panel.tty:
            progress = panel.progress
        else:
            progress = _both(ProgressBar(label, console).update, panel.progress)
    report_dir = getattr(args, "report", None)
    return Monitoring(
        config=config,
        recorder=recorder,
        exporter=exporter,
        panel=panel,
        progress=progress,
        report_dir=report_dir if isinstance(report_dir, str) else None,
        run_info=run_info or {},
        watermarks=watermarks,
        link_gb_per_s=link_gb_per_s,
        stream=None if quiet else out,
        engine_model=engine_model,
        linger_s=float(getattr(args, "metrics_linger_s", 0.0)),
    )


def _exporter(
    args: argparse.Namespace,
    config: KvSwapConfig,
    block_bytes: int,
    kv_metrics: KVMetrics | None,
    watermarks: Watermarks,
    remote_counters: Callable[[], Mapping[str, int]] | None,
) -> PrometheusExporter | None:
    port = getattr(args, "metrics_port", None)
    if port is None:
        return None
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise KvSwapError(f"--metrics-port {port}: allowed 0..65535 (0 picks a free port)")
    exporter = PrometheusExporter(
        block_bytes=block_bytes,
        block_tokens=config.cache.kv_block_tokens,
        watermarks=watermarks,
        kv_metrics=kv_metrics,
        remote_counters=remote_counters,
    )
    exporter.serve(str(getattr(args, "metrics_host", "127.0.0.1")), port)
    return exporter


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _both(first: RequestProgress, second: RequestProgress) -> RequestProgress:
    def progress(done: int, total: int) -> None:
        first(done, total)
        second(done, total)

    return progress
