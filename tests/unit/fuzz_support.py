"""Support for the CLI fuzz tests: running kvswap in-process, the checks every
call must pass, and the strategies that draw hurtful flags and documents."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import io
import json
import os
import signal
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, currently_in_test_context, event, settings
from hypothesis import strategies as st

from kvswap.cli import main

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
    # --time-scale and --length-scale shape traces only (test_fuzz_trace_reader).
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


#: `kvswap run` on the tiny model with a 4-block NVMe tier in the sandbox.
RUN_BASE = ("run", "--model", "tiny", "--quiet", "--nvme-dir", "@NVME@",
            "--nvme-kv-capacity-blocks", "4", "--metrics-linger-s", "0",
            *TINY_WORKLOAD)  # fmt: skip
