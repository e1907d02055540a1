"""`kvswap serve` as users run it: a child process, the official openai client, loadgen.

Exact mode (`--batch-invariant`), so every comparison is token for token: a
greedy completion equals `kvswap generate`; a chat's second turn restored from
CPU and NVMe equals the same turn on a server with an unlimited GPU pool; and
what `kvswap loadgen` counts equals what the server's /metrics counts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai

from kvswap.serve.tokenizer import builtin_codec
from tests.unit.serve_fakes import kvswap_server, metric

TINY = ("--model", "tiny", "--device", "cpu", "--port", "0", "--block-tokens", "8",
        "--batch-invariant", "--protected-sink-blocks", "1")  # fmt: skip
PROMPT_IDS = (5, 17, 99, 3, 42, 8, 77, 120, 64, 31, 200, 11)


@contextmanager
def server(*flags: str) -> Iterator[str]:
    """A running `kvswap serve` on the tiny model; yields its URL; SIGTERM at the end."""
    with kvswap_server(*TINY, *flags) as url:
        yield url


def api(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_greedy_completion_is_kvswap_generate_on_the_same_ids() -> None:
    generated = subprocess.run(
        [sys.executable, "-m", "kvswap", "generate", "--model", "tiny", "--device", "cpu",
         "--prompt-ids", ",".join(map(str, PROMPT_IDS)), "--max-new-tokens", "12", "--json"],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    expected_ids: list[int] = json.loads(generated.stdout)["output_ids"]
    codec = builtin_codec(256)
    stop = next((i for i, t in enumerate(expected_ids) if t in codec.eos_token_ids), None)
    expected_ids = expected_ids if stop is None else expected_ids[: stop + 1]
    with server("--gpu-kv-capacity-blocks", "32", "--cpu-kv-capacity-blocks", "16") as url:
        answer = api(url).completions.create(
            model="tiny", prompt=list(PROMPT_IDS), max_tokens=12, temperature=0
        )
    assert answer.choices[0].text == codec.decode(expected_ids)
    assert answer.usage is not None
    assert answer.usage.completion_tokens == len(expected_ids)


def conversation(url: str) -> tuple[list[str], int, dict[str, float]]:
    """Turn 1, four unrelated chats that push its KV off the GPU, then turn 2.
    Returns both replies, turn 2's cached tokens and the prefix hits by tier."""
    client = api(url)
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "You are a terse assistant for the kvswap tests."},
        {"role": "user", "content": "Name three tiers of memory a KV block can live in."},
    ]
    first = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=12,
        temperature=0,  # type: ignore[arg-type]
    )
    reply = first.choices[0].message.content or ""
    for other in range(4):
        client.chat.completions.create(
            model="tiny", max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": f"Unrelated request {other}: " + "x y " * 30}],
        )  # fmt: skip
    messages += [{"role": "assistant", "content": reply},
                 {"role": "user", "content": "And which one is slowest?"}]  # fmt: skip
    second = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=12,
        temperature=0,  # type: ignore[arg-type]
    )
    usage = second.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens or 0
    hits = metric(url, "kvswap_prefix_hit_tokens_total")
    return [reply, second.choices[0].message.content or ""], cached, hits


def test_a_chats_second_turn_restored_from_cpu_and_nvme_equals_an_unlimited_pool(
    tmp_path: Path,
) -> None:
    tight = ("--gpu-kv-capacity-blocks", "28", "--cpu-kv-capacity-blocks", "6",
             "--nvme-kv-capacity-blocks", "128", "--nvme-dir", str(tmp_path),
             "--cpu-demote-high-watermark", "0.5", "--cpu-demote-low-watermark", "0.0")  # fmt: skip
    with server(*tight) as url:
        tight_replies, cached, hits = conversation(url)
    with server("--gpu-kv-capacity-blocks", "512", "--cpu-kv-capacity-blocks", "16") as url:
        roomy_replies, roomy_cached, _ = conversation(url)
    assert tight_replies == roomy_replies
    assert cached > 0 and roomy_cached > 0
    restored = {label: value for label, value in hits.items() if value > 0}
    assert any('"cpu"' in label or '"nvme"' in label for label in restored), hits
    assert list(tmp_path.iterdir()) == []  # the slab went with the server


def test_loadgen_counts_what_the_servers_metrics_count() -> None:
    # --no-calibrate: the server's counters then hold the replay alone, not the probes
    # that calibrate text length (tests/integration/test_loadgen_tiny.py runs those).
    with server("--gpu-kv-capacity-blocks", "64", "--cpu-kv-capacity-blocks", "64") as url:
        run = subprocess.run(
            [sys.executable, "-m", "kvswap", "loadgen", "--url", url, "--json",
             "--num-sessions", "3", "--turns", "2", "--prompt-tokens", "24",
             "--output-tokens", "6", "--user-tokens", "8", "--system-prompt-tokens", "8",
             "--no-calibrate"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        measured = json.loads(run.stdout)
        requests = sum(metric(url, "kvswap_requests_total").values())
        generated = sum(metric(url, "kvswap_generation_tokens_total").values())
        prompted = sum(metric(url, "kvswap_prompt_tokens_total").values())
    assert measured["requests_completed"] == requests == 6
    assert measured["tokens_generated"] == generated
    assert measured["prompt_tokens"] == prompted
