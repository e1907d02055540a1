"""Run reports on disk: `report.json`, PNG plots and an `index.html`, per run;
and one comparison page over several runs (`kvswap report A B`).

    DIR/report.json        {"version", "label", "run", "config", "summary",
                            "diagnosis", "watermarks", "link_gb_per_s", "time_series"}
                           and, for a load test, "requests": one record per request
    DIR/*.png              an engine run: latency CDF, tier occupancy, link throughput,
                           swap-wait share; a load test: latency CDF, TTFT CDF, throughput
    DIR/index.html         the page (relative links only: copy DIR anywhere)

Two kinds of run share the format. An engine run (`kvswap run`, `simulate`) has
the engine's configuration, watermarks and diagnosis. A load test of a server
(`kvswap loadgen`, `run.command == "loadgen"`) has the load generator's settings
as `config`, `watermarks: null`, the load-test findings (`obs/loadgen_findings.py`)
as its diagnosis and per-request records (`requests`); its series holds only what
the client saw (latencies, tokens, requests in flight), and its page adds the
sections of `obs/loadgen_page.py`. A comparison of load tests uses the load-test
rows and plots; one mixing both kinds shows what both have.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvswap.errors import KvSwapError
from kvswap.obs.diagnosis import diagnose_change
from kvswap.obs.finding import Finding
from kvswap.obs.html import (
    LOADGEN_NO_FINDING,
    LOADGEN_SUMMARY_ROWS,
    NO_FINDING,
    SUMMARY_ROWS,
    Row,
    comparison_page,
    run_page,
)
from kvswap.obs.jsonvalues import as_mapping, lookup, number
from kvswap.obs.loadgen_page import loadgen_sections
from kvswap.obs.plots import LOADGEN_PLOT_FILES, PLOT_FILES, PlotRun, write_plots
from kvswap.obs.timeseries import TimeSeries
from kvswap.obs.watermarks import Watermarks
from kvswap.readers import REPORT_JSON_FILE, parse_json, read_user_file
from kvswap.staged_dir import staged_dir

REPORT_FILE = "report.json"
INDEX_FILE = "index.html"
REPORT_VERSION = 1
LOADGEN_COMMAND = "loadgen"
#: The rows both kinds of run fill: requests, tokens, duration, throughput, latencies.
_SHARED_ROWS = 7


@dataclass(frozen=True)
class RunReport:
    label: str
    run: dict[str, object]  # what ran: command, model, workload
    config: dict[str, object]  # the validated configuration, by section
    summary: dict[str, object]  # the --json object
    series: TimeSeries = field(compare=False)
    findings: tuple[Finding, ...]
    watermarks: Watermarks | None  # None: a load test of a server (no engine of ours)
    link_gb_per_s: float | None = None
    # A load test's per-request records (`RequestRecord.to_json`); () for an engine run.
    requests: tuple[Mapping[str, object], ...] = field(default=(), compare=False)

    @property
    def is_loadgen(self) -> bool:
        return self.run.get("command") == LOADGEN_COMMAND

    def plot_run(self, label: str | None = None) -> PlotRun:
        return PlotRun(label or self.label, self.series, self.watermarks, self.link_gb_per_s)

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = {
            "version": REPORT_VERSION,
            "label": self.label,
            "run": self.run,
            "config": self.config,
            "summary": self.summary,
            "diagnosis": [f.to_json() for f in self.findings],
            "watermarks": None if self.watermarks is None else self.watermarks.to_json(),
            "link_gb_per_s": self.link_gb_per_s,
            "time_series": self.series.to_json(),
        }
        if self.is_loadgen:
            data["requests"] = [dict(r) for r in self.requests]
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, object], where: str = REPORT_FILE) -> RunReport:
        """The report in `data`; a KvSwapError naming the first invalid field.

        The lenient per-part readers would put defaults in place of a corrupt value, so
        every field they read is type-checked here first: a corrupt report is an error.
        """
        if data.get("version") != REPORT_VERSION:
            raise KvSwapError(
                f"{where}: report version {data.get('version')!r} is not supported; "
                f"this kvswap reads version {REPORT_VERSION} (rerun with --report)"
            )
        _check_fields(data, where)
        diagnosis = lookup(data, "diagnosis")
        label = data.get("label")
        return cls(
            label=label if isinstance(label, str) else Path(where).parent.name,
            run=dict(as_mapping(data.get("run", {}), f"{where}: run")),
            config=dict(as_mapping(data.get("config", {}), f"{where}: config")),
            summary=dict(as_mapping(data.get("summary", {}), f"{where}: summary")),
            series=TimeSeries.from_json(as_mapping(data.get("time_series", {}), where)),
            findings=tuple(
                Finding.from_json(as_mapping(f, f"{where}: diagnosis"))
                for f in (diagnosis if isinstance(diagnosis, list) else [])
            ),
            watermarks=(
                None
                if "watermarks" in data and data["watermarks"] is None
                else Watermarks.from_json(as_mapping(data.get("watermarks", {}), where))
            ),
            link_gb_per_s=number(data, "link_gb_per_s"),
            requests=tuple(
                as_mapping(r, f"{where}: requests") for r in _list(data.get("requests"))
            ),
        )


def _invalid(where: str, field_name: str, value: object, allowed: str) -> KvSwapError:
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return KvSwapError(f"{where}: field {field_name} = {shown} is invalid; expected {allowed}")


def _objects(where: str, data: Mapping[str, Any], name: str) -> list[Mapping[str, Any]]:
    """`data[name]` (absent: empty), checked to be a list of objects."""
    items = data.get(name, [])
    if not isinstance(items, list):
        raise _invalid(where, name, items, "a list")
    for index, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise _invalid(where, f"{name}[{index}]", item, "an object")
    return items


def _list(value: object) -> list[object]:
    return value if isinstance(value, list) else []


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _in_range(
    value: object, low: float, high: float | None, *, low_inclusive: bool = False
) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    above = value >= low if low_inclusive else value > low
    return above and (high is None or value <= high)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_map(where: str, name: str, value: object, check: Callable[[object], bool]) -> None:
    if not isinstance(value, Mapping):
        raise _invalid(where, name, value, "an object")
    for key, item in value.items():
        if not check(item):
            raise _invalid(where, f"{name}.{key}", item, "a number")


_POINT_NUMBERS = ("start_s", "end_s", "step_s", "swap_wait_s")
_POINT_COUNTS = ("num_steps", "num_running", "num_waiting", "num_preempted", "tokens_generated")
_POINT_NUMBER_MAPS = ("usage_mean_by_tier", "usage_max_by_tier")
_POINT_COUNT_MAPS = ("bytes_by_direction", "used_blocks_by_tier", "capacity_blocks_by_tier")


def _check_point(where: str, name: str, point: object) -> None:
    if not isinstance(point, Mapping):
        raise _invalid(where, name, point, "an object")
    for key in _POINT_NUMBERS:
        if key in point and not _is_number(point[key]):
            raise _invalid(where, f"{name}.{key}", point[key], "a number")
    for key in _POINT_COUNTS:
        if key in point and not _is_count(point[key]):
            raise _invalid(where, f"{name}.{key}", point[key], "a whole number >= 0")
    for key in _POINT_NUMBER_MAPS:
        if key in point:
            _check_map(where, f"{name}.{key}", point[key], _is_number)
    for key in _POINT_COUNT_MAPS:
        if key in point:
            _check_map(where, f"{name}.{key}", point[key], _is_count)


def _check_fields(data: Mapping[str, object], where: str) -> None:
    """Raise naming the first field whose type or value the report cannot use."""
    label = data.get("label")
    if label is not None and not isinstance(label, str):
        raise _invalid(where, "label", label, "a string")
    for key in ("run", "config", "summary", "time_series"):
        if key in data and not isinstance(data[key], Mapping):
            raise _invalid(where, key, data[key], "an object")
    if data.get("watermarks") is not None and not isinstance(data["watermarks"], Mapping):
        raise _invalid(where, "watermarks", data["watermarks"], "an object or null")
    link = data.get("link_gb_per_s")
    if link is not None and not _in_range(link, 0.0, None):
        raise _invalid(where, "link_gb_per_s", link, "a number > 0 or null")
    watermarks = data.get("watermarks", {})
    if isinstance(watermarks, Mapping):
        for key in Watermarks.__dataclass_fields__:
            value = watermarks.get(key)
            if key in watermarks and not _in_range(value, 0.0, 1.0, low_inclusive=True):
                raise _invalid(where, f"watermarks.{key}", value, "a fraction in [0, 1]")
    _objects(where, data, "requests")
    for index, finding in enumerate(_objects(where, data, "diagnosis")):
        for key in ("rule", "symptom", "metric", "figure", "cause", "advice"):
            if key in finding and not isinstance(finding[key], str):
                raise _invalid(where, f"diagnosis[{index}].{key}", finding[key], "a string")
        if "values" in finding:
            _check_map(where, f"diagnosis[{index}].values", finding["values"], _is_number)
    series = data.get("time_series", {})
    points = series.get("points", []) if isinstance(series, Mapping) else []
    if not isinstance(points, list):
        raise _invalid(where, "time_series.points", points, "a list")
    for index, point in enumerate(points):
        _check_point(where, f"time_series.points[{index}]", point)


def write_report(
    report: RunReport, out_dir: str | os.PathLike[str], flag: str = "--report"
) -> Path:
    """Write report.json, the plots and index.html into `out_dir`, all at once (or none:
    `staged_dir`); returns the page."""
    with staged_dir(out_dir, flag, last=INDEX_FILE) as staging:
        (staging / REPORT_FILE).write_text(json.dumps(report.to_json(), indent=1) + "\n")
        _write_run_page(report, staging)
    return Path(out_dir) / INDEX_FILE


def write_report_page(
    report: RunReport, out_dir: str | os.PathLike[str], flag: str = "--report"
) -> Path:
    """The plots and index.html of one run into `out_dir`, never report.json (which
    `kvswap report` only reads), all at once; returns the page. `flag` names the option
    in errors."""
    with staged_dir(out_dir, flag, last=INDEX_FILE) as staging:
        _write_run_page(report, staging)
    return Path(out_dir) / INDEX_FILE


def _write_run_page(report: RunReport, out: Path) -> None:
    files, rows, no_finding = _layout([report])
    plots = write_plots([report.plot_run()], out, files)
    command = LOADGEN_COMMAND if report.is_loadgen else "run"
    sections = loadgen_sections(report.summary, len(report.requests)) if report.is_loadgen else []
    page = run_page(
        f"kvswap {command} report: {report.label}",
        report.run,
        report.summary,
        report.config,
        report.findings,
        plots,
        rows,
        no_finding,
        sections,
    )
    (out / INDEX_FILE).write_text(page)


def load_report(run_dir: str | os.PathLike[str]) -> RunReport:
    """The report in `run_dir`/report.json; one-line errors naming the file (and field)."""
    path = Path(run_dir) / REPORT_FILE
    if not path.exists():  # a FIFO or a directory there is refused by read_user_file
        raise KvSwapError(
            f"{run_dir}: no {REPORT_FILE} there; write one with `kvswap run --report {run_dir}` "
            "(or simulate, loadgen)"
        )
    try:
        raw = read_user_file(path, str(path), REPORT_JSON_FILE)
    except OSError as error:
        raise KvSwapError(f"{path}: cannot read the report ({error.strerror})") from None
    # parse_json turns binary, deep nesting, bad syntax and NaN/Infinity into one line each.
    data = parse_json(raw, str(path))
    return RunReport.from_json(as_mapping(data, str(path)), str(path))


def unique_labels(reports: Sequence[RunReport], dirs: Sequence[Path]) -> list[str]:
    """Each run's label, made unique with its directory when two runs share one."""
    labels = [r.label for r in reports]
    return [
        f"{label} ({d})" if labels.count(label) > 1 else label
        for label, d in zip(labels, dirs, strict=True)
    ]


