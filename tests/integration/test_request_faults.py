"""The failure rule of the driver loop: whatever fails while admitting or serving one
request ends that request alone; every other request's output is unchanged.

A failure is injected at each step of admission and of a step, for one request of a
workload that swaps (a GPU pool four times too small), in the exact mode, so the other
requests' tokens must equal a run without the fault, token for token."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvswap.config_load import load_config
from kvswap.control.scheduler import Scheduler
from kvswap.control.swapper import Swapper
from kvswap.engine.engine import Engine
from kvswap.engine.settings import EngineOptions, engine_settings
from kvswap.errors import KvSwapError
from kvswap.workload.synthetic import generate_synthetic
from tests.integration.test_engine_outputs import BASE, SPEC

SETTINGS = {**BASE, "gpu_kv_capacity_blocks": 10, "cpu_kv_capacity_blocks": 64}


class Injected(RuntimeError):
    """The failure a test plants."""


def outputs(engine: Engine) -> dict[int, tuple[int, ...]]:
    return {i: tuple(run.output_ids) for i, run in engine.scheduler.runs.items()}


def serve(plant: Callable[[Engine], None] | None = None) -> tuple[dict[str, Any], Engine]:
    config = load_config(environ={}, overrides=SETTINGS)
    with Engine(engine_settings(config, EngineOptions(model="tiny"))) as engine:
        if plant is not None:
            plant(engine)
        summary = engine.run(generate_synthetic(SPEC)).to_json()
    return summary, engine


@pytest.fixture(scope="module")
def reference() -> tuple[dict[str, Any], dict[int, tuple[int, ...]]]:
    summary, engine = serve()
    assert summary["preemptions"] > 0 and summary["requests_completed"] == 8
    return summary, outputs(engine)


Plant = Callable[[Engine, int], None]


def failing_for(method: Callable[..., Any], victim: int, seq_of: Callable[..., Any]) -> Any:
    """`method`, raising `Injected` when the call concerns `victim` (`seq_of(args)`)."""

    def planted(*args: Any, **kwargs: Any) -> Any:
        if victim in seq_of(*args, **kwargs):
            raise Injected(f"{method.__name__} failed for the test")
        return method(*args, **kwargs)

    return planted


def first_arg(seq_id: int, *_: object, **__: object) -> tuple[int]:
    return (seq_id,)


def in_list(seq_ids: Any, *_: object, **__: object) -> list[int]:
    return list(seq_ids)


def swapper_method(name: str, seq_of: Callable[..., Any]) -> Plant:
    def plant(engine: Engine, victim: int) -> None:
        swapper: Swapper = engine.swapper
        setattr(swapper, name, failing_for(getattr(swapper, name), victim, seq_of))

    return plant


def backend_step(engine: Engine, victim: int) -> None:
    """The model's step fails whenever `victim` is in it (the step is the backend's)."""
    execute = engine.execute
    engine.execute = failing_for(  # type: ignore[method-assign]
        execute, victim, lambda plan: [item.seq_id for item in plan.seqs]
    )


def admission(engine: Engine, victim: int) -> None:
    """`Scheduler.admission` fails while `victim` is being added."""
    scheduler: Scheduler = engine.scheduler
    add_request, admit = scheduler.add_request, scheduler.admission
    adding: list[int] = []

    def planted_add(seq_id: int, *args: Any, **kwargs: Any) -> Any:
        adding[:] = [seq_id]
        return add_request(seq_id, *args, **kwargs)

    scheduler.add_request = planted_add  # type: ignore[method-assign]
    scheduler.admission = failing_for(  # type: ignore[method-assign]
        admit, victim, lambda *_: adding
    )


# Where the failure strikes, and whose request: 5 is a second turn (it finds its first
# turn's KV; no turn follows it); 3 is a first turn preempted five times.
INJECTIONS: dict[str, tuple[Plant, int]] = {
    "admission": (admission, 5),
    "open the sequence": (swapper_method("open_sequence", first_arg), 5),
    "mark it running": (swapper_method("set_running", first_arg), 5),
    "prefetch its blocks": (swapper_method("prefetch", in_list), 5),
    "allocate its blocks": (swapper_method("allocate", first_arg), 5),
    "swap it out (preempted)": (swapper_method("swap_out_sequence", first_arg), 3),
    "offload it (finished)": (swapper_method("finish", first_arg), 5),
    "compute its step": (backend_step, 5),
}


@pytest.mark.parametrize("where", list(INJECTIONS))
def test_a_failure_at_any_step_ends_that_request_alone(
    where: str, reference: tuple[dict[str, Any], dict[int, tuple[int, ...]]]
) -> None:
    expected_summary, expected = reference
    plant, victim = INJECTIONS[where]
    summary, engine = serve(lambda engine: plant(engine, victim))
    run = engine.scheduler.runs[victim]
    assert run.finish_reason is not None and run.finish_reason.value == "abort", where
    reason = run.abort_reason or (run.refusal.message if run.refusal else "")
    assert "for the test" in reason and "\n" not in reason, reason
    got = outputs(engine)
    # The turn that follows the victim's carries its (partial) output in its prompt.
    follow_ups = {r.request_id for r in generate_synthetic(SPEC).follow_ups_of(victim)}
    for seq_id, tokens in expected.items():
        if seq_id != victim and seq_id not in follow_ups:
            assert got[seq_id] == tokens, (where, seq_id)
    assert summary["requests_completed"] == expected_summary["requests_completed"] - 1
    engine.swapper.check_integrity()


def test_a_failure_that_breaks_the_control_plane_stops_the_run() -> None:
    """Containment holds only while the invariants do: a request whose failure left the
    store inconsistent ends the run with one line, instead of serving on."""

    def corrupt(engine: Engine) -> None:
        swapper = engine.swapper
        open_sequence = swapper.open_sequence

        def planted(seq_id: int, *args: Any, **kwargs: Any) -> int:
            hit_tokens = open_sequence(seq_id, *args, **kwargs)
            if seq_id == 5:
                for block in swapper.store.sequence_blocks(seq_id):
                    block.ref_count += 1  # a reference nobody holds
                raise Injected("and the store is broken")
            return hit_tokens

        swapper.open_sequence = planted  # type: ignore[method-assign]

    with pytest.raises(KvSwapError, match="cannot go on after request 5 failed") as stopped:
        serve(corrupt)
    assert "\n" not in str(stopped.value)
