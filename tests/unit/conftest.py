"""Fixtures shared by more than one test module of tests/unit."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from types import FrameType

import pytest

from .copy_engine_support import engine, layout, pools

__all__ = ["engine", "fail_if_blocked", "layout", "pools"]

BLOCKED_DEADLINE_S = 60  # a bound on a hang, not a performance figure


@pytest.fixture
def fail_if_blocked() -> Iterator[None]:
    """A read that blocks (a FIFO opened without a writer) fails the test, not hangs it."""

    def blocked(signum: int, frame: FrameType | None) -> None:
        raise AssertionError(f"blocked for {BLOCKED_DEADLINE_S} s: a FIFO opened for reading?")

    previous = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(BLOCKED_DEADLINE_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
