"""The remote tier against a real redis-server on loopback (no fake store).

Each test starts its own server (tests/redis_server.py) and moves 8 KiB blocks
between a HostPool and the store through RemoteCopyEngine: bytes round trip,
prefix lookups, SET NX, corrupt values, passwords, an unreachable store, a
store killed mid-run and restarted, persistence across a restart, TTLs, the
write cap and the slow-store rule, and the tiered engine in front of both.
Reconnect backoff runs on an injected clock, so no test waits for it.
"""

from __future__ import annotations

import hashlib
import http.server
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from kvswap.control.transfer import Direction, Priority, TransferChunk, TransferResult
from kvswap.data.copy_engine import LocalCopyEngine
from kvswap.data.device_pool import DevicePool
from kvswap.data.host_pool import HostPool
from kvswap.data.layout import KVLayout
from kvswap.data.remote_copy import SLOW_HOLD_S, RemoteCopyEngine, open_remote_tier
from kvswap.data.remote_format import HEADER_BYTES
from kvswap.data.remote_store import MAX_LOOKUP_KEYS, PutOutcome, RemoteStoreClient
from kvswap.data.remote_url import PASSWORD_ENV, parse_remote_url
from kvswap.data.tiered_copy import TieredCopyEngine
from kvswap.errors import KvSwapError

from ..redis_server import HOST, RedisServer

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
    engine = RemoteCopyEngine(client, host, **options)  # type: ignore[arg-type]
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


# --- bytes ------------------------------------------------------------------------


def test_random_blocks_round_trip_every_byte(
    redis_server: RedisServer, host: HostPool, engines: list[RemoteCopyEngine]
) -> None:
    engine = make_engine(redis_server.url, host, engines)
    data = fill_random(host, seed=1)
    keys = block_keys(NUM_SLOTS)
    assert run(engine, write(1, (0, 1, 2, 3), keys[:4])).success
    assert run(engine, write(2, (7, 6, 5, 4), keys[4:])).success
    for slot in range(NUM_SLOTS):
        host.byte_view(slot).zero_()

    engine.submit(read(3, keys[:4], (4, 5, 6, 7)))
    engine.submit(read(4, keys[4:], (0, 1, 2, 3)))
    results = engine.wait_all()
    assert [r.success for r in results] == [True, True]
    for position, slot in enumerate((4, 5, 6, 7, 0, 1, 2, 3)):
        source_slot = (0, 1, 2, 3, 7, 6, 5, 4)[position]
        assert torch.equal(host.byte_view(slot), data[source_slot])
    stats = engine.stats()
    assert (stats.written_blocks, stats.hits_blocks, stats.misses_blocks) == (8, 8, 0)
    assert stats.cpu_to_remote_bytes == stats.remote_to_cpu_bytes == 8 * BLOCK_BYTES
    assert stats.outages == 0 and stats.corrupt_blocks == 0


def test_one_key_per_block_holding_header_and_bytes(
    redis_server: RedisServer, host: HostPool, engines: list[RemoteCopyEngine]
) -> None:
    engine = make_engine(redis_server.url, host, engines)
    data = fill_random(host, seed=2)
    keys = block_keys(2)
    assert run(engine, write(1, (3, 5), keys)).success
    plain = redis_server.client()
    assert sorted(plain.keys("*")) == sorted(store_name(key) for key in keys)
    value = plain.get(store_name(keys[1]))
    assert isinstance(value, bytes) and len(value) == HEADER_BYTES + BLOCK_BYTES
    assert value[HEADER_BYTES:] == data[5].numpy().tobytes()


def test_lookup_answers_the_length_of_the_present_prefix(
    redis_server: RedisServer, host: HostPool, engines: list[RemoteCopyEngine]
) -> None:
    engine = make_engine(redis_server.url, host, engines)
    fill_random(host, seed=3)
    keys = block_keys(4)
    assert run(engine, write(1, (0, 1, 2), keys[:3])).success
    absent = block_keys(1, salt="absent")[0]
    assert engine.lookup(keys) == 3
    assert engine.lookup(keys[:3]) == 3
    assert engine.lookup((keys[0], absent, keys[2])) == 1
    assert engine.lookup((absent, *keys)) == 0
    assert engine.lookup(()) == 0
    assert engine.available


