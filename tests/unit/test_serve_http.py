"""The OpenAI-compatible HTTP app over a fake engine (issue 12, the HTTP side).

The app runs under uvicorn on a free loopback port in a background thread and is
driven by the official `openai` client for completions and chat, streaming and
not; raw HTTP (httpx) sends what no client library would: malformed JSON, wrong
types, unknown fields. The text is the built-in byte-level codec of the presets.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from starlette.testclient import TestClient

from kvswap.cli import build_parser
from kvswap.commands import serve as serve_command
from kvswap.errors import KvSwapError
from kvswap.serve.app import AppSettings, body_limit_bytes, build_app
from kvswap.serve.http_server import bind_listener
from kvswap.serve.tokenizer import TextCodec, builtin_codec

from .cli_checks import cli, forbid, one_error_line
from .serve_fakes import (
    DEADLINE_S,
    FakeService,
    RunningServer,
    finish_process,
    kvswap_process,
    serving,
    wait_for_line,
)

REPLY_TEXT = "Hello world, this is kvswap."
PROMPT = "Say hello."


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return builtin_codec(1024)


def reply_ids(codec: TextCodec) -> tuple[int, ...]:
    """The fake's reply: the text, then the end-of-sequence token."""
    eos = min(codec.eos_token_ids)
    return (*codec.encode(REPLY_TEXT, add_special_tokens=False), eos)


@pytest.fixture
def service(codec: TextCodec) -> Iterator[FakeService]:
    fake = FakeService(reply_ids=reply_ids(codec))
    yield fake
    fake.close(0)


def client(url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=DEADLINE_S)


# -- completions and chat through the openai client --------------------------------------


def test_completion_whole_and_streamed(service: FakeService, codec: TextCodec) -> None:
    service.cached_tokens = 2
    with serving(service, codec) as server:
        api = client(server.url)
        whole = api.completions.create(
            model="fake-model", prompt=PROMPT, max_tokens=64, temperature=0.5, top_p=0.9,
            seed=7, extra_body={"cache_salt": "tenant-a"},
        )  # fmt: skip
        chunks = list(
            api.completions.create(
                model="fake-model", prompt=PROMPT, max_tokens=64, stream=True,
                stream_options={"include_usage": True},
            )
        )  # fmt: skip
    assert whole.id.startswith("cmpl-") and whole.object == "text_completion"
    assert whole.model == "fake-model"
    assert whole.choices[0].text == REPLY_TEXT and whole.choices[0].finish_reason == "stop"
    prompt_ids = codec.encode(PROMPT, add_special_tokens=True)
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == len(prompt_ids)
    assert whole.usage.completion_tokens == len(reply_ids(codec))  # the EOS counts
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert whole.usage.prompt_tokens_details is not None
    assert whole.usage.prompt_tokens_details.cached_tokens == 2
    sent = service.submitted[0]
    assert sent.prompt_ids == tuple(prompt_ids) and sent.max_new_tokens == 64
    assert (sent.temperature, sent.top_p, sent.seed, sent.cache_salt) == (0.5, 0.9, 7, "tenant-a")
    assert sent.stop_token_ids == codec.eos_token_ids
    # Streamed: the same text in pieces, one id for every chunk, usage last.
    assert len({chunk.id for chunk in chunks}) == 1
    assert all(chunk.object == "text_completion" for chunk in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == REPLY_TEXT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_whole_and_streamed(service: FakeService, codec: TextCodec) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    with serving(service, codec) as server:
        api = client(server.url)
        whole = api.chat.completions.create(
            model="fake-model", messages=messages, max_completion_tokens=5
        )
        chunks = list(
            api.chat.completions.create(model="fake-model", messages=messages, stream=True)
        )
    assert whole.id.startswith("chatcmpl-") and whole.object == "chat.completion"
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.message.content == codec.decode(reply_ids(codec)[:5])
    assert service.submitted[0].prompt_ids == tuple(codec.encode_chat(messages))
    assert service.submitted[0].max_new_tokens == 5
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == REPLY_TEXT
    assert chunks[-1].choices[0].finish_reason == "stop"
    # Without max_tokens the request may use the rest of the model's context.
    assert service.submitted[1].max_new_tokens == 256 - len(service.submitted[1].prompt_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_the_request_early(
    service: FakeService, codec: TextCodec, stream: bool
) -> None:
    with serving(service, codec) as server:
        api = client(server.url)
        if stream:
            pieces = api.completions.create(
                model="fake-model", prompt=PROMPT, stop=["world", "zzz"], stream=True
            )
            chunks = [c for c in pieces if c.choices]
            text = "".join(c.choices[0].text for c in chunks)
            finish_reason = chunks[-1].choices[0].finish_reason
        else:
            whole = api.completions.create(model="fake-model", prompt=PROMPT, stop="world")
            text, finish_reason = whole.choices[0].text, whole.choices[0].finish_reason
    assert text == "Hello " and finish_reason == "stop"  # the stop string is left out
    assert service.stopped_early == [0] and service.cancelled == []


def test_token_id_prompts(service: FakeService, codec: TextCodec) -> None:
    with serving(service, codec) as server:
        api = client(server.url)
        flat = api.completions.create(model="fake-model", prompt=[5, 6, 7], max_tokens=2)
        nested = api.completions.create(model="fake-model", prompt=[[5, 6, 7]], max_tokens=2)
    assert flat.choices[0].text == nested.choices[0].text == codec.decode(reply_ids(codec)[:2])
    assert [r.prompt_ids for r in service.submitted] == [(5, 6, 7), (5, 6, 7)]


def test_without_a_tokenizer_only_token_ids_work(service: FakeService) -> None:
    with TestClient(build_app(service, None)) as http:
        answer = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3})
        text = http.post("/v1/completions", json={"prompt": "hello"})
        messages = [{"role": "user", "content": "x"}]
        chat = http.post("/v1/chat/completions", json={"messages": messages})
        stop = http.post("/v1/completions", json={"prompt": [1], "stop": "x"})
    assert answer.status_code == 200
    choice = answer.json()["choices"][0]
    assert choice["text"] == "" and choice["token_ids"] == list(service.reply_ids[:3])
    assert service.submitted[0].stop_token_ids == frozenset()
    for refused, param in ((text, "prompt"), (chat, "prompt"), (stop, "stop")):
        error = one_line_error(refused, 400)
        assert error["code"] == "no_tokenizer" and error["param"] == param


