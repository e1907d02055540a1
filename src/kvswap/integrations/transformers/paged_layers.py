"""A model's KV in per-layer blocks, paged across the tiers by kvswap's own parts.

transformers hands a cache one layer's new K/V at a time and needs that layer's
whole K/V back. Here each (layer, batch row) is one kvswap sequence, its tokens
the positions 0, 1, 2, ..., and its blocks one layer's K and V:

    sequence id  = layer * batch_size + row        salt: "<cache nonce>/<layer>/<row>"
    block        = KVLayout(num_layers=1): [1, 2, block_tokens, num_kv_heads, head_dim]
    device pool  = DevicePool(resident_blocks)   the GPU tier: every layer's resident blocks
    pinned pool  = HostPool(cpu_blocks)          the CPU tier, below it NVMe and the store

Nothing here decides where a block lives. The `Swapper` (kvswap.control) does,
asking the tiers' `EvictionPolicy`s (sinks protected, minimum residency, cost
ranks), and the copy engine (`LocalCopyEngine`, with the remote store's
`TierCopyEngine` behind a `TieredCopyEngine`) moves the bytes. One layer's turn,
in the swapper's own call order:

    layer 0 only     begin_step(step)                 finished transfers, policy clocks
    set_running(layer's sequences)                    its blocks may not leave now
    wait_ready(...)                                   cold blocks come up (HIGH queue);
                                                      the wait is swap-wait time
    allocate(..., new positions)                      new blocks get device slots
    write new K/V into their slots; gather the layer's K/V  -> returned to the model
    set_running(..., False); prefetch(next layer)     HIGH queue, while this layer computes
    last layer only  end_step()                       swap-out past the watermark (LOW),
                                                      demotion to NVMe / the store

Every transfer of the step is the swapper's and the copy engine's; the figures
(bytes per direction, swap wait, stalls) are the swapper's `KVMetrics`.
"""

from __future__ import annotations

import secrets
import time
from contextlib import ExitStack
from pathlib import Path

import torch

from kvswap.base.tier import Tier
from kvswap.base.transfer import CopyEngine
from kvswap.base.write_policy import RemoteWritePolicy
from kvswap.control.metrics import KVMetrics
from kvswap.control.policy import named_policy
from kvswap.control.remote_tier import KeyedTier
from kvswap.control.settings import RemoteSettings, SwapSettings
from kvswap.control.store_records import StoreLayout
from kvswap.control.swapper import Swapper
from kvswap.data.copy_engine import LocalCopyEngine
from kvswap.data.device_pool import DevicePool
from kvswap.data.host_pool import HostPool
from kvswap.data.layout import K_INDEX, V_INDEX, KVLayout
from kvswap.data.remote_copy import TierFactory, open_keyed_tiers, open_store_tier
from kvswap.data.tiered_copy import TieredCopyEngine
from kvswap.data.tiers.base import HostSlots, SecondaryTier
from kvswap.data.tiers.copy_adapter import TierCopyEngine
from kvswap.data.tiers.nvme_tier import open_nvme_tier
from kvswap.errors import KvSwapError
from kvswap.integrations.transformers.report import CacheReport, ReportWindow
from kvswap.integrations.transformers.settings import TieredCacheSettings
from kvswap.model.kv_identity import KvIdentity
from kvswap.units import ceil_div


