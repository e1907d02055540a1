"""One request from the HTTP side: its limits checked, submitted, its events turned to text.

    prompt ids + RequestSampling --plan_generation--> GenerationRequest
        --choice_requests--> one per choice (n) --submit_all--> handles
    handle.events() --Generation.pieces()--> Piece(text, token ids, logprobs) ... result()

A stop string ends the request through `service.stop_early` (its KV stays for
prefix reuse); tokens that still arrive before its Finished are dropped, and its
usage counts the tokens up to the one that completed the stop string (what the
client got). A client that leaves ends it through `service.cancel` (`abandon`),
unless it had ended.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from kvswap.errors import KvSwapError
from kvswap.sampling import TokenLogprobs, choice_seed, logits_options_or_none
from kvswap.serve.detokenize import IncrementalDecoder, StopMatcher
from kvswap.serve.errors import ApiError, from_status_error
from kvswap.serve.protocol import RequestSampling
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

#: The most logprob values (sampled and alternatives: n x tokens x (1 + top)) one request
#: may ask for. Each costs about 500 bytes of memory until the response is written (chat's
#: JSON, measured on the fake engine) and 10 to 50 bytes of body: at the bound ~130 MB and
#: 13 MB at most, where `n: 128, max_tokens: 2000, logprobs: 20` would be 5.4 M values.
MAX_RESPONSE_LOGPROBS = 2**18


def plan_generation(
    prompt_ids: tuple[int, ...],
    sampling: RequestSampling,
    service: EngineService,
    *,
    stop_token_ids: frozenset[int],
    vocab_size: int | None,
    max_tokens_field: str = "max_tokens",
    logprobs_field: str = "logprobs",
) -> GenerationRequest:
    """The request to submit (its first choice), or an ApiError: an empty prompt or an id
    outside the vocabulary (400), a prompt over the limit (413), no room left for output
    or `min_tokens` past it (400), logprobs past MAX_RESPONSE_LOGPROBS (400). The body's
    logit_bias ids were checked against the vocabulary as it was parsed."""
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
    max_new = _max_new_tokens(sampling, room)
    if max_new < 1 or max_new > room:
        raise ApiError(
            400,
            f"this model's context is {service.max_model_tokens} tokens; the prompt has "
            f"{num_prompt} and {max_tokens_field} = {max_new} (allowed: 1..{max(room, 0)})",
            code="context_length_exceeded",
            param=max_tokens_field if sampling.max_tokens is not None else "prompt",
        )
    _check_logprobs_bound(sampling, max_new, max_tokens_field, logprobs_field)
    if sampling.min_tokens > max_new:
        raise ApiError(
            400, f"min_tokens = {sampling.min_tokens}: allowed: at most {max_tokens_field} "
            f"({max_new} for this request)", code="invalid_value", param="min_tokens",
        )  # fmt: skip
    try:
        options = logits_options_or_none(
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            repetition_penalty=sampling.repetition_penalty,
            logit_bias=sampling.logit_bias,
            min_tokens=sampling.min_tokens,
            num_logprobs=sampling.num_logprobs,
        )
    except KvSwapError as error:  # the body's checks are the same rule: a bug if reached
        raise ApiError(400, str(error), code="invalid_value") from None
    return GenerationRequest(
        prompt_ids=prompt_ids,
        max_new_tokens=max_new,
        temperature=sampling.temperature,
        top_p=sampling.top_p if sampling.top_p is not None else 1.0,
        seed=sampling.seed,
        stop_token_ids=stop_token_ids,
        cache_salt=sampling.cache_salt,
        top_k=sampling.top_k,
        options=options,
    )


def _check_logprobs_bound(
    sampling: RequestSampling, max_new: int, max_tokens_field: str, logprobs_field: str
) -> None:
    """Refuse (400) a request whose logprobs would pass MAX_RESPONSE_LOGPROBS values: each
    choice's every token holds them until its response is written."""
    if sampling.num_logprobs is None:
        return
    num_values = sampling.n * max_new * (1 + sampling.num_logprobs)
    if num_values > MAX_RESPONSE_LOGPROBS:
        raise ApiError(
            400, f"n x {max_tokens_field} x (1 + {logprobs_field}) = {sampling.n} x {max_new} x "
            f"{1 + sampling.num_logprobs} = {num_values:,} logprobs; allowed: at most "
            f"{MAX_RESPONSE_LOGPROBS:,} per request: ask for fewer choices, tokens or "
            f"{logprobs_field}", code="invalid_value", param=logprobs_field,
        )  # fmt: skip


