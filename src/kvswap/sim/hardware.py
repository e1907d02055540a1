"""Hardware profiles: what the simulator assumes about a machine.

A profile is a handful of measured or published numbers: GPU and host memory,
HBM bandwidth and dense fp16 compute (with the fraction a real step reaches),
the host<->device link per direction with a per-transfer overhead, how much
worse pageable host memory is, and the NVMe drive. Presets cover the
article's machine and two newer ones; `hardware_from_bench` replaces the link
numbers with what `kvswap bench` measured on a real machine.

Sources and assumptions (GB/s = 1e9 bytes/s):
- article-40gb: an A100-40GB-class card (HBM2 1555 GB/s, 312 TFLOPS dense
  bf16), PCIe 4.0 x16 at the seed article's measured ~25 GB/s, 96 GB of RAM and an
  NVMe drive reading ~7 GB/s (the seed article's figures).
- h100-pcie5: H100 PCIe 80 GB (HBM2e ~2000 GB/s, ~756 TFLOPS dense bf16),
  PCIe 5.0 x16 at ~50 GB/s real (the seed article: 45-55).
- h200: H200 141 GB (HBM3e 4800 GB/s, ~989 TFLOPS dense bf16), PCIe 5.0.
- Efficiencies (0.8 of HBM for decode, 0.55 of peak for prefill), a 1 ms
  per-step launch/scheduling overhead and a 15 us per-chunk copy overhead
  are typical values, not measurements; `kvswap bench` measures the link.
- Pageable host memory: DMA cannot read it directly, the driver stages it
  through a bounce buffer, so it runs at about half the pinned bandwidth and
  each chunk takes an exponentially distributed extra time (page faults,
  staging contention) with a mean of 30% of its nominal time.
- A DMA chunk is never preempted once it started. Whether host->device and
  device->host chunks share one copy engine (`shared_copy_engine`) is per
  profile:

      profile        copy engines            why
      article-40gb   ONE, shared             the seed article's finding: a 512 MB swap-out
                                             chunk "held the DMA engine" and delayed
                                             swap-ins (copies in both directions on
                                             one engine or stream, as on many
                                             consumer / PCIe setups)
      h100-pcie5     one per direction       H100 and H200 have several copy engines;
      h200           one per direction       PCIe is full duplex
      bench:FILE     one per direction       unless the file was measured without a
                     (CPU report: shared)    GPU: host memcpy in both directions then
                                             shares one memory bus

  Turning the option off (or on) changes nothing else in a profile.
- The remote link (a shared store such as Redis, reached over the network;
  every preset has the same one): ASSUMED, not measured, a 25 GbE-class NIC
  per engine. 25 Gbit/s is 3.125 GB/s on the wire; Ethernet, IP and TCP
  framing leave ~2.9 GB/s, and a store's protocol and copies some more, so
  `remote_gb_per_s` = 2.5 per direction (the NIC is full duplex: one link per
  direction, as the host<->device link with one copy engine per direction).
  `remote_rtt_ms` = 0.2: a same-rack TCP round trip is some tens of
  microseconds; the store's request handling and the client's system calls
  bring one request to about a fifth of a millisecond. A chunk takes
  rtt + bytes / bandwidth; a lookup costs one rtt. The store's own NIC and CPU
  are not modelled (each engine gets its full link however many share the
  store). `kvswap simulate --remote-gb-per-s / --remote-rtt-ms` replace them.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from kvswap.bench.report import BenchReport, link_gb_per_s, load_report
from kvswap.config_load import suggest
from kvswap.errors import KvSwapError
from kvswap.ledger import check_link_gb_per_s, check_measured_link
from kvswap.units import GIB

GB = 1_000_000_000


@dataclass(frozen=True)
class HardwareProfile:
    """One machine as the cost and copy models see it."""

    name: str
    description: str
    gpu_mem_bytes: int
    host_mem_bytes: int
    gpu_reserve_bytes: int  # activations, CUDA context, fragmentation: never KV
    hbm_gb_per_s: float
    peak_tflops: float  # dense fp16/bf16
    mem_efficiency: float  # share of hbm_gb_per_s a step's memory traffic reaches
    compute_efficiency: float  # share of peak_tflops a step's matmuls reach
    step_overhead_s: float  # per step: kernel launches, scheduling, sampling
    h2d_gb_per_s: float  # pinned host -> device, real
    d2h_gb_per_s: float  # device -> pinned host, real
    transfer_overhead_s: float  # per chunk: copy launch + gather/scatter kernel
    pageable_bandwidth_fraction: float  # pageable GB/s / pinned GB/s
    pageable_jitter: float  # mean extra time of a pageable chunk / its nominal time
    nvme_read_gb_per_s: float
    nvme_write_gb_per_s: float
    nvme_latency_s: float  # per chunk
    seq_overhead_s: float = 0.0  # per sequence in a step (0 on GPUs: attention is batched)
    # True: host->device and device->host chunks queue on ONE copy engine (one link,
    # HIGH first among the waiting chunks, a started chunk never preempted), so a big
    # swap-out chunk delays a swap-in. False: one engine per direction (full duplex).
    shared_copy_engine: bool = False
    low_yields_per_block: bool = False  # a LOW chunk yields to HIGH between blocks
    # The link to a shared remote store, per direction (assumptions: see the module).
    remote_gb_per_s: float = 2.5
    remote_rtt_ms: float = 0.2  # per chunk and per lookup: one request's round trip

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            positive = field.name not in _MAY_BE_ZERO
            if not (value > 0 if positive else value >= 0):
                allowed = "> 0" if positive else ">= 0"
                raise KvSwapError(
                    f"hardware {self.name!r}: {field.name} = {value}; allowed {allowed}"
                )
        for name in ("mem_efficiency", "compute_efficiency", "pageable_bandwidth_fraction"):
            if getattr(self, name) > 1:
                raise KvSwapError(
                    f"hardware {self.name!r}: {name} = {getattr(self, name)}; allowed 0 < x <= 1"
                )


_MAY_BE_ZERO = frozenset(
    {"gpu_reserve_bytes", "step_overhead_s", "transfer_overhead_s", "pageable_jitter",
     "nvme_latency_s", "seq_overhead_s", "remote_rtt_ms"}
)  # fmt: skip


def _preset(
    name: str,
    description: str,
    gpu_gb: int,
    host_gb: int,
    hbm_gb_per_s: float,
    tflops: float,
    link_gb_per_s: float,
    *,
    shared_copy_engine: bool,
) -> HardwareProfile:
    return HardwareProfile(
        name=name, description=description, gpu_mem_bytes=gpu_gb * GB,
        host_mem_bytes=host_gb * GB, gpu_reserve_bytes=4 * GIB, hbm_gb_per_s=hbm_gb_per_s,
        peak_tflops=tflops, mem_efficiency=0.8, compute_efficiency=0.55, step_overhead_s=1e-3,
        h2d_gb_per_s=link_gb_per_s, d2h_gb_per_s=link_gb_per_s, transfer_overhead_s=15e-6,
        pageable_bandwidth_fraction=0.5, pageable_jitter=0.3, nvme_read_gb_per_s=7.0,
        nvme_write_gb_per_s=5.0, nvme_latency_s=80e-6, shared_copy_engine=shared_copy_engine,
    )  # fmt: skip


PRESETS: dict[str, HardwareProfile] = {
    profile.name: profile
    for profile in (
        _preset("article-40gb", "the seed article's machine: A100-40GB-class GPU, 96 GB RAM, "
                "PCIe 4.0 x16, NVMe", 40, 96, 1555.0, 312.0, 25.0, shared_copy_engine=True),
        _preset("h100-pcie5", "H100 PCIe 80 GB, PCIe 5.0 x16, 256 GB RAM, NVMe",
                80, 256, 2000.0, 756.0, 50.0, shared_copy_engine=False),
        _preset("h200", "H200 141 GB, PCIe 5.0 x16, 512 GB RAM, NVMe", 141, 512, 4800.0, 989.0,
                50.0, shared_copy_engine=False),
    )
}  # fmt: skip
HARDWARE_NAMES: tuple[str, ...] = tuple(PRESETS)


def hardware_preset(name: str) -> HardwareProfile:
    """A preset by name; an unknown name lists the valid ones."""
    key = name.strip().lower()
    if key not in PRESETS:
        prefixed = [known for known in HARDWARE_NAMES if known.startswith(key)]
        hint = f" (did you mean {prefixed[0]!r}?)" if prefixed else suggest(key, HARDWARE_NAMES)
        raise KvSwapError(
            f"unknown hardware {name!r}{hint}; "
            f"valid hardware: {', '.join(HARDWARE_NAMES)} (or --bench FILE)"
        )
    return PRESETS[key]


def hardware_from_bench(path: str | Path, base: HardwareProfile) -> HardwareProfile:
    """`base` with the link replaced by what `kvswap bench --out FILE` measured."""
    return hardware_from_report(load_report(path), base, source=str(path))


def hardware_from_report(
    report: BenchReport, base: HardwareProfile, *, source: str = "benchmark report"
) -> HardwareProfile:
    """`base` with the measured link: bandwidth per direction (the largest pinned
    transfer), per-chunk overhead (gather rows: time beyond bytes / bandwidth)
    and pageable bandwidth. The copy engines come from the report, not from `base`:
    a GPU report gets one engine per direction (the bench measures each direction
    alone, so it cannot tell a shared engine apart); a report measured without a
    GPU describes host memory copies: then both directions share one memory bus
    and a LOW chunk yields to HIGH between blocks, as kvswap's CPU copy engine does."""
    h2d, d2h = link_gb_per_s(report, "h2d"), link_gb_per_s(report, "d2h")
    check_measured_link(h2d, d2h, source)
    overheads = [
        max(0.0, row.num_bytes / (row.gb_per_s_median * GB) - row.num_bytes / (d2h * GB))
        for row in report.results
        if row.op == "gather_chunk" and row.gb_per_s_median > 0
    ]
    pageable = [r for r in report.results if r.memory == "pageable" and r.gb_per_s_median > 0]
    fraction = base.pageable_bandwidth_fraction
    if pageable:
        largest = max(pageable, key=lambda r: r.num_bytes)
        fraction = min(1.0, largest.gb_per_s_median / max(h2d, d2h))
    on_cpu = report.device == "cpu"
    return dataclasses.replace(
        base,
        name=f"bench:{Path(source).name}",
        description=f"{base.name} with the link measured in {source} ({report.device_name})",
        h2d_gb_per_s=h2d,
        d2h_gb_per_s=d2h,
        transfer_overhead_s=statistics.median(overheads) if overheads else base.transfer_overhead_s,
        pageable_bandwidth_fraction=fraction,
        shared_copy_engine=on_cpu,
        low_yields_per_block=on_cpu or base.low_yields_per_block,
    )


