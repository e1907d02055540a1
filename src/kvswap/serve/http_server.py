"""uvicorn, run in-process: the listener, the ready line, and a clean stop on a signal.

    bind_listener(host, port)      before the engine is built: a taken port or a wrong
                                   host is one line, and no weights were loaded for it
    ApiServer(app, service, ...).run([listener])
                                   serves until a stop signal (or the engine stops):
        signal -> uvicorn stops accepting and closes idle connections
               -> service.close(timeout) in a worker thread, at the same time, so the
                  open requests finish or are aborted by the deadline; their streams
                  end and their connections close
               -> returns the signal's number; the command exits 0

Signals: `kvswap.cli` turns stop signals into exceptions (`stop_signals_raise`).
While the server runs, `ApiServer.capture_signals` puts uvicorn's graceful handler
on all four stop signals instead, and puts the raising ones back afterwards.
uvicorn's own `capture_signals` would re-raise the signal once it restored those
(`signal.raise_signal`), turning a clean stop into `Terminated` and exit 143;
this one records the signal and does not. A second SIGINT forces the exit, as
in uvicorn (the service is still closed, within its timeout).

Slow clients: uvicorn bounds a request's header size (h11, 16 KiB) and an idle
keep-alive connection (5 s), but not the time a client takes to send its headers,
nor a connection that connects and sends nothing: a client sending a byte now and
then held its connection (and a file descriptor) forever. `DeadlineH11Protocol`
gives every connection `header_read_timeout_s` to deliver a request's headers
whenever the app is not handling a request on it (a new connection, the bytes of
the next request, what is left of a body the app refused), and closes it past that.
While the app handles a request it is the app's business: the body has
`AppSettings.body_read_timeout_s` (408), and a long stream is never cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import math
import signal
import socket
import sys
import threading
from collections.abc import Generator
from typing import TextIO

import h11
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvswap.errors import KvSwapError
from kvswap.serve.service import EngineService
from kvswap.signals import STOP_SIGNALS

#: uvicorn checks `should_exit` every 0.1 s; the engine's health every this many checks.
_HEALTH_CHECK_TICKS = 10
#: Extra seconds uvicorn waits for connections after `service.close` had its timeout.
_CONNECTION_GRACE_S = 2
#: A connection's time to deliver a request's headers while no request runs on it.
HEADER_READ_TIMEOUT_S = 10.0


def bind_listener(host: str, port: int) -> socket.socket:
    """A bound TCP socket on host:port (0: any free port); asyncio starts listening."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        listener = socket.socket(family, kind, proto)
    except (OSError, UnicodeError) as error:  # UnicodeError: no IDNA name ("a..b", 64+ chars)
        raise _host_error(host, error) from None
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
    except OSError as error:
        listener.close()
        if error.errno == errno.EADDRNOTAVAIL:
            raise _host_error(host, error) from None
        reason = error.strerror or str(error)
        raise KvSwapError(
            f"--port {port}: cannot listen on {host}:{port} ({reason}); "
            "choose a free port (1024-65535) or 0 for any"
        ) from None
    return listener


def _host_error(host: str, error: OSError | UnicodeError) -> KvSwapError:
    reason = (error.strerror if isinstance(error, OSError) else None) or str(error)
    return KvSwapError(
        f"--host {host}: not an address of this machine ({reason}); "
        "use 127.0.0.1 (the default), ::1 or one of this machine's addresses"
    )


