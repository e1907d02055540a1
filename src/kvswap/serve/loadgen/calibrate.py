"""Prompt text calibrated to the server's tokenizer, before the replay.

A workload gives lengths in tokens; a remote server counts its own. Two (or three)
streamed requests with `max_tokens` 1 read the server's `usage.prompt_tokens`:

    probe A   one user message (or prompt) of k words                  -> a tokens
    probe B   one message of 2k words (A's words, then k more)          -> b tokens
    probe C   B's 2k words as user / assistant / user messages          -> c tokens
              (chat workloads with several messages per request only)

    tokens per word       s = (b - a) / k
    request overhead      a - k s       (BOS, the template around one message and
                                          the assistant prompt; 0 if negative)
    message overhead      (c - b) / 2   (each further message's wrapper)

The k words of each half are the probe vocabulary's words in a seeded order; at
k = 256 that is every word exactly once, and since prompts draw words uniformly,
s is then the mean over exactly the words prompts use. A probe the server
refuses as too long (HTTP 400 or 413: a small context or GPU tier) is retried at
half the size, down to MIN_PROBE_WORDS. A server that gives no usage, refuses
the probes otherwise, or counts nonsense leaves lengths uncalibrated (1 word per
token), said in one line; the replay runs either way.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

from kvswap.serve.loadgen.client import OpenAIClient, StreamResult
from kvswap.serve.loadgen.prompts import WORDS, Endpoint, TextScale

MAX_PROBE_WORDS = len(WORDS)  # k: every word once per half
MIN_PROBE_WORDS = 32
_TOO_LONG_STATUSES = (400, 413)


@dataclass(frozen=True)
class Calibration:
    """The text scale the replay uses, and how it was found."""

    scale: TextScale
    tokens_per_word: float | None  # None: not measured (uncalibrated)
    probe_requests: int  # requests sent to calibrate, refused ones included
    probe_prompt_tokens: int  # the server's prompt tokens over the probes it answered
    # The server's completion tokens over the probes it answered (max_tokens 1 each):
    # with the replay's figures, every token this run made the server count.
    probe_output_tokens: int
    line: str  # one line for the user

    def to_json(self) -> dict[str, object]:
        return {
            "tokens_per_word": self.tokens_per_word,
            "words_per_token": round(self.scale.words_per_token, 6),
            "request_overhead_tokens": round(self.scale.request_overhead_tokens, 3),
            "message_overhead_tokens": round(self.scale.message_overhead_tokens, 3),
            "probe_requests": self.probe_requests,
            "probe_prompt_tokens": self.probe_prompt_tokens,
            "probe_output_tokens": self.probe_output_tokens,
            "line": self.line,
        }


def uncalibrated(
    reason: str, probe_requests: int = 0, probe_prompt_tokens: int = 0, probe_output_tokens: int = 0
) -> Calibration:
    return Calibration(
        TextScale(),
        None,
        probe_requests,
        probe_prompt_tokens,
        probe_output_tokens,
        f"prompt lengths uncalibrated (about 1 word per token): {reason}",
    )


def probe_words(num_words: int) -> tuple[list[str], list[str]]:
    """The two halves of the probes: `num_words` words each, in seeded orders."""
    rng = random.Random("kvswap loadgen calibration")
    first, second = list(WORDS), list(WORDS)
    rng.shuffle(first)
    rng.shuffle(second)
    return first[:num_words], second[:num_words]


class _Prober:
    def __init__(self, client: OpenAIClient, model: str, endpoint: Endpoint, timeout_s: float):
        self.client, self.model, self.endpoint, self.timeout_s = client, model, endpoint, timeout_s
        self.num_sent = 0
        self.prompt_tokens = 0
        self.output_tokens = 0

    async def send(self, messages: list[str]) -> StreamResult:
        """One probe: `messages` as user / assistant / user ... (one prompt for completions)."""
        fields: dict[str, object]
        if self.endpoint == "completions":
            fields = {"prompt": " ".join(messages)}
        else:
            roles = ("user", "assistant")
            fields = {
                "messages": [
                    {"role": roles[i % 2], "content": text} for i, text in enumerate(messages)
                ]
            }
        body = {
            "model": self.model,
            **fields,
            "max_tokens": 1,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0,
        }
        self.num_sent += 1
        try:
            result = await asyncio.wait_for(self.client.stream(self.endpoint, body), self.timeout_s)
        except asyncio.TimeoutError:
            return StreamResult(error=f"timeout: no answer within --timeout-s {self.timeout_s:g}")
        if result.error is None:
            self.prompt_tokens += result.prompt_tokens or 0
            self.output_tokens += result.completion_tokens or 0
        return result

    def failed(self, reason: str) -> Calibration:
        return uncalibrated(reason, self.num_sent, self.prompt_tokens, self.output_tokens)


async def calibrate(
    client: OpenAIClient,
    model: str,
    endpoint: Endpoint,
    *,
    multi_message: bool,
    timeout_s: float,
) -> Calibration:
    """Probe the server and return the scale that makes sent lengths the intended ones."""
    prober = _Prober(client, model, endpoint, timeout_s)
    num_words = MAX_PROBE_WORDS
    while True:
        first, second = probe_words(num_words)
        longer = await prober.send([" ".join(first + second)])
        if longer.status not in _TOO_LONG_STATUSES or num_words // 2 < MIN_PROBE_WORDS:
            break
        num_words //= 2
    if longer.error is not None:
        return prober.failed(f"the calibration probe failed: {longer.error}")
    shorter = await prober.send([" ".join(first)])
    if shorter.error is not None:
        return prober.failed(f"the calibration probe failed: {shorter.error}")
    a, b = shorter.prompt_tokens, longer.prompt_tokens
    if a is None or b is None:
        return prober.failed("the server reports no usage.prompt_tokens")
    if b <= a:
        return prober.failed(
            f"the server's usage.prompt_tokens did not grow with the prompt ({a}, then {b} "
            f"for {num_words} more words)"
        )
    tokens_per_word = (b - a) / num_words
    request_overhead = max(0.0, a - num_words * tokens_per_word)
    message_overhead = 0.0
    if multi_message and endpoint == "chat":
        half = num_words // 2
        split = await prober.send(
            [" ".join(first), " ".join(second[:half]), " ".join(second[half:])]
        )
        if split.error is not None or split.prompt_tokens is None:
            reason = split.error or "no usage.prompt_tokens"
            return prober.failed(f"the calibration probe of three messages failed: {reason}")
        message_overhead = max(0.0, (split.prompt_tokens - b) / 2)
    scale = TextScale(1 / tokens_per_word, request_overhead, message_overhead)
    per_message = (
        f", {message_overhead:.1f} per further message"
        if multi_message and endpoint == "chat"
        else ""
    )
    line = (
        f"calibrated to the server's tokenizer: {tokens_per_word:.3f} tokens per word, "
        f"{request_overhead:.1f} tokens of template per request{per_message}; prompts go out "
        f"as {scale.words_per_token:.3f} words per intended token ({prober.num_sent} probes)"
    )
    return Calibration(
        scale,
        round(tokens_per_word, 6),
        prober.num_sent,
        prober.prompt_tokens,
        prober.output_tokens,
        line,
    )
