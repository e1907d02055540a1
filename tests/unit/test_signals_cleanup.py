"""Nothing left behind: stop signals, stale slabs, failed start-ups (issue 13, items 1, 2, 9).

The signal tests start `python -m kvswap run` on the tiny model with an NVMe tier
in a tmp dir, wait until it is serving, signal it, and check the exit code, the
one stop line, no traceback and an empty directory."""

from __future__ import annotations

import fcntl
import os
import resource
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kvswap.__main__ as kvswap_main
from kvswap.cli import main
from kvswap.config_load import load_config
from kvswap.data import pinned
from kvswap.data.disk_pool import DiskPool
from kvswap.engine.engine import Engine
from kvswap.engine.settings import EngineOptions, engine_settings
from kvswap.host_memory import available_host_bytes
from kvswap.signals import (
    Terminated,
    run_stoppable,
    signals_deferred,
    stop_message,
    stop_signals_raise,
)

BLOCK_BYTES = 4096
DEADLINE_S = 60.0  # a bound on waiting for a child, not a performance figure
# Tiny model, 8-token blocks (4 KiB each), every tier; 40 sessions at 2 per second
# keep the run going for ~20 s, long after the signal.
RUN_ARGS: tuple[str, ...] = (
    "run", "--model", "tiny", "--device", "cpu", "--block-tokens", "8",
    "--num-sessions", "40", "--arrival-rate", "2", "--prompt-tokens", "16",
    "--output-tokens", "24", "--system-prompt-tokens", "8", "--user-tokens", "8",
    "--gpu-kv-capacity-blocks", "12", "--cpu-kv-capacity-blocks", "8",
    "--nvme-kv-capacity-blocks", "16",
)  # fmt: skip
TINY_SETTINGS: dict[str, object] = {
    "kv_block_tokens": 8,
    "protected_sink_blocks": 1,
    "device": "cpu",
    "gpu_kv_capacity_blocks": 12,
    "cpu_kv_capacity_blocks": 8,
    "nvme_kv_capacity_blocks": 16,
}


def kvswap_process(*argv: str, **kwargs: Any) -> subprocess.Popen[str]:
    # Unbuffered: a line the test waits for must reach the pipe when it is printed.
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "kvswap", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        **kwargs,
    )


def wait_for_stdout_line(process: subprocess.Popen[str], needle: str) -> None:
    """Read the child's stdout until it holds `needle` (bounded by DEADLINE_S).

    Reads the raw descriptor: a select() on the pipe followed by the text wrapper's
    readline() would leave lines in the wrapper's buffer while select() waits for
    more bytes, and the needle would only be seen when the child exits."""
    assert process.stdout is not None
    fd = process.stdout.fileno()
    seen = b""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        data = os.read(fd, 65536)
        if not data:
            break
        seen += data
        if needle.encode() in seen:
            return
    process.kill()
    raise AssertionError(f"the child never printed {needle!r}: {seen!r} {process.communicate()}")


