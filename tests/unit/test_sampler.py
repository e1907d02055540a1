"""The sampler's torch ops (kvswap.model.sampler) and the rule they follow (kvswap.sampling):
penalties, logit_bias, min_tokens, top_k, logprobs, and the seeds tokens are drawn with.

Logits here are small hand-written tensors, so every expected value is worked out by
hand in the test; one runner test shows a request draws the same token under any
sequence id and beside any other request."""

from __future__ import annotations

import math

import pytest
import torch

from kvswap.control.scheduler_records import ScheduledSeq, StepPlan
from kvswap.engine.runner import ModelRunner
from kvswap.errors import KvSwapError
from kvswap.model.loader import load_model
from kvswap.model.sampler import adjust_logits, draw_weights, sample_token, token_logprobs
from kvswap.sampling import (
    MAX_LOGPROBS,
    MIN_LOGPROB,
    LogitsContext,
    LogitsOptions,
    SamplingParams,
    api_top_k,
    api_top_k_problem,
    choice_seed,
    logits_options_or_none,
    options_problems,
    token_seed,
)

LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0])


def context(
    prompt: tuple[int, ...] = (),
    output: tuple[int, ...] = (),
    stops: frozenset[int] = frozenset(),
    **options: object,
) -> LogitsContext:
    return LogitsContext(LogitsOptions(**options), prompt, output, stops)  # type: ignore[arg-type]


# -- the rule --------------------------------------------------------------------------


def test_neutral_options_are_no_options_and_bad_ones_are_one_line() -> None:
    assert logits_options_or_none() is None
    assert logits_options_or_none(presence_penalty=0, repetition_penalty=1, logit_bias={}) is None
    assert logits_options_or_none(num_logprobs=0) == LogitsOptions(num_logprobs=0)
    biased = logits_options_or_none(logit_bias={5: 1, 2: -3.5})
    assert biased is not None and biased.logit_bias == ((2, -3.5), (5, 1.0))
    problems = options_problems(2.5, -3, 0, {3: 101, -1: 0}, -1, 21)
    assert [p.split(" =")[0] for p in problems] == [
        "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
        "logprobs", "logit_bias[3]", "logit_bias key",
    ]  # fmt: skip
    assert all("allowed:" in p and "\n" not in p for p in problems)
    with pytest.raises(KvSwapError, match=r"^repetition_penalty = 0: allowed: a number in"):
        logits_options_or_none(repetition_penalty=0)
    with pytest.raises(KvSwapError, match=r"^logprobs = 21: allowed: an integer in 0\.\.20"):
        LogitsOptions(num_logprobs=MAX_LOGPROBS + 1)
    assert options_problems(float("nan")) != [] and options_problems(True) != []


def test_top_k_off_values_follow_vllm() -> None:
    assert api_top_k(-1) is None and api_top_k(0) is None and api_top_k(7) == 7
    assert api_top_k_problem(-1) is None and api_top_k_problem(0) is None
    assert api_top_k_problem(-2) is not None and api_top_k_problem(1.5) is not None


def test_seeds_depend_on_the_request_seed_and_position_only() -> None:
    assert token_seed(42, 10) == token_seed(42, 10)
    assert len({token_seed(42, p) for p in range(100)}) == 100
    assert token_seed(42, 10) != token_seed(43, 10)
    assert all(0 <= token_seed(s, p) < 2**63 for s in (0, 2**63 - 1) for p in (0, 2**20))
    assert choice_seed(42, 0) == 42  # n = 1 and the first of n choices agree
    assert len({choice_seed(42, i) for i in range(8)}) == 8


# -- adjusting the logits ----------------------------------------------------------------


def test_no_adjustment_returns_the_logits_themselves() -> None:
    assert adjust_logits(LOGITS, context(num_logprobs=3)) is LOGITS


def test_presence_and_frequency_follow_the_openai_definition() -> None:
    # Output so far: token 3 twice, token 5 once. logit -= frequency * count + presence.
    got = adjust_logits(
        LOGITS, context(prompt=(0, 1), output=(3, 5, 3), presence_penalty=0.5,
                        frequency_penalty=0.25),
    )  # fmt: skip
    expected = LOGITS.clone()
    expected[3] -= 2 * 0.25 + 0.5
    expected[5] -= 1 * 0.25 + 0.5
    assert torch.equal(got, expected)  # the prompt's tokens are not penalized by these
    # Negative values encourage repeating, as in the API.
    encouraged = adjust_logits(LOGITS, context(output=(1,), presence_penalty=-2.0))
    assert encouraged[1] == LOGITS[1] + 2.0


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    got = adjust_logits(LOGITS, context(prompt=(0, 1), output=(2,), repetition_penalty=2.0))
    assert got.tolist() == [1.0, -2.0, 0.25, 3.0, -2.0, 1.0]  # 0, 1 from the prompt, 2 output
    below_one = adjust_logits(LOGITS, context(prompt=(0,), repetition_penalty=0.5))
    assert below_one[0] == 4.0  # < 1 encourages repeating


