"""Results of `kvswap bench`: frozen result types, the JSON file, and the link speed.

The JSON file is what the ledger and the simulator read back, so loading it
checks every field and names the file and the field when something is wrong.

    {"schema_version": 1, "device": "cuda", "device_name": "...", "note": null,
     "torch_version": "...", "created_unix_s": 1.7e9,
     "results": [{"op": "d2h", "memory": "pinned", "bytes": 16777216,
                  "gb_per_s_median": 24.1, "gb_per_s_min": 23.9, "gb_per_s_max": 24.3,
                  "num_repeats": 5}, ...]}

`gather_chunk` rows also carry `ratio_to_memcpy`, `num_blocks` and `block_bytes`.
Bandwidths are decimal: 1 GB/s = 1e9 bytes per second.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

from kvswap.errors import KvSwapError
from kvswap.readers import BENCH_FILE, parse_json, read_user_file
from kvswap.units import format_bytes

BenchOp = Literal["h2d", "d2h", "memcpy", "gather_chunk"]
# "mmap": a PinnedBuffer on a machine without CUDA (exact-size, not page-locked).
BenchMemory = Literal["pinned", "pageable", "mmap"]
BenchDevice = Literal["cpu", "cuda"]
LinkDirection = Literal["h2d", "d2h"]

SCHEMA_VERSION = 1
_OPS: tuple[str, ...] = ("h2d", "d2h", "memcpy", "gather_chunk")
_MEMORIES: tuple[str, ...] = ("pinned", "pageable", "mmap")
_DEVICES: tuple[str, ...] = ("cpu", "cuda")
_GATHER_KEYS: tuple[str, ...] = ("ratio_to_memcpy", "num_blocks", "block_bytes")


@dataclass(frozen=True)
class BenchResult:
    """One measured row: `num_bytes` moved per copy, GB/s over `num_repeats` timed copies.

    `ratio_to_memcpy`, `num_blocks` and `block_bytes` are set only on
    `gather_chunk` rows (the chunk is `num_blocks` x `block_bytes` = `num_bytes`).
    """

    op: BenchOp
    memory: BenchMemory
    num_bytes: int
    gb_per_s_median: float
    gb_per_s_min: float
    gb_per_s_max: float
    num_repeats: int
    ratio_to_memcpy: float | None = None
    num_blocks: int | None = None
    block_bytes: int | None = None


@dataclass(frozen=True)
class BenchReport:
    """Everything one `kvswap bench` run measured, on one device."""

    device: BenchDevice
    device_name: str
    note: str | None
    results: tuple[BenchResult, ...]
    created_unix_s: float
    torch_version: str

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "device": self.device,
            "device_name": self.device_name,
            "note": self.note,
            "torch_version": self.torch_version,
            "created_unix_s": self.created_unix_s,
            "results": [_result_to_json(result) for result in self.results],
        }


def _result_to_json(result: BenchResult) -> dict[str, Any]:
    row: dict[str, Any] = {
        "op": result.op,
        "memory": result.memory,
        "bytes": result.num_bytes,
        "gb_per_s_median": result.gb_per_s_median,
        "gb_per_s_min": result.gb_per_s_min,
        "gb_per_s_max": result.gb_per_s_max,
        "num_repeats": result.num_repeats,
    }
    if result.op == "gather_chunk":
        row["ratio_to_memcpy"] = result.ratio_to_memcpy
        row["num_blocks"] = result.num_blocks
        row["block_bytes"] = result.block_bytes
    return row


def format_result(result: BenchResult) -> str:
    """One human line per row, e.g. for progress on stderr."""
    line = (
        f"{result.op} {result.memory} {format_bytes(result.num_bytes)}: "
        f"{result.gb_per_s_median:.2f} GB/s (min {result.gb_per_s_min:.2f}, "
        f"max {result.gb_per_s_max:.2f}, {result.num_repeats} repeats)"
    )
    if result.ratio_to_memcpy is not None:
        line += (
            f", {result.num_blocks} blocks of {format_bytes(result.block_bytes or 0)}, "
            f"{result.ratio_to_memcpy:.2f}x a contiguous copy"
        )
    return line


def save_report(report: BenchReport, path: str | Path) -> None:
    """Write `report` as indented JSON to `path` (the parent folder must exist)."""
    text = json.dumps(report.to_json_dict(), indent=2) + "\n"
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise KvSwapError(f"{path}: cannot write the benchmark report ({exc.strerror})") from exc


def load_report(path: str | Path) -> BenchReport:
    """Read a report written by `save_report`; KvSwapError naming the file if it is unusable."""
    try:
        data = read_user_file(path, str(path), BENCH_FILE)
    except FileNotFoundError as exc:
        raise KvSwapError(
            f"{path}: no such benchmark report; run `kvswap bench --out {path}` first"
        ) from exc
    except OSError as exc:
        raise KvSwapError(f"{path}: cannot read the benchmark report ({exc.strerror})") from exc
    # parse_json turns binary, deep nesting, bad syntax and NaN/Infinity into one line each.
    raw = parse_json(data, str(path))
    return report_from_json_dict(raw, source=str(path))


class _SchemaError(Exception):
    """A field of the JSON document is missing or has the wrong type or value."""


def report_from_json_dict(raw: object, *, source: str = "benchmark report") -> BenchReport:
    """Build a report from `to_json_dict()` output; KvSwapError naming `source` and the field."""
    try:
        return _parse_report(raw)
    except _SchemaError as exc:
        raise KvSwapError(f"{source}: not a kvswap benchmark report: {exc}") from exc


def _parse_report(raw: object) -> BenchReport:
    doc = _as_object(raw, "the document")
    version = doc.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise _SchemaError(f"schema_version is {version!r}, this kvswap reads {SCHEMA_VERSION}")
    device = _choice(doc, "device", _DEVICES, "the document")
    note = doc.get("note")
    if note is not None and not isinstance(note, str):
        raise _SchemaError(f"note must be a string or null, got {note!r}")
    rows = doc.get("results")
    if not isinstance(rows, list):
        raise _SchemaError("results must be a list of rows")
    return BenchReport(
        device=cast(BenchDevice, device),
        device_name=_string(doc, "device_name", "the document"),
        note=note,
        results=tuple(_result_from_json(row, index) for index, row in enumerate(rows)),
        created_unix_s=_number(doc, "created_unix_s", "the document"),
        torch_version=_string(doc, "torch_version", "the document"),
    )


#: Keys of reports written before the rates were renamed (GB/s, not gigabits): old -> new.
_OLD_RATE_KEYS = {"gbps_min": "gb_per_s_min", "gbps_median": "gb_per_s_median",
                  "gbps_max": "gb_per_s_max"}  # fmt: skip


def _result_from_json(raw: object, index: int) -> BenchResult:
    where = f"results[{index}]"
    row = _as_object(raw, where)
    for old, new in _OLD_RATE_KEYS.items():
        if old in row and new not in row:
            row = {**row, new: row[old]}
    op = _choice(row, "op", _OPS, where)
    memory = _choice(row, "memory", _MEMORIES, where)
    num_bytes = _positive_int(row, "bytes", where)
    gb_per_s_min = _number(row, "gb_per_s_min", where)
    gb_per_s_median = _number(row, "gb_per_s_median", where)
    gb_per_s_max = _number(row, "gb_per_s_max", where)
    if not gb_per_s_min <= gb_per_s_median <= gb_per_s_max:
        raise _SchemaError(f"{where}: needs gb_per_s_min <= gb_per_s_median <= gb_per_s_max")
    result = BenchResult(
        op=cast(BenchOp, op),
        memory=cast(BenchMemory, memory),
        num_bytes=num_bytes,
        gb_per_s_median=gb_per_s_median,
        gb_per_s_min=gb_per_s_min,
        gb_per_s_max=gb_per_s_max,
        num_repeats=_positive_int(row, "num_repeats", where),
    )
    if op != "gather_chunk":
        extra = [key for key in _GATHER_KEYS if row.get(key) is not None]
        if extra:
            raise _SchemaError(f"{where}: {extra[0]} is only allowed on gather_chunk rows")
        return result
    num_blocks = _positive_int(row, "num_blocks", where)
    block_bytes = _positive_int(row, "block_bytes", where)
    if num_blocks * block_bytes != num_bytes:
        raise _SchemaError(f"{where}: bytes must equal num_blocks x block_bytes")
    return BenchResult(
        op=result.op,
        memory=result.memory,
        num_bytes=num_bytes,
        gb_per_s_median=gb_per_s_median,
        gb_per_s_min=gb_per_s_min,
        gb_per_s_max=gb_per_s_max,
        num_repeats=result.num_repeats,
        ratio_to_memcpy=_number(row, "ratio_to_memcpy", where),
        num_blocks=num_blocks,
        block_bytes=block_bytes,
    )


def _as_object(raw: object, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise _SchemaError(f"{where} must be a JSON object, got {type(raw).__name__}")
    return cast(dict[str, Any], raw)


def _choice(doc: dict[str, Any], key: str, allowed: tuple[str, ...], where: str) -> str:
    value = doc.get(key)
    if value not in allowed:
        raise _SchemaError(f"{where}: {key} is {value!r}, allowed: {', '.join(allowed)}")
    return cast(str, value)


def _string(doc: dict[str, Any], key: str, where: str) -> str:
    value = doc.get(key)
    if not isinstance(value, str):
        raise _SchemaError(f"{where}: {key} must be a string, got {value!r}")
    return value


def _number(doc: dict[str, Any], key: str, where: str) -> float:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _SchemaError(f"{where}: {key} must be a finite number, got {value!r}")
    if value < 0:
        raise _SchemaError(f"{where}: {key} must be >= 0, got {value!r}")
    return float(value)


def _positive_int(doc: dict[str, Any], key: str, where: str) -> int:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _SchemaError(f"{where}: {key} must be a whole number > 0, got {value!r}")
    return value


def link_gb_per_s(report: BenchReport, direction: LinkDirection) -> float:
    """The host<->device bandwidth (GB/s) the ledger and simulator should assume.

    CUDA report: the median of the largest pinned transfer in `direction` (the
    swap path copies into and out of the pinned pool). CPU report: there is no
    link, so this is the largest host memcpy, the PinnedBuffer-backed ("mmap")
    row when there is one, whatever `direction`; callers must say it is host memory.
    """
    if direction not in ("h2d", "d2h"):
        raise KvSwapError(f"link direction {direction!r} is not one of: h2d, d2h")
    if report.device == "cuda":
        rows = [r for r in report.results if r.op == direction and r.memory == "pinned"]
        wanted = f"pinned {direction}"
    else:
        rows = [r for r in report.results if r.op == "memcpy"]
        wanted = "memcpy"
    if not rows:
        raise KvSwapError(
            f"benchmark report ({report.device}) has no {wanted} rows; rerun `kvswap bench`"
        )
    # Ties on size: a pool-backed row (pinned or mmap) beats a pageable one.
    best = max(rows, key=lambda r: (r.num_bytes, r.memory != "pageable"))
    return best.gb_per_s_median
