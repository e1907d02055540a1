"""A copy engine for narrated control-plane tests: nothing moves until the test says so."""

from __future__ import annotations

from kvswap.base.transfer import CopyEngine, TransferChunk, TransferResult


class ManualCopyEngine(CopyEngine):
    """Chunks wait in `pending` until `finish()`; `wait()` finishes one at once."""

    def __init__(self) -> None:
        self.submitted: list[TransferChunk] = []
        self.pending: dict[int, TransferChunk] = {}
        self._done: list[TransferResult] = []
        self.fail_ids: set[int] = set()

    def submit(self, chunk: TransferChunk) -> None:
        self.submitted.append(chunk)
        self.pending[chunk.transfer_id] = chunk

    def finish(self, transfer_id: int | None = None) -> None:
        """Complete one chunk (or all pending ones), to be reported by the next poll."""
        ids = list(self.pending) if transfer_id is None else [transfer_id]
        for done_id in ids:
            self._done.append(self._result(self.pending.pop(done_id)))

    def _result(self, chunk: TransferChunk) -> TransferResult:
        ok = chunk.transfer_id not in self.fail_ids
        return TransferResult(
            chunk.transfer_id, ok, chunk.num_bytes, 0.0, 0.001, None if ok else "injected"
        )

    def poll(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, transfer_id: int) -> TransferResult:
        for index, result in enumerate(self._done):
            if result.transfer_id == transfer_id:
                return self._done.pop(index)
        return self._result(self.pending.pop(transfer_id))

    def wait_all(self) -> list[TransferResult]:
        self.finish()
        return self.poll()

    def close(self) -> None:
        self.pending.clear()
