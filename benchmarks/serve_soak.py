"""`kvswap serve` under bursts of streaming clients, a third of whom leave mid-stream:
does the server's memory plateau?

Starts `kvswap serve` on a built-in model (a child process on 127.0.0.1, any free
port), then sends `--bursts` bursts of `--burst-size` concurrent streaming
completions (text and token-id prompts, alternately). A share of each burst
(`--disconnect-share`, a third by default) closes its stream after a random number
of chunks. After each burst it waits until the server has ended every request it
was sent (its /metrics count), then prints the server's resident memory (VmRSS).

    requests sent, disconnects done, streams completed, what /metrics counted
    RSS after each burst; ratio last / second (the first burst pays the warm-up)

Goal: ratio <= 1.1. The server's stderr is drained and searched: tracebacks and
asyncio's "socket.send() raised exception" (writes to clients that are gone) are
counted and printed. Exit status 1 when the goal is missed or a stream failed.

    .venv/bin/python benchmarks/serve_soak.py                       # 20 x 64, ~1-3 min
    .venv/bin/python benchmarks/serve_soak.py --bursts 3 --burst-size 8   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TextIO

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests/
from tests.unit.serve_fakes import CHILD_DEADLINE_S, child_stderr, kvswap_process, wait_for_line

from machine import add_out_argument, keep_result

GOAL_RSS_RATIO = 1.1
#: Bounds on waiting for the server; not performance figures.
REQUEST_TIMEOUT_S = 120.0
SETTLE_TIMEOUT_S = 60.0
WORDS = ("tiered", "cache", "block", "swap", "prefix", "stream", "token", "page", "tier", "kv")


@dataclass
class Tally:
    sent: int = 0
    disconnected: int = 0
    completed: int = 0  # streams read to `data: [DONE]`
    refused: int = 0  # a status other than 200
    failed: list[str] = field(default_factory=list)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--bursts", type=int, default=20, help="bursts to send (default 20)")
    parser.add_argument("--burst-size", type=int, default=64, help="requests a burst (default 64)")
    parser.add_argument("--disconnect-share", type=float, default=1 / 3,
                        help="share of a burst that leaves mid-stream (default 1/3)")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens a request (default 32)")
    parser.add_argument("--model", default="tiny", help="a built-in preset (default tiny)")
    parser.add_argument("--device", default="cpu", help="the server's device (default cpu)")
    parser.add_argument("--seed", type=int, default=0, help="the clients' random seed")
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    if args.bursts < 2 or args.burst_size < 1 or args.max_tokens < 2:
        parser.error(
            f"--bursts {args.bursts}, --burst-size {args.burst_size}, --max-tokens "
            f"{args.max_tokens}: allowed: bursts >= 2 (the ratio is last / second), "
            "burst size >= 1, max tokens >= 2 (a client leaves after 1 or more chunks)"
        )
    if not 0.0 <= args.disconnect_share <= 1.0:
        parser.error(f"--disconnect-share {args.disconnect_share}: allowed: 0..1")
    return args


# -- the server ---------------------------------------------------------------------------


class Server:
    """`kvswap serve` as a child; its stdout drained in a thread (a full pipe would stall
    it), its stderr in a file (read at the end), SIGTERM at the end and a kill past
    CHILD_DEADLINE_S."""

    def __init__(self, model: str, device: str, max_waiting_requests: int):
        self.process = kvswap_process(
            "serve", "--model", model, "--device", device, "--host", "127.0.0.1", "--port", "0",
            "--max-waiting-requests", str(max_waiting_requests),
        )  # fmt: skip
        line = wait_for_line(self.process, "kvswap serve: listening on ")
        self.url = line.split("listening on ")[1].split()[0]
        self.stderr: list[str] = []
        self._drains = [
            threading.Thread(target=self._drain, args=(pipe, sink), daemon=True)
            for pipe, sink in ((self.process.stdout, []),)
        ]
        for drain in self._drains:
            drain.start()

    @staticmethod
    def _drain(pipe: IO[bytes] | None, sink: list[str]) -> None:
        assert pipe is not None
        for raw in iter(pipe.readline, b""):
            sink.append(raw.decode(errors="replace"))

    def rss_kib(self) -> int:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        found = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
        assert found is not None, "no VmRSS in /proc/PID/status"
        return int(found.group(1))

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(CHILD_DEADLINE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for drain in self._drains:
            drain.join(10)
        self.stderr = [child_stderr(self.process)]
        return self.process.returncode


async def ended_requests(http: httpx.AsyncClient) -> dict[str, float]:
    """kvswap_requests_total by finish reason, from /metrics."""
    text = (await http.get("/metrics")).text
    found: dict[str, float] = {}
    pattern = r'^kvswap_requests_total\{finished_reason="(\w+)"\} (\S+)$'
    for match in re.finditer(pattern, text, re.MULTILINE):
        found[match.group(1)] = float(match.group(2))
    return found


# -- the clients --------------------------------------------------------------------------


def body(rng: random.Random, index: int, max_tokens: int) -> dict[str, object]:
    prompt: object
    if index % 2:
        prompt = [rng.randrange(1, 250) for _ in range(rng.randrange(8, 64))]
    else:
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(4, 24)))
    return {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0}


async def one_stream(
    http: httpx.AsyncClient, payload: dict[str, object], leave_after: int | None, tally: Tally
) -> None:
    """One streaming request; `leave_after` chunks and the connection is closed."""
    tally.sent += 1
    try:
        async with http.stream("POST", "/v1/completions", json=payload) as response:
            if response.status_code != 200:
                tally.refused += 1
                await response.aread()
                return
            chunks = 0
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    tally.completed += 1
                    return
                chunks += 1
                if leave_after is not None and chunks >= leave_after:
                    tally.disconnected += 1
                    return  # leaving the block unread closes the connection
            tally.failed.append("a stream ended without data: [DONE]")
    except httpx.HTTPError as error:
        tally.failed.append(f"{type(error).__name__}: {error}")


async def burst(
    http: httpx.AsyncClient, args: argparse.Namespace, rng: random.Random, tally: Tally
) -> None:
    num_leaving = round(args.burst_size * args.disconnect_share)
    leaving = set(rng.sample(range(args.burst_size), num_leaving))
    streams = []
    for index in range(args.burst_size):
        leave_after = rng.randrange(1, max(2, args.max_tokens // 2)) if index in leaving else None
        streams.append(one_stream(http, body(rng, index, args.max_tokens), leave_after, tally))
    await asyncio.gather(*streams)


async def settle(http: httpx.AsyncClient, expected: int) -> dict[str, float]:
    """Waits until the server counted `expected` ended requests (bounded)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        ended = await ended_requests(http)
        if sum(ended.values()) >= expected or time.monotonic() > deadline:
            return ended
        await asyncio.sleep(0.05)


