"""Clients that are slow, or leave, on the wire: the server bounds what they hold.

Raw sockets send what no client library would: headers or a body cut short, a
connection that says nothing, a client that resets its connection mid-body or
mid-stream. The timeouts are set short here (the defaults are 10 s for headers,
30 s for a body); every wait in the tests is bounded by DEADLINE_S, and no test
measures time.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from kvswap.errors import KvSwapError
from kvswap.serve.app import AppSettings, build_app
from kvswap.serve.http_server import ApiServer
from kvswap.serve.tokenizer import TextCodec, builtin_codec

from .serve_fakes import DEADLINE_S, FakeHandle, FakeService, RunningServer

#: Short, so a test does not wait long; generous next to a loopback round trip.
SHORT_TIMEOUT_S = 0.3
#: Loggers a server writes its tracebacks and asyncio its write warnings to.
SERVER_LOGGERS = ("uvicorn.error", "asyncio")


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return builtin_codec(1024)


@pytest.fixture
def service(codec: TextCodec) -> Iterator[FakeService]:
    reply = codec.encode("a long reply that never ends ", add_special_tokens=False)
    fake = FakeService(reply_ids=reply, max_model_tokens=4096)
    yield fake
    fake.close(0)


class BurstyService(FakeService):
    """Each step delivers a burst of tokens per request, as a fast engine does to a
    stream that fell behind: events queue up between two sends."""

    tokens_a_step: int = 50

    def _step(self, handle: FakeHandle) -> bool:
        return any(super(BurstyService, self)._step(handle) for _ in range(self.tokens_a_step))


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._lock_records = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self._lock_records:
            self.records.append(record)

    def attach(self) -> None:
        """Listen from now on: uvicorn's dictConfig, run by every new server's Config,
        drops the handlers its loggers had."""
        for name in SERVER_LOGGERS:
            logging.getLogger(name).addHandler(self)

    def detach(self) -> None:
        for name in SERVER_LOGGERS:
            logging.getLogger(name).removeHandler(self)

    def warnings(self) -> list[str]:
        with self._lock_records:
            return [
                f"{r.name}: {r.getMessage()} {'(with a traceback)' if r.exc_info else ''}"
                for r in self.records
                if r.levelno >= logging.WARNING
            ]


@pytest.fixture
def server_log() -> Iterator[_Records]:
    """What the server logs at WARNING and above (uvicorn's tracebacks, asyncio's
    "socket.send() raised exception"), however uvicorn configured its handlers."""
    handler = _Records()
    yield handler
    handler.detach()


class SlowClientServer(RunningServer):
    """`RunningServer` with the timeouts of a test."""

    def __init__(
        self,
        service: FakeService,
        codec: TextCodec,
        *,
        header_read_timeout_s: float = DEADLINE_S,
        body_read_timeout_s: float = DEADLINE_S,
        log: _Records | None = None,
    ):
        settings = AppSettings(body_read_timeout_s=body_read_timeout_s)
        app = build_app(service, codec, settings)
        super().__init__(app, service)
        self.server = ApiServer(
            app, service, model_name=service.model_id, shutdown_timeout_s=5.0,
            stdout=self.stdout, header_read_timeout_s=header_read_timeout_s,
        )  # fmt: skip
        if log is not None:
            log.attach()


def connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return socket.create_connection((parts.hostname, parts.port), timeout=DEADLINE_S)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (bounded)."""
    received = b""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            return received
        if not data:
            return received
        received += data
    raise AssertionError(f"the server kept the connection open: {received!r}")


