"""Every request field of the two endpoints over the fake engine (issue 22, item 1): what
each is translated to for the engine, what is accepted at a neutral value only, and the
one-line 400 for everything else; `n` choices, logprobs' shapes, the default
`max_tokens`, and usage after a stop string. The table: docs/api_fields.md."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvswap.base.identity import MAX_CACHE_SALT_CHARS
from kvswap.sampling import LogitsOptions
from kvswap.serve.errors import ApiError
from kvswap.serve.http_generation import MAX_RESPONSE_LOGPROBS, plan_generation
from kvswap.serve.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from kvswap.serve.tokenizer import TextCodec, builtin_codec

from .serve_fakes import DEADLINE_S, FakeService, serving
from .test_serve_http import one_line_error

REPLY_TEXT = "Hello world, this is kvswap."
PROMPT = "Say hello."
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return builtin_codec(1024)


def reply_ids(codec: TextCodec) -> tuple[int, ...]:
    return (*codec.encode(REPLY_TEXT, add_special_tokens=False), min(codec.eos_token_ids))


@pytest.fixture
def service(codec: TextCodec) -> Iterator[FakeService]:
    fake = FakeService(reply_ids=reply_ids(codec))
    yield fake
    fake.close(0)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S)


def body_for(path: str, **fields: object) -> dict[str, object]:
    base: dict[str, object] = {"messages": USER} if path == CHAT else {"prompt": PROMPT}
    return {**base, "max_tokens": 4, **fields}


def events(response: httpx.Response) -> list[dict[str, Any]]:
    lines = [
        line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data:")
    ]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# -- accepted: neutral values change nothing, the others reach the engine ---------------

NEUTRAL: dict[str, object] = {
    "presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1, "logit_bias": {},
    "top_k": -1, "top_k ": 0, "min_tokens": 0, "n": 1, "response_format": {"type": "text"},
    "seed": None, "logit_bias ": None,
}  # fmt: skip
CHAT_NEUTRAL: dict[str, object] = {
    "tools": [], "tool_choice": "none", "logprobs": False, "top_logprobs": 0,
}  # fmt: skip


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_neutral_values_are_accepted_and_change_nothing(
    service: FakeService, codec: TextCodec, path: str
) -> None:
    extra = CHAT_NEUTRAL if path == CHAT else {"echo": False, "echo ": None, "logprobs": None}
    with serving(service, codec) as server, httpx.Client(base_url=server.url) as http:
        plain = http.post(path, json=body_for(path))
        for name, value in {**NEUTRAL, **extra}.items():
            # A trailing space names the same field again with another value.
            answer = http.post(path, json=body_for(path, **{name.strip(): value}))
            assert answer.status_code == 200, (name, answer.text)
            assert answer.json()["choices"] == plain.json()["choices"], name
    first = service.submitted[0]
    for sent in service.submitted:
        assert sent == first  # the same GenerationRequest: no options, no top_k
    assert first.options is None and first.top_k is None


def test_sampling_fields_reach_the_engine_as_the_rule_reads_them(
    service: FakeService, codec: TextCodec
) -> None:
    fields = {
        "temperature": 0.8, "top_k": 5, "seed": 3, "presence_penalty": 0.5,
        "frequency_penalty": -1, "repetition_penalty": 1.2, "logit_bias": {"7": 2, "3": -100},
        "min_tokens": 2,
    }  # fmt: skip
    with serving(service, codec) as server, httpx.Client(base_url=server.url) as http:
        for path in (COMPLETIONS, CHAT):
            assert http.post(path, json=body_for(path, **fields)).status_code == 200
        logprobs = http.post(COMPLETIONS, json=body_for(COMPLETIONS, logprobs=3))
        chat_logprobs = http.post(CHAT, json=body_for(CHAT, logprobs=True, top_logprobs=2))
        bare = http.post(CHAT, json=body_for(CHAT, logprobs=True))
    assert logprobs.status_code == chat_logprobs.status_code == bare.status_code == 200
    expected = LogitsOptions(
        presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.2,
        logit_bias=((3, -100.0), (7, 2.0)), min_tokens=2,
    )  # fmt: skip
    for sent in service.submitted[:2]:
        assert (sent.temperature, sent.top_k, sent.seed, sent.options) == (0.8, 5, 3, expected)
    numbers = [sent.options.num_logprobs for sent in service.submitted[2:] if sent.options]
    assert numbers == [3, 2, 0]  # chat's logprobs alone: the sampled token's only


# -- refused: one line naming the field ------------------------------------------------

REFUSED: list[tuple[str, dict[str, object], str, str]] = [
    (COMPLETIONS, {"presence_penalty": 2.5}, "presence_penalty: allowed: a number in [-2, 2]",
     "invalid_value"),
    (COMPLETIONS, {"frequency_penalty": "1"}, "frequency_penalty: ", "invalid_value"),
    (COMPLETIONS, {"repetition_penalty": 0}, "repetition_penalty: allowed: a number in [0.01, 100]",
     "invalid_value"),
    (CHAT, {"repetition_penalty": float("nan")}, "'repetition_penalty' is nan", "invalid_json"),
    (COMPLETIONS, {"logit_bias": {"x": 1}}, "logit_bias: key 'x': expected a token id",
     "invalid_value"),
    (COMPLETIONS, {"logit_bias": {"5": 101}}, "logit_bias: [5] = 101: allowed: a number in "
     "[-100, 100]", "invalid_value"),
    (COMPLETIONS, {"logit_bias": {"5": True}}, "logit_bias: [5] = True", "invalid_value"),
    (COMPLETIONS, {"logit_bias": [1]}, "logit_bias: expected an object", "invalid_value"),
    (CHAT, {"logit_bias": {"5000": 1}}, "logit_bias: token id 5000 is outside the vocabulary",
     "invalid_value"),
    (COMPLETIONS, {"top_k": -2}, "top_k: allowed: -1 or 0 (no top-k), or an integer >= 1",
     "invalid_value"),
    (COMPLETIONS, {"top_k": 1.5}, "top_k: ", "invalid_value"),
    (COMPLETIONS, {"min_tokens": -1}, "min_tokens: allowed: an integer >= 0", "invalid_value"),
    (COMPLETIONS, {"min_tokens": 5}, "min_tokens = 5: allowed: at most max_tokens (4 for this "
     "request)", "invalid_value"),
    (CHAT, {"n": 129}, "n: allowed: an integer in 1..128", "invalid_value"),
    (CHAT, {"n": True}, "n: ", "invalid_value"),
    (COMPLETIONS, {"logprobs": -1}, "logprobs: allowed: an integer in 0..20", "invalid_value"),
    (COMPLETIONS, {"logprobs": True}, "logprobs: ", "invalid_value"),
    (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs: allowed: an integer in 0..20",
     "invalid_value"),
    (CHAT, {"logprobs": 1}, "logprobs: ", "invalid_value"),
    (CHAT, {"top_logprobs": 2}, "top_logprobs: allowed only with logprobs = true",
     "invalid_value"),
    (COMPLETIONS, {"echo": True}, "echo: the prompt is not repeated", "unsupported_parameter"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools: 1 given; this server does not call tools", "unsupported_parameter"),
    (CHAT, {"tools": {}}, "tools: ", "invalid_value"),
    (CHAT, {"tool_choice": "auto"}, "tool_choice: 'auto' asks for a tool call",
     "unsupported_parameter"),
    (CHAT, {"tool_choice": "required"}, "tool_choice: 'required' asks", "unsupported_parameter"),
    (CHAT, {"tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice: a named tool asks", "unsupported_parameter"),
    (CHAT, {"response_format": {"type": "json_object"}},
     "response_format: type 'json_object': structured output is not supported",
     "unsupported_parameter"),
    (COMPLETIONS, {"response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format: type 'json_schema'", "unsupported_parameter"),
    (CHAT, {"response_format": {"type": "xml"}}, 'response_format: allowed: {"type": "text"}',
     "invalid_value"),
    (CHAT, {"response_format": "text"}, "response_format: ", "invalid_value"),
    (CHAT, {"messages": [{"role": "bogus", "content": "x"}]},
     "messages[0].role: allowed: system, developer, user, assistant", "invalid_value"),
    (CHAT, {"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]},
     "messages[0].role: 'tool' messages answer tool calls", "unsupported_parameter"),
    (CHAT, {"messages": [{"role": "user"}]}, "messages[0].content: required", "invalid_value"),
    (CHAT, {"messages": [{"role": "user", "content": None}]}, "messages[0].content: required",
     "invalid_value"),
    (CHAT, {"messages": [{"content": "x"}]}, "messages[0].role: required", "invalid_value"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content: part 0: expected {type: text, text: string}", "invalid_value"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
     "messages[0].content: part 0 has type 'input_audio'", "unsupported_parameter"),
    (COMPLETIONS, {"best_of": 2}, "best_of: unknown field", "unsupported_parameter"),
    # Issue 30: what the engine would have refused in its thread, and Python's own words.
    (COMPLETIONS, {"cache_salt": "x" * (MAX_CACHE_SALT_CHARS + 1)},
     f"cache_salt: {MAX_CACHE_SALT_CHARS + 1} characters; allowed: 1 to {MAX_CACHE_SALT_CHARS}",
     "invalid_value"),
    (CHAT, {"cache_salt": "\u00e9" * 300}, "cache_salt: 300 characters; allowed: 1 to",
     "invalid_value"),
    (CHAT, {"cache_salt": ""}, "cache_salt: 0 characters; allowed: 1 to", "invalid_value"),
    (COMPLETIONS, {"cache_salt": "t\ud800"}, "cache_salt: a lone surrogate (U+D800) at character "
     "1 is not valid Unicode; allowed: text whose", "invalid_value"),
    (COMPLETIONS, {"prompt": "hi \udcff"}, "prompt: a lone surrogate (U+DCFF) at character 3",
     "invalid_value"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]},
     "messages[0].content: a lone surrogate (U+D83D) at character 0", "invalid_value"),
    (CHAT, {"messages": [{"role": "user", "content": "x", "name": "\ude00"}]},
     "messages[0].name: a lone surrogate (U+DE00)", "invalid_value"),
    (COMPLETIONS, {"logit_bias": {"9" * 5000: 1}}, "logit_bias: token id 999999999999... (5000 "
     "digits) is outside the vocabulary (0..1023)", "invalid_value"),
    (COMPLETIONS, {"logit_bias": {"0" * 5000 + "1024": 1}}, "logit_bias: token id 1024 is "
     "outside the vocabulary (0..1023)", "invalid_value"),
    (COMPLETIONS, {"n": 128, "max_tokens": 100, "logprobs": 20},
     f"n x max_tokens x (1 + logprobs) = 128 x 100 x 21 = 268,800 logprobs; allowed: at most "
     f"{MAX_RESPONSE_LOGPROBS:,} per request", "invalid_value"),
    (CHAT, {"n": 128, "max_completion_tokens": 100, "logprobs": True, "top_logprobs": 20},
     "n x max_completion_tokens x (1 + top_logprobs) = 128 x 100 x 21", "invalid_value"),
]  # fmt: skip


def test_every_refusal_is_one_line_naming_its_field(service: FakeService, codec: TextCodec) -> None:
    with serving(service, codec) as server, httpx.Client(base_url=server.url) as http:
        for path, fields, needle, code in REFUSED:
            body = body_for(path, **fields)
            response = http.post(
                path, content=json.dumps(body), headers={"Content-Type": "application/json"}
            )
            error = one_line_error(response, 400)
            assert needle in str(error["message"]), (fields, error)
            assert error["code"] == code, (fields, error)
            assert "Traceback" not in response.text
    assert service.submitted == []  # every refusal came before the engine


def test_values_at_the_edge_of_the_new_bounds_are_taken(
    service: FakeService, codec: TextCodec
) -> None:
    salt = "\u00e9" * MAX_CACHE_SALT_CHARS
    pair = r"\ud83d\ude00"  # a surrogate pair, JSON's escape of an emoji: one character
    with serving(service, codec) as server, httpx.Client(base_url=server.url) as http:
        for path in (COMPLETIONS, CHAT):
            answer = http.post(path, json=body_for(path, cache_salt=salt, logit_bias={"01023": 1}))
            assert answer.status_code == 200, answer.text
        emoji = http.post(COMPLETIONS, content=f'{{"prompt": "{pair}", "max_tokens": 2}}')
        assert emoji.status_code == 200, emoji.text
    assert [sent.cache_salt for sent in service.submitted[:2]] == [salt, salt]
    assert service.submitted[0].options is not None
    assert service.submitted[0].options.logit_bias == ((1023, 1.0),)


def test_the_logprobs_a_request_may_ask_for_are_bounded() -> None:
    """n x tokens x (1 + top logprobs) up to MAX_RESPONSE_LOGPROBS, whatever the shape,
    the default max_tokens included; without logprobs no bound but the context's."""
    service = FakeService(max_model_tokens=MAX_RESPONSE_LOGPROBS + 8, max_prompt_tokens=8)

    def plan(**fields: object) -> int:
        chat = "messages" in fields
        model = ChatCompletionRequest if chat else CompletionRequest
        body = parse_body(model, json.dumps(fields if chat else {"prompt": [1], **fields}).encode())
        planned = plan_generation(
            (1,), body.sampling(), service, stop_token_ids=frozenset(), vocab_size=None,
            max_tokens_field=body.max_tokens_field, logprobs_field=body.logprobs_field,
        )  # fmt: skip
        return planned.max_new_tokens

    half = MAX_RESPONSE_LOGPROBS // 2
    try:
        assert plan(n=2, max_tokens=half, logprobs=0) == half
        assert plan(max_tokens=MAX_RESPONSE_LOGPROBS // 21, logprobs=20) > 0
        assert plan(n=128, max_tokens=MAX_RESPONSE_LOGPROBS) > 0  # no logprobs asked
        with pytest.raises(ApiError, match=f"= 2 x {half + 1} x 1 = ") as refused:
            plan(n=2, max_tokens=half + 1, logprobs=0)
        assert refused.value.status == 400 and refused.value.param == "logprobs"
        with pytest.raises(ApiError, match=r"n x max_tokens x \(1 \+ top_logprobs\)"):
            plan(messages=USER, logprobs=True)  # chat's default: the rest of the context
    finally:
        service.close(0)


def test_roles_and_contents_as_the_openai_api_takes_them(
    service: FakeService, codec: TextCodec
) -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        {
            "role": "system",
            "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": "kind."}],
        },
        {"role": "user", "content": "Hi", "name": "ann"},
        {"role": "assistant", "content": "Hello", "tool_calls": None, "refusal": None},
        {"role": "user", "content": "Again"},
    ]
    with serving(service, codec) as server:
        answer = httpx.post(f"{server.url}{CHAT}", json={"messages": messages, "max_tokens": 2})
    assert answer.status_code == 200, answer.text
    rendered = codec.decode(service.submitted[0].prompt_ids, skip_special_tokens=False)
    assert "developer\nBe brief." in rendered and "system\nBe\nkind." in rendered


