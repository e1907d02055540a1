"""Run reports on disk: `report.json`, four PNG plots and an `index.html`, per run;
and one comparison page over several runs (`kvswap report A B`).

    DIR/report.json        {"version", "label", "run", "config", "summary",
                            "diagnosis", "watermarks", "link_gb_per_s", "time_series"}
    DIR/*.png              latency CDF, tier occupancy, link throughput, swap-wait share
    DIR/index.html         the page (relative links only: copy DIR anywhere)
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvswap.errors import KvSwapError
from kvswap.obs.diagnosis import Finding, diagnose_change
from kvswap.obs.html import comparison_page, run_page
from kvswap.obs.jsonvalues import as_mapping, lookup, number
from kvswap.obs.plots import PlotRun, write_plots
from kvswap.obs.timeseries import TimeSeries
from kvswap.obs.watermarks import Watermarks

REPORT_FILE = "report.json"
INDEX_FILE = "index.html"
REPORT_VERSION = 1


@dataclass(frozen=True)
class RunReport:
    label: str
    run: dict[str, object]  # what ran: command, model, workload
    config: dict[str, object]  # the validated configuration, by section
    summary: dict[str, object]  # the --json object
    series: TimeSeries = field(compare=False)
    findings: tuple[Finding, ...]
    watermarks: Watermarks
    link_gb_per_s: float | None = None

    def plot_run(self, label: str | None = None) -> PlotRun:
        return PlotRun(label or self.label, self.series, self.watermarks, self.link_gb_per_s)

    def to_json(self) -> dict[str, object]:
        return {
            "version": REPORT_VERSION,
            "label": self.label,
            "run": self.run,
            "config": self.config,
            "summary": self.summary,
            "diagnosis": [f.to_json() for f in self.findings],
            "watermarks": self.watermarks.to_json(),
            "link_gb_per_s": self.link_gb_per_s,
            "time_series": self.series.to_json(),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, object], where: str = REPORT_FILE) -> RunReport:
        if data.get("version") != REPORT_VERSION:
            raise KvSwapError(
                f"{where}: report version {data.get('version')!r} is not supported; "
                f"this kvswap reads version {REPORT_VERSION} (rerun with --report)"
            )
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
            watermarks=Watermarks.from_json(as_mapping(data.get("watermarks", {}), where)),
            link_gb_per_s=number(data, "link_gb_per_s"),
        )


def write_report(report: RunReport, out_dir: str | os.PathLike[str]) -> Path:
    """Write report.json, the plots and index.html into `out_dir`; returns the page."""
    out = _writable_dir(out_dir)
    (out / REPORT_FILE).write_text(json.dumps(report.to_json(), indent=1) + "\n")
    plots = write_plots([report.plot_run()], out)
    page = run_page(
        f"kvswap run report: {report.label}",
        report.run,
        report.summary,
        report.config,
        report.findings,
        plots,
    )
    (out / INDEX_FILE).write_text(page)
    return out / INDEX_FILE


def load_report(run_dir: str | os.PathLike[str]) -> RunReport:
    path = Path(run_dir) / REPORT_FILE
    if not path.is_file():
        raise KvSwapError(
            f"{run_dir}: no {REPORT_FILE} there; write one with `kvswap run --report {run_dir}`"
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise KvSwapError(f"{path}: cannot read the report ({error})") from None
    return RunReport.from_json(as_mapping(data, str(path)), str(path))


def unique_labels(reports: Sequence[RunReport], dirs: Sequence[Path]) -> list[str]:
    """Each run's label, made unique with its directory when two runs share one."""
    labels = [r.label for r in reports]
    return [
        f"{label} ({d})" if labels.count(label) > 1 else label
        for label, d in zip(labels, dirs, strict=True)
    ]


def write_comparison(
    reports: Sequence[RunReport], dirs: Sequence[Path], out_dir: str | os.PathLike[str]
) -> Path:
    """One page comparing the runs side by side, plots overlaid; returns the page."""
    if not reports:
        raise KvSwapError("kvswap report: give at least one report directory")
    out = _writable_dir(out_dir)
    labels = unique_labels(reports, dirs)
    plots = write_plots([r.plot_run(label) for r, label in zip(reports, labels, strict=True)], out)
    links = [
        Path(os.path.relpath(Path(d).resolve() / INDEX_FILE, out.resolve())).as_posix()
        for d in dirs
    ]
    base = reports[0].summary
    changes = [None] + [diagnose_change(base, r.summary) for r in reports[1:]]
    page = comparison_page(
        f"kvswap comparison: {' vs '.join(labels)}",
        labels,
        links,
        [r.summary for r in reports],
        [{"run": r.run, **r.config} for r in reports],
        [r.findings for r in reports],
        changes,
        plots,
    )
    (out / INDEX_FILE).write_text(page)
    return out / INDEX_FILE


def _writable_dir(path: str | os.PathLike[str]) -> Path:
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise KvSwapError(f"--report {path}: cannot create the directory ({error})") from None
    if not out.is_dir():
        raise KvSwapError(f"--report {path}: not a directory")
    return out
