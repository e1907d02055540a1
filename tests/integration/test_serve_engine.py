"""The engine thread behind `kvswap serve`: live requests, streaming, stop, cancel, close.

Driven directly (no HTTP) on the tiny model in exact mode, so every output can
be compared with the reference generator token for token.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import pytest
import torch

from kvswap.base.tier import Tier
from kvswap.config_load import load_config
from kvswap.control.scheduler_records import StepPlan
from kvswap.drive.backend import StepOutput
from kvswap.engine import runner as runner_module
from kvswap.engine.engine import Engine
from kvswap.engine.settings import EngineOptions, engine_settings
from kvswap.model.generate import generate_reference
from kvswap.sampling import SamplingParams
from kvswap.serve.engine_service import EngineThreadService
from kvswap.serve.service import (
    Finished,
    FinishReason,
    GenerationRequest,
    InvalidRequest,
    PromptTooLong,
    QueueFull,
    RequestHandle,
    ServiceStopping,
    TokenEvent,
)

SETTINGS: dict[str, object] = {
    "kv_block_tokens": 8,
    "protected_sink_blocks": 1,
    "gpu_kv_capacity_blocks": 24,
    "cpu_kv_capacity_blocks": 64,
    "max_num_seqs": 4,
    "device": "cpu",
    "batch_invariant": True,
}


def make_service(**settings: object) -> EngineThreadService:
    config = load_config(environ={}, overrides={**SETTINGS, **settings})
    engine = Engine(engine_settings(config, EngineOptions(model="tiny")))
    return EngineThreadService(engine, model_id="tiny", max_waiting_requests=2)


@pytest.fixture
def service() -> Iterator[EngineThreadService]:
    svc = make_service()
    yield svc
    svc.close(timeout_s=5)


async def collect(handle: RequestHandle) -> tuple[list[int], Finished]:
    tokens: list[int] = []
    async for event in handle.events():
        if isinstance(event, TokenEvent):
            tokens.append(event.token_id)
        else:
            return tokens, event
    raise AssertionError("the stream ended without Finished")


def prompt(seed: int, length: int) -> tuple[int, ...]:
    return tuple((seed * 31 + 7 * i) % 250 + 1 for i in range(length))


def test_concurrent_requests_stream_exactly_the_reference_tokens(
    service: EngineThreadService,
) -> None:
    prompts = [prompt(seed, 20 + 6 * seed) for seed in range(5)]

    async def main() -> list[tuple[list[int], Finished]]:
        handles = [service.submit(GenerationRequest(p, max_new_tokens=10)) for p in prompts]
        return await asyncio.gather(*(collect(h) for h in handles))

    results = asyncio.run(main())
    model = service.engine.model
    for p, (tokens, finished) in zip(prompts, results, strict=True):
        expected = generate_reference(model, p, 10, block_tokens=8).token_ids
        assert tokens == list(expected)
        assert finished.reason is FinishReason.LENGTH
        assert (finished.prompt_tokens, finished.completion_tokens) == (len(p), 10)


def test_a_repeated_prompt_reports_its_cached_tokens(service: EngineThreadService) -> None:
    shared = prompt(3, 33)

    async def twice() -> tuple[Finished, Finished]:
        first = await collect(service.submit(GenerationRequest(shared, max_new_tokens=4)))
        second = await collect(service.submit(GenerationRequest(shared, max_new_tokens=4)))
        assert first[0] == second[0]
        return first[1], second[1]

    first, second = asyncio.run(twice())
    assert first.cached_tokens == 0
    assert second.cached_tokens == 32  # four full 8-token blocks; the last token is computed


def test_a_stop_token_ends_the_request_as_stop(service: EngineThreadService) -> None:
    p = prompt(1, 24)
    expected = generate_reference(service.engine.model, p, 10, block_tokens=8).token_ids
    stop = frozenset({expected[3]})

    async def main() -> tuple[list[int], Finished]:
        request = GenerationRequest(p, max_new_tokens=10, stop_token_ids=stop)
        return await collect(service.submit(request))

    tokens, finished = asyncio.run(main())
    first_stop = next(i for i, t in enumerate(expected) if t in stop)
    assert tokens == list(expected[: first_stop + 1])
    assert finished.reason is FinishReason.STOP


def test_cancel_mid_stream_frees_the_blocks_on_every_tier(service: EngineThreadService) -> None:
    async def cancel_after_two() -> Finished:
        handle = service.submit(GenerationRequest(prompt(5, 40), max_new_tokens=100))
        seen = 0
        async for event in handle.events():
            if isinstance(event, TokenEvent):
                seen += 1
                if seen == 2:
                    service.cancel(handle)
            else:
                return event
        raise AssertionError("no Finished")

    finished = asyncio.run(cancel_after_two())
    assert finished.reason is FinishReason.ABORT
    assert 2 <= finished.completion_tokens < 100
    service.close(timeout_s=5)  # the loop drains: the store is quiet
    store = service.engine.swapper.store
    assert all(store.tiers[t].num_used_slots == 0 for t in (Tier.GPU, Tier.CPU))


def test_stop_early_keeps_the_prefix_for_the_next_request(service: EngineThreadService) -> None:
    p = prompt(7, 40)

    async def main() -> Finished:
        handle = service.submit(GenerationRequest(p, max_new_tokens=60))
        async for event in handle.events():
            if isinstance(event, TokenEvent):
                service.stop_early(handle)
            else:
                assert event.reason is FinishReason.STOP
                break
        return (await collect(service.submit(GenerationRequest(p, max_new_tokens=2))))[1]

    assert asyncio.run(main()).cached_tokens == 32


def test_limits_are_refused_with_their_reason(service: EngineThreadService) -> None:
    assert service.max_model_tokens == (24 - 1) * 8  # what the GPU tier holds beside sinks
    with pytest.raises(PromptTooLong, match="at most 184"):
        service.submit(GenerationRequest(prompt(1, 300), max_new_tokens=10))
    with pytest.raises(PromptTooLong, match="must fit the GPU tier"):
        service.submit(GenerationRequest(prompt(1, 150), max_new_tokens=100))
    with pytest.raises(InvalidRequest, match=r"must be in \[0, 256\)"):
        service.submit(GenerationRequest((1, 2, 999), max_new_tokens=1))

    async def flood() -> None:
        handles = []
        with pytest.raises(QueueFull, match="retry later") as caught:
            for _ in range(20):
                handles.append(service.submit(GenerationRequest(prompt(2, 16), 50)))
        assert caught.value.retry_after_s is not None
        assert len(handles) == 4 + 2  # max_num_seqs + max_waiting_requests
        for handle in handles:
            service.cancel(handle)
        await asyncio.gather(*(collect(h) for h in handles))

    asyncio.run(flood())
    service.close(timeout_s=5)

    async def late() -> None:
        service.submit(GenerationRequest(prompt(1, 8), 2))

    with pytest.raises(ServiceStopping):
        asyncio.run(late())
    assert not service.healthy()


def test_close_aborts_what_outlives_the_deadline() -> None:
    svc = make_service()

    async def main() -> Finished:
        handle = svc.submit(GenerationRequest(prompt(4, 16), max_new_tokens=100_000 // 1000))
        await asyncio.sleep(0)
        await asyncio.get_running_loop().run_in_executor(None, svc.close, 0.0)
        return (await collect(handle))[1]

    finished = asyncio.run(main())
    assert finished.reason in (FinishReason.ABORT, FinishReason.LENGTH)
    assert svc.engine.host_pool is None  # released


@pytest.mark.parametrize(
    ("temperature", "top_p", "seed", "needle"),
    [
        (1e-9, 1.0, 1, "temperature = 1e-09"),
        (1.0, 1.0, 2**63, "seed = 9223372036854775808"),
        (1.0, 1.0, -1, "seed = -1"),
        (None, 1.0, 2**64 - 1, "seed"),
        (1.0, 0.0, 1, "top_p = 0.0"),
    ],
)
def test_sampling_outside_the_rule_is_refused_at_submit_and_the_engine_goes_on(
    service: EngineThreadService, temperature: float | None, top_p: float, seed: int, needle: str
) -> None:
    bad = GenerationRequest(prompt(1, 8), 2, temperature=temperature, top_p=top_p, seed=seed)

    async def main() -> Finished:
        with pytest.raises(InvalidRequest, match=re.escape(needle)):
            service.submit(bad)
        good = GenerationRequest(prompt(1, 8), 2, temperature=1.0, top_p=1e-50, seed=7)
        return (await collect(service.submit(good)))[1]

    assert asyncio.run(main()).reason is FinishReason.LENGTH
    assert service.healthy()


def test_a_sampling_failure_aborts_only_that_request(
    service: EngineThreadService,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    real = runner_module.sample_token

    def failing(logits: torch.Tensor, sampling: SamplingParams | None, generator: object) -> int:
        if sampling is not None and sampling.temperature == 1.5:
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return real(logits, sampling, generator)  # type: ignore[arg-type]

    monkeypatch.setattr(runner_module, "sample_token", failing)

    async def main() -> list[tuple[list[int], Finished]]:
        doomed = service.submit(GenerationRequest(prompt(2, 12), 8, temperature=1.5, seed=1))
        others = [service.submit(GenerationRequest(prompt(s, 12), 8)) for s in (3, 4)]
        return await asyncio.gather(*(collect(h) for h in (doomed, *others)))

    (lost, aborted), *rest = asyncio.run(main())
    assert aborted.reason is FinishReason.ABORT and lost == []
    assert aborted.error is not None and aborted.error.startswith("sampling failed: probability")
    assert [f.reason for _, f in rest] == [FinishReason.LENGTH, FinishReason.LENGTH]
    assert all(len(tokens) == 8 for tokens, _ in rest)
    assert service.healthy() and service.num_open_requests == 0
    # One warning in the server's log (`kvswap.serve`), naming the request and why.
    assert any(
        r.levelname == "WARNING" and "aborted: sampling failed" in r.getMessage()
        for r in caplog.records
    )
    assert not service.engine.swapper.holds_kv(0)  # the doomed request (id 0) holds no KV


def test_a_cache_salt_no_key_can_take_refuses_that_request_and_the_engine_lives_on(
    service: EngineThreadService,
) -> None:
    """Issue 30, HIGH 1: a 257-character salt reached the engine thread, which raised in
    the key namespace and stopped: /health 503, every request lost. Whatever fails while
    admitting one request refuses it alone (the HTTP edge refuses it first too)."""

    async def main() -> tuple[Finished, Finished]:
        bad = service.submit(GenerationRequest(prompt(1, 8), 2, cache_salt="s" * 257))
        good = service.submit(GenerationRequest(prompt(1, 8), 2, cache_salt="tenant"))
        return (await collect(bad))[1], (await collect(good))[1]

    refused, served = asyncio.run(main())
    assert refused.reason is FinishReason.ABORT
    assert refused.error is not None and "cache_salt" in refused.error
    assert "256 characters" in refused.error
    assert served.reason is FinishReason.LENGTH
    assert service.healthy() and service.num_open_requests == 0


def test_a_step_that_fails_for_one_request_aborts_it_alone_and_the_server_serves_on(
    service: EngineThreadService,
) -> None:
    """The failure rule inside the server: a step the model cannot compute for one
    request is run again a request at a time; that request ends with the error, the
    others stream their reference tokens, /health stays up, later requests are served."""
    execute = service.engine.execute

    def failing(plan: StepPlan) -> StepOutput:
        if any(item.seq_id == 0 for item in plan.seqs):  # the first request submitted
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return execute(plan)

    service.engine.execute = failing  # type: ignore[method-assign]

    async def main() -> list[tuple[list[int], Finished]]:
        doomed = service.submit(GenerationRequest(prompt(9, 12), 6))
        others = [service.submit(GenerationRequest(prompt(s, 12), 6)) for s in (3, 4)]
        return await asyncio.gather(*(collect(h) for h in (doomed, *others)))

    (lost, aborted), *rest = asyncio.run(main())
    assert aborted.reason is FinishReason.ABORT and lost == []
    assert aborted.error == "RuntimeError: CUDA error: an illegal memory access was encountered"
    for (tokens, finished), seed in zip(rest, (3, 4), strict=True):
        assert finished.reason is FinishReason.LENGTH
        expected = generate_reference(service.engine.model, prompt(seed, 12), 6, block_tokens=8)
        assert tokens == list(expected.token_ids)
    assert service.healthy() and service.num_open_requests == 0

    async def later() -> Finished:
        return (await collect(service.submit(GenerationRequest(prompt(5, 12), 2))))[1]

    assert asyncio.run(later()).reason is FinishReason.LENGTH
