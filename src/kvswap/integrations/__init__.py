"""Thin adapters onto the engines users run: they translate calls into kvswap's
policy, copy engine and tiers, and hold no policy or tier logic of their own.

- `vllm/`: vLLM's offloading connector (an `OffloadingSpec`, its `CachePolicy`,
  secondary tiers and copy worker). Only this package imports vLLM, and only when
  vLLM loads it.
"""
