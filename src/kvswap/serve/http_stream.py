"""A submitted generation as the HTTP answer: an event stream, or one JSON object.

Streaming: one chunk per piece of text (chat: the first also carries the
assistant role), a closing chunk with the finish reason, the usage chunk when
`stream_options.include_usage`, and `data: [DONE]`. A request the engine
aborts mid-stream (the server stopping) ends with an OpenAI error event instead
of the closing chunk, then `[DONE]`: the status line was sent long before.

Either way the generation is `abandon`ed when the answer ends, so a client that
left mid-answer gets its request cancelled (its KV freed on every tier).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvswap.serve.errors import ApiError
from kvswap.serve.http_generation import Generation
from kvswap.serve.http_responses import ResponseWriter
from kvswap.serve.sse import DONE_EVENT, EventStreamResponse, client_left, sse_event


def event_stream(
    generation: Generation, writer: ResponseWriter, *, with_token_ids: bool
) -> EventStreamResponse:
    return EventStreamResponse(_events(generation, writer, with_token_ids), generation.abandon)


async def _events(
    generation: Generation, writer: ResponseWriter, with_token_ids: bool
) -> AsyncIterator[bytes]:
    # Nothing is sent before the engine's first token: a client timing its first chunk
    # (a load generator's TTFT) must see the first token, not an empty opening.
    opened = False
    try:
        async for piece in generation.pieces():
            ids = piece.token_ids if with_token_ids else None
            yield sse_event(writer.text_chunk(piece.text, first=not opened, token_ids=ids))
            opened = True
        finish_reason, finished = generation.result()
    except ApiError as error:
        yield sse_event(error.to_json())
    else:
        if not opened and writer.shape.chat:
            yield sse_event(writer.text_chunk("", first=True))  # the assistant's role
        yield sse_event(writer.final_chunk(finish_reason))
        if writer.include_usage:
            yield sse_event(writer.usage_chunk(finished))
    yield DONE_EVENT


async def collect(
    request: Request, generation: Generation, writer: ResponseWriter, *, with_token_ids: bool
) -> Response:
    """The whole answer, or (the client gone before it was done) the request cancelled."""
    texts: list[str] = []

    async def gather() -> None:
        async for piece in generation.pieces():
            texts.append(piece.text)

    gathering = asyncio.ensure_future(gather())
    leaving = asyncio.ensure_future(client_left(request.receive))
    try:
        await asyncio.wait({gathering, leaving}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (gathering, leaving):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        generation.abandon()
    if not gathering.done() or gathering.cancelled():
        # Nobody reads this answer; it exists because the ASGI call must return one.
        return ApiError(499, "the client closed the connection", code="client_closed").response()
    gathering.result()  # re-raises what went wrong while gathering
    finish_reason, finished = generation.result()
    ids = tuple(generation.token_ids) if with_token_ids else None
    return JSONResponse(writer.whole("".join(texts), finish_reason, finished, ids))