def test_lookup_asks_about_a_bounded_number_of_keys(
    redis_server: RedisServer, host: HostPool, engines: list[RemoteCopyEngine]
) -> None:
    engine = make_engine(redis_server.url, host, engines)
    keys = block_keys(MAX_LOOKUP_KEYS + 5)
    pipe = redis_server.client().pipeline(transaction=False)
    for key in keys:
        pipe.set(store_name(key), b"x")
    pipe.execute()
    assert engine.lookup(keys) == MAX_LOOKUP_KEYS  # a shorter hit; ask again from there
    assert engine.lookup(keys[MAX_LOOKUP_KEYS:]) == 5


def test_a_block_already_stored_is_never_rewritten(
    redis_server: RedisServer, host: HostPool, engines: list[RemoteCopyEngine]
) -> None:
    engine = make_engine(redis_server.url, host, engines)
    data = fill_random(host, seed=4)
    key = block_keys(1)
    assert run(engine, write(1, (0,), key)).success
    result = run(engine, write(2, (1,), key))  # other bytes under the same key
    assert result.success
    assert engine.stats().already_present == 1 and engine.stats().written_blocks == 1
    assert run(engine, read(3, key, (2,))).success
    assert torch.equal(host.byte_view(2), data[0])


def test_ttl_is_set_only_when_configured(
    redis_server: RedisServer, host: HostPool, engines: list[RemoteCopyEngine]
) -> None:
    fill_random(host, seed=5)
    keys = block_keys(2)
    forever = make_engine(redis_server.url, host, engines)
    expiring = make_engine(redis_server.url, host, engines, ttl_s=100.0)
    assert run(forever, write(1, (0,), keys[:1])).success
    assert run(expiring, write(2, (1,), keys[1:])).success
    plain = redis_server.client()
    assert plain.pttl(store_name(keys[0])) == -1
    assert 0 < plain.pttl(store_name(keys[1])) <= 100_000


# --- values that fail their checks -------------------------------------------------


def test_corrupt_values_are_detected_deleted_and_counted(
    redis_server: RedisServer, host: HostPool, engines: list[RemoteCopyEngine]
) -> None:
    engine = make_engine(redis_server.url, host, engines)
    data = fill_random(host, seed=6)
    keys = block_keys(4)
    assert run(engine, write(1, (0, 1, 2, 3), keys)).success
    plain = redis_server.client()
    offset = HEADER_BYTES + 100
    flipped = bytes([int(data[1][100]) ^ 0x5A])
    plain.setrange(store_name(keys[1]), offset, flipped)  # one payload byte
    plain.set(store_name(keys[2]), b"garbage")  # not a block at all
    plain.delete(store_name(keys[3]))  # evicted between lookup and read

    result = run(engine, read(2, keys, (4, 5, 6, 7)))
    assert result.success  # for block 0: only the listed slots are untrusted
    assert result.failed_dst_slots == (5, 6, 7)
    assert result.error is not None
    assert "checksum x1" in result.error and "short x1" in result.error
    assert "1 blocks missing" in result.error
    assert torch.equal(host.byte_view(4), data[0])
    stats = engine.stats()
    assert (stats.hits_blocks, stats.corrupt_blocks, stats.misses_blocks) == (1, 2, 1)
    counters = stats.counters()
    assert counters["corrupt"] == 2 and counters["already_present"] == 0
    assert counters["outages"] == counters["skipped_writes"] == 0
    assert plain.exists(store_name(keys[1]), store_name(keys[2])) == 0  # deleted
    assert engine.lookup(keys) == 1


def test_a_value_of_another_layout_is_a_miss(
    redis_server: RedisServer, host: HostPool, engines: list[RemoteCopyEngine]
) -> None:
    writer = make_engine(redis_server.url, host, engines)
    fill_random(host, seed=7)
    key = block_keys(1)
    assert run(writer, write(1, (0,), key)).success
    # Same block bytes, another shape: the same bytes would mean something else.
    other = KVLayout(num_layers=2, num_kv_heads=2, head_dim=1024, block_tokens=1,
                     dtype=torch.uint8)  # fmt: skip
    assert other.block_bytes == BLOCK_BYTES
    with HostPool(other, 2) as other_host:
        reader = make_engine(redis_server.url, other_host, engines)
        result = run(reader, read(2, key, (1,)))
        assert result.failed_dst_slots == (1,) and "layout x1" in (result.error or "")
        assert reader.stats().corrupt_blocks == 1
        reader.close()


# --- passwords ----------------------------------------------------------------------


