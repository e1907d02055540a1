"""Files that prove their owner runs, and the sweep that removes the ones left behind.

kvswap puts files where other processes see them: the NVMe slab, and the host pool
that vLLM's scheduler and worker share in /dev/shm. A kill (SIGKILL, a crash, the OOM
killer) skips every cleanup, so each such file carries its own proof of life: its
owner takes an exclusive `flock` on it as it creates it, and the kernel drops that lock
when the process dies, however it dies. (A mapping of the file keeps the lock as the
descriptor would: a mapped file whose descriptor was closed is still owned.) At a later
start, a file whose lock is free is stale and is removed.

A name may carry its owner's pid: the sweep then skips the file of a live pid without
opening it, which also covers the instant between the create and the lock. A name
without one relies on `create_locked` for that instant: an owner whose new file a
sweeper removed finds out, and makes another.

Only regular files are ever judged. A FIFO, a socket, a device, a symlink or a directory
named like an owned file is skipped without being opened or followed (opening a FIFO
would block until a writer came); the descriptor that tests a lock is non-blocking.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# Never follow a link, never block in open (a FIFO), never acquire a terminal.
_PROBE_FLAGS = os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | _CLOEXEC


@dataclass(frozen=True)
class StaleFile:
    """A file whose owner is gone, and what the sweep did with it."""

    path: Path
    name: re.Match[str]  # its name, matched: the groups say what it is (a pid, ...)
    removed: bool
    error: str | None = None  # why it could not be removed; None if removed or kept


def sweep_stale(
    directory: Path,
    name: re.Pattern[str],
    *,
    keep: Callable[[re.Match[str]], bool] | None = None,
) -> list[StaleFile]:
    """Remove the regular files in `directory` named like `name` (whole name; a group
    `pid` is the owner's pid) whose owner is gone; those `keep` picks stay, reported.

    A live process's file, in this pid namespace or another, is never touched."""
    try:
        with os.scandir(directory) as listing:
            entries = sorted(listing, key=lambda entry: entry.name)
    except OSError:
        return []  # the caller's own checks say what is wrong with the directory
    found: list[StaleFile] = []
    for entry in entries:
        match = name.fullmatch(entry.name)
        if match is None or not _is_regular(entry):
            continue
        if "pid" in name.groupindex and process_exists(int(match["pid"])):
            continue
        path = Path(entry.path)
        lock_fd = lock_if_free(path)
        if lock_fd is None:
            continue  # alive (perhaps in another pid namespace), or gone meanwhile
        try:
            if keep is not None and keep(match):
                found.append(StaleFile(path, match, removed=False))
                continue
            try:
                removed = remove_if_named(path, lock_fd)
            except OSError as exc:
                error = describe_os_error(exc)
                found.append(StaleFile(path, match, removed=False, error=error))
                continue
            if removed:
                found.append(StaleFile(path, match, removed=True))
        finally:
            os.close(lock_fd)  # removed while locked, so no new owner can be between
    return found


def _is_regular(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_file(follow_symlinks=False)
    except OSError:
        return False


def lock_if_free(path: Path) -> int | None:
    """A descriptor holding `path`'s lock if no process held it; None if one does, or
    the file is gone, unreadable or not a regular file (not ours to judge)."""
    fd = open_regular(path, os.O_RDONLY)
    if fd is None:
        return None
    if not try_lock(fd):
        os.close(fd)
        return None
    return fd


def open_regular(path: Path, flags: int) -> int | None:
    """`path` opened with `flags`, without following a link or blocking; None if it is
    gone, cannot be opened, or is not a regular file."""
    try:
        fd = os.open(path, flags | _PROBE_FLAGS)
    except OSError:
        return None
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        regular = False
    if not regular:
        os.close(fd)
        return None
    return fd


def try_lock(fd: int) -> bool:
    """Take `fd`'s file's lock if no other open file holds it: True when taken (the
    owner is gone), False when an owner holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def create_locked(path: Path) -> int | None:
    """Create `path` (O_EXCL, mode 0600) and take its lock, held until the descriptor
    and every mapping of it are gone: "this file is alive". None when a sweeper removed
    the new file between the create and the lock (the caller makes another). The
    create's OSError (FileExistsError, EACCES, ...) is the caller's to phrase."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a sweeper holds it for microseconds at most
        if names_file(path, fd):
            return fd
    except BaseException:
        with contextlib.suppress(OSError):
            remove_if_named(path, fd)
        os.close(fd)
        raise
    os.close(fd)
    return None


def names_file(path: Path, fd: int) -> bool:
    """Whether `path` still leads to the file open as `fd` (not removed, not replaced)."""
    try:
        named = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def remove_if_named(path: Path, fd: int) -> bool:
    """Remove `path` if it still leads to `fd`'s file (a file made since under the same
    name is someone else's); True if removed."""
    if not names_file(path, fd):
        return False
    try:
        path.unlink()
    except FileNotFoundError:
        return False  # another process starting up removed it first
    return True


def process_exists(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)  # signal 0: existence check only, nothing is sent
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process, alive
    except OverflowError:
        return False  # not a pid this system can have
    return True


def describe_os_error(exc: OSError) -> str:
    """'ENOSPC (No space left on device)' for an OSError, however it was built."""
    code = exc.errno
    if code is None and len(exc.args) == 1 and isinstance(exc.args[0], int):
        code = exc.args[0]
    if code is None:
        return str(exc) or type(exc).__name__
    return f"{errno.errorcode.get(code, str(code))} ({os.strerror(code)})"
