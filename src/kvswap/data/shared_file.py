"""One file mapped by exactly two processes: how they meet, and what they refuse.

vLLM runs its scheduler, whose secondary tiers read and write the host slots, and its
worker, whose copies fill them, in two processes; the host pool is then the pages of
one file in /dev/shm that both map (`PinnedBuffer(shared=...)`). Two parties, of two
kinds (`SharedFile.party`):

- the first creates the file (exclusively, and locked as `owned_files` describes: a
  creator killed before its partner came leaves a file whose lock is free, which the
  next start removes), sizes it, writes a header naming itself, and maps it;
- the second finds the file, checks its creator is alive and of the other kind, maps
  it, and removes its name at once: nothing else can open it, and the pages go with
  the last mapping. The creator removes the name at close as well (the second may
  never come), but only while that name still leads to its own file.

A party that finds a live file made by a party of its own kind refuses it: that is
another pair's file (two vLLMs given the same engine_id), `SharedFileTaken`.

    +-------------------------------+--------+-------------------------------------+
    | the pool: num_bytes           | to a   | header: "kvswap shared pool: party= |
    | (both parties map only this)  | page   | <party> pid=<pid> bytes=<n>\\n"      |
    +-------------------------------+--------+-------------------------------------+
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from kvswap.data.owned_files import (
    create_locked,
    describe_os_error,
    open_regular,
    remove_if_named,
    try_lock,
)
from kvswap.errors import KvSwapError
from kvswap.host_memory import require_host_bytes
from kvswap.units import ceil_div

_PAGE_BYTES = mmap.PAGESIZE
# How long the second party waits for the first to write the header (right after
# it has created the file).
SHARED_HEADER_WAIT_S = 10.0
# Creating and finding can each lose a race (a sweeper, a dead creator's file): tries.
_ATTEMPTS = 3
_HEADER = re.compile(rb"kvswap shared pool: party=(\S+) pid=([0-9]+) bytes=([0-9]+)\n")


@dataclass(frozen=True)
class SharedFile:
    """The file a shared buffer lives in, and which of its two parties maps it here
    (e.g. "worker", "scheduler"): a file's two parties are of two kinds."""

    path: Path
    party: str


class SharedFileTaken(KvSwapError):
    """The file was made, and is held, by a live party of the same kind."""

    def __init__(self, what: str, shared: SharedFile, owner_pid: int) -> None:
        super().__init__(
            f"{what}: {shared.path} was made by another {shared.party} (process "
            f"{owner_pid}), which still runs; give each pair of processes its own file"
        )
        self.shared = shared
        self.owner_pid = owner_pid


class MappedFile(NamedTuple):
    mapping: mmap.mmap  # [0, num_bytes) of the file, MAP_SHARED
    created: bool  # this party made the file (and is to populate it)
    file_id: tuple[int, int]  # (st_dev, st_ino): whose name `release_name` may remove


def map_shared(shared: SharedFile, num_bytes: int, what: str) -> MappedFile:
    """Map `shared.path`'s first `num_bytes`, creating the file if no live party has."""
    for _attempt in range(_ATTEMPTS):
        try:
            fd = create_locked(shared.path)
        except FileExistsError:
            joined = _join(shared, num_bytes, what)
            if joined is not None:
                return joined
            continue  # a dead creator's file, now removed, or gone meanwhile: make it
        if fd is not None:
            return _create(fd, shared, num_bytes, what)
    raise KvSwapError(
        f"{what}: {shared.path} kept being removed or remade by other processes while "
        "this one mapped it; give each pair of processes its own file"
    )


def release_name(mapped: MappedFile, path: Path) -> None:
    """Remove `path` if it still leads to the mapped file (a file made since under the
    same name is another pair's); idempotent."""
    with contextlib.suppress(FileNotFoundError):
        named = os.stat(path, follow_symlinks=False)
        if (named.st_dev, named.st_ino) == mapped.file_id:
            path.unlink()


def _create(fd: int, shared: SharedFile, num_bytes: int, what: str) -> MappedFile:
    try:
        require_host_bytes(num_bytes, f"{what}: {num_bytes} bytes asked for")
        file_bytes = ceil_div(num_bytes, _PAGE_BYTES) * _PAGE_BYTES + _PAGE_BYTES
        os.ftruncate(fd, file_bytes)
        header = f"kvswap shared pool: party={shared.party} pid={os.getpid()} bytes={num_bytes}\n"
        os.pwrite(fd, header.encode(), file_bytes - _PAGE_BYTES)  # last: the partner waits
        mapped = mmap.mmap(fd, num_bytes, flags=mmap.MAP_SHARED)
        held = os.fstat(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            remove_if_named(shared.path, fd)
        raise
    finally:
        os.close(fd)  # the mapping keeps the file, and its lock
    return MappedFile(mapped, created=True, file_id=(held.st_dev, held.st_ino))


def _join(shared: SharedFile, num_bytes: int, what: str) -> MappedFile | None:
    """Map the file another party made; None if there is none to join (it went, or its
    creator is dead and it was removed)."""
    path = shared.path
    fd = open_regular(path, os.O_RDWR)
    if fd is None:
        if not os.path.lexists(path):
            return None
        raise KvSwapError(
            f"{what}: {path} is not a regular file this process can open and map; "
            "remove it if no process uses it"
        )
    try:
        if try_lock(fd):  # nobody holds it: its creator was killed before a partner came
            remove_if_named(path, fd)
            return None
        party, owner_pid, pool_bytes = _wait_for_header(fd, path, what)
        if party == shared.party:
            raise SharedFileTaken(what, shared, owner_pid)
        if pool_bytes != num_bytes:
            raise KvSwapError(
                f"{what}: {path} holds a pool of {pool_bytes} bytes, expected {num_bytes}; "
                "another process made it for a pool of another size"
            )
        mapped = mmap.mmap(fd, num_bytes, flags=mmap.MAP_SHARED)
        held = os.fstat(fd)
        remove_if_named(path, fd)  # both map it now: nothing else may open it
    except OSError as exc:
        raise KvSwapError(f"{what}: cannot map {path}: {describe_os_error(exc)}") from exc
    finally:
        os.close(fd)
    return MappedFile(mapped, created=False, file_id=(held.st_dev, held.st_ino))


def _wait_for_header(fd: int, path: Path, what: str) -> tuple[str, int, int]:
    """(party, pid, pool bytes) of the file's creator, which writes its header right
    after creating the file: wait for that, briefly."""
    deadline_s = time.monotonic() + SHARED_HEADER_WAIT_S
    while True:
        size = os.fstat(fd).st_size
        if size >= _PAGE_BYTES:
            found = _HEADER.match(os.pread(fd, _PAGE_BYTES, size - _PAGE_BYTES))
            if found is not None:
                return found[1].decode(), int(found[2]), int(found[3])
        if time.monotonic() >= deadline_s:
            raise KvSwapError(
                f"{what}: {path} is not a kvswap shared pool (no header after "
                f"{SHARED_HEADER_WAIT_S:g} s); remove it if no process uses it"
            )
        time.sleep(0.005)
