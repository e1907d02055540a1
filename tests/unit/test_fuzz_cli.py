"""Fuzz every subcommand's flags and every reader of a user's file with hypothesis.

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

import contextlib
import copy
import dataclasses
import functools
import io
import json
import os
import shutil
import signal
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

from kvswap.cli import main
from kvswap.config import FIELD_SECTIONS

# ---------------------------------------------------------------------------------------------
# How much to run
# ---------------------------------------------------------------------------------------------

_EXAMPLES_FROM_ENV = os.environ.get("FUZZ_EXAMPLES")
#: A call past this is a hang: every valid size drawn here runs in well under a second.
CALL_LIMIT_S = 30.0
#: "A few lines": the one-line error, and room for a warning or two (e.g. a listener
#: that is not on loopback). A Python warning counts as the two lines it prints.
MAX_STDERR_LINES = 4


def fuzz_settings(ci_examples: int) -> Callable[[Any], Any]:
    """`ci_examples` per test in CI (deterministic); FUZZ_EXAMPLES=N runs N, random."""
    return settings(
        max_examples=int(_EXAMPLES_FROM_ENV) if _EXAMPLES_FROM_ENV else ci_examples,
        deadline=None,
        derandomize=_EXAMPLES_FROM_ENV is None,
        database=None,  # nothing left on disk, not even hypothesis's example database
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# ---------------------------------------------------------------------------------------------
# Running the CLI in a sandbox
# ---------------------------------------------------------------------------------------------


class CallRanTooLong(BaseException):
    """Raised by SIGALRM in the call; a BaseException so no `except Exception` swallows it."""


@dataclasses.dataclass(frozen=True)
class Outcome:
    argv: tuple[str, ...]
    code: int
    out: str
    err: str
    warnings: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Sandbox:
    """Per example: an NVMe directory that must stay empty, and a working directory."""

    nvme: Path
    work: Path

    def fill(self, argv: Sequence[str]) -> list[str]:
        return [a.replace("@NVME@", str(self.nvme)).replace("@WORK@", str(self.work)) for a in argv]


@contextlib.contextmanager
def sandbox() -> Iterator[Sandbox]:
    previous = Path.cwd()
    with tempfile.TemporaryDirectory(prefix="kvswap-fuzz-") as root:
        box = Sandbox(Path(root, "nvme"), Path(root, "work"))
        box.nvme.mkdir()
        box.work.mkdir()
        os.chdir(box.work)  # tune and report write default files into the working directory
        try:
            yield box
        finally:
            os.chdir(previous)


_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
    if hasattr(signal, name)
)


def _ran_too_long(signum: int, frame: object) -> None:
    raise CallRanTooLong


def invoke(argv: Sequence[str]) -> Outcome:
    """`kvswap ARGV` in-process; an exception escaping main() (a traceback) fails the test."""
    out_bytes, err_bytes = io.BytesIO(), io.BytesIO()
    out = io.TextIOWrapper(out_bytes, encoding="utf-8", errors="strict", write_through=True)
    err = io.TextIOWrapper(
        err_bytes, encoding="utf-8", errors="backslashreplace", write_through=True
    )
    # main() may install handlers for the stop signals; the test process keeps its own.
    handlers = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    previous_alarm = signal.signal(signal.SIGALRM, _ran_too_long)
    signal.setitimer(signal.ITIMER_REAL, CALL_LIMIT_S)
    try:
        with (
            warnings.catch_warnings(record=True) as caught,
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            warnings.simplefilter("always")
            try:
                code = main(list(argv))
            except SystemExit as done:  # argparse: usage errors (2) and --help (0)
                code = done.code if isinstance(done.code, int) else 0 if done.code is None else 1
    except CallRanTooLong:
        raise AssertionError(f"kvswap {list(argv)!r} ran past {CALL_LIMIT_S:g} s") from None
    except BaseException as error:
        raise AssertionError(
            f"kvswap {list(argv)!r} raised {type(error).__name__}: {error!s:.300}"
        ) from error
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_alarm)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    out.flush()
    err.flush()
    return Outcome(
        tuple(argv),
        code,
        out_bytes.getvalue().decode("utf-8", errors="replace"),
        err_bytes.getvalue().decode("utf-8", errors="replace"),
        tuple(f"{w.category.__name__}: {w.message}" for w in caught),
    )


def _strict_json(text: str) -> object:
    def refuse(constant: str) -> object:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def check(outcome: Outcome, box: Sandbox, *, json_out: bool = False) -> None:
    """The contract every command keeps, whatever its input."""
    where = f"kvswap {list(outcome.argv)!r}"
    assert outcome.code in (0, 2), f"{where}: exit {outcome.code}; stderr {outcome.err!r}"
    assert "Traceback" not in outcome.err, f"{where}: {outcome.err[-2000:]}"
    num_lines = outcome.err.count("\n") + 2 * len(outcome.warnings)
    assert num_lines <= MAX_STDERR_LINES, f"{where}: stderr {outcome.err!r} {outcome.warnings}"
    if outcome.code == 2:
        assert outcome.err.strip(), f"{where}: exit 2 without saying why"
    left = sorted(p.name for p in box.nvme.iterdir())
    assert not left, f"{where}: left {left} in the NVMe directory"
    slabs = sorted(p.name for p in box.work.rglob("*.kvslab"))
    assert not slabs, f"{where}: left slabs {slabs} in the working directory"
    if json_out and outcome.code == 0 and "--help" not in outcome.argv:
        try:
            _strict_json(outcome.out)
        except ValueError as error:
            raise AssertionError(
                f"{where}: --json printed {outcome.out[:300]!r}: {error}"
            ) from None


def run_checked(box: Sandbox, argv: Sequence[str]) -> Outcome:
    filled = box.fill(argv)
    outcome = invoke(filled)
    # --hypothesis-show-statistics shows how many draws got past the checks.
    if currently_in_test_context():  # the plain regression tests call this too
        event(f"{filled[0]} exit {outcome.code}")
    check(outcome, box, json_out="--json" in filled)
    return outcome


@pytest.fixture(autouse=True, scope="module")
def _no_kvswap_environment() -> Iterator[None]:
    # The environment is a config layer: a developer's KVSWAP_* must not change the draws.
    with pytest.MonkeyPatch.context() as patch:
        for name in [n for n in os.environ if n.startswith("KVSWAP_")]:
            patch.delenv(name)
        yield


# ---------------------------------------------------------------------------------------------
# Values that hurt
# ---------------------------------------------------------------------------------------------

#: Numbers written as a user might: NaN, infinities, overflow, hex, underscores, a sign.
NASTY_NUMBERS = (
    "nan", "-nan", "NaN", "inf", "-inf", "Infinity", "1e300", "-1e300", "1e308", "1e400",
    "1e23", "1e9", "-1", "0", "-0", "0.0", "1e-300", "5e-324", "0x1f", "1_0", "+5", "2.5",
)  # fmt: skip
#: Numbers big enough that an up-front bound must refuse them (never merely slow).
HUGE_INTEGERS = (
    "1000000000", "99999999999", "1000000000000000", "9223372036854775807",
    "9223372036854775808", "1" + "0" * 30, "9" * 400,
)  # fmt: skip
#: Text: empty, whitespace, a lone surrogate (what CPython makes of undecodable argv
#: bytes), a newline (an error echoing it raw would take two lines), a long word.
NASTY_TEXT = (
    "", " ", "abc", "\udcff\udcfe", "\u2603", "-", "a" * 300, "1,2", ",", "[1]", "{}",
    "true", "null", "line\nbreak", "%s%n", "../..", "~",
)  # fmt: skip


def nasty() -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(NASTY_NUMBERS + HUGE_INTEGERS + NASTY_TEXT),
        st.integers(-(10**6), -1).map(str),
        st.floats(allow_nan=True, allow_infinity=True).map(repr),
        st.text(st.characters(blacklist_characters="\x00"), max_size=12),
    )


@dataclasses.dataclass(frozen=True)
class Opt:
    """A flag's values: plausible ones, and the nasty ones drawn for at most one flag a call."""

    valid: st.SearchStrategy[str]
    bad: st.SearchStrategy[str]


