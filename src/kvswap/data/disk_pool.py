"""The NVMe slab: one preallocated file cut into fixed, 4096-aligned slots.

    kvswap-<pid>-<random>.kvslab           (mode 0600, created with O_EXCL)
    kvswap-<pid>-<random>.persist.kvslab   (the same, made with nvme_persist: kept)
    +----------------+----------------+-- ... --+------------------------+
    | slot 0         | slot 1         |         | slot num_slots-1       |
    | block | pad    | block | pad    |         | block | pad            |
    +----------------+----------------+-- ... --+------------------------+
    slot i starts at i * slot_stride_bytes; stride = block_bytes rounded up to 4096

The whole file is preallocated at start-up (`posix_fallocate`), so a full disk
shows up then and not in the middle of a swap. I/O goes through an O_DIRECT
descriptor (no page-cache copy, no double buffering of the pinned pool) when
the filesystem accepts it and the caller's buffer and the block size are
4096-aligned; otherwise through a buffered descriptor. Every slot carries a
CRC-32 written with it and checked on every read: a slot whose bytes changed
raises `DiskSlotError`, never returns wrong data as good.

A slab outlives its process only when that process was killed (SIGKILL, a
crash, the OOM killer). The owner holds an exclusive `flock` on its slab for
its whole life, and the kernel drops that lock when the process dies however
it dies, so at start-up a slab in the directory whose owner pid is gone and
whose lock is free is known to be stale: it is removed (or, if persisted,
reported). The lock is what protects a live slab whose owner is in another pid
namespace (a container sharing the directory), where the pid alone would
look dead. The scheme, and the sweep that skips anything but a regular file, are
`owned_files`'s (the vLLM adapter's shared host pool uses them too).
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
import stat
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from kvswap.data.owned_files import create_locked, describe_os_error, sweep_stale
from kvswap.errors import KvSwapError
from kvswap.units import ceil_div

SLOT_ALIGN_BYTES = 4096
IoMode = Literal["direct", "buffered"]
# A block's bytes: a contiguous CPU tensor (any dtype) or any C-contiguous buffer.
ByteSink = memoryview | bytearray | torch.Tensor
ByteSource = bytes | memoryview | bytearray | torch.Tensor
SLAB_NAME = re.compile(r"kvswap-(?P<pid>[0-9]+)-[0-9a-f]+(?P<persist>\.persist)?\.kvslab")


class DiskSlotError(Exception):
    """One slot's write or read failed (ENOSPC, EIO, checksum mismatch, ...).

    The copy engine reports the slot in `failed_dst_slots`; it is not a user error."""

    def __init__(self, slot: int, reason: str) -> None:
        super().__init__(f"NVMe slot {slot}: {reason}")
        self.slot = slot
        self.reason = reason


class DiskPool:
    """`num_slots` blocks of `block_bytes` in one preallocated file under `directory`."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        block_bytes: int,
        num_slots: int,
        *,
        persist: bool = False,
        direct_io: bool = True,
        swept: bool = False,
    ) -> None:
        """`swept`: the caller has just swept `directory` (`report_stale_slabs`), so
        the slabs that sweep kept or could not remove are not reported a second time."""
        if isinstance(block_bytes, bool) or block_bytes < 1:
            raise KvSwapError(f"NVMe pool: block_bytes {block_bytes!r} is invalid; expected >= 1")
        if isinstance(num_slots, bool) or num_slots < 1:
            raise KvSwapError(f"NVMe pool: num_slots {num_slots!r} is invalid; expected >= 1")
        self.directory = Path(directory)
        self.block_bytes = block_bytes
        self.num_slots = num_slots
        self.persist = persist
        self.slot_stride_bytes = ceil_div(block_bytes, SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES
        self.configured_bytes = num_slots * self.slot_stride_bytes
        if not swept:
            # Before the free-space check: a stale slab's bytes are free once it is removed.
            report_stale_slabs(self.directory)
        check_directory(self.directory, self.configured_bytes)

        suffix = ".persist.kvslab" if persist else ".kvslab"
        self.path, fd = _create_locked(self.directory, suffix)
        self._fd: int | None = fd
        self._direct_fd: int | None = None
        try:
            os.fchmod(self._fd, 0o600)  # whatever the umask: KV bytes are private
            _preallocate(self._fd, self.configured_bytes, self.directory)
            if direct_io and block_bytes % SLOT_ALIGN_BYTES == 0:
                self._direct_fd = _open_direct(self.path)
        except BaseException:
            os.close(self._fd)
            self._fd = None
            self.path.unlink(missing_ok=True)
            raise
        self.io_mode: IoMode = "direct" if self._direct_fd is not None else "buffered"
        # Unaligned caller buffers in direct mode go through the buffered descriptor.
        self.num_buffered_fallback_ios = 0
        # CRC-32 of each slot's last good write; None = never written or write failed.
        self._checksums: list[int | None] = [None] * num_slots

    def write_slot(self, slot: int, src: ByteSource) -> None:
        """Write one block (exactly `block_bytes`) to `slot`; DiskSlotError on failure."""
        self._check_slot(slot)
        view, address = _byte_buffer(src, writable=False, expected_bytes=self.block_bytes)
        checksum = zlib.crc32(view)
        self._checksums[slot] = None  # not trustworthy until the write has completed
        try:
            _pwrite_all(self._fd_for(address), view, slot * self.slot_stride_bytes)
        except OSError as exc:
            raise DiskSlotError(slot, f"write failed: {describe_os_error(exc)}") from exc
        self._checksums[slot] = checksum

    def read_slot(self, slot: int, dst: ByteSink) -> None:
        """Read `slot` into `dst` (exactly `block_bytes`) and verify its checksum.

        On DiskSlotError the contents of `dst` are undefined and must not be used."""
        self._check_slot(slot)
        expected = self._checksums[slot]
        if expected is None:
            raise DiskSlotError(slot, "never written, or its last write failed")
        view, address = _byte_buffer(dst, writable=True, expected_bytes=self.block_bytes)
        try:
            _pread_all(self._fd_for(address), view, slot * self.slot_stride_bytes)
        except OSError as exc:
            raise DiskSlotError(slot, f"read failed: {describe_os_error(exc)}") from exc
        if zlib.crc32(view) != expected:
            raise DiskSlotError(slot, "checksum mismatch: the bytes on disk are corrupt")

    def is_written(self, slot: int) -> bool:
        self._check_slot(slot)
        return self._checksums[slot] is not None

    def check_integrity(self, *, verify_checksums: bool = False) -> tuple[int, ...]:
        """Raise AssertionError if the slab's structure is broken; with
        `verify_checksums`, read every written slot and return the corrupt ones."""
        if self._fd is None:
            raise AssertionError("NVMe pool is closed")
        info = os.fstat(self._fd)
        if info.st_size != self.configured_bytes:
            raise AssertionError(f"slab file is {info.st_size} bytes, not {self.configured_bytes}")
        if stat.S_IMODE(info.st_mode) != 0o600:
            raise AssertionError(f"slab file mode is {oct(stat.S_IMODE(info.st_mode))}, not 0o600")
        if not self.path.exists():
            raise AssertionError(f"slab file {self.path} was removed while in use")
        if not verify_checksums:
            return ()
        scratch = mmap.mmap(-1, self.slot_stride_bytes)  # page-aligned, fine for O_DIRECT
        corrupt: list[int] = []
        try:
            view = memoryview(scratch)[: self.block_bytes]
            for slot in range(self.num_slots):
                if self._checksums[slot] is None:
                    continue
                try:
                    self.read_slot(slot, view)
                except DiskSlotError:
                    corrupt.append(slot)
            view.release()
        finally:
            scratch.close()
        return tuple(corrupt)

    def close(self) -> None:
        """Close the file; delete it unless `persist`. Safe to call twice."""
        for fd in (self._direct_fd, self._fd):
            if fd is not None:
                os.close(fd)
        was_open = self._fd is not None
        self._fd = None
        self._direct_fd = None
        if was_open and not self.persist:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> DiskPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fd_for(self, address: int) -> int:
        if self._fd is None:
            raise ValueError("NVMe pool is closed")
        if self._direct_fd is None:
            return self._fd
        if address % SLOT_ALIGN_BYTES != 0:
            self.num_buffered_fallback_ios += 1
            return self._fd
        return self._direct_fd

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"NVMe slot {slot} out of range [0, {self.num_slots})")


