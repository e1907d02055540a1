"""Host buffers allocated at exactly the size asked for.

torch's caching pinned allocator (`torch.empty(..., pin_memory=True)`) rounds
every allocation up to a power of two: asking for 24 GiB + 2 MiB pins 32 GiB.
Here the bytes come from one anonymous `mmap` of exactly `num_bytes`, wrapped
with `torch.frombuffer`, and are page-locked with `cudaHostRegister` when CUDA
is present. Without CUDA the buffer is plain (pageable) host memory and says so.
"""

from __future__ import annotations

import contextlib
import mmap
import os

import numpy as np
import torch

from kvswap.errors import KvSwapError

_PAGE_BYTES = mmap.PAGESIZE


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (bytes); total RAM if it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class PinnedBuffer:
    """`num_bytes` of host memory as a flat uint8 tensor, page-locked when CUDA exists.

    `populate=True` touches every page at start-up so the resident size equals
    the configured size from the first step (no page faults on the hot path).
    """

    def __init__(self, num_bytes: int, *, populate: bool = True, what: str = "pinned pool"):
        if num_bytes <= 0:
            raise KvSwapError(f"{what}: size must be > 0 bytes, got {num_bytes}")
        free_bytes = available_host_bytes()
        if num_bytes > free_bytes:
            raise KvSwapError(
                f"{what}: {num_bytes} bytes asked for but only {free_bytes} bytes of host "
                "memory are available; lower the CPU tier capacity"
            )
        self.num_bytes = num_bytes
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        if populate and hasattr(mmap, "MAP_POPULATE"):
            flags |= mmap.MAP_POPULATE
        self._mmap: mmap.mmap | None = mmap.mmap(-1, num_bytes, flags=flags)
        # tensor: [num_bytes] uint8, sharing memory with the mmap.
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8, count=num_bytes)
        if populate and not hasattr(mmap, "MAP_POPULATE"):
            self.tensor[::_PAGE_BYTES].zero_()
        self.is_pinned = False
        if torch.cuda.is_available():
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            code = cudart.cudaHostRegister(self.tensor.data_ptr(), num_bytes, 0)
            if int(code) != 0:
                self._release_mmap()
                raise KvSwapError(
                    f"{what}: cudaHostRegister of {num_bytes} bytes failed (error {int(code)}); "
                    "lower the CPU tier capacity or raise the locked-memory limit (ulimit -l)"
                )
            self.is_pinned = True

    def resident_bytes(self) -> int | None:
        """Bytes of this buffer resident in RAM now, as the kernel reports them
        (/proc/self/smaps); None where that file cannot be read."""
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

    def _release_mmap(self) -> None:
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
