"""Text in and out for `kvswap serve` (issue 12): a checkpoint's tokenizer.json and chat
template, read as transformers reads them (its own output is the reference), the
built-in tokenizer of the random-weight presets, streaming detokenization and stop
strings, and a one-line error for every bad file or request field."""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from kvswap.errors import KvSwapError
from kvswap.serve.builtin_text import (
    SPECIAL_TOKEN_IDS,
    builtin_tokenizer,
    byte_alphabet,
)
from kvswap.serve.detokenize import (
    MAX_HELD_TOKENS,
    IncrementalDecoder,
    StopMatcher,
    StopPiece,
    parse_stop,
)
from kvswap.serve.text_errors import NoTokenizerError, TextRequestError
from kvswap.serve.tokenizer import TextCodec, builtin_codec, load_text

SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
SENTENCES = [
    "hello world", "the quick brown fox jumps over the lazy dog",
    "how are you today? I am fine, thank you.", "<b>bold</b> & 'quoted' text",
]  # fmt: skip
# A Zephyr-like template: indented block tags (lstrip_blocks), a newline after every tag
# (trim_blocks), tojson (no HTML escaping), loop controls, raise_exception.
TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'system' %}
<|system|>
{{ message['content'] | tojson }}{{ eos_token }}
    {% elif message['role'] in ['user', 'assistant'] %}
<|{{ message['role'] }}|>
{{ message['content'] }}{{ eos_token }}
    {% else %}
{{ raise_exception('Unknown role: ' + message['role']) }}
    {% endif %}
    {% if loop.index > 50 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}"""
CHAT = [
    {"role": "system", "content": "Be <brief> & 'kind'."},
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "how are you today?"},
    {"role": "user", "content": [{"type": "text", "text": "the quick"},
                                 {"type": "text", "text": "fox"}]},
]  # fmt: skip
TEXT_CHAT = [*CHAT[:3], {"role": "user", "content": "the quick\nfox"}]  # parts joined by "\n"


def trained_tokenizer(with_processor: bool = True) -> Tokenizer:
    """A small SentencePiece-style BPE trained in memory (a leading "▁" marks a space)."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False)
    tokenizer.train_from_iterator(SENTENCES * 3, trainer)
    if with_processor:
        bos_id = tokenizer.token_to_id("<s>")
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", bos_id)]
        )
    return tokenizer


def write_model(directory: Path, tokenizer: Tokenizer | None = None, **config: Any) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (tokenizer or trained_tokenizer()).save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False},
        "eos_token": "</s>",
        "chat_template": TEMPLATE,
        **config,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return directory


def codec_of(directory: Path, vocab_size: int = 300) -> TextCodec:
    codec = load_text(str(directory), vocab_size)
    assert codec is not None
    return codec


def one_line_error(error: type[Exception], call: Callable[[], object], *needles: str) -> str:
    with pytest.raises(error) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message and message, message
    for needle in needles:
        assert needle in message, message
    return message


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("text") / "model")