#: A flag: its values (a plain strategy serves both roles), or None for a switch.
Flag = Opt | st.SearchStrategy[str] | None


def value(valid: st.SearchStrategy[Any]) -> Opt:
    return Opt(valid.map(str), nasty())


def ints(low: int, high: int) -> Opt:
    return value(st.integers(low, high))


def choice(*options: str) -> Opt:
    return value(st.sampled_from(options))


@st.composite
def flags(draw: st.DrawFn, options: dict[str, Flag]) -> list[str]:
    """A few of `options` with plausible values, and usually one with a nasty value.

    One bad value among valid ones reaches the code past the first check; many bad
    values at once would all stop at the first flag that is validated.
    """
    chosen = draw(st.lists(st.sampled_from(sorted(options)), unique=True, max_size=4))
    target = draw(st.sampled_from([None, *chosen]))
    argv: list[str] = []
    for name in chosen:
        option = options[name]
        if option is None:
            argv.append(name)
        elif isinstance(option, Opt):
            argv += [name, draw(option.bad if name == target else option.valid)]
        else:
            argv += [name, draw(option)]
    return argv


OUTPUT_FILE = st.sampled_from(
    ("@WORK@/out.json", "@WORK@/no/such/dir/out.json", "/proc/nope", "", "@WORK@", "/")
)
OUTPUT_DIR = st.sampled_from(("@WORK@/report", "/proc/nope", "", "@WORK@/a/b", "/dev/null"))
WATERMARK = value(st.sampled_from(("0.5", "0.65", "0.85", "0.95", "1", "1.0")))
METRICS_PORT = st.sampled_from(("0", "-1", "65536", "99999999999", "x", "nan"))
#: Loopback only (never 0.0.0.0 in a test), plus names that fail to resolve without a network.
METRICS_HOST = st.sampled_from(("127.0.0.1", "::1", "localhost", "", "999.1.1.1"))

