"""The live terminal panel: the seed article's four numbers while the run goes.

On a terminal (rich's `Console.is_terminal`, not a dumb one) the panel is a
rich `Live` display redrawn in place at most `1 / redraw_interval_s` times a
second; it replaces the progress bar, as its second row *is* a progress bar.
Elsewhere (a pipe, a log file, CI) it writes one plain line every
`log_interval_s` and one at the end. The command decides whether there is a
panel at all (none with --quiet or --json).

    host<->device  read 803 MB/s  write 1.23 GB/s (5% of link)
    swap-wait      3.2% of step time
    token latency  p50 12.1 ms  p95 30.2 ms  p99 45.0 ms
    pinned pool    20%  51/256 blk
    requests 12/24 ━━━━━━━━━━━━━━━━╸━━━━━━━━━━━━━━━     3.4 s  step 412  run 4 wait 0 paused 0
     GPU   [###################:####|--]  78%  234/300 blk  low : 65%  high | 85%
     CPU   [######----------------:|---]  20%   51/256 blk  low : 80%  high | 90%
    link  gpu>cpu 1.23 GB/s  cpu>gpu 803 MB/s  cpu>nvme 0 B/s  nvme>cpu 0 B/s
    remote  hits 384 tok  misses 2  written 12 blk  known 40 blk  in 1.0 MB/s  out 0 B/s

The remote row (and the plain line's `remote` part) appears only with a remote
tier. A figure past the seed article's threshold (`diagnosis.Thresholds`) is
drawn red.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar as BarRenderable
from rich.table import Table
from rich.text import Text

from kvswap.obs.finding import Thresholds
from kvswap.obs.observer import StepObserver, StepSample
from kvswap.obs.quantiles import LogHistogram
from kvswap.obs.rates import TrailingRate, format_rate
from kvswap.obs.watermarks import Watermarks

BAR_WIDTH = 28
PROGRESS_BAR_WIDTH = 32
MIN_PROGRESS_BAR_WIDTH = 8
_TIER_NAMES = {"gpu": "GPU", "cpu": "CPU", "nvme": "NVMe"}
_SHORT_DIRECTIONS = {
    "gpu_to_cpu": "gpu>cpu",
    "cpu_to_gpu": "cpu>gpu",
    "cpu_to_nvme": "cpu>nvme",
    "nvme_to_cpu": "nvme>cpu",
}
_ALARM = "bold red"


def occupancy_bar(
    usage: float, watermarks: tuple[float, float] | None, width: int = BAR_WIDTH
) -> str:
    """`[####--]` filled to `usage` (0..1), with `|` at the high and `:` at the low watermark."""
    cells = ["#" if i < round(usage * width) else "-" for i in range(width)]
    if watermarks is not None:
        high, low = watermarks
        cells[min(width - 1, int(low * width))] = ":"
        cells[min(width - 1, int(high * width))] = "|"
    return "[" + "".join(cells) + "]"


class LivePanel(StepObserver):
    """A `StepObserver` that shows the run on `console`; `progress` is the driver's
    `RequestProgress` callback. Call `close()` (or let `on_finish` do it) to end the
    in-place display; an unclosed one is ended at interpreter exit so the cursor comes back.
    """

    def __init__(
        self,
        console: Console,
        *,
        watermarks: Watermarks,
        label: str = "requests",
        link_gb_per_s: float | None = None,
        redraw_interval_s: float = 0.25,
        log_interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        thresholds: Thresholds | None = None,
    ):
        self.console = console
        self.watermarks = watermarks
        self.tty = console.is_terminal and not console.is_dumb_terminal
        self.label = label
        self.link_gb_per_s = link_gb_per_s  # None: the share of the link is not shown
        self.interval_s = redraw_interval_s if self.tty else log_interval_s
        self.clock = clock
        self.thresholds = thresholds if thresholds is not None else Thresholds()
        self._last_draw_s: float | None = None
        self._done = self._total = 0
        self._sample: StepSample | None = None
        self._rate = TrailingRate(1.0)
        self._latencies = LogHistogram()
        self._live: Live | None = None
        self._stop_live: weakref.finalize[[], LivePanel] | None = None

    def progress(self, done: int, total: int) -> None:
        """The driver's progress callback: requests finished of all."""
        self._done, self._total = done, total

    def on_step(self, sample: StepSample) -> None:
        self._sample = sample
        self._rate.add(sample.t_s, sample.bytes_by_direction)
        self._latencies.add_all(sample.token_latencies_s)
        now_s = self.clock()
        if self._last_draw_s is None and not self.tty:
            self._last_draw_s = now_s  # the first plain line comes one interval in
        elif self._last_draw_s is None or now_s - self._last_draw_s >= self.interval_s:
            self._last_draw_s = now_s
            self.draw()

    def on_finish(self, summary: dict[str, object]) -> None:
        if self._live is not None:
            self._live.update(self.renderable())  # close() below draws it, once
        elif self._sample is not None:
            self.draw()
        self.close()

    def draw(self) -> None:
        if not self.tty:
            self.console.out(self.log_line(), highlight=False)
            return
        if self._live is None:
            # Redrawn only from here, on the driver's thread: no refresh thread reading a
            # sample half-updated. stdout stays the command's own (it may be a pipe while
            # stderr is a terminal); stray stderr writes are printed above the panel.
            live = Live(
                self.renderable(), console=self.console, auto_refresh=False,
                redirect_stdout=False, redirect_stderr=True,
            )  # fmt: skip
            live.start(refresh=True)
            self._live = live
            self._stop_live = weakref.finalize(self, live.stop)
        else:
            self._live.update(self.renderable(), refresh=True)

    def close(self) -> None:
        """Leave the last panel on screen and give the terminal back (idempotent)."""
        if self._stop_live is not None:
            self._stop_live()
        self._live = None

    def renderable(self) -> RenderableType:
        """The panel: the four numbers, progress, tier occupancy, link per direction."""
        parts: list[RenderableType] = [self._headline(), self._progress_row()]
        sample = self._sample
        if sample is not None:
            parts += [self._tier_table(sample), Text("link  " + self._link_text())]
            if sample.remote_enabled:
                parts.append(Text("remote  " + self._remote_text(sample)))
        return Group(*parts)

    def log_line(self) -> str:
        """One plain line: progress, the four numbers, tier occupancy."""
        sample = self._sample
        elapsed = f"[{sample.t_s:7.1f} s]" if sample is not None else "[    0.0 s]"
        parts = [f"{elapsed} {self.label} {self._done}/{self._total}"]
        if sample is not None:
            tiers = [
                f"{name} {100 * sample.used_blocks_by_tier.get(tier, 0) / slots:.0f}%"
                for tier, name in _TIER_NAMES.items()
                if (slots := sample.capacity_blocks_by_tier.get(tier, 0))
            ]
            p50, p95, p99 = self._latencies_ms()
            parts += [
                self._host_device_text(),
                "swap-wait " + self._swap_wait_text(),
                f"p50 {p50} p95 {p95} p99 {p99} ms",
                "pinned " + self._pinned_text(),
                " ".join(tiers),
            ]
            if sample.remote_enabled:
                parts.append(
                    f"remote hits {sample.remote_hit_tokens} tok misses {sample.remote_misses}"
                )
        return " | ".join(parts)

    def _headline(self) -> Table:
        """The four numbers, one a line, so that the panel fits an 80-column terminal."""
        table = Table.grid(padding=(0, 2, 0, 0))
        table.add_column(style="bold", no_wrap=True)
        table.add_column()
        limits = self.thresholds
        link_style = _alarm(self._write_link_share(), limits.write_link_share)
        wait_style = _alarm(self._swap_wait_share(), limits.swap_wait_share)
        pinned_style = _alarm(self._pinned_usage(), limits.pinned_pool_usage)
        p50, p95, p99 = self._latencies_ms()
        rows = (
            ("host<->device", self._host_device_text(), link_style),
            ("swap-wait", self._swap_wait_text() + " of step time", wait_style),
            ("token latency", f"p50 {p50} ms  p95 {p95} ms  p99 {p99} ms", ""),
            ("pinned pool", self._pinned_text(), pinned_style),
        )
        for name, value, style in rows:
            table.add_row(Text(name), Text(value, style))
        return table

    def _progress_row(self) -> Table:
        sample = self._sample
        t_s = sample.t_s if sample is not None else 0.0
        state = f"{t_s:7.1f} s"
        if sample is not None:
            state += f"  step {sample.step}  run {sample.num_running} wait {sample.num_waiting}"
            state += f" paused {sample.num_preempted}"
        label = f"{self.label} {self._done}/{self._total}"
        # The bar takes what the words leave on a narrow terminal, up to PROGRESS_BAR_WIDTH.
        room = self.console.width - len(label) - len(state) - 2
        total = max(self._total, 1)
        bar = BarRenderable(
            total=total, completed=min(self._done, total),
            width=max(MIN_PROGRESS_BAR_WIDTH, min(PROGRESS_BAR_WIDTH, room)),
        )  # fmt: skip
        grid = Table.grid(padding=(0, 1))
        grid.add_row(Text(label), bar, Text(state))
        return grid

    def _tier_table(self, sample: StepSample) -> Table:
        table = Table.grid(padding=(0, 1))
        table.add_column(min_width=5)  # the tier name, indented one cell by the padding
        for tier, name in _TIER_NAMES.items():
            slots = sample.capacity_blocks_by_tier.get(tier, 0)
            if not slots:
                continue
            used = sample.used_blocks_by_tier.get(tier, 0)
            levels = self.watermarks.for_tier(tier)
            usage = used / slots
            marks = "" if levels is None else f" low : {100 * levels[1]:.0f}%  high | "
            marks += "" if levels is None else f"{100 * levels[0]:.0f}%"
            # Text, not str: a str cell is read as markup, and `[###...]` looks like a tag.
            table.add_row(
                Text(f" {name}"),
                Text(occupancy_bar(usage, levels)),
                Text(f"{100 * usage:3.0f}%", _alarm(usage, levels[0] if levels else None)),
                Text(f"{used:>5}/{slots} blk"),
                Text(marks),
            )
        return table

    def _host_device_text(self) -> str:
        rates = self._rate.per_s()
        text = f"read {format_rate(rates.get('cpu_to_gpu', 0.0))}  "
        text += f"write {format_rate(rates.get('gpu_to_cpu', 0.0))}"
        share = self._write_link_share()
        return text if share is None else f"{text} ({100 * share:.0f}% of link)"

    def _write_link_share(self) -> float | None:
        """Swap-out (write) throughput as a share of the link, the seed article's 60 % rule."""
        if self.link_gb_per_s is None or self.link_gb_per_s <= 0:
            return None
        return self._rate.per_s().get("gpu_to_cpu", 0.0) / (self.link_gb_per_s * 1e9)

    def _link_text(self) -> str:
        rates = self._rate.per_s()
        return "  ".join(
            f"{short} {format_rate(rates.get(direction, 0.0))}"
            for direction, short in _SHORT_DIRECTIONS.items()
        )

    def _remote_text(self, sample: StepSample) -> str:
        rates = self._rate.per_s()
        # Every keyed tier's ("remote", "remote2", ...): in from them, out to them.
        keyed_in = sum(rate for label, rate in rates.items() if label.startswith("remote"))
        keyed_out = sum(rate for label, rate in rates.items() if label.startswith("cpu_to_remote"))
        return (
            f"hits {sample.remote_hit_tokens} tok  misses {sample.remote_misses}  "
            f"written {sample.remote_writes} blk  known {sample.remote_known_blocks} blk  "
            f"in {format_rate(keyed_in)}  out {format_rate(keyed_out)}"
        )

    def _swap_wait_share(self) -> float | None:
        sample = self._sample
        if sample is None or sample.step_total_s <= 0:
            return None
        return sample.swap_wait_total_s / sample.step_total_s

    def _swap_wait_text(self) -> str:
        share = self._swap_wait_share()
        return f"{100 * (share or 0.0):.1f}%"

    def _latencies_ms(self) -> list[str]:
        """P50, P95, P99 token latency over the run so far, in ms ('-' before any)."""
        quantiles = [self._latencies.quantile_ms(q) for q in (0.50, 0.95, 0.99)]
        return ["-" if ms is None else f"{ms:.1f}" for ms in quantiles]

    def _latency_text(self) -> str:
        return " / ".join(self._latencies_ms()) + " ms"

    def _pinned_usage(self) -> float | None:
        """The CPU (pinned) tier's occupancy; None without a CPU tier."""
        sample = self._sample
        slots = sample.capacity_blocks_by_tier.get("cpu", 0) if sample is not None else 0
        if sample is None or not slots:
            return None
        return sample.used_blocks_by_tier.get("cpu", 0) / slots

    def _pinned_text(self) -> str:
        usage = self._pinned_usage()
        if usage is None or self._sample is None:
            return "-"
        used = self._sample.used_blocks_by_tier.get("cpu", 0)
        slots = self._sample.capacity_blocks_by_tier["cpu"]
        return f"{100 * usage:.0f}%  {used}/{slots} blk"


def _alarm(value: float | None, limit: float | None) -> str:
    """The style of a figure: red past its limit, plain otherwise (or when unknown)."""
    return _ALARM if value is not None and limit is not None and value > limit else ""
