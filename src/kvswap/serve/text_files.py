"""What a checkpoint directory says about its text, read from the files transformers
writes next to the weights:

    tokenizer.json           the tokenizer (required for text; read by `tokenizers`)
    tokenizer_config.json    chat_template (a string, or a list of {"name", "template"}
                             from which "default" is used), the special tokens
                             (bos_token, eos_token, ...: a string or {"content": ...}),
                             add_bos_token
    chat_template.jinja      the chat template as its own file (transformers >= 4.43
                             saves it so); it wins over tokenizer_config.json's, as there
    generation_config.json   eos_token_id (an id or a list): the ids that end a
                             generation; config.json's eos_token_id when the file is absent

Every file is optional but tokenizer.json; a malformed one is a one-line KvSwapError
naming the file and the field. Each is refused before it is read unless it is a regular
file within its cap (`kvswap.readers`: MAX_TOKENIZER_BYTES, MAX_MODEL_CONFIG_BYTES,
MAX_CHAT_TEMPLATE_BYTES), so a FIFO or /dev/zero in its place neither blocks nor fills memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvswap import readers
from kvswap.errors import KvSwapError
from kvswap.readers import FileKind, check_user_file, parse_json, read_user_file

__all__ = ["SPECIAL_TOKEN_NAMES", "TextFiles", "read_text_files"]

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"
#: The named special tokens a chat template may use (transformers' SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip
DEFAULT_TEMPLATE_NAME = "default"


@dataclass(frozen=True)
class TextFiles:
    """The text side of one checkpoint directory, as read from its files."""

    tokenizer_path: Path
    chat_template: str | None  # the default template's jinja source
    chat_template_where: str  # the file it came from, for messages
    no_chat_template_reason: str | None  # why there is none, when there is none
    special_tokens: dict[str, str]  # name (bos_token, ...) -> token text
    add_bos_token: bool | None  # None: the tokenizer.json post-processor decides
    generation_eos_token_ids: tuple[int, ...]


def _read_object(path: Path, kind: FileKind) -> dict[str, object] | None:
    """A JSON object file, or None when it does not exist."""
    if not path.exists():
        return None
    try:
        raw = read_user_file(path, str(path), kind)
    except OSError as error:
        raise KvSwapError(f"cannot read {path}: {error.strerror}") from None
    value = parse_json(raw, str(path))
    if not isinstance(value, dict):
        raise KvSwapError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def _token_text(value: object, where: str) -> str | None:
    """A special token as tokenizer_config.json writes it: text, or an AddedToken object."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        content: str = value["content"]
        return content
    raise KvSwapError(f'{where} is {value!r}; expected a string or {{"content": string}}')


def _named_template(value: list[object], where: str) -> tuple[str | None, str | None]:
    """(the "default" template, or None and why) from a list of {"name", "template"}."""
    templates: dict[str, str] = {}
    for index, entry in enumerate(value):
        name = entry.get("name") if isinstance(entry, dict) else None
        template = entry.get("template") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not isinstance(template, str):
            raise KvSwapError(f'{where}[{index}] is not {{"name": string, "template": string}}')
        templates[name] = template
    if DEFAULT_TEMPLATE_NAME in templates:
        return templates[DEFAULT_TEMPLATE_NAME], None
    names = ", ".join(sorted(templates)) or "none"
    return None, f"{where} names no 'default' template (it has: {names})"


def _chat_template(
    directory: Path, config: dict[str, object]
) -> tuple[str | None, str, str | None]:
    """(template source or None, where it came from, why there is none)."""
    jinja_path = directory / CHAT_TEMPLATE_FILE
    if jinja_path.exists():
        try:
            raw = read_user_file(jinja_path, str(jinja_path), readers.CHAT_TEMPLATE_FILE)
            return raw.decode("utf-8"), str(jinja_path), None
        except (OSError, UnicodeDecodeError) as error:
            reason = getattr(error, "strerror", None) or "not UTF-8 text"
            raise KvSwapError(f"cannot read {jinja_path}: {reason}") from None
    where = f"{directory / TOKENIZER_CONFIG_FILE} chat_template"
    value = config.get("chat_template")
    if isinstance(value, str):
        return value, where, None
    if isinstance(value, list):
        template, reason = _named_template(value, where)
        return template, where, reason
    if value is not None:
        raise KvSwapError(
            f"{where} is {type(value).__name__}; expected a jinja string or a list of "
            '{"name", "template"} objects'
        )
    return (
        None,
        where,
        (
            f"model directory {directory} has no chat template ({CHAT_TEMPLATE_FILE} or "
            f"chat_template in {TOKENIZER_CONFIG_FILE}); use /v1/completions with a prompt"
        ),
    )


def _eos_ids(config: dict[str, object] | None, path: Path) -> tuple[int, ...]:
    value = None if config is None else config.get("eos_token_id")
    ids = value if isinstance(value, list) else [] if value is None else [value]
    for token_id in ids:
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise KvSwapError(
                f"{path} eos_token_id is {value!r}; expected a token id or a list of token ids"
            )
    return tuple(ids)


def read_text_files(directory: Path) -> TextFiles | None:
    """The directory's text files, or None when it has no tokenizer.json."""
    tokenizer_path = directory / TOKENIZER_FILE
    if not tokenizer_path.exists():
        return None
    try:
        # Read by `tokenizers` (Tokenizer.from_file), so only checked here, not read.
        check_user_file(tokenizer_path, str(tokenizer_path), readers.TOKENIZER_FILE)
    except OSError as error:
        raise KvSwapError(f"cannot read {tokenizer_path}: {error.strerror}") from None
    config_path = directory / TOKENIZER_CONFIG_FILE
    config = _read_object(config_path, readers.TOKENIZER_FILE) or {}
    template, template_where, no_template_reason = _chat_template(directory, config)
    special_tokens: dict[str, str] = {}
    for name in SPECIAL_TOKEN_NAMES:
        text = _token_text(config.get(name), f"{config_path} {name}")
        if text is not None:
            special_tokens[name] = text
    add_bos = config.get("add_bos_token")
    if add_bos is not None and not isinstance(add_bos, bool):
        raise KvSwapError(f"{config_path} add_bos_token is {add_bos!r}; expected true or false")
    eos_path = directory / GENERATION_CONFIG_FILE
    if not eos_path.exists():
        eos_path = directory / MODEL_CONFIG_FILE
    eos_ids = _eos_ids(_read_object(eos_path, readers.MODEL_CONFIG_FILE), eos_path)
    return TextFiles(
        tokenizer_path=tokenizer_path,
        chat_template=template,
        chat_template_where=template_where,
        no_chat_template_reason=no_template_reason if template is None else None,
        special_tokens=special_tokens,
        add_bos_token=add_bos,
        generation_eos_token_ids=eos_ids,
    )