#: Config fields as flags, with tiny valid values (`run` and `simulate` share them).
TIER_FLAGS: dict[str, Flag] = {
    "--gpu-kv-capacity-blocks": value(st.sampled_from(("4", "8", "32", "99999999999"))),
    "--cpu-kv-capacity-blocks": ints(0, 64),
    "--nvme-kv-capacity-blocks": ints(0, 16),
    "--gpu-kv-capacity-bytes": choice("1MiB", "64KiB", "9TiB", "2 potatoes", "1e300GiB"),
    "--cpu-kv-capacity-bytes": choice("1MiB", "64KiB", "9TiB", "2 potatoes", "-1GiB"),
    "--nvme-kv-capacity-bytes": choice("1MiB", "9EiB", "0", "nanGiB"),
    "--nvme-dir": st.sampled_from(("@NVME@", "", "/nonexistent", "/proc", "@NVME@/missing")),
    "--nvme-persist": st.sampled_from(("false", "0", "no", "maybe", "", "nan")),
    "--protected-sink-blocks": ints(0, 40),
    "--evict-protected-blocks": ints(0, 8),
    "--min-residency-steps": ints(0, 70),
    "--swap-out-high-watermark": WATERMARK,
    "--swap-out-low-watermark": WATERMARK,
    "--swap-in-low-watermark": WATERMARK,
    "--cpu-demote-high-watermark": WATERMARK,
    "--cpu-demote-low-watermark": WATERMARK,
    "--swap-out-chunk-blocks": ints(1, 16),
    "--swap-in-chunk-blocks": ints(1, 16),
    "--prefetch-stream-count": ints(1, 9),
    "--block-tokens": choice("1", "4", "16", "24", "4096", "8192", "true"),
    "--max-num-seqs": ints(1, 8),
    "--max-num-batched-tokens": ints(1, 64),
    "--preemption": choice("swap", "recompute", "SWAP"),
    "--device": choice("cpu", "auto", "cuda", "tpu"),
}
WORKLOAD_FLAGS: dict[str, Flag] = {
    "--num-sessions": ints(1, 3),
    "--turns": ints(1, 3),
    "--prompt-tokens": ints(1, 48),
    "--output-tokens": ints(0, 4),
    "--user-tokens": ints(0, 8),
    "--system-prompt-tokens": ints(0, 8),
    "--arrival-rate": choice("inf", "100", "1e6"),
    "--think-time-s": choice("0", "0.001"),
    "--seed": value(st.integers(0, 2**64)),
    "--time-scale": choice("1", "0.5"),
    "--length-scale": choice("1", "0.5"),
    "--max-requests": ints(1, 4),
}
MONITOR_FLAGS: dict[str, Flag] = {
    "--metrics-port": METRICS_PORT,
    "--metrics-host": METRICS_HOST,
    "--report": OUTPUT_DIR,
    "--json": None,
}
#: A tiny synthetic workload; drawn flags come after it and win.
TINY_WORKLOAD = (
    "--num-sessions", "2", "--turns", "1", "--prompt-tokens", "24", "--system-prompt-tokens",
    "0", "--output-tokens", "2", "--user-tokens", "2",
)  # fmt: skip

