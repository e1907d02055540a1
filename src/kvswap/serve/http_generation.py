"""One request from the HTTP side: its limits checked, submitted, its events turned to text.

    prompt ids + request --plan_generation--> GenerationRequest --service.submit--> handle
    handle.events() --Generation.pieces()--> Piece(text, token ids) ... then result()

A stop string ends the request through `service.stop_early` (its KV stays for
prefix reuse); tokens that still arrive before its Finished are dropped. A client
that leaves ends it through `service.cancel` (`abandon`), unless it had ended.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvswap.serve.detokenize import IncrementalDecoder, StopMatcher
from kvswap.serve.errors import ApiError, from_status_error
from kvswap.serve.service import (
    EngineService,
    Finished,
    FinishReason,
    GenerationRequest,
    RequestHandle,
    ServiceError,
    TokenEvent,
)
from kvswap.serve.text_errors import TextRequestError
from kvswap.serve.tokenizer import TextCodec


@dataclass(frozen=True)
class Sampling:
    """The sampling fields of a request, as both endpoints give them."""

    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    seed: int | None
    cache_salt: str | None


def plan_generation(
    prompt_ids: tuple[int, ...],
    sampling: Sampling,
    service: EngineService,
    *,
    stop_token_ids: frozenset[int],
    vocab_size: int | None,
    max_tokens_field: str = "max_tokens",
) -> GenerationRequest:
    """The request to submit, or an ApiError: an empty prompt or an id outside the
    vocabulary (400), a prompt over the limit (413), no room left for output (400)."""
    num_prompt = len(prompt_ids)
    if num_prompt == 0:
        raise ApiError(400, "prompt: empty; give at least one token", code="invalid_value",
                       param="prompt")  # fmt: skip
    if vocab_size is not None:
        outside = next((t for t in prompt_ids if t >= vocab_size), None)
        if outside is not None:
            raise ApiError(
                400, f"prompt: token id {outside} is outside the vocabulary (0..{vocab_size - 1})",
                code="invalid_value", param="prompt",
            )  # fmt: skip
    if num_prompt > service.max_prompt_tokens:
        raise ApiError(
            413, f"prompt: {num_prompt} tokens; allowed: at most {service.max_prompt_tokens}",
            code="context_length_exceeded", param="prompt",
        )  # fmt: skip
    room = service.max_model_tokens - num_prompt
    max_new = sampling.max_tokens if sampling.max_tokens is not None else room
    if max_new < 1 or max_new > room:
        raise ApiError(
            400,
            f"this model's context is {service.max_model_tokens} tokens; the prompt has "
            f"{num_prompt} and {max_tokens_field} = {max_new} (allowed: 1..{max(room, 0)})",
            code="context_length_exceeded",
            param=max_tokens_field if sampling.max_tokens is not None else "prompt",
        )
    return GenerationRequest(
        prompt_ids=prompt_ids,
        max_new_tokens=max_new,
        temperature=sampling.temperature,
        top_p=sampling.top_p if sampling.top_p is not None else 1.0,
        seed=sampling.seed,
        stop_token_ids=stop_token_ids,
        cache_salt=sampling.cache_salt,
    )


def submit(service: EngineService, request: GenerationRequest) -> RequestHandle:
    try:
        return service.submit(request)
    except ServiceError as error:
        raise from_status_error(error) from None


class OutputText:
    """Sampled ids -> the text to send: decoded incrementally (special tokens, EOS
    included, decode to nothing), cut before the first stop string. Without a codec
    there is no text: every push gives ""."""

    def __init__(self, codec: TextCodec | None, prompt_ids: tuple[int, ...], stop: tuple[str, ...]):
        self.codec = codec
        self._decoder = IncrementalDecoder(codec, prompt_ids) if codec is not None else None
        try:
            self._stop = StopMatcher(stop)
        except TextRequestError as error:
            raise from_status_error(error, param="stop") from None

    def push(self, token_id: int) -> tuple[str, bool]:
        """(text that may be sent now, whether a stop string just matched)."""
        if self._decoder is None:
            return "", False
        piece = self._stop.push(self._decoder.push(token_id))
        return piece.text, piece.stopped

    def finish(self) -> tuple[str, bool]:
        """At the end: the text held back (a partial character, a partial stop string),
        and whether a stop string matched in it."""
        if self._decoder is None:
            return "", False
        piece = self._stop.push(self._decoder.flush())
        if piece.stopped:
            return piece.text, True
        return piece.text + self._stop.flush(), False


@dataclass(frozen=True)
class Piece:
    """Text to send, and the ids it came from (only when there is no text to send them as)."""

    text: str
    token_ids: tuple[int, ...] = ()


class Generation:
    """A submitted request as the endpoint sees it. Iterate `pieces()` once, then
    `result()`; call `abandon()` when the response ends, however it ends."""

    def __init__(self, service: EngineService, handle: RequestHandle, output: OutputText):
        self._service = service
        self._handle = handle
        self._output = output
        self._stopped = False  # a stop string matched: stop_early was called
        self._finished: Finished | None = None
        self._cancelled = False
        self.token_ids: list[int] = []  # sampled ids up to the end (or the stop string)

    async def pieces(self) -> AsyncIterator[Piece]:
        async for event in self._handle.events():
            if isinstance(event, Finished):
                self._finished = event
                break
            if self._stopped:
                continue  # sampled before the engine saw stop_early
            assert isinstance(event, TokenEvent)
            self.token_ids.append(event.token_id)
            text, matched = self._output.push(event.token_id)
            if matched:
                self._stopped = True
                self._service.stop_early(self._handle)
            ids = (event.token_id,) if self._output.codec is None else ()
            if text or ids:
                yield Piece(text, ids)
        if not self._stopped and self._finished is not None:
            tail, self._stopped = self._output.finish()
            if tail:
                yield Piece(tail)

    def result(self) -> tuple[str, Finished]:
        """(finish_reason, Finished) once `pieces()` is exhausted; an ApiError (503) when
        the engine aborted the request (the server is stopping, or it was rejected)."""
        finished = self._finished
        if finished is None:
            raise ApiError(503, "the request ended without a result", code="service_unavailable")
        if self._stopped:
            return "stop", finished
        if finished.reason is FinishReason.ABORT:
            why = finished.error or "aborted by the server"
            raise ApiError(503, f"the request was aborted: {why}", code="request_aborted")
        return finished.reason.value, finished

    @property
    def ended(self) -> bool:
        return self._finished is not None or self._stopped or self._cancelled

    def abandon(self) -> None:
        """The response is over: a request still generating is cancelled (the client left
        or the server is stopping), so its KV is freed instead of kept running."""
        if not self.ended:
            self._cancelled = True
            self._service.cancel(self._handle)
