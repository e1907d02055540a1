"""Random operations across all tiers; after every step every live copy holds its bytes.

The control plane (Swapper) drives the real data plane (device pool, pinned
pool, NVMe slab, two-queue copy engine). A block's "KV" is a deterministic
function of its chain position and tokens, written into its GPU slot when the
block is computed, exactly where the model would write it. After every step:
each ready copy on every tier equals that function of the block as it is now,
no slot has two owners, and each tier's occupancy equals the copies it holds.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvswap.control.blocks import Block
from kvswap.control.policy import PolicyOptions
from kvswap.control.settings import SwapSettings
from kvswap.control.store import StoreLayout
from kvswap.control.swapper import Swapper
from kvswap.control.transfer import CopyEngine, Tier, TransferChunk, TransferResult
from kvswap.data.copy_engine import LocalCopyEngine
from kvswap.data.device_pool import DevicePool
from kvswap.data.disk_pool import DiskPool
from kvswap.data.host_pool import HostPool
from kvswap.data.layout import KVLayout

BLOCK_TOKENS = 4
BLOCK_BYTES = 4096
LAYOUT = KVLayout.from_block_bytes(BLOCK_BYTES)
PREFIXES = [(1, 2, 3, 4, 5, 6, 7, 8), (9, 9, 9, 9), (1, 2, 3, 4, 6)]


def block_bytes(block: Block) -> torch.Tensor:
    """The bytes block `block` must hold: a function of its parent key and tokens."""
    seed = hashlib.sha256(repr((block.parent_key, block.token_ids)).encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(seed[:8], "little"))
    return torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8, generator=generator)


class GatedCopyEngine(CopyEngine):
    """The real copy engine, but the control plane learns of a finished chunk only
    once the test releases it (or waits for it): bytes move on real threads while
    every decision stays reproducible, so hypothesis can replay and shrink."""

    def __init__(self, inner: LocalCopyEngine):
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
    )
    def setup(self, gpu: int, cpu: int, nvme: int, protected: int, residency: int) -> None:
        self.directory = Path(f"/tmp/kvswap-hypothesis-{time.monotonic_ns()}")
        self.directory.mkdir()
        self.device = DevicePool(LAYOUT, gpu, "cpu")
        self.host = HostPool(LAYOUT, cpu)
        self.disk = DiskPool(self.directory, BLOCK_BYTES, nvme) if nvme else None
        self.engine = GatedCopyEngine(LocalCopyEngine(self.device, self.host, self.disk))
        self.swapper = Swapper(
            StoreLayout(BLOCK_TOKENS, gpu, cpu, nvme, protected),
            PolicyOptions(sink_protection=protected > 0, min_residency_steps=residency),
            SwapSettings(
                block_bytes=BLOCK_BYTES, swap_out_high_watermark=0.7, swap_out_low_watermark=0.4,
                swap_out_chunk_blocks=2, swap_in_chunk_blocks=2,
                cpu_demote_high_watermark=0.75, cpu_demote_low_watermark=0.5,
            ),
            self.engine,
            clock_s=time.perf_counter,
        )  # fmt: skip
        self.step = 0
        self.next_seq = 0
        self.running: set[int] = set()
        self.paused: set[int] = set()
        self.next_token = 100

    def teardown(self) -> None:
        if not hasattr(self, "engine"):
            return
        self.swapper.drain()
        self.engine.close()
        self.host.close()
        if self.disk is not None:
            self.disk.close()
        assert not any(self.directory.iterdir()), "the NVMe slab outlived its pool"
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

    # ------------------------------------------------------------------- rules

    @rule(prefix=st.sampled_from(PREFIXES), extra=st.integers(0, 6))
    def open_sequence(self, prefix: tuple[int, ...], extra: int) -> None:
        seq_id = self.next_seq
        self.next_seq += 1
        tokens = [*prefix, *range(self.next_token, self.next_token + extra)]
        self.next_token += extra
        self.swapper.open_sequence(seq_id, tokens)
        self.swapper.set_running(seq_id, True)
        if self.swapper.wait_ready([seq_id]).not_ready or not self._grow(
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
        if self.swapper.wait_ready([seq_id]).not_ready:
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
        self.swapper.end_step()
        self.step += 1
        self.swapper.begin_step(self.step)

    @rule(num_blocks=st.integers(1, 4))
    def evict_now(self, num_blocks: int) -> None:
        self.swapper.ensure_gpu_slots(num_blocks)

    @rule(count=st.integers(1, 3))
    def transfers_finish(self, count: int) -> None:
        self.engine.release(count)

    @rule()
    def drain(self) -> None:
        self.swapper.drain()

    # -------------------------------------------------------------- invariants

    @invariant()
    def every_ready_copy_holds_its_bytes(self) -> None:
        if not hasattr(self, "swapper"):
            return
        self.swapper.check_integrity()
        for block in list(self.swapper.store.blocks.values()):
            expected = block_bytes(block)
            for tier, copy in block.copies.items():
                if not copy.ready or copy.stale:
                    continue
                if tier is Tier.GPU:
                    got = self.device.byte_view(copy.slot)
                elif tier is Tier.CPU:
                    got = self.host.byte_view(copy.slot)
                else:
                    assert self.disk is not None
                    got = torch.empty(BLOCK_BYTES, dtype=torch.uint8)
                    self.disk.read_slot(copy.slot, got)
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
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestTieredStore = TieredStoreMachine.TestCase
