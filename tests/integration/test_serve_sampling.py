"""Sampling as clients use it (issue 22, item 1): the official `openai` client against a
live `kvswap serve --model tiny` (a child process on a free loopback port, stopped by
SIGTERM at the end of the module).

Exact mode (`--batch-invariant`), so a request's logits do not depend on what shares
its batch; what these tests add is that its *draws* do not either: a seeded request
gives the same text alone, beside other requests in any order, and under whatever
sequence id the server gives it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator

import openai
import pytest

from tests.integration.test_serve_end_to_end import api, server

PROMPT = "Write one line about tiered memory."
MESSAGES = [{"role": "user", "content": PROMPT}]
SEEDED = {"temperature": 1.0, "seed": 42, "max_tokens": 24}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with server("--gpu-kv-capacity-blocks", "64", "--cpu-kv-capacity-blocks", "32") as running:
        yield running


def seeded_completion(client: openai.OpenAI, **fields: object) -> str:
    answer = client.completions.create(model="tiny", prompt=PROMPT, **{**SEEDED, **fields})  # type: ignore[call-overload]
    return str(answer.choices[0].text)


async def in_a_crowd(url: str, position: int, companions: int) -> str:
    """The seeded request sent together with `companions` others (other prompts, seeds,
    temperatures, some streamed), at `position` among them; returns its text."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

    async def other(index: int) -> str:
        if index % 2:
            stream = await client.completions.create(
                model="tiny", prompt=f"Other request {index}: " + "abc " * index,
                max_tokens=30, temperature=0.7, seed=index, stream=True,
            )  # fmt: skip
            return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
        chat = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"Chat {index}"}], max_tokens=20,
        )  # fmt: skip
        return chat.choices[0].message.content or ""

    async def mine() -> str:
        answer = await client.completions.create(model="tiny", prompt=PROMPT, **SEEDED)  # type: ignore[call-overload]
        return str(answer.choices[0].text)

    tasks = [other(i) for i in range(companions)]
    tasks.insert(position, mine())
    try:
        texts = await asyncio.gather(*tasks)
    finally:
        await client.close()
    return texts[position]


def test_a_seed_gives_the_same_text_whatever_shares_the_batch(url: str) -> None:
    client = api(url)
    alone = seeded_completion(client)
    assert alone  # the tiny model has something to say at temperature 1
    assert asyncio.run(in_a_crowd(url, position=0, companions=3)) == alone
    assert asyncio.run(in_a_crowd(url, position=4, companions=5)) == alone
    assert seeded_completion(client) == alone  # a later sequence id, alone again
    streamed = client.completions.create(model="tiny", prompt=PROMPT, stream=True, **SEEDED)  # type: ignore[call-overload]
    assert "".join(c.choices[0].text for c in streamed if c.choices) == alone
    assert seeded_completion(client, seed=43) != alone  # the seed is what decides


def test_n_choices_each_with_its_own_draws(url: str) -> None:
    client = api(url)
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, n=3, **SEEDED)  # type: ignore[call-overload]
    assert [choice.index for choice in answer.choices] == [0, 1, 2]
    texts = [choice.message.content for choice in answer.choices]
    assert len(set(texts)) == 3
    single = client.chat.completions.create(model="tiny", messages=MESSAGES, **SEEDED)  # type: ignore[call-overload]
    assert texts[0] == single.choices[0].message.content  # choice 0 is the request's seed
    assert answer.usage is not None and single.usage is not None
    assert answer.usage.prompt_tokens == single.usage.prompt_tokens
    # Every choice's tokens are counted (a choice may end early at an end token).
    completion = client.completions.create(
        model="tiny", prompt=PROMPT, n=2, extra_body={"ignore_eos": True}, **SEEDED
    )  # type: ignore[call-overload]
    assert completion.usage is not None and completion.usage.completion_tokens == 2 * 24
    again = client.chat.completions.create(model="tiny", messages=MESSAGES, n=3, **SEEDED)  # type: ignore[call-overload]
    assert [choice.message.content for choice in again.choices] == texts


def test_logprobs_are_the_distribution_the_tokens_came_from(url: str) -> None:
    client = api(url)
    answer = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True,  # type: ignore[arg-type]
        top_logprobs=3,
    )  # fmt: skip
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None and answer.usage is not None
    assert len(logprobs.content) == answer.usage.completion_tokens
    for item in logprobs.content:
        assert len(item.top_logprobs) == 3
        top = item.top_logprobs[0]
        # Greedy: the sampled token is the most likely one.
        assert (top.token, top.logprob) == (item.token, item.logprob)
        values = [entry.logprob for entry in item.top_logprobs]
        assert values == sorted(values, reverse=True) and values[0] <= 0
        assert sum(math.exp(v) for v in values) <= 1.0 + 1e-5
    completion = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, logprobs=2, temperature=1.0, seed=7
    )
    lp = completion.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and len(lp.tokens) == 6
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == value and len(top) in (2, 3)  # the top 2 and the sampled one


def test_penalties_and_bias_change_what_greedy_picks(url: str) -> None:
    client = api(url)
    greedy = {"max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
    forced = client.completions.create(
        model="tiny", prompt=[5, 17, 99, 3], logit_bias={"120": 10}, **greedy
    )  # type: ignore[call-overload]
    assert forced.choices[0].text == "x" * 12  # id 120 is "x" in the built-in tokenizer
    # Each "x" so far costs 2 more and any costs 2: the model's own choices come back.
    decaying = client.completions.create(
        model="tiny", prompt=[5, 17, 99, 3], logit_bias={"120": 10}, frequency_penalty=2.0,
        presence_penalty=2.0, **greedy,
    )  # type: ignore[call-overload]  # fmt: skip
    text = decaying.choices[0].text
    assert text.startswith("x") and 1 < text.count("x") < 12
    # The bias comes first, then the penalty divides the biased logit of a seen token:
    # "x" once, then the model's own choices.
    once = client.completions.create(
        model="tiny", prompt=[5, 17, 99, 3], logit_bias={"120": 100},
        extra_body={"ignore_eos": True, "repetition_penalty": 100.0}, max_tokens=12,
        temperature=0,
    )  # fmt: skip
    assert once.choices[0].text.startswith("x") and once.choices[0].text.count("x") == 1
    held = client.completions.create(
        model="tiny", prompt=[5, 17, 99, 3], max_tokens=12, temperature=0,
        logit_bias={"255": 100}, extra_body={"min_tokens": 5},
    )  # fmt: skip
    assert held.usage is not None and held.usage.completion_tokens == 6  # </s> (255) at 6th


def test_defaults_models_and_refusals(url: str) -> None:
    client = api(url)
    default = client.completions.create(
        model="tiny", prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True}
    )
    assert default.usage is not None and default.usage.completion_tokens == 16
    chat = client.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=0, tools=[], tool_choice="none",  # type: ignore[arg-type]
        response_format={"type": "text"}, presence_penalty=0, frequency_penalty=0,
        logit_bias={}, max_tokens=4,
    )  # fmt: skip
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.BadRequestError, match="structured output is not supported"):
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            response_format={"type": "json_object"},  # type: ignore[arg-type]
        )
    with pytest.raises(openai.BadRequestError, match="allowed: system, developer, user"):
        client.chat.completions.create(model="tiny", messages=[{"role": "bogus", "content": "x"}])  # type: ignore[list-item]
