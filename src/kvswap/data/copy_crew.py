"""Copy threads that share one chunk's block copies, so a chunk uses every core.

    lane thread (owns the batch)             helper threads (copy_threads - 1)
    start(batch): post --------------------> wake, join the batch
      take pair 0, copy                      take pair 1, copy
      take pair 2, copy                      take pair 3, copy
      ...                                    ...
      nothing left to take: withdraw the     last pair done, last one out:
      batch, return (the lane starts its     on_done(outcome) reports the
      next chunk: the helper joins it        chunk, then joins the next batch
      without going to sleep)                if one is open

A batch is one chunk's (src_slot, dst_slot) pairs. Every thread takes the
next pair from one cursor, so the pairs go to whichever threads the OS runs:
a helper that is not scheduled delays the chunk by at most the one pair it
holds, and the owner never waits for a pair nobody took. The last thread to
leave a batch calls its `on_done`, so the owner need not wait for a helper's
last pair: it returns to its lane, which starts the next chunk meanwhile, and
a stream of chunks keeps every thread copying. A batch smaller than
`min_spread_bytes` (or with one pair) stays on its lane: waking a helper
costs more than it saves.

Priority: a LOW batch's owner waits (`LinkArbiter.wait_until_no_high`)
before taking each pair while any HIGH chunk is pending or running; a helper
in a LOW batch leaves instead and helps the HIGH batch. So a HIGH chunk waits
at most for the LOW copies already in flight, one per copy thread, and the
LOW batch gets its helpers back once the HIGH chunks are done. A LOW batch
given a `copy_piece` takes its blocks in pieces of at most `low_piece_bytes`
(a block is copied once all its pieces are), so what a HIGH chunk waits for
is a piece, not a block.

Failures: a copy that raises stops the batch: that block and every one not
yet copied are reported lost. Nothing raises out of `start` but a bug in the crew.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvswap.data.block_copy import error_text
from kvswap.data.link_arbiter import LinkArbiter
from kvswap.units import ceil_div

# copy(src_slot, dst_slot): one block (raising stops the batch).
PairCopy = Callable[[int, int], None]
# copy_piece(src_slot, dst_slot, piece, num_pieces): bytes [piece / num_pieces,
# (piece + 1) / num_pieces) of the block, the same contract as PairCopy.
PieceCopy = Callable[[int, int, int, int], None]


@dataclass(frozen=True)
class BatchOutcome:
    """Destination slots not to trust (in chunk order) and what went wrong."""

    failed_dst_slots: tuple[int, ...]
    errors: tuple[str, ...]


# on_done(outcome, end_s): called once, by the last thread to leave the batch.
OnDone = Callable[[BatchOutcome, float], None]


class Batch:
    """One chunk's pairs and progress; `wait()` returns once no thread touches it.
    Every other field is guarded by the crew's lock."""

    def __init__(
        self,
        pairs: Sequence[tuple[int, int]],
        copy: PairCopy,
        yield_to: LinkArbiter | None,
        on_done: OnDone | None,
        copy_piece: PieceCopy | None = None,
        num_pieces: int = 1,
    ) -> None:
        self.pairs = pairs
        self.copy = copy
        self.copy_piece = copy_piece
        self.num_pieces = num_pieces  # each pair copied as this many pieces (units)
        self.num_units = len(pairs) * num_pieces
        self.yield_to = yield_to  # LOW: the arbiter it yields to; HIGH: None
        self.on_done = on_done
        self.done = threading.Event()  # set after on_done, once no thread touches the batch
        self.result: tuple[BatchOutcome, float] | None = None  # (outcome, end_s) once done
        self.owner_left = False  # the owner is out; the last helper out completes it
        self.next_index = 0  # the next unit to take: pair next_index // num_pieces
        self.stopped = False  # a copy raised: take nothing more
        self.pieces_copied = [0] * len(pairs)
        self.errors: list[str] = []
        self.num_helpers = 0  # helpers inside now
        self.helper_yielded = False  # a helper left for a HIGH chunk

    def wait(self) -> tuple[BatchOutcome, float]:
        """Block until every pair is copied or lost; (outcome, end_s)."""
        self.done.wait()
        if self.result is None:
            raise RuntimeError("copy crew: a batch ended without a result")
        return self.result

    def has_untaken(self) -> bool:
        return not self.stopped and self.next_index < self.num_units

    def outcome(self) -> BatchOutcome:
        failed = tuple(
            dst
            for index, (_src, dst) in enumerate(self.pairs)
            if self.pieces_copied[index] < self.num_pieces
        )
        return BatchOutcome(failed, tuple(self.errors))


