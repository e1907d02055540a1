"""A progress bar on stderr: rich's, in place on a terminal; plain lines otherwise.

On a terminal (rich's `Console.is_terminal`, not a dumb one) `update` redraws a
rich `Progress` at most 10 times a second and once more for the final state.
Elsewhere it writes a plain line each time another tenth of the work is done,
and at the end:

    tune: 3/15 (20%) 12.4s
"""

from __future__ import annotations

import sys
import time
import weakref
from collections.abc import Callable
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

REDRAW_INTERVAL_S = 0.1


class ProgressBar:
    """`update(done, total)` as often as you like (a `RequestProgress`); `close()` or a
    `with` block ends the in-place bar early (an error); an unclosed bar is ended at
    interpreter exit so the terminal gets its cursor back."""

    def __init__(
        self,
        label: str,
        console: Console | None = None,
        *,
        enabled: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.label = label
        self.console = console if console is not None else Console(file=sys.stderr)
        self.enabled = enabled
        self.is_tty = self.console.is_terminal and not self.console.is_dumb_terminal
        self.clock = clock
        self._start_s = clock()
        self._last_draw_s: float | None = None
        self._last_logged_tenth: int | None = None
        self._done_drawn = False  # the final state is drawn once, however often reported
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._stop: weakref.finalize[[], ProgressBar] | None = None

    def update(self, done: int, total: int, detail: str = "") -> None:
        if not self.enabled or total <= 0 or self._done_drawn:
            return
        self._done_drawn = done >= total
        now_s = self.clock()
        recent = self._last_draw_s is not None and now_s - self._last_draw_s < REDRAW_INTERVAL_S
        if done < total and recent:
            return
        self._last_draw_s = now_s
        if self.is_tty:
            self._draw(done, total, detail)
        else:
            self._log(done, total, detail, now_s - self._start_s)

    def close(self) -> None:
        """Stop drawing in place, leaving the last state on screen (idempotent)."""
        if self._stop is not None:
            self._stop()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _draw(self, done: int, total: int, detail: str) -> None:
        if self._progress is None or self._task is None:
            # Redrawn only from update(), on the caller's thread: no refresh thread.
            # stdout stays the command's own; stray stderr lines print above the bar.
            progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(bar_width=30),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[detail]}"),
                console=self.console,
                auto_refresh=False,
                redirect_stdout=False,
                redirect_stderr=True,
                get_time=self.clock,
            )
            progress.start()
            self._task = progress.add_task(self.label, total=total, detail=detail)
            self._progress = progress
            self._stop = weakref.finalize(self, progress.stop)
        self._progress.update(self._task, completed=done, total=total, detail=detail)
        if done >= total:
            self.close()  # stopping draws the final state, once
        else:
            self._progress.refresh()

    def _log(self, done: int, total: int, detail: str, elapsed_s: float) -> None:
        pct = 100 * done // total
        tenth = pct // 10
        if tenth == self._last_logged_tenth and done < total:
            return
        self._last_logged_tenth = tenth
        line = f"{self.label}: {done}/{total} ({pct}%) {elapsed_s:.1f}s {detail}".rstrip()
        self.console.out(line, highlight=False)