# ---------------------------------------------------------------------------------------------
# Every subcommand's flags
# ---------------------------------------------------------------------------------------------

PLAN_FLAGS: dict[str, Flag] = {
    "--context-tokens": ints(1, 10**6),
    "--concurrency": ints(1, 512),
    "--gpu-mem-gib": choice("40", "80", "0", "0.5"),
    "--weights-gib": choice("16", "0", "39.9"),
    "--reserve-gib": choice("6", "0", "100"),
    "--cpu-pool-gib": choice("64", "0", "0.001"),
    "--nvme-gib": choice("512", "0"),
    "--link-gb-per-s": choice("25", "0.001", "1e6"),
    "--link-gbps": choice("25", "64"),
    "--preset": choice("article-8b", "tiny", "small", "llama-9"),
    "--dtype": choice("fp16", "bf16", "fp32", "fp8", "int4"),
    "--block-tokens": choice("16", "1", "24", "4096"),
    "--kv-block-tokens": choice("16", "32"),
    "--swap-out-chunk-blocks": ints(1, 64),
    "--swap-in-chunk-blocks": ints(1, 64),
    "--swap-out-high-watermark": WATERMARK,
    "--protected-sink-blocks": ints(0, 10**4),
    "--gpu-kv-capacity-blocks": ints(0, 10**4),
    "--cpu-kv-capacity-bytes": choice("64GiB", "0", "1e300"),
    "--json": None,
}


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
RUN_BASE = ("run", "--model", "tiny", "--quiet", "--nvme-dir", "@NVME@",
            "--nvme-kv-capacity-blocks", "4", *TINY_WORKLOAD)  # fmt: skip


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


# ---------------------------------------------------------------------------------------------
# Every reader: --trace, --config, --bench, --hf-config, a checkpoint's config.json, report.json
# ---------------------------------------------------------------------------------------------

_DEEP_MARK = "@DEEP@"
#: JSON leaves that hurt; _DEEP_MARK becomes a deeply nested array in the text.
NASTY_JSON: tuple[Any, ...] = (
    float("nan"), float("inf"), -float("inf"), 1e308, -1e308, 5e-324, 10**30, -(10**30),
    2**63, 2**64, 0, -1, True, False, None, "", "x", "\udcff", "1e9", [], {}, [1, 2],
    {"a": 1}, [[[]]], _DEEP_MARK, 10**4000,
)  # fmt: skip


def json_leaf() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.sampled_from(NASTY_JSON),
        st.integers(),
        st.floats(),
        st.text(max_size=8),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
            max_leaves=6,
        ),
    )


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def _dump(doc: Any, depth: int) -> str:
    # 10**4000 is past int->str's default digit limit; such a file is still valid JSON.
    with _unlimited_int_digits():
        text = json.dumps(doc, allow_nan=True)
    return text.replace(json.dumps(_DEEP_MARK), _deep(depth))


@contextlib.contextmanager
def _unlimited_int_digits() -> Iterator[None]:
    import sys

    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        yield
    finally:
        sys.set_int_max_str_digits(limit)


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every node's path (dict keys and list indexes), the root excluded."""
    children: list[tuple[Any, Any]] = []
    if isinstance(doc, dict):
        children = list(doc.items())
    elif isinstance(doc, list):
        children = list(enumerate(doc))
    paths: list[tuple[Any, ...]] = []
    for key, child in children:
        paths.append((*prefix, key))
        paths += _paths(child, (*prefix, key))
    return paths


