"""A failure while serving one request is that request's: the rule the driver loop keeps.

Most of a step works on one request at a time: admitting it, resuming it,
growing its blocks, finishing it. What raises there is wrapped as
`RequestFailed(seq_id)` (`blame`), so the loop (`kvswap.drive.loop`) aborts that
request alone, checks that the control plane's invariants still hold, and goes
on. A failure of the machinery every request shares (the copy engine's waits, a
broken invariant, a `StopRun` such as a user's tier raising) names no request:
it stops the run, since going on could hand a request another's KV.

Torch-free, like the rest of `control/`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kvswap.errors import KvSwapError, StopRun
from kvswap.import_path import one_line


class RequestFailed(Exception):
    """Serving request `seq_id` raised `error`; `reason` says so in one line."""

    def __init__(self, seq_id: int, error: BaseException) -> None:
        self.seq_id = seq_id
        self.error = error
        super().__init__(f"request {seq_id}: {self.reason}")

    @property
    def reason(self) -> str:
        return failure_reason(self.error)


def failure_reason(error: BaseException) -> str:
    """One line for what went wrong: kvswap's own message, else the error's type and text
    (`import_path.one_line`)."""
    if isinstance(error, KvSwapError):
        return str(error).splitlines()[0] if str(error) else ""
    return one_line(error)


@contextmanager
def blame(seq_id: int) -> Iterator[None]:
    """What raises inside is request `seq_id`'s failure (an inner `blame` keeps its own)."""
    try:
        yield
    except (RequestFailed, StopRun):
        raise
    except Exception as error:
        raise RequestFailed(seq_id, error) from error
