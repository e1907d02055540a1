"""The device block pool: every KV block resident on the compute device.

One tensor allocated once at start-up, never resized; the control plane names
blocks by slot index only. On a CUDA device it lives in GPU memory; on a
machine without a GPU the same code allocates a CPU tensor, so every path that
touches it runs in CPU tests too.

    kv: [num_blocks, num_layers, 2, block_tokens, num_kv_heads, head_dim]
    slot s = kv[s], bytes [s * block_bytes, (s + 1) * block_bytes)
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from kvswap.data.layout import KVLayout
from kvswap.errors import KvSwapError
from kvswap.host_memory import available_host_bytes


class DevicePool:
    """`num_blocks` KV blocks in one tensor on `device`; exact size, allocated once."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str) -> None:
        self.layout = layout
        self.device = torch.device(device)
        if isinstance(num_blocks, bool) or num_blocks < 1:
            raise KvSwapError(f"device pool: num_blocks {num_blocks!r} is invalid; expected >= 1")
        self.num_blocks = num_blocks
        self.configured_bytes = num_blocks * layout.block_bytes
        free_bytes = _free_bytes(self.device)
        if free_bytes is not None and self.configured_bytes > free_bytes:
            raise KvSwapError(
                f"device pool: {num_blocks} blocks x {layout.block_bytes} bytes = "
                f"{self.configured_bytes} bytes asked for but only {free_bytes} bytes are free "
                f"on {self.device}; lower the GPU tier capacity"
            )
        # kv: [num_blocks, *block_shape]. Zeroed so every page is touched (resident)
        # before the first step, and so never-written slots hold no stale data.
        self.kv = torch.zeros((num_blocks, *layout.block_shape), dtype=layout.dtype, device=device)
        # _bytes: [num_blocks, block_bytes] uint8, the same memory.
        self._bytes = self.kv.view(num_blocks, -1).view(torch.uint8)
        # _rows: the same bytes as numpy rows, when they are in host memory.
        self._rows = self._bytes.numpy() if self.device.type == "cpu" else None

    @property
    def is_cuda(self) -> bool:
        return self.kv.is_cuda

    def block(self, slot: int) -> torch.Tensor:
        """Slot `slot` as a typed view: [num_layers, 2, block_tokens, num_kv_heads, head_dim]."""
        self._check_slot(slot)
        return self.kv[slot]

    def byte_view(self, slot: int) -> torch.Tensor:
        """Slot `slot` as a flat uint8 view: [block_bytes]."""
        self._check_slot(slot)
        return self._bytes[slot]

    def host_byte_rows(self) -> npt.NDArray[np.uint8] | None:
        """The pool as [num_blocks, block_bytes] uint8 numpy rows, sharing its memory,
        when it lives in host memory (a CPU device); None on any other device.
        A row copy is a plain memcpy that releases the GIL (the CPU copy path)."""
        return self._rows

    def check_integrity(self) -> None:
        """Raise AssertionError if the pool's invariants no longer hold."""
        expected_shape = (self.num_blocks, *self.layout.block_shape)
        if tuple(self.kv.shape) != expected_shape:
            raise AssertionError(f"device pool shape {tuple(self.kv.shape)} != {expected_shape}")
        if not self.kv.is_contiguous():
            raise AssertionError("device pool tensor is not contiguous")
        if self.kv.numel() * self.kv.element_size() != self.configured_bytes:
            raise AssertionError("device pool size differs from its configured bytes")

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_blocks:
            raise ValueError(f"device slot {slot} out of range [0, {self.num_blocks})")


def _free_bytes(device: torch.device) -> int | None:
    """Bytes that can still be allocated on `device`; None if unknown."""
    if device.type == "cuda":
        free_bytes, _total_bytes = torch.cuda.mem_get_info(device)
        return int(free_bytes)
    if device.type == "cpu":
        return available_host_bytes()
    return None
