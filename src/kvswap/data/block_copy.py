"""What the copy workers share: the pools, a submitted job, one block copy.

`copy_block` is the unit every transfer is made of. It lives apart from the
workers so that a test can replace it (fault injection, ordering hooks) and
every worker path picks the replacement up: callers look it up as
`block_copy.copy_block` at call time.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvswap.base.transfer import Direction, TransferChunk, TransferResult
from kvswap.data.device_pool import DevicePool
from kvswap.data.host_pool import HostPool

# Directions with a device-pool end: on CUDA they run on copy streams.
GPU_DIRECTIONS = frozenset({Direction.GPU_TO_CPU, Direction.CPU_TO_GPU})


@dataclass(frozen=True)
class Pools:
    device: DevicePool
    host: HostPool | None


@dataclass(frozen=True)
class Job:
    """A submitted chunk, its completion, and (CUDA) the event it must wait for."""

    chunk: TransferChunk
    future: Future[TransferResult]
    ready_event: torch.cuda.Event | None


def copy_block(
    pools: Pools,
    direction: Direction,
    src_slot: int,
    dst_slot: int,
    *,
    non_blocking: bool = False,
    byte_range: tuple[int, int] | None = None,
) -> None:
    """Copy one block (block_bytes) from `src_slot` to `dst_slot` between the device
    and host pools; with `byte_range` (start, stop), only those bytes of it (the
    device pool in host memory only: the CPU path's LOW pieces).

    GPU legs with the device pool in host memory (no GPU): one memcpy between
    numpy rows of the two pools, which releases the GIL, so copy threads run
    side by side. Not torch's `copy_`: it forks an OpenMP team for every
    MiB-sized block, and when other work holds a core each fork can wait a
    scheduler slice for it (measured on 2 shared cores: 1 MiB copies at a
    median of 8 ms at times, 0.13 ms at others). And numpy rows of the whole
    pools: indexing two tensors and wrapping each for numpy cost ~8 us a block,
    this whole call ~2 us (measured with 64-byte blocks).
    Other GPU legs are tensor copies ([block_bytes] uint8 views); with
    `non_blocking` on CUDA they are queued on the current stream. (The keyed
    tiers below the pinned pool move their own bytes: `kvswap.data.tiers`.)"""
    host = _host(pools)
    if direction not in GPU_DIRECTIONS:
        raise ValueError(f"{direction.value}: not a leg between the device and host pools")
    device_rows = pools.device.host_byte_rows()
    if device_rows is not None:
        host_rows = host.byte_rows()
        if direction is Direction.GPU_TO_CPU:
            np.copyto(
                _row(host_rows, dst_slot, "host", byte_range),
                _row(device_rows, src_slot, "device", byte_range),
            )
        else:
            np.copyto(
                _row(device_rows, dst_slot, "device", byte_range),
                _row(host_rows, src_slot, "host", byte_range),
            )
    elif byte_range is not None:
        raise ValueError("a byte range needs the device pool in host memory")
    elif direction is Direction.GPU_TO_CPU:
        src = pools.device.byte_view(src_slot)
        host.byte_view(dst_slot).copy_(src, non_blocking=non_blocking)
    else:
        src = host.byte_view(src_slot)
        pools.device.byte_view(dst_slot).copy_(src, non_blocking=non_blocking)


def _row(
    rows: npt.NDArray[np.uint8], slot: int, tier: str, byte_range: tuple[int, int] | None = None
) -> npt.NDArray[np.uint8]:
    """rows[slot] (or its bytes [start, stop)), refusing what numpy would wrap
    around (a negative slot)."""
    if not 0 <= slot < rows.shape[0]:
        raise ValueError(f"{tier} slot {slot} out of range [0, {rows.shape[0]})")
    if byte_range is None:
        row: npt.NDArray[np.uint8] = rows[slot]
        return row
    start_byte, stop_byte = byte_range
    if not 0 <= start_byte <= stop_byte <= rows.shape[1]:
        raise ValueError(f"byte range {byte_range} out of a {rows.shape[1]}-byte block")
    piece: npt.NDArray[np.uint8] = rows[slot, start_byte:stop_byte]
    return piece


def _host(pools: Pools) -> HostPool:
    if pools.host is None:
        raise ValueError("this copy engine has no host pool")
    return pools.host


def failed_result(chunk: TransferChunk, start_s: float, error: str) -> TransferResult:
    """A result that marks every destination slot of `chunk` as untrustworthy."""
    return TransferResult(
        transfer_id=chunk.transfer_id,
        success=False,
        num_bytes=chunk.num_bytes,
        start_s=start_s,
        end_s=max(start_s, time.perf_counter()),
        error=error,
        failed_dst_slots=chunk.dst_slots,
    )


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
