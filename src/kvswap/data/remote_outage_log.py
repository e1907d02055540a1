"""Which of the remote store's up / down changes get a log line (`RemoteStoreClient`'s).

A store can flap: a Redis Cluster with a dead master and no replica fails every
call that reaches that master's slots (an outage) while a reconnect probe that
misses them succeeds (reachable again), so the store goes down and up every 0.5
to 6 s. Two lines per flap would bury every other line, so:

  - at most one "unreachable" line per `interval_s`. An outage that begins sooner
    is counted, not logged, and the next line says how many were left out;
  - an outage that lasts is logged anyway, at its first failed probe once
    `interval_s` has passed since the last line (at most `interval_s` plus one
    backoff delay late), so a store that stays down never reads as up;
  - an outage's "reachable again" line is logged exactly when its "unreachable"
    line was: the last of these lines always names the state the store is in.

Every change is counted whether logged or not (`num_outages`, `num_reconnects`
of the client, exported as metrics). Not thread-safe: the client calls it under
its own lock.
"""

from __future__ import annotations

#: At most one "unreachable" line per this many seconds.
OUTAGE_LOG_INTERVAL_S = 60.0


class OutageLog:
    """The decisions above, on the caller's clock (seconds)."""

    def __init__(self, interval_s: float = OUTAGE_LOG_INTERVAL_S) -> None:
        if not interval_s >= 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s}")
        self.interval_s = interval_s
        self._last_line_s = float("-inf")
        self._this_outage_logged = False
        self._num_unlogged = 0  # outages begun since the last line, this one included

    def down(self, now_s: float, *, began: bool) -> int | None:
        """An outage began (`began`) or a reconnect probe of it failed. None: no line
        now. Otherwise log one, saying that this many earlier outages began since the
        last line without a line of their own (0: none)."""
        if began:
            self._this_outage_logged = False
            self._num_unlogged += 1
        if self._this_outage_logged or now_s - self._last_line_s < self.interval_s:
            return None
        self._this_outage_logged = True
        self._last_line_s = now_s
        num_left_out, self._num_unlogged = max(0, self._num_unlogged - 1), 0
        return num_left_out

    def up(self) -> bool:
        """The outage ended: whether to log that (exactly when its start was logged)."""
        logged, self._this_outage_logged = self._this_outage_logged, False
        return logged
