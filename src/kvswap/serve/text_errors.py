"""The errors text handling raises for a request, and the one-line rule for messages.

A `TextRequestError` is the client's mistake (bad messages, bad `stop`, a chat template
that refused the conversation, text sent to a model without a tokenizer): the HTTP app
answers it with `status` and `code`, as it does a `ServiceError`. Problems with the
model's own files are plain `KvSwapError`s, raised once when the text is loaded.
"""

from __future__ import annotations

import re

from kvswap.errors import KvSwapError

#: Longest message text quoted from a template or a library; the rest is cut with "...".
MAX_QUOTED_CHARS = 300
#: A UTF-16 surrogate code point. JSON's escapes decode a high-low pair to one character,
#: so one left in a str is lone: no UTF-8 encodes it, no tokenizer or hash takes it.
_SURROGATE = re.compile("[\ud800-\udfff]")


class TextRequestError(KvSwapError):
    """A request's text input is invalid; `status` is the HTTP status to answer with."""

    status = 400
    code = "invalid_request_error"


class NoTokenizerError(TextRequestError):
    """Text (not token ids) was sent to a model directory that has no tokenizer.json."""

    def __init__(self, directory: str):
        super().__init__(
            f"model directory {directory} has no tokenizer.json, so text prompts and chat "
            "messages cannot be tokenized; give the prompt as token ids (a list of integers)"
        )


def one_line(text: str, max_chars: int = MAX_QUOTED_CHARS) -> str:
    """`text` with every run of whitespace (line breaks included) made one space, cut to
    `max_chars`: a template's or a library's message quoted inside a one-line error."""
    flat = " ".join(text.split())
    return flat if len(flat) <= max_chars else flat[: max_chars - 3] + "..."


def unicode_problem(text: str) -> str | None:
    """Why `text` is not valid Unicode (its first lone surrogate, where), or None."""
    found = _SURROGATE.search(text)
    if found is None:
        return None
    return (
        f"a lone surrogate (U+{ord(found.group()):04X}) at character {found.start()} is not "
        "valid Unicode; allowed: text whose \\uD800-\\uDFFF escapes come in high-low pairs"
    )


def json_type_name(value: object) -> str:
    """The JSON name of a parsed value's type, for messages about request bodies."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
