"""Parsing untrusted JSON and TOML text without ever raising anything but a one-line error.

Every file kvswap reads (traces, `--config`, `--bench`, `config.json`, `report.json`)
goes through `parse_json` or `parse_toml`. Each turns the ways a hostile or broken file
can crash a plain `json.loads` / `tomllib.loads` into a `KvSwapError` (a `ConfigError`
for TOML) whose message names `what` was read and the problem:

- nesting deeper than `MAX_NESTING_DEPTH` (a cheap bracket scan up front, so the
  parsers' recursion is never reached; `RecursionError` is still caught as a backstop),
- bytes that are not UTF-8 (a binary file),
- syntax errors (with line and column),
- non-finite numbers (`NaN`, `Infinity`, `1e400`, TOML's `nan` / `inf`), which no
  setting, trace or report of kvswap can use, named by their key path,
- integers too long to convert (Python's digit limit).

Torch-free and standard library only, so any layer may import it.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Iterator

from kvswap.errors import ConfigError, KvSwapError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

__all__ = ["MAX_NESTING_DEPTH", "parse_json", "parse_toml"]

# Real inputs nest a handful of levels (a report.json about 5); 64 leaves room for any
# honest file while staying far below the interpreter's recursion limit.
MAX_NESTING_DEPTH = 64

_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_JSON_BRACKET = re.compile(r"[\[\]{}]")
# Left to right, the first alternative that matches wins, so a '#' or a bracket inside
# a string is skipped with the string and a quote inside a comment with the comment.
_TOML_SKIPPED = re.compile(
    r'"""[\s\S]*?"""|\'\'\'[\s\S]*?\'\'\'|"(?:[^"\\\n]|\\.)*"|\'[^\'\n]*\'|#[^\n]*'
)
_OPENERS = frozenset("[{")


def _deeper_than(text: str, skipped: re.Pattern[str], limit: int) -> bool:
    """Whether brackets outside strings (and comments) nest deeper than `limit`."""
    # Fast path: with no more openers than the limit the text cannot nest deeper.
    if text.count("[") + text.count("{") <= limit:
        return False
    depth = 0
    for match in _JSON_BRACKET.finditer(skipped.sub("", text)):
        if match.group() in _OPENERS:
            depth += 1
            if depth > limit:
                return True
        else:
            depth = max(depth - 1, 0)
    return False


def _first_clause(error: Exception) -> str:
    """The message up to its first ':' or line break; Python's digit-limit text runs long."""
    return str(error).splitlines()[0].split(":")[0] if str(error) else type(error).__name__


def _too_deep(what: str) -> str:
    return f"{what}: nested deeper than {MAX_NESTING_DEPTH} levels; kvswap reads flatter files"


def _decode(text: str | bytes, what: str, kind: str, error_type: type[KvSwapError]) -> str:
    if isinstance(text, str):
        return text
    try:
        return text.decode("utf-8")
    except UnicodeDecodeError as error:
        raise error_type(
            f"{what}: not UTF-8 text (byte 0x{text[error.start]:02x} at offset {error.start});"
            f" expected a {kind} file, is it binary?"
        ) from None


def _key_path(parent: str, key: object) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else str(key)


def _walk(value: object, path: str = "") -> Iterator[tuple[str, object, int]]:
    """(key path, value, depth) of every value, iteratively (no recursion to exhaust)."""
    stack: list[tuple[str, object, int]] = [(path, value, 0)]
    while stack:
        here, item, depth = stack.pop()
        yield here, item, depth
        if isinstance(item, dict):
            children = [(_key_path(here, k), v, depth + 1) for k, v in item.items()]
            stack.extend(reversed(children))
        elif isinstance(item, list):
            children = [(_key_path(here, i), v, depth + 1) for i, v in enumerate(item)]
            stack.extend(reversed(children))


def _first_non_finite(value: object) -> tuple[str, float] | None:
    for path, item, _ in _walk(value):
        if isinstance(item, float) and not math.isfinite(item):
            return path, item
    return None


def _non_finite_message(what: str, found: tuple[str, float] | None) -> str:
    if found is None:  # pragma: no cover - the hooks only flag what the walk finds
        return f"{what}: holds a non-finite number; expected finite numbers only"
    path, item = found
    place = f"{path!r} is" if path else "the value is"
    return f"{what}: {place} {item}; expected a finite number"


def parse_json(text: str | bytes, what: str) -> object:
    """The JSON value in `text`, or a one-line KvSwapError naming `what` and the problem.

    `what` says what is being read, e.g. "trace line 3" or "report.json 'DIR/report.json'".
    NaN, Infinity and numbers too large for a float are refused (strict JSON has none).
    """
    decoded = _decode(text, what, "JSON", KvSwapError)
    if _deeper_than(decoded, _JSON_STRING, MAX_NESTING_DEPTH):
        raise KvSwapError(_too_deep(what))
    saw_non_finite = False

    # The hooks only flag the value; the key path is found afterwards, and only when one
    # was seen, so a valid file costs no extra walk.
    def parse_float(literal: str) -> float:
        nonlocal saw_non_finite
        number = float(literal)
        if not math.isfinite(number):
            saw_non_finite = True
        return number

    def parse_constant(literal: str) -> float:
        nonlocal saw_non_finite
        saw_non_finite = True
        return float(literal)

    try:
        value = json.loads(decoded, parse_float=parse_float, parse_constant=parse_constant)
    except json.JSONDecodeError as error:
        raise KvSwapError(
            f"{what}: not valid JSON (line {error.lineno}, column {error.colno}: {error.msg})"
        ) from None
    except RecursionError:
        raise KvSwapError(_too_deep(what)) from None
    except ValueError as error:  # e.g. an integer longer than Python converts
        raise KvSwapError(f"{what}: not valid JSON: {_first_clause(error)}") from None
    if saw_non_finite:
        raise KvSwapError(_non_finite_message(what, _first_non_finite(value)))
    return value


def parse_toml(text: str | bytes, what: str) -> dict[str, object]:
    """The TOML table in `text`, or a one-line ConfigError naming `what` and the problem.

    `what` says what is being read, e.g. "config file 'x.toml'". Besides bracket nesting,
    dotted keys and table headers (`a.b.c...`) nest too, so the parsed table's depth is
    checked as well; TOML's `nan` and `inf` are refused with their key.
    """
    decoded = _decode(text, what, "TOML", ConfigError)
    if "\x00" in decoded:
        raise ConfigError(f"{what}: contains NUL bytes; expected a TOML text file, is it binary?")
    if _deeper_than(decoded, _TOML_SKIPPED, MAX_NESTING_DEPTH):
        raise ConfigError(_too_deep(what))
    try:
        table = tomllib.loads(decoded)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{what}: not valid TOML: {str(error).splitlines()[0]}") from None
    except RecursionError:
        raise ConfigError(_too_deep(what)) from None
    except ValueError as error:  # e.g. an integer longer than Python converts
        raise ConfigError(f"{what}: not valid TOML: {_first_clause(error)}") from None
    for path, item, depth in _walk(table):
        if depth > MAX_NESTING_DEPTH:
            raise ConfigError(_too_deep(what))
        if isinstance(item, float) and not math.isfinite(item):
            raise ConfigError(_non_finite_message(what, (path, item)))
    return dict(table)