def write_comparison(
    reports: Sequence[RunReport],
    dirs: Sequence[Path],
    out_dir: str | os.PathLike[str],
    flag: str = "--out",
) -> Path:
    """One page comparing the runs side by side, plots overlaid; returns the page."""
    if not reports:
        raise KvSwapError("kvswap report: give at least one report directory")
    out = Path(out_dir)
    labels = unique_labels(reports, dirs)
    files, rows, no_finding = _layout(reports)
    plot_runs = [r.plot_run(label) for r, label in zip(reports, labels, strict=True)]
    # Relative to where the page will be, not to where it is staged.
    links = [
        Path(os.path.relpath(Path(d).resolve() / INDEX_FILE, out.resolve())).as_posix()
        for d in dirs
    ]
    base = reports[0]
    # The latency-trend rules read an engine's own tail; between two servers (or a
    # server and an engine) a latency change has other causes, so none is claimed.
    changes = [None] + [
        None if base.is_loadgen or r.is_loadgen else diagnose_change(base.summary, r.summary)
        for r in reports[1:]
    ]
    with staged_dir(out_dir, flag, last=INDEX_FILE) as staging:
        plots = write_plots(plot_runs, staging, files)
        page = comparison_page(
            f"kvswap comparison: {' vs '.join(labels)}",
            labels,
            links,
            [r.summary for r in reports],
            [{"run": r.run, **r.config} for r in reports],
            [r.findings for r in reports],
            changes,
            plots,
            rows,
            no_finding,
        )
        (staging / INDEX_FILE).write_text(page)
    return out / INDEX_FILE


def _layout(reports: Sequence[RunReport]) -> tuple[dict[str, str], Sequence[Row], str]:
    """The plots, summary rows and empty-diagnosis text for a page over `reports`."""
    kinds = {r.is_loadgen for r in reports}
    if kinds == {False}:
        return PLOT_FILES, SUMMARY_ROWS, NO_FINDING
    rows = LOADGEN_SUMMARY_ROWS if kinds == {True} else SUMMARY_ROWS[:_SHARED_ROWS]
    return LOADGEN_PLOT_FILES, rows, LOADGEN_NO_FINDING if kinds == {True} else NO_FINDING
