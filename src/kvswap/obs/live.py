"""The live terminal panel: the article's four numbers while the run goes.

On a terminal the panel is redrawn in place (ANSI cursor-up) at most
`1 / redraw_interval_s` times a second and replaces the progress bar; its
first line *is* the progress bar. Elsewhere (a pipe, a log file, CI) it writes
one plain line every `log_interval_s` and one at the end. The command decides
whether there is a panel at all (none with --quiet or --json).

    requests 12/24 [###########-----------]    3.4 s  step 412
    GPU  [###################:####|--]  78%  234/300 blk  low : 65%  high | 85%
    CPU  [######----------------:|---]  20%   51/256 blk  low : 80%  high | 90%
    link  gpu>cpu 1.23 GB/s  cpu>gpu 803 MB/s  cpu>nvme 0 B/s  nvme>cpu 0 B/s
    swap-wait 3.2% of step time   token latency p50 12.1 ms  p99 45.0 ms
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO

from kvswap.obs.observer import StepObserver, StepSample
from kvswap.obs.quantiles import LogHistogram
from kvswap.obs.rates import TrailingRate, format_rate
from kvswap.obs.watermarks import Watermarks

BAR_WIDTH = 28
_TIER_NAMES = {"gpu": "GPU ", "cpu": "CPU ", "nvme": "NVMe"}
_SHORT_DIRECTIONS = {
    "gpu_to_cpu": "gpu>cpu",
    "cpu_to_gpu": "cpu>gpu",
    "cpu_to_nvme": "cpu>nvme",
    "nvme_to_cpu": "nvme>cpu",
}


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
    def __init__(
        self,
        stream: TextIO,
        *,
        watermarks: Watermarks,
        tty: bool | None = None,
        label: str = "requests",
        redraw_interval_s: float = 0.25,
        log_interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.stream = stream
        self.watermarks = watermarks
        self.tty = stream.isatty() if tty is None else tty
        self.label = label
        self.interval_s = redraw_interval_s if self.tty else log_interval_s
        self.clock = clock
        self._last_draw_s: float | None = None
        self._lines_drawn = 0
        self._done = self._total = 0
        self._sample: StepSample | None = None
        self._rate = TrailingRate(1.0)
        self._latencies = LogHistogram()

    def progress(self, done: int, total: int) -> None:
        """The engine's progress callback: requests finished of all."""
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
        if self._sample is not None:
            self.draw()

    def draw(self) -> None:
        if self.tty:
            lines = self.render()
            # Cursor to the start of the panel drawn last time, then overwrite each line.
            out = f"\x1b[{self._lines_drawn}F" if self._lines_drawn else ""
            out += "".join(f"\x1b[2K{line}\n" for line in lines)
            self._lines_drawn = len(lines)
        else:
            out = self.log_line() + "\n"
        self.stream.write(out)
        self.stream.flush()

    def render(self) -> list[str]:
        """The panel's lines (no escape codes)."""
        sample = self._sample
        lines = [self._progress_line()]
        if sample is None:
            return lines
        for tier, name in _TIER_NAMES.items():
            slots = sample.capacity_blocks_by_tier.get(tier, 0)
            if not slots:
                continue
            used = sample.used_blocks_by_tier.get(tier, 0)
            levels = self.watermarks.for_tier(tier)
            line = f"{name} {occupancy_bar(used / slots, levels)} {100 * used / slots:3.0f}%"
            line += f" {used:>5}/{slots} blk"
            if levels is not None:
                line += f"  low : {100 * levels[1]:.0f}%  high | {100 * levels[0]:.0f}%"
            lines.append(line)
        lines.append("link  " + self._link_text())
        lines.append(f"swap-wait {self._swap_wait_text()} of step time   token latency "
                     + self._latency_text())  # fmt: skip
        return lines

    def log_line(self) -> str:
        """One plain line: progress, occupancy, link, swap-wait, latency."""
        sample = self._sample
        elapsed = f"[{sample.t_s:7.1f} s]" if sample is not None else "[    0.0 s]"
        parts = [f"{elapsed} {self.label} {self._done}/{self._total}"]
        if sample is not None:
            tiers = [
                f"{name.strip()} {100 * sample.used_blocks_by_tier.get(tier, 0) / slots:.0f}%"
                for tier, name in _TIER_NAMES.items()
                if (slots := sample.capacity_blocks_by_tier.get(tier, 0))
            ]
            parts += [
                " ".join(tiers),
                self._link_text(),
                "swap-wait " + self._swap_wait_text(),
                self._latency_text(),
            ]
        return " | ".join(parts)

    def _progress_line(self) -> str:
        total = max(self._total, 1)
        filled = int(22 * min(self._done, total) / total)
        sample = self._sample
        t_s = sample.t_s if sample is not None else 0.0
        line = f"{self.label} {self._done}/{self._total} [{'#' * filled}{'-' * (22 - filled)}]"
        line += f" {t_s:7.1f} s"
        if sample is not None:
            line += f"  step {sample.step}  run {sample.num_running} wait {sample.num_waiting}"
            line += f" paused {sample.num_preempted}"
        return line

    def _link_text(self) -> str:
        rates = self._rate.per_s()
        return "  ".join(
            f"{short} {format_rate(rates.get(direction, 0.0))}"
            for direction, short in _SHORT_DIRECTIONS.items()
        )

    def _swap_wait_text(self) -> str:
        sample = self._sample
        if sample is None or sample.step_total_s <= 0:
            return "0.0%"
        return f"{100 * sample.swap_wait_total_s / sample.step_total_s:.1f}%"

    def _latency_text(self) -> str:
        p50, p99 = self._latencies.quantile_ms(0.50), self._latencies.quantile_ms(0.99)
        if p50 is None or p99 is None:
            return "p50 - ms  p99 - ms"
        return f"p50 {p50:.1f} ms  p99 {p99:.1f} ms"
