"""Files left by killed processes, and things only named like them (issue 30, items 5, 6,
8 and a LOW one).

    item 5   a FIFO, a symlink or a directory named like a stale slab is skipped at
             once (a FIFO used to block every start forever, in open())
    item 6   the vLLM host pool file of a start killed before its scheduler came is
             removed at the next start, whatever its engine_id; a live one is kept
    item 8   a second vLLM's worker meeting the first's file (one engine_id for two)
             is refused in one line; the same engine's two parties still meet
    LOW      a slab the sweep keeps is reported once per start, not twice
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvswap.config_load import load_config
from kvswap.data.pinned import PinnedBuffer
from kvswap.data.shared_file import SharedFile
from kvswap.engine.engine import Engine
from kvswap.engine.settings import EngineOptions, engine_settings
from kvswap.errors import KvSwapError
from kvswap.integrations.vllm.host_file import (
    SCHEDULER,
    WORKER,
    host_file_path,
    refusing_a_shared_engine_id,
    sweep_host_files,
)
from tests.unit.test_signals_cleanup import TINY_SETTINGS, dead_pid

POOL_BYTES = 8192
DEADLINE_S = 60.0  # a bound on waiting for a child, not a performance figure
# A slab's start, in a child with a deadline: a FIFO used to block it for good.
SLAB_START = """
import sys
from kvswap.data.disk_pool import DiskPool
DiskPool(sys.argv[1], 4096, 2).close()
"""
# A child that makes a host file as a party, then is killed before any partner comes.
KILLED_CREATOR = """
import os, signal, sys
from pathlib import Path
from kvswap.data.pinned import PinnedBuffer
from kvswap.data.shared_file import SharedFile
PinnedBuffer(int(sys.argv[3]), shared=SharedFile(Path(sys.argv[1]), sys.argv[2]))
os.kill(os.getpid(), signal.SIGKILL)
"""
# A child that is a live worker: makes the file, fills it with 3s, waits for a line,
# then prints the sum of what its pool holds.
LIVE_WORKER = """
import sys
from pathlib import Path
from kvswap.data.pinned import PinnedBuffer
from kvswap.data.shared_file import SharedFile
buffer = PinnedBuffer(int(sys.argv[2]), shared=SharedFile(Path(sys.argv[1]), "worker"))
buffer.tensor[:] = 3
print("ready", flush=True)
sys.stdin.readline()
print(int(buffer.tensor.sum()), flush=True)
buffer.close()
"""


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A private directory, not under pytest's basetemp (which a concurrent pytest
    session of the same user prunes)."""
    with tempfile.TemporaryDirectory(prefix="kvswap-stale-") as name:
        yield Path(name)


def run_child(code: str, *args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True, text=True, timeout=DEADLINE_S, check=False,
    )  # fmt: skip


def kill_after_creating(path: Path, party: str) -> None:
    done = run_child(KILLED_CREATOR, path, party, POOL_BYTES)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert path.exists()  # what a SIGKILL between the two parties leaves in /dev/shm


# --- item 5: only regular files are judged -----------------------------------------


def test_a_fifo_symlink_or_directory_named_like_a_stale_slab_is_skipped_at_once(
    scratch: Path,
) -> None:
    pid = dead_pid()
    fifo = scratch / f"kvswap-{pid}-abcdef.kvslab"
    os.mkfifo(fifo)
    target = scratch / "someone-else-s-file"
    target.write_bytes(b"x")
    link = scratch / f"kvswap-{pid}-abcdf0.kvslab"
    link.symlink_to(target)
    link_to_fifo = scratch / f"kvswap-{pid}-abcdf1.kvslab"
    link_to_fifo.symlink_to(fifo)
    directory = scratch / f"kvswap-{pid}-abcdf2.kvslab"
    directory.mkdir()
    stale = scratch / f"kvswap-{pid}-abcdf3.kvslab"
    stale.write_bytes(b"x")
    done = run_child(SLAB_START, scratch)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        f"kvswap: removed the stale NVMe slab {stale} left by process {pid}, which no longer runs"
    ]
    assert sorted(path.name for path in scratch.iterdir()) == sorted(
        path.name for path in (fifo, target, link, link_to_fifo, directory)
    )
    assert target.read_bytes() == b"x"


# --- item 6: a killed start's host file ---------------------------------------------