# -- max_tokens by default: completions 16, chat the rest of the context ----------------


def test_default_max_tokens_follow_vllm(codec: TextCodec) -> None:
    service = FakeService(reply_ids=reply_ids(codec), max_prompt_tokens=256)
    try:
        with serving(service, codec) as server, httpx.Client(base_url=server.url) as http:
            api = client(server.url)
            api.completions.create(model="fake-model", prompt=PROMPT)
            http.post(COMPLETIONS, json={"prompt": PROMPT, "max_tokens": None})
            http.post(COMPLETIONS, json={"prompt": [1] * 250})  # 6 tokens of room: 6, not 16
            full = http.post(COMPLETIONS, json={"prompt": [1] * 256})
            api.chat.completions.create(model="fake-model", messages=USER)  # type: ignore[arg-type]
    finally:
        service.close(0)
    sent = service.submitted
    assert [r.max_new_tokens for r in sent[:3]] == [16, 16, 6]
    assert "context is 256 tokens; the prompt has 256" in str(one_line_error(full, 400)["message"])
    assert sent[3].max_new_tokens == 256 - len(sent[3].prompt_ids)


# -- n choices ---------------------------------------------------------------------------


def test_n_choices_whole_and_streamed(service: FakeService, codec: TextCodec) -> None:
    with serving(service, codec) as server:
        api = client(server.url)
        whole = api.completions.create(model="fake-model", prompt=PROMPT, n=3, max_tokens=5,
                                       seed=11, temperature=1.0)  # fmt: skip
        chunks = list(
            api.chat.completions.create(
                model="fake-model", messages=USER, n=2, max_tokens=64, stream=True,  # type: ignore[arg-type]
                stream_options={"include_usage": True},
            )
        )  # fmt: skip
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert all(c.text == codec.decode(reply_ids(codec)[:5]) for c in whole.choices)
    assert whole.usage is not None and whole.usage.completion_tokens == 15  # summed
    assert whole.usage.prompt_tokens == len(codec.encode(PROMPT))  # the prompt, once
    seeds = [r.seed for r in service.submitted[:3]]
    assert seeds[0] == 11 and len(set(seeds)) == 3  # each choice draws with its own seed
    by_index: dict[int, list[Any]] = {0: [], 1: []}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        by_index[choice.index].append(choice)
    for choices in by_index.values():
        assert choices[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in choices) == REPLY_TEXT
        assert [c.finish_reason for c in choices][-1] == "stop"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens == 2 * len(reply_ids(codec))