def test_models_health_metrics(service: FakeService, codec: TextCodec) -> None:
    with serving(service, codec) as server:
        models = client(server.url).models.list()
        card = client(server.url).models.retrieve("fake-model")
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client(server.url).models.retrieve("gpt-9")
        with httpx.Client(base_url=server.url) as http:
            health = http.get("/health")
            metrics = http.get("/metrics")
    assert [m.id for m in models.data] == ["fake-model"]
    assert models.data[0].model_dump()["max_model_len"] == 256
    assert card.model_dump() == models.data[0].model_dump()
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert metrics.status_code == 200 and "kvswap_fake_requests_total 1" in metrics.text
    assert metrics.headers["content-type"].startswith("text/plain")
    line = server.stdout.getvalue().strip()
    assert line == f"kvswap serve: listening on {server.url} (model fake-model)"
    assert service.closed_with_s == [5.0]  # the server closed the service as it stopped


def test_a_dead_engine_fails_health_and_stops_the_server(
    service: FakeService, codec: TextCodec
) -> None:
    service.alive = False
    with TestClient(build_app(service, codec)) as http:
        sick = http.get("/health")
    assert one_line_error(sick, 503)["code"] == "service_unavailable"
    running = RunningServer(build_app(service, codec), service)
    with running:
        running.wait_until_stopped()  # on its own: the engine is gone
    assert isinstance(running.error, KvSwapError) and "engine stopped" in str(running.error)
    assert service.closed_with_s == [5.0]


# -- what a client can get wrong: one line, the right status, the server goes on ---------


