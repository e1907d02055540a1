"""Helpers shared by the CLI tests: run kvswap in-process, read its one error line."""

from __future__ import annotations

from typing import Any

import pytest

from kvswap.cli import main


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """`kvswap ARGV` in-process: (exit code, stdout, stderr)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    """The single `kvswap: error:` line a user mistake must give (no traceback)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("kvswap: error: ") and "Traceback" not in err
    return lines[0]


def forbid(monkeypatch: pytest.MonkeyPatch, target: object, name: str) -> None:
    """Make `target.name` fail the test if called: proves no work started."""

    def called(*_args: object, **_kwargs: object) -> Any:
        raise AssertionError(f"{name} ran although the input was bad")

    monkeypatch.setattr(target, name, called)
