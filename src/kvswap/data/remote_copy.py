"""The keyed tiers over a pinned host pool, as the control plane's remote tier.

`RemoteCopyEngine` = `TierCopyEngine(RedisTier(...))`: the
control plane's remote chunks become the tier's jobs, its lookups the tier's
(`kvswap.data.tiers.copy_adapter`); lanes, batching, value checks, skipped
writes and counters are `RedisTier`'s (`kvswap.data.tiers.redis_tier`).

`open_store_tier` opens the store of the `tiers.remote_*` settings over a host
pool (`open_remote_tier`: it alone, as the remote tier); `open_keyed_tiers` lists
it with tiers of one's own (each a `UserTier`), each its own `TierCopyEngine`,
for the engine and the transformers cache (the control plane keeps one keyed
tier per entry: `kvswap.control.remote_tier`);
`host_slot_bytes` is the bridge from the torch-side `HostPool` to the byte view
every `SecondaryTier` is built over.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import torch

from kvswap.data.host_pool import HostPool
from kvswap.data.layout import KVLayout
from kvswap.data.remote_format import layout_fingerprint
from kvswap.data.remote_store import RemoteStoreClient
from kvswap.data.tiers.base import HostSlots, SecondaryTier
from kvswap.data.tiers.copy_adapter import TierCopyEngine
from kvswap.data.tiers.redis_tier import (
    DEFAULT_READ_LANES,
    DEFAULT_WRITE_LANES,
    READ_BATCH_BYTES,
    SLOW_HOLD_S,
    WRITE_BATCH_BYTES,
    RedisTier,
    RemoteStats,
    open_redis_tier,
)
from kvswap.data.tiers.user_tier import UserTier
from kvswap.errors import KvSwapError
from kvswap.import_path import one_line

__all__ = [
    "DEFAULT_READ_LANES",
    "DEFAULT_WRITE_LANES",
    "READ_BATCH_BYTES",
    "SLOW_HOLD_S",
    "WRITE_BATCH_BYTES",
    "RemoteCopyEngine",
    "RemoteStats",
    "TierFactory",
    "host_slot_bytes",
    "open_keyed_tiers",
    "open_remote_tier",
    "open_store_tier",
]

#: How the engine is handed a key-addressed tier of one's own: built once the pinned
#: pool exists, over its slots' bytes and for its block layout.
TierFactory = Callable[[HostSlots, KVLayout], SecondaryTier]


def host_slot_bytes(pool: HostPool) -> HostSlots:
    """`pool`'s slots as the [num_slots, block_bytes] uint8 array a tier is built over,
    sharing the pool's memory."""
    flat = pool.slots.view(torch.uint8).reshape(pool.num_slots, pool.layout.block_bytes)
    return flat.numpy()


class RemoteCopyEngine(TierCopyEngine):
    """Remote chunks over one `RedisTier`; also the RemoteIndex. Owns the tier and so
    its client: `close()` closes them."""

    tier: RedisTier

    def __init__(self, tier: RedisTier) -> None:
        super().__init__(tier)

    @classmethod
    def over_client(
        cls,
        client: RemoteStoreClient,
        host_pool: HostPool,
        *,
        ttl_s: float = 0.0,
        max_inflight_write_chunks: int = 4,
        num_read_lanes: int = DEFAULT_READ_LANES,
        num_write_lanes: int = DEFAULT_WRITE_LANES,
        read_batch_bytes: int = READ_BATCH_BYTES,
        write_batch_bytes: int = WRITE_BATCH_BYTES,
        clock: Callable[[], float] = time.perf_counter,
    ) -> RemoteCopyEngine:
        """Over a client already connected, with the tier's lanes and batches as given
        (the tests' and benchmarks' way in)."""
        return cls(RedisTier(
            client, host_slot_bytes(host_pool), layout_fingerprint=layout_fingerprint(
                host_pool.layout), ttl_s=ttl_s, max_inflight_write_chunks=max_inflight_write_chunks,
            num_read_lanes=num_read_lanes, num_write_lanes=num_write_lanes,
            read_batch_bytes=read_batch_bytes, write_batch_bytes=write_batch_bytes, clock=clock,
        ))  # fmt: skip

    @property
    def client(self) -> RemoteStoreClient:
        return self.tier.client

    def stats(self) -> RemoteStats:
        return self.tier.stats()