class CopyCrew:
    """`num_helpers` threads that join the lanes' batches, HIGH ones first."""

    def __init__(
        self,
        num_helpers: int,
        *,
        min_spread_bytes: int,
        low_piece_bytes: int = 0,
        name: str = "kvswap-crew",
    ) -> None:
        """`low_piece_bytes`: a LOW batch given a `copy_piece` copies its blocks in
        pieces of at most this many bytes, so a HIGH chunk waits for less (0: whole
        blocks)."""
        if num_helpers < 0 or min_spread_bytes < 0 or low_piece_bytes < 0:
            raise ValueError(
                f"num_helpers {num_helpers}, min_spread_bytes {min_spread_bytes} and "
                f"low_piece_bytes {low_piece_bytes} must be >= 0"
            )
        self.min_spread_bytes = min_spread_bytes
        self.low_piece_bytes = low_piece_bytes
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # helpers wait here for a batch
        self._open: list[Batch] = []
        self._closing = False
        self._threads = [
            threading.Thread(target=self._serve, name=f"{name}-{index}", daemon=True)
            for index in range(num_helpers)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def num_helpers(self) -> int:
        return len(self._threads)

    def start(
        self,
        pairs: Sequence[tuple[int, int]],
        copy: PairCopy,
        *,
        num_bytes: int,
        yield_to: LinkArbiter | None,
        on_done: OnDone | None = None,
        copy_piece: PieceCopy | None = None,
    ) -> Batch:
        """Copy pairs on the calling thread (and, if the batch is big enough, on the
        helpers) until none is left to take; return the batch, whose
        last pairs may still be in a helper's hands. `on_done` runs once all are
        copied or lost, on whichever thread leaves last. `yield_to`: for a LOW
        batch, the arbiter whose HIGH chunks go first; with `copy_piece`, a LOW
        batch copies its blocks in pieces of at most `low_piece_bytes`."""
        num_pieces = 1
        pieces = bool(self.low_piece_bytes and pairs and copy_piece is not None)
        if pieces and yield_to is not None:
            num_pieces = max(1, ceil_div(num_bytes // len(pairs), self.low_piece_bytes))
        batch = Batch(pairs, copy, yield_to, on_done, copy_piece, num_pieces)
        shared = bool(self._threads) and len(pairs) > 1
        shared = shared and num_bytes >= self.min_spread_bytes
        if shared:
            with self._lock:
                self._open.append(batch)
                self._work.notify(min(len(pairs) - 1, len(self._threads)))
        try:
            self._work_on(batch, owner=True)
        finally:
            with self._lock:
                if shared:
                    self._open.remove(batch)  # nothing left to take: no helper joins now
                batch.owner_left = True
                last_out = batch.num_helpers == 0
            if last_out:
                self._complete(batch)
        return batch

    def run(
        self,
        pairs: Sequence[tuple[int, int]],
        copy: PairCopy,
        *,
        num_bytes: int,
        yield_to: LinkArbiter | None,
        copy_piece: PieceCopy | None = None,
    ) -> BatchOutcome:
        """`start`, then wait until no thread touches the batch."""
        batch = self.start(
            pairs,
            copy,
            num_bytes=num_bytes,
            yield_to=yield_to,
            copy_piece=copy_piece,
        )
        return batch.wait()[0]

    def close(self) -> None:
        """Stop the helpers (after the batches they are in) and join them."""
        with self._lock:
            self._closing = True
            self._work.notify_all()
        for thread in self._threads:
            thread.join()

    def _work_on(self, batch: Batch, *, owner: bool) -> None:
        done_index: int | None = None
        while True:
            if batch.yield_to is not None:
                if owner:
                    batch.yield_to.wait_until_no_high()
                    if batch.helper_yielded:  # read unlocked: at worst, recalled a pair later
                        self._recall_helpers(batch)
                elif batch.yield_to.has_high():
                    with self._lock:
                        self._mark_copied(batch, done_index)
                        batch.helper_yielded = True
                    return
            with self._lock:
                self._mark_copied(batch, done_index)
                done_index = None
                if not batch.has_untaken():
                    return
                unit = batch.next_index
                batch.next_index += 1
            index, piece = divmod(unit, batch.num_pieces)
            src_slot, dst_slot = batch.pairs[index]
            try:
                if batch.copy_piece is not None and batch.num_pieces > 1:
                    batch.copy_piece(src_slot, dst_slot, piece, batch.num_pieces)
                else:
                    batch.copy(src_slot, dst_slot)
            except Exception as exc:
                with self._lock:
                    batch.stopped = True
                    batch.errors.append(error_text(exc))
                return
            done_index = index

    @staticmethod
    def _mark_copied(batch: Batch, index: int | None) -> None:
        """One more piece of pair `index` landed (None: nothing did)."""
        if index is not None:
            batch.pieces_copied[index] += 1

    def _recall_helpers(self, batch: Batch) -> None:
        """After a LOW batch's owner yielded: wake the helpers that left it."""
        with self._lock:
            if batch.helper_yielded and batch.has_untaken():
                batch.helper_yielded = False
                self._work.notify_all()

    def _pick(self) -> Batch | None:
        """The oldest open batch with pairs left that may be helped now: a HIGH
        one, or a LOW one while no HIGH chunk is pending (an open HIGH batch is
        a pending HIGH chunk, so HIGH batches come first). Called with the lock
        held."""
        for batch in self._open:
            if batch.has_untaken() and (batch.yield_to is None or not batch.yield_to.has_high()):
                return batch
        return None

    def _serve(self) -> None:
        while True:
            with self._lock:
                batch = self._pick()
                while batch is None:
                    if self._closing:
                        return
                    self._work.wait()
                    batch = self._pick()
                batch.num_helpers += 1
            try:
                self._work_on(batch, owner=False)
            finally:
                with self._lock:
                    batch.num_helpers -= 1
                    last_out = batch.owner_left and batch.num_helpers == 0
                if last_out:
                    self._complete(batch)

    def _complete(self, batch: Batch) -> None:
        """The last thread out: record the result, report it, release `wait()`."""
        try:
            with self._lock:
                batch.result = (batch.outcome(), time.perf_counter())
            if batch.on_done is not None:
                batch.on_done(*batch.result)
        finally:
            batch.done.set()  # even if on_done failed: the waiter reports instead