def test_a_killed_start_s_host_file_is_removed_at_the_next_start_and_a_live_one_kept(
    scratch: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stale = host_file_path("6f1c-dead", scratch)  # vLLM's engine_id: a random uuid
    kill_after_creating(stale, WORKER)
    live = host_file_path("6f1c-live", scratch)
    with (
        caplog.at_level(logging.WARNING, logger="kvswap.vllm"),
        PinnedBuffer(POOL_BYTES, shared=SharedFile(live, WORKER)),
    ):
        sweep_host_files(scratch)  # what each party does before it maps its own
        assert not stale.exists()
        assert live.exists()
    assert not live.exists()
    assert [record.getMessage() for record in caplog.records] == [
        f"kvswap: removed the stale vLLM host pool {stale} (engine_id '6f1c-dead') left by "
        "a process that no longer runs"
    ]


def test_a_live_worker_s_file_in_another_process_is_kept_and_joined(scratch: Path) -> None:
    path = host_file_path("one-engine", scratch)
    worker = subprocess.Popen(
        [sys.executable, "-c", LIVE_WORKER, str(path), str(POOL_BYTES)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert worker.stdout is not None and worker.stdin is not None
        assert worker.stdout.readline() == "ready\n"
        sweep_host_files(scratch)
        with PinnedBuffer(POOL_BYTES, shared=SharedFile(path, SCHEDULER)) as scheduler:
            assert not scheduler.created_file and not path.exists()
            assert int(scheduler.tensor.sum()) == 3 * POOL_BYTES  # the worker's pages
            scheduler.tensor[:] = 4
            worker.stdin.write("go\n")
            worker.stdin.flush()
            assert worker.stdout.readline() == f"{4 * POOL_BYTES}\n"
        assert worker.wait(timeout=DEADLINE_S) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_the_same_engine_s_file_left_by_a_killed_start_is_made_anew_not_joined(
    scratch: Path,
) -> None:
    path = host_file_path("fixed-engine-id", scratch)  # an explicit engine_id, restarted
    kill_after_creating(path, WORKER)
    with PinnedBuffer(POOL_BYTES, shared=SharedFile(path, WORKER)) as worker:
        assert worker.created_file  # the dead start's file is not this start's pool
        with PinnedBuffer(POOL_BYTES, shared=SharedFile(path, SCHEDULER)) as scheduler:
            assert not scheduler.created_file
            worker.tensor[:] = 5
            assert int(scheduler.tensor.sum()) == 5 * POOL_BYTES
    assert list(scratch.iterdir()) == []


# --- item 8: one engine_id, two vLLMs ------------------------------------------------


def test_a_second_vllm_with_the_same_engine_id_is_refused_in_one_line(scratch: Path) -> None:
    path = host_file_path("shared-id", scratch)
    # vLLM A's worker has made the file; A's scheduler has not come yet.
    with PinnedBuffer(POOL_BYTES, shared=SharedFile(path, WORKER)):
        with (
            pytest.raises(KvSwapError) as info,
            refusing_a_shared_engine_id("shared-id"),  # as the spec maps it
        ):
            PinnedBuffer(POOL_BYTES, shared=SharedFile(path, WORKER))  # vLLM B's worker
        message = str(info.value)
        assert "\n" not in message
        assert message.startswith("kv_transfer_config engine_id 'shared-id' is in use by another")
        assert f"its worker, process {os.getpid()}, made {path}" in message
        assert "give each vLLM its own engine_id, or leave it unset" in message
        # A's file is untouched: A's scheduler still finds it and joins A's worker.
        with PinnedBuffer(POOL_BYTES, shared=SharedFile(path, SCHEDULER)) as a_scheduler:
            assert not a_scheduler.created_file
    assert list(scratch.iterdir()) == []


# --- LOW: reported once -------------------------------------------------------------


def test_a_slab_the_sweep_keeps_is_reported_once_per_start(
    scratch: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    persisted = scratch / f"kvswap-{dead_pid()}-0123456789ac.persist.kvslab"
    persisted.write_bytes(b"x")
    config = load_config(None, overrides={"nvme_dir": str(scratch)}, defaults=TINY_SETTINGS)
    Engine(engine_settings(config, EngineOptions(model="tiny", cpu_threads=1))).close()
    err = capsys.readouterr().err
    assert err.count("kept the NVMe slab") == 1, err
    assert sorted(scratch.iterdir()) == [persisted]
