"""Streaming text out: token ids -> text pieces, and stop strings over those pieces.

    decoder = IncrementalDecoder(codec, prompt_ids)     stop = StopMatcher(parse_stop(body))
    for each sampled token:
        piece = stop.push(decoder.push(token_id))
        send piece.text; if piece.stopped: service.stop_early(handle); done
    at Finished: send stop.push(decoder.flush()).text, then stop.flush()

`IncrementalDecoder` never returns part of a character. A byte-level BPE may split one
character's UTF-8 bytes over several tokens; decoding such a prefix gives U+FFFD at the
end, so text is held back while the decoded window ends in U+FFFD. A character has at
most 4 bytes and every text token at least 1, so a window still ending in U+FFFD after
`MAX_HELD_TOKENS` tokens holds bytes that are not UTF-8 at all (a model emitting stray
bytes): it is released as U+FFFD, as a whole-sequence decode would show it, and decoding
restarts from there. Each step decodes two short windows (tokens since the last piece
plus a little context), never the whole sequence, and a few prompt tokens are the first
context, since a token's leading space can depend on what precedes it (SentencePiece).

`StopMatcher` holds back text that could be the start of a stop string, so a stop string
split over tokens is still found; on a match it returns the text before it and reports
the match (the OpenAI API leaves the stop string out of the output).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvswap.serve.text_errors import TextRequestError, json_type_name

__all__ = [
    "MAX_STOP_STRINGS",
    "IncrementalDecoder",
    "StopMatcher",
    "StopPiece",
    "parse_stop",
]

MAX_STOP_STRINGS = 4  # the OpenAI API's limit
#: Tokens a window may hold back waiting for the rest of a character (> 4 bytes' worth).
MAX_HELD_TOKENS = 8
#: Prompt tokens decoded as context before the first generated token.
NUM_CONTEXT_TOKENS = 4
_REPLACEMENT = "\ufffd"


class Decodes(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDecoder:
    """One request's generated ids -> new text, a piece per `push`.

    Window invariant: `_ids[:_read]` is decoded and its text (beyond the context) already
    returned; `_ids[_read:]` is held back; `_ids[0]` starts the decoding window.
    """

    def __init__(
        self, codec: Decodes, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True
    ):
        self._codec = codec
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-NUM_CONTEXT_TOKENS:]) if prompt_ids else []
        self._read = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._codec.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def push(self, token_id: int) -> str:
        """The text `token_id` completes: "" while a character is still incomplete."""
        self._ids.append(token_id)
        return self._emit(force=False)

    def flush(self) -> str:
        """At the end of the generation: the held-back text (incomplete bytes as U+FFFD)."""
        return self._emit(force=True)

    def _emit(self, force: bool) -> str:
        if self._read == len(self._ids):
            return ""
        done_text = self._decode(self._ids[: self._read])
        window_text = self._decode(self._ids)
        held_tokens = len(self._ids) - self._read
        incomplete = window_text.endswith(_REPLACEMENT)
        if incomplete and held_tokens < MAX_HELD_TOKENS and not force:
            return ""
        if len(window_text) <= len(done_text) and not force and held_tokens < MAX_HELD_TOKENS:
            return ""  # e.g. a skipped special token: nothing new to show yet
        piece = window_text[len(done_text) :]
        if incomplete:
            # Released bytes that never formed a character: no context carries over,
            # so a later byte is not read as the end of this one.
            self._ids = []
        else:
            # The tokens just decoded are the next window's context.
            self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        return piece


def parse_stop(value: object) -> tuple[str, ...]:
    """The OpenAI `stop` field: null, a string, or a list of at most 4 non-empty strings."""
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list):
        raise TextRequestError(
            f"stop is {json_type_name(value)}; expected a string or a list of at most "
            f"{MAX_STOP_STRINGS} strings"
        )
    return _checked_stops(stops)


def _checked_stops(stops: Sequence[object]) -> tuple[str, ...]:
    if len(stops) > MAX_STOP_STRINGS:
        raise TextRequestError(
            f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed"
        )
    for index, stop in enumerate(stops):
        if not isinstance(stop, str):
            raise TextRequestError(f"stop[{index}] is {json_type_name(stop)}; expected a string")
        if not stop:
            raise TextRequestError(f"stop[{index}] is empty; stop strings must be non-empty")
    return tuple(str(stop) for stop in stops)


@dataclass(frozen=True)
class StopPiece:
    """What may be sent now. When `stopped`, `text` ends just before the stop string and
    nothing more is to be sent."""

    text: str
    stopped: bool = False


class StopMatcher:
    """Finds the first stop string in a stream of text pieces.

    Invariant: the held-back text is the longest tail of everything pushed that is a
    proper prefix of some stop string; a match can only start inside it or later, so no
    text that was returned can belong to a match.
    """

    def __init__(self, stop: Sequence[str]):
        self._stops = _checked_stops(stop)
        self._held = ""
        self._stopped = False

    def push(self, text: str) -> StopPiece:
        if self._stopped:
            return StopPiece("", stopped=True)
        if not self._stops:
            return StopPiece(text)
        buffer = self._held + text
        found = [i for i in (buffer.find(s) for s in self._stops) if i >= 0]
        if found:
            self._stopped = True
            self._held = ""
            return StopPiece(buffer[: min(found)], stopped=True)
        keep = self._held_length(buffer)
        self._held = buffer[len(buffer) - keep :]
        return StopPiece(buffer[: len(buffer) - keep])

    def flush(self) -> str:
        """At the end of a generation no stop string ended: the held-back text."""
        held, self._held = self._held, ""
        return "" if self._stopped else held

    def _held_length(self, buffer: str) -> int:
        longest = min(len(buffer), max(len(s) for s in self._stops) - 1)
        for length in range(longest, 0, -1):
            tail = buffer[-length:]
            if any(len(s) > length and s.startswith(tail) for s in self._stops):
                return length
        return 0
