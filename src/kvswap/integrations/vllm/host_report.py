"""What kvswap says inside vLLM: a start-up line, a stats line, and counters on /metrics.

The lines go to the logger `vllm.kvswap`, a child of vLLM's own: they appear in
vLLM's log with its format and level (`VLLM_LOGGING_LEVEL`), beside vLLM's lines.

    start-up   kvswap 0.1.0 inside vLLM: host tier 512 chunks x 64 KiB = 32.0 MiB (policy
               kvswap, sinks 8 chunks, residency 64 steps); NVMe /mnt/nvme 1.0 GiB ...
    stats      every `stats_interval_s()` while something changed: host-tier hits, loads,
               stores, refused stores, evictions, and each secondary tier's counts
    /metrics   the same counts as vLLM counters (`vllm:kvswap_host_*_total`), through
               vLLM's own path: the spec declares them (`metric_definitions`), the
               manager's `get_stats` hands the increments over (`HostReport.take`)

kvswap's connector (connector.py) writes its own stats line beside these
(`SyncLoadCounts`): loads within their step and between steps, and the chunks it
promoted within their step. Both lines keep one cadence (`StatsCadence`).

And one warning, once: a request offered more chunks than the host tier holds (it
keeps the request's first chunks, so the tiers below still get them; a larger
`cpu_bytes_to_use` keeps all of them). vLLM-free: the counters are written into the
stats object vLLM hands over.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from kvswap.units import format_bytes

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

#: Under vLLM's logger: its handler, format and level.
LOGGER = logging.getLogger("vllm.kvswap")
#: vLLM's own stats interval, and its environment variable (vllm/envs.py).
STATS_INTERVAL_S = 10.0
STATS_INTERVAL_ENV = "VLLM_LOG_STATS_INTERVAL"


def stats_interval_s() -> float:
    """How often the stats line may be written: as often as vLLM writes its own."""
    try:
        return float(os.environ.get(STATS_INTERVAL_ENV, STATS_INTERVAL_S))
    except ValueError:  # vLLM refuses such a value itself at start
        return STATS_INTERVAL_S


class StatsCadence:
    """When a stats line is due: at most once every `interval_s`, and only when its
    counts changed since the last line (the host tier's line and the connector's)."""

    def __init__(
        self,
        counts: DataclassInstance,
        *,
        clock: Callable[[], float] = time.monotonic,
        interval_s: float | None = None,
    ) -> None:
        """`counts`: the dataclass the line shows, as of now (nothing to say yet)."""
        self._clock = clock
        self._interval_s = stats_interval_s() if interval_s is None else interval_s
        self._last_line_s = clock()
        self._logged = dataclasses.replace(counts)

    def changed(self, counts: DataclassInstance) -> bool:
        """Whether `counts` moved since the last line."""
        return counts != self._logged

    def due(self, counts: DataclassInstance) -> bool:
        """Whether a line showing `counts` is due now; if so, it counts as written."""
        now_s = self._clock()
        if now_s - self._last_line_s < self._interval_s or not self.changed(counts):
            return False
        self._last_line_s = now_s
        self._logged = dataclasses.replace(counts)
        return True


@dataclass
class HostCounts:
    """The host tier's counts since start, in chunks (vLLM's offloaded unit)."""

    lookups: int = 0  # chunks looked up (a prefix lookup asks chunk by chunk)
    hits: int = 0  # of those, found ready in the host tier
    loads: int = 0  # chunks loaded from the host tier to the device
    stores: int = 0  # chunks the host tier took (from the device or a tier below)
    refused: int = 0  # chunks offered but not taken: no room, or the policy failed
    evictions: int = 0  # chunks dropped to make room
    policy_failures: int = 0  # calls the ranking policy raised in (it is then replaced)


@dataclass
class SyncLoadCounts:
    """kvswap's connector's loads since start: within the step that scheduled them, or
    between steps (vLLM 0.32's way), and the chunks it promoted from a secondary tier
    within a step. Its stats line is written by the connector and
    read back from vLLM's log by benchmarks and tests (`last_in`)."""

    within_step: int = 0
    within_step_tokens: int = 0
    between_steps: int = 0
    #: Chunks promoted from a secondary tier (NVMe, the store) within a step (read
    #: whole: a value the tier refused is not counted).
    promoted_chunks: int = 0
    #: What the steps waited for those promotions, in all (ms).
    promotion_wait_ms: float = 0.0

    def line(self) -> str:
        return (
            f"kvswap connector: {self.within_step} loads within their step "
            f"({self.within_step_tokens} tokens), {self.between_steps} between steps, "
            f"{self.promoted_chunks} chunks promoted within their step "
            f"({self.promotion_wait_ms:.0f} ms waited)"
        )

    @classmethod
    def last_in(cls, log_text: str) -> SyncLoadCounts | None:
        """The counts of the last such line in `log_text` (None: there is none)."""
        found = _SYNC_LOADS_LINE.findall(log_text)
        return None if not found else cls(*(int(value) for value in found[-1]))


_SYNC_LOADS_LINE = re.compile(
    r"kvswap connector: (\d+) loads within their step \((\d+) tokens\), (\d+) between steps, "
    r"(\d+) chunks promoted within their step \((\d+) ms waited\)"
)
#: Each count as a vLLM counter: name and documentation.
METRICS: dict[str, tuple[str, str]] = {
    "lookups": ("vllm:kvswap_host_lookups", "Chunks looked up in kvswap's host tier."),
    "hits": ("vllm:kvswap_host_hits", "Chunks found ready in kvswap's host tier."),
    "loads": ("vllm:kvswap_host_loads", "Chunks loaded from kvswap's host tier to the device."),
    "stores": ("vllm:kvswap_host_stores", "Chunks kvswap's host tier took."),
    "refused": (
        "vllm:kvswap_host_refused_stores",
        "Chunks offered to kvswap's host tier and not taken (no room, or a failed policy).",
    ),
    "evictions": ("vllm:kvswap_host_evictions", "Chunks kvswap's host tier dropped for room."),
    "policy_failures": (
        "vllm:kvswap_host_policy_failures",
        "Calls kvswap's host-tier policy raised in; the policy is then replaced by LRU.",
    ),
}
assert set(METRICS) == {field.name for field in dataclasses.fields(HostCounts)}


def metric_definitions(counter_metadata: Callable[..., Any]) -> dict[str, Any]:
    """vLLM's metric definitions of the counts (`OffloadingCounterMetadata`, passed in)."""
    return {name: counter_metadata(documentation=doc) for name, doc in METRICS.values()}


def kvswap_version() -> str:
    try:
        return version("kvswap")
    except PackageNotFoundError:  # run from a source tree
        return "(source tree)"


class HostReport:
    """The host tier's counts, its start-up line and its periodic stats line."""

    def __init__(
        self,
        num_chunks: int,
        chunk_bytes: int,
        *,
        tiers: Callable[[], Sequence[tuple[str, Mapping[str, int]]]] = lambda: (),
        clock: Callable[[], float] = time.monotonic,
        interval_s: float | None = None,
    ) -> None:
        """`tiers`: each secondary tier's name and counts, asked when a line is written."""
        self.num_chunks = num_chunks
        self.chunk_bytes = chunk_bytes
        self.counts = HostCounts()
        self._tiers = tiers
        self._cadence = StatsCadence(self.counts, clock=clock, interval_s=interval_s)
        self._taken = HostCounts()  # as of the last `take`
        self._warned_small = False

    # --- the lines ----------------------------------------------------------------------

    def start_line(self, ranking: str, below: Sequence[str]) -> str:
        """The start-up line: version, host tier size, its ranking, the tiers below."""
        size = format_bytes(self.num_chunks * self.chunk_bytes)
        parts = [
            f"kvswap {kvswap_version()} inside vLLM: host tier {self.num_chunks} chunks x "
            f"{format_bytes(self.chunk_bytes)} = {size} ({ranking})",
            *below,
        ]
        return "; ".join(parts)

    def log_start(self, ranking: str, below: Sequence[str]) -> None:
        LOGGER.info(self.start_line(ranking, below))

    def tick(self) -> None:
        """A scheduler step ended: write the stats line if it is due and anything moved."""
        if self._cadence.due(self.counts):
            LOGGER.info(self.stats_line())

    def stats_line(self) -> str:
        c = self.counts
        hit_rate = f" ({c.hits / c.lookups:.0%})" if c.lookups else ""
        line = (
            f"kvswap host tier: {c.hits} of {c.lookups} chunks looked up hit{hit_rate}, "
            f"{c.loads} loaded, {c.stores} stored, {c.refused} refused, {c.evictions} evicted"
        )
        if c.policy_failures:
            line += f", policy failed {c.policy_failures} times"
        for name, counts in self._tiers():
            shown = ", ".join(f"{k} {v}" for k, v in counts.items() if v)
            line += f"; {name}: {shown or 'idle'}"
        return line

    def warn_small(self, num_offered: int) -> None:
        """Once: a request offered more chunks than the whole host tier."""
        if self._warned_small:
            return
        self._warned_small = True
        LOGGER.warning(
            "kvswap: a request offered %d chunks to a host tier of %d chunks (%s); it keeps "
            "the request's first %d, and the tiers below get only those. Raise "
            "cpu_bytes_to_use to at least %d to keep whole requests.",
            num_offered, self.num_chunks, format_bytes(self.num_chunks * self.chunk_bytes),
            self.num_chunks, num_offered * self.chunk_bytes,
        )  # fmt: skip

    # --- /metrics -----------------------------------------------------------------------

    def take(self, increase_counter: Callable[[str, int], None]) -> None:
        """Hand vLLM the increments since the last call (`increase_counter(name, n)`)."""
        for field in dataclasses.fields(HostCounts):
            delta = getattr(self.counts, field.name) - getattr(self._taken, field.name)
            if delta:
                increase_counter(METRICS[field.name][0], delta)
        self._taken = dataclasses.replace(self.counts)
