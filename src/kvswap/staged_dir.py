"""Writing a directory of results all at once, or not at all (`--report DIR`, `--out DIR`).

The files are written into a staging directory and moved into place at the end, so
a stop (Ctrl-C, SIGTERM), a full disk or a crash mid-way never leaves a half-written
report (plots without an index.html) where the user looks for one:

    DIR missing:  PARENT/.DIR.kvswap-staging-<random>/   --rename-->   PARENT/DIR/
                  (the missing parents of DIR are made first, and removed again on failure)
    DIR exists:   DIR/.kvswap-staging-<random>/*   --os.replace, `last` file last-->   DIR/*
                  (files beside them, e.g. the report.json `kvswap report DIR` reads, stay)

On any exit through an exception the staging directory and the parents made for it
are removed and DIR is left as it was; a stop signal gets the note "FLAG DIR: not
written" for its one stop line. The moves and the removal run with stop signals
deferred (`signals_deferred`), so a signal cannot cut them in half.

The staging directory is made with `mkdir` (not `mkdtemp`, whose 0700 mode the
report would keep), so the report gets the same permissions a plain mkdir gives.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvswap.errors import KvSwapError
from kvswap.signals import Terminated, signals_deferred

__all__ = ["STAGING_MARK", "note_not_written", "staged_dir"]

STAGING_MARK = ".kvswap-staging-"
_NAME_ATTEMPTS = 100


def note_not_written(stop: BaseException, flag: str, path: str | os.PathLike[str]) -> None:
    """Add "FLAG PATH: not written" to a stop's notes, unless one about PATH is there."""
    prefix = f"{flag} {os.fspath(path)}:"
    if not any(str(note).startswith(prefix) for note in getattr(stop, "__notes__", ())):
        stop.add_note(f"{prefix} not written")


@contextmanager
def staged_dir(
    path: str | os.PathLike[str], flag: str, *, last: str | None = None
) -> Iterator[Path]:
    """A fresh directory to write into; on a clean exit its files become `path`'s.

    `flag` names the option in errors and notes; `last` is the file moved last into
    an existing directory (the page that links the others). Raises KvSwapError when
    `path` is not a directory or cannot be made; an OSError while writing or moving
    passes through (after the clean-up) for the caller's one-line message.
    """
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise KvSwapError(f"{flag} {os.fspath(path)}: exists and is not a directory")
    made: list[Path] = []
    staging: Path | None = None
    committed = False
    try:
        try:
            _make_missing(target.parent, made)
            staging = _new_staging(target)
        except OSError as error:
            reason = error.strerror or str(error)
            raise KvSwapError(
                f"{flag} {os.fspath(path)}: cannot create the directory ({reason})"
            ) from None
        yield staging
        with signals_deferred():
            _commit(staging, target, last)
            committed = True
    except BaseException as error:
        if not committed:
            _discard(staging, made, flag, path)
        if isinstance(error, KeyboardInterrupt | Terminated):
            if committed:  # a signal held during the moves, raised once they were done
                error.add_note(f"{flag} {os.fspath(path)}: written")
            else:
                note_not_written(error, flag, path)
        raise


def _make_missing(directory: Path, made: list[Path]) -> None:
    """Make `directory` and its missing parents, recording each one made in `made`."""
    missing: list[Path] = []
    while not directory.exists() and directory != directory.parent:
        missing.append(directory)
        directory = directory.parent
    for each in reversed(missing):
        each.mkdir()
        made.append(each)


def _new_staging(target: Path) -> Path:
    """An empty directory beside `target` (missing) or inside it (existing)."""
    inside = target.exists()
    parent = target if inside else target.parent
    prefix = STAGING_MARK if inside else f".{target.name}{STAGING_MARK}"
    for _ in range(_NAME_ATTEMPTS):
        candidate = parent / f"{prefix}{secrets.token_hex(6)}"
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return candidate
    raise FileExistsError(f"no free staging name in {parent}")  # pragma: no cover


def _commit(staging: Path, target: Path, last: str | None) -> None:
    if staging.parent != target:
        os.rename(staging, target)  # atomic: DIR appears whole or not at all
        return
    # Into an existing DIR, file by file (each os.replace is atomic), `last` last.
    names = sorted(os.listdir(staging), key=lambda name: (name == last, name))
    for name in names:
        os.replace(staging / name, target / name)
    os.rmdir(staging)


def _discard(
    staging: Path | None, made: list[Path], flag: str, path: str | os.PathLike[str]
) -> None:
    """Remove the staging directory and the parents made for it (only if empty)."""
    try:
        with signals_deferred():
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
            for directory in reversed(made):
                try:
                    directory.rmdir()
                except OSError:
                    break  # something else was put there meanwhile: not ours to remove
    except (KeyboardInterrupt, Terminated) as stop:  # held during the removal
        note_not_written(stop, flag, path)
        raise
