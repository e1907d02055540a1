"""Fuzz every subcommand's flags with hypothesis (readers: test_fuzz_readers.py).

Whatever a user types or points kvswap at, the command ends with exit code 0
or 2, says at most a few lines on stderr, never shows a traceback, and leaves
nothing in the NVMe directory. Values are drawn to hurt: wrong types, NaN and
infinities, huge numbers, deep nesting, undecodable bytes. Sizes that would be
valid are kept tiny (a real run of them must finish in well under a second),
so that only a missing up-front check can make an example slow; a call that
runs past `CALL_LIMIT_S` fails as a hang.

The CLI runs in-process (`kvswap.cli.main`) with stdout encoded strictly and
stderr with backslash escapes, as CPython sets up a real process's streams.
CI runs a few hundred examples in all, derandomised; `FUZZ_EXAMPLES=N` runs N
per test with fresh random draws. (Not `KVSWAP_*`: every command refuses an
unknown `KVSWAP_*` variable, so such a name would fail the rest of the suite.)
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from .fuzz_support import (
    HUGE_INTEGERS,
    MONITOR_FLAGS,
    OUTPUT_DIR,
    OUTPUT_FILE,
    PLAN_FLAGS,
    RUN_BASE,
    TIER_FLAGS,
    TINY_WORKLOAD,
    WORKLOAD_FLAGS,
    Flag,
    choice,
    flags,
    fuzz_settings,
    ints,
    run_checked,
    sandbox,
    value,
)


@pytest.fixture(autouse=True, scope="module")
def _no_kvswap_environment() -> Iterator[None]:
    # The environment is a config layer: a developer's KVSWAP_* must not change the draws.
    with pytest.MonkeyPatch.context() as patch:
        for name in [n for n in os.environ if n.startswith("KVSWAP_")]:
            patch.delenv(name)
        yield


@fuzz_settings(60)
@given(argv=flags(PLAN_FLAGS))
def test_fuzz_plan_flags(argv: list[str]) -> None:
    with sandbox() as box:
        run_checked(box, ["plan", *argv])


SIM_FLAGS: dict[str, Flag] = {
    **TIER_FLAGS,
    **WORKLOAD_FLAGS,
    **MONITOR_FLAGS,
    "--hardware": choice("article-40gb", "h100-pcie5", "h200", "abacus"),
    "--pageable": None,
    "--sim-seed": value(st.integers(0, 2**64)),
    # Not `tiny`: its GPU tier sized from a 40 GB card is millions of blocks, slow to set
    # up by design of the tier (see test_simulate_sizes_a_tiny_model_s_tier_in_bounded_time).
    "--preset": choice("article-8b", "qwen2.5-7b", "llama-9"),
    "--dtype": choice("fp16", "bf16", "fp8", "int4"),
    "--timeseries": OUTPUT_FILE,
    "--capacities-tokens": choice("1000,inf", "0", "a,b", "-5"),
    # Several engines and a shared remote store.
    "--engines": ints(1, 4),
    "--route": choice("round-robin", "hash"),
    "--shared-remote-gib": value(st.sampled_from(("0.001", "1", "64"))),
    "--compare-remote": None,
    "--remote-gb-per-s": value(st.sampled_from(("0.5", "2.5", "100"))),
    "--remote-rtt-ms": value(st.sampled_from(("0", "0.2", "5"))),
}


@fuzz_settings(40)
@given(argv=flags(SIM_FLAGS))
def test_fuzz_simulate_flags(argv: list[str]) -> None:
    with sandbox() as box:
        run_checked(box, ["simulate", *TINY_WORKLOAD, "--quiet", *argv])


TUNE_FLAGS: dict[str, Flag] = {
    key: SIM_FLAGS[key]
    for key in (
        "--hardware", "--pageable", "--preset", "--gpu-kv-capacity-blocks",
        "--cpu-kv-capacity-blocks", "--swap-out-chunk-blocks", "--prefetch-stream-count",
        "--protected-sink-blocks", "--block-tokens", "--num-sessions", "--prompt-tokens",
        "--output-tokens", "--seed",
    )
}  # fmt: skip
TUNE_FLAGS |= {"--out": OUTPUT_FILE, "--json": None}


@fuzz_settings(12)
@given(argv=flags(TUNE_FLAGS))
def test_fuzz_tune_flags(argv: list[str]) -> None:
    with sandbox() as box:
        run_checked(box, ["tune", *TINY_WORKLOAD, "--quiet", "--out", "@WORK@/t.toml", *argv])


RUN_FLAGS: dict[str, Flag] = {
    **TIER_FLAGS,
    **WORKLOAD_FLAGS,
    **MONITOR_FLAGS,
    "--model": choice("tiny", "/nonexistent-model", "@WORK@"),
    "--dtype": choice("fp32", "bf16", "fp16", "fp8"),
    "--temperature": choice("1", "0.5", "0"),
}
#: The engine with a small NVMe tier in the sandbox, so the slab's life is exercised.


@fuzz_settings(30)
@given(argv=flags(RUN_FLAGS))
def test_fuzz_run_flags(argv: list[str]) -> None:
    with sandbox() as box:
        run_checked(box, [*RUN_BASE, *argv])


GENERATE_FLAGS: dict[str, Flag] = {
    "--model": choice("tiny", "/nonexistent-model", "@WORK@"),
    "--prompt-ids": choice("1,2,3", "0", "255", "1,,2", " 7 ", "1, 2"),
    "--max-new-tokens": ints(1, 4),
    "--dtype": choice("fp32", "bf16", "fp16"),
    "--device": choice("cpu", "auto"),
    "--temperature": choice("1", "0.7", "0", "1e-300"),
    "--top-p": choice("1", "0.9", "0", "1.5"),
    "--seed": value(st.integers(0, 2**64)),
    "--json": None,
}


@fuzz_settings(30)
@given(argv=flags(GENERATE_FLAGS))
def test_fuzz_generate_flags(argv: list[str]) -> None:
    with sandbox() as box:
        run_checked(box, ["generate", "--model", "tiny", "--prompt-ids", "1,2", *argv])


BENCH_FLAGS: dict[str, Flag] = {
    "--block-bytes": choice("4KiB", "64KiB", "1MiB", "2MiB", "0", "1e300", "2 potatoes"),
    "--chunk-blocks": choice("1", "1,2", "4,8", "0", "a,b", "99999999", "-1"),
    "--repeats": value(st.integers(1, 2)),
    "--device": st.sampled_from(("cpu", "auto", "tpu")),
    "--out": OUTPUT_FILE,
    "--full": None,
}


def _tiny_bench(real: Callable[..., Any], **kwargs: Any) -> Any:
    # Tiny sizes only: every transfer and gather chunk is capped at the 1 MiB minimum.
    return real(**{**kwargs, "max_bytes": 2**20})


@fuzz_settings(10)
@given(argv=flags(BENCH_FLAGS))
def test_fuzz_bench_flags(argv: list[str]) -> None:
    from kvswap.bench.bandwidth import run_bandwidth_bench
    from kvswap.commands import bench as bench_command

    # --repeats draws stay tiny or invalid: a large valid count is slow by design.
    argv = [a if a not in HUGE_INTEGERS else "0" for a in argv]
    with pytest.MonkeyPatch.context() as patch, sandbox() as box:
        tiny = functools.partial(_tiny_bench, run_bandwidth_bench)
        patch.setattr(bench_command, "run_bandwidth_bench", tiny)
        run_checked(box, ["bench", "--repeats", "1", "--json", *argv])


@fuzz_settings(15)
@given(
    dirs=st.lists(st.sampled_from(("@WORK@", "/nonexistent", "", "/proc", "@NVME@")), max_size=3),
    argv=flags({"--out": OUTPUT_DIR}),
)
def test_fuzz_report_flags(dirs: list[str], argv: list[str]) -> None:
    with sandbox() as box:
        run_checked(box, ["report", *dirs, *argv])
