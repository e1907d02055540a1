"""The simulator's virtual clock: time moves only when the simulation says so.

Everything that reads time in a simulation reads this clock: the scheduler
and swapper (through their `clock_s` callables), the modelled copy engine
(transfers end at virtual times) and the driver (a step lasts what the cost
model says). Nothing sleeps; a wait is a jump forward.

Invariant: time never goes backwards. `advance_to(t)` with t in the past is a
no-op, so two parties waiting for the same instant cannot rewind each other.
"""

from __future__ import annotations

import math


class VirtualClock:
    """Seconds since the simulation started; call the clock to read it."""

    def __init__(self, start_s: float = 0.0):
        if not math.isfinite(start_s) or start_s < 0:
            raise ValueError(f"start_s must be a finite number >= 0, got {start_s}")
        self._now_s = start_s

    def __call__(self) -> float:
        return self._now_s

    @property
    def now_s(self) -> float:
        return self._now_s

    def advance(self, duration_s: float) -> None:
        """Let `duration_s` seconds pass (a step computing, an idle gap)."""
        if not duration_s >= 0 or not math.isfinite(duration_s):
            raise ValueError(f"duration_s must be a finite number >= 0, got {duration_s}")
        self._now_s += duration_s

    def advance_to(self, time_s: float) -> None:
        """Jump to `time_s` if it is later than now (waiting for an event)."""
        if not math.isfinite(time_s):
            raise ValueError(f"time_s must be finite, got {time_s}")
        if time_s > self._now_s:
            self._now_s = time_s
