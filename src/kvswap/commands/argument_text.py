"""Text from the command line or the environment, checked before anything uses it.

Python decodes both with surrogateescape: a byte that is not UTF-8 (`--prompt
$'\\xff'`) becomes a lone surrogate, which no tokenizer, JSON answer or HTTP header
can carry. Text that goes there is refused here in one line naming the byte; a path
is not (it round-trips to the same bytes, whatever they are).
"""

from __future__ import annotations

from kvswap.errors import KvSwapError
from kvswap.serve.text_errors import unicode_problem


def utf8_text(text: str, source: str) -> str:
    """`text` if it is valid UTF-8 text; `source` names the flag or variable it came from."""
    problem = unicode_problem(text)
    if problem is None:
        return text
    try:
        text.encode("utf-8", "surrogateescape").decode("utf-8")
    except UnicodeEncodeError:  # a surrogate no undecodable byte became
        pass
    except UnicodeDecodeError as error:
        byte = error.object[error.start]
        raise KvSwapError(
            f"{source}: not valid UTF-8 (byte 0x{byte:02x} at byte {error.start}); "
            "allowed: UTF-8 text"
        ) from None
    raise KvSwapError(f"{source}: {problem}")


def api_key_text(key: str, source: str) -> str:
    """`key` if an HTTP client can send it: a bearer token travels in a header, where
    clients (httpx, so the openai client) take printable ASCII only."""
    utf8_text(key, source)
    for index, char in enumerate(key):
        if not (char.isascii() and char.isprintable()):
            raise KvSwapError(
                f"{source}: character {char!r} at {index} cannot be sent in an HTTP header; "
                "allowed: printable ASCII characters"
            )
    return key
