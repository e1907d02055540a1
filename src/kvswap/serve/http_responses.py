"""The JSON the endpoints answer with: OpenAI's completion and chat shapes, whole or chunked.

    non-streaming                          streaming (one chunk per event)
    -------------                          -------------------------------
    {"id": "cmpl-..." | "chatcmpl-...",    {"id": same for every chunk,
     "object": "text_completion" |          "object": "text_completion" |
               "chat.completion",                     "chat.completion.chunk",
     "created", "model",                    "created", "model",
     "choices": [{"index": i, "text" |      "choices": [{"index": i, "text" | "delta",
                  "message", "logprobs",                 "logprobs", "finish_reason"}],
                  "finish_reason"}, ...],   "usage": null   (only with include_usage)}
     "usage": {...}}                       then, with include_usage, one chunk with
                                           "choices": [] and the usage

With `n` choices the answer has n choices, indexed 0..n-1; streamed, each chunk
carries one choice's piece under its index (chat: each choice's first chunk has the
assistant role), and each choice closes with its own finish_reason chunk.

`usage` is `prompt_tokens` (the prompt, once), `completion_tokens` (summed over
the choices), `total_tokens` and `prompt_tokens_details.cached_tokens` (prompt
tokens whose KV was reused, any tier: the fewest any choice reused), as vLLM
reports it. A server without a tokenizer cannot write text: its choices carry the
sampled ids in `token_ids` (vLLM's name) and an empty text. `logprobs` is null
unless asked for (its shapes: kvswap.serve.http_logprobs).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from kvswap.serve.service import Finished

JsonObject = dict[str, object]


def usage_json(finished: Sequence[Finished]) -> JsonObject:
    """The usage of a request whose choices ended as `finished` (one Finished each)."""
    prompt_tokens = finished[0].prompt_tokens
    completion_tokens = sum(item.completion_tokens for item in finished)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": min(item.cached_tokens for item in finished)},
    }


@dataclass(frozen=True)
class ChoiceResult:
    """One choice of a whole answer."""

    text: str
    finish_reason: str
    token_ids: tuple[int, ...] | None = None  # only without a tokenizer
    logprobs: JsonObject | None = None  # only when asked for


@dataclass(frozen=True)
class ResponseShape:
    """What differs between the two endpoints' answers."""

    id_prefix: str
    object_name: str
    chunk_object_name: str
    chat: bool

    def choice(self, index: int, result: ChoiceResult) -> JsonObject:
        body: JsonObject = {"index": index}
        if self.chat:
            body["message"] = {"role": "assistant", "content": result.text}
        else:
            body["text"] = result.text
        body.update({"logprobs": result.logprobs, "finish_reason": result.finish_reason})
        if result.token_ids is not None:
            body["token_ids"] = list(result.token_ids)
        return body

    def chunk_choice(
        self,
        index: int,
        text: str | None,
        finish_reason: str | None,
        *,
        first: bool = False,
        logprobs: JsonObject | None = None,
    ) -> JsonObject:
        """A streamed choice: `text` None sends no content (the closing chunk)."""
        body: JsonObject = {"index": index}
        if self.chat:
            delta: JsonObject = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            body["delta"] = delta
        else:
            body["text"] = text or ""
        body.update({"logprobs": logprobs, "finish_reason": finish_reason})
        return body


COMPLETION_SHAPE = ResponseShape("cmpl-", "text_completion", "text_completion", chat=False)
CHAT_SHAPE = ResponseShape("chatcmpl-", "chat.completion", "chat.completion.chunk", chat=True)


class ResponseWriter:
    """The id, time and model every object of one response shares, and their builders."""

    def __init__(self, shape: ResponseShape, model: str, *, include_usage: bool = False):
        self.shape = shape
        self.id = shape.id_prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage

    def _head(self, object_name: str) -> JsonObject:
        return {"id": self.id, "object": object_name, "created": self.created,
                "model": self.model}  # fmt: skip

    def whole(self, results: Sequence[ChoiceResult], finished: Sequence[Finished]) -> JsonObject:
        return {
            **self._head(self.shape.object_name),
            "choices": [self.shape.choice(index, result) for index, result in enumerate(results)],
            "usage": usage_json(finished),
        }

    def chunk(self, choice: JsonObject) -> JsonObject:
        body = {**self._head(self.shape.chunk_object_name), "choices": [choice]}
        if self.include_usage:
            body["usage"] = None  # OpenAI: every chunk has the key; only the last one a value
        return body

    def text_chunk(
        self,
        index: int,
        text: str,
        *,
        first: bool = False,
        token_ids: tuple[int, ...] | None = None,
        logprobs: JsonObject | None = None,
    ) -> JsonObject:
        choice = self.shape.chunk_choice(index, text, None, first=first, logprobs=logprobs)
        if token_ids is not None:
            choice["token_ids"] = list(token_ids)
        return self.chunk(choice)

    def final_chunk(self, index: int, finish_reason: str) -> JsonObject:
        return self.chunk(self.shape.chunk_choice(index, None, finish_reason))

    def usage_chunk(self, finished: Sequence[Finished]) -> JsonObject:
        return {**self._head(self.shape.chunk_object_name), "choices": [],
                "usage": usage_json(finished)}  # fmt: skip
