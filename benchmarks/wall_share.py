"""Where a long run's wall time goes, by kvswap module: a sampling profiler.

    with WallShare() as share:        a thread samples the calling thread's stack
        run()                         every `interval_s` (5 ms)
    share.by_module()                 {"control/store_policies.py": 0.17, ...}: each
                                      sample counted once, for the innermost kvswap
                                      frame on the stack (time in the standard
                                      library or a C call is its caller's)
    share.of(prefixes)                the share of samples whose innermost kvswap
                                      frame is in one of these modules

Sampling, not tracing: a deterministic profiler (cProfile) charges every call
the same overhead, so code made of many small calls (the control plane is) runs
2-3x slower under it (sim_scale's 1,500 requests: 141 s against 47 s), each
function by how many calls it makes, not by its time. A sample is one stack walk
every 5 ms. Shares of a few thousand samples are good to about a percent.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from types import FrameType


class WallShare:
    """Samples one thread's stack (the one that enters) until it exits."""

    def __init__(self, interval_s: float = 0.005, package_dir: str | None = None) -> None:
        self.interval_s = interval_s
        self._package = package_dir or _package_dir()
        self._counts: Counter[str] = Counter()
        self.num_samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._target = 0

    def __enter__(self) -> WallShare:
        self._target = threading.get_ident()
        self._thread = threading.Thread(target=self._sample, name="wall-share", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            frame = sys._current_frames().get(self._target)
            if frame is not None:
                self._counts[self._module(frame)] += 1
                self.num_samples += 1

    def _module(self, frame: FrameType | None) -> str:
        """The innermost kvswap module on the stack, relative to the package."""
        package = self._package
        while frame is not None:
            filename = frame.f_code.co_filename
            if filename.startswith(package):
                return filename[len(package) :]
            frame = frame.f_back
        return "(outside kvswap)"

    def by_module(self, top: int = 15) -> dict[str, float]:
        """The `top` modules by share of samples, largest first (the rest summed)."""
        total = max(self.num_samples, 1)
        ranked = self._counts.most_common()
        shares = {module: round(count / total, 3) for module, count in ranked[:top]}
        rest = sum(count for _, count in ranked[top:])
        if rest:
            shares["(the rest)"] = round(rest / total, 3)
        return shares

    def of(self, prefixes: Iterable[str]) -> float:
        """The share of samples in modules starting with any of `prefixes`."""
        wanted = tuple(prefixes)
        count = sum(n for module, n in self._counts.items() if module.startswith(wanted))
        return round(count / max(self.num_samples, 1), 3)


def _package_dir() -> str:
    """Where kvswap is imported from (a worktree's src, an installed copy)."""
    import kvswap

    return str(Path(kvswap.__file__).resolve().parent) + "/"
