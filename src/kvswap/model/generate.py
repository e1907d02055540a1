"""Reference generation: one sequence, a private KV pool, prefill then decode.

The engine batches many sequences over the tiered store; this helper is the
plain baseline its output is compared with (and what `kvswap generate` runs).
Sampling happens on CPU with a seeded generator, so a seed gives the same
tokens on every device as long as the logits agree. The model runs in the mode
it was built in (`LlamaForCausal(..., batch_invariant=...)`): the exact mode's
output is bit-identical however the prompt is chunked or its blocks placed,
the fast mode's equal to fp32 rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kvswap.errors import KvSwapError
from kvswap.model.arch_config import ModelArchConfig
from kvswap.model.llama import LlamaForCausal
from kvswap.model.paged_attention import AttentionBatch
from kvswap.model.sampler import sample_token as sample_token  # re-exported: the draw
from kvswap.sampling import SamplingParams
from kvswap.units import ceil_div


def check_generation_length(
    num_prompt_tokens: int,
    max_new_tokens: int,
    config: ModelArchConfig,
    *,
    name: str = "max_new_tokens",
) -> None:
    """One line, before anything is allocated, when prompt + `max_new_tokens` is longer
    than the model can attend over (its maximum position, or its sliding window,
    which the paged attention does not implement). `name` is the field to blame."""
    num_tokens = num_prompt_tokens + max_new_tokens
    limits = [(config.max_position_tokens, "max_position_embeddings")]
    if config.sliding_window_tokens is not None:
        limits.append((config.sliding_window_tokens, "sliding_window"))
    limit_tokens, limit_name = min(limits)
    if num_tokens > limit_tokens:
        allowed = max(0, limit_tokens - num_prompt_tokens)
        raise KvSwapError(
            f"{name} = {max_new_tokens}: {num_prompt_tokens} prompt + {max_new_tokens} new = "
            f"{num_tokens} tokens exceed the model's {limit_name} of {limit_tokens}; allowed: "
            f"{name} <= {allowed} for this prompt"
        )


@dataclass(frozen=True)
class GenerationResult:
    token_ids: tuple[int, ...]  # generated tokens only, stop token included if hit
    logits: Tensor  # [len(token_ids), vocab] float32 on CPU: the logits each token came from


def generate_reference(
    model: LlamaForCausal,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    sampling: SamplingParams | None = None,
    block_tokens: int = 16,
    prefill_chunk_tokens: int | None = None,
    stop_token_ids: frozenset[int] = frozenset(),
    block_table: Sequence[int] | None = None,
    num_pool_blocks: int | None = None,
) -> GenerationResult:
    """Prefill `prompt_ids` (in chunks of `prefill_chunk_tokens` if given), then decode.

    The pool is private to the call; `block_table` (default 0, 1, 2, ...) and
    `num_pool_blocks` choose where the blocks physically live, which must not
    change the output.
    """
    if not prompt_ids:
        raise KvSwapError("prompt must hold at least one token")
    if max_new_tokens < 1:
        raise KvSwapError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if prefill_chunk_tokens is not None and prefill_chunk_tokens < 1:
        raise KvSwapError(f"prefill_chunk_tokens must be >= 1, got {prefill_chunk_tokens}")
    vocab_size = model.config.vocab_size
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        raise KvSwapError(f"prompt token ids must be in [0, {vocab_size})")
    check_generation_length(len(prompt_ids), max_new_tokens, model.config)
    total_tokens = len(prompt_ids) + max_new_tokens - 1  # the last token is never fed back
    needed_blocks = ceil_div(total_tokens, block_tokens)
    table = tuple(block_table) if block_table is not None else tuple(range(needed_blocks))
    if len(table) < needed_blocks:
        raise KvSwapError(f"block_table has {len(table)} blocks, {needed_blocks} are needed")
    pool_blocks = num_pool_blocks if num_pool_blocks is not None else max(table) + 1
    kv = model.allocate_kv(pool_blocks, block_tokens)
    generator = None
    if sampling is not None:
        generator = torch.Generator(device="cpu").manual_seed(sampling.seed)

    chunk_tokens = prefill_chunk_tokens if prefill_chunk_tokens is not None else len(prompt_ids)
    context_len = 0
    step_logits: Tensor | None = None
    while context_len < len(prompt_ids):
        chunk = prompt_ids[context_len : context_len + chunk_tokens]
        context_len += len(chunk)
        step_logits = _step(model, kv, chunk, context_len, table)
    assert step_logits is not None

    token_ids: list[int] = []
    all_logits: list[Tensor] = []
    while True:
        logits = step_logits[0].cpu()
        token = sample_token(logits, sampling, generator)
        token_ids.append(token)
        all_logits.append(logits)
        if len(token_ids) == max_new_tokens or token in stop_token_ids:
            break
        context_len += 1
        step_logits = _step(model, kv, [token], context_len, table)
    return GenerationResult(token_ids=tuple(token_ids), logits=torch.stack(all_logits))


def _step(
    model: LlamaForCausal,
    kv: Tensor,
    new_ids: Sequence[int],
    context_len: int,
    table: tuple[int, ...],
) -> Tensor:
    batch = AttentionBatch((len(new_ids),), (context_len,), (table,))
    input_ids = torch.tensor(list(new_ids), dtype=torch.int64, device=model.device)
    logits: Tensor = model(input_ids, batch, kv)
    return logits
