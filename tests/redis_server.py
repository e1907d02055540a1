"""A throwaway redis-server on loopback, for the remote tier's tests and benchmark.

Starts Debian's `/usr/bin/redis-server` (never any other address than
127.0.0.1, never a server the test did not start) on a free port with its
files in a directory of the caller's, waits until it answers PING, and stops
it at the end:

    with RedisServer(tmp_path / "redis", password="pw").start() as server:
        server.url        # redis://:pw@127.0.0.1:PORT/0
        server.kill()     # SIGKILL: an outage
        server.restart()  # the same port and directory

`persist=True` keeps an append-only file (fsync on every write), so keys
survive a restart. Without redis-server the fixtures skip, saying why.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

REDIS_SERVER = Path("/usr/bin/redis-server")
HOST = "127.0.0.1"
_START_TIMEOUT_S = 20.0
_STOP_TIMEOUT_S = 20.0
_PORT_ATTEMPTS = 5


def redis_server_missing() -> str | None:
    """Why the real-server tests cannot run here, or None."""
    if not os.access(REDIS_SERVER, os.X_OK):
        return f"{REDIS_SERVER} not found: install Debian's redis-server package"
    return None


class RedisServer:
    """One redis-server process; `start()` it, use `url`, `stop()` it."""

    def __init__(
        self,
        work_dir: Path,
        *,
        password: str | None = None,
        persist: bool = False,
        unix_socket: bool = False,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.work_dir = work_dir
        self.password = password
        self.persist = persist
        self.extra_args = extra_args
        self.socket_path = work_dir / "redis.sock" if unix_socket else None
        self.port: int | None = None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        credentials = f":{self.password}@" if self.password else ""
        return f"redis://{credentials}{HOST}:{self.port}/0"

    @property
    def pid(self) -> int:
        """The server process's id (a test in another process kills it by this)."""
        assert self._process is not None, "not running"
        return self._process.pid

    @property
    def unix_url(self) -> str:
        assert self.socket_path is not None, "started without unix_socket=True"
        return f"unix://{self.socket_path}?db=0"

    def start(self) -> RedisServer:
        reason = redis_server_missing()
        if reason is not None:
            pytest.skip(reason)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        for _attempt in range(_PORT_ATTEMPTS):
            self.port = free_port()  # another process may take it first: then try again
            if self._launch():
                return self
        raise RuntimeError(f"redis-server did not start; see {self.work_dir / 'redis.log'}")

    def restart(self) -> RedisServer:
        """Start again on the same port and directory (after `stop` or `kill`)."""
        if self._process is not None:
            self.stop()
        if not self._launch():
            raise RuntimeError(f"redis-server did not restart; see {self.work_dir / 'redis.log'}")
        return self

    def client(self) -> redis.Redis:
        """A plain client, for a test to look at or tamper with what is stored."""
        assert self.port is not None, "not started"
        return redis.Redis(host=HOST, port=self.port, password=self.password, socket_timeout=10)

    def stop(self) -> None:
        """SIGTERM and wait (the server flushes its append-only file)."""
        self._end(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL: the store vanishes mid-run."""
        self._end(signal.SIGKILL)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _launch(self) -> bool:
        args = [
            str(REDIS_SERVER),
            "--port", str(self.port), "--bind", HOST, "--dir", str(self.work_dir),
            "--save", "", "--daemonize", "no", "--logfile", "",
            "--appendonly", "yes" if self.persist else "no",
        ]  # fmt: skip
        if self.persist:
            args += ["--appendfsync", "always"]
        if self.password:
            args += ["--requirepass", self.password]
        if self.socket_path is not None:
            args += ["--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        args += self.extra_args
        with open(self.work_dir / "redis.log", "ab") as log:
            self._process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        deadline_s = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline_s:
            if self._process.poll() is not None:  # e.g. the port was taken meanwhile
                self._process = None
                return False
            try:
                with self.client() as probe:
                    probe.ping()
                return True
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        self.kill()
        return False

    def _end(self, sig: signal.Signals) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        process.send_signal(sig)
        try:
            process.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A plain server (no password, no persistence) for one test."""
    with RedisServer(tmp_path / "redis").start() as server:
        yield server


@pytest.fixture
def redis_server_factory(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """`factory(password=..., persist=..., unix_socket=...)`: started servers, each
    in its own directory, all stopped when the test ends."""
    servers: list[RedisServer] = []

    def factory(**options: Any) -> RedisServer:
        server = RedisServer(tmp_path / f"redis-{len(servers)}", **options)
        servers.append(server)
        return server.start()

    yield factory
    for server in servers:
        server.stop()
