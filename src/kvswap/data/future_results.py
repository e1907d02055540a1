"""The result side every threaded copy engine shares: one future per submitted chunk.

    submit(chunk) -> _track(chunk) -> a Future the engine's lane completes
    poll()        -> the done futures' results, by end time (never blocks)
    wait(id)      -> that chunk's result (not reported again)
    wait_all()    -> every unreported result

A waiter wakes every `LIVENESS_CHECK_S` to check the lane it waits on is still
alive: lanes that die fail their chunks themselves, so this is only the last
resort should every lane be gone without doing so.
"""

from __future__ import annotations

from abc import abstractmethod
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError

from kvswap.control.transfer import CopyEngine, TransferChunk, TransferResult
from kvswap.data.block_copy import failed_result

#: How often a waiter checks that the lane it waits on is still alive.
LIVENESS_CHECK_S = 0.5


class FutureCopyEngine(CopyEngine):
    """A `CopyEngine` whose lanes complete one future per chunk."""

    def __init__(self) -> None:
        # Submitted and not yet reported, in submit order.
        self._pending: dict[int, tuple[TransferChunk, Future[TransferResult]]] = {}

    @property
    def num_pending(self) -> int:
        """Chunks submitted whose results have not been reported yet."""
        return len(self._pending)

    def _track(self, chunk: TransferChunk) -> Future[TransferResult]:
        """The future `chunk`'s lane completes (the id is checked unused by the caller)."""
        future: Future[TransferResult] = Future()
        self._pending[chunk.transfer_id] = (chunk, future)
        return future

    def _is_pending(self, transfer_id: int) -> bool:
        return transfer_id in self._pending

    def poll(self) -> list[TransferResult]:
        """Results finished since the last poll/wait, in order of end time; never blocks."""
        done = [tid for tid, (_chunk, future) in self._pending.items() if future.done()]
        results = [self._pending.pop(tid)[1].result() for tid in done]
        return sorted(results, key=lambda result: result.end_s)

    def wait(self, transfer_id: int) -> TransferResult:
        """Block until chunk `transfer_id` finishes; its result is not polled again."""
        entry = self._pending.pop(transfer_id, None)
        if entry is None:
            raise ValueError(
                f"transfer {transfer_id} is not pending: never submitted or already reported"
            )
        return self._await(*entry)

    def wait_all(self) -> list[TransferResult]:
        """Block until every submitted chunk finishes; return the unreported results."""
        entries = list(self._pending.values())
        self._pending.clear()
        results = [self._await(chunk, future) for chunk, future in entries]
        return sorted(results, key=lambda result: result.end_s)

    def _await(self, chunk: TransferChunk, future: Future[TransferResult]) -> TransferResult:
        while True:
            try:
                return future.result(timeout=LIVENESS_CHECK_S)
            except FutureTimeoutError:
                if not self._lane_alive(chunk) and not future.done():
                    return failed_result(chunk, self._now_s(), self._dead_lane_reason)

    # -- what each engine says about its lanes -----------------------------------------

    _dead_lane_reason = "copy worker exited"

    @abstractmethod
    def _lane_alive(self, chunk: TransferChunk) -> bool:
        """Is some lane that can run `chunk` still alive?"""

    @abstractmethod
    def _now_s(self) -> float:
        """The engine's clock, for a result it has to make up."""
