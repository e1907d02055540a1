"""Text in and out of the model: the one object the HTTP app tokenizes with.

    codec = load_text(source, vocab_size)   # source: what --model named; vocab_size:
                                            # the model's (ModelArchConfig.vocab_size)
      preset (tiny, small)            -> the built-in byte-level codec (no download)
      directory with tokenizer.json   -> its tokenizer, chat template, special tokens
      directory without tokenizer.json -> None: the server takes token-id prompts only,
                                          and answers text with NoTokenizerError(source)
    codec.encode(text, add_special_tokens=True) -> list[int]      (a completion prompt)
    codec.encode_chat(messages, add_generation_prompt=True) -> list[int]
        = encode(apply_chat_template(messages, ...), add_special_tokens=False): the
          template writes the BOS text itself, so it is never added twice (as transformers)
    codec.apply_chat_template(messages, add_generation_prompt=True) -> str
    codec.decode(ids, skip_special_tokens=True) -> str
    codec.eos_token_ids: frozenset[int]   stop ids for GenerationRequest.stop_token_ids
    codec.vocab_size: int                 ids the tokenizer emits (<= the model's)
    codec.max_prompt_chars(num_tokens)    the longest text that can tokenize to that many
                                          tokens: longer text is refused untokenized
    codec.has_chat_template: bool
Streaming output: kvswap.serve.detokenize (IncrementalDecoder, StopMatcher, parse_stop).

Errors: the model's files are checked once, in `load_text` (a KvSwapError, one line: the
server does not start); a request's bad text or messages raise TextRequestError (HTTP
400, `status` and `code` on the class), raised by encode / encode_chat.

Invariants: every id `encode` returns is below the model's vocabulary size (checked at
load over the whole tokenizer vocabulary, added tokens included), and so are the stop
ids. tokenizer.json's truncation and padding are switched off: a prompt is never cut
silently (its length is the engine's to refuse). The codec holds no per-request state
and may be shared by threads.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from tokenizers import Tokenizer

from kvswap.errors import KvSwapError
from kvswap.model.presets import ENGINE_PRESET_NAMES
from kvswap.readers import TOKENIZER_FILE, read_user_file
from kvswap.serve.builtin_text import (
    BUILTIN_CHAT_TEMPLATE,
    BUILTIN_SPECIAL_TOKENS,
    BUILTIN_STOP_TOKENS,
    builtin_tokenizer,
)
from kvswap.serve.chat_template import ChatTemplate
from kvswap.serve.text_errors import (
    NoTokenizerError,
    TextRequestError,
    one_line,
    unicode_problem,
)
from kvswap.serve.text_files import read_text_files

__all__ = ["NoTokenizerError", "TextCodec", "TextRequestError", "builtin_codec", "load_text"]


class TextCodec:
    """A tokenizer with its chat template, special tokens and stop ids."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        name: str,
        model_vocab_size: int,
        special_tokens: Mapping[str, str],
        chat_template: ChatTemplate | None,
        no_chat_template_reason: str | None = None,
        add_bos_token: bool | None = None,
        extra_eos_token_ids: Iterable[int] = (),
    ):
        """`name` says where the tokenizer came from in every message. `add_bos_token`
        None leaves BOS to tokenizer.json's post-processor; True or False overrides it
        (tokenizer_config.json's flag, as transformers 4's Llama tokenizers applied it)."""
        self.name = name
        self._tokenizer = tokenizer
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._special_tokens = dict(special_tokens)
        self._chat_template = chat_template
        self._no_chat_template_reason = no_chat_template_reason or f"{name} has no chat template"
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        if not vocab:
            raise KvSwapError(f"{name} has an empty vocabulary")
        top_token, top_id = max(vocab.items(), key=lambda item: item[1])
        if top_id >= model_vocab_size:
            raise KvSwapError(
                f"{name} has token id {top_id} ({top_token!r}), beyond the model's "
                f"{model_vocab_size} ids; the tokenizer does not belong to this model"
            )
        self.vocab_size = top_id + 1
        # No token stands for more characters than its vocabulary string has (byte-level
        # BPE: one character per byte; SentencePiece: one per character; byte fallback
        # "<0x41>": more), so a text of n characters needs at least n / this many tokens.
        self.max_token_chars = max(1, max(len(token) for token in vocab))
        self.bos_token_id = self._special_id("bos_token")
        eos_id = self._special_id("eos_token")
        eos_ids = {*extra_eos_token_ids, *([] if eos_id is None else [eos_id])}
        for token_id in sorted(eos_ids):
            if token_id >= model_vocab_size:
                raise KvSwapError(
                    f"{name}: stop token id {token_id} (eos_token_id) is beyond the model's "
                    f"{model_vocab_size} ids"
                )
        self.eos_token_ids = frozenset(eos_ids)
        # What the post-processor adds around any text, seen on the empty text.
        added_by_processor = tokenizer.encode("", add_special_tokens=True).ids
        processor_adds_bos = self.bos_token_id is not None and added_by_processor[:1] == [
            self.bos_token_id
        ]
        want_bos = processor_adds_bos if add_bos_token is None else add_bos_token
        self._prepend_bos = want_bos and not processor_adds_bos
        self._strip_bos = processor_adds_bos and not want_bos

    def max_prompt_chars(self, num_tokens: int) -> int:
        """The most characters a text of `num_tokens` tokens can have: a longer text
        cannot fit, and is refused before it is tokenized (tokenizing is the costly part)."""
        return num_tokens * self.max_token_chars

    def _special_id(self, name: str) -> int | None:
        text = self._special_tokens.get(name)
        if text is None:
            return None
        token_id = self._tokenizer.token_to_id(text)
        if token_id is None:
            raise KvSwapError(f"{name} {text!r} of {self.name} is not a token of its vocabulary")
        return token_id

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`; with special tokens as the model's tokenizer adds them
        (BOS for most models). Special-token text inside `text` becomes that token."""
        if not isinstance(text, str):
            raise TextRequestError(f"a prompt must be a string, not {type(text).__name__}")
        try:
            ids = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        except Exception as error:  # the library's errors carry no common type
            # A lone surrogate gets the library's "TextInputSequence must be str": say what.
            reason = unicode_problem(text) or one_line(str(error) or type(error).__name__)
            raise TextRequestError(f"the text cannot be tokenized: {reason}") from None
        if add_special_tokens and self.bos_token_id is not None:
            if self._prepend_bos:
                ids.insert(0, self.bos_token_id)
            elif self._strip_bos and ids[:1] == [self.bos_token_id]:
                del ids[0]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`; an id the tokenizer does not know decodes to nothing (a model
        may have more ids than its tokenizer: padding rows)."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: object, add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation (OpenAI `messages`, validated here)."""
        if self._chat_template is None:
            raise TextRequestError(self._no_chat_template_reason)
        return self._chat_template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self._special_tokens,
        )

    def encode_chat(self, messages: object, add_generation_prompt: bool = True) -> list[int]:
        """The prompt ids of a conversation: the template's text, no special tokens added."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)


@functools.cache
def builtin_codec(vocab_size: int) -> TextCodec:
    """The built-in byte-level codec for a random-weight preset of `vocab_size` ids."""
    tokenizer = builtin_tokenizer(vocab_size)
    stop_ids = [tokenizer.token_to_id(token) for token in BUILTIN_STOP_TOKENS]
    return TextCodec(
        tokenizer,
        name=f"the built-in tokenizer ({vocab_size} ids)",
        model_vocab_size=vocab_size,
        special_tokens=BUILTIN_SPECIAL_TOKENS,
        chat_template=ChatTemplate(BUILTIN_CHAT_TEMPLATE, "the built-in chat template"),
        extra_eos_token_ids=[i for i in stop_ids if i is not None],
    )


def load_text(source: str, vocab_size: int) -> TextCodec | None:
    """The codec for the model `source` names (a preset or a checkpoint directory, as
    `--model` takes it) of `vocab_size` ids; None for a directory without tokenizer.json.

    With None the server serves token-id prompts only; raise `NoTokenizerError(source)`
    (one line, HTTP 400) for a request that carries text, and log its message at start.
    """
    if source in ENGINE_PRESET_NAMES:
        return builtin_codec(vocab_size)
    directory = Path(source).expanduser()
    if not directory.is_dir():
        raise KvSwapError(
            f"model {source!r} is neither a preset ({', '.join(ENGINE_PRESET_NAMES)}) nor an "
            "existing directory"
        )
    files = read_text_files(directory)
    if files is None:
        return None
    path = files.tokenizer_path
    try:
        # Read through the readers' cap (not Tokenizer.from_file): a file swapped for a
        # larger one after read_text_files checked it is still read bounded.
        text = read_user_file(path, str(path), TOKENIZER_FILE).decode("utf-8")
        tokenizer = Tokenizer.from_str(text)
    except OSError as error:
        raise KvSwapError(f"cannot read {path}: {error.strerror or error}") from None
    except KvSwapError:
        raise
    except Exception as error:  # the library's parse errors carry no common type
        raise KvSwapError(
            f"cannot read {files.tokenizer_path}: {one_line(str(error) or type(error).__name__)}"
        ) from None
    template = (
        None
        if files.chat_template is None
        else ChatTemplate(files.chat_template, files.chat_template_where)
    )
    return TextCodec(
        tokenizer,
        name=str(files.tokenizer_path),
        model_vocab_size=vocab_size,
        special_tokens=files.special_tokens,
        chat_template=template,
        no_chat_template_reason=files.no_chat_template_reason,
        add_bos_token=files.add_bos_token,
        extra_eos_token_ids=files.generation_eos_token_ids,
    )
