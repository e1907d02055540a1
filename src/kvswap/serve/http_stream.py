"""A submitted request's choices as the HTTP answer: an event stream, or one JSON object.

Streaming: one chunk per piece of text of any choice, under that choice's index
(chat: a choice's first chunk also carries the assistant role), a closing chunk
per choice with its finish reason, the usage chunk when
`stream_options.include_usage`, and `data: [DONE]`. The choices' pieces are sent
in the order they arrive, so with `n > 1` they interleave. A request the engine
aborts mid-stream (the server stopping) ends with an OpenAI error event instead
of the closing chunks, then `[DONE]`: the status line was sent long before.

Either way every choice is `abandon`ed when the answer ends, so a client that
left mid-answer gets its requests cancelled (their KV freed on every tier).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvswap.serve.errors import ApiError
from kvswap.serve.http_generation import Generation, Piece
from kvswap.serve.http_logprobs import LogprobsWriter
from kvswap.serve.http_responses import ChoiceResult, ResponseWriter
from kvswap.serve.service import Finished
from kvswap.serve.sse import DONE_EVENT, EventStreamResponse, client_left, sse_event


@dataclass(frozen=True)
class Choice:
    """One of a request's `n` choices: its generation and, when logprobs were asked
    for, the writer of its logprobs."""

    index: int
    generation: Generation
    logprobs: LogprobsWriter | None = None

    def logprobs_json(self, piece: Piece) -> dict[str, object] | None:
        return None if self.logprobs is None else self.logprobs.to_json(piece.logprobs)


def abandon_all(choices: Sequence[Choice]) -> None:
    for choice in choices:
        choice.generation.abandon()


def event_stream(
    choices: Sequence[Choice], writer: ResponseWriter, *, with_token_ids: bool
) -> EventStreamResponse:
    return EventStreamResponse(
        _events(choices, writer, with_token_ids), lambda: abandon_all(choices)
    )


#: What a choice's feeder hands the stream: a piece, None (its pieces ended), or an error.
_Fed = tuple[int, Piece | BaseException | None]


async def _feed(choice: Choice, queue: asyncio.Queue[_Fed]) -> None:
    try:
        async for piece in choice.generation.pieces():
            queue.put_nowait((choice.index, piece))
    except Exception as error:
        queue.put_nowait((choice.index, error))
    else:
        queue.put_nowait((choice.index, None))


async def _events(
    choices: Sequence[Choice], writer: ResponseWriter, with_token_ids: bool
) -> AsyncIterator[bytes]:
    # Nothing is sent before the engine's first token: a client timing its first chunk
    # (a load generator's TTFT) must see the first token, not an empty opening.
    queue: asyncio.Queue[_Fed] = asyncio.Queue()
    feeders = [asyncio.ensure_future(_feed(choice, queue)) for choice in choices]
    opened: set[int] = set()
    finished: list[Finished] = []
    try:
        while len(finished) < len(choices):
            index, item = await queue.get()
            choice = choices[index]
            if isinstance(item, Piece):
                ids = item.token_ids if with_token_ids else None
                yield sse_event(
                    writer.text_chunk(
                        index, item.text, first=index not in opened, token_ids=ids,
                        logprobs=choice.logprobs_json(item),
                    )
                )  # fmt: skip
                opened.add(index)
                continue
            if item is not None:
                raise item  # a bug while gathering its pieces
            finish_reason, ended = choice.generation.result()
            if index not in opened and writer.shape.chat:
                yield sse_event(writer.text_chunk(index, "", first=True))  # the assistant's role
            yield sse_event(writer.final_chunk(index, finish_reason))
            finished.append(ended)
    except ApiError as error:
        yield sse_event(error.to_json())
    else:
        if writer.include_usage:
            yield sse_event(writer.usage_chunk(finished))
    finally:
        for feeder in feeders:
            feeder.cancel()
    yield DONE_EVENT


async def collect(
    request: Request, choices: Sequence[Choice], writer: ResponseWriter, *, with_token_ids: bool
) -> Response:
    """The whole answer, or (the client gone before it was done) every choice cancelled."""
    texts: list[list[str]] = [[] for _ in choices]

    async def gather_one(choice: Choice) -> None:
        async for piece in choice.generation.pieces():
            texts[choice.index].append(piece.text)

    async def gather() -> None:
        await asyncio.gather(*(gather_one(choice) for choice in choices))

    gathering = asyncio.ensure_future(gather())
    leaving = asyncio.ensure_future(client_left(request.receive))
    try:
        await asyncio.wait({gathering, leaving}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (gathering, leaving):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        abandon_all(choices)
    if not gathering.done() or gathering.cancelled():
        # Nobody reads this answer; it exists because the ASGI call must return one.
        return ApiError(499, "the client closed the connection", code="client_closed").response()
    gathering.result()  # re-raises what went wrong while gathering
    results: list[ChoiceResult] = []
    finished: list[Finished] = []
    for choice in choices:
        generation = choice.generation
        finish_reason, ended = generation.result()
        logprobs = None
        if choice.logprobs is not None:
            logprobs = choice.logprobs.to_json(generation.logprobs)
        ids = tuple(generation.token_ids) if with_token_ids else None
        results.append(ChoiceResult("".join(texts[choice.index]), finish_reason, ids, logprobs))
        finished.append(ended)
    return JSONResponse(writer.whole(results, finished))
