"""`TieredCache`: a transformers `Cache` whose KV is paged by kvswap.

    cache = TieredCache(model, resident_blocks=64, cpu_blocks=1024, block_tokens=16)
    out = model.generate(input_ids, max_new_tokens=256, cache=cache)
    print(*cache.take_report().lines(), sep="\\n")   # the seed's four numbers
    cache.close()                                    # or: with TieredCache(...) as cache

transformers calls `Cache.update(keys, values, layer_idx)` once per layer and
step; each `TieredLayer` hands that to the one `PagedLayers` of the cache (built
at the first call, when batch size, dtype and device are known), which pages
the blocks with kvswap's swapper, policies and copy engine. This module only
translates: transformers' layer interface in, `PagedLayers` calls out.

Full-attention decoders only (Llama, Mistral without a window, Qwen2, ...): a
sliding-window or linear-attention layer is refused at construction, as are
beam search and cropping (they rewrite KV in place; `generate` with greedy or
sampled decoding never does).
"""

from __future__ import annotations

import hashlib
import os
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from kvswap.data.remote_copy import TierFactory
from kvswap.errors import ConfigError, KvSwapError
from kvswap.integrations.transformers.paged_layers import PagedLayers
from kvswap.integrations.transformers.report import CacheReport
from kvswap.integrations.transformers.settings import TieredCacheSettings
from kvswap.model.kv_identity import KvIdentity, config_json, hf_config_fields

#: Values of each parameter a weights digest reads (a strided sample).
_SAMPLED_VALUES = 64


