"""Build a control plane (store, policies, swapper, scheduler, metrics) from settings.

The engine and the simulator both call `build_control_plane`; they differ
only in the copy engine and the clock they hand it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvswap.control.metrics import KVMetrics
from kvswap.control.scheduler import Scheduler
from kvswap.control.swapper import Swapper
from kvswap.control.transfer import CopyEngine
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
    settings: ControlSettings, copy_engine: CopyEngine, clock_s: Callable[[], float]
) -> ControlPlane:
    swapper = Swapper(settings.layout, settings.policy, settings.swap, copy_engine, clock_s)
    return ControlPlane(settings, swapper, Scheduler(swapper, settings.scheduler))
