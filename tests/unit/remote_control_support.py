"""What the remote-tier scenario tests share: a fake store, processes on tiny pools.

The store is a small in-memory fake shared by "processes" (each a scheduler
with its own pools and copy engine, as two engines on two machines would be).
`FakeStore` is the `RemoteIndex`; `RemoteEngine` is the manual copy engine of
the other scenario tests plus the store (and any keyed tier below it, each a
`FakeStore` too): a keyed chunk's outcome is decided when the test finishes it (a
key gone means that block's slot failed; a store that is down fails every slot).
Blocks are 2 tokens; the "model" samples `1000 + 100 * seq_id + i`
(scheduler_support.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kvswap.base.identity import KeyNamespace
from kvswap.base.remote_index import RemoteIndex
from kvswap.base.tier import keyed_tier_list
from kvswap.base.transfer import TransferChunk, TransferResult
from kvswap.base.write_policy import RemoteWritePolicy
from kvswap.control.policy import PolicyOptions
from kvswap.control.remote_tier import KeyedTier
from kvswap.control.scheduler import Scheduler
from kvswap.control.scheduler_records import SchedulerSettings
from kvswap.control.settings import RemoteSettings, SwapSettings
from kvswap.control.store_records import StoreLayout
from kvswap.control.swapper import Swapper
from tests.manual_engine import ManualCopyEngine
from tests.unit.scheduler_support import run_step

BT = 2
NAMESPACE = KeyNamespace(model_fingerprint="model-a", block_tokens=BT)


class FakeStore(RemoteIndex):
    """Block keys held by a shared store. `vanishing` keys are reported present by a
    lookup but gone by the time they are fetched (a TTL ran out in between);
    `refused` keys are never stored (the store refuses their SET: OOM)."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()
        self.vanishing: set[bytes] = set()
        self.refused: set[bytes] = set()
        self.up = True
        self.down_after_lookup = False  # an outage right after the next lookup answers
        self.lookups: list[tuple[bytes, ...]] = []
        self.written: list[bytes] = []  # every key a write chunk stored, in order

    def lookup(self, keys: Sequence[bytes]) -> int:
        self.lookups.append(tuple(keys))
        if self.down_after_lookup:
            self.up = False
        held = 0
        for key in keys:
            if key not in self.keys and key not in self.vanishing:
                break
            held += 1
        return held

    @property
    def available(self) -> bool:
        return self.up

    def put(self, keys: Sequence[bytes]) -> set[bytes]:
        """A write chunk's `keys` stored; the keys refused."""
        refused = {key for key in keys if key in self.refused}
        stored = [key for key in keys if key not in refused]
        self.keys.update(stored)
        self.written += stored
        return refused

    def got(self, keys: Sequence[bytes]) -> None:
        """A read chunk's `keys` were read (a use)."""


