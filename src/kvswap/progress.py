"""The progress callbacks long-running code hands its caller, one alias per signature.

Torch-free and free of imports from the rest of kvswap, so the control plane, the
simulator, the engine and the commands can all name the same types. Who calls what:

- `RequestProgress(finished, total)`: a driver (engine, simulator) after every step,
  with requests finished so far and requests in the workload; the obs progress bar and
  live panel take it.
- `StageProgress(line)`: a batch of measurements (bench rows, findings variants) after
  each one, with a one-line description of what was just measured.
- `TrialProgress(done, planned, line)`: the tuner after each simulation, with trials
  done, trials planned and the one-line result of the trial just finished. It is its
  own type because the caller wants the count and the line of the same trial together
  (a bar and a log line), which neither of the others carries.
"""

from __future__ import annotations

from collections.abc import Callable

RequestProgress = Callable[[int, int], None]
StageProgress = Callable[[str], None]
TrialProgress = Callable[[int, int, str], None]

__all__ = ["RequestProgress", "StageProgress", "TrialProgress"]
