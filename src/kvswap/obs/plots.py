"""The report's pictures, as PNG files; several runs are drawn overlaid.

matplotlib's object API with the Agg canvas: no pyplot, no global backend
switch, no display needed, safe to call from any thread. Every function takes
a list of runs, so a single-run report and `kvswap report A B` share the code:
run i is drawn in colour Ci everywhere.

Two sets: an engine run (`run`, `simulate`) draws PLOT_FILES (token latency,
tier occupancy, link throughput, swap-wait share); a load test against a
server (`loadgen`), which sees only what comes back over HTTP, draws
LOADGEN_PLOT_FILES (token latency, TTFT, output tokens per second and
requests in flight), which any run's series also has.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullFormatter

from kvswap.obs.quantiles import LogHistogram
from kvswap.obs.rates import rate_unit
from kvswap.obs.timeseries import SeriesPoint, TimeSeries
from kvswap.obs.watermarks import Watermarks

PLOT_FILES: dict[str, str] = {
    "latency_cdf": "latency_cdf.png",
    "tier_occupancy": "tier_occupancy.png",
    "link_throughput": "link_throughput.png",
    "swap_wait_share": "swap_wait_share.png",
}
LOADGEN_PLOT_FILES: dict[str, str] = {
    "latency_cdf": "latency_cdf.png",
    "ttft_cdf": "ttft_cdf.png",
    "token_throughput": "token_throughput.png",
}
PLOT_TITLES: dict[str, str] = {
    "latency_cdf": "Token latency CDF",
    "tier_occupancy": "Tier occupancy over time",
    "link_throughput": "Link throughput per direction",
    "swap_wait_share": "Swap-wait share over time",
    "ttft_cdf": "Time to first token CDF",
    "token_throughput": "Output tokens per second and requests in flight",
}
_TIER_TITLES = {"gpu": "GPU", "cpu": "CPU (pinned pool)", "nvme": "NVMe"}
_DIRECTION_TITLES = {
    "gpu_to_cpu": "GPU -> CPU (write, swap-out)",
    "cpu_to_gpu": "CPU -> GPU (read, swap-in)",
    "cpu_to_nvme": "CPU -> NVMe",
    "nvme_to_cpu": "NVMe -> CPU",
}
_DPI = 100


@dataclass(frozen=True)
class PlotRun:
    label: str
    series: TimeSeries
    watermarks: Watermarks | None  # None: not an engine run (a load test of a server)
    link_gb_per_s: float | None = None
    write_link_share: float = 0.60  # the diagnosis threshold drawn on the write plot
    swap_wait_limit: float = 0.10


def write_plots(
    runs: Sequence[PlotRun], out_dir: Path, files: Mapping[str, str] = PLOT_FILES
) -> dict[str, str]:
    """Write the PNGs of `files` (PLOT_FILES or LOADGEN_PLOT_FILES) into `out_dir`;
    returns {plot name: file name}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    painters: dict[str, Callable[[Sequence[PlotRun]], Figure]] = {
        "latency_cdf": latency_cdf,
        "tier_occupancy": tier_occupancy,
        "link_throughput": link_throughput,
        "swap_wait_share": swap_wait_share,
        "ttft_cdf": ttft_cdf,
        "token_throughput": token_throughput,
    }
    for name, file in files.items():
        figure = painters[name](runs)
        figure.savefig(out_dir / file, dpi=_DPI)
    return dict(files)