def handlers_installed(pid: int) -> bool:
    """True once the child catches SIGTERM (kvswap.signals installed its handlers)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(status.split("SigCgt:")[1].split()[0], 16)
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def finish(process: subprocess.Popen[str]) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
    return process.returncode, out, err


@pytest.fixture
def slab_dir() -> Iterator[Path]:
    """A private directory, not under pytest's basetemp: a concurrent pytest session
    of the same user prunes old basetemp directories, slab and all, mid-test."""
    with tempfile.TemporaryDirectory(prefix="kvswap-signals-") as name:
        yield Path(name)  # removed afterwards, with anything left in it


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


# --- item 1: SIGTERM, SIGHUP, SIGQUIT handled like SIGINT ---------------------


@pytest.mark.parametrize(
    ("signum", "stop_line"),
    [
        (signal.SIGTERM, "kvswap: stopped by SIGTERM"),
        (signal.SIGHUP, "kvswap: stopped by SIGHUP"),
        (signal.SIGQUIT, "kvswap: stopped by SIGQUIT"),
        (signal.SIGINT, "kvswap: interrupted"),
    ],
)
def test_a_stop_signal_mid_run_removes_the_slab_and_exits_128_plus_n(
    signum: signal.Signals, stop_line: str, slab_dir: Path
) -> None:
    process = kvswap_process(*RUN_ARGS, "--nvme-dir", str(slab_dir))
    wait_for_stdout_line(process, "workload")  # printed once every pool is allocated
    assert len(list(slab_dir.iterdir())) == 1
    process.send_signal(signum)
    code, _, err = finish(process)
    assert code == 128 + signum
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(stop_line) and "removed the NVMe slab" in last, err
    assert list(slab_dir.iterdir()) == []


def test_sigterm_during_imports_exits_143_without_a_traceback(slab_dir: Path) -> None:
    process = kvswap_process(*RUN_ARGS, "--nvme-dir", str(slab_dir))
    deadline = time.monotonic() + DEADLINE_S
    while not handlers_installed(process.pid) and time.monotonic() < deadline:
        time.sleep(0.005)
    process.send_signal(signal.SIGTERM)  # torch is still being imported, or just done
    code, _, err = finish(process)
    assert code == 143
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("kvswap: stopped by SIGTERM")
    assert list(slab_dir.iterdir()) == []


def test_ctrl_c_during_imports_is_one_line_and_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    class InterruptImports:
        def find_spec(self, name: str, *args: object) -> None:
            if name == "kvswap.cli":
                raise KeyboardInterrupt

    monkeypatch.delitem(sys.modules, "kvswap.cli")
    monkeypatch.setattr(sys, "meta_path", [InterruptImports(), *sys.meta_path])
    assert kvswap_main.entry() == 130
    assert capsys.readouterr().err == "kvswap: interrupted\n"


def test_a_second_signal_while_stopping_does_not_interrupt_the_clean_up() -> None:
    cleaned = False
    with pytest.raises(Terminated) as info, stop_signals_raise():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(DEADLINE_S)  # the handler raises here
        finally:
            os.kill(os.getpid(), signal.SIGHUP)  # ignored: already stopping
            cleaned = True
    assert cleaned and info.value.exit_code == 143
    assert stop_message(info.value) == "kvswap: stopped by SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_stop_signal_is_held_until_a_deferred_block_ends() -> None:
    steps: list[str] = []
    with pytest.raises(Terminated) as info, stop_signals_raise():
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            steps.append("signalled")  # the held signal did not raise here
            os.kill(os.getpid(), signal.SIGHUP)  # a second one: only the first is raised
            steps.append("finished")
        steps.append("after the block")  # never reached: raised as the block ends
    assert steps == ["signalled", "finished"]
    assert info.value.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_script_run_stoppable_unwinds_on_sigterm_and_exits_143(
    capsys: pytest.CaptureFixture[str],
) -> None:
    released: list[str] = []

    def script() -> int:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(DEADLINE_S)  # the handler raises here
        finally:
            released.append("server stopped")
        return 0

    assert run_stoppable(script) == 143
    assert released == ["server stopped"]
    assert capsys.readouterr().err.strip() == "kvswap: stopped by SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert run_stoppable(lambda: None) == 0 and run_stoppable(lambda: 3) == 3


def test_a_deferred_block_without_a_signal_changes_nothing() -> None:
    with stop_signals_raise():
        handler = signal.getsignal(signal.SIGTERM)
        with signals_deferred():
            assert signal.getsignal(signal.SIGTERM) is not handler
        assert signal.getsignal(signal.SIGTERM) is handler


# --- item 1: stale slabs at start-up ------------------------------------------


def test_a_dead_process_slab_is_removed_at_start_up_and_a_live_one_is_not(
    slab_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pid = dead_pid()
    stale = slab_dir / f"kvswap-{pid}-0123456789ab.kvslab"
    persisted = slab_dir / f"kvswap-{pid}-0123456789ac.persist.kvslab"
    live = slab_dir / f"kvswap-{os.getpid()}-0123456789ad.kvslab"
    unrelated = slab_dir / f"notes-{pid}.kvslab.txt"
    for path in (stale, persisted, live, unrelated):
        path.write_bytes(b"x" * 16)
    with DiskPool(slab_dir, BLOCK_BYTES, num_slots=2) as pool:
        assert not stale.exists()
        assert persisted.exists() and live.exists() and unrelated.exists()
        err = capsys.readouterr().err.splitlines()
    assert not pool.path.exists()
    assert len(err) == 2
    assert "removed the stale NVMe slab" in err[0] and str(pid) in err[0]
    assert "kept the NVMe slab" in err[1] and "nvme_persist" in err[1]
    for path in (persisted, live, unrelated):
        path.unlink()


def test_a_locked_slab_is_never_touched_even_if_its_pid_looks_dead(slab_dir: Path) -> None:
    # Another pid namespace (a container sharing the directory): its pid means
    # nothing here, but the kernel still shows its lock.
    other = slab_dir / f"kvswap-{dead_pid()}-0123456789ab.kvslab"
    other.write_bytes(b"x")
    fd = os.open(other, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with DiskPool(slab_dir, BLOCK_BYTES, num_slots=2):
            assert other.exists()
    finally:
        os.close(fd)
    other.unlink()


def test_persisted_slabs_are_named_apart(slab_dir: Path) -> None:
    with DiskPool(slab_dir, BLOCK_BYTES, num_slots=2, persist=True) as pool:
        assert pool.path.name.endswith(".persist.kvslab")
    pool.path.unlink()


# --- item 2: a failed start-up releases every pool ----------------------------


def test_an_impossible_gpu_tier_leaves_the_nvme_dir_empty(
    slab_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*RUN_ARGS, "--nvme-dir", str(slab_dir), "--quiet"]
    argv[argv.index("--gpu-kv-capacity-blocks") + 1] = "99999999999"
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert list(slab_dir.iterdir()) == []


def test_ctrl_c_while_the_pinned_pool_fills_removes_the_slab(
    slab_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    touched: list[int] = []

    def interrupted_touch(piece: Any) -> None:
        touched.append(piece.numel())
        if len(touched) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(pinned, "FILL_CHUNK_BYTES", BLOCK_BYTES)
    monkeypatch.setattr(pinned, "_touch_pages", interrupted_touch)
    config = load_config(None, overrides={"nvme_dir": str(slab_dir)}, defaults=TINY_SETTINGS)
    with pytest.raises(KeyboardInterrupt) as info:
        Engine(engine_settings(config, EngineOptions(model="tiny", cpu_threads=1)))
    assert len(touched) == 2  # stopped at the next piece, not after all 8
    assert list(slab_dir.iterdir()) == []
    assert "removed the NVMe slab" in stop_message(info.value)


def test_a_failure_after_the_slab_was_made_releases_it(
    slab_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvswap.engine import engine as engine_module

    def broken_device_pool(*args: object, **kwargs: object) -> None:
        raise RuntimeError("device pool allocation failed")

    monkeypatch.setattr(engine_module, "DevicePool", broken_device_pool)
    config = load_config(None, overrides={"nvme_dir": str(slab_dir)}, defaults=TINY_SETTINGS)
    with pytest.raises(RuntimeError, match="device pool"):
        Engine(engine_settings(config, EngineOptions(model="tiny", cpu_threads=1)))
    assert list(slab_dir.iterdir()) == []


def test_an_address_space_limit_is_a_one_line_error_naming_rlimit_as(slab_dir: Path) -> None:
    limit_bytes = 4 << 30  # room for the interpreter and torch, not for the pool
    pool_bytes = 6 << 30
    if available_host_bytes() < pool_bytes + (1 << 30):
        pytest.skip("this machine has too little free memory for RLIMIT_AS to bind")

    def limit_address_space() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, resource.RLIM_INFINITY))

    argv = [*RUN_ARGS, "--nvme-dir", str(slab_dir), "--quiet"]
    index = argv.index("--cpu-kv-capacity-blocks")
    argv[index : index + 2] = ["--cpu-kv-capacity-bytes", str(pool_bytes)]
    process = kvswap_process(*argv, preexec_fn=limit_address_space)
    code, _, err = finish(process)
    assert code == 2
    assert err.count("\n") == 1 and "RLIMIT_AS" in err, err
    assert list(slab_dir.iterdir()) == []
