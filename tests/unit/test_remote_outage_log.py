"""Which of a flapping store's up / down changes get a log line (`OutageLog`), on
made-up times: one "unreachable" line per interval at most, the outages left out
counted in the next line, a lasting outage logged late rather than never, and a
"reachable again" line exactly for the outages whose start was logged."""

from __future__ import annotations

import pytest

from kvswap.data.remote_outage_log import OutageLog


def test_a_flapping_store_logs_one_outage_a_minute_and_counts_the_rest() -> None:
    log = OutageLog(interval_s=60.0)
    lines: list[tuple[float, str]] = []
    for flap in range(100):  # down at 0, 2, 4 ... s, back 0.5 s later each time
        now_s = 2.0 * flap
        left_out = log.down(now_s, began=True)
        if left_out is not None:
            lines.append((now_s, f"down, {left_out} left out"))
        if log.up():
            lines.append((now_s + 0.5, "up"))
    assert lines == [
        (0.0, "down, 0 left out"), (0.5, "up"),
        (60.0, "down, 29 left out"), (60.5, "up"),
        (120.0, "down, 29 left out"), (120.5, "up"),
        (180.0, "down, 29 left out"), (180.5, "up"),
    ]  # fmt: skip


def test_an_outage_that_lasts_is_logged_at_a_probe_once_the_interval_has_passed() -> None:
    log = OutageLog(interval_s=60.0)
    assert log.down(0.0, began=True) == 0
    assert log.down(0.5, began=False) is None  # a failed probe of a logged outage
    assert log.up()
    assert log.down(10.0, began=True) is None  # too soon: counted
    assert log.up() is False  # its start was not logged: neither is its end
    assert log.down(20.0, began=True) is None  # and this one stays down
    for probe_s in (20.5, 21.5, 23.5, 27.5, 35.5, 51.5):
        assert log.down(probe_s, began=False) is None
    assert log.down(81.5, began=False) == 1  # logged now; one outage before it left out
    assert log.down(111.5, began=False) is None  # once per outage
    assert log.up()  # so the last line says the store is up again


def test_interval_zero_logs_every_change() -> None:
    log = OutageLog(interval_s=0.0)
    for now_s in (0.0, 0.0, 1.0):
        assert log.down(now_s, began=True) == 0
        assert log.up()


def test_a_negative_interval_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="interval_s must be >= 0"):
        OutageLog(interval_s=-1.0)
