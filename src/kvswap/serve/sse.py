"""Server-sent events for `stream: true`, and a response that cancels what the client left.

    data: {"id": "cmpl-...", "object": "text_completion", "choices": [...]}\\n\\n
    ...
    data: [DONE]\\n\\n

`EventStreamResponse` runs `on_close` however the stream ends: the last event
sent, the client gone (starlette cancels the sending task, or the send raises),
the server stopping, or the stream never started because the client left before
the first byte. `on_close` decides whether the request still needs cancelling.
"""

from __future__ import annotations

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
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                # A generator cut between two events is closed now, not when collected;
                # one that never started or already ended closes without running anything.
                aclose = getattr(self._events, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                self._on_close()
