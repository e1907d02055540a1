"""Who may use a shared link now: HIGH chunks first, LOW copies in their gaps.

The local copy engine and the remote engine each own one. Their control thread
counts a HIGH chunk in at submit (before any LOW copy thread's next check) and
out when its result is set; a LOW copy thread asks before every block (or
batch) and waits while any HIGH chunk is pending or running, so a HIGH chunk
waits at most for the LOW copies already in flight.
"""

from __future__ import annotations

import threading


class LinkArbiter:
    """Counts HIGH chunks pending or running; LOW copies wait while any exist."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._num_high = 0

    def high_submitted(self) -> None:
        with self._cond:
            self._num_high += 1

    def high_finished(self) -> None:
        with self._cond:
            self._num_high -= 1
            if self._num_high == 0:
                self._cond.notify_all()

    def has_high(self) -> bool:
        """True while a HIGH chunk is pending or running (a check, never a wait).
        One read of the count, without the lock: a copy thread asks before every
        block or piece, and a HIGH chunk counted in a moment after the read
        finds that copy in flight, as it would a moment later with the lock."""
        return self._num_high > 0

    def wait_until_no_high(self) -> None:
        if self._num_high == 0:  # the common case, read as in has_high
            return
        with self._cond:
            while self._num_high > 0:
                self._cond.wait()
