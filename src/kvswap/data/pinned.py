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
import resource
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from kvswap.errors import KvSwapError

_PAGE_BYTES = mmap.PAGESIZE
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
# cgroup v1 writes "no limit" as the page counter's maximum (2**63 rounded down to
# a page); anything this large is no limit on a real machine.
_UNLIMITED_CGROUP_BYTES = 1 << 60
# The pool is touched in pieces of this size so that a stop signal is handled
# between two of them (one MAP_POPULATE of 24 GiB blocks signals for seconds).
FILL_CHUNK_BYTES = 64 << 20


class HostMemory(NamedTuple):
    """How many bytes this process may still allocate, and which limit says so."""

    available_bytes: int
    limit: str  # the binding limit, named for the user: "MemAvailable (/proc/meminfo)", ...


def available_host_bytes() -> int:
    """Bytes of host memory this process can still allocate (see `host_memory`)."""
    return host_memory().available_bytes


def host_memory(
    cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP
) -> HostMemory:
    """The tightest of: MemAvailable, the address-space rlimit (ulimit -v) less the
    address space in use, and the cgroup v2 / v1 memory limit less its usage.

    MemAvailable alone misses the last two: under `ulimit -v` or a container's limit
    a pool that fits in RAM still fails (an OSError from mmap, or the OOM killer)."""
    candidates = [
        _meminfo_available(),
        _address_space_headroom(),
        _cgroup_headroom(cgroup_root, proc_cgroup),
    ]
    return min((c for c in candidates if c is not None), key=lambda c: c.available_bytes)


def _meminfo_available() -> HostMemory:
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return HostMemory(int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo")
    except (OSError, ValueError, IndexError):
        pass
    total_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return HostMemory(total_bytes, "total RAM")


def _address_space_headroom() -> HostMemory | None:
    soft_bytes, _hard_bytes = resource.getrlimit(resource.RLIMIT_AS)
    if soft_bytes == resource.RLIM_INFINITY:
        return None
    used_bytes = _status_kib("VmSize:")
    used_bytes = 0 if used_bytes is None else used_bytes * 1024
    return HostMemory(
        max(0, soft_bytes - used_bytes),
        f"the address-space limit RLIMIT_AS (ulimit -v) of {soft_bytes} bytes, {used_bytes} in use",
    )


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_headroom(root: Path, proc_cgroup: Path) -> HostMemory | None:
    """The tightest memory limit of this process's cgroup and its ancestors.

    Usage less inactive file cache: the kernel reclaims that page cache before
    it fails an allocation, so counting it would refuse pools that fit."""
    tightest: HostMemory | None = None
    for directory, version in _cgroup_directories(root, proc_cgroup):
        if version == 2:
            names = ("memory.max", "memory.current", "inactive_file")
        else:
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        limit_bytes = _read_int(directory / names[0])
        if limit_bytes is None or limit_bytes >= _UNLIMITED_CGROUP_BYTES:
            continue
        usage_bytes = _read_int(directory / names[1]) or 0
        usage_bytes -= min(usage_bytes, _memory_stat(directory / "memory.stat", names[2]))
        found = HostMemory(
            max(0, limit_bytes - usage_bytes),
            f"the cgroup memory limit {directory / names[0]} of {limit_bytes} bytes, "
            f"{usage_bytes} in use",
        )
        if tightest is None or found.available_bytes < tightest.available_bytes:
            tightest = found
    return tightest


def _cgroup_directories(root: Path, proc_cgroup: Path) -> list[tuple[Path, int]]:
    """(directory, cgroup version) of this process's memory cgroup and its ancestors,
    from /proc/self/cgroup; a path missing here (another namespace's view) is skipped."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    found: list[tuple[Path, int]] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            base, version = root, 2
        elif "memory" in controllers.split(","):
            base, version = root / "memory", 1
        else:
            continue
        relative = Path(path.lstrip("/"))
        for ancestor in (relative, *relative.parents):
            directory = base / ancestor
            if directory.is_dir():
                found.append((directory, version))
    return found


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _memory_stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def require_host_bytes(num_bytes: int, asked: str) -> None:
    """Raise a one-line KvSwapError naming the binding limit if `num_bytes` do not fit.

    `asked` starts the message: "host pool: 8 slots x 4096 bytes = 32768 bytes asked for"."""
    memory = host_memory()
    if num_bytes > memory.available_bytes:
        raise KvSwapError(
            f"{asked} but only {memory.available_bytes} bytes of host memory are available "
            f"(limited by {memory.limit}); lower the CPU tier capacity"
        )


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

    def __init__(self, num_bytes: int, *, populate: bool = True, what: str = "pinned pool"):
        if num_bytes <= 0:
            raise KvSwapError(f"{what}: size must be > 0 bytes, got {num_bytes}")
        require_host_bytes(num_bytes, f"{what}: {num_bytes} bytes asked for")
        self.num_bytes = num_bytes
        self.is_pinned = False
        try:
            self._mmap: mmap.mmap | None = mmap.mmap(
                -1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
            )
        except OSError as exc:  # ENOMEM: ulimit -v, overcommit rules, a cgroup
            raise KvSwapError(
                f"{what}: mapping {num_bytes} bytes failed ({os.strerror(exc.errno or 0)}); "
                "lower the CPU tier capacity or raise the memory limit (ulimit -v)"
            ) from exc
        # tensor: [num_bytes] uint8, sharing memory with the mmap.
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8, count=num_bytes)
        try:
            if populate:
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