async def soak(
    server: Server, args: argparse.Namespace, out: TextIO
) -> tuple[Tally, list[int], dict[str, float]]:
    rng = random.Random(args.seed)
    tally = Tally()
    rss_kib: list[int] = []
    limits = httpx.Limits(max_connections=args.burst_size + 4, max_keepalive_connections=8)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S)
    async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=timeout) as http:
        ended: dict[str, float] = {}
        for number in range(1, args.bursts + 1):
            await burst(http, args, rng, tally)
            ended = await settle(http, tally.sent - tally.refused)
            rss_kib.append(server.rss_kib())
            print(
                f"burst {number:3d}: server RSS {rss_kib[-1] / 1024:8.1f} MiB  (sent "
                f"{tally.sent}, left {tally.disconnected}, completed {tally.completed}, "
                f"ended on the server {int(sum(ended.values()))})", file=out, flush=True,
            )  # fmt: skip
    return tally, rss_kib, ended


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = sys.stderr if args.json else sys.stdout
    server = Server(args.model, args.device, max_waiting_requests=args.burst_size * 2)
    try:
        tally, rss_kib, ended = asyncio.run(soak(server, args, out))
    finally:
        code = server.stop()
    log = "".join(server.stderr)
    tracebacks = log.count("Traceback (most recent call last)")
    send_warnings = log.count("socket.send() raised exception")
    ratio = rss_kib[-1] / rss_kib[1]
    report = {
        "bursts": args.bursts, "burst_size": args.burst_size, "model": args.model,
        "requests_sent": tally.sent, "disconnects_done": tally.disconnected,
        "streams_completed": tally.completed, "refused": tally.refused,
        "failed": len(tally.failed), "server_ended_by_reason": ended,
        "rss_mib_by_burst": [round(kib / 1024, 1) for kib in rss_kib],
        "rss_ratio_last_vs_second": round(ratio, 3), "goal_rss_ratio": GOAL_RSS_RATIO,
        "server_tracebacks": tracebacks, "server_socket_send_warnings": send_warnings,
        "server_stderr_lines": log.count("\n"), "server_exit_code": code,
    }  # fmt: skip
    print(f"exercised: {tally.sent} streaming requests in {args.bursts} bursts of "
          f"{args.burst_size}; {tally.disconnected} left mid-stream, {tally.completed} "
          f"completed, {tally.refused} refused, {len(tally.failed)} failed", file=out)  # fmt: skip
    print(
        f"server ended: {ended}; its stderr: {report['server_stderr_lines']} lines, "
        f"{tracebacks} tracebacks, {send_warnings} socket.send() warnings",
        file=out,
    )
    print(f"RSS last / second burst: {ratio:.3f} (goal <= {GOAL_RSS_RATIO})", file=out)
    for failure in tally.failed[:5]:
        print(f"failed: {failure}", file=out)
    if args.json:
        print(json.dumps(report, indent=2))
    keep_result(args.out, "serve_soak", "serve_soak.py", argv, report)
    return 0 if ratio <= GOAL_RSS_RATIO and not tally.failed and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
