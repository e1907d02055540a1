"""Stop signals as exceptions, so every `with` and `finally` on the stack runs.

A service manager stops a process with SIGTERM (systemd, docker, Kubernetes),
a closed terminal sends SIGHUP, Ctrl-\\ sends SIGQUIT. Left at their default
actions they kill the process on the spot and the NVMe slab stays on disk.
While `stop_signals_raise()` is active they raise `Terminated` in the main
thread instead, exactly as SIGINT raises KeyboardInterrupt, and the pools are
released by the context managers that own them on the way out.

    signal -> handler (main thread) -> raise Terminated(signum) / KeyboardInterrupt
           -> Engine.__exit__ releases the pools -> cli.main prints one line, returns 128 + n

Only the first signal raises: a second one (an impatient Ctrl-C, a service
manager repeating SIGTERM) arriving while the first unwinds would otherwise
interrupt the very clean-up that removes the slab. This module imports only
the standard library: `python -m kvswap` installs it before torch is imported.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

#: Signals that stop a command cleanly; SIGINT keeps raising KeyboardInterrupt.
STOP_SIGNALS: tuple[signal.Signals, ...] = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
)

_Handler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None


class Terminated(BaseException):
    """The process was asked to stop by `signum` (SIGTERM, SIGHUP, SIGQUIT).

    A BaseException like KeyboardInterrupt: `except Exception` never swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def signal_name(self) -> str:
        return signal_name(self.signum)

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by a signal: 128 + its number."""
        return 128 + self.signum

    def __str__(self) -> str:
        return f"stopped by {self.signal_name}"


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def stop_exit_code(exc: KeyboardInterrupt | Terminated) -> int:
    """128 + the signal number: 130 for Ctrl-C, 143 for SIGTERM."""
    if isinstance(exc, Terminated):
        return exc.exit_code
    return 128 + signal.SIGINT


def stop_message(exc: KeyboardInterrupt | Terminated) -> str:
    """One line: which signal stopped the command and what was released on the way out.

    Owners of resources add what they did as notes (`add_note`) while the exception
    passes through their `__exit__`."""
    what = f"stopped by {exc.signal_name}" if isinstance(exc, Terminated) else "interrupted"
    notes = [str(note) for note in getattr(exc, "__notes__", ())]
    return "; ".join([f"kvswap: {what}", *notes])


@contextmanager
def stop_signals_raise() -> Iterator[None]:
    """Within the block, STOP_SIGNALS raise (once) in the main thread; the previous
    handlers come back afterwards. Outside the main thread it does nothing, since
    Python lets only the main thread install handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised = False

    def handler(signum: int, frame: FrameType | None) -> None:
        nonlocal raised
        if raised:
            return  # already stopping: let the clean-up finish
        raised = True
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(signum)

    previous: dict[signal.Signals, _Handler] = {}
    try:
        for signum in STOP_SIGNALS:
            previous[signum] = signal.signal(signum, handler)
        yield
    finally:
        for signum, old in previous.items():
            # A handler installed from C (not by Python) reads back as None: keep ours
            # rather than guess, for the few instructions left before exit.
            if old is not None:
                signal.signal(signum, old)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Within the block, STOP_SIGNALS are held; the first one that arrived is raised
    again, through the handlers in force before, when the block ends.

    For the few steps that must not be cut in half: renaming a finished report into
    place, removing a half-written one. Keep the block short: the user waits on it.
    Outside the main thread it does nothing (no signal handler runs there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        pending.append(signum)

    previous: dict[signal.Signals, _Handler] = {}
    try:
        for signum in STOP_SIGNALS:
            previous[signum] = signal.signal(signum, hold)
        yield
    finally:
        for signum, old in previous.items():
            if old is not None:
                signal.signal(signum, old)
        if pending:
            # Runs the restored Python handler at once: it raises (Terminated,
            # KeyboardInterrupt) here, or does nothing if already stopping.
            signal.raise_signal(pending[0])


def report_stop(exc: KeyboardInterrupt | Terminated) -> int:
    """Print the one stop line on stderr and return the exit code."""
    print(stop_message(exc), file=sys.stderr)
    return stop_exit_code(exc)


def run_stoppable(main: Callable[[], int | None]) -> int:
    """Run a script's `main` with the stop signals raising, so a SIGTERM unwinds every
    `with` on the way out as Ctrl-C does; returns its exit code (None: 0), or after a
    stop the one stop line's 128 + the signal number."""
    try:
        with stop_signals_raise():
            code = main()
    except (KeyboardInterrupt, Terminated) as stop:
        return report_stop(stop)
    return 0 if code is None else code
