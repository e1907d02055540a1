"""How much host memory this process may still allocate, and which limit says so.

Torch-free, so that the data plane's pools and the workload bounds read the
same figure: the smallest of MemAvailable, the RLIMIT_AS headroom and the
cgroup (v2 or v1) limit minus usage.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path
from typing import NamedTuple

from kvswap.errors import KvSwapError

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
# cgroup v1 writes "no limit" as the page counter's maximum (2**63 rounded down to
# a page); anything this large is no limit on a real machine.
_UNLIMITED_CGROUP_BYTES = 1 << 60


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