@st.composite
def mutated_json(draw: st.DrawFn, base: Any) -> bytes:
    """`base` as is, with one node replaced or removed, or nested deep, binary, random JSON."""
    kinds = ("keep", "leaf", "leaf", "leaf", "leaf", "drop", "deep", "binary", "any")
    kind = draw(st.sampled_from(kinds))
    depth = draw(st.sampled_from((50, 1000, 100_000)))
    if kind == "binary":
        return draw(st.binary(max_size=64)) + b"\xff\xfe"
    if kind == "deep":
        return _deep(depth).encode()
    if kind == "any":
        return _dump(draw(json_leaf()), depth).encode()
    doc = copy.deepcopy(base)
    if kind == "keep":  # the valid document, so the flags beside it reach the work
        return _dump(doc, depth).encode()
    path = draw(st.sampled_from(_paths(doc)))
    parent = functools.reduce(lambda node, key: node[key], path[:-1], doc)
    if kind == "drop":
        del parent[path[-1]]
    else:
        parent[path[-1]] = draw(json_leaf())
    return _dump(doc, depth).encode()


# A Mooncake trace: (timestamp ms, input tokens <= 512 per hash id, output tokens, hash ids).
TRACE_ROWS = [
    {"timestamp": 0, "input_length": 40, "output_length": 2, "hash_ids": [1]},
    {"timestamp": 5, "input_length": 60, "output_length": 2, "hash_ids": [1, 2]},
]
TRACE_COMMANDS = (
    ("simulate", "--quiet", "--trace", "@FILE@"),
    ("simulate", "--quiet", "--hit-rate-curve", "--trace", "@FILE@"),
    ("run", "--model", "tiny", "--quiet", "--nvme-dir", "@NVME@",
     "--nvme-kv-capacity-blocks", "4", "--trace", "@FILE@"),
)  # fmt: skip


@st.composite
def trace_text(draw: st.DrawFn) -> bytes:
    row = draw(st.sampled_from(range(len(TRACE_ROWS))))
    lines = [json.dumps(r).encode() for r in TRACE_ROWS]
    lines[row] = draw(mutated_json(TRACE_ROWS[row]))
    if draw(st.booleans()):
        lines.insert(draw(st.integers(0, len(lines))), draw(st.sampled_from((b"", b" ", b"\x00"))))
    return b"\n".join(lines) + b"\n"


def _write(box: Sandbox, name: str, data: bytes) -> str:
    path = box.work / name
    path.write_bytes(data)
    return str(path)


@fuzz_settings(40)
@given(
    data=trace_text(),
    command=st.sampled_from(TRACE_COMMANDS),
    scales=flags({"--time-scale": choice("1", "1e-3"), "--length-scale": choice("1", "0.5", "2")}),
)
def test_fuzz_trace_reader(data: bytes, command: tuple[str, ...], scales: list[str]) -> None:
    with sandbox() as box:
        path = _write(box, "trace.jsonl", data)
        run_checked(box, [a.replace("@FILE@", path) for a in command] + scales)


_SECTION_OF = dict(FIELD_SECTIONS)
#: TOML right-hand sides that hurt (a bool for an int, a date, an overflowing float, ...).
NASTY_TOML = (
    "nan", "+nan", "inf", "-inf", "true", "false", '"x"', '""', '"1GiB"', '"9TiB"', "[1, 2]",
    "{ a = 1 }", "1e400", "99999999999999999999999", "-1", "0", "1", "16", "0.5", "1979-05-27",
    "07:32:00", "1979-05-27T07:32:00Z", '"\\u00e9"', "'''multi\nline'''", '"fp8"', '"tiny"',
)  # fmt: skip
TOML_KEYS = (*FIELD_SECTIONS, "swap_in_low_watermark", "evict_protected_blocks", "model", "x")


