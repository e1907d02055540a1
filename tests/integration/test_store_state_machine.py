"""Random operations across all tiers; after every step every live copy holds its bytes.

The control plane (Swapper) drives the real data plane (device pool, pinned
pool, two-queue copy engine, and when drawn the NVMe slab by key: `NvmeTier`
over a `DiskPool`, evicting by LRU, this process's own). A block's "KV" is a deterministic
function of its chain position and tokens, written into its GPU slot when the
block is computed, exactly where the model would write it. After every step:
each ready copy on every tier equals that function of the block as it is now,
no slot has two owners, and each tier's occupancy equals the copies it holds.

The remote tier, when drawn, is an in-memory store of key -> bytes behind a
`RemoteIndex`; its chunks are executed at submit (their sources are reserved
and their destinations owned, so the bytes are final either way) and reported
through the same gate. Keys vanish (a TTL ran out) and the store goes down and
comes back at random: a remote copy the control plane trusts is checked
against the store whenever the store still holds its key, and a fetch of a key
that is gone must end as a lost, recomputed block, never as wrong bytes.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvswap.base.remote_index import RemoteIndex
from kvswap.base.tier import Tier
from kvswap.base.transfer import CopyEngine, Direction, TransferChunk, TransferResult
from kvswap.base.write_policy import RemoteWritePolicy
from kvswap.control.blocks import Block
from kvswap.control.policy import PolicyOptions, named_policy
from kvswap.control.remote_tier import KeyedTier
from kvswap.control.settings import RemoteSettings, SwapSettings
from kvswap.control.store_records import StoreLayout
from kvswap.control.swapper import Swapper
from kvswap.data.copy_engine import LocalCopyEngine
from kvswap.data.device_pool import DevicePool
from kvswap.data.host_pool import HostPool
from kvswap.data.layout import KVLayout
from kvswap.data.remote_copy import host_slot_bytes
from kvswap.data.tiers.copy_adapter import TierCopyEngine
from kvswap.data.tiers.nvme_tier import open_nvme_tier

BLOCK_TOKENS = 4
BLOCK_BYTES = 4096
LAYOUT = KVLayout.from_block_bytes(BLOCK_BYTES)
PREFIXES = [(1, 2, 3, 4, 5, 6, 7, 8), (9, 9, 9, 9), (1, 2, 3, 4, 6)]
POLICY_NAMES = ["kvswap", "lru", "arc", "reuse"]  # (GPU, CPU) pairs are drawn from these


def block_bytes(block: Block) -> torch.Tensor:
    """The bytes block `block` must hold: a function of its parent key and tokens."""
    seed = hashlib.sha256(repr((block.parent_key, block.token_ids)).encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(seed[:8], "little"))
    return torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8, generator=generator)


class MemoryStore(RemoteIndex):
    """The shared store: key -> the block's bytes. A `ghost` is a key whose value
    expired but that lookups still report (the expiry raced the lookup)."""

    def __init__(self) -> None:
        self.values: dict[bytes, torch.Tensor] = {}
        self.ghosts: set[bytes] = set()
        self.up = True

    def lookup(self, keys: Sequence[bytes]) -> int:
        held = 0
        while (
            self.up
            and held < len(keys)
            and (keys[held] in self.values or keys[held] in self.ghosts)
        ):
            held += 1
        return held

    @property
    def available(self) -> bool:
        return self.up


class RemoteCopyEngine(CopyEngine):
    """The local engine for local chunks, the NVMe slab's (`slab`, when drawn) for its
    own; the store's chunks copied between the host pool and the `MemoryStore` at
    submit, their results kept for `wait`."""

    def __init__(
        self,
        local: LocalCopyEngine,
        host: HostPool,
        store: MemoryStore,
        slab: TierCopyEngine | None = None,
    ):
        self.local, self.host, self.store, self.slab = local, host, store, slab
        self.results: dict[int, TransferResult] = {}
        self.on_slab: set[int] = set()  # ids submitted to the slab's engine

    def submit(self, chunk: TransferChunk) -> None:
        direction = chunk.direction
        if not direction.keyed:
            self.local.submit(chunk)
            return
        if Tier.NVME in (direction.src_tier, direction.dst_tier):
            assert self.slab is not None, "a chunk for an NVMe slab never drawn"
            self.slab.submit(chunk)
            self.on_slab.add(chunk.transfer_id)
            return
        failed: list[int] = []
        if not self.store.up:
            failed = list(chunk.dst_slots)
        elif chunk.direction is Direction.CPU_TO_REMOTE:
            for slot, key in zip(chunk.src_slots, chunk.keys, strict=True):
                self.store.values[key] = self.host.byte_view(slot).clone()
                self.store.ghosts.discard(key)
        else:
            for slot, key in zip(chunk.dst_slots, chunk.keys, strict=True):
                value = self.store.values.get(key)
                if value is None:
                    failed.append(slot)
                else:
                    self.host.byte_view(slot).copy_(value)
        ok = not (chunk.direction is Direction.CPU_TO_REMOTE and failed)
        self.results[chunk.transfer_id] = TransferResult(
            chunk.transfer_id, ok, chunk.num_bytes, 0.0, 0.0, None, tuple(failed)
        )

    def poll(self) -> list[TransferResult]:
        raise AssertionError("the gate collects results one by one")

    def wait(self, transfer_id: int) -> TransferResult:
        if transfer_id in self.on_slab:
            assert self.slab is not None
            self.on_slab.discard(transfer_id)
            return self.slab.wait(transfer_id)
        result = self.results.pop(transfer_id, None)
        return result if result is not None else self.local.wait(transfer_id)

    def wait_all(self) -> list[TransferResult]:
        raise AssertionError("the gate collects results one by one")

    def close(self) -> None:
        if self.slab is not None:
            self.slab.close()  # first: its read lanes copy into the host pool
        self.local.close()


class GatedCopyEngine(CopyEngine):
    """The real copy engine, but the control plane learns of a finished chunk only
    once the test releases it (or waits for it): bytes move on real threads while
    every decision stays reproducible, so hypothesis can replay and shrink."""

    def __init__(self, inner: CopyEngine):
        self.inner = inner
        self.unreleased: list[int] = []
        self.released: set[int] = set()
        self.done: dict[int, TransferResult] = {}

    def submit(self, chunk: TransferChunk) -> None:
        self.inner.submit(chunk)
        self.unreleased.append(chunk.transfer_id)

    def release(self, count: int) -> None:
        for transfer_id in self.unreleased[:count]:
            self.released.add(transfer_id)
        del self.unreleased[:count]

    def _collect(self, transfer_id: int) -> TransferResult:
        if transfer_id not in self.done:
            self.done[transfer_id] = self.inner.wait(transfer_id)
        return self.done.pop(transfer_id)

    def poll(self) -> list[TransferResult]:
        ready = sorted(self.released)
        self.released.clear()
        return [self._collect(transfer_id) for transfer_id in ready]

    def wait(self, transfer_id: int) -> TransferResult:
        if transfer_id in self.unreleased:
            self.unreleased.remove(transfer_id)
        self.released.discard(transfer_id)
        return self._collect(transfer_id)

    def wait_all(self) -> list[TransferResult]:
        ids = sorted([*self.released, *self.unreleased])
        self.released.clear()
        self.unreleased.clear()
        return [self._collect(transfer_id) for transfer_id in ids]

    def close(self) -> None:
        self.inner.close()


class TieredStoreMachine(RuleBasedStateMachine):
    @initialize(
        gpu=st.integers(6, 10),
        cpu=st.integers(2, 8),
        nvme=st.integers(0, 8),
        protected=st.integers(0, 1),
        residency=st.integers(0, 3),
        remote=st.sampled_from([None, *RemoteWritePolicy]),
        policies=st.tuples(st.sampled_from(POLICY_NAMES), st.sampled_from(POLICY_NAMES)),
    )
    def setup(
        self,
        gpu: int,
        cpu: int,
        nvme: int,
        protected: int,
        residency: int,
        remote: RemoteWritePolicy | None,
        policies: tuple[str, str] = ("kvswap", "kvswap"),
    ) -> None:
        self.directory = Path(f"/tmp/kvswap-hypothesis-{time.monotonic_ns()}")
        self.directory.mkdir()
        self.store = MemoryStore()
        self.sizes = (gpu, cpu, nvme, protected, residency)
        self.remote = remote
        self.policies = policies  # (GPU, CPU) eviction policy names
        self._start()

    def _start(self) -> None:
        """Pools, engine and swapper of a fresh process (the store outlives it)."""
        gpu, cpu, nvme, protected, residency = self.sizes
        remote = self.remote
        self.device = DevicePool(LAYOUT, gpu, "cpu")
        self.host = HostPool(LAYOUT, cpu)
        self.slab = None
        if nvme:  # this process's own NVMe slab, by key
            policy = named_policy(Tier.NVME, "lru", capacity_blocks=nvme)
            self.slab = open_nvme_tier(
                host_slot_bytes(self.host), self.directory, nvme, policy=policy, local=True
            )
        slab_engine = None if self.slab is None else TierCopyEngine(self.slab)
        local = LocalCopyEngine(self.device, self.host)
        self.engine = GatedCopyEngine(
            local
            if remote is None and slab_engine is None
            else RemoteCopyEngine(local, self.host, self.store, slab_engine)
        )
        keyed = [] if slab_engine is None else [
            KeyedTier(slab_engine, RemoteSettings("test", RemoteWritePolicy.ON_DEMOTE, 4, 2))
        ]  # fmt: skip
        if remote is not None:
            keyed.append(KeyedTier(self.store, RemoteSettings("test", remote, 4, 2)))
        self.swapper = Swapper(
            StoreLayout(BLOCK_TOKENS, gpu, cpu, protected),
            PolicyOptions(
                sink_protection=protected > 0, min_residency_steps=residency,
                gpu_eviction_policy=self.policies[0], cpu_eviction_policy=self.policies[1],
            ),
            SwapSettings(
                block_bytes=BLOCK_BYTES, swap_out_high_watermark=0.7, swap_out_low_watermark=0.4,
                swap_out_chunk_blocks=2, swap_in_chunk_blocks=2,
                cpu_demote_high_watermark=0.75, cpu_demote_low_watermark=0.5,
            ),
            self.engine,
            clock_s=time.perf_counter,
            keyed=keyed,
        )  # fmt: skip
        self.step = 0
        self.next_seq = 0
        self.running: set[int] = set()
        self.paused: set[int] = set()
        self.next_token = 100

    def _stop(self) -> None:
        self.swapper.drain()
        self.engine.close()  # the slab's engine closes the slab
        self.host.close()
        assert not any(self.directory.iterdir()), "the NVMe slab outlived its tier"

    def teardown(self) -> None:
        if not hasattr(self, "engine"):
            return
        self._stop()
        self.directory.rmdir()

    # ----------------------------------------------------------------- helpers

    def _grow(self, seq_id: int, tokens: list[int]) -> bool:
        """Append tokens and write the KV of every block they changed, on the GPU."""
        store = self.swapper.store
        before = {b.block_id: len(b.token_ids) for b in store.sequence_blocks(seq_id)}
        if not self.swapper.allocate(seq_id, tokens):
            return False
        for block in store.sequence_blocks(seq_id):
            if before.get(block.block_id) != len(block.token_ids):
                copy = block.ready_copy(Tier.GPU)
                assert copy is not None, "a block being computed must be on the GPU"
                self.device.byte_view(copy.slot).copy_(block_bytes(block))
        return True

    def _ready(self, seq_id: int) -> bool:
        """Bring the (running) sequence's blocks to the GPU, recomputing from its first
        lost block as the scheduler does (a fetch of a key that vanished); False when
        there is no room for it now."""
        if self.swapper.wait_ready([seq_id]).not_ready:
            return False
        first_lost = self.swapper.first_lost_token(seq_id)
        if first_lost is None:
            return True
        tokens = [t for b in self.swapper.store.sequence_blocks(seq_id) for t in b.token_ids]
        self.swapper.truncate(seq_id, first_lost)
        return self._grow(seq_id, tokens[first_lost:])

    # ------------------------------------------------------------------- rules

    @rule(prefix=st.sampled_from(PREFIXES), extra=st.integers(0, 6))
    def open_sequence(self, prefix: tuple[int, ...], extra: int) -> None:
        seq_id = self.next_seq
        self.next_seq += 1
        tokens = [*prefix, *range(self.next_token, self.next_token + extra)]
        self.next_token += extra
        self.swapper.open_sequence(seq_id, tokens)
        self.swapper.set_running(seq_id, True)
        if not self._ready(seq_id) or not self._grow(
            seq_id, tokens[self.swapper.store.sequences[seq_id].num_tokens :]
        ):
            self.swapper.finish(seq_id)  # no room: give it up, nothing may leak
            return
        self.running.add(seq_id)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), count=st.integers(1, 5))
    def append(self, data: st.DataObject, count: int) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.running)))
        tokens = list(range(self.next_token, self.next_token + count))
        self.next_token += count
        self._grow(seq_id, tokens)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), swap_out=st.booleans())
    def pause(self, data: st.DataObject, swap_out: bool) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.running)))
        self.running.discard(seq_id)
        self.paused.add(seq_id)
        if swap_out:
            self.swapper.swap_out_sequence(seq_id)
        else:
            self.swapper.set_running(seq_id, False)

    @precondition(lambda self: self.paused)
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.paused)))
        self.swapper.set_running(seq_id, True)
        if not self._ready(seq_id):
            self.swapper.set_running(seq_id, False)  # no room now; stays paused
            return
        self.paused.discard(seq_id)
        self.running.add(seq_id)

    @precondition(lambda self: self.running or self.paused)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.running | self.paused)))
        self.running.discard(seq_id)
        self.paused.discard(seq_id)
        self.swapper.finish(seq_id)

    @rule()
    def end_step(self) -> None:
        self.store.up = True
        self.swapper.end_step()
        self.step += 1
        self.swapper.begin_step(self.step)

    @rule(num_blocks=st.integers(1, 4))
    def evict_now(self, num_blocks: int) -> None:
        self.swapper.ensure_gpu_slots(num_blocks)

    @rule(num_blocks=st.integers(1, 4))
    def cpu_room_now(self, num_blocks: int) -> None:
        """The pinned pool's coldest copies go below now (the transformers cache's call),
        to the NVMe slab or the store where there is one."""
        self.swapper.make_cpu_room(num_blocks)

    @rule(count=st.integers(1, 3))
    def transfers_finish(self, count: int) -> None:
        self.engine.release(count)

    @rule()
    def drain(self) -> None:
        self.swapper.drain()

    @precondition(lambda self: self.remote is not None)
    @rule(prefix=st.sampled_from(PREFIXES), extra=st.integers(0, 6))
    def restart(self, prefix: tuple[int, ...], extra: int) -> None:
        """The process ends (every sequence with it) and a new one starts on the same
        store, its first request a known prefix: what it finds there it restores
        instead of recomputing."""
        for seq_id in sorted(self.running | self.paused):
            self.swapper.finish(seq_id)
        self.running.clear()
        self.paused.clear()
        self.swapper.end_step()  # the last step's end: its write-behind is sent
        self._stop()  # drained: every write has landed or failed
        self._start()
        self.open_sequence(prefix, extra)

    @precondition(lambda self: self.store.values)
    @rule(data=st.data(), ghost=st.booleans())
    def a_key_vanishes(self, data: st.DataObject, ghost: bool) -> None:
        key = data.draw(st.sampled_from(sorted(self.store.values)))
        del self.store.values[key]
        if ghost:
            self.store.ghosts.add(key)

    @precondition(lambda self: self.remote is not None)
    @rule()
    def store_outage(self) -> None:
        """The store is unreachable until the next step ends."""
        self.store.up = False

    # -------------------------------------------------------------- invariants

    @invariant()
    def every_ready_copy_holds_its_bytes(self) -> None:
        if not hasattr(self, "swapper"):
            return
        self.swapper.check_integrity()
        if self.slab is not None:
            # Its lanes store on their own (a store may take an evicted key's slot): let
            # them land, their results kept for the gate, before its slots are read.
            self.slab.drain()
        for block in list(self.swapper.store.blocks.values()):
            expected = block_bytes(block)
            for tier, copy in block.copies.items():
                if not copy.ready or copy.stale:
                    continue
                if tier is Tier.GPU:
                    got = self.device.byte_view(copy.slot)
                elif tier is Tier.CPU:
                    got = self.host.byte_view(copy.slot)
                elif tier is Tier.REMOTE:
                    assert block.key is not None
                    value = self.store.values.get(block.key)
                    if value is None:
                        continue  # vanished: the fetch will fail and the block be lost
                    got = value
                else:
                    assert tier is Tier.NVME and self.slab is not None and block.key is not None
                    slot = self.slab.slot_of(block.key)
                    if slot is None:
                        continue  # evicted, heard at the next step: the copy goes then
                    got = torch.empty(BLOCK_BYTES, dtype=torch.uint8)
                    self.slab.disk.read_slot(slot, got)
                assert torch.equal(got, expected), f"block {block.block_id} on {tier.value}"

    @invariant()
    def running_sequences_are_resident(self) -> None:
        if not hasattr(self, "swapper"):
            return
        for seq_id in self.running:
            assert len(self.swapper.store.gpu_block_table(seq_id)) == len(
                self.swapper.store.sequences[seq_id].block_ids
            )


TieredStoreMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestTieredStore = TieredStoreMachine.TestCase


def test_a_restarted_process_restores_its_prefix_and_recomputes_a_vanished_block() -> None:
    # The machine's own rules in a fixed order, with the real pools: a process serves
    # (1..8) + 2 tokens and ends; the next one restores both full blocks from the store.
    machine = TieredStoreMachine()
    machine.setup(
        gpu=8, cpu=5, nvme=0, protected=0, residency=0, remote=RemoteWritePolicy.ON_FINISH
    )
    try:
        machine.open_sequence(PREFIXES[0], 2)
        machine.end_step()
        machine.restart(PREFIXES[0], 2)  # finishes 0, writes [1..4] [5..8], opens it again
        metrics = machine.swapper.metrics
        assert metrics.remote_found_blocks == metrics.prefix_hit_blocks_by_tier[Tier.REMOTE] == 2
        machine.every_ready_copy_holds_its_bytes()
        machine.running_sequences_are_resident()
        # The second block's value expires, but lookups still report it: the next
        # process fetches it, the read fails, and the block is recomputed in place.
        second = machine.swapper.store.sequence_blocks(0)[1]
        assert second.key is not None
        del machine.store.values[second.key]
        machine.store.ghosts.add(second.key)
        machine.restart(PREFIXES[0], 2)
        metrics = machine.swapper.metrics
        assert (metrics.remote_fetch_failures, metrics.lost_blocks) == (1, 1)
        machine.every_ready_copy_holds_its_bytes()
        machine.running_sequences_are_resident()
    finally:
        machine.teardown()


def test_a_victim_that_an_earlier_victims_placement_took_away_is_passed_over() -> None:
    # Found by the machine: two finished sequences leave cache entries on the GPU and
    # in a full pinned pool; evicting four GPU blocks at once, the first victim's room
    # in the pool discards a cache entry that is also a later victim (every copy of
    # it), which must be passed over, not placed again.
    machine = TieredStoreMachine()
    machine.setup(gpu=6, cpu=4, nvme=0, protected=0, residency=0, remote=None,
                  policies=("reuse", "kvswap"))  # fmt: skip
    try:
        for seq_id, extra, grow in ((0, 0, 0), (1, 3, 1)):
            machine.open_sequence(PREFIXES[0], extra)
            if grow:
                machine._grow(seq_id, list(range(900, 900 + grow)))
            machine.running.discard(seq_id)
            machine.swapper.finish(seq_id)
            machine.drain()
        machine.evict_now(4)
        machine.every_ready_copy_holds_its_bytes()
    finally:
        machine.teardown()


def test_blocks_written_to_the_nvme_slab_come_back_with_their_bytes_or_are_forgotten() -> None:
    # The machine's rules in a fixed order, with the real slab (`NvmeTier` over a
    # `DiskPool`, 3 blocks, LRU) below a pinned pool of 4: every copy the control plane
    # trusts holds its bytes after each step, the slab evicts only a key nobody holds,
    # and a paused sequence resumes with the bytes it left there.
    machine = TieredStoreMachine()
    machine.setup(gpu=6, cpu=4, nvme=3, protected=0, residency=0, remote=None)

    def placement() -> list[tuple[int, list[str]]]:
        blocks = machine.swapper.store.blocks.values()
        return [(b.token_ids[0], sorted(t.value for t in b.copies)) for b in blocks]

    def pause(seq_id: int) -> None:
        machine.running.discard(seq_id)
        machine.paused.add(seq_id)
        machine.swapper.swap_out_sequence(seq_id)

    def settle() -> None:
        for _ in range(3):
            machine.drain()
            machine.end_step()
            machine.every_ready_copy_holds_its_bytes()

    try:
        # Two sequences of two full blocks pause: the pool (4) writes its 2 coldest.
        machine.open_sequence(PREFIXES[0], 0)  # [1..4] [5..8]
        machine.open_sequence((10, 11, 12, 13, 14, 15, 16, 17), 0)
        pause(0)
        pause(1)
        settle()
        assert placement() == [(1, ["nvme"]), (5, ["nvme"]), (10, ["cpu"]), (14, ["cpu"])]
        # The first finishes (its keys no longer held); a third pauses: the slab, full
        # at 3, evicts its least recently used free key for the fourth, and the block
        # with that key alone is forgotten at the next step.
        machine.paused.discard(0)
        machine.swapper.finish(0)
        machine.open_sequence((20, 21, 22, 23, 24, 25, 26, 27), 0)
        pause(2)
        settle()
        assert placement() == [
            (5, ["nvme"]), (10, ["nvme"]), (14, ["nvme"]), (20, ["cpu"]), (24, ["cpu"]),
        ]  # fmt: skip
        assert machine.swapper.metrics.evictions_by_reason["nvme_discard"] == 1
        # Both resume: sequence 1 from the slab, through the pinned pool.
        for seq_id in (1, 2):
            machine.swapper.set_running(seq_id, True)
            assert machine._ready(seq_id)
            machine.paused.discard(seq_id)
            machine.running.add(seq_id)
        machine.every_ready_copy_holds_its_bytes()
        machine.running_sequences_are_resident()
        assert machine.swapper.metrics.bytes_by_direction[Direction.NVME_TO_CPU] == 2 * BLOCK_BYTES
    finally:
        machine.teardown()
