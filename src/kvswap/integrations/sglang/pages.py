"""SGLang's pages as kvswap blocks: their keys, and the host pool as a tier's host slots.

A HiCache page is `page_size` tokens of every layer's K and V. In SGLang's
`page_first` host layouts the K half and the V half of a page are each one
contiguous run of bytes, in two separate regions of the host buffer:

    kv_buffer  page_first:        [2, num_pages * page_size, layers, heads, head_dim]
               page_first_direct: [2, num_pages, layers, page_size, heads, head_dim]
    as host slots (no copy):      [2 * num_pages, half_page_bytes] uint8
                                  slot p = page p's K half, slot num_pages + p its V half

so each half is one kvswap block (a self-checking value in the store, a slot of
the NVMe slab) and a page is two of them, moved in the same job, loaded only
when both arrive (as SGLang's Mooncake backend keeps K and V apart).

Keys: SGLang names a page by its hash string (a chain over the page's tokens).
`PageKeys` roots it in THE identity of the page's bytes (`kvswap.model.kv_identity`:
the checkpoint's weights and config, never its path or served name; the shard's
TP / PP / context-parallel rank and size; the host layout, dtype and shape) and
the tenant salt (`identity.foreign_key`). The same hash under another model,
shard, layout or salt is another key, so nothing is shared across them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvswap.base.identity import foreign_key
from kvswap.data.layout import KVLayout
from kvswap.data.tiers.base import HostSlots
from kvswap.errors import ConfigError
from kvswap.model.kv_identity import KvIdentity, Shard, checkpoint_identity, find_checkpoint

#: Host layouts whose page halves are contiguous (the zero-copy path needs one).
PAGE_FIRST_LAYOUTS = ("page_first", "page_first_direct")
_PLANES = (b"k", b"v")


@dataclass(frozen=True)
class PageShape:
    """One page's geometry, as SGLang's host pool describes it."""

    layout: str
    page_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def half_layout(self) -> KVLayout:
        """One half page (K or V) as a kvswap block layout: one plane, all layers."""
        return KVLayout(
            num_layers=self.num_layers, num_kv_heads=self.num_heads, head_dim=self.head_dim,
            block_tokens=self.page_size, dtype=self.dtype, num_kv_planes=1,
        )  # fmt: skip

    @property
    def half_bytes(self) -> int:
        return self.half_layout.block_bytes

    def describe(self) -> str:
        return (
            f"{self.layout}/{str(self.dtype).removeprefix('torch.')}/"
            f"{self.num_layers}x{self.num_heads}x{self.head_dim}"
        )


class PageKeys:
    """SGLang page hashes -> the kvswap keys of their K and V halves (module docstring)."""

    def __init__(self, identity: KvIdentity, tenant_salt: str | None) -> None:
        self._root = identity.namespace().root_key(tenant_salt)

    def halves(self, page_hash: str) -> tuple[bytes, bytes]:
        """The keys of the page's K half and V half."""
        name = page_hash.encode()
        k, v = (foreign_key(self._root, plane + b":" + name) for plane in _PLANES)
        return k, v

    def flat(self, page_hashes: Sequence[str]) -> list[bytes]:
        """K, V, K, V, ... for the pages in order (a lookup's prefix counts halves)."""
        return [key for page_hash in page_hashes for key in self.halves(page_hash)]