class TieredCache(Cache):
    """KV in fixed blocks: a resident set on the model's device, the rest in a pinned
    CPU slot pool (and an NVMe slab, a shared store), moved by kvswap. See
    `TieredCacheSettings` for what each size means."""

    def __init__(
        self,
        model_or_config: Any,
        *,
        resident_blocks: int,
        cpu_blocks: int,
        block_tokens: int = 16,
        protected_sink_blocks: int = 1,
        min_residency_steps: int = 0,
        nvme_blocks: int = 0,
        nvme_dir: str | Path | None = None,
        remote_url: str | None = None,
        remote_timeout_ms: float = 500.0,
        secondary_tiers: Sequence[TierFactory] = (),
        gpu_eviction_policy: str = "kvswap",
        cpu_eviction_policy: str = "kvswap",
        nvme_eviction_policy: str = "kvswap",
        prefetch_streams: int = 1,
    ) -> None:
        config = _text_config(model_or_config)
        self.settings = TieredCacheSettings(
            resident_blocks=resident_blocks, cpu_blocks=cpu_blocks, block_tokens=block_tokens,
            protected_sink_blocks=protected_sink_blocks, min_residency_steps=min_residency_steps,
            nvme_blocks=nvme_blocks, nvme_dir=_path(nvme_dir),
            remote_url=remote_url, remote_timeout_ms=remote_timeout_ms,
            secondary_tiers=tuple(secondary_tiers),
            gpu_eviction_policy=gpu_eviction_policy, cpu_eviction_policy=cpu_eviction_policy,
            nvme_eviction_policy=nvme_eviction_policy, prefetch_streams=prefetch_streams,
        )  # fmt: skip
        self.num_layers = int(config.num_hidden_layers)
        # A batch has one row at least; `PagedLayers` checks again with its own.
        self.settings.check_cpu_blocks(self.num_layers, batch_size=1)
        self._config = config
        self._weights = _weights_identity(model_or_config)
        # The pages, once built; a list so that the finalizer closes them without
        # holding the cache itself (a cache dropped unclosed still releases its pools).
        self._paged: list[PagedLayers] = []
        self._closed = False
        self._finalizer = weakref.finalize(self, _close_all, self._paged)
        super().__init__(layers=[TieredLayer(self, i) for i in range(self.num_layers)])

    @property
    def paged(self) -> PagedLayers:
        """The pages (built by the first update); one line if nothing ran yet."""
        if not self._paged:
            raise KvSwapError("TieredCache: nothing was cached yet; call generate first")
        return self._paged[0]

    def pages_for(self, keys: torch.Tensor) -> PagedLayers:
        """The pages for K/V shaped like `keys` ([batch, kv_heads, tokens, head_dim]),
        built at the first call; a later batch of another shape is refused."""
        batch_size, num_kv_heads, _, head_dim = keys.shape
        if self._closed:
            raise KvSwapError("TieredCache is closed; allowed: a new TieredCache")
        if not self._paged:
            pages = PagedLayers(
                self.settings, num_layers=self.num_layers, batch_size=batch_size,
                num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=keys.dtype,
                device=keys.device, identity=self._identity(keys),
            )  # fmt: skip
            self._paged.append(pages)
        paged = self._paged[0]
        layout = paged.layout
        built = (paged.batch_size, layout.num_kv_heads, layout.head_dim, layout.dtype)
        if (batch_size, num_kv_heads, head_dim, keys.dtype) != built or keys.device != paged.device:
            raise KvSwapError(
                f"TieredCache holds batch {paged.batch_size} x {layout.num_kv_heads} heads x "
                f"{layout.head_dim} ({layout.dtype}, {paged.device}); got "
                f"{tuple(keys.shape)} ({keys.dtype}, {keys.device}): use one cache per batch"
            )
        return paged

    def _identity(self, keys: torch.Tensor) -> KvIdentity:
        """THE identity of this cache's blocks (`kvswap.model.kv_identity`). Each cache
        salts its keys with a nonce of its own, so no other cache reads them; the
        identity still names what computed them, as for every engine."""
        _, num_kv_heads, _, head_dim = keys.shape
        attention = getattr(self._config, "_attn_implementation", None) or "eager"
        dtype = str(keys.dtype).removeprefix("torch.")
        return KvIdentity(
            compute=f"transformers/{attention}/{keys.device.type}",
            weights=self._weights,
            config=config_json(hf_config_fields(self._config.to_dict())),
            kv_dtype=dtype,
            layout=f"transformers-layer/{num_kv_heads}x{head_dim}",
            block_tokens=self.settings.block_tokens,
            block_bytes=2 * self.settings.block_tokens * num_kv_heads * head_dim
            * keys.element_size(),
        )  # fmt: skip

    def take_report(self) -> CacheReport:
        """The seed's four numbers and the bytes moved since the last report (or since the
        first update): one `generate` call's, when taken after each."""
        return self.paged.take_report()

    def close(self) -> None:
        """Finish transfers; release the pools, copy threads, store connections and the
        NVMe slab file. Safe to call twice; the cache is unusable afterwards."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TieredLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]  # __init_subclass__
    """One layer of a `TieredCache`: transformers' layer interface over its pages."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, cache: TieredCache, layer_idx: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._cache = cache
        self.layer_idx = layer_idx

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._cache.pages_for(key_states)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        paged = self._cache.pages_for(key_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return paged.append(self.layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        pages = self._cache._paged
        return pages[0].num_tokens[self.layer_idx] if pages else 0

    def get_max_length(self) -> int:
        return -1  # grows as long as the tiers have room

    def reset(self) -> None:
        _refuse("reset")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        _refuse("beam search (reorder_cache)")

    def crop(self, tokens_to_remove: int) -> None:
        _refuse("crop (assisted decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        _refuse("batch_repeat_interleave")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        _refuse("batch_select_indices")

    def offload(self) -> None:
        pass  # kvswap moves blocks itself; transformers' whole-layer offload is not used

    def prefetch(self) -> None:
        pass


def _refuse(what: str) -> None:
    raise KvSwapError(
        f"TieredCache does not support {what}; allowed: greedy or sampled generate, "
        "one TieredCache per conversation"
    )


def _path(value: Any) -> Any:
    """A directory named by a string as a Path; anything else as given, for the settings
    to take (a Path, None) or refuse in one line."""
    return Path(value) if isinstance(value, str | os.PathLike) else value


def _text_config(model_or_config: Any) -> Any:
    """The decoder's config of a model or a config; one line for what cannot be paged."""
    config = model_or_config
    if not isinstance(config, PreTrainedConfig):
        config = getattr(model_or_config, "config", None)
    if not isinstance(config, PreTrainedConfig):
        raise ConfigError(
            f"TieredCache({type(model_or_config).__name__}): allowed: a transformers model "
            "or its PreTrainedConfig"
        )
    text = config.get_text_config(decoder=True)
    layer_types, _ = get_layer_types_and_kwargs(text)
    others = sorted(set(layer_types) - {"full_attention"})
    if others:
        raise ConfigError(
            f"TieredCache pages full-attention layers only; {type(text).__name__} has "
            f"{', '.join(others)} layers"
        )
    return text


def _weights_identity(model_or_config: Any) -> str | None:
    """A digest of a model's weights as they are in memory: each parameter's name, dtype,
    shape and a strided sample of `_SAMPLED_VALUES` values. None for a bare config
    (the weights are unknown; the cache's own salt keeps its blocks its own)."""
    if not isinstance(model_or_config, torch.nn.Module):
        return None
    digest = hashlib.sha256(b"kvswap-transformers-weights-v1")
    for name, tensor in model_or_config.state_dict().items():
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // _SAMPLED_VALUES)
        sample = flat[::step][:_SAMPLED_VALUES].to("cpu").contiguous()
        header = f"{name}:{tensor.dtype}:{tuple(tensor.shape)}:".encode()
        digest.update(len(header).to_bytes(8, "little") + header)
        digest.update(sample.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _close_all(pages: list[PagedLayers]) -> None:
    while pages:
        pages.pop().close()
