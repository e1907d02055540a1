"""Reading and parsing untrusted files without ever raising anything but a one-line error.

Every file a user hands kvswap (`--config`, `--bench`, `--hf-config`, a checkpoint's
`config.json` and tokenizer files, traces, `report.json`) is read here, in two steps.

Reading (`read_user_file`, or `open_user_file` for a trace streamed line by line):
before anything is opened the path must be a regular file (`os.stat` + `S_ISREG`, so a
FIFO, `/dev/zero` or a directory is refused in one line instead of blocking or filling
memory), no larger than its kind's cap (the table below); then at most cap + 1 bytes
are read, so a file that grows while it is read is still bounded. A trace is streamed,
so it has no size cap, only one on the length of a line.

Parsing (`parse_json` / `parse_toml`) turns the ways a hostile or broken file can crash
a plain `json.loads` / `tomllib.loads` into a `KvSwapError` (a `ConfigError` for TOML)
whose message names `what` was read and the problem:

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
import os
import re
import stat
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from kvswap.errors import ConfigError, KvSwapError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

__all__ = [
    "BENCH_FILE",
    "CHAT_TEMPLATE_FILE",
    "CONFIG_FILE",
    "MAX_BENCH_BYTES",
    "MAX_CHAT_TEMPLATE_BYTES",
    "MAX_CONFIG_BYTES",
    "MAX_MODEL_CONFIG_BYTES",
    "MAX_NESTING_DEPTH",
    "MAX_REPORT_BYTES",
    "MAX_TOKENIZER_BYTES",
    "MAX_TRACE_LINE_BYTES",
    "MAX_WEIGHT_INDEX_BYTES",
    "MODEL_CONFIG_FILE",
    "REPORT_JSON_FILE",
    "SAFETENSORS_FILE",
    "TOKENIZER_FILE",
    "TRACE_FILE",
    "WEIGHT_INDEX_FILE",
    "FileKind",
    "check_user_file",
    "open_user_file",
    "parse_json",
    "parse_toml",
    "read_user_file",
]

_MIB = 2**20

# --- the caps: the largest file of each kind kvswap reads -----------------------------
# Each is far above any honest file of its kind and far below a host's memory.
#: `--config`: a TOML file of settings is a few KiB.
MAX_CONFIG_BYTES = 1 * _MIB
#: A Hugging Face `config.json` (`--hf-config`, a checkpoint's) or `generation_config.json`.
MAX_MODEL_CONFIG_BYTES = 1 * _MIB
#: `tokenizer.json` / `tokenizer_config.json`: a 256k vocabulary with merges is ~30 MB.
MAX_TOKENIZER_BYTES = 64 * _MIB
#: `chat_template.jinja`: a template is a few KiB.
MAX_CHAT_TEMPLATE_BYTES = 1 * _MIB
#: `model.safetensors.index.json`: ~100 bytes per tensor; 90k tensors are ~9 MB.
MAX_WEIGHT_INDEX_BYTES = 64 * _MIB
#: `--bench`: a bandwidth benchmark result, a few KiB.
MAX_BENCH_BYTES = 4 * _MIB
#: A run's `report.json`: the summary plus at most ~300 time-series points, ~1 MB at most.
MAX_REPORT_BYTES = 16 * _MIB
#: One line of a Mooncake JSONL trace (the trace itself is streamed, so it has no cap).
MAX_TRACE_LINE_BYTES = 16 * _MIB

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


# --- reading: a regular file, bounded ---------------------------------------------------


@dataclass(frozen=True)
class FileKind:
    """What a user may hand in for one kind of file, for `read_user_file`'s messages."""

    expected: str  # what to give instead, e.g. "a TOML file"
    max_bytes: int | None  # None: streamed line by line (a trace), no cap on the whole
    cap_name: str  # the constant's name, shown in the message