def sglang_identity(storage_config: Any, shape: PageShape, model_path: str | None) -> KvIdentity:
    """THE identity of the pages of SGLang's `storage_config` (its shard) in `shape`,
    computed by the checkpoint at `model_path` (None: the one SGLang serves, from its
    published server args); one line when no checkpoint can be read."""
    revision = None
    if model_path is None:
        model_path, revision = _served_model()
    directory = None if model_path is None else find_checkpoint(model_path, revision)
    if directory is None:
        raise ConfigError(
            f"kvswap's HiCache backend names pages by the checkpoint's weights and config and "
            f"cannot read those of model {model_path!r}; allowed: model_path in "
            "--hicache-storage-backend-extra-config, a local checkpoint directory or a hub id "
            "in the local Hugging Face cache"
        )
    found = checkpoint_identity(directory)
    c = storage_config
    return KvIdentity(
        compute="sglang", weights=found.weights, config=found.config,
        kv_dtype=str(shape.dtype).removeprefix("torch."),
        layout=f"sglang-half-page/{shape.describe()}",
        block_tokens=shape.page_size, block_bytes=shape.half_bytes,
        shard=Shard(
            tp_rank=int(c.tp_rank), tp_size=int(c.tp_size), pp_rank=int(c.pp_rank),
            pp_size=int(c.pp_size), cp_rank=int(getattr(c, "attn_cp_rank", 0)),
            cp_size=int(getattr(c, "attn_cp_size", 1)),
        ),
    )  # fmt: skip


def _served_model() -> tuple[str | None, str | None]:
    """The model path and revision SGLang serves, from its published server args."""
    try:
        from sglang.srt.runtime_context import get_server_args

        args = get_server_args()
    except Exception:  # an older SGLang, or no server in this process: not published
        return None, None
    path = getattr(args, "model_path", None)
    return (None if path is None else str(path)), getattr(args, "revision", None)


def page_shape(host_pool: Any) -> PageShape:
    """The page geometry of an SGLang MHA host pool; one line for one kvswap cannot page."""
    layout = getattr(host_pool, "layout", None)
    kv_buffer = getattr(host_pool, "kv_buffer", None)
    if layout not in PAGE_FIRST_LAYOUTS or not isinstance(kv_buffer, torch.Tensor):
        raise ConfigError(
            f"kvswap's HiCache backend moves page_first pages; this host pool is "
            f"{type(host_pool).__name__} with layout {layout!r}: allowed: "
            f"--hicache-mem-layout {' or '.join(PAGE_FIRST_LAYOUTS)} on an MHA model"
        )
    return PageShape(
        layout=str(layout), page_size=int(host_pool.page_size),
        num_layers=int(host_pool.layer_num), num_heads=int(host_pool.head_num),
        head_dim=int(host_pool.head_dim), dtype=kv_buffer.dtype,
    )  # fmt: skip


def half_page_slots(kv_buffer: torch.Tensor, shape: PageShape) -> HostSlots:
    """The host buffer as [2 * num_pages, half_page_bytes] uint8 host slots, sharing its
    memory: slot p is page p's K half, slot num_pages + p its V half."""
    if kv_buffer.device.type != "cpu" or not kv_buffer.is_contiguous() or kv_buffer.shape[0] != 2:
        raise ConfigError(
            f"kvswap's HiCache backend needs the host pool's K/V in one contiguous CPU buffer "
            f"[2, ...]; got {tuple(kv_buffer.shape)} on {kv_buffer.device}"
        )
    total_bytes = kv_buffer.numel() * kv_buffer.element_size()
    num_halves = total_bytes // shape.half_bytes
    if num_halves * shape.half_bytes != total_bytes:
        raise ConfigError(
            f"the host pool's {total_bytes} bytes are not whole pages of {2 * shape.half_bytes}"
        )
    slots: HostSlots = kv_buffer.view(torch.uint8).reshape(num_halves, shape.half_bytes).numpy()
    return slots


def page_numbers(host_indices: torch.Tensor, page_size: int, num_pages: int) -> list[int]:
    """The host pages that SGLang's token indices (page-aligned runs) name, in order."""
    firsts = host_indices.reshape(-1)[::page_size].tolist()
    if len(firsts) * page_size != host_indices.numel() or any(
        first % page_size or not 0 <= first // page_size < num_pages for first in firsts
    ):
        raise ValueError(
            f"host indices must be whole pages of {page_size} tokens within {num_pages} pages"
        )
    return [first // page_size for first in firsts]
