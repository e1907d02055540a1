"""kvswap's secondary tiers as vLLM `SecondaryTierManager`s: the NVMe slab and the store.

vLLM's tiering manager runs them in its scheduler, below the host tier: it
cascades every chunk the host tier stores to each of them, and promotes a chunk
the host tier misses from the first that holds it. Each call is the call of
kvswap's `SecondaryTier` (`kvswap.data.tiers`), which does the work:

    vLLM                                   kvswap SecondaryTier
    lookup(key, ctx) -> HIT / MISS         lookup([key]) == 1; a HIT is held for the
                                           request (hold first, then lookup: no gap)
    submit_store(job)   (a cascade)        submit_store(TransferJob(keys, host_slots=chunk ids))
    submit_load(job)    (a promotion)      submit_load(...)
    get_finished_jobs()                    get_finished_jobs(): success, the keys that did;
                                           a promotion's keys are released for its request
    on_request_finished(ctx)               release what the request still holds
    drain_jobs() / shutdown()              drain() / close()

vLLM answers a HIT by queueing a promotion that it submits at the step's end, and
the cascades of that step may reach the tier first: a slab evicting its least
recently used key would take exactly the old key just found. A tier that holds
keys (`SecondaryTier.holds_keys`: the NVMe slab) keeps each key a request was told
is a HIT until that request's promotion of it lands or the request finishes.

Keys become kvswap keys under the identity of the model's chunks (`keys.py`). Values check
themselves (the slab's CRC per slot; the store's header, key digest and CRC),
so a corrupt or missing value is a key left out of a promotion's
`successful_keys`: vLLM drops that chunk and the request recomputes it.

`KvswapOffloadingSpec` builds them from its `nvme_*` / `remote_*` keys and hands
them `copied_below`, so the host tier's ranking knows a chunk is clean. vLLM's
own `TieringOffloadingSpec` can build them too:
`"secondary_tiers": [{"type": "KvswapNvmeTier", "module_path":
"kvswap.integrations.vllm", "nvme_dir": ..., "nvme_kv_capacity_bytes": ...}]`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, TypeVar

from vllm.v1.kv_offload.base import Locality, LookupResult, Medium, RequestOffloadingContext
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvswap.base.tier import Tier
from kvswap.control.policy import named_policy
from kvswap.data.layout import KVLayout
from kvswap.data.remote_format import layout_fingerprint
from kvswap.data.tiers.base import SecondaryTier, TransferJob
from kvswap.data.tiers.nvme_tier import open_nvme_tier
from kvswap.data.tiers.redis_tier import open_redis_tier
from kvswap.errors import ConfigError
from kvswap.import_path import one_line
from kvswap.integrations.vllm.keys import VllmKeys, vllm_identity
from kvswap.integrations.vllm.settings import SOURCE, AdapterSettings, adapter_settings

#: What a tier tells the host tier's ranking: these chunks now have a copy below.
CopiedBelow = Callable[[Iterable[bytes]], None]
_T = TypeVar("_T")


class KvswapSecondaryTier(SecondaryTierManager):
    """One kvswap `SecondaryTier` behind vLLM's interface (module docstring)."""

    #: Whether the tier's keys leave this process (`vllm_identity`'s `shared`).
    shared: ClassVar[bool] = False

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        **config: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.keys = VllmKeys(
            vllm_identity(
                offloading_spec.config,
                tokens_per_chunk=offloading_spec.tokens_per_block[0]
                * offloading_spec.blocks_per_chunk,
                row_bytes=self.block_size_bytes, shared=self.shared, source=SOURCE,
            )
        )  # fmt: skip
        self.copied_below: CopiedBelow | None = None  # set by KvswapOffloadingSpec
        self.tier = self._open(adapter_settings(config), primary_kv_view)
        # job id -> (its vLLM keys in order, is a load, the request's id)
        self._jobs: dict[int, tuple[tuple[Any, ...], bool, str]] = {}
        # request id -> the kvswap keys held for it (HITs not yet promoted)
        self._held: dict[str, set[bytes]] = {}
        self._waited: list[Any] = []  # results `wait_for` took, not yet reported

    def _open(self, settings: AdapterSettings, host_rows: memoryview) -> SecondaryTier:
        raise NotImplementedError

    # --- vLLM's SecondaryTierManager --------------------------------------------------

    def lookup(self, key: bytes, req_context: Any) -> Any:
        kvswap_key = self.keys.key(key)
        if not self.tier.holds_keys:
            return LookupResult.HIT if self.tier.lookup([kvswap_key]) else LookupResult.MISS
        held = self._held.setdefault(req_context.req_id, set())
        new = kvswap_key not in held
        if new:
            self.tier.hold([kvswap_key])  # before the lookup: no eviction in between
        found = self.tier.lookup([kvswap_key]) == 1
        if new and found:
            held.add(kvswap_key)
        elif new:
            self.tier.release([kvswap_key])
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: Any) -> None:
        self.tier.submit_store(self._job(job_metadata, is_load=False))

    def submit_load(self, job_metadata: Any) -> None:
        self.tier.submit_load(self._job(job_metadata, is_load=True))

    def get_finished_jobs(self) -> list[Any]:
        results, self._waited = self._waited, []
        results.extend(self._result(done) for done in self.tier.get_finished_jobs())
        return results

    def wait_for(self, job_id: int) -> Any:
        """Block until job `job_id` finished (a promotion the step waits for); its
        result, which also comes with the next `get_finished_jobs()`, as any other's."""
        result = self._result(self.tier.wait(job_id))
        self._waited.append(result)
        return result

    def _result(self, done: Any) -> Any:
        vllm_keys, is_load, req_id = self._jobs.pop(done.job_id)
        if is_load:
            self._release(req_id, [self.keys.key(key) for key in vllm_keys])
        kept = set(done.successful_keys)
        successful = [key for key in vllm_keys if self.keys.key(key) in kept]
        if not is_load and successful and self.copied_below is not None:
            self.copied_below(successful)
        return JobResult(
            job_id=done.job_id,
            success=done.success,
            successful_keys=successful if is_load else None,
            transfer_time=done.transfer_time_s,
            transfer_bytes=done.transfer_bytes,
        )

    def has_pending_work(self) -> bool:
        return bool(self._jobs or self._waited)

    def on_new_request(self, req_context: Any) -> Any:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: Any) -> None:
        held = self._held.pop(req_context.req_id, None)
        if held:
            self.tier.release(sorted(held))

    @property
    def num_held_keys(self) -> int:
        """Keys held for requests (each request's own, counted per request)."""
        return sum(len(held) for held in self._held.values())

    def _release(self, req_id: str, kvswap_keys: Iterable[bytes]) -> None:
        """End the request's holds of those of `kvswap_keys` it holds."""
        held = self._held.get(req_id)
        if not held:
            return
        done = [key for key in kvswap_keys if key in held]
        if done:
            held.difference_update(done)
            self.tier.release(done)

    def drain_jobs(self) -> None:
        self.tier.drain()

    def shutdown(self) -> None:
        self.tier.close()

    def counters(self) -> Mapping[str, int]:
        """kvswap's counts for this tier (hits, corrupt values, skipped writes, ...)."""
        return self.tier.counters()

    def _job(self, job: Any, *, is_load: bool) -> TransferJob:
        vllm_keys = tuple(job.keys)
        self._jobs[job.job_id] = (vllm_keys, is_load, job.req_context.req_id)
        return TransferJob(
            job_id=job.job_id,
            keys=tuple(self.keys.key(key) for key in vllm_keys),
            host_slots=tuple(int(chunk) for chunk in job.chunk_ids),
            is_load=is_load,
        )


