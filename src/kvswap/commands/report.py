"""`kvswap report`: render one run's report again, or compare several side by side.

A report directory's report.json is read-only to this command: it writes the plots
and index.html (into DIR itself for one run unless --out), never report.json. A
report.json whose fields the reader would have to replace with defaults is refused
with the first such field named, instead of drawing a page from made-up values.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from kvswap.commands.outputs import check_output_dir
from kvswap.config_load import load_config
from kvswap.errors import KvSwapError
from kvswap.obs.report import (
    REPORT_FILE,
    RunReport,
    load_report,
    write_comparison,
    write_report_page,
)
from kvswap.readers import REPORT_JSON_FILE, parse_json, read_user_file

_SHOWN_CHARS = 60  # of an invalid value in the error line


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "report",
        help="compare run reports (written by run/simulate/loadgen --report) on one page",
        description="Read the report.json of each DIR and write one HTML page comparing the "
        "runs side by side: summary table, configuration differences, diagnosis, and the "
        "latency, occupancy, link and swap-wait plots with the runs overlaid (for load tests "
        "of servers, `kvswap loadgen --report`: latency, TTFT and throughput). With one DIR "
        "the run's own page is rendered again. report.json is only read, never rewritten.",
    )
    parser.add_argument("dirs", nargs="+", metavar="DIR", help="report directories")
    parser.add_argument(
        "--out",
        metavar="DIR",
        default=None,
        help="where to write index.html and the plots (default: DIR itself for one run; "
        "needed for several: nothing is written into the working directory unasked)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    # No setting applies to rendering, but a KVSWAP_* typo is refused as everywhere else.
    load_config()
    dirs = [Path(d) for d in args.dirs]
    if args.out is None and len(dirs) > 1:
        raise KvSwapError(
            f"comparing {len(dirs)} runs needs --out DIR, where the page and its plots go"
        )
    out = args.out if args.out is not None else args.dirs[0]
    check_output_dir(out, "--out")
    reports = [read_report(d) for d in dirs]
    try:
        if len(reports) == 1:
            page = write_report_page(reports[0], out, "--out")
        else:
            page = write_comparison(reports, dirs, out, "--out")
    except OSError as error:
        reason = error.strerror or str(error)
        raise KvSwapError(f"--out {out}: cannot write ({reason})") from None
    print(page)
    return 0


def read_report(directory: Path) -> RunReport:
    """The run's report, refused if any field it holds is not what the reader took from it."""
    report = load_report(directory)
    path = directory / REPORT_FILE
    try:
        text = read_user_file(path, str(path), REPORT_JSON_FILE)
    except OSError as error:
        raise KvSwapError(f"{path}: cannot read the report ({error.strerror})") from None
    raw = parse_json(text, str(path))  # load_report parsed the same bytes: this succeeds
    # What the reader understood, as it would be written; any difference from the
    # file is a field it had to drop or default, i.e. an invalid one.
    understood: object = json.loads(json.dumps(report.to_json()))
    invalid = first_difference(understood, raw, "")
    if invalid is not None:
        field, value = invalid
        raise KvSwapError(
            f"{path}: field {field!r} is invalid ({_short(value)}); report.json is only read here, "
            "write a new one with `kvswap run --report` (or simulate, loadgen)"
        )
    return report


class _Missing:
    """A key the file lacks (a JSON `null` is a value, so None cannot stand for it)."""


_MISSING = _Missing()


def first_difference(expected: object, raw: object, where: str) -> tuple[str, object] | None:
    """The first field (dotted path) where `raw` differs from `expected`, and its raw value.

    Keys only `raw` has are ignored: the file is not rewritten, so nothing is lost.
    """
    if isinstance(expected, dict):
        if not isinstance(raw, dict):
            return where or "(top level)", raw
        for key, value in expected.items():
            inner = f"{where}.{key}" if where else str(key)
            if key not in raw:
                return inner, _MISSING
            found = first_difference(value, raw[key], inner)
            if found is not None:
                return found
        return None
    if isinstance(expected, list):
        if not isinstance(raw, list) or len(raw) != len(expected):
            return where, raw
        for index, (value, item) in enumerate(zip(expected, raw, strict=True)):
            found = first_difference(value, item, f"{where}[{index}]")
            if found is not None:
                return found
        return None
    return None if _same_scalar(expected, raw) else (where, raw)


def _same_scalar(expected: object, raw: object) -> bool:
    if isinstance(expected, bool) or isinstance(raw, bool):
        return type(expected) is type(raw) and expected == raw
    both_floats = isinstance(expected, float) and isinstance(raw, float)
    if both_floats and math.isnan(expected) and math.isnan(raw):  # type: ignore[arg-type]
        return True  # NaN never equals itself; the reader kept it as it was
    numbers = isinstance(expected, int | float) and isinstance(raw, int | float)
    return (numbers or type(expected) is type(raw)) and expected == raw


def _short(value: object) -> str:
    text = json.dumps(value) if not isinstance(value, _Missing) else "missing"
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."