@dataclass(frozen=True)
class StaleSlab:
    """A slab file whose owning process is gone."""

    path: Path
    owner_pid: int
    persisted: bool
    removed: bool
    error: str | None = None  # why it could not be removed

    def describe(self) -> str:
        gone = f"process {self.owner_pid}, which no longer runs"
        if self.removed:
            return f"removed the stale NVMe slab {self.path} left by {gone}"
        if self.persisted:
            return (
                f"kept the NVMe slab {self.path} made with nvme_persist by {gone}; "
                "delete it when it is no longer needed"
            )
        return f"could not remove the stale NVMe slab {self.path} left by {gone}: {self.error}"


def sweep_stale_slabs(directory: Path) -> list[StaleSlab]:
    """Remove the slabs in `directory` whose owner is dead; persisted ones are kept.

    A slab is stale only when its owner pid does not exist here AND nobody holds its
    lock (`owned_files`); a live process's slab, in this pid namespace or another, is
    never touched, and nothing but a regular file is ever opened."""
    return [
        StaleSlab(
            stale.path,
            int(stale.name["pid"]),
            persisted=stale.name["persist"] is not None,
            removed=stale.removed,
            error=stale.error,
        )
        for stale in sweep_stale(directory, SLAB_NAME, keep=lambda name: bool(name["persist"]))
    ]


