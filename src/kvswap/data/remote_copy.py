"""The remote tier's copy engine: chunks between the pinned host pool and the store.

`RemoteCopyEngine` executes the two remote directions of the control plane's
chunks and answers its presence lookups (`RemoteIndex`) over one
`RemoteStoreClient`:

    REMOTE_TO_CPU  HIGH lanes (2 threads)   GET the chunk's keys, check each value
                                            (remote_format.decode), copy the payload
                                            into the host pool's dst slot
    CPU_TO_REMOTE  LOW lanes (2 threads)    read the host pool's src slots into a
                                            lane's reused value buffers, SET NX;
                                            yield to reads between batches

A chunk moves in batches of at most `read_batch_bytes` / `write_batch_bytes`
(at least one block), one pipelined round trip each. Two lanes per direction
let one lane checksum and copy while the other waits on its socket (zlib's CRC
and socket I/O release the GIL).

A chunk's lane is fixed by its direction (reads are what a request waits for;
its `priority` field is not consulted). Lanes are threads because they block
on sockets; idle, they sleep on their queue. A HIGH chunk never waits behind a
LOW one: the lanes are separate threads on separate connections, and a LOW
lane waits before each batch while any read is pending (`LinkArbiter`).

What fails is a miss, never an exception or a hang:
  - a read whose key is absent, or whose value fails a check: that dst slot is
    in `failed_dst_slots`; a value that failed its checks is deleted from the
    store and counted `corrupt_blocks`;
  - a write is SKIPPED, reported at once as success=False with every slot
    failed and counted in `skipped_writes`, when `max_inflight_write_chunks`
    writes are already in flight, when the store is down, or for
    `SLOW_HOLD_S` after a write batch took longer than the store timeout: a
    write is only ever an optimisation, and the decode path must not pay for it;
  - a block the store refused or lost mid-write is a failed slot (remote side
    position i of the chunk's keys) and counted in `failed_writes`.

Same contract as `LocalCopyEngine`: submit/poll/wait/wait_all/close from one
control thread; programming errors (bad slots, a reused id, a non-remote
direction) raise ValueError. Times are on `clock` (perf_counter by default).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from kvswap.control.identity import KEY_BYTES
from kvswap.control.remote import RemoteIndex
from kvswap.control.transfer import (
    REMOTE_DIRECTIONS,
    Direction,
    TransferChunk,
    TransferResult,
)
from kvswap.data.block_copy import error_text, failed_result
from kvswap.data.copy_workers import LinkArbiter
from kvswap.data.future_results import FutureCopyEngine
from kvswap.data.host_pool import HostPool
from kvswap.data.remote_format import (
    HEADER_BYTES,
    Rejected,
    decode,
    encode_into,
    layout_fingerprint,
)
from kvswap.data.remote_store import RemoteStoreClient
from kvswap.data.remote_url import parse_remote_url
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
    """Counts since the engine started; blocks unless the name says otherwise.
    Seconds are summed over chunks (read lanes overlap, so they can exceed wall time)."""

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


class _Lanes:
    """`count` threads serving one FIFO; `run` never raises into a thread, and
    `settle` runs before the result is published."""

    def __init__(
        self,
        name: str,
        count: int,
        run: Callable[[TransferChunk], TransferResult],
        settle: Callable[[TransferChunk], None],
        clock: Callable[[], float],
    ) -> None:
        self._run = run
        self._settle = settle
        self._clock = clock
        self._jobs: queue.SimpleQueue[tuple[TransferChunk, Future[TransferResult]] | None]
        self._jobs = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._serve, name=f"kvswap-remote-{name}-{i}", daemon=True)
            for i in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def put(self, chunk: TransferChunk, future: Future[TransferResult]) -> None:
        self._jobs.put((chunk, future))

    def stop(self) -> None:
        for _thread in self._threads:
            self._jobs.put(None)  # after every queued job: they finish first

    def join(self) -> None:
        for thread in self._threads:
            thread.join()

    def is_alive(self) -> bool:
        return any(thread.is_alive() for thread in self._threads)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            chunk, future = job
            start_s = self._clock()
            try:
                result = self._run(chunk)
            except BaseException as exc:  # a bug: still a result, never a hung waiter
                result = failed_result(chunk, start_s, error_text(exc))
            self._settle(chunk)
            future.set_result(result)


class RemoteCopyEngine(FutureCopyEngine, RemoteIndex):
    """Remote chunks over one store client and one host pool; also the RemoteIndex.
    Owns the client: `close()` closes it."""

    def __init__(
        self,
        client: RemoteStoreClient,
        host_pool: HostPool,
        *,
        ttl_s: float = 0.0,
        max_inflight_write_chunks: int = 4,
        num_read_lanes: int = DEFAULT_READ_LANES,
        num_write_lanes: int = DEFAULT_WRITE_LANES,
        read_batch_bytes: int = READ_BATCH_BYTES,
        write_batch_bytes: int = WRITE_BATCH_BYTES,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        for name, value in (
            ("max_inflight_write_chunks", max_inflight_write_chunks),
            ("num_read_lanes", num_read_lanes),
            ("num_write_lanes", num_write_lanes),
            ("read_batch_bytes", read_batch_bytes),
            ("write_batch_bytes", write_batch_bytes),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        super().__init__()
        if ttl_s < 0:
            raise ValueError(f"ttl_s must be >= 0, got {ttl_s}")
        self.client = client
        self.host_pool = host_pool
        self.block_bytes = host_pool.layout.block_bytes
        self.ttl_s = ttl_s
        self.max_inflight_write_chunks = max_inflight_write_chunks
        self._fingerprint = layout_fingerprint(host_pool.layout)
        self._blocks_per_read = max(1, read_batch_bytes // self.block_bytes)
        self._blocks_per_write = max(1, write_batch_bytes // self.block_bytes)
        self._clock = clock
        self._arbiter = LinkArbiter()
        self._lock = threading.Lock()  # guards the totals and the write state below
        self._totals = RemoteStats()
        self._num_inflight_writes = 0
        self._slow_until_s = float("-inf")
        self._scratch = threading.local()  # each write lane's reused value buffers
        self._closed = False
        self._reads = _Lanes("read", num_read_lanes, self._read, self._read_done, clock)
        self._writes = _Lanes("write", num_write_lanes, self._write, self._write_done, clock)

    # --- RemoteIndex --------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        return self.client.lookup(keys)

    @property
    def available(self) -> bool:
        return self.client.available

    # --- CopyEngine ---------------------------------------------------------------

    def submit(self, chunk: TransferChunk) -> None:
        self._validate(chunk)
        future = self._track(chunk)
        if chunk.direction is Direction.REMOTE_TO_CPU:
            self._arbiter.high_submitted()  # before a write lane's next batch check
            self._reads.put(chunk, future)
            return
        reason = self._skip_reason()
        if reason is not None:
            self._add(skipped_writes=chunk.num_blocks)
            future.set_result(failed_result(chunk, self._clock(), f"write skipped: {reason}"))
            return
        self._writes.put(chunk, future)

    def close(self) -> None:
        """Let queued chunks finish, join the lanes, close the client."""
        if self._closed:
            return
        self._closed = True
        for lanes in (self._reads, self._writes):
            lanes.stop()
        for lanes in (self._reads, self._writes):
            lanes.join()
        self.client.close()

    def __enter__(self) -> RemoteCopyEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> RemoteStats:
        with self._lock:
            totals = self._totals
        return dataclasses.replace(totals, outages=self.client.num_outages)

    # --- the lanes' work ------------------------------------------------------------

    def _read(self, chunk: TransferChunk) -> TransferResult:
        start_s = self._clock()
        failed: list[int] = []
        reasons: Counter[str] = Counter()  # why blocks failed: "missing" or a check
        for batch in _batches(chunk.num_blocks, self._blocks_per_read):
            values = self.client.get_many([chunk.keys[i] for i in batch])
            for index, value in zip(batch, values, strict=True):
                reason = self._land(chunk.keys[index], value, chunk.dst_slots[index])
                if reason is not None:
                    failed.append(chunk.dst_slots[index])
                    reasons[reason] += 1
        end_s = self._clock()
        num_hits = chunk.num_blocks - len(failed)
        num_missing = reasons.pop("missing", 0)
        self._add(
            hits_blocks=num_hits, misses_blocks=num_missing, corrupt_blocks=sum(reasons.values()),
            remote_to_cpu_bytes=num_hits * self.block_bytes, remote_to_cpu_s=end_s - start_s,
        )  # fmt: skip
        error = None
        if failed:
            checks = ", ".join(f"{reason} x{count}" for reason, count in sorted(reasons.items()))
            error = f"{num_missing} blocks missing"
            if checks:
                error += f", failed checks: {checks}"
        return _result(chunk, start_s, end_s, failed, error)

    def _land(self, key: bytes, value: bytes | None, dst_slot: int) -> str | None:
        """Copy a fetched value's payload into `dst_slot`; None, or why it was not."""
        if value is None:
            return "missing"
        # The value must name this very key: one found under another (renamed, swapped)
        # is rejected as "key", like any other failed check.
        payload = decode(value, self._fingerprint, self.block_bytes, self.client.key_name(key))
        if isinstance(payload, Rejected):
            self.client.delete(key)  # a value we cannot use; the next write replaces it
            return payload.reason
        np.copyto(self.host_pool.byte_view(dst_slot).numpy(), np.frombuffer(payload, np.uint8))
        return None

    def _write(self, chunk: TransferChunk) -> TransferResult:
        start_s = self._clock()
        failed: list[int] = []
        errors: list[str] = []
        num_stored = num_present = 0
        buffers = self._write_buffers()
        for batch in _batches(chunk.num_blocks, self._blocks_per_write):
            self._arbiter.wait_until_no_high()
            items = [
                (chunk.keys[i], self._encode(buffer, chunk.keys[i], chunk.src_slots[i]))
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
            failed.extend(chunk.dst_slots[batch[j]] for j in outcome.failed_indices)
            if outcome.error is not None and outcome.error not in errors:
                errors.append(outcome.error)
        end_s = self._clock()
        self._add(
            written_blocks=num_stored, already_present=num_present, failed_writes=len(failed),
            cpu_to_remote_bytes=(num_stored + num_present) * self.block_bytes,
            cpu_to_remote_s=end_s - start_s,
        )  # fmt: skip
        return _result(chunk, start_s, end_s, failed, "; ".join(errors) or None)

    def _encode(self, buffer: bytearray, key: bytes, src_slot: int) -> memoryview:
        """Block `key`'s value, from host slot `src_slot`, bound to its store key."""
        payload = self.host_pool.byte_view(src_slot).numpy().data
        return encode_into(buffer, payload, self._fingerprint, self.client.key_name(key))

    def _write_buffers(self) -> list[bytearray]:
        """This lane's value buffers, one per block of a batch, allocated once: a
        fresh 1 MiB buffer per block costs more than its checksum (page faults)."""
        buffers: list[bytearray] | None = getattr(self._scratch, "buffers", None)
        if buffers is None:
            value_bytes = HEADER_BYTES + self.block_bytes
            buffers = [bytearray(value_bytes) for _ in range(self._blocks_per_write)]
            self._scratch.buffers = buffers
        return buffers

    def _read_done(self, _chunk: TransferChunk) -> None:
        self._arbiter.high_finished()

    def _write_done(self, _chunk: TransferChunk) -> None:
        with self._lock:
            self._num_inflight_writes -= 1

    def _skip_reason(self) -> str | None:
        """Why a write submitted now is skipped; None: it is queued (and counted in flight)."""
        if not self.client.available:
            return f"the remote store at {self.client.url.shown} is down"
        with self._lock:
            if self._num_inflight_writes >= self.max_inflight_write_chunks:
                return f"{self._num_inflight_writes} writes in flight (the cap)"
            if self._clock() < self._slow_until_s:
                return f"the last write took over {self.client.timeout_s * 1000:g} ms"
            self._num_inflight_writes += 1
        return None

    def _add(self, **counts: float) -> None:
        with self._lock:
            totals = {name: getattr(self._totals, name) + count for name, count in counts.items()}
            self._totals = dataclasses.replace(self._totals, **totals)

    _dead_lane_reason = "remote copy lane exited"

    def _lane_alive(self, chunk: TransferChunk) -> bool:
        lanes = self._reads if chunk.direction is Direction.REMOTE_TO_CPU else self._writes
        return lanes.is_alive()

    def _now_s(self) -> float:
        return self._clock()

    def _validate(self, chunk: TransferChunk) -> None:
        tid = chunk.transfer_id
        if self._closed:
            raise ValueError(f"transfer {tid}: the remote copy engine is closed")
        if self._is_pending(tid):
            raise ValueError(f"transfer {tid}: id already in use by a pending chunk")
        if chunk.direction not in REMOTE_DIRECTIONS:
            raise ValueError(f"transfer {tid}: {chunk.direction} is not a remote direction")
        n = chunk.num_blocks
        if n < 1 or len(chunk.dst_slots) != n or len(chunk.keys) != n:
            raise ValueError(
                f"transfer {tid}: needs >= 1 block and as many destination slots and keys as "
                f"source slots, got {n} -> {len(chunk.dst_slots)} with {len(chunk.keys)} keys"
            )
        if any(len(key) != KEY_BYTES for key in chunk.keys):
            raise ValueError(f"transfer {tid}: every key must be {KEY_BYTES} bytes")
        if chunk.num_bytes != n * self.block_bytes:
            raise ValueError(
                f"transfer {tid}: num_bytes {chunk.num_bytes} != {n} blocks x {self.block_bytes}"
            )
        reading = chunk.direction is Direction.REMOTE_TO_CPU
        remote_slots, host_slots = (
            (chunk.src_slots, chunk.dst_slots) if reading else (chunk.dst_slots, chunk.src_slots)
        )
        if remote_slots != tuple(range(n)):
            raise ValueError(f"transfer {tid}: the remote side's slots must be 0..{n - 1}")
        num_slots = self.host_pool.num_slots
        if len(set(host_slots)) != n or not all(0 <= slot < num_slots for slot in host_slots):
            raise ValueError(
                f"transfer {tid}: host slots {host_slots} repeat or leave [0, {num_slots})"
            )


def _batches(num_blocks: int, step: int) -> list[range]:
    return [range(i, min(i + step, num_blocks)) for i in range(0, num_blocks, step)]


def _result(
    chunk: TransferChunk, start_s: float, end_s: float, failed: list[int], error: str | None
) -> TransferResult:
    # A chunk with some blocks missing in the store succeeded for the others: only the
    # slots listed are untrusted (the control plane recomputes just those blocks).
    return TransferResult(
        transfer_id=chunk.transfer_id,
        success=len(failed) < chunk.num_blocks,
        num_bytes=chunk.num_bytes,
        start_s=start_s,
        end_s=end_s,
        error=error,
        failed_dst_slots=tuple(failed),
    )


def open_remote_tier(
    url: str,
    host_pool: HostPool,
    *,
    namespace: str,
    timeout_ms: float,
    ttl_s: float = 0.0,
    max_inflight_chunks: int = 4,
    required: bool = False,
    environ: Mapping[str, str] | None = None,
) -> RemoteCopyEngine:
    """The remote tier from `tiers.remote_*` settings: parse the URL, connect, check
    the server. `required`: a store that cannot be used raises a one-line
    KvSwapError; otherwise one warning line and the engine starts with the tier off
    (lookups miss, writes are skipped) until the store answers."""
    client = RemoteStoreClient(
        parse_remote_url(url, environ), namespace=namespace, timeout_ms=timeout_ms
    )
    try:
        client.connect(required=required)
    except BaseException:
        client.close()
        raise
    return RemoteCopyEngine(
        client, host_pool, ttl_s=ttl_s, max_inflight_write_chunks=max_inflight_chunks
    )
