"""The CPU runtime's settings chosen before torch loads: OpenMP's wait policy, oneDNN's caches.

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

`cap_onednn_caches`, called at the same point for the same reason, bounds the
caches of compiled oneDNN primitives. The fast mode's packed CPU linears
compile one primitive (0.6-2 MiB) per distinct row count, and a server's steps
see almost every token count: with the libraries' default of 1,024 entries per
cache (oneDNN's, and torch's ideep one beside it), `kvswap serve` grew
492 -> 999 MiB over 20 bursts of 64 streaming requests and had not levelled
off (`benchmarks/serve_soak.py`). At ONEDNN_CACHE_ENTRIES each, the same
soak stays flat; a step whose row count fell out of the cache compiles it
again (a decode batch's few row counts stay cached).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping

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


#: Entries each of oneDNN's and ideep's primitive caches keeps (the default is 1,024).
ONEDNN_CACHE_ENTRIES = 128
#: oneDNN's primitive cache, and torch's ideep LRU cache of the same primitives.
ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def cap_onednn_caches(environ: MutableMapping[str, str] | None = None) -> bool:
    """Cap both primitive caches at ONEDNN_CACHE_ENTRIES unless torch is already loaded
    (they read the variables once) or the user set either. Returns whether it set them."""
    env = os.environ if environ is None else environ
    if "torch" in sys.modules or any(name in env for name in ONEDNN_CACHE_VARIABLES):
        return False
    for name in ONEDNN_CACHE_VARIABLES:
        env[name] = str(ONEDNN_CACHE_ENTRIES)
    return True


def model_threads(cpu_threads: int | None, environ: Mapping[str, str] | None = None) -> int | None:
    """The thread count to give torch for the model on a CPU device: `cpu_threads` when
    the caller chose one; else None (keep torch's) when the user set OMP_NUM_THREADS,
    which torch read when it loaded; else every core."""
    if cpu_threads is not None:
        return cpu_threads
    env = os.environ if environ is None else environ
    if env.get("OMP_NUM_THREADS", "").strip():
        return None
    return os.cpu_count() or 1
