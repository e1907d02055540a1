"""No request can stop `kvswap serve`: every field of both endpoints, fuzzed, against
one live server (a child process, as users run it).

The invariant, after every generated request: the answer is a success or an
OpenAI error object of one line with a client status (never 500 or 503), and
the server still answers /health and the next valid request.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvswap.base.identity import MAX_CACHE_SALT_CHARS
from tests.integration.test_serve_end_to_end import server

#: The client statuses a request may get; anything else (500, 503) is a server failure.
CLIENT_STATUSES = frozenset({200, 400, 404, 413, 429})
#: A request's seconds at most: the tiny model fills its 256-token context in well under.
REQUEST_TIMEOUT_S = 60

ODD = st.one_of(
    st.none(), st.booleans(), st.text(max_size=8), st.lists(st.integers(), max_size=3),
    st.floats(), st.integers(-(2**70), 2**70), st.dictionaries(st.text(max_size=3), st.none()),
)  # fmt: skip
EDGE_NUMBERS = st.sampled_from(
    [0, 1, 2, -1, 1e-9, 1e-50, 5e-324, 1e-46, 1e-3, 2.000001, 1e308, 0.999999, -0.0]
)
TEXT = st.text(max_size=60)
TEXT_PART = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"])},
    optional={"content": st.one_of(TEXT, st.lists(TEXT_PART, max_size=3)), "name": TEXT},
)
#: Every field of both endpoints, each with values the server must accept...
VALID: dict[str, st.SearchStrategy[Any]] = {
    "model": st.just("tiny"),
    "temperature": st.one_of(st.just(0), st.floats(1e-3, 2.0)),
    "top_p": st.one_of(st.floats(1e-300, 1.0, exclude_min=True), st.sampled_from([1e-50, 1e-46])),
    "seed": st.integers(0, 2**63 - 1),
    "stop": st.one_of(st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1), max_size=4)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "user": TEXT,
    "cache_salt": st.text(min_size=1, max_size=8),
    "ignore_eos": st.booleans(),
    "n": st.integers(1, 3),
    "top_k": st.integers(-1, 300),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.floats(0.01, 100.0),
    "logit_bias": st.dictionaries(
        st.integers(0, 255).map(str), st.floats(-100.0, 100.0), max_size=3
    ),
    "min_tokens": st.integers(0, 1),
    "response_format": st.just({"type": "text"}),
}
TOKEN_IDS = st.lists(st.integers(0, 255), min_size=1, max_size=40)
#: max_tokens always: without it a request generates to the end of the context (slow
#: here); a mutation may still drop it (None).
MAX_TOKENS = st.integers(1, 8)
COMPLETION_ONLY = {"prompt": st.one_of(TEXT, TOKEN_IDS), "max_tokens": MAX_TOKENS}
COMPLETION_OPTIONAL = {"logprobs": st.integers(0, 20), "echo": st.just(False)}
CHAT_ONLY = {"messages": st.lists(MESSAGE, min_size=1, max_size=4), "max_tokens": MAX_TOKENS}
CHAT_OPTIONAL = {
    "max_completion_tokens": MAX_TOKENS, "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 20), "tools": st.just([]), "tool_choice": st.just("none"),
}  # fmt: skip
#: ... and values it must refuse (or that are edges of a range).
ODD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.one_of(st.integers(-3, 400), st.integers(-(2**70), 2**70)),
    "temperature": EDGE_NUMBERS,
    "top_p": EDGE_NUMBERS,
    "seed": st.sampled_from([2**63, 2**64 - 1, 2**64, -(2**63), -1]),
    "prompt": st.one_of(st.lists(st.integers(-5, 300), max_size=40), st.lists(TEXT, max_size=2)),
    "messages": st.lists(
        st.fixed_dictionaries({}, optional={"role": st.one_of(TEXT, ODD), "content": ODD}),
        max_size=4,
    ),
    # Out of range only: a valid n of up to 128 choices with up to 400 tokens each is
    # minutes of CPU work on this machine (test_serve_fields covers n = 128).
    "n": st.sampled_from([-1, 0, 129, 200, 2**70]),
    "logprobs": st.integers(-1, 25),
    "top_logprobs": st.integers(-1, 25),
    "presence_penalty": EDGE_NUMBERS,
    "frequency_penalty": EDGE_NUMBERS,
    "repetition_penalty": EDGE_NUMBERS,
    "top_k": st.one_of(st.integers(-3, 2**70), EDGE_NUMBERS),
    "min_tokens": st.integers(-3, 400),
    "logit_bias": st.dictionaries(st.one_of(st.text(max_size=4), st.integers(-1, 300).map(str)),
                                  st.one_of(EDGE_NUMBERS, st.floats(), ODD), max_size=3),
    "tools": st.lists(ODD, max_size=2),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]), ODD),
    "response_format": st.one_of(st.fixed_dictionaries({"type": TEXT}), ODD),
    "echo": ODD,
    # Past the engine's limit, and text no UTF-8 encodes: both once stopped its thread.
    "cache_salt": st.one_of(st.text(min_size=MAX_CACHE_SALT_CHARS - 4,
                                    max_size=MAX_CACHE_SALT_CHARS + 40),
                            st.sampled_from(["\ud800", "tenant\udcff"])),
}  # fmt: skip
FIELDS = sorted(
    {*VALID, *ODD_VALUES, *COMPLETION_ONLY, *COMPLETION_OPTIONAL, *CHAT_ONLY, *CHAT_OPTIONAL}
)


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A valid request of either endpoint (optional fields drawn at random), then up to
    two fields replaced by a wrong type, an edge of their range or an unknown field."""
    chat = draw(st.booleans())
    required = CHAT_ONLY if chat else COMPLETION_ONLY
    optional = VALID | (CHAT_OPTIONAL if chat else COMPLETION_OPTIONAL)
    body = draw(st.fixed_dictionaries(required, optional=optional))
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=2, unique=True)):
        body[name] = draw(st.one_of(ODD_VALUES.get(name, ODD), ODD))
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


