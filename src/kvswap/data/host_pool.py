"""The host slot pool: a pinned buffer allocated once and cut into fixed slots.

The pool is sized exactly (`num_slots * block_bytes`, no power-of-two
rounding) and populated at start-up, so a full pool is the normal state and
nothing is allocated on the hot path:

    PinnedBuffer (one mmap, page-aligned base, page-locked when CUDA exists)
    +-----------+-----------+-----------+-- ... --+---------------------+
    |  slot 0   |  slot 1   |  slot 2   |         |  slot num_slots-1   |
    +-----------+-----------+-----------+-- ... --+---------------------+
    slot i = bytes [i * block_bytes, (i + 1) * block_bytes)
    slots: [num_slots, num_layers, 2, block_tokens, num_kv_heads, head_dim]

Slot i's address is 4096-aligned when block_bytes is a multiple of 4096, which
is what lets the NVMe slab read and write it with O_DIRECT.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from kvswap.data.layout import KVLayout
from kvswap.data.pinned import PinnedBuffer
from kvswap.data.shared_file import SharedFile
from kvswap.errors import KvSwapError
from kvswap.host_memory import require_host_bytes


class HostPool:
    """`num_slots` KV blocks in one exact-size pinned host buffer."""

    def __init__(
        self,
        layout: KVLayout,
        num_slots: int,
        *,
        populate: bool = True,
        shared: SharedFile | None = None,
    ) -> None:
        """`shared`: the pool is that file's pages, shared with one other process
        (`shared_file`)."""
        if isinstance(num_slots, bool) or num_slots < 1:
            raise KvSwapError(f"host pool: num_slots {num_slots!r} is invalid; expected >= 1")
        self.layout = layout
        self.num_slots = num_slots
        self.configured_bytes = num_slots * layout.block_bytes
        # Checked here (as well as in PinnedBuffer) to name the slot count in the message.
        require_host_bytes(
            self.configured_bytes,
            f"host pool: {num_slots} slots x {layout.block_bytes} bytes = "
            f"{self.configured_bytes} bytes asked for",
        )
        self._buffer = PinnedBuffer(
            self.configured_bytes, populate=populate, what="host pool", shared=shared
        )
        # _bytes: [num_slots, block_bytes] uint8; slots: [num_slots, *block_shape] typed.
        self._bytes = self._buffer.tensor.view(num_slots, layout.block_bytes)
        self.slots = self._buffer.tensor.view(layout.dtype).view(num_slots, *layout.block_shape)
        # _rows: _bytes as numpy rows (the CPU copy path's memcpys), the same memory.
        self._rows: npt.NDArray[np.uint8] = self._bytes.numpy()
        self._closed = False

    @property
    def is_pinned(self) -> bool:
        """True when the buffer is page-locked for DMA (only where CUDA exists)."""
        return self._buffer.is_pinned

    @property
    def base_address(self) -> int:
        return self._buffer.tensor.data_ptr()

    def resident_bytes(self) -> int | None:
        """Bytes of the pool resident in RAM now (kernel's count); None if unknown.
        Reported next to `configured_bytes`: the two should be equal after start-up."""
        if self._closed:
            return 0
        return self._buffer.resident_bytes()

    def slot(self, index: int) -> torch.Tensor:
        """Slot `index` as a typed view: [num_layers, 2, block_tokens, num_kv_heads, head_dim]."""
        self._check_slot(index)
        return self.slots[index]

    def byte_view(self, index: int) -> torch.Tensor:
        """Slot `index` as a flat uint8 view: [block_bytes]."""
        self._check_slot(index)
        return self._bytes[index]

    def byte_rows(self) -> npt.NDArray[np.uint8]:
        """The pool as [num_slots, block_bytes] uint8 numpy rows, sharing its buffer.
        Not to be used after close()."""
        if self._closed:
            raise ValueError("host pool is closed")
        return self._rows

    def check_integrity(self) -> None:
        """Raise AssertionError if the pool's invariants no longer hold."""
        if self._closed:
            raise AssertionError("host pool is closed")
        if self._buffer.num_bytes != self.configured_bytes:
            raise AssertionError("host pool buffer size differs from its configured bytes")
        if tuple(self._bytes.shape) != (self.num_slots, self.layout.block_bytes):
            raise AssertionError(f"host pool byte view has shape {tuple(self._bytes.shape)}")
        if self._bytes.data_ptr() != self.slots.data_ptr():
            raise AssertionError("host pool views do not share one buffer")

    def close(self) -> None:
        """Unpin and unmap the buffer. Views taken earlier must not be used afterwards."""
        if self._closed:
            return
        self._closed = True
        # Drop this pool's views first so the mapping has no exports left to keep it alive.
        self._bytes = torch.empty((0, self.layout.block_bytes), dtype=torch.uint8)
        self._rows = self._bytes.numpy()
        self.slots = torch.empty((0, *self.layout.block_shape), dtype=self.layout.dtype)
        self._buffer.close()

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_slot(self, index: int) -> None:
        if self._closed:
            raise ValueError("host pool is closed")
        if not 0 <= index < self.num_slots:
            raise ValueError(f"host slot {index} out of range [0, {self.num_slots})")
