"""`kvswap loadgen`: replay a trace or a synthetic workload against an OpenAI-compatible
server (kvswap serve, vLLM, SGLang) and report latency, throughput and goodput.

Order of work: flags and output paths are checked, the workload is built (a bad
trace is one line), then one asyncio loop asks GET /v1/models (unreachable or
not OpenAI-compatible: one line), calibrates prompt text to the server's
tokenizer (`calibrate.py`; one line says how, or why not) and replays the
workload. The summary and the load-test findings (`obs/loadgen_findings.py`)
are printed even when the run was stopped (Ctrl-C, SIGTERM) or a report write
failed; the stop or the failure is raised after it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from kvswap.commands.argument_text import api_key_text
from kvswap.commands.outputs import attempt_write, check_output_dir
from kvswap.commands.run import add_workload_arguments, check_workload_arguments
from kvswap.commands.run import workload_from_args as build_workload
from kvswap.errors import KvSwapError
from kvswap.obs.finding import Finding
from kvswap.obs.html import LOADGEN_SUMMARY_ROWS
from kvswap.obs.loadgen_findings import CHECKED, judge
from kvswap.obs.progress import ProgressBar
from kvswap.obs.report import LOADGEN_COMMAND, RunReport, write_report
from kvswap.redact import redact_url
from kvswap.serve.loadgen.calibrate import Calibration, calibrate, uncalibrated
from kvswap.serve.loadgen.client import OpenAIClient, api_base
from kvswap.serve.loadgen.prompts import ENDPOINTS, VOCAB_SIZE, PromptBook
from kvswap.serve.loadgen.replay import Replay, ReplayOutcome, ReplaySettings
from kvswap.serve.loadgen.results import Slo, summarize
from kvswap.serve.loadgen.series import loadgen_series
from kvswap.signals import Terminated
from kvswap.workload.request import Workload

API_KEY_VARIABLE = "OPENAI_API_KEY"
DEFAULT_TIMEOUT_S = 600.0
MAX_SHOWN_ERRORS = 5
#: report.json keeps this many per-request records (~260 bytes each as written: ~5 MiB,
#: a third of the 16 MiB a report is read back with); the page says when more ran.
MAX_REPORTED_REQUESTS = 20_000


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "loadgen",
        help="replay a trace or synthetic sessions against an OpenAI-compatible server",
        description="Send a workload to any OpenAI-compatible server (kvswap serve, vLLM, "
        "SGLang) at its arrival times, streamed, and report TTFT, TPOT, inter-token latency "
        "percentiles, throughput and goodput. Trace prompts are built from hash_ids (equal ids, "
        "equal text), worded to the server's tokenizer: a few requests of max_tokens 1 "
        "measure its tokens per word first; multi-turn sessions are chats that carry the "
        "server's own replies.",
    )
    parser.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument(
        "--synthetic", action="store_true",
        help="replay synthetic sessions (the default without --trace)",
    )  # fmt: skip
    parser.add_argument(
        "--endpoint", choices=ENDPOINTS, default="chat",
        help="API for requests (default chat; completions sends later turns as one prompt)",
    )  # fmt: skip
    parser.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    parser.add_argument(
        "--api-key", default=None, help=f"bearer token (default: ${API_KEY_VARIABLE})"
    )
    parser.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                        help="requests in flight at most (default: no limit)")  # fmt: skip
    parser.add_argument("--duration-s", type=float, default=None, metavar="S",
                        help="stop after S seconds; requests in flight are cancelled")  # fmt: skip
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                        help=f"per request (default {DEFAULT_TIMEOUT_S:g})")  # fmt: skip
    parser.add_argument("--slo-ttft-ms", type=float, default=None, metavar="MS",
                        help="goodput counts requests with TTFT <= MS")  # fmt: skip
    parser.add_argument("--slo-tpot-ms", type=float, default=None, metavar="MS",
                        help="goodput counts requests with TPOT <= MS")  # fmt: skip
    parser.add_argument(
        "--no-calibrate", dest="calibrate", action="store_false",
        help="send one word per intended token instead of probing the server's tokenizer",
    )  # fmt: skip
    add_workload_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--report", metavar="DIR", default=None,
        help="write report.json, PNG plots and index.html into DIR",
    )  # fmt: skip
    parser.set_defaults(handler=run)


def check_arguments(args: argparse.Namespace) -> None:
    """Every flag no reader checks, before anything is built or sent."""
    check_workload_arguments(args)
    if args.synthetic and args.trace is not None:
        raise KvSwapError("--synthetic and --trace: give one workload, not both")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise KvSwapError(f"--max-concurrency {args.max_concurrency}: allowed: an integer >= 1")
    for flag, number in (("--duration-s", args.duration_s), ("--timeout-s", args.timeout_s),
                         ("--slo-ttft-ms", args.slo_ttft_ms),
                         ("--slo-tpot-ms", args.slo_tpot_ms)):  # fmt: skip
        if number is not None and (not math.isfinite(number) or number <= 0):
            raise KvSwapError(f"{flag} {number}: allowed: a finite number > 0")


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    api_base(args.url)  # a malformed URL or key is one line before the workload is built
    api_key(args)
    check_output_dir(args.report, "--report")
    workload = build_workload(args, VOCAB_SIZE)
    show = not (args.quiet or args.json)
    with ProgressBar("loadgen", Console(file=sys.stderr), enabled=show) as bar:
        model, calibration, outcome = asyncio.run(_load_test(args, workload, bar, show))
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    facts = {"command": LOADGEN_COMMAND, "url": redact_url(args.url), "model": model,
             "endpoint": args.endpoint, "workload": workload.name}  # fmt: skip
    measured = summarize(
        outcome.records, duration_s=outcome.duration_s, slo=slo, stopped_by=outcome.stopped_by
    )
    summary: dict[str, object] = {**facts, **measured, "calibration": calibration.to_json()}
    findings = judge(summary, max_concurrency=args.max_concurrency)
    print(json.dumps(summary, indent=2) if args.json else render(summary, findings))
    failure = None
    if args.report is not None:
        run_facts = {**facts, "requests": len(outcome.records), "calibration": calibration.line}
        report = _report(args, summary, run_facts, outcome, len(workload), findings)
        failure = attempt_write(lambda: write_report(report, args.report), "--report", args.report)
        if failure is None and not args.quiet:
            print(f"report: {Path(args.report) / 'index.html'}", file=sys.stderr)
    if outcome.stop_signal is not None:
        if failure is not None:
            print(f"kvswap: error: {failure}", file=sys.stderr)  # the stop line comes last
        stop: BaseException = (
            KeyboardInterrupt() if outcome.stop_signal == signal.SIGINT
            else Terminated(outcome.stop_signal)
        )  # fmt: skip
        stop.add_note(f"{measured['requests_cancelled']} requests in flight cancelled")
        raise stop
    if failure is not None:
        raise failure
    _refuse_if_all_failed(measured)
    return 0


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $KVSWAP_API_KEY; None for neither (or an empty one)."""
    source = "--api-key" if args.api_key is not None else API_KEY_VARIABLE
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_VARIABLE)
    return api_key_text(key, source) if key else None


