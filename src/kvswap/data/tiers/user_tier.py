"""A tier of one's own, held to the interface's one rule about failures.

`SecondaryTier` reports a tier's failures as results (a key left out of
`successful_keys`), never as exceptions. kvswap's tiers keep that rule; a user's
may not. `UserTier` wraps a tier built by a user's factory (`secondary_tiers`): an
exception out of any of its calls becomes one `StopRun` line naming the entry,
the call and the cause, and kvswap stops there, as for a bad setting (no request
is blamed for it: `kvswap.control.request_fault`). It does not
carry on without the tier: a tier that raised in the middle of a job may still be
writing into the pinned pool's slots, and those slots would be handed to other
blocks. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from kvswap.base.write_policy import WRITE_POLICIES
from kvswap.data.tiers.base import JobResult, SecondaryTier, TransferJob
from kvswap.errors import KvSwapError, StopRun
from kvswap.import_path import one_line

_T = TypeVar("_T")


class UserTier(SecondaryTier):
    """`tier` (a user's) behind the interface, its exceptions one line naming `name`."""

    def __init__(self, tier: SecondaryTier, name: str) -> None:
        super().__init__(tier.host_slots)
        self.tier = tier
        self.name = name

    def lookup(self, keys: Sequence[bytes]) -> int:
        return self._call("lookup", lambda: self.tier.lookup(keys))

    @property
    def available(self) -> bool:
        return self._call("available", lambda: self.tier.available)

    def submit_store(self, job: TransferJob) -> None:
        self._call("submit_store", lambda: self.tier.submit_store(job))

    def submit_load(self, job: TransferJob) -> None:
        self._call("submit_load", lambda: self.tier.submit_load(job))

    def get_finished_jobs(self) -> list[JobResult]:
        return self._call("get_finished_jobs", self.tier.get_finished_jobs)

    def wait(self, job_id: int) -> JobResult:
        return self._call("wait", lambda: self.tier.wait(job_id))

    def drain(self) -> None:
        self._call("drain", self.tier.drain)

    def close(self) -> None:
        self._call("close", self.tier.close)

    @property
    def holds_keys(self) -> bool:
        return self._call("holds_keys", lambda: self.tier.holds_keys)

    def hold(self, keys: Sequence[bytes]) -> None:
        self._call("hold", lambda: self.tier.hold(keys))

    def release(self, keys: Sequence[bytes]) -> None:
        self._call("release", lambda: self.tier.release(keys))

    @property
    def local(self) -> bool:
        return bool(self._call("local", lambda: self.tier.local))

    def evicted_keys(self) -> Sequence[bytes]:
        return self._call("evicted_keys", self.tier.evicted_keys)

    @property
    def capacity_blocks(self) -> int | None:
        capacity = self._call("capacity_blocks", lambda: self.tier.capacity_blocks)
        if capacity is not None and (
            isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1
        ):
            raise KvSwapError(
                f"{self.name} ({type(self.tier).__name__}).capacity_blocks = {capacity!r}; "
                "allowed: None (not known) or an integer >= 1"
            )
        return capacity

    @property
    def write_policy(self) -> str | None:
        policy = self._call("write_policy", lambda: self.tier.write_policy)
        if policy is not None and policy not in WRITE_POLICIES:
            raise KvSwapError(
                f"{self.name} ({type(self.tier).__name__}).write_policy = {policy!r}; allowed: "
                f"None (as tiers.remote_write_policy says), {', '.join(WRITE_POLICIES)}"
            )
        return policy

    def counters(self) -> Mapping[str, int]:
        return self._call("counters", self.tier.counters)

    def _call(self, what: str, call: Callable[[], _T]) -> _T:
        try:
            return call()
        except Exception as error:  # a user's tier broke the interface: one line, stop
            raise StopRun(
                f"{self.name} ({type(self.tier).__name__}).{what} raised {one_line(error)}; "
                "a tier reports a failure as a failed key, never an exception "
                "(kvswap.data.tiers.base)"
            ) from None
