"""What the remote store tests share: a clock, pools, engines, chunk builders."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvswap.base.transfer import Direction, Priority, TransferChunk, TransferResult
from kvswap.data.host_pool import HostPool
from kvswap.data.layout import KVLayout
from kvswap.data.remote_copy import RemoteCopyEngine
from kvswap.data.remote_store import RemoteStoreClient
from kvswap.data.remote_url import parse_remote_url

from ..redis_server import RedisServer

BLOCK_BYTES = 8192
NUM_SLOTS = 8
NAMESPACE = "test-ns"
# Generous: the test machine is shared; the outage tests use refused connections.
TIMEOUT_MS = 5000.0
PASSWORD = "Pa55-w0rd-never-shown"
ServerFactory = Callable[..., RedisServer]


class FakeClock:
    """Seconds that move only when a test says so."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


@pytest.fixture
def layout() -> KVLayout:
    return KVLayout.from_block_bytes(BLOCK_BYTES)


@pytest.fixture
def host(layout: KVLayout) -> Iterator[HostPool]:
    pool = HostPool(layout, NUM_SLOTS)
    yield pool
    pool.close()


@pytest.fixture
def engines() -> Iterator[list[RemoteCopyEngine]]:
    """Engines a test opens; all closed at its end."""
    opened: list[RemoteCopyEngine] = []
    yield opened
    for engine in opened:
        engine.close()


def make_engine(
    url: str,
    host: HostPool,
    engines: list[RemoteCopyEngine],
    *,
    backoff_clock: Callable[[], float] | None = None,
    required: bool = True,
    environ: dict[str, str] | None = None,
    **options: object,
) -> RemoteCopyEngine:
    client = RemoteStoreClient(
        parse_remote_url(url, environ or {}),
        namespace=NAMESPACE,
        timeout_ms=TIMEOUT_MS,
        clock=backoff_clock or time.monotonic,
    )
    client.connect(required=required)
    engine = RemoteCopyEngine.over_client(client, host, **options)  # type: ignore[arg-type]
    engines.append(engine)
    return engine


def block_keys(count: int, salt: str = "") -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(f"{salt}block-{i}".encode()).digest() for i in range(count))


def fill_random(host: HostPool, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (NUM_SLOTS, BLOCK_BYTES), dtype=torch.uint8, generator=generator)
    for slot in range(NUM_SLOTS):
        host.byte_view(slot).copy_(data[slot])
    return data


def write(tid: int, host_slots: tuple[int, ...], keys: tuple[bytes, ...]) -> TransferChunk:
    n = len(host_slots)
    return TransferChunk(
        tid, Direction.CPU_TO_REMOTE, Priority.LOW, host_slots, tuple(range(n)),
        n * BLOCK_BYTES, keys,
    )  # fmt: skip


def read(tid: int, keys: tuple[bytes, ...], host_slots: tuple[int, ...]) -> TransferChunk:
    n = len(host_slots)
    return TransferChunk(
        tid, Direction.REMOTE_TO_CPU, Priority.HIGH, tuple(range(n)), host_slots,
        n * BLOCK_BYTES, keys,
    )  # fmt: skip


def run(engine: RemoteCopyEngine, chunk: TransferChunk) -> TransferResult:
    engine.submit(chunk)
    return engine.wait(chunk.transfer_id)


def store_name(key: bytes) -> bytes:
    return f"{NAMESPACE}:{key.hex()}".encode()


def remote_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvswap.remote"]


def runs_sharing_a_prefix(url: str) -> tuple[dict[str, Any], ...]:
    """Three `kvswap run` processes of one small workload (3 sessions whose prompts
    share a 32-token system prompt): without the store, then twice with the store at
    `url`. Their `--json` summaries in that order."""
    argv = [sys.executable, "-m", "kvswap", "run", "--model", "tiny", "--json",
            "--device", "cpu", "--batch-invariant", "--num-sessions", "3", "--turns", "1",
            "--prompt-tokens", "48", "--output-tokens", "4", "--system-prompt-tokens", "32",
            "--block-tokens", "8", "--gpu-kv-capacity-blocks", "40"]  # fmt: skip

    def kvswap_run(*extra: str) -> dict[str, Any]:
        done = subprocess.run([*argv, *extra], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        summary: dict[str, Any] = json.loads(done.stdout)
        return summary

    return kvswap_run(), kvswap_run("--remote-url", url), kvswap_run("--remote-url", url)
