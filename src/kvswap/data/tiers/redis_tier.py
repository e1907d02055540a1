"""The shared store on the Redis protocol as a secondary tier (`SecondaryTier`).

Over one `RemoteStoreClient` (owned: `close()` closes it) and the host pool's
slots, each block one self-checking value (`remote_format`):

    load   read lanes (2 threads)    read the job's keys (at most one value's
                                     bytes + 1 of each), check each value
                                     (remote_format.decode), copy the payload
                                     into its host slot
    store  write lanes (2 threads)   read the job's host slots into a lane's reused
                                     value buffers, SET NX; yield to loads between
                                     batches
    lookup                           one pipelined EXISTS round trip (the client's)

A job moves in batches of at most `read_batch_bytes` / `write_batch_bytes`
(at least one block), one pipelined round trip each. Two lanes per direction
let one lane checksum and copy while the other waits on its socket (zlib's CRC
and socket I/O release the GIL).

What fails is a miss, never an exception or a hang:
  - a key that is absent, or whose value fails a check, is a failed key of its
    load; a value that failed its checks (one found under another key, one of
    any other size, a key of another type than a string included) is deleted
    from the store and counted `corrupt_blocks`: never read whole, never an
    outage;
  - a store is SKIPPED, reported at once with every key failed and counted in
    `skipped_writes`, when `max_inflight_write_chunks` stores are already in
    flight, when the store is down, or for `SLOW_HOLD_S` after a write batch
    took longer than the store timeout: a write is only ever an optimisation,
    and the decode path must not pay for it;
  - a block the store refused or lost mid-write is a failed key, counted in
    `failed_writes`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvswap.data.remote_format import (
    HEADER_BYTES,
    LAYOUT_FINGERPRINT_BYTES,
    Rejected,
    decode,
    encode_into,
)
from kvswap.data.remote_store import RemoteStoreClient, WrongType
from kvswap.data.remote_url import parse_remote_url
from kvswap.data.tiers.base import HostSlots, JobResult, TransferJob, job_result
from kvswap.data.tiers.lanes import LaneTier, Totals
from kvswap.units import MIB

DEFAULT_READ_LANES = 2
DEFAULT_WRITE_LANES = 2
#: Bytes of values per round trip, at least one block. Reads: small, as pipelined
#: GETs of several MiB read slower than one-block GETs on loopback (the server
#: copies every reply into its output buffer first); two lanes overlap the round
#: trips. Writes: several blocks per pipeline; a write yields to reads between
#: batches. Moving one batch must take less than `remote_timeout_ms`, or the
#: store counts as slow (writes skipped) or down.
READ_BATCH_BYTES = MIB
WRITE_BATCH_BYTES = 4 * MIB
#: Writes skipped after a slow one, before the next may measure the store again.
SLOW_HOLD_S = 1.0


@dataclass(frozen=True)
class RemoteStats:
    """Counts since the tier opened; blocks unless the name says otherwise.
    Seconds are summed over jobs (read lanes overlap, so they can exceed wall time)."""

    hits_blocks: int = 0
    misses_blocks: int = 0
    corrupt_blocks: int = 0
    written_blocks: int = 0
    already_present: int = 0
    skipped_writes: int = 0
    failed_writes: int = 0
    remote_to_cpu_bytes: int = 0
    remote_to_cpu_s: float = 0.0
    cpu_to_remote_bytes: int = 0
    cpu_to_remote_s: float = 0.0
    outages: int = 0
    reconnects: int = 0

    def counters(self) -> dict[str, int]:
        """The integer counts by name, for a run summary's `remote` object and the
        metrics exporter; `corrupt` (their name) is `corrupt_blocks`."""
        counts = {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if isinstance(getattr(self, field.name), int)
        }
        counts["corrupt"] = self.corrupt_blocks
        return counts


class RedisTier(LaneTier):
    """Blocks as self-checking values in a Redis-protocol store (module docstring)."""

    def __init__(
        self,
        client: RemoteStoreClient,
        host_slots: memoryview | HostSlots,
        *,
        layout_fingerprint: bytes,
        ttl_s: float = 0.0,
        max_inflight_write_chunks: int = 4,
        num_read_lanes: int = DEFAULT_READ_LANES,
        num_write_lanes: int = DEFAULT_WRITE_LANES,
        read_batch_bytes: int = READ_BATCH_BYTES,
        write_batch_bytes: int = WRITE_BATCH_BYTES,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """`layout_fingerprint`: `remote_format.layout_fingerprint(layout)` of the host
        pool's blocks; a value written under another layout is a miss."""
        for name, value in (
            ("max_inflight_write_chunks", max_inflight_write_chunks),
            ("read_batch_bytes", read_batch_bytes),
            ("write_batch_bytes", write_batch_bytes),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if ttl_s < 0:
            raise ValueError(f"ttl_s must be >= 0, got {ttl_s}")
        if len(layout_fingerprint) != LAYOUT_FINGERPRINT_BYTES:
            raise ValueError(f"layout_fingerprint must be {LAYOUT_FINGERPRINT_BYTES} bytes")
        self.client = client
        self.ttl_s = ttl_s
        self.max_inflight_write_chunks = max_inflight_write_chunks
        self._fingerprint = layout_fingerprint
        self._lock = threading.Lock()  # guards the write state below
        self._totals = Totals(RemoteStats())
        self._num_inflight_writes = 0
        self._slow_until_s = float("-inf")
        self._scratch = threading.local()  # each write lane's reused value buffers
        super().__init__(
            host_slots, name="remote", num_load_lanes=num_read_lanes,
            num_store_lanes=num_write_lanes, clock=clock,
        )  # fmt: skip
        self._blocks_per_read = max(1, read_batch_bytes // self.block_bytes)
        self._blocks_per_write = max(1, write_batch_bytes // self.block_bytes)
        self._value_bytes = HEADER_BYTES + self.block_bytes  # one block's stored value

    # --- SecondaryTier ----------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        return self.client.lookup(keys)

    @property
    def available(self) -> bool:
        return self.client.available

    def counters(self) -> Mapping[str, int]:
        return self.stats().counters()

    def stats(self) -> RemoteStats:
        return dataclasses.replace(
            self._totals.snapshot(),
            outages=self.client.num_outages,
            reconnects=self.client.num_reconnects,
        )

    # --- loads --------------------------------------------------------------------------

    def _load(self, job: TransferJob) -> JobResult:
        start_s = self._clock()
        failed: set[bytes] = set()
        reasons: Counter[str] = Counter()  # why blocks failed: "missing" or a check
        for batch in _batches(job.num_blocks, self._blocks_per_read):
            values = self.client.get_many([job.keys[i] for i in batch], self._value_bytes)
            for index, value in zip(batch, values, strict=True):
                reason = self._land(job.keys[index], value, job.host_slots[index])
                if reason is not None:
                    failed.add(job.keys[index])
                    reasons[reason] += 1
        end_s = self._clock()
        num_failed = sum(reasons.values())
        num_hits = job.num_blocks - num_failed
        num_missing = reasons.pop("missing", 0)
        self._totals.add(
            hits_blocks=num_hits, misses_blocks=num_missing, corrupt_blocks=sum(reasons.values()),
            remote_to_cpu_bytes=num_hits * self.block_bytes, remote_to_cpu_s=end_s - start_s,
        )  # fmt: skip
        error = None
        if num_failed:
            checks = ", ".join(f"{reason} x{count}" for reason, count in sorted(reasons.items()))
            error = f"{num_missing} blocks missing"
            if checks:
                error += f", failed checks: {checks}"
        return job_result(
            job, failed, transfer_bytes=num_hits * self.block_bytes, start_s=start_s,
            end_s=end_s, error=error,
        )  # fmt: skip

    def _land(self, key: bytes, value: bytes | WrongType | None, host_slot: int) -> str | None:
        """Copy a fetched value's payload into `host_slot`; None, or why it was not."""
        if value is None:
            return "missing"
        if isinstance(value, WrongType):
            self.client.delete(key)  # not a block; the next write stores one there
            return "type"
        # The value must name this very key: one found under another (renamed, swapped)
        # is rejected as "key", like any other failed check.
        payload = decode(value, self._fingerprint, self.block_bytes, self.client.key_name(key))
        if isinstance(payload, Rejected):
            self.client.delete(key)  # a value we cannot use; the next write replaces it
            return payload.reason
        np.copyto(self.host_slots[host_slot], np.frombuffer(payload, np.uint8))
        return None

    # --- stores -------------------------------------------------------------------------

    def _store(self, job: TransferJob) -> JobResult:
        start_s = self._clock()
        failed: set[bytes] = set()
        errors: list[str] = []
        num_stored = num_present = num_failed = 0
        buffers = self._write_buffers()
        for batch in _batches(job.num_blocks, self._blocks_per_write):
            self._yield_to_loads()
            items = [
                (job.keys[i], self._encode(buffer, job.keys[i], job.host_slots[i]))
                for buffer, i in zip(buffers, batch, strict=False)
            ]
            batch_start_s = self._clock()
            outcome = self.client.put_many(items, self.ttl_s)
            batch_end_s = self._clock()
            if batch_end_s - batch_start_s > self.client.timeout_s:
                with self._lock:
                    self._slow_until_s = batch_end_s + SLOW_HOLD_S
            num_stored += outcome.num_stored
            num_present += outcome.num_already_present
            num_failed += len(outcome.failed_indices)
            failed.update(job.keys[batch[j]] for j in outcome.failed_indices)
            if outcome.error is not None and outcome.error not in errors:
                errors.append(outcome.error)
        end_s = self._clock()
        moved_bytes = (num_stored + num_present) * self.block_bytes
        self._totals.add(
            written_blocks=num_stored, already_present=num_present, failed_writes=num_failed,
            cpu_to_remote_bytes=moved_bytes, cpu_to_remote_s=end_s - start_s,
        )  # fmt: skip
        return job_result(
            job, failed, transfer_bytes=moved_bytes, start_s=start_s, end_s=end_s,
            error="; ".join(errors) or None,
        )  # fmt: skip

    def _encode(self, buffer: bytearray, key: bytes, host_slot: int) -> memoryview:
        """Block `key`'s value, from `host_slot`, bound to its store key."""
        payload = self.host_slots[host_slot].data
        return encode_into(buffer, payload, self._fingerprint, self.client.key_name(key))

    def _write_buffers(self) -> list[bytearray]:
        """This lane's value buffers, one per block of a batch, allocated once: a
        fresh 1 MiB buffer per block costs more than its checksum (page faults)."""
        buffers: list[bytearray] | None = getattr(self._scratch, "buffers", None)
        if buffers is None:
            buffers = [bytearray(self._value_bytes) for _ in range(self._blocks_per_write)]
            self._scratch.buffers = buffers
        return buffers

    def _refuse_store(self, job: TransferJob) -> str | None:
        """Why a store submitted now is skipped; None: it is queued (and counted in flight)."""
        reason = self._skip_reason()
        if reason is not None:
            self._totals.add(skipped_writes=job.num_blocks)
        return reason

    def _skip_reason(self) -> str | None:
        if not self.client.available:
            return f"the remote store at {self.client.url.shown} is down"
        with self._lock:
            if self._num_inflight_writes >= self.max_inflight_write_chunks:
                return f"{self._num_inflight_writes} writes in flight (the cap)"
            if self._clock() < self._slow_until_s:
                return f"the last write took over {self.client.timeout_s * 1000:g} ms"
            self._num_inflight_writes += 1
        return None

    def _store_done(self, job: TransferJob) -> None:
        with self._lock:
            self._num_inflight_writes -= 1

    def _release(self) -> None:
        self.client.close()


def _batches(num_blocks: int, step: int) -> list[range]:
    return [range(i, min(i + step, num_blocks)) for i in range(0, num_blocks, step)]


def open_redis_tier(
    url: str,
    host_slots: memoryview | HostSlots,
    *,
    layout_fingerprint: bytes,
    namespace: str,
    timeout_ms: float,
    required: bool = False,
    ttl_s: float = 0.0,
    max_inflight_write_chunks: int = 4,
    environ: Mapping[str, str] | None = None,
) -> RedisTier:
    """The store at `url` (`tiers.remote_url` forms) as a tier over `host_slots`: parse
    the URL, connect, check the server, build. `required`: a store that cannot be used
    raises a one-line KvSwapError; otherwise one warning line and the tier is off
    (lookups miss, writes are skipped) until the store answers. The client is closed
    when anything fails."""
    client = RemoteStoreClient(
        parse_remote_url(url, environ), namespace=namespace, timeout_ms=timeout_ms
    )
    try:
        client.connect(required=required)
        return RedisTier(
            client, host_slots, layout_fingerprint=layout_fingerprint, ttl_s=ttl_s,
            max_inflight_write_chunks=max_inflight_write_chunks,
        )  # fmt: skip
    except BaseException:
        client.close()
        raise