class KvswapNvmeTier(KvswapSecondaryTier):
    """kvswap's NVMe slab (`NvmeTier` over a `DiskPool`), slots of one host chunk each."""

    medium: ClassVar[Any] = Medium.STORAGE

    def _open(self, settings: AdapterSettings, host_rows: memoryview) -> SecondaryTier:
        self.locality = Locality.LOCAL
        nvme = _required(settings.nvme, "nvme_dir and nvme_kv_capacity_bytes")
        num_slots = nvme.capacity_bytes // self.block_size_bytes
        if num_slots < 1:
            raise ConfigError(
                f"{SOURCE}: nvme_kv_capacity_bytes = {nvme.capacity_bytes} holds no host chunk "
                f"of {self.block_size_bytes} bytes; allowed: at least one"
            )
        policy = named_policy(Tier.NVME, nvme.eviction_policy, capacity_blocks=num_slots)
        return open_nvme_tier(host_rows, nvme.directory, num_slots, policy=policy)


class KvswapRedisTier(KvswapSecondaryTier):
    """kvswap's store on the Redis protocol (`RedisTier`): one self-checking value per
    chunk, shared by every vLLM instance of the same model that names it."""

    medium: ClassVar[Any] = Medium.STORAGE
    cache_hit_source: ClassVar[Any] = CacheHitSource.EXTERNAL_UNSPECIFIED
    shared: ClassVar[bool] = True

    def _open(self, settings: AdapterSettings, host_rows: memoryview) -> SecondaryTier:
        self.locality = Locality.REMOTE
        remote = _required(settings.remote, "remote_url")
        layout = KVLayout.from_block_bytes(self.block_size_bytes)
        return open_redis_tier(
            remote.url, host_rows, layout_fingerprint=layout_fingerprint(layout),
            namespace=remote.namespace or self.keys.store_prefix, timeout_ms=remote.timeout_ms,
            required=remote.required, ttl_s=remote.ttl_s,
            max_inflight_write_chunks=remote.max_inflight_chunks,
        )  # fmt: skip