def test_logit_bias_adds_and_min_tokens_holds_stop_tokens_back() -> None:
    biased = adjust_logits(LOGITS, context(logit_bias=((1, 100.0), (3, -100.0))))
    assert biased[1] == 99.0 and biased[3] == -97.0
    assert sample_token(biased, None, None) == 1  # greedy follows the bias
    stops = frozenset({3, 5})
    held = adjust_logits(LOGITS, context(output=(0,), stops=stops, min_tokens=2))
    assert held[3] == held[5] == float("-inf") and held[0] == LOGITS[0]
    assert sample_token(held, None, None) == 0  # 3 was the argmax
    free = adjust_logits(LOGITS, context(output=(0, 2), stops=stops, min_tokens=2))
    assert torch.equal(free, LOGITS)  # two tokens generated: the stop tokens are back


# -- the draw: top_k -------------------------------------------------------------------


def test_top_k_draws_only_among_the_k_most_likely() -> None:
    hot = SamplingParams(temperature=2.0, seed=1, top_k=2)
    drawn = {sample_token(LOGITS, hot, torch.Generator().manual_seed(s)) for s in range(200)}
    assert drawn == {0, 3}
    weights = draw_weights(LOGITS, hot)
    assert (weights > 0).tolist() == [True, False, False, True, False, False]


# -- logprobs ----------------------------------------------------------------------------


def test_greedy_logprobs_are_log_softmax_of_the_adjusted_logits() -> None:
    ctx = context(output=(3,), presence_penalty=1.5, num_logprobs=2)
    adjusted = adjust_logits(LOGITS, ctx)
    token = sample_token(adjusted, None, None)
    got = token_logprobs(adjusted, None, token, 2)
    expected = torch.log_softmax(adjusted, dim=-1)
    assert token == 0 and got.token_id == 0 and got.logprob == float(expected[0])
    assert [t for t, _ in got.top] == [0, 3]  # 3 lost 1.5 to the penalty: 2.0 vs 1.5
    assert [v for _, v in got.top] == [float(expected[0]), float(expected[3])]


def test_seeded_logprobs_are_the_distribution_the_draw_used() -> None:
    hot = SamplingParams(temperature=0.5, seed=9, top_k=3, top_p=0.9)
    weights = draw_weights(LOGITS, hot)
    probs = weights / weights.sum()
    for seed in range(20):
        token = sample_token(LOGITS, hot, torch.Generator().manual_seed(seed))
        got = token_logprobs(LOGITS, hot, token, 4)
        assert got.logprob == pytest.approx(math.log(float(probs[token])), abs=1e-6)
        assert got.logprob > MIN_LOGPROB  # a drawn token was possible
        assert [v for _, v in got.top] == sorted((v for _, v in got.top), reverse=True)
        # Top-k and top-p left some of the top 4 out: they are reported at the floor.
        assert any(v == MIN_LOGPROB for _, v in got.top)
    assert token_logprobs(LOGITS, hot, 3, 0).top == ()


# -- the runner: a token depends on the request, not on its id or its companions ------


def test_a_seeded_request_draws_the_same_tokens_under_any_id_and_beside_anything() -> None:
    model = load_model("tiny", None, torch.device("cpu"), batch_invariant=True)[0]
    prompt = tuple(range(5, 17))
    other = tuple(range(40, 49))
    hot = SamplingParams(temperature=1.5, seed=1234)
    ctx = LogitsContext(LogitsOptions(presence_penalty=1.0, num_logprobs=2), prompt, (7, 7))

    def step(*items: tuple[int, tuple[int, ...], SamplingParams | None]) -> dict[int, int]:
        runner = ModelRunner(model, model.allocate_kv(12, 4))
        tables = {3: (0, 1, 2), 99: (3, 4, 5), 1: (6, 7, 8)}
        seqs = tuple(
            ScheduledSeq(seq, ids, 0, True, sampling, ctx if ids == prompt else None)
            for seq, ids, sampling in items
        )
        out = runner.run(StepPlan(0, seqs, 0.0), tables)
        assert set(out.logprobs) == {seq for seq, ids, _ in items if ids == prompt}
        return dict(out.sampled)

    alone = step((3, prompt, hot))[3]
    assert step((99, prompt, hot))[99] == alone  # another sequence id
    assert step((1, other, hot), (99, prompt, hot))[99] == alone  # another companion
    assert step((1, other, None), (3, prompt, hot))[3] == alone