def _figure(rows: int = 1, height_in: float = 3.6) -> tuple[Figure, list[Axes]]:
    figure = Figure(figsize=(8.0, max(height_in, 2.3 * rows)), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = [figure.add_subplot(rows, 1, i + 1) for i in range(rows)]
    return figure, axes


def _no_data(axes: Axes, text: str = "no data") -> None:
    axes.text(0.5, 0.5, text, ha="center", va="center", transform=axes.transAxes, color="0.4")


def _stairs(
    axes: Axes, points: Sequence[SeriesPoint], value: Callable[[SeriesPoint], float], **kw: object
) -> None:
    """One value per window, drawn flat across the window."""
    edges = [points[0].start_s] + [p.end_s for p in points]
    axes.stairs([value(p) for p in points], edges, baseline=None, **kw)  # type: ignore[arg-type]


def _usage_pct(tier: str) -> Callable[[SeriesPoint], float]:
    return lambda point: 100 * point.usage_mean_by_tier.get(tier, 0.0)


def _gb_per_s(direction: str, scale: float) -> Callable[[SeriesPoint], float]:
    return lambda point: point.gb_per_s(direction) * scale


def _finish(figure: Figure, axes: list[Axes], title: str, runs: Sequence[PlotRun]) -> Figure:
    figure.suptitle(title)
    axes[-1].set_xlabel("run time (s)")
    for a in axes:
        if a.get_legend_handles_labels()[0]:
            # Outside the axes, on the right: occupancy and rates fill the whole height.
            a.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    for a in axes:
        a.grid(alpha=0.3)
    return figure


def latency_cdf(runs: Sequence[PlotRun]) -> Figure:
    return _cdf(
        runs,
        lambda series: series.itl,
        PLOT_TITLES["latency_cdf"] + " (inter-token latency)",
        "no token latencies",
        "fraction of tokens",
    )


def ttft_cdf(runs: Sequence[PlotRun]) -> Figure:
    return _cdf(
        runs,
        lambda series: series.ttft,
        PLOT_TITLES["ttft_cdf"],
        "no first tokens",
        "fraction of requests",
    )


def _cdf(
    runs: Sequence[PlotRun],
    histogram: Callable[[TimeSeries], LogHistogram],
    title: str,
    empty_text: str,
    y_label: str,
) -> Figure:
    figure, (axes,) = _figure()
    drawn = False
    for i, run in enumerate(runs):
        cdf = histogram(run.series).cdf()
        if not cdf:
            continue
        xs = [value_s * 1e3 for value_s, _ in cdf]
        ys = [fraction for _, fraction in cdf]
        axes.step(xs, ys, where="post", color=f"C{i}", label=run.label)
        drawn = True
    if drawn:
        axes.set_xscale("log")
        axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:g}"))
        axes.xaxis.set_minor_formatter(NullFormatter())
        for level in (0.50, 0.95, 0.99):
            axes.axhline(level, color="0.6", linewidth=0.8, linestyle=":")
            axes.annotate(f"P{level * 100:g}", (0.005, level), xycoords=("axes fraction", "data"),
                          fontsize="x-small", color="0.4", va="top")  # fmt: skip
    else:
        _no_data(axes, empty_text)
    axes.set_ylim(0, 1.02)
    axes.set_ylabel(y_label)
    figure.suptitle(title)
    axes.set_xlabel("latency (ms)")
    axes.grid(alpha=0.3)
    if drawn:
        axes.legend(loc="lower right", fontsize="small")
    return figure


def _watermark_lines(ax: Axes, tier: str, runs: Sequence[PlotRun]) -> None:
    """High (dashed) and low (dotted) watermarks: once in grey when every run has the
    same, else once per run in its colour."""
    levels = [None if run.watermarks is None else run.watermarks.for_tier(tier) for run in runs]
    if not levels or levels[0] is None:
        return
    shared = all(level == levels[0] for level in levels)
    for i, (run, level) in enumerate(zip(runs, levels, strict=True)):
        if level is None or (shared and i > 0):
            continue
        colour, tag = ("0.35", "") if shared else (f"C{i}", f" ({run.label})")
        high, low = level
        ax.axhline(100 * high, color=colour, linestyle="--", linewidth=1,
                   label=f"high watermark {100 * high:.0f}%{tag}")  # fmt: skip
        ax.axhline(100 * low, color=colour, linestyle=":", linewidth=1,
                   label=f"low watermark {100 * low:.0f}%{tag}")  # fmt: skip


def tier_occupancy(runs: Sequence[PlotRun]) -> Figure:
    tiers = [
        tier for tier in ("gpu", "cpu", "nvme")
        if tier == "gpu" or any(
            p.capacity_blocks_by_tier.get(tier, 0) for r in runs for p in r.series.points
        )
    ]  # fmt: skip
    figure, axes = _figure(len(tiers))
    for ax, tier in zip(axes, tiers, strict=True):
        for i, run in enumerate(runs):
            points = run.series.points
            if points:
                _stairs(ax, points, _usage_pct(tier), color=f"C{i}", label=run.label)
        _watermark_lines(ax, tier, runs)
        if not any(r.series.points for r in runs):
            _no_data(ax)
        ax.set_ylim(0, 105)
        ax.set_ylabel("% of slots")
        ax.set_title(_TIER_TITLES[tier], fontsize="medium", loc="left")
    return _finish(figure, axes, PLOT_TITLES["tier_occupancy"], runs)


