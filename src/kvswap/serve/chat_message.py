"""One chat turn of /v1/chat/completions, as the OpenAI API sends it, validated by pydantic.

    {"role": "user", "content": "Hi", "name": "ann"}
    {"role": "system", "content": [{"type": "text", "text": "Be kind."}]}

Roles are CHAT_ROLES; `tool` and `function` are refused by name (they answer tool
calls, which this server never makes). Content is text only, valid Unicode.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from kvswap.serve.body_errors import invalid, unsupported, valid_text
from kvswap.serve.chat_template import CONTENT_PART_SEPARATOR

#: The chat roles a text model takes (OpenAI's, less `tool` and `function`, which
#: answer tool calls this server never makes).
CHAT_ROLES = ("system", "developer", "user", "assistant")


class StrictBody(BaseModel):
    """A request body or a part of one: unknown fields refused, types strict, frozen."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ChatMessage(StrictBody):
    """One chat turn: `role` (one of CHAT_ROLES), `content` (a string or text parts,
    joined with a newline as vLLM joins them), `name`. Fields whose value is null are
    dropped first, as transformers drops them (clients echo `"tool_calls": null` back in
    assistant turns); `content` is then required, as the OpenAI API requires it of every
    message without tool calls."""

    role: str
    content: str
    name: str | None = None

    @field_validator("role", mode="after")
    @classmethod
    def _role(cls, value: str) -> str:
        if value in CHAT_ROLES:
            return value
        if value in ("tool", "function"):
            raise unsupported(
                f"{value!r} messages answer tool calls, which this server never makes"
            )
        raise invalid(f"allowed: {', '.join(CHAT_ROLES)}")

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {key: item for key, item in value.items() if item is not None}
        return value

    @field_validator("name", mode="after")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        return None if value is None else valid_text(value)

    @field_validator("content", mode="plain")
    @classmethod
    def _content(cls, value: Any) -> str:
        """A string, or a list of text parts: the only content a text model reads."""
        if isinstance(value, str):
            return valid_text(value)
        if not isinstance(value, list):
            raise invalid("expected a string or a list of {type: text, text} parts")
        texts: list[str] = []
        for index, part in enumerate(value):
            if not isinstance(part, dict):
                raise invalid(f"part {index}: expected {{type: text, text: string}}")
            kind = part.get("type")
            if kind is not None and kind != "text":
                raise unsupported(f"part {index} has type {kind!r}: only text parts are read")
            if set(part) != {"type", "text"} or not isinstance(part["text"], str):
                raise invalid(f"part {index}: expected {{type: text, text: string}}")
            texts.append(valid_text(part["text"]))
        return CONTENT_PART_SEPARATOR.join(texts)

    def to_template(self) -> dict[str, str]:
        """The message as a chat template reads it."""
        message = {"role": self.role, "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        return message