def one_line_error(response: Any, status: int) -> dict[str, object]:
    """The OpenAI error object of `response` (httpx's, or the test client's)."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and "\n" not in error["message"]
    return dict(error)


BAD_REQUESTS: list[tuple[str, str | bytes | dict[str, object], int, str]] = [
    ("/v1/completions", b'{"prompt": "hi",', 400, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, "expected a JSON object"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": 3}, 400, "[0.001, 2]"),
    ("/v1/completions", {"prompt": "hi", "temperature": 1e-9}, 400, "0 (greedy) or"),
    ("/v1/completions", {"prompt": "hi", "temperature": 1, "seed": 2**63}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": -1}, 400, "0..9223372036854775807"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "temperature": 1e-9}, 400, "temperature"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt: required"),
    ("/v1/completions", {"prompt": {"text": "hi"}}, 400, "prompt: expected a string"),
    ("/v1/completions", {"prompt": "hi", "best_of": 2}, 400, "best_of: unknown field"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n: allowed: an integer in 1..128"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs: allowed: an integer"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "a batch of 2 prompts"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-9"}, 404, "'gpt-9' does not exist"),
    ("/v1/completions", {"prompt": "x" * 300}, 413, "allowed: at most 128"),
    ("/v1/completions", {"prompt": [100] * 30_000}, 413, "at most 128"),  # a 150 KB body
    ("/v1/completions", {"prompt": [1] * 100, "max_tokens": 200}, 400, "context is 256"),
    ("/v1/completions", {"prompt": [5000]}, 400, "outside the vocabulary"),
    ("/v1/completions", {"prompt": [], "max_tokens": 1}, 400, "prompt: empty"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a"] * 5}, 400, "at most 4"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "only with stream"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
     400, "messages[0].tool_calls: unknown field"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, "allowed only with logprobs = true"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "only text parts"),
    ("/v1/nowhere", {}, 404, "no such route"),
]  # fmt: skip


def test_bad_requests_get_one_line_and_the_server_goes_on(
    service: FakeService, codec: TextCodec
) -> None:
    with serving(service, codec) as server, httpx.Client(base_url=server.url) as http:
        for path, body, status, needle in BAD_REQUESTS:
            if isinstance(body, dict):
                response = http.post(path, json=body)
            else:
                response = http.post(path, content=body)
            error = one_line_error(response, status)
            assert needle in str(error["message"]), (body, error)
            good = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert good.status_code == 200, good.text
        wrong_method = http.get("/v1/completions")
    one_line_error(wrong_method, 405)
    # Every refusal came before submit: only the good requests reached the engine.
    assert len(service.submitted) == len(BAD_REQUESTS)


def test_body_over_the_byte_limit(service: FakeService, codec: TextCodec) -> None:
    with TestClient(build_app(service, codec, AppSettings(max_body_bytes=1000))) as http:
        response = http.post("/v1/completions", json={"prompt": "x" * 2000})
    assert "over 1000 bytes" in str(one_line_error(response, 413)["message"])


def test_a_text_that_cannot_fit_is_refused_before_it_is_tokenized(
    service: FakeService, codec: TextCodec, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 128 tokens of at most 12 characters each: 1,536 characters can still fit.
    assert codec.max_prompt_chars(service.max_prompt_tokens) == 128 * 12

    def no_tokenizing(*args: object, **kwargs: object) -> list[int]:
        raise AssertionError("a text that cannot fit was tokenized")

    monkeypatch.setattr(codec, "encode", no_tokenizing)
    monkeypatch.setattr(codec, "encode_chat", no_tokenizing)
    long_text = "x" * (4 * 2**20)  # 4 MiB: under the body limit, far over the prompt's
    with TestClient(build_app(service, codec)) as http:
        completion = http.post("/v1/completions", json={"prompt": long_text})
        chat = http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": long_text[:1000]}] * 2},
        )
    message = str(one_line_error(completion, 413)["message"])
    assert message.startswith("prompt: 4194304 characters cannot fit in 128 tokens")
    assert "at most 1536 characters" in message
    assert "messages: 2000 characters" in str(one_line_error(chat, 413)["message"])
    assert not service.submitted


def test_the_body_limit_follows_from_the_longest_prompt(codec: TextCodec) -> None:
    # Each token: 12 characters of 12 escaped bytes at most, plus 48 bytes of framing.
    assert body_limit_bytes(4064, codec) == 4064 * (12 * 12 + 48) + 64 * 1024
    assert body_limit_bytes(4064, None) == 4064 * 48 + 64 * 1024  # token ids only
    assert body_limit_bytes(4064, codec) < 1024**2  # not the 32 MiB default


def test_a_hundred_thousand_bad_messages_cost_one_short_line(
    service: FakeService, codec: TextCodec
) -> None:
    body = {"messages": [{"role": "user", "content": 5}] * 100_000}
    with TestClient(build_app(service, codec)) as http:
        response = http.post("/v1/chat/completions", json=body)
    message = str(one_line_error(response, 400)["message"])
    assert message.endswith("and 99995 more") and len(message) < 1000
    assert message.count("messages[") == 5


def test_accepted_extras_and_a_bug_as_an_error_object(
    service: FakeService, codec: TextCodec, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = {"prompt": "hi", "max_tokens": 2, "user": "u1", "ignore_eos": True, "n": 1,
            "logprobs": None, "seed": 2**63 - 1, "stop": None}  # fmt: skip
    with TestClient(build_app(service, codec), raise_server_exceptions=False) as http:
        accepted = http.post("/v1/completions", json=body)

        def broken(request: object) -> object:
            raise RuntimeError("a bug")

        monkeypatch.setattr(service, "submit", broken)
        failed = http.post("/v1/completions", json=body)
    assert accepted.status_code == 200, accepted.text
    assert service.submitted[0].stop_token_ids == frozenset()  # ignore_eos
    assert service.submitted[0].seed == 2**63 - 1
    error = one_line_error(failed, 500)
    assert error["code"] == "internal_error" and "RuntimeError" in str(error["message"])


def test_api_key(service: FakeService, codec: TextCodec) -> None:
    with serving(service, codec, AppSettings(api_key="s3cret")) as server:
        with pytest.raises(openai.AuthenticationError):
            client(server.url, api_key="wrong").completions.create(model="fake-model", prompt="x")
        with httpx.Client(base_url=server.url) as http:
            missing = http.post("/v1/completions", json={"prompt": "hi"})
            health = http.get("/health")  # probes need no key
        good = client(server.url, api_key="s3cret").completions.create(
            model="fake-model", prompt="hi", max_tokens=1
        )
    error = one_line_error(missing, 401)
    assert error["code"] == "invalid_api_key" and "missing" in str(error["message"])
    assert missing.headers["www-authenticate"] == "Bearer"
    assert health.status_code == 200 and good.choices[0].finish_reason == "length"
    assert len(service.submitted) == 1


def test_full_queue_is_429_with_retry_after(codec: TextCodec) -> None:
    service = FakeService(reply_ids=reply_ids(codec)[:-1], max_open_requests=1, step_s=0.02)
    with serving(service, codec) as server, httpx.Client(base_url=server.url) as http:
        body = {"prompt": "hi", "max_tokens": 200, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as first:
            # Keep the iterator: a dropped one closes the connection (and so the request).
            lines = first.iter_lines()
            next(lines)  # the first request holds the only slot
            refused = http.post("/v1/completions", json={"prompt": "hi"})
        assert service.cancel_seen.wait(DEADLINE_S)  # leaving the stream cancelled it
    error = one_line_error(refused, 429)
    assert refused.headers["retry-after"] == "3"  # 2.5 s, rounded up
    assert error["code"] == "too_many_requests"
    service.close(0)


# -- clients that leave, a server that stops ---------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_client_leaving_cancels_its_request(codec: TextCodec, stream: bool) -> None:
    service = FakeService(reply_ids=reply_ids(codec)[:-1], step_s=0.02)
    body = {"prompt": "hi", "max_tokens": 200, "stream": stream}
    with serving(service, codec) as server:
        if stream:
            with (
                httpx.Client(base_url=server.url) as http,
                http.stream("POST", "/v1/completions", json=body) as response,
            ):
                lines = response.iter_lines()  # kept: a dropped one closes the connection
                next(lines), next(lines)
        else:
            with pytest.raises(httpx.TimeoutException):
                httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.3)
        assert service.cancel_seen.wait(DEADLINE_S)
    assert service.cancelled == [0] and service.stopped_early == []
    service.close(0)


def test_stopping_service_is_503_and_aborted_stream_ends_with_an_error(
    codec: TextCodec,
) -> None:
    service = FakeService(reply_ids=reply_ids(codec)[:-1], step_s=0.02)
    body = {"prompt": "hi", "max_tokens": 200, "stream": True}
    with TestClient(build_app(service, codec)) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            service.close(0)  # aborts the open request, refuses new ones
            events = [line for line in lines if line]
        refused = http.post("/v1/completions", json={"prompt": "hi"})
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "request_aborted" and "stopping" in error["message"]
    assert one_line_error(refused, 503)["code"] == "service_unavailable"


# -- the command: flags, the listener, a real engine stopped by a signal ------------------


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--port", "70000"], "--port 70000: allowed: 0..65535"),
        (["--max-prompt-tokens", "0"], "--max-prompt-tokens 0"),
        (["--max-waiting-requests", "-1"], "--max-waiting-requests -1"),
        (["--shutdown-timeout-s", "nan"], "--shutdown-timeout-s nan"),
        (["--header-read-timeout-s", "0"], "--header-read-timeout-s 0.0: allowed: a number > 0"),
        (["--body-read-timeout-s", "nan"], "--body-read-timeout-s nan: allowed: a number > 0"),
        (["--api-key", " "], "--api-key: empty"),
        (["--served-model-name", ""], "--served-model-name: empty"),
        (["--host", "no-such-host.invalid", "--port", "0"], "--host no-such-host.invalid"),
    ],
)
def test_serve_flags_are_checked_before_any_work(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, argv: list[str],
    needle: str,
) -> None:  # fmt: skip
    forbid(monkeypatch, serve_command, "_serve_on")
    code, _, err = cli(capsys, "serve", *argv)
    assert code == 2 and needle in one_error_line(err)


def test_a_taken_port_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    forbid(monkeypatch, serve_command, "_serve_on")
    taken = bind_listener("127.0.0.1", 0)
    taken.listen()
    try:
        port = taken.getsockname()[1]
        code, _, err = cli(capsys, "serve", "--port", str(port))
    finally:
        taken.close()
    assert code == 2 and f"--port {port}: cannot listen" in one_error_line(err)


def test_a_non_loopback_host_warns(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(serve_command, "_serve_on", lambda *args: 0)
    monkeypatch.setenv("KVSWAP_API_KEY", "from-env")
    code, _, err = cli(capsys, "serve", "--host", "0.0.0.0", "--port", "0")
    assert code == 0
    assert err.startswith("kvswap: warning: --host 0.0.0.0 is not a loopback address")
    assert "--api-key" not in err  # the key came from the environment
    parser = build_parser()
    args = parser.parse_args(["serve", "--gpu-kv-capacity-blocks", "4", "--config", "x.toml"])
    assert args.cfg_gpu_kv_capacity_blocks == "4" and args.config == "x.toml"
    assert serve_command.api_key(args) == "from-env"


def test_sigterm_stops_a_real_server_cleanly(tmp_path: Path) -> None:
    """`kvswap serve` on the tiny model with an NVMe tier: answers the openai client,
    then SIGTERM ends it with exit 0, one stop line, no traceback, no slab left."""
    process = kvswap_process(
        "serve", "--model", "tiny", "--device", "cpu", "--port", "0", "--block-tokens", "8",
        "--gpu-kv-capacity-blocks", "32", "--cpu-kv-capacity-blocks", "8",
        "--nvme-kv-capacity-blocks", "16", "--nvme-dir", str(tmp_path),
        "--shutdown-timeout-s", "5",
    )  # fmt: skip
    try:
        line = wait_for_line(process, "kvswap serve: listening on ")
        url = line.split("listening on ")[1].split()[0]
        assert len(list(tmp_path.iterdir())) == 1  # the slab, while serving
        api = client(url)
        answer = api.completions.create(model="tiny", prompt="Hello", max_tokens=4)
        chat = api.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
        )
        process.send_signal(signal.SIGTERM)
        code, err = finish_process(process)
    finally:
        if process.poll() is None:
            process.kill()
    assert answer.usage is not None and answer.usage.completion_tokens <= 4
    assert chat.choices[0].message.role == "assistant"
    assert code == 0, err
    assert "Traceback" not in err and err.strip().endswith("kvswap serve: stopped by SIGTERM")
    assert list(tmp_path.iterdir()) == []
