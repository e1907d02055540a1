"""The simulator's copy engine: the `CopyEngine` contract on modelled links.

    separate engines (shared_copy_engine False)   one engine (shared_copy_engine True)
    GPU_TO_CPU  --> "gpu_to_cpu" link             GPU_TO_CPU --+
    CPU_TO_GPU  --> "cpu_to_gpu" link             CPU_TO_GPU --+--> "pcie" link
    CPU_TO_NVME --> "nvme" link             } with a keyed tier only: the NVMe slab's
    NVME_TO_CPU --> "nvme" link             } link is one drive (reads and writes queue
    CPU_TO_REMOTE --> "cpu_to_remote" link  } together); the shared store's a NIC, full
    REMOTE_TO_CPU --> "remote_to_cpu" link  } duplex, one link per direction (a tier
                                              whose `KeyedLink` is not duplex has one
                                              "<tier>" link both ways); each keyed tier
                                              below has its own ("cpu_to_remote2")

Each link has the two priority queues of the real engine (see `link.py`). On
one shared engine a swap-in (HIGH) that arrives while a swap-out chunk (LOW)
is on the link waits for that whole chunk, however big: the seed article's first
pitfall. With an engine per direction it never waits for a swap-out.
A chunk's time on its link is overhead + bytes / bandwidth, where pageable
host memory lowers the GPU legs' bandwidth and stretches each chunk by a
seeded exponential jitter. A keyed chunk takes its tier's latency + bytes /
its rate (`KeyedLink`: the profile's remote link, by default); when it ends, the
tier's store decides: a read of a key the store no longer holds (evicted,
expired, never written) and a write the store cannot hold report those
destination slots failed, the chunk itself a success (it ran; the other keys
are good), so the control plane drops only those copies and recomputes them.
Times are on the simulator's `VirtualClock`:

- `poll()` reports the chunks whose end time is <= now;
- `wait(transfer_id)` jumps the clock to that chunk's end, which is how a
  swap-in stall or a synchronous swap-out shows up in virtual time;
- `wait_all()` jumps to the end of the last chunk.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvswap.base.tier import CPU_TIER, Tier, keyed_tier_list
from kvswap.base.transfer import (
    CopyEngine,
    Direction,
    TransferChunk,
    TransferResult,
    direction_between,
)
from kvswap.sim.clock import VirtualClock
from kvswap.sim.hardware import HardwareProfile
from kvswap.sim.keyed_tier import KeyedLink
from kvswap.sim.link import Link, LinkJob
from kvswap.sim.remote_store import RemoteStoreView, Settle

GB = 1e9
_GPU_LEGS = (Direction.GPU_TO_CPU, Direction.CPU_TO_GPU)


class ModelledCopyEngine(CopyEngine):
    def __init__(
        self,
        hardware: HardwareProfile,
        clock: VirtualClock,
        *,
        pinned_host: bool = True,
        prefetch_streams: int = 2,
        seed: int = 0,
        keyed: Sequence[tuple[RemoteStoreView, KeyedLink]] = (),
        remote_streams: int = 1,
    ):
        """`keyed`: each keyed tier's view of its store and its link, fastest first
        (`keyed_tier_list` names them)."""
        if prefetch_streams < 1:
            raise ValueError(f"prefetch_streams must be >= 1, got {prefetch_streams}")
        if remote_streams < 1:
            raise ValueError(f"remote_streams must be >= 1, got {remote_streams}")
        self.hardware = hardware
        self.clock = clock
        self.pinned_host = pinned_host
        # The keyed tiers: each one's store view and link, by tier.
        tiers = keyed_tier_list([view.local for view, _ in keyed])
        self.keyed: dict[Tier, tuple[RemoteStoreView, KeyedLink]] = dict(
            zip(tiers, keyed, strict=True)
        )
        self._rng = random.Random(f"kvswap-sim-copy:{seed}")
        yields = hardware.low_yields_per_block

        def link(name: str) -> Link:
            return Link(name, high_streams=prefetch_streams, yields_per_block=yields)

        d2h = link("pcie" if hardware.shared_copy_engine else "gpu_to_cpu")
        h2d = d2h if hardware.shared_copy_engine else link("cpu_to_gpu")
        self.links: dict[Direction, Link] = {Direction.GPU_TO_CPU: d2h, Direction.CPU_TO_GPU: h2d}
        for tier, (view, keyed_link) in self.keyed.items():
            down, up = direction_between(CPU_TIER, tier), direction_between(tier, CPU_TIER)
            # Requests pipelined on the connection overlap their round trips with the
            # previous chunk's data, as a second copy stream overlaps its launch.
            if keyed_link.duplex:
                write = Link(down.value, high_streams=remote_streams)
                read = Link(up.value, high_streams=remote_streams)
            else:  # one drive: reads and writes queue together
                write = read = Link(tier.value, high_streams=remote_streams)
            self.links[down], self.links[up] = write, read
            view.attach(self._settler(write))
        self._all_links = list({id(link): link for link in self.links.values()}.values())
        self._jobs: dict[int, tuple[Link, LinkJob]] = {}
        self._done: dict[int, TransferResult] = {}
        # Per LOW chunk (swap-out, demotion) that held its link while a HIGH chunk
        # (swap-in, restore, sync eviction) waited: the longest such wait; all links
        # together, and per link name (to tell the PCIe stall from the NVMe one).
        self.high_blocked_by_low_s: list[float] = []
        self.high_blocked_by_low_s_by_link: dict[str, list[float]] = {
            link.name: [] for link in self._all_links
        }

    # ---------------------------------------------------------------- contract

    def submit(self, chunk: TransferChunk) -> None:
        if chunk.transfer_id in self._jobs or chunk.transfer_id in self._done:
            raise ValueError(f"transfer {chunk.transfer_id}: id already in use")
        if chunk.direction not in self.links:
            raise ValueError(
                f"transfer {chunk.transfer_id}: {chunk.direction.value} but no such keyed tier "
                "is modelled"
            )
        link = self.links[chunk.direction]
        overhead_s, data_s = self.chunk_time_s(chunk.direction, chunk.num_bytes)
        if self._jittered(chunk.direction):
            data_s *= 1.0 + self._rng.expovariate(1.0 / self.hardware.pageable_jitter)
        job = LinkJob(chunk, self.clock.now_s, overhead_s, data_s, num_slices=1)
        self._jobs[chunk.transfer_id] = (link, job)
        link.submit(job, self.clock.now_s)

    def poll(self) -> list[TransferResult]:
        now_s = self.clock.now_s
        for link in self._distinct_links():
            link.advance(now_s)
        self._collect()
        done = sorted(self._done.values(), key=lambda result: result.end_s)
        self._done.clear()
        return done

    def wait(self, transfer_id: int) -> TransferResult:
        if transfer_id not in self._done:
            entry = self._jobs.get(transfer_id)
            if entry is None:
                raise ValueError(
                    f"transfer {transfer_id} is not pending: never submitted or already reported"
                )
            link, job = entry
            self.clock.advance_to(link.finish(job))
            self._collect()
        return self._done.pop(transfer_id)

    def wait_all(self) -> list[TransferResult]:
        for link in self._distinct_links():
            end_s = link.drain()
            if end_s is not None:
                self.clock.advance_to(end_s)
        return self.poll()

    def close(self) -> None:
        """Nothing to release: the links are bookkeeping only."""

    # ------------------------------------------------------------------ model

    def chunk_time_s(self, direction: Direction, num_bytes: int) -> tuple[float, float]:
        """(overhead, data time) of one chunk before jitter."""
        hw = self.hardware
        if direction.keyed:
            tier = direction.src_tier if direction.upward else direction.dst_tier
            return self.keyed[tier][1].chunk_time_s(num_bytes, load=direction.upward)
        gb_per_s = hw.d2h_gb_per_s if direction is Direction.GPU_TO_CPU else hw.h2d_gb_per_s
        if not self.pinned_host:
            gb_per_s *= hw.pageable_bandwidth_fraction
        return hw.transfer_overhead_s, num_bytes / (gb_per_s * GB)

    def _jittered(self, direction: Direction) -> bool:
        return direction in _GPU_LEGS and not self.pinned_host and self.hardware.pageable_jitter > 0

    def _settler(self, write_link: Link) -> Settle:
        """What a keyed tier's store calls before another engine looks up or reads:
        record in it every write of `write_link` that ended by `t_s` (never past this
        engine's clock: what it submits later cannot change those)."""

        def settle(t_s: float) -> None:
            write_link.advance(min(t_s, self.clock.now_s))
            self._collect_link(write_link)

        return settle

    def busy_s_by_link(self) -> dict[str, float]:
        """Seconds each link spent moving data (or paying overhead) so far."""
        return {link.name: link.busy_s for link in self._distinct_links()}

    def num_pending(self) -> int:
        return len(self._jobs) + len(self._done)

    def _distinct_links(self) -> list[Link]:
        return self._all_links

    def _collect(self) -> None:
        # The remote write link comes before the read link: a read that a store
        # settles first records this engine's finished writes (`_collect_link` of
        # the write link only, never of the link being collected).
        for link in self._distinct_links():
            self._collect_link(link)

    def _collect_link(self, link: Link) -> None:
        finished, link.finished = link.finished, []
        for job in finished:
            assert job.start_s is not None and job.end_s is not None
            chunk = job.chunk
            if job.blocked_high_s > 0:
                self.high_blocked_by_low_s.append(job.blocked_high_s)
                self.high_blocked_by_low_s_by_link[link.name].append(job.blocked_high_s)
            del self._jobs[chunk.transfer_id]
            failed = self._remote_outcome(chunk, job.end_s)
            self._done[chunk.transfer_id] = TransferResult(
                chunk.transfer_id, True, chunk.num_bytes, job.start_s, job.end_s,
                error=f"the store failed {len(failed)} of {chunk.num_blocks} keys" if failed
                else None,
                failed_dst_slots=failed,
            )  # fmt: skip

    def _remote_outcome(self, chunk: TransferChunk, end_s: float) -> tuple[int, ...]:
        """The destination slots of a keyed chunk its store failed (none for others)."""
        direction = chunk.direction
        if not direction.keyed:
            return ()
        store = self.keyed[direction.src_tier if direction.upward else direction.dst_tier][0]
        if direction.upward:
            positions = store.read(chunk.keys, end_s)
        else:
            positions = store.write(chunk.keys, chunk.num_bytes // chunk.num_blocks, end_s)
        return tuple(chunk.dst_slots[index] for index in positions)
