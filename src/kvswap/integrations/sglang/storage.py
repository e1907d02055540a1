"""`KvSwapStorage`: kvswap's shared store (or NVMe slab) as an SGLang HiCache storage backend.

    python -m sglang.launch_server --model-path M --enable-hierarchical-cache \\
        --hicache-mem-layout page_first --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvswap",
          "module_path": "kvswap.integrations.sglang", "class_name": "KvSwapStorage",
          "interface_v1": 1, "remote_url": "redis://127.0.0.1:6379/0"}'

SGLang builds it as `KvSwapStorage(storage_config, kwargs)` and then calls
`register_mem_pool_host(host_pool)`. What SGLang calls, and what it becomes:

    batch_exists(hashes, extra_info) -> int   PageStore.exists_prefix: the present prefix
    batch_get_v1(hashes, host_indices, ...)   PageStore.load straight into the host pool's
    batch_set_v1(hashes, host_indices, ...)   pages (zero-copy: no tensor in between) / store
    get / batch_get / set / batch_set         the legacy calls: the same, through a staging
                                              buffer of LEGACY_STAGING_PAGES pages (a get
                                              without a target fills a new flat page)
    exists(hash)                              batch_exists([hash]) == 1

Every byte is moved and checked by kvswap's tier (`page_store.open_page_store`:
`RedisTier` values are self-checking and bound to their key, a value that fails
is a miss and is deleted; a store that is down answers misses). This class only
translates SGLang's arguments. Pages are keyed by SGLang's hashes under THE identity
of their bytes (the checkpoint's weights and config, never its served name; the
shard, layout and tenant salt: `pages.PageKeys`, `pages.sglang_identity`).

MHA models with a page_first host layout; an MLA model or another layout is
refused in one line when the host pool registers.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from kvswap.errors import ConfigError, KvSwapError
from kvswap.integrations.sglang.options import StorageOptions
from kvswap.integrations.sglang.page_store import PageStore, open_page_store
from kvswap.integrations.sglang.pages import (
    PageShape,
    half_page_slots,
    page_numbers,
    page_shape,
    sglang_identity,
)
from kvswap.model.kv_identity import KvIdentity

#: Pages the legacy calls move at once through their staging buffer.
LEGACY_STAGING_PAGES = 8


class KvSwapStorage(HiCacheStorage):  # type: ignore[misc]  # SGLang's class, untyped here
    """SGLang's HiCacheStorage over kvswap's tiers (module docstring)."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        self.options = StorageOptions.from_extra_config(storage_config.extra_config)
        if storage_config.is_mla_model or getattr(storage_config, "should_split_heads", False):
            raise ConfigError(
                "kvswap's HiCache backend stores whole MHA pages; allowed: an MHA model "
                "without split heads"
            )
        self.storage_config = storage_config
        self._shape: PageShape | None = None
        self._identity: KvIdentity | None = None  # of the pages, once the host pool is known
        self._pages: PageStore | None = None  # over the registered host pool (v1)
        self._staged: PageStore | None = None  # over the legacy calls' staging buffer
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._build = threading.Lock()
        self._legacy = threading.Lock()  # one legacy call at a time: they share the staging

    # --- setup ------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        shape = page_shape(mem_pool_host)
        slots = half_page_slots(mem_pool_host.kv_buffer, shape)
        with self._build:
            if self._pages is not None:
                self._pages.close()
            self._shape = shape
            self._identity = sglang_identity(self.storage_config, shape, self.options.model_path)
            self._pages = open_page_store(self.options, shape, self._identity, slots)

    def _store(self) -> PageStore:
        if self._pages is None:
            raise KvSwapError("KvSwapStorage: register_mem_pool_host was not called")
        return self._pages

    # --- v1: straight into the host pool --------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        return self._store().exists_prefix(keys)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        store = self._store()
        return store.load(keys, self._pages_of(host_indices, store))

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        store = self._store()
        return store.store(keys, self._pages_of(host_indices, store))

    def _pages_of(self, host_indices: torch.Tensor, store: PageStore) -> list[int]:
        assert self._shape is not None  # set with the store
        return page_numbers(host_indices, self._shape.page_size, store.num_pages)

    # --- the legacy calls: flat page tensors, through a staging buffer --------------

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        given: list[torch.Tensor | None] = (
            [None] * len(keys) if target_locations is None else list(target_locations)
        )
        if len(given) != len(keys):
            raise ValueError(f"{len(keys)} keys for {len(given)} target pages")
        staged, half = self._staging_store(), self._half_bytes()
        # No target (SGLang's `get(key)`): the value comes back in a page of its own.
        targets = [self._new_page() if t is None else t for t in given]
        out: list[torch.Tensor | None] = []
        with self._legacy:
            self._get_staged(staged, half, keys, targets, out)
        return out

    def _get_staged(
        self,
        staged: PageStore,
        half: int,
        keys: list[str],
        targets: list[torch.Tensor],
        out: list[torch.Tensor | None],
    ) -> None:
        for start in range(0, len(keys), LEGACY_STAGING_PAGES):
            chunk = keys[start : start + LEGACY_STAGING_PAGES]
            loaded = staged.load(chunk, range(len(chunk)))
            for i, (ok, target) in enumerate(zip(loaded, targets[start:], strict=False)):
                if not ok:
                    out.append(None)
                    continue
                flat = _page_bytes(target, half)
                flat[:half].copy_(self._staging[i])
                flat[half:].copy_(self._staging[LEGACY_STAGING_PAGES + i])
                out.append(target)

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        pages: list[torch.Tensor] = list(values or [])
        if len(pages) != len(keys):
            raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
        staged, half = self._staging_store(), self._half_bytes()
        stored = True
        with self._legacy:
            for start in range(0, len(keys), LEGACY_STAGING_PAGES):
                chunk = keys[start : start + LEGACY_STAGING_PAGES]
                for i, page in enumerate(pages[start : start + len(chunk)]):
                    flat = _page_bytes(page, half)
                    self._staging[i].copy_(flat[:half])
                    self._staging[LEGACY_STAGING_PAGES + i].copy_(flat[half:])
                stored = all(staged.store(chunk, range(len(chunk)))) and stored
        return stored

    def _new_page(self) -> torch.Tensor:
        """A flat CPU page of the host pool's dtype (K half then V half), as SGLang's
        `get_dummy_flat_data_page` makes one."""
        assert self._shape is not None  # set with the store
        flat = torch.empty(2 * self._shape.half_bytes, dtype=torch.uint8)
        return flat.view(self._shape.dtype)

    def _half_bytes(self) -> int:
        assert self._shape is not None  # set with the store
        return self._shape.half_bytes

    def _staging_store(self) -> PageStore:
        """The legacy calls' store, over its own staging buffer, made at their first call."""
        self._store()  # the host pool registered: the page shape is known
        with self._build:
            if self._staged is None:
                assert self._shape is not None and self._identity is not None  # registered
                staging = torch.zeros((2 * LEGACY_STAGING_PAGES, self._shape.half_bytes),
                                      dtype=torch.uint8)  # fmt: skip
                self._staged = open_page_store(
                    self.options, self._shape, self._identity, staging.numpy()
                )
                self._staging = staging
            return self._staged

    # --- the rest -----------------------------------------------------------------------

    def counters(self) -> Mapping[str, int]:
        """The tier's counts (hits, misses, corrupt values, skipped writes, ...)."""
        return self._pages.counters() if self._pages is not None else {}

    def close(self) -> None:
        """Finish queued copies; release the store's connections or the slab file."""
        with self._build:
            for store in (self._pages, self._staged):
                if store is not None:
                    store.close()
            self._pages = self._staged = None


def _page_bytes(page: object, half_bytes: int) -> torch.Tensor:
    """A flat page tensor (K half then V half) as its bytes; one line for anything else
    (None, a value set without a page, included)."""
    if not isinstance(page, torch.Tensor) or page.device.type != "cpu" or not page.is_contiguous():
        raise ValueError(
            f"a legacy page must be a contiguous CPU tensor; got {type(page).__name__}"
        )
    flat = page.view(torch.uint8).reshape(-1)
    if flat.numel() != 2 * half_bytes:
        raise ValueError(f"a page is {2 * half_bytes} bytes; got {flat.numel()}")
    return flat
