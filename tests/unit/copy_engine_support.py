"""Pools, an engine and helpers shared by the copy-engine tests (8 KiB blocks, 8 slots):
a device pool on the CPU and a host pool, the two ends of every local chunk."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
import torch

from kvswap.base.transfer import Direction, Priority, TransferChunk
from kvswap.data.copy_engine import LocalCopyEngine
from kvswap.data.device_pool import DevicePool
from kvswap.data.host_pool import HostPool
from kvswap.data.layout import KVLayout

BLOCK_BYTES = 8192
NUM_SLOTS = 8
HANG_TIMEOUT_S = 20.0
T = TypeVar("T")


@pytest.fixture
def layout() -> KVLayout:
    return KVLayout.from_block_bytes(BLOCK_BYTES)


@pytest.fixture
def pools(layout: KVLayout) -> Iterator[tuple[DevicePool, HostPool]]:
    device = DevicePool(layout, NUM_SLOTS, device="cpu")
    host = HostPool(layout, NUM_SLOTS)
    yield device, host
    host.close()


@pytest.fixture
def engine(pools: tuple[DevicePool, HostPool]) -> Iterator[LocalCopyEngine]:
    copy_engine = LocalCopyEngine(*pools)
    yield copy_engine
    within_timeout(copy_engine.close)


def chunk(
    transfer_id: int,
    direction: Direction,
    src_slots: tuple[int, ...],
    dst_slots: tuple[int, ...],
    priority: Priority | None = None,
) -> TransferChunk:
    if priority is None:  # a swap-in (towards the GPU) is HIGH, a swap-out LOW
        priority = Priority.HIGH if direction.upward else Priority.LOW
    return TransferChunk(
        transfer_id=transfer_id,
        direction=direction,
        priority=priority,
        src_slots=src_slots,
        dst_slots=dst_slots,
        num_bytes=len(src_slots) * BLOCK_BYTES,
    )


def within_timeout(call: Callable[[], T], timeout_s: float = HANG_TIMEOUT_S) -> T:
    """Run `call` in a thread; fail the test if it has not returned in `timeout_s`."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"call did not return within {timeout_s} s"
    if "error" in box:
        raise box["error"]
    value: T = box["value"]
    return value


def fill_random(pool_bytes: torch.Tensor, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    pool_bytes.copy_(
        torch.randint(0, 256, pool_bytes.shape, dtype=torch.uint8, generator=generator)
    )