class PagedLayers:
    """Every layer's KV of one batch, in blocks paged by a `Swapper` (module docstring).
    Built on the first layer's first K/V; `close()` releases every pool and thread."""

    def __init__(
        self,
        settings: TieredCacheSettings,
        *,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        identity: KvIdentity,
    ) -> None:
        settings.check_cpu_blocks(num_layers, batch_size)
        self.settings = settings
        self.num_layers = num_layers
        self.batch_size = batch_size
        self.device = device
        self.layout = KVLayout(
            num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim,
            block_tokens=settings.block_tokens, dtype=dtype,
        )  # fmt: skip
        self.num_tokens = [0] * num_layers  # tokens held, per layer (every row alike)
        self._step = 0
        self._resources = ExitStack()  # what close() releases, last made first
        try:
            self._allocate(identity)
        except BaseException:
            self._resources.close()
            raise
        self._window = ReportWindow(self.swapper.metrics, self.layout.block_bytes)

    def _allocate(self, identity: KvIdentity) -> None:
        settings, layout = self.settings, self.layout
        host_pool = self._resources.enter_context(HostPool(layout, settings.cpu_blocks))
        self.host_pool = host_pool
        self.device_pool = DevicePool(layout, settings.resident_blocks, self.device)
        local = self._resources.enter_context(
            LocalCopyEngine(self.device_pool, host_pool, prefetch_streams=settings.prefetch_streams)
        )
        engine: CopyEngine = local
        namespace = identity.namespace()
        keyed: tuple[TierCopyEngine, ...] = ()
        keyed_uses: tuple[KeyedTier, ...] = ()
        if settings.has_keyed_tiers:
            store_namespace = f"kvswap-hf:{identity.fingerprint()}"
            slab: TierFactory | None = None
            if settings.nvme_blocks:  # this cache's own NVMe slab, by key
                assert settings.nvme_dir is not None  # checked by the settings
                nvme_dir, num_slots = Path(settings.nvme_dir), settings.nvme_blocks
                policy_name = settings.nvme_eviction_policy

                def slab(host_slots: HostSlots, _layout: KVLayout) -> SecondaryTier:
                    policy = named_policy(Tier.NVME, policy_name, capacity_blocks=num_slots)
                    return open_nvme_tier(host_slots, nvme_dir, num_slots, policy=policy,
                                          local=True)  # fmt: skip

            store = None
            if settings.remote_url is not None:
                store = open_store_tier(
                    settings.remote_url, host_pool, namespace=store_namespace,
                    timeout_ms=settings.remote_timeout_ms,
                )  # fmt: skip
            keyed = open_keyed_tiers(store, settings.secondary_tiers, host_pool, slab=slab)
            for each in keyed:
                self._resources.callback(each.close)
            # Cold blocks leave the pinned pool for the keyed tiers (this cache's blocks
            # are its own: keys salted per cache, so nothing is read back but what it
            # wrote), whatever a tier asks for.
            uses = RemoteSettings(store_namespace, RemoteWritePolicy.ON_DEMOTE)
            keyed_uses = tuple(KeyedTier(each, uses) for each in keyed)
            engine = TieredCopyEngine(local, keyed)
        self.keyed = keyed
        self._has_tier_below = bool(keyed)
        self.copy_engine = engine
        self.swapper = Swapper(
            StoreLayout(
                block_tokens=settings.block_tokens,
                num_gpu_blocks=settings.resident_blocks,
                num_cpu_blocks=settings.cpu_blocks,
                protected_blocks=settings.protected_sink_blocks,
                namespace=namespace,
            ),
            settings.policy_options(),
            SwapSettings(block_bytes=layout.block_bytes),
            engine,
            time.perf_counter,
            keyed=keyed_uses,
        )
        # Transfers end before the engine closes (close() runs these last-made first).
        self._resources.callback(self.swapper.drain)
        nonce = secrets.token_hex(8)
        for layer in range(self.num_layers):
            for seq_id in self._seq_ids(layer):
                row = seq_id - layer * self.batch_size
                self.swapper.open_sequence(seq_id, [], cache_salt=f"{nonce}/{layer}/{row}")

    # --- one layer's turn -----------------------------------------------------------

    def append(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `keys`/`values` ([batch, kv_heads, new_tokens, head_dim]) as the layer's
        next tokens; the layer's whole K and V ([batch, kv_heads, tokens, head_dim])."""
        swapper, seq_ids = self.swapper, self._seq_ids(layer)
        if layer == 0:
            self._step += 1
            self._window.step_began(time.perf_counter())
            swapper.begin_step(self._step)
        for seq_id in seq_ids:
            swapper.set_running(seq_id, True)
        self._bring_up(layer, seq_ids)
        start, num_new = self.num_tokens[layer], keys.shape[2]
        positions = list(range(start, start + num_new))
        for seq_id in seq_ids:
            if not self._allocate_new(seq_id, positions):
                raise KvSwapError(self._no_room(layer, start + num_new))
        self.num_tokens[layer] = start + num_new
        tables = self._tables(seq_ids)
        self._write(tables, start, keys, values)
        full_keys, full_values = self._gather(tables, self.num_tokens[layer])
        for seq_id in seq_ids:
            swapper.set_running(seq_id, False)
        self._prefetch((layer + 1) % self.num_layers)
        if layer == self.num_layers - 1:
            swapper.end_step()
        return full_keys, full_values

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's whole K and V ([batch, kv_heads, tokens, head_dim]), brought up
        from wherever its blocks are, outside any step (to look, as a test does)."""
        seq_ids = self._seq_ids(layer)
        for seq_id in seq_ids:
            self.swapper.set_running(seq_id, True)
        try:
            self._bring_up(layer, seq_ids)
            return self._gather(self._tables(seq_ids), self.num_tokens[layer])
        finally:
            for seq_id in seq_ids:
                self.swapper.set_running(seq_id, False)

    def _tables(self, seq_ids: list[int]) -> torch.Tensor:
        """[batch, num_blocks]: the device slots of each row's blocks, in order."""
        slots = [self.swapper.gpu_block_table(seq_id) for seq_id in seq_ids]
        return torch.tensor(slots, dtype=torch.long, device=self.device)

    def _prefetch(self, layer: int) -> None:
        """Start the layer's cold blocks up on the HIGH queue, room made for them first
        (the policy's victims: clean copies are dropped at once, dirty ones copied out),
        so that they move while the layer before computes."""
        seq_ids = self._seq_ids(layer)
        missing = sum(self.swapper.num_missing_gpu_blocks(seq_id) for seq_id in seq_ids)
        if missing:
            self.swapper.ensure_gpu_slots(missing)
            self.swapper.prefetch(seq_ids)

    def _allocate_new(self, seq_id: int, positions: list[int]) -> bool:
        """Device slots for the new tokens' blocks. Other layers' blocks leave the
        device for them through the pinned pool; while it is too full to take them,
        room is made below it (`_bring_up`) and the allocation is tried again. Room
        that was there already (copies landed since the allocation was tried) earns
        one more try; a second try with no slot freed means the pinned pool is not
        the cause."""
        num_blocks = ceil_div(len(positions), self.layout.block_tokens) + 1
        room_was_there = False
        while not self.swapper.allocate(seq_id, positions):
            if not self._has_tier_below:
                return False
            freed = self.swapper.make_cpu_room(num_blocks)
            if not freed and room_was_there:
                return False
            room_was_there = not freed
        return True

    def _bring_up(self, layer: int, seq_ids: list[int]) -> None:
        """The layer's blocks all on the device, or one line saying why they cannot be.

        One step moves every layer's blocks through the device, and what leaves it (or
        comes up from NVMe or the store) passes through the pinned pool, which
        `end_step`'s demotion empties only after the last layer. So a pinned pool full
        mid-step sends its coldest copies below now (`Swapper.make_cpu_room`) and the
        wait is tried again, while each try brings more of the layer's blocks up: the
        tiers below add capacity whatever the pinned pool's size."""
        result = self.swapper.wait_ready(seq_ids)
        self._window.waited(result.wait_s)
        resident = self._num_resident(seq_ids)
        while result.not_ready and self._has_tier_below:
            missing = sum(self.swapper.num_missing_gpu_blocks(s) for s in seq_ids)
            self.swapper.make_cpu_room(2 * missing + 1)  # a slot each way: down and up
            result = self.swapper.wait_ready(seq_ids)
            self._window.waited(result.wait_s)
            resident, before = self._num_resident(seq_ids), resident
            if resident <= before:
                break  # no block came up: the pinned pool is not what is short
        lost = [s for s in seq_ids if self.swapper.first_lost_token(s) is not None]
        if lost:
            raise KvSwapError(
                f"TieredCache: layer {layer}'s KV of row {lost[0] - layer * self.batch_size} "
                "was lost (every copy failed its check or its tier went away); a cache "
                "cannot recompute it: generate again"
            )
        if result.not_ready:
            raise KvSwapError(self._no_room(layer, self.num_tokens[layer]))

    def _num_resident(self, seq_ids: list[int]) -> int:
        """The sequences' blocks with a ready device copy."""
        blocks = (b for s in seq_ids for b in self.swapper.store.sequence_blocks(s))
        return sum(block.ready_copy(Tier.GPU) is not None for block in blocks)

    def _no_room(self, layer: int, num_tokens: int) -> str:
        blocks = ceil_div(num_tokens, self.layout.block_tokens) * self.batch_size
        sinks = self.settings.protected_sink_blocks * self.batch_size * (self.num_layers - 1)
        return (
            f"TieredCache: resident_blocks = {self.settings.resident_blocks} cannot hold "
            f"layer {layer}'s {blocks} blocks next to the other layers' {sinks} sink blocks "
            f"(protected_sink_blocks = {self.settings.protected_sink_blocks} per layer and "
            f"row) and the blocks min_residency_steps = {self.settings.min_residency_steps} "
            "keeps, or with no room below for what must leave; allowed: a larger "
            "resident_blocks or cpu_blocks"
        )

    def _write(
        self, tables: torch.Tensor, start: int, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """New tokens into their slots. keys, values: [batch, kv_heads, new, head_dim]."""
        block_tokens = self.layout.block_tokens
        positions = torch.arange(start, start + keys.shape[2], device=self.device)
        slots = tables[:, positions // block_tokens].reshape(-1)  # [batch * new]
        offsets = (positions % block_tokens).repeat(self.batch_size)  # [batch * new]
        kv = self.device_pool.kv  # [slots, 1, 2, block_tokens, kv_heads, head_dim]
        for plane, new in ((K_INDEX, keys), (V_INDEX, values)):
            rows = new.transpose(1, 2).reshape(-1, new.shape[1], new.shape[3])  # [batch*new, h, d]
            kv[:, 0, plane][slots, offsets] = rows.to(self.layout.dtype)

    def _gather(self, tables: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V, each [batch, kv_heads, num_tokens, head_dim], contiguous."""
        kv = self.device_pool.kv
        out = []
        for plane in (K_INDEX, V_INDEX):
            blocks = kv[:, 0, plane][tables]  # [batch, num_blocks, block_tokens, heads, dim]
            flat = blocks.reshape(self.batch_size, -1, *blocks.shape[3:])[:, :num_tokens]
            out.append(flat.transpose(1, 2).contiguous())
        return out[0], out[1]

    def _seq_ids(self, layer: int) -> list[int]:
        return list(range(layer * self.batch_size, (layer + 1) * self.batch_size))

    # --- figures and the end ----------------------------------------------------------

    @property
    def metrics(self) -> KVMetrics:
        return self.swapper.metrics

    def take_report(self) -> CacheReport:
        """The figures since the last report (or since the cache was built)."""
        cpu = self.swapper.occupancy()[Tier.CPU]
        return self._window.take(time.perf_counter(), cpu.peak_used_blocks / cpu.num_blocks)

    def check_integrity(self) -> None:
        self.swapper.check_integrity()
        self.device_pool.check_integrity()
        self.host_pool.check_integrity()

    def close(self) -> None:
        """Finish the transfers, then release the copy lanes, the store's connections,
        the pinned pool and the NVMe slab (its file removed). Safe to call twice."""
        self._resources.close()
