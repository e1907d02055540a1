"""Output paths: checked before any work starts, written after it without losing the result.

Every command that writes a file or a directory (`run --report`, `simulate --report`
and `--timeseries`, `tune --out`, `bench --out`, `report --out`) does:

    check_output_dir(args.report, "--report")       # before the workload is built
    ...                                             # the work
    failure = attempt_write(lambda: write(...), "--report", args.report)
    print(summary)                                  # the result is never thrown away
    if failure is not None:
        raise failure                               # then one line on stderr, exit 2

A check only probes: it creates a temporary entry beside the target and removes
it at once, so a run that fails a check leaves nothing on disk. The probe is a
real create, not `os.access`, because as root `os.access` says yes to /proc and
to read-only mounts alike.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from kvswap.errors import KvSwapError

_PROBE_PREFIX = ".kvswap-probe-"


def check_output_dir(path: str | None, flag: str) -> Path | None:
    """That directory `path` exists and takes new files, or can be created; None if unset.

    Nothing is created: the directory is made when the result is written.
    """
    if path is None:
        return None
    target = _non_empty(path, flag)
    if target.exists():
        if not target.is_dir():
            raise KvSwapError(f"{flag} {path}: exists and is not a directory")
        _probe_dir(target, flag, path)
        return target
    _probe_dir(_nearest_existing_dir(target, flag, path), flag, path)
    return target


def check_output_file(path: str | None, flag: str) -> Path | None:
    """That file `path` can be written (its folder exists and takes files); None if unset."""
    if path is None:
        return None
    target = _non_empty(path, flag)
    if target.is_dir():
        raise KvSwapError(f"{flag} {path}: is a directory; give a file name")
    parent = target.parent
    if not parent.exists():
        raise KvSwapError(f"{flag} {path}: the folder {parent} does not exist")
    if not parent.is_dir():
        raise KvSwapError(f"{flag} {path}: {parent} is not a directory")
    _probe_dir(parent, flag, path)
    if target.exists():
        try:
            # O_APPEND without writing: proves the file opens for writing, changes nothing.
            os.close(os.open(target, os.O_WRONLY | os.O_APPEND))
        except OSError as error:
            raise KvSwapError(f"{flag} {path}: cannot write ({_reason(error)})") from None
    return target


def write_text_output(path: str, text: str, flag: str) -> None:
    """Write `text` to `path`; an OSError becomes one line naming the flag."""
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as error:
        raise KvSwapError(f"{flag} {path}: cannot write ({_reason(error)})") from None


def attempt_write(write: Callable[[], object], flag: str, path: str) -> KvSwapError | None:
    """Run `write`; the failure as a one-line error to raise after the summary is printed."""
    try:
        write()
    except KvSwapError as error:
        return error
    except OSError as error:
        return KvSwapError(f"{flag} {path}: cannot write ({_reason(error)})")
    return None


def _non_empty(path: str, flag: str) -> Path:
    if not path.strip():
        raise KvSwapError(f"{flag} {path!r}: empty; give a path")
    return Path(path).expanduser()


def _nearest_existing_dir(target: Path, flag: str, path: str) -> Path:
    """The closest ancestor of `target` that exists; it must be a directory."""
    ancestor = target.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise KvSwapError(f"{flag} {path}: {ancestor} is not a directory")
    return ancestor


def _probe_dir(directory: Path, flag: str, path: str) -> None:
    """Create and remove a temporary file in `directory`, or fail in one line."""
    try:
        handle, probe = tempfile.mkstemp(prefix=_PROBE_PREFIX, dir=directory)
    except OSError as error:
        raise KvSwapError(
            f"{flag} {path}: cannot write into {directory} ({_reason(error)})"
        ) from None
    os.close(handle)
    os.unlink(probe)


def _reason(error: OSError) -> str:
    return error.strerror or str(error)
