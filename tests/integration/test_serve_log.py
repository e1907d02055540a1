"""A recorded `kvswap serve` session: what the operator reads on stderr.

The start-up line (model, tiers in blocks and tokens, concurrency), one access line
per request, stats lines while requests run, one line per refusal (400, 413), and
the gauges back at zero once the requests ended."""

from __future__ import annotations

import re
import signal

import httpx
import openai

from tests.unit.serve_fakes import finish_process, kvswap_process, wait_for_line


def test_a_serve_session_tells_the_operator_what_happened() -> None:
    process = kvswap_process(
        "serve", "tiny", "--device", "cpu", "--port", "0", "--block-tokens", "8",
        "--gpu-kv-capacity-blocks", "32", "--cpu-kv-capacity-blocks", "16",
        "--max-prompt-tokens", "64", "--log-stats-interval-s", "0.01",
    )  # fmt: skip
    try:
        url = wait_for_line(process, "kvswap serve: listening on ").split("listening on ")[1]
        url = url.split()[0]
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        for _ in range(2):
            api.completions.create(model="tiny", prompt="Hello there", max_tokens=6)
        bad = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x",
                                                        "max_tokens": 2, "bogus": 1})  # fmt: skip
        long = httpx.post(
            f"{url}/v1/completions",
            json={"model": "tiny", "prompt": list(range(1, 100)), "max_tokens": 2},
        )
        metrics = httpx.get(f"{url}/metrics").text
        process.send_signal(signal.SIGINT)
        code, err = finish_process(process)
    finally:
        if process.poll() is None:
            process.kill()
    assert code == 0 and (bad.status_code, long.status_code) == (400, 413)
    lines = err.splitlines()
    startup = next(line for line in lines if "kvswap serve: model tiny" in line)
    assert startup.startswith("INFO ")
    assert "tiers: GPU 32 blocks (256 tokens), CPU 16 blocks (128 tokens), NVMe -" in startup
    assert "up to " in startup and "running sequences" in startup
    access = [line for line in lines if re.search(r"request \d+: 200, prompt", line)]
    assert len(access) == 2
    assert re.search(r"prompt \d+ tokens \(\d+ cached\), 6 generated, TTFT [\d.]+ ms, length",
                     access[0])  # fmt: skip
    assert any("stats: prompt" in line and "running" in line and "KV GPU" in line
               for line in lines)  # fmt: skip
    assert any(line.startswith("WARNING") and ": 400 bogus" in line for line in lines)
    assert any(line.startswith("WARNING") and ": 413 " in line for line in lines)
    assert "kvswap_num_requests_running 0.0" in metrics
    assert "Traceback" not in err


def test_request_lines_can_be_silenced() -> None:
    process = kvswap_process(
        "serve", "tiny", "--device", "cpu", "--port", "0", "--disable-log-requests",
        "--disable-log-stats", "--log-stats-interval-s", "0.01",
    )  # fmt: skip
    try:
        url = wait_for_line(process, "kvswap serve: listening on ").split("listening on ")[1]
        api = openai.OpenAI(base_url=f"{url.split()[0]}/v1", api_key="unused", max_retries=0)
        api.completions.create(model="tiny", prompt="Hello", max_tokens=3)
        process.send_signal(signal.SIGINT)
        code, err = finish_process(process)
    finally:
        if process.poll() is None:
            process.kill()
    assert code == 0
    assert "kvswap serve: model tiny" in err  # the start-up line stays
    assert "request 0: 200" not in err and "stats:" not in err
