"""Pages in and out of one kvswap `SecondaryTier`, in the calls HiCache makes.

    exists_prefix(hashes)          tier.lookup(K, V, K, V, ...) // 2: whole pages present
    load(hashes, pages)            one load job, both halves of every page; a page is
                                   loaded only when both arrived intact
    store(hashes, pages)           one store job; a page is stored when both halves are

The tier is kvswap's (`RedisTier`: self-checking values bound to their key, a
store that is down or slow is a miss; `NvmeTier`: the slab, evicting by policy;
or both, the slab in front, as a `TierList`),
built over the host slots it copies to and from (`pages.half_page_slots`, or a
staging buffer for SGLang's legacy calls). A value that fails its check, a key
that is absent, a store that died: a page that is not there, never an exception.

SGLang calls from more than one thread (prefetch, backup): submits are taken one
at a time under a lock; each caller then waits for its own job.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Mapping, Sequence

from kvswap.base.tier import Tier
from kvswap.control.policy import named_policy
from kvswap.data.remote_format import layout_fingerprint
from kvswap.data.tiers.base import HostSlots, SecondaryTier, TransferJob
from kvswap.data.tiers.nvme_tier import open_nvme_tier
from kvswap.data.tiers.redis_tier import open_redis_tier
from kvswap.data.tiers.tier_list import TierList
from kvswap.integrations.sglang.options import StorageOptions
from kvswap.integrations.sglang.pages import PageKeys, PageShape
from kvswap.model.kv_identity import KvIdentity


class PageStore:
    """SGLang pages on `tier`, whose host slots are [2 * num_pages, half_page_bytes]:
    page p's halves are slots p and num_pages + p. Owns the tier (`close()`)."""

    def __init__(self, tier: SecondaryTier, keys: PageKeys) -> None:
        self.tier = tier
        self.keys = keys
        self.num_pages = tier.num_host_slots // 2
        self._job_ids = itertools.count(1)
        self._submit = threading.Lock()

    def exists_prefix(self, page_hashes: Sequence[str]) -> int:
        """How many of the pages, from the first, the tier holds both halves of."""
        if not page_hashes:
            return 0
        return self.tier.lookup(self.keys.flat(page_hashes)) // 2

    def load(self, page_hashes: Sequence[str], pages: Sequence[int]) -> list[bool]:
        """The tier's pages into host pages `pages`; which arrived whole."""
        return self._move(page_hashes, pages, is_load=True)

    def store(self, page_hashes: Sequence[str], pages: Sequence[int]) -> list[bool]:
        """Host pages `pages` into the tier as `page_hashes`; which are stored."""
        return self._move(page_hashes, pages, is_load=False)

    def counters(self) -> Mapping[str, int]:
        return self.tier.counters()

    def close(self) -> None:
        self.tier.close()

    def _move(
        self, page_hashes: Sequence[str], pages: Sequence[int], *, is_load: bool
    ) -> list[bool]:
        if len(page_hashes) != len(pages):
            raise ValueError(f"{len(page_hashes)} page hashes for {len(pages)} host pages")
        if not pages:
            return []
        halves = [self.keys.halves(page_hash) for page_hash in page_hashes]
        keys = tuple(key for pair in halves for key in pair)
        slots = tuple(slot for page in pages for slot in (page, self.num_pages + page))
        job = TransferJob(next(self._job_ids), keys, slots, is_load=is_load)
        with self._submit:
            if is_load:
                self.tier.submit_load(job)
            else:
                self.tier.submit_store(job)
        done = frozenset(self.tier.wait(job.job_id).successful_keys)
        return [k in done and v in done for k, v in halves]


def open_page_store(
    options: StorageOptions, shape: PageShape, identity: KvIdentity, host_slots: HostSlots
) -> PageStore:
    """The tiers `options` name over `host_slots`: the NVMe slab, the shared store, or
    both as one `TierList` (the slab in front: a page stored goes to both; a page the
    slab lacks or fails is read from the store)."""
    keys = PageKeys(identity, options.tenant_salt)
    tiers: list[SecondaryTier] = []
    try:
        if options.nvme_dir is not None:
            num_slots = 2 * options.nvme_pages  # a page is two half-page slots
            policy = named_policy(
                Tier.NVME, options.nvme_eviction_policy, capacity_blocks=num_slots
            )
            tiers.append(open_nvme_tier(host_slots, options.nvme_dir, num_slots, policy=policy))
        if options.remote_url is not None:
            tiers.append(open_redis_tier(
                options.remote_url, host_slots,
                layout_fingerprint=layout_fingerprint(shape.half_layout),
                namespace=options.remote_namespace, timeout_ms=options.remote_timeout_ms,
                required=options.remote_required,
            ))  # fmt: skip
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    assert tiers, "StorageOptions.check: one of them at least"
    return PageStore(tiers[0] if len(tiers) == 1 else TierList(tiers), keys)