def link_throughput(runs: Sequence[PlotRun]) -> Figure:
    directions = [
        d for d in _DIRECTION_TITLES
        if d in ("gpu_to_cpu", "cpu_to_gpu") or any(
            p.bytes_by_direction.get(d, 0) for r in runs for p in r.series.points
        )
    ]  # fmt: skip
    figure, axes = _figure(len(directions))
    peak = max(
        (p.gb_per_s(d) for r in runs for p in r.series.points for d in directions), default=0.0
    )
    scale, unit = rate_unit(peak)
    for ax, direction in zip(axes, directions, strict=True):
        for i, run in enumerate(runs):
            if run.series.points:
                _stairs(ax, run.series.points, _gb_per_s(direction, scale), color=f"C{i}",
                        label=run.label)  # fmt: skip
        if direction == "gpu_to_cpu":
            for i, run in enumerate(runs):
                if run.link_gb_per_s is None:
                    continue
                limit = run.write_link_share * run.link_gb_per_s
                # Draw the limit only when it is on the data's scale; else it flattens the plot.
                if limit <= 3 * peak:
                    ax.axhline(limit * scale, color=f"C{i}", linestyle="--", linewidth=1,
                               label=f"{100 * run.write_link_share:.0f}% of link")  # fmt: skip
        if not any(r.series.points for r in runs):
            _no_data(ax)
        ax.set_ylim(bottom=0)
        ax.set_ylabel(unit)
        ax.set_title(_DIRECTION_TITLES[direction], fontsize="medium", loc="left")
    return _finish(figure, axes, PLOT_TITLES["link_throughput"], runs)


def swap_wait_share(runs: Sequence[PlotRun]) -> Figure:
    figure, axes = _figure()
    ax = axes[0]
    for i, run in enumerate(runs):
        if run.series.points:
            _stairs(ax, run.series.points, lambda p: 100 * p.swap_wait_share, color=f"C{i}",
                    label=run.label)  # fmt: skip
    limit = runs[0].swap_wait_limit if runs else 0.10
    ax.axhline(100 * limit, color="0.3", linestyle="--", linewidth=1,
               label=f"{100 * limit:.0f}%: prefetch or eviction is wrong")  # fmt: skip
    if not any(r.series.points for r in runs):
        _no_data(ax)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("% of step time")
    return _finish(figure, axes, PLOT_TITLES["swap_wait_share"], runs)


def _tokens_per_s(points: Sequence[SeriesPoint]) -> list[float]:
    """Output tokens per second of each window (`tokens_generated` is cumulative)."""
    rates, before = [], 0
    for point in points:
        tokens, before = point.tokens_generated - before, point.tokens_generated
        rates.append(tokens / point.duration_s if point.duration_s > 0 else 0.0)
    return rates


def token_throughput(runs: Sequence[PlotRun]) -> Figure:
    figure, axes = _figure(2)
    rate_ax, flight_ax = axes
    for i, run in enumerate(runs):
        points = run.series.points
        if not points:
            continue
        edges = [points[0].start_s] + [p.end_s for p in points]
        rate_ax.stairs(_tokens_per_s(points), edges, baseline=None, color=f"C{i}", label=run.label)
        _stairs(flight_ax, points, lambda p: float(p.num_running), color=f"C{i}",
                label=run.label)  # fmt: skip
    for ax in axes:
        if not any(r.series.points for r in runs):
            _no_data(ax)
        ax.set_ylim(bottom=0)
    rate_ax.set_ylabel("tokens / s")
    rate_ax.set_title("Output tokens per second", fontsize="medium", loc="left")
    flight_ax.set_ylabel("requests")
    flight_ax.set_title("Requests in flight (an engine run: running)", fontsize="medium",
                        loc="left")  # fmt: skip
    return _finish(figure, axes, PLOT_TITLES["token_throughput"], runs)
