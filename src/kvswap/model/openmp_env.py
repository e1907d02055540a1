"""OpenMP's wait policy for the engine's CPU threads, chosen before torch loads.

Torch runs CPU ops on an OpenMP team. Between two parallel regions, GNU
OpenMP's idle threads spin by default. Once a machine has more runnable
threads than cores (copy workers next to the model, a server thread, other
processes), a spinning thread holds a core the working one needs, and each of
the hundreds of parallel regions of a step waits for a descheduled thread: on
a loaded 2-core machine a decode step of the `small` preset took 1.6 s with the
default policy and 0.13 s with PASSIVE, and the `kvswap run` demo 133 s
against 38 s. With PASSIVE an idle thread sleeps at once; the price is a
wake-up per parallel region, small next to a step.

The runtime reads its environment once, when it is loaded (`import torch`), so
`prefer_passive_openmp_wait` must run before anything imports torch: the
command line's entry point calls it first. Torch-free, so importing it loads
nothing. A user's own setting is kept.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

WAIT_POLICY = "PASSIVE"
#: Variables through which a user already chose how OpenMP threads wait.
USER_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def prefer_passive_openmp_wait(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE unless the user chose a policy or torch is already
    loaded (then it would not apply to this process, only leak into its children).

    Returns whether it was set. `environ` defaults to `os.environ`."""
    env = os.environ if environ is None else environ
    if "torch" in sys.modules or any(name in env for name in USER_SETTINGS):
        return False
    env["OMP_WAIT_POLICY"] = WAIT_POLICY
    return True
