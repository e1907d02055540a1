"""The host pool's file, with secondary tiers: named by engine, swept, never shared twice.

    /dev/shm/kvswap-vllm-<engine_id>.host

vLLM runs its worker (which fills the host pool) and its scheduler (whose secondary
tiers read and write it) as two processes with one config, so the pool is one file
both map, named by the only name both know: vLLM's engine_id. The worker maps it as
the party "worker", the scheduler as "scheduler" (`kvswap.data.shared_file`): once
both have, the name is gone. A start killed between the two (SIGKILL, a crash) leaves
the file, the whole pool in RAM (/dev/shm is memory), under a random engine_id no
later start asks for; so each party, before it maps its own, removes the files of any
engine whose creator is gone (`kvswap.data.owned_files`).

Two vLLMs given the same engine_id would meet on one name: a party that finds the
file made by a live party of its own kind refuses to start, naming the engine_id.

vLLM-free.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvswap.data.owned_files import sweep_stale
from kvswap.data.shared_file import SharedFileTaken
from kvswap.errors import KvSwapError

LOGGER = logging.getLogger("kvswap.vllm")

#: Where the shared host pool lives while both sides map it (then its name goes).
SHARED_HOST_DIR = Path("/dev/shm")
#: Its name, for any engine.
HOST_FILE_NAME = re.compile(r"kvswap-vllm-(?P<engine_id>.+)\.host")
#: The two parties that map it.
WORKER = "worker"
SCHEDULER = "scheduler"


def host_file_path(engine_id: str, directory: Path = SHARED_HOST_DIR) -> Path:
    return directory / f"kvswap-vllm-{engine_id}.host"


def sweep_host_files(directory: Path = SHARED_HOST_DIR) -> None:
    """Remove the host pool files whose creator is gone (any engine), one log line each.
    Called by each party before it maps its own."""
    for stale in sweep_stale(directory, HOST_FILE_NAME):
        engine = f"engine_id {stale.name['engine_id']!r}"
        if stale.removed:
            LOGGER.warning(
                "kvswap: removed the stale vLLM host pool %s (%s) left by a process "
                "that no longer runs", stale.path, engine
            )  # fmt: skip
        else:
            LOGGER.warning(
                "kvswap: could not remove the stale vLLM host pool %s (%s): %s",
                stale.path, engine, stale.error,
            )  # fmt: skip


@contextmanager
def refusing_a_shared_engine_id(engine_id: str) -> Iterator[None]:
    """Turn a host file taken by another vLLM's party of the same kind into the one-line
    refusal that names the engine_id."""
    try:
        yield
    except SharedFileTaken as taken:
        raise KvSwapError(
            f"kv_transfer_config engine_id {engine_id!r} is in use by another vLLM on this "
            f"machine (its {taken.shared.party}, process {taken.owner_pid}, made "
            f"{taken.shared.path}); give each vLLM its own engine_id, or leave it unset "
            "(vLLM then draws a unique one)"
        ) from taken
