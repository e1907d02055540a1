"""Server-sent events for `stream: true`, and a response that cancels what the client left.

    data: {"id": "cmpl-...", "object": "text_completion", "choices": [...]}\\n\\n
    ...
    data: [DONE]\\n\\n

`EventStreamResponse` runs `on_close` however the stream ends: the last event
sent, the client gone, the server stopping, or the stream never started because
the client left before the first byte. `on_close` decides whether the request
still needs cancelling.

A client that leaves is noticed at once, not at the next event: the events are
sent by one task while another waits for `http.disconnect`; the first to end
cancels the other. After each event the sender yields to the event loop, so a
connection lost during a write is known (and the stream stopped) before the next
write: a backlog of events is never written into a closed socket (asyncio warns
"socket.send() raised exception" from the fifth such write on).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Mapping

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE_EVENT = b"data: [DONE]\n\n"
#: Proxies (nginx) buffer responses unless told not to; an event stream must not wait.
EVENT_STREAM_HEADERS: Mapping[str, str] = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


def sse_event(payload: Mapping[str, object]) -> bytes:
    """One `data:` event; compact JSON never holds a raw newline, so one line each."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class EventStreamResponse(StreamingResponse):
    """A `text/event-stream` response over `events`; `on_close()` runs exactly once at
    the end, whether the stream was sent in full, cut by the client, or never started."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream", headers=EVENT_STREAM_HEADERS)
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sending = asyncio.ensure_future(self._send_events(send))
        leaving = asyncio.ensure_future(client_left(receive))
        try:
            await asyncio.wait({sending, leaving}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            error = await _stop(sending, leaving)
            try:
                # A generator cut between two events is closed now, not when collected;
                # one that never started or already ended closes without running anything.
                aclose = getattr(self._events, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                self._on_close()
        if error is not None:
            raise error  # a bug while streaming: uvicorn logs it and closes the connection

    async def _send_events(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})  # fmt: skip
        async for event in self._events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
            await asyncio.sleep(0)  # a connection lost in that write is seen before the next
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _stop(*tasks: asyncio.Future[None]) -> Exception | None:
    """Cancels `tasks` and waits for them to end; returns the first error one raised,
    beside a cancellation or a write refused because the client left (OSError, from
    servers on ASGI spec 2.4)."""
    for task in tasks:
        task.cancel()
    error: Exception | None = None
    for task in tasks:
        try:
            await task
        except (asyncio.CancelledError, OSError):
            pass
        except Exception as raised:
            error = error or raised
    return error


async def client_left(receive: Receive) -> None:
    """Returns once the client has disconnected (the request's body was read already,
    so the only message left to receive is the disconnect)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
