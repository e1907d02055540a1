"""The sampling rule (kvswap.sampling): one range per parameter, for the HTTP edge,
the CLI and the engine alike; and a sampler that never fails on a value inside it."""

from __future__ import annotations

import pytest
import torch

from kvswap.errors import KvSwapError
from kvswap.model.generate import sample_token
from kvswap.sampling import (
    MAX_SEED,
    SamplingParams,
    sampling_or_greedy,
    sampling_problems,
    seed_problem,
    temperature_problem,
    top_p_problem,
)


@pytest.mark.parametrize("value", [0, 0.0, 1e-3, 0.7, 1, 2.0])
def test_temperatures_inside_the_rule(value: float) -> None:
    assert temperature_problem(value) is None


@pytest.mark.parametrize("value", [1e-9, 5e-324, -0.5, 2.5, float("nan"), float("inf"), True, "1"])
def test_temperatures_outside_the_rule(value: object) -> None:
    assert temperature_problem(value) == "allowed: 0 (greedy) or a number in [0.001, 2]"


@pytest.mark.parametrize("value", [0, -1e-9, 1.5, float("nan"), False])
def test_top_p_outside_the_rule(value: object) -> None:
    assert top_p_problem(value) == "allowed: a number in (0, 1]"


@pytest.mark.parametrize("value", [-1, MAX_SEED + 1, 2**64, True, 1.0])
def test_seeds_outside_the_rule(value: object) -> None:
    assert seed_problem(value) is not None
    assert seed_problem(0) is None and seed_problem(MAX_SEED) is None


def test_greedy_or_sampling_and_one_line_per_problem() -> None:
    assert sampling_or_greedy(None, 0) is None
    assert sampling_or_greedy(0, 5, top_p=0.5) is None
    assert sampling_or_greedy(0.5, 5) == SamplingParams(temperature=0.5, seed=5)
    # Greedy requests are checked too: a bad seed is a bad request whatever the temperature.
    with pytest.raises(KvSwapError, match=r"^seed = -1: allowed: an integer in 0\.\."):
        sampling_or_greedy(None, -1)
    with pytest.raises(KvSwapError, match=r"^top_p = 0: "):
        sampling_or_greedy(1.0, 1, top_p=0)
    with pytest.raises(KvSwapError, match="means greedy"):
        SamplingParams(temperature=0, seed=1)
    problems = sampling_problems(1e-9, 2**70, 3.0, 0)
    assert [p.split(" =")[0] for p in problems] == ["temperature", "top_p", "seed", "top_k"]
    assert all("\n" not in p and len(p) < 120 for p in problems)


@pytest.mark.parametrize("top_p", [1e-50, 1e-300, 5e-324, 1e-46])
def test_a_top_p_that_rounds_to_zero_in_float32_keeps_the_most_likely_token(top_p: float) -> None:
    logits = torch.tensor([0.1, 3.0, -2.0, 2.9, 0.0])
    for seed in range(20):
        generator = torch.Generator().manual_seed(seed)
        sampling = SamplingParams(temperature=1.0, seed=seed, top_p=top_p)
        assert sample_token(logits, sampling, generator) == 1


def test_top_p_keeps_the_same_tokens_as_before_for_ordinary_values() -> None:
    # Forcing the first token kept changes nothing when top_p does not round to 0.
    logits = torch.linspace(-3, 3, 50)
    sampling = SamplingParams(temperature=1.0, seed=3, top_p=0.3)
    got = [sample_token(logits, sampling, torch.Generator().manual_seed(s)) for s in range(50)]
    assert set(got) <= set(range(44, 50)) and len(set(got)) > 1
