"""A progress bar on stderr: redrawn in place on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """`update(done, total)` as often as you like; redraws at most 10 times a second."""

    def __init__(self, label: str, stream: TextIO | None = None, *, enabled: bool = True):
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.is_tty = self.stream.isatty()
        self._start_s = time.perf_counter()
        self._last_draw_s = 0.0
        self._last_logged_pct = -1
        self._done_drawn = False  # the final state is drawn once, however often reported

    def update(self, done: int, total: int, detail: str = "") -> None:
        if not self.enabled or total <= 0 or self._done_drawn:
            return
        self._done_drawn = done >= total
        now_s = time.perf_counter()
        if done < total and now_s - self._last_draw_s < 0.1:
            return
        self._last_draw_s = now_s
        elapsed_s = now_s - self._start_s
        if self.is_tty:
            width = 30
            filled = int(width * done / total)
            bar = "#" * filled + "-" * (width - filled)
            line = f"\r{self.label} [{bar}] {done}/{total} {elapsed_s:6.1f}s {detail}"
            self.stream.write(line[:200].ljust(80))
            if done >= total:
                self.stream.write("\n")
        else:
            pct = 100 * done // total
            if pct // 10 == self._last_logged_pct // 10 and done < total:
                return
            self._last_logged_pct = pct
            self.stream.write(f"{self.label}: {done}/{total} ({pct}%) {elapsed_s:.1f}s {detail}\n")
        self.stream.flush()
