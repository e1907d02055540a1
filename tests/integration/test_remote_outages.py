"""The remote tier when the store is unreachable, killed, slow, refusing, evicting or
restarted, and the write lane's cap (a real redis-server on loopback)."""

from __future__ import annotations

import http.server
import logging
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from kvswap.data.host_pool import HostPool
from kvswap.data.remote_copy import SLOW_HOLD_S, RemoteCopyEngine, open_remote_tier
from kvswap.data.remote_store import PutOutcome, RemoteStoreClient
from kvswap.errors import KvSwapError
from tests.integration.remote_store_support import (
    NAMESPACE,
    NUM_SLOTS,
    PASSWORD,
    TIMEOUT_MS,
    FakeClock,
    ServerFactory,
    block_keys,
    fill_random,
    make_engine,
    read,
    remote_lines,
    run,
    write,
)

from ..redis_server import HOST, RedisServer, free_port

# --- outages --------------------------------------------------------------------------


def test_an_unreachable_store_required_or_not(
    host: HostPool, engines: list[RemoteCopyEngine], caplog: pytest.LogCaptureFixture
) -> None:
    url = f"redis://:{PASSWORD}@{HOST}:{free_port()}/0"
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
    assert (stats.outages, stats.reconnects, stats.misses_blocks, stats.hits_blocks) == (1, 1, 4, 2)
    lines = remote_lines(caplog)
    assert len(lines) == 2
    assert "is unreachable" in lines[0] and "is reachable again" in lines[1]
    assert all(PASSWORD not in line and ":***@" in line for line in lines)


def test_failed_reconnects_back_off_exponentially(
    host: HostPool, engines: list[RemoteCopyEngine]
) -> None:
    clock = FakeClock()
    engine = make_engine(f"redis://{HOST}:{free_port()}/0", host, engines,
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
