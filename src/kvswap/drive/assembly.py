"""Build a control plane (store, policies, swapper, scheduler, metrics) from settings.

The engine and the simulator both call `build_control_plane`; they differ
only in the copy engine and the clock they hand it, and, with a remote tier,
in the `RemoteIndex` (the engine's over a Redis client, the simulator's over
its modelled shared store).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvswap.base.remote_index import RemoteIndex
from kvswap.base.transfer import CopyEngine
from kvswap.control.metrics import KVMetrics
from kvswap.control.mover import SubmitHook
from kvswap.control.scheduler import Scheduler
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
    remote_index: RemoteIndex | None = None,
    on_submit: SubmitHook | None = None,
) -> ControlPlane:
    """The control plane; with `remote_index` (and the copy engine executing remote
    chunks) it reads from and writes to the shared store as `settings.remote` says.
    Without one there is no remote tier, whatever the settings (the store was not
    configured, or could not be reached and is not required). `on_submit` sees each
    chunk and its blocks as it is submitted (the simulator's swap-in counts)."""
    swapper = Swapper(
        settings.layout, settings.policy, settings.swap, copy_engine, clock_s,
        remote_index=remote_index, remote=settings.remote, on_submit=on_submit,
    )  # fmt: skip
    return ControlPlane(settings, swapper, Scheduler(swapper, settings.scheduler))