def test_a_refused_choice_leaves_no_other_queued(codec: TextCodec) -> None:
    fake = FakeService(reply_ids=reply_ids(codec), max_open_requests=2)
    try:
        with serving(fake, codec) as server:
            refused = httpx.post(f"{server.url}{COMPLETIONS}", json=body_for(COMPLETIONS, n=3))
            one_line_error(refused, 429)
            assert fake.cancelled == [0, 1]  # the two choices queued before the refusal
            assert httpx.post(f"{server.url}{COMPLETIONS}", json=body_for(COMPLETIONS, n=2))
    finally:
        fake.close(0)


# -- logprobs: the OpenAI shapes ---------------------------------------------------------


def test_chat_logprobs_whole_and_streamed(service: FakeService, codec: TextCodec) -> None:
    with serving(service, codec) as server:
        api = client(server.url)
        whole = api.chat.completions.create(
            model="fake-model",
            messages=USER,
            max_tokens=3,
            logprobs=True,
            top_logprobs=2,  # type: ignore[arg-type]
        )
        chunks = list(
            api.chat.completions.create(
                model="fake-model",
                messages=USER,
                max_tokens=3,
                logprobs=True,
                stream=True,  # type: ignore[arg-type]
            )
        )
        plain = api.chat.completions.create(model="fake-model", messages=USER, max_tokens=3)  # type: ignore[arg-type]
    ids = reply_ids(codec)[:3]
    logprobs = whole.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [item.token for item in logprobs.content] == [codec.decode([t]) for t in ids]
    first = logprobs.content[0]
    assert first.logprob == -0.25 and first.bytes == list(first.token.encode())
    assert [(t.token, t.logprob) for t in first.top_logprobs] == [
        (codec.decode([ids[0]]), -0.25), (codec.decode([ids[0] + 1]), -1.25),
    ]  # fmt: skip
    streamed = [
        item for chunk in chunks for choice in chunk.choices if choice.logprobs
        for item in choice.logprobs.content or []
    ]  # fmt: skip
    assert [item.token for item in streamed] == [codec.decode([t]) for t in ids]
    assert all(item.top_logprobs == [] for item in streamed)  # top_logprobs absent: none
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_shape(service: FakeService, codec: TextCodec) -> None:
    with serving(service, codec) as server:
        whole = client(server.url).completions.create(
            model="fake-model", prompt=PROMPT, max_tokens=4, logprobs=2
        )
        zero = client(server.url).completions.create(
            model="fake-model", prompt=PROMPT, max_tokens=2, logprobs=0
        )
    ids = reply_ids(codec)[:4]
    texts = [codec.decode([t]) for t in ids]
    logprobs = whole.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens == texts and logprobs.token_logprobs == [-0.25] * 4
    offsets = [sum(len(t) for t in texts[:i]) for i in range(4)]
    assert logprobs.text_offset == offsets
    assert logprobs.top_logprobs is not None
    assert logprobs.top_logprobs[0] == {texts[0]: -0.25, codec.decode([ids[0] + 1]): -1.25}
    assert zero.choices[0].logprobs is not None
    assert zero.choices[0].logprobs.top_logprobs == [{texts[0]: -0.25}, {texts[1]: -0.25}]


