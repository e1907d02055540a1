"""The remote tier against a real redis-server on loopback (no fake store).

Each test starts its own server (tests/redis_server.py) and moves 8 KiB blocks
between a HostPool and the store through RemoteCopyEngine: bytes round trip,
prefix lookups, SET NX, corrupt values, passwords, an unreachable store, a
store killed mid-run and restarted, persistence across a restart, TTLs, the
write cap and the slow-store rule, and the tiered engine in front of both.
Reconnect backoff runs on an injected clock, so no test waits for it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kvswap.base.transfer import Direction, Priority, TransferChunk, TransferResult
from kvswap.data.copy_engine import LocalCopyEngine
from kvswap.data.device_pool import DevicePool
from kvswap.data.host_pool import HostPool
from kvswap.data.layout import KVLayout
from kvswap.data.remote_copy import RemoteCopyEngine, open_remote_tier
from kvswap.data.remote_format import HEADER_BYTES
from kvswap.data.remote_store import MAX_LOOKUP_KEYS
from kvswap.data.remote_url import PASSWORD_ENV
from kvswap.data.tiered_copy import TieredCopyEngine
from kvswap.errors import KvSwapError
from tests.integration.remote_store_support import (
    BLOCK_BYTES,
    NAMESPACE,
    NUM_SLOTS,
    PASSWORD,
    TIMEOUT_MS,
    ServerFactory,
    block_keys,
    fill_random,
    make_engine,
    read,
    remote_lines,
    run,
    store_name,
    write,
)

from ..redis_server import HOST, RedisServer

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


def test_a_value_under_another_key_is_detected_deleted_and_counted(
    redis_server: RedisServer, host: HostPool, engines: list[RemoteCopyEngine]
) -> None:
    # Regression: intact values moved between keys passed every check and were
    # restored as the wrong blocks.
    engine = make_engine(redis_server.url, host, engines)
    data = fill_random(host, seed=8)
    keys = block_keys(4)
    assert run(engine, write(1, (0, 1, 2), keys[:3])).success
    plain = redis_server.client()
    first, second = plain.get(store_name(keys[0])), plain.get(store_name(keys[1]))
    assert isinstance(first, bytes) and isinstance(second, bytes)
    plain.set(store_name(keys[0]), second)  # two values swapped
    plain.set(store_name(keys[1]), first)
    plain.rename(store_name(keys[2]), store_name(keys[3]))  # one renamed

    result = run(engine, read(2, keys, (4, 5, 6, 7)))
    assert not result.success and result.failed_dst_slots == (4, 5, 6, 7)
    assert "key x3" in (result.error or "") and "1 blocks missing" in (result.error or "")
    assert all(torch.equal(host.byte_view(slot), data[slot]) for slot in (4, 5, 6, 7))  # untouched
    stats = engine.stats()
    assert (stats.hits_blocks, stats.corrupt_blocks, stats.misses_blocks) == (0, 3, 1)
    assert plain.exists(*(store_name(key) for key in keys)) == 0  # deleted
    # The blocks are written again under their own keys and read back intact.
    assert run(engine, write(3, (0, 1), keys[:2])).success
    assert run(engine, read(4, keys[:2], (6, 7))).failed_dst_slots == ()
    assert torch.equal(host.byte_view(6), data[0]) and torch.equal(host.byte_view(7), data[1])


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


# --- contract ---------------------------------------------------------------------------------


def test_programming_errors_raise_value_error(
    redis_server: RedisServer, host: HostPool, engines: list[RemoteCopyEngine]
) -> None:
    engine = make_engine(redis_server.url, host, engines)
    keys = block_keys(2)
    bad = [
        TransferChunk(1, Direction.GPU_TO_CPU, Priority.LOW, (0,), (0,), BLOCK_BYTES, keys[:1]),
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
    with TieredCopyEngine(LocalCopyEngine(device, host), [remote]) as tiered:
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
