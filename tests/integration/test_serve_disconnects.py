"""Streams whose clients leave, over HTTP, on the real engine (tiny, CPU): each request
ends as `abort`, the engine's open-request count returns to 0, and nothing of the
requests stays behind (the scheduler's runs, the live handles, their sampling)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import pytest

from kvswap.config_load import load_config
from kvswap.engine.engine import Engine
from kvswap.engine.settings import EngineOptions, engine_settings
from kvswap.serve.app import build_app
from kvswap.serve.engine_service import EngineThreadService
from kvswap.serve.tokenizer import builtin_codec
from tests.unit.serve_fakes import DEADLINE_S, RunningServer

SETTINGS: dict[str, object] = {
    "kv_block_tokens": 8,
    "protected_sink_blocks": 1,
    "gpu_kv_capacity_blocks": 64,
    "cpu_kv_capacity_blocks": 64,
    "max_num_seqs": 4,
    "device": "cpu",
}


@pytest.fixture
def service() -> Iterator[EngineThreadService]:
    config = load_config(environ={}, overrides=SETTINGS)
    svc = EngineThreadService(
        Engine(engine_settings(config, EngineOptions(model="tiny"))), model_id="tiny"
    )
    yield svc
    svc.close(timeout_s=5)


def ended_by_reason(http: httpx.Client) -> dict[str, float]:
    text = http.get("/metrics").text
    pattern = r'^kvswap_requests_total\{finished_reason="(\w+)"\} (\S+)$'
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text, re.MULTILINE)}


def test_streams_whose_clients_leave_end_as_abort_and_leave_nothing_behind(
    service: EngineThreadService,
) -> None:
    num_streams = 6  # more than max_num_seqs: some leave while still waiting
    body = {"prompt": [5, 17, 99, 3, 42, 8, 77], "max_tokens": 400, "stream": True}
    with (
        RunningServer(build_app(service, builtin_codec(256)), service) as server,
        httpx.Client(base_url=server.url, timeout=DEADLINE_S) as http,
    ):
        for _ in range(num_streams):
            # Leaving the block with the stream unread closes its connection.
            with http.stream("POST", "/v1/completions", json=body) as response:
                assert next(response.iter_lines()).startswith("data: ")
        deadline = time.monotonic() + DEADLINE_S
        while service.num_open_requests and time.monotonic() < deadline:
            time.sleep(0.01)
        ended = ended_by_reason(http)
        assert service.num_open_requests == 0
        assert ended == {"abort": num_streams}
        whole = http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 3})
        assert whole.status_code == 200, whole.text
    assert service.arrivals.handles == {}
    assert service.engine.scheduler.runs == {}  # each run held its request's sampling
