"""`kvswap report`: render one run's report again, or compare several side by side."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvswap.obs.report import load_report, write_comparison, write_report

DEFAULT_COMPARE_DIR = "kvswap-compare"


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "report",
        help="compare run reports (written by run/simulate --report) on one page",
        description="Read the report.json of each DIR and write one HTML page comparing the "
        "runs side by side: summary table, configuration differences, diagnosis, and the "
        "latency, occupancy, link and swap-wait plots with the runs overlaid. With one DIR "
        "the run's own page is rendered again.",
    )
    parser.add_argument("dirs", nargs="+", metavar="DIR", help="report directories")
    parser.add_argument(
        "--out",
        metavar="DIR",
        default=None,
        help=f"where to write index.html and the plots (default: DIR itself for one run, "
        f"./{DEFAULT_COMPARE_DIR} for several)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    dirs = [Path(d) for d in args.dirs]
    reports = [load_report(d) for d in dirs]
    if len(reports) == 1:
        page = write_report(reports[0], args.out if args.out is not None else dirs[0])
    else:
        page = write_comparison(reports, dirs, args.out or DEFAULT_COMPARE_DIR)
    print(page)
    return 0