def describe_hardware(profile: HardwareProfile) -> str:
    return (
        f"{profile.name}: {profile.description}; GPU {profile.gpu_mem_bytes / GB:.0f} GB, "
        f"HBM {profile.hbm_gb_per_s:g} GB/s, {profile.peak_tflops:g} TFLOPS, link "
        f"{profile.h2d_gb_per_s:g}/{profile.d2h_gb_per_s:g} GB/s (h2d/d2h), NVMe "
        f"{profile.nvme_read_gb_per_s:g}/{profile.nvme_write_gb_per_s:g} GB/s (read/write), "
        f"{copy_engines(profile)}"
    )


def describe_remote_link(profile: HardwareProfile) -> str:
    """The modelled link to a shared remote store, in words."""
    return (
        f"remote link {profile.remote_gb_per_s:g} GB/s per direction, "
        f"{profile.remote_rtt_ms:g} ms round trip (assumed)"
    )


def with_remote_link(
    profile: HardwareProfile, *, gb_per_s: float | None = None, rtt_ms: float | None = None
) -> HardwareProfile:
    """`profile` with the remote link replaced where a value is given; a bandwidth that
    is not a usable link rate (`check_link_gb_per_s`, as `kvswap plan` checks it) or a
    round trip that is not a finite number >= 0 is an error."""
    if gb_per_s is not None:
        check_link_gb_per_s(gb_per_s, "--remote-gb-per-s")
    if rtt_ms is not None and not (math.isfinite(rtt_ms) and rtt_ms >= 0):
        raise KvSwapError(f"--remote-rtt-ms {rtt_ms}: allowed: a finite number >= 0")
    return dataclasses.replace(
        profile,
        remote_gb_per_s=profile.remote_gb_per_s if gb_per_s is None else gb_per_s,
        remote_rtt_ms=profile.remote_rtt_ms if rtt_ms is None else rtt_ms,
    )


def copy_engines(profile: HardwareProfile) -> str:
    """How host<->device chunks queue, in words (for tables and notes)."""
    if profile.shared_copy_engine:
        return "one copy engine shared by both directions"
    return "one copy engine per direction"
