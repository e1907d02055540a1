"""One copy engine over the local tiers and the keyed ones, routed by direction.

    submit(chunk) --- keyed directions ----> that keyed tier's engine (`TierCopyEngine`;
                  |                          `keyed_tier_list` names them)
                  \\-- every other one -----> local engine  (LocalCopyEngine)
    poll()        every engine's results, merged in order of end time
    wait(id)      the engine the id was submitted to
    wait_all(), close()   every engine (close: the keyed ones first, so no read lane
                          copies into the host pool the local engine's owner frees)

The swapper sees one `CopyEngine`, as without a keyed tier. Transfer ids are
unique across the engines (checked at submit): a result is looked up by id alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack

from kvswap.base.tier import Tier, keyed_tier_list
from kvswap.base.transfer import CopyEngine, TransferChunk, TransferResult
from kvswap.data.tiers.copy_adapter import TierCopyEngine


class TieredCopyEngine(CopyEngine):
    """Routes each keyed tier's chunks to its engine in `keyed` (fastest first), the
    rest to `local`; owns and closes them all."""

    def __init__(self, local: CopyEngine, keyed: Sequence[TierCopyEngine]) -> None:
        self.local = local
        tiers = keyed_tier_list([engine.local for engine in keyed])
        self.keyed: dict[Tier, CopyEngine] = dict(zip(tiers, keyed, strict=True))
        self._engines = (local, *self.keyed.values())
        # Submitted and not yet reported: id -> the engine that runs it.
        self._engine_of: dict[int, CopyEngine] = {}
        self._closed = False

    @property
    def num_pending(self) -> int:
        return len(self._engine_of)

    def submit(self, chunk: TransferChunk) -> None:
        if chunk.transfer_id in self._engine_of:
            raise ValueError(f"transfer {chunk.transfer_id}: id already in use by a pending chunk")
        direction = chunk.direction
        engine = self.local
        if direction.keyed:
            tier = direction.src_tier if direction.upward else direction.dst_tier
            found = self.keyed.get(tier)
            if found is None:
                raise ValueError(
                    f"transfer {chunk.transfer_id}: {direction.value} but no engine for the "
                    f"{tier.value} tier"
                )
            engine = found
        engine.submit(chunk)  # raises for a bad chunk before it is recorded
        self._engine_of[chunk.transfer_id] = engine

    def poll(self) -> list[TransferResult]:
        return self._reported([result for engine in self._engines for result in engine.poll()])

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
        return self._reported([result for engine in self._engines for result in engine.wait_all()])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with ExitStack() as closing:  # each closed whatever the others raise: local last
            closing.callback(self.local.close)
            for engine in self.keyed.values():
                closing.callback(engine.close)

    def __enter__(self) -> TieredCopyEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _reported(self, results: list[TransferResult]) -> list[TransferResult]:
        for result in results:
            self._engine_of.pop(result.transfer_id, None)
        return sorted(results, key=lambda result: result.end_s)