async def _load_test(
    args: argparse.Namespace, workload: Workload, bar: ProgressBar, show: bool
) -> tuple[str, Calibration, ReplayOutcome]:
    async with OpenAIClient(
        args.url, api_key=api_key(args), timeout_s=args.timeout_s,
        max_connections=args.max_concurrency,
    ) as client:  # fmt: skip
        model = _pick_model(args.model, await client.served_models(), client.shown_url)
        settings = ReplaySettings(
            model=model,
            endpoint=args.endpoint,
            max_requests=args.max_requests,
            duration_s=args.duration_s,
            max_concurrency=args.max_concurrency,
            timeout_s=args.timeout_s,
        )
        system_tokens = args.system_prompt_tokens if args.trace is None else 0
        if args.calibrate:
            several = system_tokens > 0 or any(r.follow_up is not None for r in workload)
            calibration = await calibrate(
                client, model, args.endpoint, multi_message=several, timeout_s=args.timeout_s
            )
        else:
            calibration = uncalibrated("--no-calibrate")
        prompts = PromptBook(workload, args.endpoint, system_tokens, calibration.scale)
        replay = Replay(workload, prompts, client, settings, bar.update)
        if show:
            print(
                f"loadgen: {workload.name}: {replay.num_planned} requests to "
                f"{client.shown_url} (model {model}, {args.endpoint})"
            )
            print(f"loadgen: {calibration.line}")
        return model, calibration, await replay.run()


