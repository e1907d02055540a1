"""Logprobs as the two endpoints write them: the OpenAI API's shapes, filled as vLLM fills them.

    chat         {"content": [{"token": " the", "logprob": -0.31, "bytes": [32, 116, 104, 101],
                               "top_logprobs": [{"token", "logprob", "bytes"}, ...]}],
                  "refusal": null}
                 top_logprobs: the k most likely tokens, most likely first
    completions  {"tokens": [" the", ...], "token_logprobs": [-0.31, ...],
                  "top_logprobs": [{" the": -0.31, " a": -1.6, ...}, ...],
                  "text_offset": [0, 4, ...]}
                 top_logprobs: the k most likely and the sampled token ("up to
                 logprobs + 1" entries, as the API says; ids whose texts are equal
                 share one key, the sampled token's value kept); text_offset: where each
                 token's text starts, counted over the tokens' texts as vLLM counts

A token's text is its id decoded alone, special tokens included (vLLM's
`tokenizer.decode(id)`): a byte that is only part of a character decodes to
U+FFFD, and `bytes` is that text's UTF-8, as in vLLM. Without a tokenizer a token is
written `token_id:<id>` (vLLM's `return_tokens_as_token_ids` form). The values
themselves come from the sampler (`kvswap.sampling.TokenLogprobs`).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvswap.sampling import TokenLogprobs
from kvswap.serve.tokenizer import TextCodec

JsonObject = dict[str, object]


class LogprobsWriter:
    """One choice's logprobs, chunk after chunk (completions' text offsets carry over)."""

    def __init__(self, codec: TextCodec | None, *, chat: bool):
        self._codec = codec
        self._chat = chat
        self._text_offset = 0

    def token_text(self, token_id: int) -> str:
        if self._codec is None:
            return f"token_id:{token_id}"
        return self._codec.decode([token_id], skip_special_tokens=False)

    def to_json(self, logprobs: Sequence[TokenLogprobs]) -> JsonObject:
        return self._chat_json(logprobs) if self._chat else self._completion_json(logprobs)

    def _entry(self, token_id: int, logprob: float) -> JsonObject:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob,
                "bytes": list(text.encode("utf-8", errors="replace"))}  # fmt: skip

    def _chat_json(self, logprobs: Sequence[TokenLogprobs]) -> JsonObject:
        content = [
            {**self._entry(item.token_id, item.logprob),
             "top_logprobs": [self._entry(token, value) for token, value in item.top]}
            for item in logprobs
        ]  # fmt: skip
        return {"content": content, "refusal": None}

    def _completion_json(self, logprobs: Sequence[TokenLogprobs]) -> JsonObject:
        tokens: list[str] = []
        offsets: list[int] = []
        tops: list[dict[str, float]] = []
        for item in logprobs:
            text = self.token_text(item.token_id)
            tokens.append(text)
            offsets.append(self._text_offset)
            self._text_offset += len(text)
            top = {self.token_text(token): value for token, value in item.top}
            # Set last: where two ids decode to the same text (bytes of one character,
            # both U+FFFD), the entry under the sampled token's text is the sampled one.
            top[text] = item.logprob
            tops.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": [item.logprob for item in logprobs],
            "top_logprobs": tops,
            "text_offset": offsets,
        }