def url_host(address: str) -> str:
    """An address as it goes in a URL: IPv6 in brackets."""
    return f"[{address}]" if ":" in address else address


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline (see the module docstring).

    The deadline is armed when the connection opens, and when bytes arrive while no
    request is being handled; it is dropped once a request's headers are in and the
    app runs. Firing with still no request running, it closes the connection (the
    client sent no complete request line and headers: there is nothing to answer)."""

    header_read_timeout_s = HEADER_READ_TIMEOUT_S
    _header_deadline: asyncio.TimerHandle | None = None

    @classmethod
    def with_timeout(cls, header_read_timeout_s: float) -> type[DeadlineH11Protocol]:
        return type(cls.__name__, (cls,), {"header_read_timeout_s": header_read_timeout_s})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._handling_request():
            self._drop_header_deadline()
        elif self._header_deadline is None:
            self._arm_header_deadline()  # the first bytes of a request, or of a refused body

    def connection_lost(self, exc: Exception | None) -> None:
        self._drop_header_deadline()
        super().connection_lost(exc)

    def _handling_request(self) -> bool:
        cycle = self.cycle
        return cycle is not None and not cycle.response_complete

    def _arm_header_deadline(self) -> None:
        self._drop_header_deadline()
        self._header_deadline = self.loop.call_later(
            self.header_read_timeout_s, self._header_deadline_passed
        )

    def _drop_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _header_deadline_passed(self) -> None:
        self._header_deadline = None
        if self._handling_request() or self.transport.is_closing():
            return
        if self.conn.our_state is not h11.ERROR:
            with contextlib.suppress(h11.LocalProtocolError):
                self.conn.send(h11.ConnectionClosed())
        self.transport.close()


class ApiServer(uvicorn.Server):
    """uvicorn's server with kvswap's start and stop (see the module docstring).

    `run(listener)` serves until a stop signal, `request_stop()` (any thread) or the
    engine stopping; it returns the stop signal's number, or None."""

    def __init__(
        self,
        app: ASGIApp,
        service: EngineService,
        *,
        model_name: str,
        shutdown_timeout_s: float,
        stdout: TextIO | None = None,
        header_read_timeout_s: float = HEADER_READ_TIMEOUT_S,
    ):
        if not (math.isfinite(header_read_timeout_s) and header_read_timeout_s > 0):
            raise KvSwapError(
                f"header_read_timeout_s {header_read_timeout_s}: allowed: a number > 0"
            )
        super().__init__(
            uvicorn.Config(
                app, log_level="warning", access_log=False, lifespan="off",
                timeout_graceful_shutdown=math.ceil(shutdown_timeout_s + _CONNECTION_GRACE_S),
                # Always h11 (never httptools, were it installed): the protocol with the
                # header deadline above. No WebSockets: none is served, and an upgraded
                # connection would leave the deadline armed behind it.
                http=DeadlineH11Protocol.with_timeout(header_read_timeout_s), ws="none",
            )
        )  # fmt: skip
        self._service = service
        self._model_name = model_name
        self._shutdown_timeout_s = shutdown_timeout_s
        self._stdout = stdout
        self.stop_signal: int | None = None
        self.engine_stopped = False
        self._service_closed = False
        self.ready = threading.Event()
        self.url: str | None = None  # set once listening

    def run(self, sockets: list[socket.socket] | None = None) -> int | None:  # type: ignore[override]
        """Serve on `sockets` (one bound listener); the service is closed on every way out."""

        async def main() -> None:
            try:
                await self.serve(sockets=sockets)
            finally:
                await self._close_service()  # uvicorn never started: no shutdown ran it

        asyncio.run(main())
        if self.engine_stopped and self.stop_signal is None:
            raise KvSwapError("the engine stopped (its error is above); the server shut down")
        return self.stop_signal

    def request_stop(self) -> None:
        """Stop as a signal would (from any thread; uvicorn polls the flag)."""
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {signum: signal.signal(signum, self.handle_exit) for signum in STOP_SIGNALS}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def handle_exit(self, sig: int, frame: object) -> None:
        if self.stop_signal is None:
            self.stop_signal = sig
        super().handle_exit(sig, frame)  # type: ignore[arg-type]

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and sockets:
            host, port = sockets[0].getsockname()[:2]
            self.url = f"http://{url_host(host)}:{port}"
            out = self._stdout if self._stdout is not None else sys.stdout
            out.write(f"kvswap serve: listening on {self.url} (model {self._model_name})\n")
            out.flush()
            self.ready.set()

    async def on_tick(self, counter: int) -> bool:
        check = counter % _HEALTH_CHECK_TICKS == 0 and not self.should_exit
        if check and not self._service.healthy():
            self.engine_stopped = True
            self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # The service closes while uvicorn drains: requests end (finished or aborted by
        # the deadline), so their streams end and uvicorn's wait for them ends too.
        closing = asyncio.ensure_future(self._close_service())
        try:
            await super().shutdown(sockets)
        finally:
            await closing

    async def _close_service(self) -> None:
        if not self._service_closed:
            self._service_closed = True
            await asyncio.to_thread(self._service.close, self._shutdown_timeout_s)