@st.composite
def toml_text(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(("keys", "keys", "keys", "deep", "deep_table", "binary")))
    if kind == "binary":
        return draw(st.binary(max_size=64)) + b"\xff"
    depth = draw(st.sampled_from((50, 1000, 100_000)))
    if kind == "deep":
        return f"kv_block_tokens = {_deep(depth)}\n".encode()
    if kind == "deep_table":
        return f"cache = {'{ a = ' * depth}1{' }' * depth}\n".encode()
    lines: list[str] = []
    for key in draw(st.lists(st.sampled_from(TOML_KEYS), min_size=1, max_size=3)):
        literal = draw(st.one_of(st.sampled_from(NASTY_TOML), st.integers().map(str)))
        # In its own section, in a wrong one, or at the top level (the seed's flat form).
        section = draw(st.sampled_from((_SECTION_OF.get(key, "cache"), "swap", "nope", None)))
        lines += ([] if section is None else [f"[{section}]"]) + [f"{key} = {literal}"]
    return ("\n".join(lines) + "\n").encode()


CONFIG_COMMANDS = (
    ("plan", "--json", "--config", "@FILE@"),
    ("simulate", *TINY_WORKLOAD, "--quiet", "--config", "@FILE@"),
    (*RUN_BASE, "--config", "@FILE@"),
)


@fuzz_settings(45)
@given(data=toml_text(), command=st.sampled_from(CONFIG_COMMANDS))
def test_fuzz_config_reader(data: bytes, command: tuple[str, ...]) -> None:
    with sandbox() as box:
        path = _write(box, "kvswap.toml", data)
        run_checked(box, [a.replace("@FILE@", path) for a in command])


@pytest.fixture(scope="module")
def bench_document() -> Any:
    """A real `kvswap bench` report of this machine, at the smallest sizes."""
    from kvswap.bench.bandwidth import run_bandwidth_bench

    report = run_bandwidth_bench(
        block_bytes=64 * 1024, chunk_blocks=(2,), repeats=1, device="cpu", max_bytes=2**20
    )
    return report.to_json_dict()


BENCH_READERS = (
    ("plan", "--json", "--bench", "@FILE@"),
    ("simulate", *TINY_WORKLOAD, "--quiet", "--bench", "@FILE@"),
    ("tune", *TINY_WORKLOAD, "--quiet", "--out", "@WORK@/t.toml", "--bench", "@FILE@"),
)


@fuzz_settings(20)
@given(data=st.data(), command=st.sampled_from(BENCH_READERS))
def test_fuzz_bench_reader(
    data: st.DataObject, command: tuple[str, ...], bench_document: Any
) -> None:
    text = data.draw(mutated_json(bench_document))
    with sandbox() as box:
        path = _write(box, "bench.json", text)
        run_checked(box, [a.replace("@FILE@", path) for a in command])


#: The engine's `tiny` preset as a Hugging Face config.json (its checkpoint is saved below).
TINY_CONFIG_JSON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "torch_dtype": "float32",
}  # fmt: skip


@fuzz_settings(25)
@given(data=mutated_json(TINY_CONFIG_JSON), with_json=st.booleans())
def test_fuzz_hf_config_reader(data: bytes, with_json: bool) -> None:
    with sandbox() as box:
        path = _write(box, "config.json", data)
        json_flag = ["--json"] if with_json else []
        run_checked(box, ["plan", "--hf-config", path, *json_flag])
        # A fixed GPU tier: sized from a 40 GB card, a tiny model's tier is millions of
        # blocks (see test_simulate_sizes_a_tiny_model_s_tier_in_bounded_time).
        simulate = ["simulate", *TINY_WORKLOAD, "--quiet", "--gpu-kv-capacity-blocks", "64"]
        run_checked(box, [*simulate, "--hf-config", path])


@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The `tiny` preset's weights as one safetensors file (removed after the module)."""
    import torch
    from safetensors.torch import save_file

    from kvswap.model.loader import load_model

    model, _ = load_model("tiny", None, torch.device("cpu"))
    directory = tmp_path_factory.mktemp("tiny-checkpoint")
    path = directory / "model.safetensors"
    save_file({n: p.detach().clone() for n, p in model.named_parameters()}, str(path))
    yield path
    path.unlink()
    directory.rmdir()


