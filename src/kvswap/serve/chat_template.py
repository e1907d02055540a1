"""Chat messages -> prompt text, by the model's jinja chat template, rendered as
transformers renders it (so a prompt is the one the model was trained on).

The environment is the one `transformers.utils.chat_template_utils` builds: jinja's
`ImmutableSandboxedEnvironment` (a template from a checkpoint is untrusted code: no
attribute starting with "_", no mutation of the messages), `trim_blocks` and
`lstrip_blocks` on, the `loopcontrols` extension (`{% break %}`), a `tojson` filter that
does not HTML-escape, and the globals `raise_exception(message)` (how templates refuse a
conversation) and `strftime_now(format)`. The variables are `messages`,
`add_generation_prompt`, `tools` and `documents` (None: kvswap serves neither), and the
named special tokens (`bos_token`, `eos_token`, ...).

Messages are validated before rendering (`validate_messages`), to the subset of the
OpenAI chat format a text model can take: `role` and `content`, where `content` is a
string or a list of `{"type": "text", "text": ...}` parts, joined with "\\n" as vLLM
joins them; `name` is passed through. Keys whose value is null are dropped first, as
transformers drops them (clients echo `"tool_calls": null` back in assistant turns).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvswap.errors import KvSwapError
from kvswap.serve.text_errors import TextRequestError, json_type_name, one_line

__all__ = ["ChatTemplate", "validate_messages"]

_MESSAGE_FIELDS = ("role", "content", "name")
#: How text parts of one message's content are joined into the template's string.
CONTENT_PART_SEPARATOR = "\n"


class _Refusal(jinja2.TemplateError):
    """What `raise_exception` raises: the template's own verdict on the conversation."""


def _raise_exception(message: str) -> None:
    raise _Refusal(message)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML; a prompt wants the plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(date_format: str) -> str:
    return datetime.now().strftime(date_format)


def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


class ChatTemplate:
    """One compiled chat template. `where` names its file in every error."""

    def __init__(self, source: str, where: str):
        self.source = source
        self.where = where
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as error:
            raise KvSwapError(
                f"the chat template in {where} is not valid jinja (line {error.lineno}: "
                f"{one_line(error.message or 'syntax error')})"
            ) from None

    def render(
        self,
        messages: object,
        *,
        add_generation_prompt: bool,
        special_tokens: Mapping[str, str],
    ) -> str:
        """The prompt text for `messages` (validated here); a TextRequestError when the
        messages are malformed or the template refuses or fails on them."""
        checked = validate_messages(messages)
        try:
            return self._template.render(
                messages=checked,
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **special_tokens,
            )
        except _Refusal as error:
            reason = one_line(error.message or "no reason given")
            raise TextRequestError(f"the chat template refused the messages: {reason}") from None
        except Exception as error:  # undefined names, the sandbox, any Python error: a
            # template is untrusted code, and its failure is reported, never raised on
            reason = one_line(f"{type(error).__name__}: {error}")
            raise TextRequestError(f"the chat template failed on the messages: {reason}") from None


def _content_text(content: object, index: int) -> str:
    if isinstance(content, str):
        return content
    where = f"messages[{index}].content"
    if not isinstance(content, list):
        raise TextRequestError(
            f"{where} is {json_type_name(content)}; expected a string or a list of "
            '{"type": "text", "text": ...} parts'
        )
    texts: list[str] = []
    for part_index, part in enumerate(content):
        at = f"{where}[{part_index}]"
        if not isinstance(part, dict):
            raise TextRequestError(
                f'{at} is {json_type_name(part)}; expected {{"type": "text", "text": ...}}'
            )
        kind = part.get("type")
        if kind != "text":
            raise TextRequestError(f"{at}.type is {kind!r}; only 'text' parts are supported")
        text = part.get("text")
        if not isinstance(text, str):
            raise TextRequestError(f"{at}.text is {json_type_name(text)}; expected a string")
        texts.append(text)
    return CONTENT_PART_SEPARATOR.join(texts)


def validate_messages(messages: object) -> list[dict[str, str]]:
    """`messages` as the template sees them: a list of {"role", "content"[, "name"]}
    string dicts. A one-line TextRequestError names the message and the field."""
    if not isinstance(messages, list | tuple) or not messages:
        shown = "an empty list" if isinstance(messages, list | tuple) else json_type_name(messages)
        raise TextRequestError(
            f'messages is {shown}; expected a non-empty list of {{"role", "content"}} objects'
        )
    checked: list[dict[str, str]] = []
    for index, message in enumerate(messages):
        at = f"messages[{index}]"
        if not isinstance(message, Mapping):
            raise TextRequestError(
                f'{at} is {json_type_name(message)}; expected an object {{"role", "content"}}'
            )
        present = {key: value for key, value in message.items() if value is not None}
        for key in present:
            if key not in _MESSAGE_FIELDS:
                raise TextRequestError(
                    f"{at} has field {key!r}, which is not supported; "
                    f"allowed: {', '.join(_MESSAGE_FIELDS)}"
                )
        role = present.get("role")
        if not isinstance(role, str) or not role:
            shown = "missing" if role is None else f"{json_type_name(role)}, {role!r}"
            raise TextRequestError(f"{at}.role is {shown}; expected a non-empty string")
        if "content" not in present:
            raise TextRequestError(f"{at}.content is missing; expected a string")
        entry = {"role": role, "content": _content_text(present["content"], index)}
        name = present.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise TextRequestError(f"{at}.name is {json_type_name(name)}; expected a string")
            entry["name"] = name
        checked.append(entry)
    return checked
