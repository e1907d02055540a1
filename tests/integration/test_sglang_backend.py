"""kvswap's HiCache storage backend under SGLang 0.5.23's own classes.

SGLang cannot share this venv (its wheel pins a CUDA torch), so `.ci/sglang-venv.sh`
builds `.venv-sglang` over this venv's packages and `sglang_checks.py` runs there,
once, against a redis-server this test starts: the backend built by SGLang's
`StorageBackendFactory` ("dynamic"), a real `MHATokenToKVPoolHost` on CPU tensors,
the zero-copy and the legacy calls, the present prefix, a corrupted value, a value
under another key, and a store killed mid-run. Each check is one test here.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.redis_server import RedisServer

REPO = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"
CHECKS = (
    "host_pool_round_trip",
    "present_prefix",
    "the_served_name_is_no_part_of_a_page_s_key",
    "legacy_calls",
    "corrupted_value_is_a_miss",
    "value_under_the_wrong_key_is_a_miss",
    "other_layouts_and_models_are_refused_in_one_line",
    "killed_store_is_misses",
)
pytestmark = pytest.mark.skipif(
    not SGLANG_PYTHON.exists(),
    reason="no .venv-sglang: build the engines' venvs with bash .ci/engine-venvs",
)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    with RedisServer(tmp_path_factory.mktemp("redis")).start() as server:
        env = dict(os.environ, PYTHONPATH=str(REPO / "src"), HF_HUB_OFFLINE="1")
        done = subprocess.run(
            [str(SGLANG_PYTHON), str(Path(__file__).with_name("sglang_checks.py")),
             server.url, str(server.pid)],
            capture_output=True, text=True, env=env, timeout=600, check=False, cwd=REPO,
        )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    results = {entry["check"]: entry for entry in map(json.loads, lines)}
    if done.returncode != 0 or not results:
        pytest.fail(f"sglang_checks.py exited {done.returncode}:\n{done.stderr[-4000:]}")
    return results


@pytest.mark.parametrize("name", CHECKS)
def test_sglang_check(outcomes: dict[str, dict[str, object]], name: str) -> None:
    outcome = outcomes.get(name)
    assert outcome is not None, f"{name} did not run"
    assert outcome["ok"], outcome["detail"]