INDEX_DOCUMENT = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model.safetensors"}}
CHECKPOINT_COMMANDS = (
    ("generate", "--model", "@FILE@", "--prompt-ids", "1,2", "--max-new-tokens", "2"),
    ("generate", "--model", "@FILE@", "--prompt-ids", "1,2", "--temperature", "1", "--json"),
    ("run", "--model", "@FILE@", "--quiet", "--nvme-dir", "@NVME@", "--nvme-kv-capacity-blocks",
     "4", *TINY_WORKLOAD),
)  # fmt: skip


@fuzz_settings(25)
@given(
    data=st.data(),
    which=st.sampled_from(("config.json", "config.json", "model.safetensors.index.json")),
    command=st.sampled_from(CHECKPOINT_COMMANDS),
)
def test_fuzz_checkpoint_reader(
    data: st.DataObject, which: str, command: tuple[str, ...], tiny_weights: Path
) -> None:
    with sandbox() as box:
        model_dir = box.work / "model"
        model_dir.mkdir()
        # A copy, not a link: the loader refuses links that lead out of the model directory.
        shutil.copyfile(tiny_weights, model_dir / "model.safetensors")
        config = json.dumps(TINY_CONFIG_JSON).encode()
        if which == "config.json":
            config = data.draw(mutated_json(TINY_CONFIG_JSON), label="config.json")
        else:
            index = data.draw(mutated_json(INDEX_DOCUMENT), label="index")
            (model_dir / which).write_bytes(index)
        (model_dir / "config.json").write_bytes(config)
        run_checked(box, [a.replace("@FILE@", str(model_dir)) for a in command])


@pytest.fixture(scope="module")
def report_document(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A real report.json, written by `simulate --report` on a tiny workload."""
    directory = tmp_path_factory.mktemp("report")
    outcome = invoke(["simulate", *TINY_WORKLOAD, "--quiet", "--report", str(directory)])
    assert outcome.code == 0, outcome.err
    document = json.loads((directory / "report.json").read_text(encoding="utf-8"))
    for path in sorted(directory.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    directory.rmdir()
    return document


@fuzz_settings(15)
@given(data=st.data(), compare=st.booleans())
def test_fuzz_report_reader(data: st.DataObject, compare: bool, report_document: Any) -> None:
    text = data.draw(mutated_json(report_document))
    with sandbox() as box:
        run_dir = box.work / "run"
        run_dir.mkdir()
        (run_dir / "report.json").write_bytes(text)
        dirs = [str(run_dir)]
        if compare:
            other = box.work / "other"
            other.mkdir()
            (other / "report.json").write_text(json.dumps(report_document), encoding="utf-8")
            dirs.append(str(other))
        run_checked(box, ["report", *dirs, "--out", str(box.work / "page")])
        # A report is read-only to `report`: it never rewrites what it read.
        assert (run_dir / "report.json").read_bytes() == text, "report rewrote report.json"


@pytest.mark.xfail(
    run=False,
    reason="open: the simulator sizes the GPU tier from the card's memory with no bound on "
    "its block count; `tiny` with 1-token blocks is ~70 million blocks, ~24 s to set up for "
    "2 requests (and ~15 times that in `tune`)",
)
def test_simulate_sizes_a_tiny_model_s_tier_in_bounded_time() -> None:
    with sandbox() as box:
        argv = ["simulate", *TINY_WORKLOAD, "--quiet", "--preset", "tiny", "--block-tokens", "1"]
        run_checked(box, argv)


def test_generate_with_a_vanishing_temperature_is_not_a_traceback() -> None:
    with sandbox() as box:
        run_checked(box, ["generate", "--prompt-ids", "1,2", "--temperature", "1e-300"])


@pytest.mark.parametrize("key", ["rms_norm_eps", "rope_theta"])
def test_hf_config_float_field_given_a_huge_integer_is_one_line(key: str) -> None:
    with sandbox() as box:
        path = _write(box, "config.json", json.dumps({**TINY_CONFIG_JSON, key: 10**400}).encode())
        run_checked(box, ["plan", "--hf-config", path])