def report_stale_slabs(directory: Path) -> None:
    """`sweep_stale_slabs`, with one stderr line per slab removed or kept."""
    for stale in sweep_stale_slabs(directory):
        print(f"kvswap: {stale.describe()}", file=sys.stderr)


def _create_locked(directory: Path, suffix: str) -> tuple[Path, int]:
    """Create a new slab file (O_EXCL, 0600) holding its lock (`owned_files`): a new
    name if a sweeper in another pid namespace removed it before the lock was taken."""
    for _attempt in range(3):
        path = directory / f"kvswap-{os.getpid()}-{secrets.token_hex(6)}{suffix}"
        try:
            fd = create_locked(path)
        except OSError as exc:
            raise KvSwapError(
                f"NVMe directory {directory}: cannot create {path.name}: "
                f"{describe_os_error(exc)}; point the NVMe tier at a writable directory"
            ) from exc
        if fd is not None:
            return path, fd
    raise KvSwapError(
        f"NVMe directory {directory}: another process keeps removing new slab files; "
        "give each machine or container its own NVMe directory"
    )


def slab_bytes(block_bytes: int, num_slots: int) -> int:
    """The slab file's size: slots rounded up to SLOT_ALIGN_BYTES."""
    return num_slots * (ceil_div(block_bytes, SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES)


def check_directory(directory: Path, needed_bytes: int) -> None:
    """Refuse a bad directory or a too-small disk before anything is created."""
    hint = "point the NVMe tier at an existing, writable directory"
    if not directory.exists():
        raise KvSwapError(f"NVMe directory {directory}: does not exist; {hint}")
    if not directory.is_dir():
        raise KvSwapError(f"NVMe directory {directory}: is not a directory; {hint}")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise KvSwapError(f"NVMe directory {directory}: is not writable by this process; {hint}")
    fs = os.statvfs(directory)
    free_bytes = fs.f_bavail * fs.f_frsize
    if needed_bytes > free_bytes:
        raise KvSwapError(
            f"NVMe directory {directory}: the slab needs {needed_bytes} bytes but only "
            f"{free_bytes} bytes are free; lower the NVMe tier capacity or free disk space"
        )


def _preallocate(fd: int, num_bytes: int, directory: Path) -> None:
    try:
        os.posix_fallocate(fd, 0, num_bytes)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS):
            os.ftruncate(fd, num_bytes)  # sparse: a full disk would show later, per slot
            return
        raise KvSwapError(
            f"NVMe directory {directory}: cannot preallocate {num_bytes} bytes: "
            f"{describe_os_error(exc)}; lower the NVMe tier capacity or free disk space"
        ) from exc


def _open_direct(path: Path) -> int | None:
    """An O_DIRECT descriptor if this filesystem really serves one (tmpfs refuses
    the open, some filesystems fail the first read instead); else None."""
    o_direct = getattr(os, "O_DIRECT", 0)
    if o_direct == 0:
        return None
    try:
        fd = os.open(path, os.O_RDWR | o_direct | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    probe = mmap.mmap(-1, SLOT_ALIGN_BYTES)
    try:
        os.preadv(fd, [probe], 0)
    except OSError:
        os.close(fd)
        return None
    finally:
        probe.close()
    return fd


def _byte_buffer(
    data: ByteSource, *, writable: bool, expected_bytes: int
) -> tuple[memoryview, int]:
    """A flat byte memoryview over `data` and its start address."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu" or not data.is_contiguous():
            raise ValueError(f"NVMe I/O needs a contiguous CPU tensor, got {data.device}")
        flat = data.reshape(-1).view(torch.uint8)
        view = flat.numpy().data
        address = flat.data_ptr()
    else:
        view = memoryview(data).cast("B")
        address = int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0
    if writable and view.readonly:
        raise ValueError("NVMe read needs a writable destination buffer")
    if view.nbytes != expected_bytes:
        raise ValueError(f"NVMe I/O buffer is {view.nbytes} bytes, expected {expected_bytes}")
    return view, address


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < view.nbytes:
        written = os.pwritev(fd, [view[done:]], offset + done)
        if written <= 0:
            raise OSError(errno.EIO, "short write")
        done += written


def _pread_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < view.nbytes:
        read = os.preadv(fd, [view[done:]], offset + done)
        if read <= 0:
            raise OSError(errno.EIO, "short read past the end of the slab")
        done += read