CONFIG_FILE = FileKind("a TOML file", MAX_CONFIG_BYTES, "MAX_CONFIG_BYTES")
MODEL_CONFIG_FILE = FileKind(
    "a Hugging Face config JSON file", MAX_MODEL_CONFIG_BYTES, "MAX_MODEL_CONFIG_BYTES"
)
TOKENIZER_FILE = FileKind("a tokenizer JSON file", MAX_TOKENIZER_BYTES, "MAX_TOKENIZER_BYTES")
CHAT_TEMPLATE_FILE = FileKind(
    "a jinja chat template", MAX_CHAT_TEMPLATE_BYTES, "MAX_CHAT_TEMPLATE_BYTES"
)
WEIGHT_INDEX_FILE = FileKind(
    "a safetensors index JSON file", MAX_WEIGHT_INDEX_BYTES, "MAX_WEIGHT_INDEX_BYTES"
)
BENCH_FILE = FileKind(
    "a JSON file written by `kvswap bench --out`", MAX_BENCH_BYTES, "MAX_BENCH_BYTES"
)
REPORT_JSON_FILE = FileKind(
    "a report.json written by `kvswap run --report`", MAX_REPORT_BYTES, "MAX_REPORT_BYTES"
)
TRACE_FILE = FileKind("a JSONL trace file", None, "")
#: The tensors are mmapped by safetensors; kvswap reads only the header (capped where read).
SAFETENSORS_FILE = FileKind("a safetensors file", None, "")


def _size(num_bytes: int) -> str:
    """1048576 -> '1 MiB', 3355443 -> '3.2 MiB', 900 -> '900 bytes'."""
    for unit, scale in (("GiB", 2**30), ("MiB", _MIB), ("KiB", 1024)):
        if num_bytes >= scale:
            value = num_bytes / scale
            return f"{value:.0f} {unit}" if num_bytes % scale == 0 else f"{value:.1f} {unit}"
    return f"{num_bytes} bytes"


def _node_kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a plain file"  # pragma: no cover - no other kind of node on Linux


def _refuse_unless_regular(
    mode: int, what: str, kind: FileKind, error_type: type[KvSwapError]
) -> None:
    if not stat.S_ISREG(mode):
        raise error_type(f"{what}: not a regular file ({_node_kind(mode)}); give {kind.expected}")


def _too_large(
    what: str, size: str, kind: FileKind, max_bytes: int, error_type: type[KvSwapError]
) -> KvSwapError:
    return error_type(f"{what}: {size}; allowed: at most {_size(max_bytes)} ({kind.cap_name})")


def check_user_file(
    path: str | os.PathLike[str],
    what: str,
    kind: FileKind,
    error_type: type[KvSwapError] = KvSwapError,
) -> None:
    """Refuse `path` in one line unless it is a regular file within `kind`'s cap, without
    opening it: for a file found ahead of reading it (read_text_files checks tokenizer.json
    when it finds it; `load_text` reads it with `read_user_file`).
    `what` names the flag or file in the message. OSError (no such file) passes through."""
    info = os.stat(path)
    _refuse_unless_regular(info.st_mode, what, kind, error_type)
    if kind.max_bytes is not None and info.st_size > kind.max_bytes:
        size = _size(info.st_size)
        if size.replace(".0 ", " ") == _size(kind.max_bytes):  # 1 MiB + 1 byte: not "1.0 MiB"
            size = f"more than {_size(kind.max_bytes)}"
        raise _too_large(what, size, kind, kind.max_bytes, error_type)


def open_user_file(
    path: str | os.PathLike[str],
    what: str,
    kind: FileKind,
    error_type: type[KvSwapError] = KvSwapError,
) -> BinaryIO:
    """`path` opened for reading in binary, once `check_user_file` accepts it; the caller
    bounds what it reads (a trace: line by line, each line capped).

    Opened non-blocking and checked again on the descriptor, so a path swapped for a
    FIFO between the check and the open neither blocks nor passes. OSError passes."""
    check_user_file(path, what, kind, error_type)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    fd = os.open(path, flags)
    try:
        _refuse_unless_regular(os.fstat(fd).st_mode, what, kind, error_type)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_user_file(
    path: str | os.PathLike[str],
    what: str,
    kind: FileKind,
    error_type: type[KvSwapError] = KvSwapError,
) -> bytes:
    """The bytes of the regular file `path`, or a one-line `error_type` naming `what`:
    not a regular file, or over `kind.max_bytes` (checked on the size before reading,
    and on what was read: at most the cap + 1 bytes are, so a file that grows meanwhile
    is bounded too). OSError (missing, unreadable) passes through for the caller's message.

        read_user_file(path, f"config file {str(path)!r}", CONFIG_FILE, ConfigError)
    """
    max_bytes = kind.max_bytes
    if max_bytes is None:  # pragma: no cover - a programming error, not user input
        raise ValueError(f"{kind.expected} is streamed; use open_user_file")
    with open_user_file(path, what, kind, error_type) as file:
        data = file.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise _too_large(what, f"more than {_size(max_bytes)}", kind, max_bytes, error_type)
    return data
