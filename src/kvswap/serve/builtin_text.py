"""The built-in tokenizer and chat template of the random-weight presets (`tiny`, `small`).

`kvswap serve --model small` has no checkpoint directory to read a tokenizer.json from,
so the text side is built here, in code, with the `tokenizers` library: a byte-level
BPE that encodes any Unicode text (its UTF-8 bytes, one token each, merged where the
merge table allows) and decodes every id back to text. It is deterministic: the same
vocabulary size gives the same ids on every machine and in every process.

Id layout (the same for every vocabulary size, so `tiny` and `small` agree on bytes):

    0 .. 255       one token per byte value, in the GPT-2 byte-to-character alphabet,
                   except the four ids below
    252 <|im_start|>  253 <|im_end|>  254 <s>  255 </s>
                   special tokens, placed on bytes 0xFC-0xFF, which never occur in
                   UTF-8 text: with `tiny`'s 256 ids nothing else is free, and any
                   valid text still encodes (so the specials fit without a lost byte)
    256 ..         (when the model's vocabulary is larger, e.g. `small`'s 32,000)
                   merges over the alphabet " abcdefghijklmnopqrstuvwxyz": every pair,
                   then every pair extended by one character, and so on until the
                   vocabulary is full; every id a model can sample decodes to text

`<s>` starts every encoding with special tokens (the post-processor) and every chat;
`</s>` and `<|im_end|>` end a generation. The chat template is ChatML.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from kvswap.errors import KvSwapError

__all__ = [
    "BOS_TOKEN",
    "BUILTIN_CHAT_TEMPLATE",
    "BUILTIN_SPECIAL_TOKENS",
    "BUILTIN_STOP_TOKENS",
    "EOS_TOKEN",
    "MIN_BUILTIN_VOCAB_SIZE",
    "SPECIAL_TOKEN_IDS",
    "builtin_tokenizer",
    "byte_alphabet",
]

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
#: Special token -> id: byte values that never occur in UTF-8 (0xF5-0xFF are not lead bytes).
SPECIAL_TOKEN_IDS: Mapping[str, int] = MappingProxyType(
    {IM_START: 0xFC, IM_END: 0xFD, BOS_TOKEN: 0xFE, EOS_TOKEN: 0xFF}
)
MIN_BUILTIN_VOCAB_SIZE = 256
#: The names a chat template knows the special tokens by (as in tokenizer_config.json).
BUILTIN_SPECIAL_TOKENS: Mapping[str, str] = MappingProxyType(
    {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN}
)
#: The tokens that end a generation: the end of the sequence, and the end of a chat turn.
BUILTIN_STOP_TOKENS: tuple[str, ...] = (EOS_TOKEN, IM_END)
#: ChatML, with `<s>` first (the chat is encoded without adding special tokens again).
BUILTIN_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_MERGE_ALPHABET = " abcdefghijklmnopqrstuvwxyz"


def byte_alphabet() -> list[str]:
    """Byte value -> the printable character byte-level BPE writes it as (GPT-2's table):
    printable Latin-1 bytes stand for themselves, the other 68 are moved to U+0100 on, in
    byte order, so no byte becomes whitespace or a control character inside a token."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    alphabet: dict[int, str] = {b: chr(b) for b in kept}
    moved = (b for b in range(256) if b not in alphabet)
    alphabet.update({b: chr(0x100 + n) for n, b in enumerate(moved)})
    return [alphabet[b] for b in range(256)]


def _merges(num_merges: int, alphabet: list[str]) -> list[tuple[str, str]]:
    """The first `num_merges` merges: each token of one level extended by each character."""
    letters = [alphabet[ord(c)] for c in _MERGE_ALPHABET]
    merges: list[tuple[str, str]] = []
    level = letters
    while len(merges) < num_merges:
        next_level: list[str] = []
        for left in level:
            for right in letters:
                merges.append((left, right))
                next_level.append(left + right)
                if len(merges) == num_merges:
                    return merges
        level = next_level
    return merges


@functools.cache
def builtin_tokenizer(vocab_size: int) -> Tokenizer:
    """The built-in tokenizer for a model of `vocab_size` ids (>= 256); cached per process.

    Every id below `vocab_size` is a token, and no id at or above it is ever produced.
    """
    if vocab_size < MIN_BUILTIN_VOCAB_SIZE:
        raise KvSwapError(
            f"the built-in tokenizer needs a vocabulary of at least {MIN_BUILTIN_VOCAB_SIZE} "
            f"ids (one per byte); this model has {vocab_size}"
        )
    alphabet = byte_alphabet()
    special_ids = set(SPECIAL_TOKEN_IDS.values())
    vocab = {alphabet[b]: b for b in range(256) if b not in special_ids}
    vocab.update(SPECIAL_TOKEN_IDS)
    merges = _merges(vocab_size - 256, alphabet)
    vocab.update({left + right: 256 + n for n, (left, right) in enumerate(merges)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    # The specials are already in the vocabulary, so they keep the ids above.
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKEN_IDS]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, SPECIAL_TOKEN_IDS[BOS_TOKEN])],
    )
    return tokenizer
