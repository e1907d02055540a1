"""Any secondary tier as the control plane's remote tier: a CopyEngine and a RemoteIndex.

The control plane moves key-addressed blocks as `TransferChunk`s of a keyed
tier's two directions and asks presence through `RemoteIndex`; a `SecondaryTier`
moves `TransferJob`s. `TierCopyEngine` translates, one job per chunk, the
job id being the transfer id:

    upward chunk   (keys, src 0..n-1, dst host slots) -> submit_load(job: keys, dst)
    downward chunk (keys, src host slots, dst 0..n-1) -> submit_store(job: keys, src)
    poll() / wait(id) / wait_all()   get_finished_jobs() / wait(id) / drain() + get_finished_jobs()
    lookup(keys), available          the tier's
    holds_keys, hold, release        the tier's
    JobResult -> TransferResult      a key left out of `successful_keys` -> its dst slot in
                                     `failed_dst_slots` (the host slot of a load, the
                                     position of a store); `success`: some key succeeded,
                                     as the control plane reads it (only the listed
                                     slots are untrusted)

The engine's store is `TierCopyEngine(RedisTier(...))`
(`kvswap.data.remote_copy`); any other tier plugs in the same way, each keyed
tier its own engine, and no module of `kvswap.control` changes. Chunks are
checked here, whatever the tier: a wrong chunk (a local direction, slots or keys
that do not match, a reused id, a chunk after close) raises ValueError.
Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvswap.base.remote_index import RemoteIndex
from kvswap.base.transfer import CopyEngine, TransferChunk, TransferResult
from kvswap.data.tiers.base import JobResult, SecondaryTier, TransferJob


class TierCopyEngine(CopyEngine, RemoteIndex):
    """The remote directions' chunks as `tier`'s jobs; also its RemoteIndex. Owns the
    tier: `close()` closes it. Called from one control thread."""

    def __init__(self, tier: SecondaryTier) -> None:
        self.tier = tier
        self.block_bytes = tier.block_bytes
        # Submitted and not yet reported, by transfer id (= job id).
        self._pending: dict[int, TransferChunk] = {}
        self._closed = False

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    # --- RemoteIndex ------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        return self.tier.lookup(keys)

    @property
    def available(self) -> bool:
        return self.tier.available

    @property
    def holds_keys(self) -> bool:
        return self.tier.holds_keys

    def hold(self, keys: Sequence[bytes]) -> None:
        self.tier.hold(keys)

    def release(self, keys: Sequence[bytes]) -> None:
        self.tier.release(keys)

    @property
    def local(self) -> bool:
        return self.tier.local

    def evicted_keys(self) -> Sequence[bytes]:
        return self.tier.evicted_keys()

    @property
    def capacity_blocks(self) -> int | None:
        return self.tier.capacity_blocks

    # --- CopyEngine -------------------------------------------------------------------

    def submit(self, chunk: TransferChunk) -> None:
        self._validate(chunk)
        loading = chunk.direction.upward
        host_slots = chunk.dst_slots if loading else chunk.src_slots
        job = TransferJob(chunk.transfer_id, chunk.keys, host_slots, is_load=loading)
        self.tier.check_job(job)  # here too: a tier of one's own need not check
        if loading:
            self.tier.submit_load(job)
        else:
            self.tier.submit_store(job)
        self._pending[chunk.transfer_id] = chunk  # after the tier took it (or raised)

    def poll(self) -> list[TransferResult]:
        return [self._reported(result) for result in self.tier.get_finished_jobs()]

    def wait(self, transfer_id: int) -> TransferResult:
        if transfer_id not in self._pending:
            raise ValueError(
                f"transfer {transfer_id} is not pending: never submitted or already reported"
            )
        return self._reported(self.tier.wait(transfer_id))

    def wait_all(self) -> list[TransferResult]:
        self.tier.drain()
        return self.poll()

    def close(self) -> None:
        """Let queued jobs finish and close the tier; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.tier.close()

    def __enter__(self) -> TierCopyEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- translation ------------------------------------------------------------------

    def _reported(self, result: JobResult) -> TransferResult:
        chunk = self._pending.pop(result.job_id, None)
        if chunk is None:
            raise ValueError(f"the tier reported job {result.job_id}, which is not pending")
        succeeded = frozenset(result.successful_keys)
        failed = tuple(
            slot for key, slot in zip(chunk.keys, chunk.dst_slots, strict=True)
            if key not in succeeded
        )  # fmt: skip
        return TransferResult(
            transfer_id=chunk.transfer_id,
            success=len(failed) < chunk.num_blocks,
            num_bytes=chunk.num_bytes,
            start_s=result.start_s,
            end_s=result.end_s,
            error=result.error,
            failed_dst_slots=failed,
        )

    def _validate(self, chunk: TransferChunk) -> None:
        tid = chunk.transfer_id
        if self._closed:
            raise ValueError(f"transfer {tid}: the remote copy engine is closed")
        if tid in self._pending:
            raise ValueError(f"transfer {tid}: id already in use by a pending chunk")
        if not chunk.direction.keyed:
            raise ValueError(f"transfer {tid}: {chunk.direction} is not a remote direction")
        n = chunk.num_blocks
        if n < 1 or len(chunk.dst_slots) != n or len(chunk.keys) != n:
            raise ValueError(
                f"transfer {tid}: needs >= 1 block and as many destination slots and keys as "
                f"source slots, got {n} -> {len(chunk.dst_slots)} with {len(chunk.keys)} keys"
            )
        if chunk.num_bytes != n * self.block_bytes:
            raise ValueError(
                f"transfer {tid}: num_bytes {chunk.num_bytes} != {n} blocks x {self.block_bytes}"
            )
        loading = chunk.direction.upward
        remote_slots = chunk.src_slots if loading else chunk.dst_slots
        if remote_slots != tuple(range(n)):
            raise ValueError(f"transfer {tid}: the remote side's slots must be 0..{n - 1}")
