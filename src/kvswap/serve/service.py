"""What the HTTP app needs from the engine behind it, and nothing more.

    HTTP event loop (starlette)                 engine thread (continuous batching)
    ---------------------------                 -----------------------------------
    service.submit(GenerationRequest) -> handle ----> queued, admitted at the next step
    async for event in handle.events():   <---------- TokenEvent per sampled token,
                                                      then one Finished
    service.stop_early(handle)   (a stop string matched; KV kept for prefix reuse)
    service.cancel(handle)       (client gone; its KV is freed on every tier)

`submit` never blocks on compute: it checks limits and enqueues. Token events
are delivered on the event loop that called `submit`.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvswap.errors import KvSwapError
from kvswap.sampling import LogitsOptions, TokenLogprobs


class FinishReason(enum.Enum):
    STOP = "stop"  # an end-of-sequence token or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # cancelled, rejected, or the server is stopping


@dataclass(frozen=True)
class GenerationRequest:
    """One sequence to generate (a request with `n` choices is `n` of these). Sampling
    values are checked by the service against `kvswap.sampling`'s rule."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float | None = None  # None or 0: greedy
    top_p: float = 1.0
    seed: int | None = None  # None: the service draws one
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    cache_salt: str | None = None
    top_k: int | None = None  # None: no top-k
    options: LogitsOptions | None = None  # penalties, logit_bias, min_tokens, logprobs


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    logprobs: TokenLogprobs | None = None  # when the request's options ask for them


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV was reused (any tier)
    completion_tokens: int
    error: str | None = None  # why, when the engine rejected or aborted it


class ServiceError(KvSwapError):
    """A request the service refuses; `status` is the HTTP status to answer with."""

    status = 503
    code = "service_unavailable"

    def __init__(self, message: str, *, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class InvalidRequest(ServiceError):
    status = 400
    code = "invalid_request_error"


class PromptTooLong(ServiceError):
    status = 413
    code = "context_length_exceeded"


class QueueFull(ServiceError):
    status = 429
    code = "too_many_requests"


class ServiceStopping(ServiceError):
    status = 503
    code = "service_unavailable"


class RequestHandle(ABC):
    request_id: int

    @abstractmethod
    def events(self) -> AsyncIterator[TokenEvent | Finished]:
        """Each sampled token in order, then exactly one Finished."""


class EngineService(ABC):
    """The engine as the HTTP app sees it."""

    model_id: str
    max_model_tokens: int  # prompt + max_tokens must fit
    max_prompt_tokens: int

    @abstractmethod
    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; raises PromptTooLong, QueueFull or ServiceStopping."""

    @abstractmethod
    def stop_early(self, handle: RequestHandle) -> None:
        """End a request now as finished (reason STOP); its KV stays for prefix reuse."""

    @abstractmethod
    def cancel(self, handle: RequestHandle) -> None:
        """Abort a request (the client left); its KV is freed on every tier."""

    @abstractmethod
    def metrics_text(self) -> tuple[bytes, str]:
        """The Prometheus exposition and its content type."""

    @abstractmethod
    def healthy(self) -> bool:
        """False once the engine thread has died or the service is stopping."""

    @abstractmethod
    def close(self, timeout_s: float) -> None:
        """Stop accepting; finish or abort in-flight requests within `timeout_s`;
        release every pool (the NVMe slab is removed)."""
