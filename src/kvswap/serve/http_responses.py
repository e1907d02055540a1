"""The JSON the endpoints answer with: OpenAI's completion and chat shapes, whole or chunked.

    non-streaming                          streaming (one chunk per event)
    -------------                          -------------------------------
    {"id": "cmpl-..." | "chatcmpl-...",    {"id": same for every chunk,
     "object": "text_completion" |          "object": "text_completion" |
               "chat.completion",                     "chat.completion.chunk",
     "created", "model",                    "created", "model",
     "choices": [{"index": 0, "text" |      "choices": [{"index": 0, "text" | "delta",
                  "message", "logprobs",                 "logprobs", "finish_reason"}],
                  "finish_reason"}],        "usage": null   (only with include_usage)}
     "usage": {...}}                       then, with include_usage, one chunk with
                                           "choices": [] and the usage

`usage` is `prompt_tokens`, `completion_tokens`, `total_tokens` and
`prompt_tokens_details.cached_tokens` (prompt tokens whose KV was reused, any
tier), as vLLM reports it. A server without a tokenizer cannot write text: its
choices carry the sampled ids in `token_ids` (vLLM's name) and an empty text.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from kvswap.serve.service import Finished

JsonObject = dict[str, object]


def usage_json(finished: Finished) -> JsonObject:
    return {
        "prompt_tokens": finished.prompt_tokens,
        "completion_tokens": finished.completion_tokens,
        "total_tokens": finished.prompt_tokens + finished.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": finished.cached_tokens},
    }


@dataclass(frozen=True)
class ResponseShape:
    """What differs between the two endpoints' answers."""

    id_prefix: str
    object_name: str
    chunk_object_name: str
    chat: bool

    def choice(
        self, text: str, finish_reason: str, token_ids: tuple[int, ...] | None
    ) -> JsonObject:
        body: JsonObject = {"index": 0}
        if self.chat:
            body["message"] = {"role": "assistant", "content": text}
        else:
            body["text"] = text
        body.update({"logprobs": None, "finish_reason": finish_reason})
        if token_ids is not None:
            body["token_ids"] = list(token_ids)
        return body

    def chunk_choice(
        self, text: str | None, finish_reason: str | None, *, first: bool = False
    ) -> JsonObject:
        """A streamed choice: `text` None sends no content (the closing chunk)."""
        body: JsonObject = {"index": 0}
        if self.chat:
            delta: JsonObject = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            body["delta"] = delta
        else:
            body["text"] = text or ""
        body.update({"logprobs": None, "finish_reason": finish_reason})
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

    def whole(
        self,
        text: str,
        finish_reason: str,
        finished: Finished,
        token_ids: tuple[int, ...] | None = None,
    ) -> JsonObject:
        return {
            **self._head(self.shape.object_name),
            "choices": [self.shape.choice(text, finish_reason, token_ids)],
            "usage": usage_json(finished),
        }

    def chunk(self, choice: JsonObject) -> JsonObject:
        body = {**self._head(self.shape.chunk_object_name), "choices": [choice]}
        if self.include_usage:
            body["usage"] = None  # OpenAI: every chunk has the key; only the last one a value
        return body

    def text_chunk(
        self, text: str, *, first: bool = False, token_ids: tuple[int, ...] | None = None
    ) -> JsonObject:
        choice = self.shape.chunk_choice(text, None, first=first)
        if token_ids is not None:
            choice["token_ids"] = list(token_ids)
        return self.chunk(choice)

    def final_chunk(self, finish_reason: str) -> JsonObject:
        return self.chunk(self.shape.chunk_choice(None, finish_reason))

    def usage_chunk(self, finished: Finished) -> JsonObject:
        return {**self._head(self.shape.chunk_object_name), "choices": [],
                "usage": usage_json(finished)}  # fmt: skip
