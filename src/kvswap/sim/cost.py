"""How long one scheduler step takes on a hardware profile: a roofline.

A step computes `q` new tokens for each scheduled sequence whose first new
token sits at position `p` (so it attends to p + 1 .. p + q keys). Over the
whole batch:

    bytes  = weights + sum_i (p_i + q_i) x KV bytes per token
             (weights are read once per step; each sequence's KV once)
    flops  = 2 x params x sum_i q_i                       (the matmuls)
           + 4 x layers x heads x head_dim x sum_i pairs_i  (QK^T and AV)
             pairs_i = q_i x p_i + q_i (q_i + 1) / 2       (causal)

    step_s = step_overhead_s + num_seqs x seq_overhead_s
             + max(bytes / (HBM x mem_efficiency), flops / (peak x compute_efficiency))

Max, not sum: within a step the kernels stream memory and compute at once,
so a step is bound by whichever takes longer (the roofline). A decode-only
step is memory-bound (weights + every running sequence's KV); a step with a
long prefill chunk is compute-bound. The overhead is the per-step cost no
roofline sees (kernel launches, scheduling, sampling); the per-sequence
overhead is 0 for the GPU presets and measured for a CPU profile, whose
attention runs sequence by sequence. Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvswap.control.scheduler_records import ScheduledSeq
from kvswap.errors import KvSwapError
from kvswap.ledger import kv_bytes_per_token
from kvswap.model.description import ModelDescription
from kvswap.model.dtypes import dtype_bytes
from kvswap.sim.hardware import HardwareProfile


@dataclass(frozen=True)
class StepCost:
    memory_s: float
    compute_s: float
    step_s: float


class StepCostModel:
    def __init__(self, shape: ModelDescription, dtype: str, hardware: HardwareProfile):
        if shape.num_params is None:
            raise KvSwapError(
                f"model {shape.name!r} has no parameter count, which the step cost model needs; "
                "use a preset or a config.json with the usual size fields"
            )
        self.hardware = hardware
        self.weights_bytes = shape.num_params * dtype_bytes(dtype)
        self.kv_bytes_per_token = kv_bytes_per_token(shape, dtype)
        self.matmul_flops_per_token = 2 * shape.num_params
        # Query width: MLA attends in its latent space, approximated by the hidden size.
        query_width = (
            shape.hidden_size
            if shape.attention == "mla"
            else shape.num_attention_heads * shape.head_dim
        )
        self.attention_flops_per_pair = 4 * shape.num_layers * query_width
        self._bytes_per_s = hardware.hbm_gb_per_s * 1e9 * hardware.mem_efficiency
        self._flops_per_s = hardware.peak_tflops * 1e12 * hardware.compute_efficiency

    def cost(self, seqs: Iterable[ScheduledSeq]) -> StepCost:
        """The roofline time of one step computing `seqs`."""
        tokens = pairs = context = num_seqs = 0
        for item in seqs:
            q, p = len(item.token_ids), item.start_position
            tokens += q
            pairs += q * p + q * (q + 1) // 2
            context += p + q
            num_seqs += 1
        return self.cost_of(tokens, pairs, context, num_seqs)

    def cost_of(
        self, num_tokens: int, num_pairs: int, num_context_tokens: int, num_seqs: int = 1
    ) -> StepCost:
        memory_bytes = self.weights_bytes + num_context_tokens * self.kv_bytes_per_token
        flops = self.matmul_flops_per_token * num_tokens + self.attention_flops_per_pair * num_pairs
        memory_s = memory_bytes / self._bytes_per_s
        compute_s = flops / self._flops_per_s
        overhead_s = self.hardware.step_overhead_s + num_seqs * self.hardware.seq_overhead_s
        return StepCost(memory_s, compute_s, overhead_s + max(memory_s, compute_s))

    def step_s(self, seqs: Iterable[ScheduledSeq]) -> float:
        return self.cost(seqs).step_s