def test_without_a_tokenizer_logprobs_name_token_ids(service: FakeService) -> None:
    with serving(service, None) as server:
        answer = httpx.post(
            f"{server.url}{COMPLETIONS}", json={"prompt": [1, 2], "max_tokens": 2, "logprobs": 1}
        )
    first = reply_ids(builtin_codec(1024))[0]
    assert answer.json()["choices"][0]["logprobs"]["tokens"][0] == f"token_id:{first}"


# -- usage and logprobs after a stop string ----------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_usage_after_a_stop_string_counts_what_the_client_got(
    codec: TextCodec, stream: bool
) -> None:
    # The fake keeps sampling for a while after stop_early (as an engine between steps).
    fake = FakeService(reply_ids=reply_ids(codec), tokens_after_stop=3)
    ids = reply_ids(codec)
    upto = next(k for k in range(1, len(ids)) if "world" in codec.decode(ids[:k]))
    body = {"prompt": PROMPT, "max_tokens": 20, "stop": "world", "logprobs": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    try:
        with serving(fake, codec) as server:
            response = httpx.post(f"{server.url}{COMPLETIONS}", json=body, timeout=DEADLINE_S)
    finally:
        fake.close(0)
    if stream:
        chunks = events(response)
        usage = chunks[-1]["usage"]
        tokens = [t for c in chunks for ch in c["choices"] if ch["logprobs"]
                  for t in ch["logprobs"]["tokens"]]  # fmt: skip
        text = "".join(ch["text"] for c in chunks for ch in c["choices"])
    else:
        answer = response.json()
        usage, choice = answer["usage"], answer["choices"][0]
        tokens, text = choice["logprobs"]["tokens"], choice["text"]
    assert text == "Hello "
    assert usage["completion_tokens"] == upto == len(tokens)


def test_a_stop_string_is_looked_for_from_min_tokens_on(
    service: FakeService, codec: TextCodec
) -> None:
    ids = reply_ids(codec)
    hello = next(k for k in range(1, len(ids)) if "Hello" in codec.decode(ids[:k]))
    with serving(service, codec) as server, httpx.Client(base_url=server.url) as http:
        late = http.post(COMPLETIONS, json={"prompt": PROMPT, "stop": ["Hello", " is"],
                                            "min_tokens": hello + 1, "max_tokens": 30})  # fmt: skip
        early = http.post(COMPLETIONS, json={"prompt": PROMPT, "stop": "Hello", "max_tokens": 30})
    assert late.json()["choices"][0]["text"] == "Hello world, this"
    assert early.json()["choices"][0]["text"] == ""
