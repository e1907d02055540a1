"""One copy engine over the local tiers and the remote one, routed by direction.

    submit(chunk) --- keyed directions ----> remote engine (RemoteCopyEngine)
                  \\-- every other one -----> local engine  (LocalCopyEngine)
    poll()        both engines' results, merged in order of end time
    wait(id)      the engine the id was submitted to
    wait_all(), close()   both (close: the remote one first, so no read lane
                          copies into the host pool the local engine's owner frees)

The swapper sees one `CopyEngine`, as before a remote tier existed. Transfer
ids are unique across both engines (checked at submit): a result is looked up
by id alone.
"""

from __future__ import annotations

from kvswap.base.transfer import CopyEngine, TransferChunk, TransferResult


class TieredCopyEngine(CopyEngine):
    """Routes remote chunks to `remote`, the rest to `local`; owns and closes both."""

    def __init__(self, local: CopyEngine, remote: CopyEngine) -> None:
        self.local = local
        self.remote = remote
        # Submitted and not yet reported: id -> the engine that runs it.
        self._engine_of: dict[int, CopyEngine] = {}
        self._closed = False

    @property
    def num_pending(self) -> int:
        return len(self._engine_of)

    def submit(self, chunk: TransferChunk) -> None:
        if chunk.transfer_id in self._engine_of:
            raise ValueError(f"transfer {chunk.transfer_id}: id already in use by a pending chunk")
        engine = self.remote if chunk.direction.keyed else self.local
        engine.submit(chunk)  # raises for a bad chunk before it is recorded
        self._engine_of[chunk.transfer_id] = engine

    def poll(self) -> list[TransferResult]:
        return self._reported(self.local.poll() + self.remote.poll())

    def wait(self, transfer_id: int) -> TransferResult:
        engine = self._engine_of.get(transfer_id)
        if engine is None:
            raise ValueError(
                f"transfer {transfer_id} is not pending: never submitted or already reported"
            )
        result = engine.wait(transfer_id)
        del self._engine_of[transfer_id]
        return result

    def wait_all(self) -> list[TransferResult]:
        return self._reported(self.local.wait_all() + self.remote.wait_all())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.remote.close()
        finally:
            self.local.close()

    def __enter__(self) -> TieredCopyEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _reported(self, results: list[TransferResult]) -> list[TransferResult]:
        for result in results:
            self._engine_of.pop(result.transfer_id, None)
        return sorted(results, key=lambda result: result.end_s)