def reset(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a killed client does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def post_head(path: str, content_length: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {content_length}\r\n\r\n"
    ).encode()


BODY = json.dumps({"prompt": "hi", "max_tokens": 4}).encode()


# -- timeouts ------------------------------------------------------------------------------


def test_a_half_sent_body_gets_408_and_its_connection_closed(
    service: FakeService, codec: TextCodec, server_log: _Records
) -> None:
    with SlowClientServer(
        service, codec, body_read_timeout_s=SHORT_TIMEOUT_S, log=server_log
    ) as server:
        with connect(server.url) as sock:
            sock.sendall(post_head("/v1/completions", len(BODY)) + BODY[:5])
            answer = read_until_closed(sock)
        good = httpx.post(f"{server.url}/v1/completions", json=json.loads(BODY))
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer
    assert b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and "\n" not in error["message"]
    assert "request body" in error["message"]
    assert good.status_code == 200, good.text
    assert len(service.submitted) == 1  # only the whole request reached the engine
    assert server_log.warnings() == []


def test_half_sent_headers_and_silent_connections_are_closed(
    service: FakeService, codec: TextCodec, server_log: _Records
) -> None:
    with SlowClientServer(
        service, codec, header_read_timeout_s=SHORT_TIMEOUT_S, log=server_log
    ) as server:
        with connect(server.url) as silent, connect(server.url) as half:
            half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Le")
            assert read_until_closed(silent) == b""
            assert read_until_closed(half) == b""
        # Kept alive after a whole request, then the next one cut short: closed as well.
        with connect(server.url) as kept:
            kept.sendall(post_head("/v1/completions", len(BODY)) + BODY)
            first = kept.recv(65536)
            kept.sendall(b"GET /health HTTP/1.1\r\nHo")
            rest = read_until_closed(kept)
        good = httpx.get(f"{server.url}/health")
    assert first.startswith(b"HTTP/1.1 200"), first
    assert b"/health" not in rest and b"HTTP/1.1" not in rest  # no answer to half a request
    assert good.status_code == 200
    assert server_log.warnings() == []


def test_the_timeouts_never_cut_a_long_stream(
    service: FakeService, codec: TextCodec, server_log: _Records
) -> None:
    service.step_s = 0.01  # 60 tokens: several header and body timeouts long
    body = {"prompt": "hi", "max_tokens": 60, "stream": True}
    with (
        SlowClientServer(
            service, codec, header_read_timeout_s=0.1, body_read_timeout_s=0.1, log=server_log
        ) as server,
        httpx.Client(base_url=server.url, timeout=DEADLINE_S) as http,
        http.stream("POST", "/v1/completions", json=body) as response,
    ):
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
    assert server_log.warnings() == []


def test_timeouts_are_checked() -> None:
    with pytest.raises(KvSwapError, match="body_read_timeout_s 0"):
        AppSettings(body_read_timeout_s=0)
    with pytest.raises(KvSwapError, match="header_read_timeout_s nan"):
        ApiServer(build_app(FakeService(), None), FakeService(), model_name="m",
                  shutdown_timeout_s=1, header_read_timeout_s=float("nan"))  # fmt: skip


# -- clients that leave ----------------------------------------------------------------------


def test_a_client_leaving_mid_body_costs_no_traceback(
    service: FakeService, codec: TextCodec, server_log: _Records
) -> None:
    with SlowClientServer(service, codec, log=server_log) as server:
        for leave in (socket.socket.close, reset) * 4:
            sock = connect(server.url)
            sock.sendall(post_head("/v1/completions", len(BODY)) + BODY[:5])
            leave(sock)
        good = httpx.post(f"{server.url}/v1/completions", json=json.loads(BODY))
    # The server stopped: every connection it had was handled and closed by now.
    assert good.status_code == 200, good.text
    assert len(service.submitted) == 1
    assert server_log.warnings() == []


def test_streams_whose_clients_leave_stop_at_once(codec: TextCodec, server_log: _Records) -> None:
    """Each client reads one event and resets its connection while the engine delivers
    tokens in bursts: the stream stops at the first failed write (asyncio warns
    "socket.send() raised exception" from the fifth write into a closed socket on),
    its request is cancelled, and the server serves the next client."""
    reply = codec.encode("a long reply that never ends ", add_special_tokens=False)
    service = BurstyService(reply_ids=reply, max_model_tokens=100_000, max_open_requests=16)
    body = json.dumps({"prompt": "hi", "max_tokens": 50_000, "stream": True}).encode()
    num_streams = 8
    with SlowClientServer(service, codec, log=server_log) as server:
        for _ in range(num_streams):
            sock = connect(server.url)
            sock.sendall(post_head("/v1/completions", len(body)) + body)
            received = b""
            while b"data: " not in received:  # the status line, then the first events
                data = sock.recv(65536)
                assert data, received
                received += data
            reset(sock)
        deadline = time.monotonic() + DEADLINE_S
        while len(service.cancelled) < num_streams and time.monotonic() < deadline:
            time.sleep(0.01)
        good = httpx.post(f"{server.url}/v1/completions", json=json.loads(BODY))
    service.close(0)
    assert sorted(service.cancelled) == list(range(num_streams))
    assert good.status_code == 200, good.text
    assert server_log.warnings() == []