# --- a checkpoint's tokenizer and chat template, against transformers ------------------


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_and_encodes_as_transformers(
    model_dir: Path, add_generation_prompt: bool
) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(model_dir))
    codec = codec_of(model_dir)
    expected = reference.apply_chat_template(
        TEXT_CHAT, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert codec.apply_chat_template(CHAT, add_generation_prompt) == expected
    assert "\"Be <brief> & 'kind'.\"" in expected  # tojson, not HTML-escaped
    assert expected.startswith("<s>\n<|system|>") and expected.count("<s>") == 1
    ids = reference.apply_chat_template(
        TEXT_CHAT, tokenize=True, add_generation_prompt=add_generation_prompt
    )["input_ids"]
    assert codec.encode_chat(CHAT, add_generation_prompt) == ids
    assert ids.count(codec.bos_token_id) == 1  # the template's BOS, not a second one


def test_encode_decode_round_trip_as_transformers(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(model_dir))
    codec = codec_of(model_dir)
    for text in SENTENCES:
        ids = codec.encode(text)
        assert ids == reference.encode(text) and ids[0] == codec.bos_token_id
        assert codec.encode(text, add_special_tokens=False) == ids[1:]
        assert codec.decode(ids) == reference.decode(ids, skip_special_tokens=True) == text
    assert codec.eos_token_ids == {codec.encode("</s>", add_special_tokens=False)[0]}
    assert codec.vocab_size == trained_tokenizer().get_vocab_size() and codec.has_chat_template


def test_chat_template_file_and_named_templates(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    jinja_dir = write_model(tmp_path / "jinja", chat_template="never used")
    (jinja_dir / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    )
    expected = AutoTokenizer.from_pretrained(str(jinja_dir)).apply_chat_template(
        TEXT_CHAT, tokenize=False
    )
    assert codec_of(jinja_dir).apply_chat_template(CHAT) == expected
    assert expected.startswith("[Be <brief>")
    named = [
        {"name": "tool_use", "template": "T"},
        {"name": "default", "template": "D{{ bos_token }}"},
    ]
    assert (
        codec_of(write_model(tmp_path / "named", chat_template=named)).apply_chat_template(CHAT)
        == "D<s>"
    )
    nameless = codec_of(write_model(tmp_path / "nameless", chat_template=named[:1]))
    assert not nameless.has_chat_template
    one_line_error(
        TextRequestError, lambda: nameless.apply_chat_template(CHAT), "no 'default'", "tool_use"
    )
    bare = codec_of(write_model(tmp_path / "bare", chat_template=None))
    one_line_error(
        TextRequestError, lambda: bare.encode_chat(CHAT), "no chat template", "/v1/completions"
    )
    assert bare.encode("hello world")[0] == bare.bos_token_id  # completions still work


def test_stop_ids_from_generation_config_or_config_json(tmp_path: Path) -> None:
    directory = write_model(tmp_path / "m")
    eos = codec_of(directory).encode("</s>", add_special_tokens=False)[0]
    (directory / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert codec_of(directory).eos_token_ids == {eos, 5}
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
    assert codec_of(directory).eos_token_ids == {eos, 3, 4}  # generation_config wins


def test_add_bos_token_overrides_the_post_processor(tmp_path: Path) -> None:
    plain = trained_tokenizer(with_processor=False)
    added = codec_of(write_model(tmp_path / "a", plain, add_bos_token=True))
    assert added.encode("hello world") == [added.bos_token_id, *plain.encode("hello world").ids]
    stripped = codec_of(write_model(tmp_path / "b", add_bos_token=False))
    assert stripped.encode("hello world") == stripped.encode("hello world", False)
    assert stripped.encode("<s>hello")[0] == stripped.bos_token_id  # the text's own <s> stays


def test_directory_without_tokenizer_serves_token_ids_only(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert load_text(str(tmp_path), 300) is None
    error = NoTokenizerError(str(tmp_path))
    assert error.status == 400 and "\n" not in str(error)
    assert "tokenizer.json" in str(error) and "token ids" in str(error)


@pytest.mark.parametrize(
    ("files", "needles"),
    [
        ({"tokenizer.json": "{not json"}, ["cannot read", "tokenizer.json"]),
        ({"tokenizer_config.json": "[1, 2]"}, ["tokenizer_config.json", "expected a JSON object"]),
        ({"tokenizer_config.json": "{"}, ["tokenizer_config.json", "not valid JSON"]),
        ({"config": {"bos_token": 7}}, ["bos_token is 7", '{"content": string}']),
        ({"config": {"eos_token": "<nope>"}}, ["eos_token '<nope>'", "not a token"]),
        ({"config": {"chat_template": 3}}, ["chat_template is int", "jinja string"]),
        ({"config": {"chat_template": [{"name": "x"}]}}, ["chat_template[0]", '"template"']),
        ({"config": {"chat_template": "{% for %}"}}, ["not valid jinja", "line 1"]),
        ({"config": {"add_bos_token": "yes"}}, ["add_bos_token is 'yes'", "true or false"]),
        ({"generation_config.json": '{"eos_token_id": "2"}'}, ["eos_token_id is '2'"]),
        ({"generation_config.json": '{"eos_token_id": [2, -1]}'}, ["eos_token_id is [2, -1]"]),
        ({"generation_config.json": '{"eos_token_id": 9999}'}, ["stop token id 9999", "300 ids"]),
        ({"chat_template.jinja": b"\xff\xfe"}, ["chat_template.jinja", "not UTF-8"]),
    ],
)
def test_bad_model_files_fail_in_one_line(
    tmp_path: Path, files: dict[str, Any], needles: list[str]
) -> None:
    directory = write_model(tmp_path / "m", **files.pop("config", {}))
    for name, content in files.items():
        path = directory / name
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    one_line_error(KvSwapError, lambda: load_text(str(directory), 300), *needles)


@pytest.mark.parametrize(
    "name",
    ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"],
)
@pytest.mark.parametrize("kind", ["fifo", "directory", "too-large"])
def test_a_model_file_that_is_no_regular_file_or_too_large_is_refused_unread(
    tmp_path: Path, fail_if_blocked: None, name: str, kind: str
) -> None:
    # A FIFO opened for reading would block forever; a too large file is never read:
    # it is sparse, the size alone refuses it.
    directory = write_model(tmp_path / "m")
    path = directory / name
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        with path.open("wb") as file:
            file.truncate(64 * 2**20 + 1)  # past every cap of a model's text files
    needle = "allowed: at most" if kind == "too-large" else "not a regular file"
    one_line_error(KvSwapError, lambda: load_text(str(directory), 300), str(path), needle)


def test_tokenizer_larger_than_the_model_is_refused(model_dir: Path) -> None:
    top_id = codec_of(model_dir).vocab_size - 1
    one_line_error(
        KvSwapError,
        lambda: load_text(str(model_dir), top_id),
        f"token id {top_id}",
        f"beyond the model's {top_id} ids",
        "does not belong to this model",
    )
    one_line_error(KvSwapError, lambda: load_text("/no/such/dir", 300), "neither a preset")


# --- messages and the template's refusals ----------------------------------------------


@pytest.mark.parametrize(
    ("messages", "needles"),
    [
        ([], ["messages is an empty list"]),
        ({"role": "user"}, ["messages is an object", "non-empty list"]),
        (["hi"], ["messages[0] is a string"]),
        ([{"content": "x"}], ["messages[0].role is missing"]),
        ([{"role": "", "content": "x"}], ["messages[0].role is a string, ''"]),
        ([{"role": 3, "content": "x"}], ["messages[0].role is a number"]),
        ([CHAT[1], {"role": "user"}], ["messages[1].content is missing"]),
        ([{"role": "user", "content": None}], ["messages[0].content is missing"]),
        ([{"role": "user", "content": 5}], ["messages[0].content is a number"]),
        ([{"role": "user", "content": ["x"]}], ["messages[0].content[0] is a string"]),
        (
            [{"role": "user", "content": [{"type": "image_url"}]}],
            ["content[0].type is 'image_url'"],
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": 1}]}],
            ["content[0].text is a number"],
        ),
        (
            [{"role": "user", "content": "x", "tool_calls": [1]}],
            ["field 'tool_calls'", "allowed: role"],
        ),
        ([{"role": "user", "content": "x", "name": 1}], ["messages[0].name is a number"]),
        ([{"role": "robot", "content": "x"}], ["refused the messages", "Unknown role: robot"]),
    ],
)
def test_bad_messages_fail_in_one_line(
    model_dir: Path, messages: object, needles: list[str]
) -> None:
    codec = codec_of(model_dir)
    one_line_error(TextRequestError, lambda: codec.encode_chat(messages), *needles)


def test_null_fields_are_dropped_and_names_kept(model_dir: Path) -> None:
    codec = codec_of(model_dir)
    echoed = [{"role": "user", "content": "hello world", "tool_calls": None, "name": "ann"}]
    assert codec.apply_chat_template(echoed) == codec.apply_chat_template([CHAT[1]])


@pytest.mark.parametrize(
    ("template", "needles"),
    [
        ("{{ messages.__class__.__mro__ }}", ["failed", "SecurityError", "unsafe"]),
        ("{% set _ = messages.append(1) %}", ["failed", "SecurityError", "unsafe"]),
        ("{{ messages[0].nope.deeper }}", ["failed", "has no attribute 'nope'"]),
        ("{{ 1 // (messages | length - 1) }}", ["failed", "ZeroDivisionError"]),
    ],
)
def test_template_errors_are_one_line_and_the_sandbox_holds(
    tmp_path: Path, template: str, needles: list[str]
) -> None:
    codec = codec_of(write_model(tmp_path / "m", chat_template=template))
    message = one_line_error(
        TextRequestError, lambda: codec.apply_chat_template([CHAT[1]]), *needles
    )
    assert message.startswith("the chat template")


def test_lone_surrogate_text_is_a_request_error(model_dir: Path) -> None:
    codec = codec_of(model_dir)
    needle = "a lone surrogate (U+D800) at character 4 is not valid Unicode; allowed: "
    one_line_error(TextRequestError, lambda: codec.encode("bad \ud800 text"), needle)


# --- the built-in tokenizer of the presets ---------------------------------------------

TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=60)
EXAMPLES = settings(max_examples=60, deadline=None, derandomize=True, database=None)


@pytest.mark.parametrize("vocab_size", [256, 32000])
@EXAMPLES
@given(text=TEXT)
def test_builtin_round_trips_any_unicode(vocab_size: int, text: str) -> None:
    codec = builtin_codec(vocab_size)
    ids = codec.encode(text)
    assert ids[0] == SPECIAL_TOKEN_IDS["<s>"] and max(ids) < vocab_size
    assert codec.decode(ids, skip_special_tokens=False) == "<s>" + text
    if not any(token in text for token in SPECIAL_TOKEN_IDS):
        assert codec.decode(ids) == text


def test_builtin_layout_is_deterministic_and_every_id_decodes() -> None:
    from tokenizers import pre_tokenizers as pre

    assert set(byte_alphabet()) == set(pre.ByteLevel.alphabet())
    small = builtin_tokenizer(32000)
    first = small.to_str()
    builtin_tokenizer.cache_clear()
    assert builtin_tokenizer(32000).to_str() == first
    assert load_text("small", 32000) is builtin_codec(32000)  # cached per process
    for token, token_id in SPECIAL_TOKEN_IDS.items():
        assert small.token_to_id(token) == token_id == builtin_tokenizer(256).token_to_id(token)
    merged = [small.decode([i]) for i in range(256, 32000)]
    assert all(text and set(text) <= set(" abcdefghijklmnopqrstuvwxyz") for text in merged)
    codec = builtin_codec(256)
    assert codec.vocab_size == 256 and codec.eos_token_ids == {0xFD, 0xFF}
    one_line_error(KvSwapError, lambda: builtin_tokenizer(100), "at least 256", "has 100")


def test_builtin_chat_template_is_chatml_as_transformers_renders_it(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from kvswap.serve.builtin_text import BUILTIN_CHAT_TEMPLATE

    builtin_tokenizer(32000).save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": BUILTIN_CHAT_TEMPLATE}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    reference = AutoTokenizer.from_pretrained(str(tmp_path))
    codec = load_text("small", 32000)
    assert codec is not None
    text = codec.apply_chat_template(TEXT_CHAT)
    assert text == reference.apply_chat_template(
        TEXT_CHAT, tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<s><|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert (
        codec.encode_chat(TEXT_CHAT)
        == reference.apply_chat_template(TEXT_CHAT, add_generation_prompt=True)["input_ids"]
    )


# --- streaming: incremental decoding -----------------------------------------------------


def stream(codec: TextCodec, ids: list[int], prompt_ids: list[int] | None = None) -> list[str]:
    decoder = IncrementalDecoder(codec, prompt_ids or [])
    return [decoder.push(token_id) for token_id in ids] + [decoder.flush()]


def test_multibyte_characters_split_over_tokens_wait_for_their_last_byte() -> None:
    codec = builtin_codec(256)  # one token per byte
    pieces = stream(codec, codec.encode("é€😀!", add_special_tokens=False))
    assert pieces == ["", "é", "", "", "€", "", "", "", "😀", "!", ""]


@pytest.mark.parametrize("vocab_size", [256, 32000])
@EXAMPLES
@given(text=TEXT.filter(lambda t: "\ufffd" not in t))
def test_streamed_pieces_add_up_to_the_text(vocab_size: int, text: str) -> None:
    codec = builtin_codec(vocab_size)
    pieces = stream(codec, codec.encode(text, add_special_tokens=False), codec.encode("hi"))
    assert "".join(pieces) == codec.decode(codec.encode(text))
    assert not any(piece.endswith("\ufffd") for piece in pieces)


def test_stray_bytes_are_released_and_decoding_recovers() -> None:
    codec = builtin_codec(256)
    lead_byte = 0xC3  # starts a 2-byte character; never completed here
    pieces = stream(codec, [lead_byte] * MAX_HELD_TOKENS + [*"é".encode(), 0xFF, ord("x")])
    assert pieces[: MAX_HELD_TOKENS - 1] == [""] * (MAX_HELD_TOKENS - 1)
    assert pieces[MAX_HELD_TOKENS - 1] == "\ufffd" * MAX_HELD_TOKENS
    assert "".join(pieces[MAX_HELD_TOKENS:]) == "éx"  # </s> (0xFF) shows nothing
    assert stream(codec, [lead_byte]) == ["", "\ufffd"]  # flushed at the end


def test_prompt_context_keeps_a_leading_space(model_dir: Path) -> None:
    codec = codec_of(model_dir)
    prompt = codec.encode("hello")
    generated = codec.encode("hello world", add_special_tokens=False)[len(prompt) - 1 :]
    assert "".join(stream(codec, generated, prompt)) == " world"
    assert "".join(stream(codec, generated)) == "world"  # alone, SentencePiece strips it


# --- stop strings ----------------------------------------------------------------------


def pieces_through(stop: list[str], pieces: list[str]) -> tuple[str, bool]:
    matcher = StopMatcher(stop)
    sent = []
    for piece in pieces:
        result = matcher.push(piece)
        sent.append(result.text)
        if result.stopped:
            return "".join(sent), True
    return "".join(sent) + matcher.flush(), False


def test_stop_string_split_over_tokens_is_found_and_left_out() -> None:
    matcher = StopMatcher(["STOP", "\n\n"])
    assert matcher.push("Hel") == StopPiece("Hel")
    assert matcher.push("lo ST") == StopPiece("lo ")  # "ST" could start STOP: held
    assert matcher.push("OP now") == StopPiece("", stopped=True)
    assert matcher.push("more") == StopPiece("", stopped=True) and matcher.flush() == ""
    assert pieces_through(["STOP"], ["a STO", "X b"]) == ("a STOX b", False)
    assert pieces_through(["STOP"], ["ST", "O"]) == ("STO", False)  # the end releases it
    assert pieces_through(["b", "abc"], ["xab", "c"]) == ("xa", True)  # first match wins
    assert pieces_through([], ["a", "b"]) == ("ab", False)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(
    text=st.text("abS\n", max_size=30),
    stops=st.lists(st.text("abS\n", min_size=1, max_size=4), max_size=4),
    cuts=st.lists(st.integers(0, 30), max_size=8),
)
def test_stop_matching_equals_searching_the_whole_text(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    bounds = [0, *sorted(cuts), len(text)]
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    expected = (text[: min(found)], True) if found else (text, False)
    assert pieces_through(stops, pieces) == expected


@pytest.mark.parametrize(
    ("value", "needles"),
    [
        (5, ["stop is a number", "at most 4"]),
        ({"s": 1}, ["stop is an object"]),
        (["a", "b", "c", "d", "e"], ["stop has 5 strings", "at most 4"]),
        (["a", ""], ["stop[1] is empty", "non-empty"]),
        ("", ["stop[0] is empty"]),
        (["a", None], ["stop[1] is null"]),
    ],
)
def test_bad_stop_fails_in_one_line(value: object, needles: list[str]) -> None:
    error = one_line_error(TextRequestError, lambda: parse_stop(value), *needles)
    assert TextRequestError.status == 400, error


def test_stop_values_accepted() -> None:
    assert parse_stop(None) == () and parse_stop("x") == ("x",)
    assert parse_stop(["a", "b"]) == ("a", "b")
    one_line_error(TextRequestError, lambda: StopMatcher(["x"] * 5), "at most 4")