def _max_new_tokens(sampling: RequestSampling, room: int) -> int:
    """`max_tokens` as asked; absent, the endpoint's default within the room left (as vLLM
    clamps it), or the whole room."""
    if sampling.max_tokens is not None:
        return sampling.max_tokens
    if sampling.default_max_tokens is not None:
        return min(sampling.default_max_tokens, room)
    return room


def choice_requests(request: GenerationRequest, n: int) -> list[GenerationRequest]:
    """The `n` sequences of a request with `n` choices: the same request, each choice
    drawn with its own seed (`choice_seed`; choice 0 keeps the request's). Without a
    seed the service draws one per choice."""
    if request.seed is None:
        return [request] * n
    return [
        dataclasses.replace(request, seed=choice_seed(request.seed, index)) for index in range(n)
    ]


def submit_all(
    service: EngineService, requests: Sequence[GenerationRequest]
) -> list[RequestHandle]:
    """Every choice submitted, or none: a refusal (a full queue, say) cancels the choices
    already queued before it is raised."""
    handles: list[RequestHandle] = []
    try:
        for request in requests:
            handles.append(submit(service, request))
    except BaseException:
        for handle in handles:
            service.cancel(handle)
        raise
    return handles


def submit(service: EngineService, request: GenerationRequest) -> RequestHandle:
    try:
        return service.submit(request)
    except ServiceError as error:
        raise from_status_error(error) from None


class OutputText:
    """Sampled ids -> the text to send: decoded incrementally (special tokens, EOS
    included, decode to nothing), cut before the first stop string. A stop string is
    looked for only in text decoded from token `min_tokens` on (vLLM checks none before).
    Without a codec there is no text: every push gives ""."""

    def __init__(
        self,
        codec: TextCodec | None,
        prompt_ids: tuple[int, ...],
        stop: tuple[str, ...],
        *,
        min_tokens: int = 0,
    ):
        self.codec = codec
        self._decoder = IncrementalDecoder(codec, prompt_ids) if codec is not None else None
        self._min_tokens = min_tokens
        self._num_tokens = 0
        try:
            self._stop = StopMatcher(stop)
        except TextRequestError as error:
            raise from_status_error(error, param="stop") from None

    def push(self, token_id: int) -> tuple[str, bool]:
        """(text that may be sent now, whether a stop string just matched)."""
        if self._decoder is None:
            return "", False
        self._num_tokens += 1
        text = self._decoder.push(token_id)
        if self._num_tokens < self._min_tokens:
            return text, False
        piece = self._stop.push(text)
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
    """Text to send, the ids it came from (only when there is no text to send them as),
    and the logprobs of the tokens sampled since the last piece (when asked for)."""

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprobs, ...] = ()


class Generation:
    """A submitted request (one choice) as the endpoint sees it. Iterate `pieces()` once,
    then `result()`; call `abandon()` when the response ends, however it ends."""

    def __init__(self, service: EngineService, handle: RequestHandle, output: OutputText):
        self._service = service
        self._handle = handle
        self._output = output
        self._stopped = False  # a stop string matched: stop_early was called
        self._finished: Finished | None = None
        self._cancelled = False
        self.token_ids: list[int] = []  # sampled ids up to the end (or the stop string)
        self.logprobs: list[TokenLogprobs] = []  # theirs, when the request asked

    async def pieces(self) -> AsyncIterator[Piece]:
        unsent: list[TokenLogprobs] = []  # logprobs of tokens whose text is held back
        async for event in self._handle.events():
            if isinstance(event, Finished):
                self._finished = event
                break
            if self._stopped:
                continue  # sampled before the engine saw stop_early
            assert isinstance(event, TokenEvent)
            self.token_ids.append(event.token_id)
            if event.logprobs is not None:
                self.logprobs.append(event.logprobs)
                unsent.append(event.logprobs)
            text, matched = self._output.push(event.token_id)
            if matched:
                self._stopped = True
                self._service.stop_early(self._handle)
            ids = (event.token_id,) if self._output.codec is None else ()
            if text or ids:
                yield Piece(text, ids, tuple(unsent))
                unsent.clear()
        tail = ""
        if not self._stopped and self._finished is not None:
            tail, self._stopped = self._output.finish()
        if tail or unsent:
            yield Piece(tail, (), tuple(unsent))

    def result(self) -> tuple[str, Finished]:
        """(finish_reason, Finished) once `pieces()` is exhausted; an ApiError (503) when
        the engine aborted the request (the server is stopping, or it was rejected).
        After a stop string, `completion_tokens` counts the tokens up to the one that
        completed it: those the client got, not those sampled before the engine heard."""
        finished = self._finished
        if finished is None:
            raise ApiError(503, "the request ended without a result", code="service_unavailable")
        if self._stopped:
            return "stop", dataclasses.replace(finished, completion_tokens=len(self.token_ids))
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
