"""Thin adapters onto the engines users run: they translate an engine's calls into
kvswap's policy, copy engine and tiers, and hold no policy or tier logic of their own.

- `vllm/`: vLLM's offloading connector (an `OffloadingSpec`, its `CachePolicy`,
  secondary tiers and copy worker).
- `sglang/`: SGLang's HiCache storage backend (`KvSwapStorage`).
- `transformers/`: a transformers `Cache` (`TieredCache`) for `model.generate`.

Which block leaves the device is an `EvictionPolicy`'s call, moves are the
`Swapper`'s and the copy engine's, values are checked by `remote_format`, block
keys come from `base.identity`. Each adapter imports its engine's package, which
kvswap itself does not depend on, and only when that adapter is loaded.
"""
