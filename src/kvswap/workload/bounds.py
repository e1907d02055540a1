"""The upper bounds of a workload, in one place, checked before any request is built.

A workload is billed up front from its description (a `SyntheticSpec`, or the
rows of a trace and its scales), before a single token id exists:

    requests            <= MAX_REQUESTS          (10**6; the Mooncake trace has ~24k)
    tokens per request  <= MAX_REQUEST_TOKENS    (2**24 = 16.7M, prompt + output)
    arrival span        <= MAX_DURATION_S        (30 days, after time scaling)
    held tokens         <= MAX_WORKLOAD_TOKENS   (2**32, every resolved prompt + output)
    estimated memory    <= WORKLOAD_MEMORY_SHARE x available host memory

"Held tokens" count what a run keeps: each request's resolved prompt (a later
turn repeats the whole conversation before it) plus its output. The memory
estimate is what Python holds for them: a tuple slot per held token and an int
object per token made fresh. Without these checks a 2-line trace at
`--length-scale 1e6` or `--num-sessions 100000000` fills the host's memory
until the kernel kills the process, and a trace timestamp of 1e308 ms makes
the engine wait forever for the next arrival.

The trace reader has its own bounds, checked line by line while reading:
MAX_TRACE_LINE_BYTES per line (kept in `kvswap.readers` with every file's cap), hash
ids in 0..MAX_HASH_ID, at most MAX_HASH_IDS_PER_REQUEST per line and MAX_TRACE_HASH_IDS
in the file.

Torch-free and standard library only (the simulator imports it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvswap.errors import ConfigError, KvSwapError
from kvswap.host_memory import available_host_bytes
from kvswap.readers import MAX_TRACE_LINE_BYTES as MAX_TRACE_LINE_BYTES  # the cap table

MAX_REQUESTS = 10**6
MAX_REQUEST_TOKENS = 2**24
MAX_DURATION_S = 30 * 24 * 3600.0
MAX_WORKLOAD_TOKENS = 2**32
WORKLOAD_MEMORY_SHARE = 0.5
"""The share of available host memory a workload's token ids may take; the rest is
left for the pools, the model and everything else on the machine."""

TOKEN_SLOT_BYTES = 8
"""One pointer in a tuple or list of token ids."""
NEW_TOKEN_BYTES = 32
"""One int object for a token id made fresh (ids past 256 are not shared by CPython)."""

MAX_HASH_ID = 2**63 - 1
MAX_TRACE_HASH_IDS = 2**25
"""Hash ids a whole trace may hold while it is read (~50x the Mooncake trace)."""
MAX_HASH_IDS_PER_REQUEST = MAX_REQUEST_TOKENS // 512
"""A Mooncake hash id names 512 tokens, so more ids than this describe a longer request."""
MAX_TIMESTAMP_MS = MAX_DURATION_S * 1000.0


@dataclass(frozen=True, slots=True)
class WorkloadBill:
    """What a workload will cost, computed from its description before it is built."""

    num_requests: int
    longest_request_tokens: int
    """The largest resolved prompt + max_new_tokens of any request."""
    held_tokens: int
    """Token ids the run holds: every request's resolved prompt plus its output."""
    new_tokens: int
    """Token ids made fresh (the rest repeat earlier ones and share their objects)."""
    duration_s: float
    """The span of the arrivals, first to last (expected, for random arrivals)."""

    @property
    def memory_bytes(self) -> int:
        return self.held_tokens * TOKEN_SLOT_BYTES + self.new_tokens * NEW_TOKEN_BYTES


def check_bill(bill: WorkloadBill, what: str, *, available_memory_bytes: int | None = None) -> None:
    """Raise a one-line KvSwapError naming the first bound `bill` breaks.

    `available_memory_bytes` defaults to the host's (`host_memory_bytes`);
    when that cannot be read, the memory check is left out.
    """
    if bill.num_requests > MAX_REQUESTS:
        raise KvSwapError(
            f"{what}: {bill.num_requests} requests; allowed: at most {MAX_REQUESTS} (MAX_REQUESTS)"
        )
    if bill.longest_request_tokens > MAX_REQUEST_TOKENS:
        raise KvSwapError(
            f"{what}: a request of {bill.longest_request_tokens} tokens (prompt + output); "
            f"allowed: at most {MAX_REQUEST_TOKENS} tokens per request (MAX_REQUEST_TOKENS)"
        )
    if not bill.duration_s <= MAX_DURATION_S:
        raise KvSwapError(
            f"{what}: arrivals span {bill.duration_s:.6g} s; allowed: at most "
            f"{MAX_DURATION_S:.0f} s = 30 days (MAX_DURATION_S)"
        )
    if bill.held_tokens > MAX_WORKLOAD_TOKENS:
        raise KvSwapError(
            f"{what}: {bill.held_tokens} tokens held (prompts + outputs); allowed: at most "
            f"{MAX_WORKLOAD_TOKENS} (MAX_WORKLOAD_TOKENS)"
        )
    available = host_memory_bytes() if available_memory_bytes is None else available_memory_bytes
    if available is None:
        return
    allowed_bytes = int(available * WORKLOAD_MEMORY_SHARE)
    if bill.memory_bytes > allowed_bytes:
        raise KvSwapError(
            f"{what}: its {bill.held_tokens} token ids need about {bill.memory_bytes} bytes of "
            f"host memory; allowed: at most {allowed_bytes} ({WORKLOAD_MEMORY_SHARE:.0%} of the "
            f"{available} bytes available); use fewer or shorter requests"
        )


def host_memory_bytes() -> int | None:
    """What this process may still allocate (`kvswap.host_memory`: MemAvailable,
    RLIMIT_AS and the cgroup limit, whichever binds), in bytes."""
    return available_host_bytes()


def check_time_scale(value: object, name: str = "time_scale") -> float:
    """A trace's time scale: a finite number > 0 (0.1 = ten times faster replay)."""
    return _positive_finite(name, value, "a finite number > 0")


def check_length_scale(value: object, name: str = "length_scale") -> float:
    """A trace's length scale: finite, > 0 and at most MAX_REQUEST_TOKENS (beyond it
    even a 1-token prompt breaks the per-request bound)."""
    scale = _positive_finite(name, value, f"a finite number in (0, {MAX_REQUEST_TOKENS}]")
    if scale > MAX_REQUEST_TOKENS:
        raise ConfigError(
            f"{name} = {value!r}: allowed: a finite number in (0, {MAX_REQUEST_TOKENS}] "
            "(MAX_REQUEST_TOKENS per request)"
        )
    return scale


def check_scales(time_scale: object, length_scale: object) -> None:
    """Both scales, for a command that takes them whether or not a trace is given."""
    check_time_scale(time_scale)
    check_length_scale(length_scale)


def check_count(name: str, value: int, maximum: int, limit_name: str) -> None:
    """A count field of a workload description against its bound, naming both."""
    if value > maximum:
        raise ConfigError(f"{name} = {value}: allowed: at most {maximum} ({limit_name})")


def _positive_finite(name: str, value: object, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name} = {value!r}: allowed: {allowed}")
    try:
        number = float(value)
    except OverflowError:  # an int past the float range
        raise ConfigError(f"{name} = {value!r:.40}: allowed: {allowed}") from None
    if not math.isfinite(number) or number <= 0:
        raise ConfigError(f"{name} = {value!r}: allowed: {allowed}")
    return number
