"""Host buffers allocated at exactly the size asked for.

torch's caching pinned allocator (`torch.empty(..., pin_memory=True)`) rounds
every allocation up to a power of two: asking for 24 GiB + 2 MiB pins 32 GiB.
Here the bytes come from one anonymous `mmap` of exactly `num_bytes`, wrapped
with `torch.frombuffer`, and are page-locked with `cudaHostRegister` when CUDA
is present. Without CUDA the buffer is plain (pageable) host memory and says so.

A buffer can also be the pages of a file (`shared`, in /dev/shm) that exactly two
processes map: vLLM's scheduler and its worker. How the two meet, and what they
refuse, is `shared_file`'s.
"""

from __future__ import annotations

import contextlib
import mmap
import os

import numpy as np
import torch

from kvswap.data.shared_file import MappedFile, SharedFile, map_shared, release_name
from kvswap.errors import KvSwapError
from kvswap.host_memory import require_host_bytes

_PAGE_BYTES = mmap.PAGESIZE
# The pool is touched in pieces of this size so that a stop signal is handled
# between two of them (one MAP_POPULATE of 24 GiB blocks signals for seconds).
FILL_CHUNK_BYTES = 64 << 20


def _populate(tensor: torch.Tensor) -> None:
    """Write one byte per page, FILL_CHUNK_BYTES at a time, so every page is resident
    and a stop signal (handled between two pieces) stops the fill within a second."""
    for start in range(0, tensor.numel(), FILL_CHUNK_BYTES):
        _touch_pages(tensor[start : start + FILL_CHUNK_BYTES])


def _touch_pages(piece: torch.Tensor) -> None:
    piece[::_PAGE_BYTES].zero_()


class PinnedBuffer:
    """`num_bytes` of host memory as a flat uint8 tensor, page-locked when CUDA exists.

    `populate=True` touches every page at start-up so the resident size equals
    the configured size from the first step (no page faults on the hot path).
    """

    def __init__(
        self,
        num_bytes: int,
        *,
        populate: bool = True,
        what: str = "pinned pool",
        shared: SharedFile | None = None,
    ):
        """`shared`: map that file instead of anonymous memory (module docstring);
        `created_file` says whether this buffer made it (and populated it)."""
        if num_bytes <= 0:
            raise KvSwapError(f"{what}: size must be > 0 bytes, got {num_bytes}")
        self.num_bytes = num_bytes
        self.is_pinned = False
        self.shared = shared
        self.created_file = False
        self._shared_map: MappedFile | None = None
        try:
            if shared is None:
                require_host_bytes(num_bytes, f"{what}: {num_bytes} bytes asked for")
                self._mmap: mmap.mmap | None = mmap.mmap(
                    -1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                )
            else:
                self._shared_map = map_shared(shared, num_bytes, what)
                self._mmap = self._shared_map.mapping
                self.created_file = self._shared_map.created
        except OSError as exc:  # ENOMEM: ulimit -v, overcommit rules, a cgroup
            raise KvSwapError(
                f"{what}: mapping {num_bytes} bytes failed ({os.strerror(exc.errno or 0)}); "
                "lower the CPU tier capacity or raise the memory limit (ulimit -v)"
            ) from exc
        # tensor: [num_bytes] uint8, sharing memory with the mmap.
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8, count=num_bytes)
        try:
            if populate and (shared is None or self.created_file):
                _populate(self.tensor)
            if torch.cuda.is_available():
                self._register(what)
        except BaseException:
            # A stop signal or a failure half-way: nothing of this buffer may outlive it.
            self._release_mmap()
            raise

    def _register(self, what: str) -> None:
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        code = cudart.cudaHostRegister(self.tensor.data_ptr(), self.num_bytes, 0)
        if int(code) != 0:
            raise KvSwapError(
                f"{what}: cudaHostRegister of {self.num_bytes} bytes failed (error {int(code)}); "
                "lower the CPU tier capacity or raise the locked-memory limit (ulimit -l)"
            )
        self.is_pinned = True

    def resident_bytes(self) -> int | None:
        """Bytes of this buffer resident in RAM now, as the kernel reports them
        (/proc/self/pagemap); None where that file cannot be read."""
        return _mapping_rss_bytes(self.tensor.data_ptr(), self.num_bytes)

    def close(self) -> None:
        """Unregister and unmap. The tensor must not be used afterwards."""
        if self._mmap is None:
            return
        if self.is_pinned:
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            cudart.cudaHostUnregister(self.tensor.data_ptr())
            self.is_pinned = False
        self._release_mmap()

    def release_name(self) -> None:
        """Remove a shared buffer's file name (its pages stay mapped) while it leads to
        this buffer's file; idempotent."""
        if self.shared is not None and self._shared_map is not None:
            release_name(self._shared_map, self.shared.path)

    def _release_mmap(self) -> None:
        if self.created_file:
            self.release_name()
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self._mmap is not None:
            # A view may still be exported; the mapping then goes with the last view.
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None

    def __enter__(self) -> PinnedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _mapping_rss_bytes(start_address: int, num_bytes: int) -> int | None:
    """Count the resident pages of [start, start + num_bytes) in /proc/self/pagemap.

    Each page has one 64-bit entry; bit 63 says "present in RAM". Reading the
    range exactly (not the smaps entry, which the kernel may merge with its
    neighbours) gives this buffer's own resident size.
    """
    first_page = start_address // _PAGE_BYTES
    last_page = (start_address + num_bytes - 1) // _PAGE_BYTES
    num_pages = last_page - first_page + 1
    present_pages = 0
    pages_per_read = 1 << 20
    try:
        with open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
            for offset in range(0, num_pages, pages_per_read):
                count = min(pages_per_read, num_pages - offset)
                pagemap.seek((first_page + offset) * 8)
                raw = pagemap.read(count * 8)
                entries = np.frombuffer(raw, dtype=np.uint64)
                present_pages += int(np.count_nonzero(entries >> np.uint64(63)))
    except OSError:
        return None
    return present_pages * _PAGE_BYTES
