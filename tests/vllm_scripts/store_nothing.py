"""A host-tier ranking that admits no store: what vLLM's offloading path costs by itself.

`benchmarks/vs_vllm.py`'s pressure section runs vLLM with kvswap's spec three ways:
without offloading, with kvswap's host tier ("reuse"), and with this ranking, which
refuses every new chunk (`admit` 0), so the connector and its worker run on every
step but no byte is stored or loaded. Offload minus this is what the stores and
loads cost (or save); this minus no offloading is the connector's own overhead.
"""

from __future__ import annotations

from kvswap.control.policy_reuse import ReusePolicy


class AdmitNothing(ReusePolicy):
    """`reuse`'s ranking, admitting no new chunk."""

    def admit(self, num_offered: int, num_free: int) -> int:
        return 0
