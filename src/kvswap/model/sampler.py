"""The sampler's torch ops, in one place: adjust a sequence's logits, draw a token,
report log-probabilities. The rule (ranges, seeds, the records) is `kvswap.sampling`.

    logits [vocab] float32 on CPU
      -> adjust_logits(logits, context)   min_tokens, logit_bias, repetition, frequency,
                                          presence (vLLM's order); only with options
      -> sample_token(adjusted, sampling, generator)
             greedy (sampling None): argmax, the first index on ties
             seeded: draw_weights (temperature, top-k, top-p) -> one multinomial draw
      -> token_logprobs(adjusted, sampling, token, k)
             the log of the distribution the draw used (greedy: log_softmax of the
             adjusted logits), the sampled token's and the k most likely

A request without options takes exactly the path it took before options existed:
`adjust_logits` is not called, so greedy and seeded tokens are bit-identical.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvswap.sampling import (
    LogitsContext,
    SamplingParams,
    TokenLogprobs,
    floored_logprob,
)


def adjust_logits(logits: Tensor, context: LogitsContext) -> Tensor:
    """logits [vocab] float32 -> a new tensor with the request's options applied."""
    options = context.options
    if not (options.min_tokens or options.logit_bias or options.penalizes):
        return logits
    vocab_size = logits.shape[0]
    adjusted = logits.clone()
    if len(context.output_ids) < options.min_tokens and context.stop_token_ids:
        stops = torch.tensor(sorted(context.stop_token_ids), dtype=torch.int64)
        adjusted[stops] = float("-inf")
    if options.logit_bias:
        ids = torch.tensor([token for token, _ in options.logit_bias], dtype=torch.int64)
        biases = torch.tensor([bias for _, bias in options.logit_bias], dtype=adjusted.dtype)
        adjusted[ids] += biases  # ids are distinct, so no update is lost
    if options.repetition_penalty != 1.0:
        seen = torch.zeros(vocab_size, dtype=torch.bool)
        history = (*context.prompt_ids, *context.output_ids)
        if history:
            seen[torch.tensor(history, dtype=torch.int64)] = True
        penalty = options.repetition_penalty
        penalized = torch.where(adjusted > 0, adjusted / penalty, adjusted * penalty)
        adjusted = torch.where(seen, penalized, adjusted)
    if (options.frequency_penalty or options.presence_penalty) and context.output_ids:
        outputs = torch.tensor(context.output_ids, dtype=torch.int64)
        counts = torch.bincount(outputs, minlength=vocab_size).to(adjusted.dtype)
        adjusted -= options.frequency_penalty * counts
        adjusted -= options.presence_penalty * (counts > 0).to(adjusted.dtype)
    return adjusted


def draw_weights(logits: Tensor, sampling: SamplingParams) -> Tensor:
    """logits [vocab] -> the unnormalized weights the seeded draw picks from: temperature,
    then top-k, then top-p (tokens outside both weigh 0)."""
    scaled = logits / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < scaled.shape[0]:
        kth = torch.topk(scaled, sampling.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        # keep the smallest prefix whose mass reaches top_p (always the first token)
        mass_before = torch.cumsum(sorted_probs, dim=0) - sorted_probs
        dropped = mass_before >= sampling.top_p
        # A top_p that rounds to 0 in float32 would drop every token; the most likely
        # one is always kept (its mass before is exactly 0, so nothing else changes).
        dropped[0] = False
        sorted_probs = sorted_probs.masked_fill(dropped, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs


def sample_token(
    logits: Tensor, sampling: SamplingParams | None, generator: torch.Generator | None
) -> int:
    """logits [vocab] float32 on CPU -> a token id (argmax, first index on ties, when greedy)."""
    if sampling is None:
        return int(torch.argmax(logits).item())
    weights = draw_weights(logits, sampling)
    return int(torch.multinomial(weights, 1, generator=generator).item())


def token_logprobs(
    logits: Tensor, sampling: SamplingParams | None, token_id: int, num_top: int
) -> TokenLogprobs:
    """The sampled token's log-probability and the `num_top` most likely tokens', from the
    distribution the draw used: greedy, log_softmax of `logits`; seeded, the normalized
    `draw_weights` (a token top-k or top-p left out has -inf, written MIN_LOGPROB)."""
    if sampling is None:
        logprobs = torch.log_softmax(logits, dim=-1)
    else:
        weights = draw_weights(logits, sampling)
        logprobs = torch.log(weights / weights.sum())
    top: tuple[tuple[int, float], ...] = ()
    if num_top:
        values, ids = torch.topk(logprobs, min(num_top, logprobs.shape[0]))
        top = tuple(
            (int(token), floored_logprob(float(value)))
            for token, value in zip(ids.tolist(), values.tolist(), strict=True)
        )
    return TokenLogprobs(token_id, floored_logprob(float(logprobs[token_id])), top)