def _required(value: _T | None, keys: str) -> _T:
    if value is None:
        raise ConfigError(f"{SOURCE}: this secondary tier needs {keys}")
    return value


def build_secondary_tiers(
    spec: Any, host_rows: memoryview, copied_below: CopiedBelow
) -> list[SecondaryTierManager]:
    """The tiers `spec.settings` names, NVMe first (the nearer one is looked up first);
    each reports the chunks it stored to `copied_below` (the host tier's ranking)."""
    settings: AdapterSettings = spec.settings
    extra = spec.extra_config
    tiers: list[KvswapSecondaryTier] = []
    try:
        if settings.nvme is not None:
            tiers.append(KvswapNvmeTier(spec, host_rows, "kvswap-nvme", **_keys(extra, "nvme_")))
        if settings.remote is not None:
            tiers.append(
                KvswapRedisTier(spec, host_rows, "kvswap-redis", **_keys(extra, "remote_"))
            )
    except BaseException:
        for tier in tiers:
            tier.shutdown()
        raise
    for tier in tiers:
        tier.copied_below = copied_below
    return list(tiers)


def _keys(extra: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    return {key: value for key, value in extra.items() if key.startswith(prefix)}


def build_vllm_tiers(
    spec: Any,
    host_rows: memoryview,
    entries: Iterable[Mapping[str, Any]],
    copied_below: CopiedBelow,
) -> list[Any]:
    """vLLM's own secondary tiers (`secondary_tiers` entries), built by vLLM's factory
    over the same host rows, in their order; one line naming the entry that fails.
    Each reports the chunks it stored to `copied_below`, as kvswap's tiers do."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    built: list[Any] = []
    try:
        for index, entry in enumerate(entries):
            tier = _vllm_tier(SecondaryTierFactory, index, entry, host_rows, spec)
            _report_stores(tier, copied_below)
            built.append(tier)
    except BaseException:
        for tier in reversed(built):
            tier.shutdown()
        raise
    return built


def _vllm_tier(
    factory: Any, index: int, entry: Mapping[str, Any], host_rows: memoryview, spec: Any
) -> Any:
    try:
        return factory.create_secondary_tier(dict(entry), host_rows, spec)
    except Exception as error:  # vLLM's or a user's tier: one line, as for a key
        raise ConfigError(
            f"{SOURCE}: secondary_tiers[{index}] (type {entry['type']!r}): vLLM could not "
            f"build it ({one_line(error)})"
        ) from None


def _report_stores(tier: Any, copied_below: CopiedBelow) -> None:
    """Make `tier` (one of vLLM's, which knows nothing of kvswap's ranking) report the
    chunks of each store job it finished whole to `copied_below`: its two calls are
    wrapped on the instance, so vLLM's manager calls them as ever."""
    stores: dict[int, tuple[Any, ...]] = {}  # job id -> its keys, until reported
    submit_store, get_finished_jobs = tier.submit_store, tier.get_finished_jobs

    def submit(job: Any) -> None:
        submit_store(job)
        stores[job.job_id] = tuple(job.keys)

    def finished() -> list[Any]:
        done = list(get_finished_jobs())
        for result in done:
            keys = stores.pop(result.job_id, None)
            if keys and result.success:  # vLLM's tiers name no keys of a partial store
                copied_below(keys)
        return done

    tier.submit_store, tier.get_finished_jobs = submit, finished


def tier_counters(tier: Any) -> Mapping[str, int]:
    """A secondary tier's counts for the stats line: kvswap's tiers keep them, vLLM's
    own tiers have none."""
    counters = getattr(tier, "counters", None)
    return counters() if callable(counters) else {}