JSON_HEADERS = {"Content-Type": "application/json"}
GOOD = {"prompt": [5, 17, 99], "max_tokens": 1}


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with (
        server("--gpu-kv-capacity-blocks", "32", "--cpu-kv-capacity-blocks", "64") as url,
        httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S) as client,
    ):
        yield client


def check_answer(response: httpx.Response, streamed: bool) -> None:
    assert response.status_code in CLIENT_STATUSES, response.text[:500]
    if response.status_code != 200:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert "\n" not in error["message"] and len(error["message"]) < 2000
    elif streamed:
        events = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        for event in events[:-1]:
            assert "error" not in json.loads(event[len("data: ") :]), event


def test_a_salt_the_engine_would_refuse_is_refused_at_the_edge(http: httpx.Client) -> None:
    """Issue 30: a salt past MAX_CACHE_SALT_CHARS (or not valid Unicode) passed the HTTP
    model and raised in the engine thread, which stopped: every later request got 503."""
    for salt in ("x" * (MAX_CACHE_SALT_CHARS + 1), "\u00e9" * 300, "a\udcff"):
        body = {"prompt": "hi", "max_tokens": 2, "cache_salt": salt}
        answer = http.post("/v1/completions", content=json.dumps(body), headers=JSON_HEADERS)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "cache_salt"
        assert http.get("/health").status_code == 200
    good = {**GOOD, "cache_salt": "x" * MAX_CACHE_SALT_CHARS}
    assert http.post("/v1/completions", json=good).status_code == 200


@settings(
    max_examples=500,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=requests())
def test_no_request_stops_the_server(
    http: httpx.Client, request: tuple[str, dict[str, Any]]
) -> None:
    path, body = request
    # Encoded here: json.dumps writes NaN and Infinity, which the server must refuse.
    content = json.dumps(body).encode()
    with http.stream("POST", path, content=content, headers=JSON_HEADERS) as response:
        response.read()
    check_answer(response, streamed=body.get("stream") is True)
    assert http.get("/health").status_code == 200
    assert http.post("/v1/completions", json=GOOD).status_code == 200
