"""One model step over the device pool: build the batch, run the model, sample."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvswap.control.scheduler_records import StepPlan
from kvswap.drive.backend import StepOutput
from kvswap.model.llama import LlamaForCausal
from kvswap.model.paged_attention import AttentionBatch
from kvswap.model.sampler import adjust_logits, sample_token, token_logprobs
from kvswap.sampling import TokenLogprobs, token_seed


class ModelRunner:
    """Runs a `StepPlan` against the device pool tensor `kv`.

    Each sequence samples with its request's own sampling, carried by the plan
    (`ScheduledSeq.sampling`): greedy, or seeded per (request seed, position) only
    (`kvswap.sampling.token_seed`), so a token is the same whatever step, batch or
    sequence id it is sampled with. A request's `LogitsOptions` (`ScheduledSeq.context`)
    adjust its logits first and may ask for the sampled token's logprobs.
    """

    def __init__(self, model: LlamaForCausal, kv: torch.Tensor):
        self.model = model
        self.kv = kv  # [num_blocks, num_layers, 2, block_tokens, kv_heads, head_dim]

    def run(self, plan: StepPlan, tables: Mapping[int, Sequence[int]]) -> StepOutput:
        """Compute the plan's KV; returns the sampled token of each sampling sequence
        (or, where sampling raised, why: that sequence alone is aborted), and the logprobs
        of those that asked."""
        ids = [token for item in plan.seqs for token in item.token_ids]
        batch = AttentionBatch(
            query_lens=tuple(len(item.token_ids) for item in plan.seqs),
            context_lens=tuple(item.start_position + len(item.token_ids) for item in plan.seqs),
            block_tables=tuple(tuple(tables[item.seq_id]) for item in plan.seqs),
        )
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.model.device)
        logits = self.model(input_ids, batch, self.kv).cpu()  # [num_seqs, vocab] float32
        sampled: dict[int, int] = {}
        failed: dict[int, str] = {}
        logprobs: dict[int, TokenLogprobs] = {}
        for row, item in enumerate(plan.seqs):
            if not item.samples:
                continue
            sampling = item.sampling
            generator = None
            if sampling is not None:
                position = item.start_position + len(item.token_ids)
                generator = torch.Generator().manual_seed(token_seed(sampling.seed, position))
            row_logits = logits[row]
            try:
                if item.context is not None:
                    row_logits = adjust_logits(row_logits, item.context)
                token = sample_token(row_logits, sampling, generator)
                num_logprobs = item.context.options.num_logprobs if item.context else None
                if num_logprobs is not None:
                    logprobs[item.seq_id] = token_logprobs(
                        row_logits, sampling, token, num_logprobs
                    )
            except RuntimeError as error:  # torch: e.g. inf or NaN in the probabilities
                # One sequence's bad logits must not end the step of every other one.
                failed[item.seq_id] = f"sampling failed: {str(error).splitlines()[0]}"
                continue
            sampled[item.seq_id] = token
        return StepOutput(sampled, failed, logprobs)
