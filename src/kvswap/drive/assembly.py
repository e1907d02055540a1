"""Build a control plane (store, policies, swapper, scheduler, metrics) from settings.

The engine and the simulator both call `build_control_plane`; they differ
only in the copy engine and the clock they hand it, and, with keyed tiers, in
their `RemoteIndex`es (the engine's over each `SecondaryTier`, the simulator's
over its modelled shared store).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvswap.base.remote_index import RemoteIndex
from kvswap.base.transfer import CopyEngine
from kvswap.base.write_policy import RemoteWritePolicy
from kvswap.control.metrics import KVMetrics
from kvswap.control.mover import SubmitHook
from kvswap.control.remote_tier import KeyedTier
from kvswap.control.scheduler import Scheduler
from kvswap.control.settings import RemoteSettings
from kvswap.control.swapper import Swapper
from kvswap.drive.settings import ControlSettings


@dataclass(frozen=True)
class ControlPlane:
    settings: ControlSettings
    swapper: Swapper
    scheduler: Scheduler

    @property
    def metrics(self) -> KVMetrics:
        return self.swapper.metrics


def build_control_plane(
    settings: ControlSettings,
    copy_engine: CopyEngine,
    clock_s: Callable[[], float],
    keyed: Sequence[KeyedTier] = (),
    on_submit: SubmitHook | None = None,
) -> ControlPlane:
    """The control plane; with `keyed` tiers (and the copy engine executing their
    chunks) it reads from and writes to each as its settings say (`keyed_tiers`
    builds them). Without any there is no keyed tier, whatever the settings (no store
    was configured, or it could not be reached and is not required). `on_submit` sees
    each chunk and its blocks as it is submitted (the simulator's swap-in counts)."""
    swapper = Swapper(
        settings.layout, settings.policy, settings.swap, copy_engine, clock_s,
        keyed=keyed, on_submit=on_submit,
    )  # fmt: skip
    return ControlPlane(settings, swapper, Scheduler(swapper, settings.scheduler))


def keyed_tiers(
    settings: ControlSettings,
    indexes: Sequence[RemoteIndex],
    write_policies: Sequence[str | None] = (),
) -> tuple[KeyedTier, ...]:
    """The keyed tiers over `indexes` (fastest first), each used as `settings.remote`
    says but written by its own entry of `write_policies` where one is given (a
    `SecondaryTier.write_policy`; None or missing: the configured one)."""
    remote = settings.remote if settings.remote is not None else RemoteSettings("unnamed")
    tiers: list[KeyedTier] = []
    for position, index in enumerate(indexes):
        policy = write_policies[position] if position < len(write_policies) else None
        tier_settings = remote
        if policy is not None:
            tier_settings = replace(remote, write_policy=RemoteWritePolicy(policy))
        tiers.append(KeyedTier(index, tier_settings))
    return tuple(tiers)