def test_wrong_or_missing_password_is_one_line_without_the_password(
    redis_server_factory: ServerFactory, host: HostPool, engines: list[RemoteCopyEngine],
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    server = redis_server_factory(password=PASSWORD)
    bare = f"redis://{HOST}:{server.port}/0"
    messages: list[str] = []
    for url, environ, expected in [
        (bare, {}, "needs a password (in the URL or KVSWAP_REMOTE_PASSWORD)"),
        (f"redis://:wrong-{PASSWORD}@{HOST}:{server.port}/0", {}, "refused the password"),
        (bare, {PASSWORD_ENV: f"x{PASSWORD}"}, f"refused the password (from {PASSWORD_ENV})"),
    ]:
        with pytest.raises(KvSwapError) as caught:
            open_remote_tier(url, host, namespace=NAMESPACE, timeout_ms=TIMEOUT_MS,
                             required=True, environ=environ)  # fmt: skip
        message = str(caught.value)
        assert expected in message and "\n" not in message
        assert "remote store at redis://" in message
        messages.append(message)

    with caplog.at_level(logging.WARNING, logger="kvswap.remote"):
        engine = open_remote_tier(
            f"redis://:{PASSWORD}x@{HOST}:{server.port}/0", host, namespace=NAMESPACE,
            timeout_ms=TIMEOUT_MS, required=False, environ={},
        )  # fmt: skip
        engines.append(engine)
        fill_random(host, seed=8)
        assert engine.lookup(block_keys(1)) == 0
        skipped = run(engine, write(1, (0,), block_keys(1)))
        assert not skipped.success and "skipped" in (skipped.error or "")
    lines = remote_lines(caplog)
    assert len(lines) == 1 and "refused the password; the remote tier is off" in lines[0]
    assert not engine.available
    messages += [*lines, repr(engine.stats()), repr(engine.client.url), skipped.error or ""]
    assert all(PASSWORD not in message for message in messages)
    assert all(PASSWORD not in record.getMessage() for record in caplog.records)


def test_the_password_from_the_environment_or_the_url_opens_the_store(
    redis_server_factory: ServerFactory, host: HostPool, engines: list[RemoteCopyEngine]
) -> None:
    server = redis_server_factory(password=PASSWORD)
    data = fill_random(host, seed=9)
    keys = block_keys(1)
    from_env = make_engine(f"redis://{HOST}:{server.port}/0", host, engines,
                           environ={PASSWORD_ENV: PASSWORD})  # fmt: skip
    assert run(from_env, write(1, (0,), keys)).success
    url_wins = make_engine(server.url, host, engines, environ={PASSWORD_ENV: "not-it"})
    assert run(url_wins, read(2, keys, (1,))).success
    assert torch.equal(host.byte_view(1), data[0])


# --- outages --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port: int = probe.getsockname()[1]
        return port


def test_an_unreachable_store_required_or_not(
    host: HostPool, engines: list[RemoteCopyEngine], caplog: pytest.LogCaptureFixture
) -> None:
    url = f"redis://:{PASSWORD}@{HOST}:{_free_port()}/0"
    with pytest.raises(KvSwapError) as caught:
        open_remote_tier(url, host, namespace=NAMESPACE, timeout_ms=TIMEOUT_MS, required=True)
    message = str(caught.value)
    assert "is unreachable" in message and "tiers.remote_required is true" in message
    assert "\n" not in message and PASSWORD not in message and ":***@" in message

    clock = FakeClock()
    with caplog.at_level(logging.WARNING, logger="kvswap.remote"):
        engine = make_engine(url, host, engines, backoff_clock=clock, required=False)
        keys = block_keys(2)
        assert not engine.available
        assert engine.lookup(keys) == 0
        skipped = run(engine, write(1, (0, 1), keys))
        missed = run(engine, read(2, keys, (2, 3)))
    assert skipped.failed_dst_slots == (0, 1) and "is down" in (skipped.error or "")
    assert missed.failed_dst_slots == (2, 3)
    stats = engine.stats()
    assert (stats.skipped_writes, stats.misses_blocks, stats.outages) == (2, 2, 1)
    lines = remote_lines(caplog)
    assert len(lines) == 1 and "is unreachable" in lines[0] and "retrying in 0.5 s" in lines[0]
    assert all(PASSWORD not in line for line in lines)


def test_a_server_that_is_not_redis_is_one_line(host: HostPool) -> None:
    server = http.server.HTTPServer((HOST, 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"redis://{HOST}:{server.server_address[1]}/0"
        with pytest.raises(KvSwapError) as caught:
            open_remote_tier(url, host, namespace=NAMESPACE, timeout_ms=TIMEOUT_MS, required=True)
        assert "did not answer in the Redis protocol" in str(caught.value)
    finally:
        server.shutdown()
        server.server_close()


def test_a_store_killed_mid_run_misses_then_comes_back(
    redis_server_factory: ServerFactory, host: HostPool, engines: list[RemoteCopyEngine],
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    server = redis_server_factory(password=PASSWORD)
    clock = FakeClock()
    engine = make_engine(server.url, host, engines, backoff_clock=clock)
    data = fill_random(host, seed=10)
    keys = block_keys(2)
    assert run(engine, write(1, (0, 1), keys)).success

    with caplog.at_level(logging.WARNING, logger="kvswap.remote"):
        server.kill()
        first = run(engine, read(2, keys, (2, 3)))
        again = run(engine, read(3, keys, (2, 3)))
        assert first.failed_dst_slots == again.failed_dst_slots == (2, 3)
        assert engine.lookup(keys) == 0
        assert engine.stats().outages == 1 and not engine.available

        server.restart()  # empty: no persistence
        # Backoff not due: no reconnect is tried, although the store is back.
        assert not run(engine, write(4, (0, 1), keys)).success
        assert engine.stats().skipped_writes == 2
        clock.advance(0.5)
        assert engine.available  # the next call is the reconnect probe
        assert run(engine, write(5, (0, 1), keys)).success
        assert run(engine, read(6, keys, (3, 2))).success
    assert torch.equal(host.byte_view(3), data[0]) and torch.equal(host.byte_view(2), data[1])
    stats = engine.stats()
    assert (stats.outages, stats.misses_blocks, stats.hits_blocks) == (1, 4, 2)
    lines = remote_lines(caplog)
    assert len(lines) == 2
    assert "is unreachable" in lines[0] and "is reachable again" in lines[1]
    assert all(PASSWORD not in line and ":***@" in line for line in lines)


def test_failed_reconnects_back_off_exponentially(
    host: HostPool, engines: list[RemoteCopyEngine]
) -> None:
    clock = FakeClock()
    engine = make_engine(f"redis://{HOST}:{_free_port()}/0", host, engines,
                         backoff_clock=clock, required=False)  # fmt: skip
    delays = []
    for _probe in range(8):
        waited = 0.0
        while not engine.available:
            clock.advance(0.25)
            waited += 0.25
        delays.append(waited)
        assert engine.lookup(block_keys(1)) == 0  # the probe fails
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert engine.stats().outages == 1


def test_a_store_that_never_answers_times_out_as_unreachable(host: HostPool) -> None:
    with socket.socket() as silent:  # accepts connections, never replies
        silent.bind((HOST, 0))
        silent.listen()
        url = f"redis://{HOST}:{silent.getsockname()[1]}/0"
        with pytest.raises(KvSwapError, match=r"is unreachable .*Timeout"):
            open_remote_tier(url, host, namespace=NAMESPACE, timeout_ms=200.0, required=True)


def test_writes_the_store_refuses_fail_their_slots_without_an_outage(
    redis_server: RedisServer, host: HostPool, engines: list[RemoteCopyEngine],
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    engine = make_engine(redis_server.url, host, engines)
    fill_random(host, seed=16)
    plain = redis_server.client()
    plain.config_set("maxmemory-policy", "noeviction")
    plain.config_set("maxmemory", "1")  # below what the server already uses: OOM on SET
    with caplog.at_level(logging.WARNING, logger="kvswap.remote"):
        first = run(engine, write(1, (0, 1), block_keys(2)))
        second = run(engine, write(2, (2,), block_keys(1, salt="more")))
    assert first.failed_dst_slots == (0, 1) and "OutOfMemoryError" in (first.error or "")
    assert second.failed_dst_slots == (0,)
    stats = engine.stats()
    assert (stats.failed_writes, stats.written_blocks, stats.outages) == (3, 0, 0)
    assert engine.available
    lines = remote_lines(caplog)
    assert len(lines) == 1 and "refused a put" in lines[0]


def test_an_evicting_store_drops_whole_blocks_never_half_of_one(
    redis_server: RedisServer, host: HostPool, engines: list[RemoteCopyEngine]
) -> None:
    engine = make_engine(redis_server.url, host, engines)
    data = fill_random(host, seed=17)
    plain = redis_server.client()
    plain.config_set("maxmemory-policy", "allkeys-lru")
    plain.config_set("maxmemory", str(plain.info("memory")["used_memory"] + 512 * 1024))
    keys = block_keys(200)
    for start in range(0, len(keys), NUM_SLOTS):  # 1.6 MB through a 0.5 MB budget
        run(engine, write(start + 1, tuple(range(NUM_SLOTS)), keys[start : start + NUM_SLOTS]))
    num_hits = 0
    for start in range(0, len(keys), NUM_SLOTS):
        result = run(engine, read(1000 + start, keys[start : start + NUM_SLOTS],
                                  tuple(range(NUM_SLOTS))))  # fmt: skip
        for slot in set(range(NUM_SLOTS)) - set(result.failed_dst_slots):
            assert torch.equal(host.byte_view(slot), data[slot])
            num_hits += 1
        for slot in range(NUM_SLOTS):  # restore the source bytes for the next check
            host.byte_view(slot).copy_(data[slot])
    stats = engine.stats()
    assert stats.corrupt_blocks == 0 and 0 < num_hits < len(keys)
    assert stats.hits_blocks + stats.misses_blocks == len(keys)


def test_keys_survive_a_server_restart_with_persistence(
    redis_server_factory: ServerFactory, host: HostPool, engines: list[RemoteCopyEngine]
) -> None:
    server = redis_server_factory(persist=True)
    engine = make_engine(server.url, host, engines)
    data = fill_random(host, seed=11)
    keys = block_keys(3)
    assert run(engine, write(1, (0, 1, 2), keys)).success
    engine.close()
    server.stop()
    server.restart()
    again = make_engine(server.url, host, engines)
    assert again.lookup(keys) == 3
    assert run(again, read(2, keys, (5, 6, 7))).success
    for slot, source in zip((5, 6, 7), (0, 1, 2), strict=True):
        assert torch.equal(host.byte_view(slot), data[source])


def test_unix_socket_url(
    redis_server_factory: ServerFactory, host: HostPool, engines: list[RemoteCopyEngine]
) -> None:
    server = redis_server_factory(unix_socket=True)
    engine = make_engine(server.unix_url, host, engines)
    data = fill_random(host, seed=12)
    keys = block_keys(1)
    assert run(engine, write(1, (0,), keys)).success
    assert run(engine, read(2, keys, (1,))).success
    assert torch.equal(host.byte_view(1), data[0])


# --- the write lane: cap, slow store, priority ---------------------------------------------


class GatedPuts:
    """Wraps a client's put_many: each call waits for `release` (a write in flight)."""

    def __init__(self, client: RemoteStoreClient, before: Callable[[], None] = lambda: None):
        self.release = threading.Event()
        self.entered = threading.Event()
        self._put_many = client.put_many
        self._before = before
        client.put_many = self  # type: ignore[method-assign]

    def __call__(self, items: Sequence[tuple[bytes, Any]], ttl_s: float = 0.0) -> PutOutcome:
        self.entered.set()
        assert self.release.wait(timeout=60)
        self._before()
        return self._put_many(items, ttl_s)


def test_writes_past_the_in_flight_cap_are_skipped_and_reads_never_wait(
    redis_server: RedisServer, host: HostPool, engines: list[RemoteCopyEngine]
) -> None:
    engine = make_engine(redis_server.url, host, engines, max_inflight_write_chunks=2)
    data = fill_random(host, seed=13)
    keys = block_keys(4)
    assert run(engine, write(1, (0,), keys[:1])).success
    gate = GatedPuts(engine.client)
    engine.submit(write(2, (1,), keys[1:2]))
    assert gate.entered.wait(timeout=60)
    engine.submit(write(3, (2,), keys[2:3]))  # queued behind it: 2 in flight
    engine.submit(write(4, (3,), keys[3:4]))  # past the cap
    skipped = engine.poll()
    assert [r.transfer_id for r in skipped] == [4]
    assert skipped[0].failed_dst_slots == (0,) and "in flight" in (skipped[0].error or "")

    # A read goes by the stuck write.
    assert run(engine, read(5, keys[:1], (7,))).success
    assert torch.equal(host.byte_view(7), data[0])

    gate.release.set()
    assert [r.success for r in engine.wait_all()] == [True, True]
    assert engine.stats().skipped_writes == 1 and engine.stats().written_blocks == 3


def test_after_a_slow_write_writes_are_skipped_for_a_while(
    redis_server: RedisServer, host: HostPool, engines: list[RemoteCopyEngine]
) -> None:
    clock = FakeClock()
    engine = make_engine(redis_server.url, host, engines, clock=clock)
    fill_random(host, seed=14)
    keys = block_keys(3)
    gate = GatedPuts(engine.client, before=lambda: clock.advance(2 * TIMEOUT_MS / 1000))
    gate.release.set()
    assert run(engine, write(1, (0,), keys[:1])).success  # took "10 s"
    skipped = run(engine, write(2, (1,), keys[1:2]))
    assert not skipped.success and "took over 5000 ms" in (skipped.error or "")
    clock.advance(SLOW_HOLD_S)
    gate._before = lambda: None
    assert run(engine, write(3, (2,), keys[2:])).success
    assert engine.stats().skipped_writes == 1 and engine.stats().outages == 0


# --- contract ---------------------------------------------------------------------------------


def test_programming_errors_raise_value_error(
    redis_server: RedisServer, host: HostPool, engines: list[RemoteCopyEngine]
) -> None:
    engine = make_engine(redis_server.url, host, engines)
    keys = block_keys(2)
    bad = [
        TransferChunk(1, Direction.CPU_TO_NVME, Priority.LOW, (0,), (0,), BLOCK_BYTES, keys[:1]),
        TransferChunk(
            1, Direction.CPU_TO_REMOTE, Priority.LOW, (0, 1), (0, 1), 2 * BLOCK_BYTES, keys[:1]
        ),
        TransferChunk(1, Direction.CPU_TO_REMOTE, Priority.LOW, (0,), (1,), BLOCK_BYTES, keys[:1]),
        TransferChunk(
            1, Direction.REMOTE_TO_CPU, Priority.HIGH, (0,), (NUM_SLOTS,), BLOCK_BYTES, keys[:1]
        ),
        TransferChunk(1, Direction.REMOTE_TO_CPU, Priority.HIGH, (0,), (0,), BLOCK_BYTES, (b"k",)),
        TransferChunk(1, Direction.REMOTE_TO_CPU, Priority.HIGH, (0,), (0,), 1, keys[:1]),
    ]
    for chunk in bad:
        with pytest.raises(ValueError):
            engine.submit(chunk)
    engine.submit(read(7, keys[:1], (0,)))
    with pytest.raises(ValueError, match="already in use"):
        engine.submit(read(7, keys[:1], (1,)))
    engine.wait(7)
    with pytest.raises(ValueError, match="not pending"):
        engine.wait(7)
    engine.close()
    with pytest.raises(ValueError, match="closed"):
        engine.submit(read(8, keys[:1], (0,)))


def test_the_tiered_engine_routes_by_direction(
    redis_server: RedisServer, layout: KVLayout, host: HostPool, engines: list[RemoteCopyEngine]
) -> None:
    device = DevicePool(layout, 4, device="cpu")
    generator = torch.Generator().manual_seed(15)
    original = torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8, generator=generator)
    device.byte_view(0).copy_(original)
    remote = make_engine(redis_server.url, host, engines)
    keys = block_keys(1)
    with TieredCopyEngine(LocalCopyEngine(device, host), remote) as tiered:
        out = TransferChunk(1, Direction.GPU_TO_CPU, Priority.LOW, (0,), (2,), BLOCK_BYTES)
        tiered.submit(out)
        assert tiered.wait(1).success
        tiered.submit(write(2, (2,), keys))
        with pytest.raises(ValueError, match="already in use"):
            tiered.submit(TransferChunk(2, Direction.CPU_TO_GPU, Priority.HIGH, (2,), (1,),
                                        BLOCK_BYTES))  # fmt: skip
        assert [r.transfer_id for r in tiered.wait_all()] == [2]
        host.byte_view(2).zero_()
        tiered.submit(read(3, keys, (5,)))
        assert tiered.wait(3).success
        tiered.submit(TransferChunk(4, Direction.CPU_TO_GPU, Priority.HIGH, (5,), (3,),
                                    BLOCK_BYTES))  # fmt: skip
        results: list[TransferResult] = []
        while not results:
            results = tiered.poll()
        assert [r.transfer_id for r in results] == [4] and tiered.num_pending == 0
        with pytest.raises(ValueError, match="not pending"):
            tiered.wait(4)
    assert torch.equal(device.byte_view(3), original)
    with pytest.raises(ValueError, match="closed"):
        remote.submit(read(5, keys, (0,)))


def test_the_fixture_serves_loopback_only(redis_server: RedisServer) -> None:
    assert redis_server.url.startswith(f"redis://{HOST}:")
    bind = redis_server.client().config_get("bind")["bind"]
    assert bind == HOST
    assert Path(redis_server.work_dir).is_dir()