def open_store_tier(
    url: str,
    host_pool: HostPool,
    *,
    namespace: str,
    timeout_ms: float,
    ttl_s: float = 0.0,
    max_inflight_chunks: int = 4,
    required: bool = False,
    environ: Mapping[str, str] | None = None,
) -> RedisTier:
    """The store of the `tiers.remote_*` settings as a tier over `host_pool`'s slots
    (`open_redis_tier`, with the pool's byte view and block layout)."""
    return open_redis_tier(
        url, host_slot_bytes(host_pool), layout_fingerprint=layout_fingerprint(host_pool.layout),
        namespace=namespace, timeout_ms=timeout_ms, required=required, ttl_s=ttl_s,
        max_inflight_write_chunks=max_inflight_chunks, environ=environ,
    )  # fmt: skip


def open_remote_tier(
    url: str,
    host_pool: HostPool,
    *,
    namespace: str,
    timeout_ms: float,
    ttl_s: float = 0.0,
    max_inflight_chunks: int = 4,
    required: bool = False,
    environ: Mapping[str, str] | None = None,
) -> RemoteCopyEngine:
    """The store alone as the control plane's remote tier (`open_store_tier`)."""
    return RemoteCopyEngine(open_store_tier(
        url, host_pool, namespace=namespace, timeout_ms=timeout_ms, ttl_s=ttl_s,
        max_inflight_chunks=max_inflight_chunks, required=required, environ=environ,
    ))  # fmt: skip


def open_keyed_tiers(
    store: SecondaryTier | None,
    own: Sequence[TierFactory],
    host_pool: HostPool,
    *,
    slab: TierFactory | None = None,
) -> tuple[TierCopyEngine, ...]:
    """The control plane's key-addressed tiers over `host_pool`, fastest first: the
    tier of this process (`SecondaryTier.local`: the NVMe slab `slab` builds, or one
    among `own`), then the `store` (opened by the caller, or None), then a tier from
    each other factory of `own`, each as its own `TierCopyEngine`. A factory that
    fails, or builds no tier over the pool's slots, is one line naming its entry
    (`secondary_tiers[i]`), as is a second tier of this process, and what was built
    (the store too) is closed; so is a call of such a tier that raises (`UserTier`)."""
    tiers: list[SecondaryTier] = [] if store is None else [store]
    try:
        if slab is not None:
            tiers.append(slab(host_slot_bytes(host_pool), host_pool.layout))
        for index, factory in enumerate(own):
            tiers.append(_own_tier(factory, index, host_pool))
            if tiers[-1].local and any(tier.local for tier in tiers[:-1]):
                raise KvSwapError(
                    f"secondary_tiers[{index}]: a second tier of this process (local) beside "
                    f"{'the NVMe slab (nvme_kv_capacity_blocks > 0)' if slab else 'another'}; "
                    "allowed: one, the NVMe slab by key"
                )
        tiers.sort(key=lambda tier: not tier.local)  # stable: the rest keep their order
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    if not tiers:
        raise ValueError("open_keyed_tiers needs a slab, a store or a factory")
    return tuple(TierCopyEngine(tier) for tier in tiers)


def _own_tier(factory: TierFactory, index: int, host_pool: HostPool) -> SecondaryTier:
    name, layout = f"secondary_tiers[{index}]", host_pool.layout
    try:
        tier = factory(host_slot_bytes(host_pool), layout)
    except Exception as error:  # a user's factory: one line, as a failed import is
        raise KvSwapError(f"{name}: building the tier failed ({one_line(error)})") from None
    if not isinstance(tier, SecondaryTier):
        raise KvSwapError(f"{name}: the factory returned a {type(tier).__name__}, not a "
                          "SecondaryTier (kvswap.data.tiers.base)")  # fmt: skip
    shape = (tier.num_host_slots, tier.block_bytes)
    if shape != (host_pool.num_slots, layout.block_bytes):
        tier.close()
        raise KvSwapError(
            f"{name}: the tier has {shape[0]} host slots of {shape[1]} bytes; the pinned "
            f"pool has {host_pool.num_slots} of {layout.block_bytes}: build it over the host "
            "slots it is given"
        )
    return UserTier(tier, name)