class LocalSlab(FakeStore):
    """This process's own keyed tier (the NVMe slab by key), evicting as `NvmeTier` does:
    `evict(key)` drops a key as its policy would, and `evicted_keys` says so once. With
    `capacity_blocks`, a write that finds it full evicts its least recently used key
    no sequence holds (written or read: a use), and is refused when every key is held."""

    def __init__(self, capacity_blocks: int | None = None) -> None:
        super().__init__()
        self._capacity_blocks = capacity_blocks
        self.evicted: list[bytes] = []
        self.recency: dict[bytes, None] = {}  # the keys, least recently used first
        self.held: Counter[bytes] = Counter()

    @property
    def local(self) -> bool:
        return True

    @property
    def capacity_blocks(self) -> int | None:
        return self._capacity_blocks

    @property
    def holds_keys(self) -> bool:
        return True

    def hold(self, keys: Sequence[bytes]) -> None:
        self.held.update(keys)

    def release(self, keys: Sequence[bytes]) -> None:
        self.held.subtract(keys)
        self.held = +self.held  # a key released as often as held is free again

    def evict(self, key: bytes) -> None:
        self.keys.remove(key)
        self.recency.pop(key, None)
        self.evicted.append(key)

    def evicted_keys(self) -> Sequence[bytes]:
        evicted, self.evicted = self.evicted, []
        return evicted

    def put(self, keys: Sequence[bytes]) -> set[bytes]:
        refused: set[bytes] = set()
        for key in keys:
            if key in self.refused or not self._room_for(key):
                refused.add(key)
                continue
            self.keys.add(key)
            self.written.append(key)
            self.got([key])
        return refused

    def got(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            if key in self.keys:
                self.recency.pop(key, None)
                self.recency[key] = None

    def _room_for(self, key: bytes) -> bool:
        if self._capacity_blocks is None or key in self.keys:
            return True
        if len(self.keys) < self._capacity_blocks:
            return True
        victim = next((each for each in self.recency if not self.held[each]), None)
        if victim is None:
            return False
        self.evict(victim)
        return True


class RemoteEngine(ManualCopyEngine):
    """`stores[i]` is the i-th keyed tier, named as the swapper names it
    (`keyed_tier_list`: the first, `Tier.REMOTE`, unless it is a `LocalSlab`)."""

    def __init__(self, *stores: FakeStore) -> None:
        super().__init__()
        self.store = stores[0]
        tiers = keyed_tier_list([store.local for store in stores])
        self.stores = dict(zip(tiers, stores, strict=True))

    def _result(self, chunk: TransferChunk) -> TransferResult:
        def result(success: bool, failed: tuple[int, ...], error: str | None) -> TransferResult:
            return TransferResult(
                chunk.transfer_id, success, chunk.num_bytes, 0.0, 0.001, error, failed
            )

        direction = chunk.direction
        if not direction.keyed:
            return super()._result(chunk)
        store = self.stores[direction.src_tier if direction.upward else direction.dst_tier]
        if direction.upward:
            if not store.up:
                return result(False, chunk.dst_slots, "store down")
            pairs = zip(chunk.dst_slots, chunk.keys, strict=True)
            store.got(chunk.keys)
            return result(True, tuple(s for s, key in pairs if key not in store.keys), None)
        if not store.up or chunk.transfer_id in self.fail_ids:
            return result(False, chunk.dst_slots, "skipped")  # a skipped write
        refused_keys = store.put(chunk.keys)
        pairs = zip(chunk.dst_slots, chunk.keys, strict=True)
        refused = tuple(slot for slot, key in pairs if key in refused_keys)
        if refused:
            return result(True, refused, "refused")
        return super()._result(chunk)


def slab_tier(capacity_blocks: int) -> tuple[RemoteEngine, list[KeyedTier]]:
    """A copy engine and the NVMe slab by key (`LocalSlab`, an LRU over keys of
    `capacity_blocks`), written as blocks leave the pinned pool: `engine.store`. For a
    swapper whose layout names no namespace."""
    engine = RemoteEngine(LocalSlab(capacity_blocks))
    settings = RemoteSettings("unnamed", RemoteWritePolicy.ON_DEMOTE)
    return engine, [KeyedTier(engine.store, settings)]


def make_process(
    store: FakeStore,
    *,
    num_gpu_blocks: int = 8,
    num_cpu_blocks: int = 8,
    write_policy: RemoteWritePolicy = RemoteWritePolicy.ON_FINISH,
    max_lookup_blocks: int = 64,
    max_inflight_write_chunks: int = 4,
    swap_out_chunk_blocks: int = 4,
    swap_in_chunk_blocks: int = 4,
    cpu_demote_high_watermark: float = 1.0,
    cpu_demote_low_watermark: float = 0.99,
    remote: bool = True,
    below: Sequence[tuple[FakeStore, RemoteWritePolicy]] = (),
    slab: LocalSlab | None = None,
) -> tuple[Scheduler, RemoteEngine]:
    """One process: its own pools and copy engine, the keyed tier `store` (the shared
    store, or a `LocalSlab`: this process's NVMe slab) and the keyed tiers `below` it,
    each written by its own policy, with the default bound on writes in flight;
    `slab`: this process's NVMe slab in front of them all, written on demotion.
    Watermarks at 1.0: nothing is swapped out or demoted ahead of need unless a test
    asks."""
    keyed = [
        KeyedTier(store, RemoteSettings("model-a", write_policy, max_lookup_blocks,
                                        max_inflight_write_chunks)),
        *(KeyedTier(each, RemoteSettings("model-a", policy, max_lookup_blocks))
          for each, policy in below),
    ]  # fmt: skip
    if slab is not None:
        keyed.insert(0, KeyedTier(slab, RemoteSettings("model-a", RemoteWritePolicy.ON_DEMOTE)))
    engine = RemoteEngine(*(each.index for each in keyed))  # type: ignore[arg-type]
    layout = StoreLayout(BT, num_gpu_blocks, num_cpu_blocks, 0, NAMESPACE)
    swap = SwapSettings(
        block_bytes=64, swap_out_high_watermark=1.0, swap_out_low_watermark=0.99,
        swap_out_chunk_blocks=swap_out_chunk_blocks, swap_in_chunk_blocks=swap_in_chunk_blocks,
        cpu_demote_high_watermark=cpu_demote_high_watermark,
        cpu_demote_low_watermark=cpu_demote_low_watermark,
    )  # fmt: skip
    swapper = Swapper(
        layout, PolicyOptions(sink_protection=False, min_residency_steps=0), swap, engine,
        clock_s=lambda: 0.0, keyed=keyed if remote else [],
    )  # fmt: skip
    return Scheduler(swapper, SchedulerSettings(max_num_seqs=8, max_num_batched_tokens=64)), engine


def between_steps(scheduler: Scheduler, engine: ManualCopyEngine, step: int) -> None:
    """Every transfer lands, then a step boundary with no work (the write-behind runs)."""
    engine.finish()
    scheduler.swapper.begin_step(step)
    scheduler.swapper.end_step()
    scheduler.swapper.check_integrity()


def serve_and_write(store: FakeStore, prompt: list[int], *, cache_salt: str | None = None) -> None:
    """Process A serves one request and writes its full blocks to the store."""
    a, engine = make_process(store)
    a.add_request(1, prompt, 1, 0.0, cache_salt=cache_salt)
    _, finished = run_step(a)
    assert finished == [1]
    for step in (2, 3):
        between_steps(a, engine, step)


def extend_a_stored_prefix(store: FakeStore) -> tuple[Scheduler, RemoteEngine]:
    """A serves [1 2] [3 4] [5] and writes it; B then restores [1 2] [3 4] from the
    store, computes [9 9] [9], finishes, and two quiet step boundaries pass."""
    serve_and_write(store, [1, 2, 3, 4, 5])
    b, engine = make_process(store)
    b.add_request(7, [1, 2, 3, 4, 9, 9, 9], 1, 0.0)
    run_step(b)
    between_steps(b, engine, 2)
    between_steps(b, engine, 3)
    return b, engine