def _pick_model(wanted: str | None, served: list[str], shown_url: str) -> str:
    if wanted is None:
        if not served:
            raise KvSwapError(f"{shown_url}: GET /v1/models lists no model; give --model NAME")
        return served[0]
    if served and wanted not in served:
        raise KvSwapError(
            f"--model {wanted!r}: not served by {shown_url}; it serves: {', '.join(served[:10])}"
        )
    return wanted


def _refuse_if_all_failed(measured: Mapping[str, object]) -> None:
    errors = measured["errors"]
    if measured["requests_completed"] == 0 and isinstance(errors, list) and errors:
        raise KvSwapError(
            f"every request sent failed ({measured['requests_failed']}); the first: "
            f"{errors[0]['message']}"
        )


def render(summary: Mapping[str, object], findings: Sequence[Finding]) -> str:
    """The summary table, the findings (or what was checked), then refused requests."""
    width = max(len(label) for label, _ in LOADGEN_SUMMARY_ROWS)
    lines = [f"{label:<{width}}  {cell(summary)}" for label, cell in LOADGEN_SUMMARY_ROWS]
    lines += [f"finding: {f.one_line()}" for f in findings] or [CHECKED]
    errors = summary.get("errors")
    listed = errors if isinstance(errors, list) else []
    for error in listed[:MAX_SHOWN_ERRORS]:  # an answer's status starts its message
        lines.append(f"failed request {error['request_id']}: {error['message']}")
    failed = summary.get("requests_failed")
    if isinstance(failed, int) and failed > MAX_SHOWN_ERRORS:
        lines.append(
            f"... {failed - MAX_SHOWN_ERRORS} more failed requests (--json lists "
            f"{len(listed)}; --report DIR keeps a record of every request)"
        )
    return "\n".join(lines)


def _report(
    args: argparse.Namespace,
    summary: dict[str, object],
    run_facts: dict[str, object],
    outcome: ReplayOutcome,
    num_workload_requests: int,
    findings: Sequence[Finding],
) -> RunReport:
    """The run as a report: the load generator's settings stand in for an engine config."""
    settings = {
        "url": run_facts["url"], "model": run_facts["model"], "endpoint": args.endpoint,
        "max_requests": args.max_requests, "duration_s": args.duration_s,
        "max_concurrency": args.max_concurrency, "timeout_s": args.timeout_s,
        "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
        "calibrate": args.calibrate,
        "api_key_given": bool(args.api_key or os.environ.get(API_KEY_VARIABLE)),
    }  # fmt: skip
    workload: dict[str, object] = {
        "name": run_facts["workload"], "requests": num_workload_requests,
        "time_scale": args.time_scale, "length_scale": args.length_scale,
    }  # fmt: skip
    if args.trace is None:
        for name in ("num_sessions", "turns", "prompt_tokens", "output_tokens", "user_tokens",
                     "system_prompt_tokens", "arrival_rate", "think_time_s", "seed"):  # fmt: skip
            value = getattr(args, name)
            workload[name] = value if math.isfinite(value) else str(value)
    return RunReport(
        label=Path(args.report).resolve().name,
        run=run_facts,
        config={"loadgen": settings, "workload": workload},
        summary=summary,
        series=loadgen_series(outcome.records, outcome.duration_s),
        findings=tuple(findings),
        watermarks=None,
        requests=tuple(r.to_json() for r in outcome.records[:MAX_REPORTED_REQUESTS]),
    )
