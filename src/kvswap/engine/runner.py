"""One model step over the device pool: build the batch, run the model, sample."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvswap.control.scheduler import StepPlan
from kvswap.drive.backend import StepOutput
from kvswap.model.generate import sample_token
from kvswap.model.llama import LlamaForCausal
from kvswap.model.paged_attention import AttentionBatch


class ModelRunner:
    """Runs a `StepPlan` against the device pool tensor `kv`.

    Each sequence samples with its request's own sampling, carried by the plan
    (`ScheduledSeq.sampling`): greedy, or seeded per (seed, sequence, position)
    so a token is the same whatever step or batch it is sampled in.
    """

    def __init__(self, model: LlamaForCausal, kv: torch.Tensor):
        self.model = model
        self.kv = kv  # [num_blocks, num_layers, 2, block_tokens, kv_heads, head_dim]

    def run(self, plan: StepPlan, tables: Mapping[int, Sequence[int]]) -> StepOutput:
        """Compute the plan's KV; returns the sampled token of each sampling sequence
        (or, where sampling raised, why: that sequence alone is aborted)."""
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
        for row, item in enumerate(plan.seqs):
            if not item.samples:
                continue
            sampling = item.sampling
            generator = None
            if sampling is not None:
                position = item.start_position + len(item.token_ids)
                seed = hash((sampling.seed, item.seq_id, position)) & 0x7FFF_FFFF_FFFF_FFFF
                generator = torch.Generator().manual_seed(seed)
            try:
                sampled[item.seq_id] = sample_token(logits[row], sampling, generator)
            except RuntimeError as error:  # torch: e.g. inf or NaN in the probabilities
                # One sequence's bad logits must not end the step of every other one.
                failed[item.seq_id] = f"sampling failed: {str(error).splitlines()[0]}"
        return StepOutput(sampled, failed)
