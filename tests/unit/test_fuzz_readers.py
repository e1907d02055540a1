"""Fuzz every reader of a user's file with hypothesis (flags: test_fuzz_commands.py).

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

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvswap.config import FIELD_SECTIONS

from .fuzz_support import (
    RUN_BASE,
    TINY_WORKLOAD,
    Sandbox,
    _deep,
    choice,
    flags,
    fuzz_settings,
    invoke,
    mutated_json,
    run_checked,
    sandbox,
)


@pytest.fixture(autouse=True, scope="module")
def _no_kvswap_environment() -> Iterator[None]:
    # The environment is a config layer: a developer's KVSWAP_* must not change the draws.
    with pytest.MonkeyPatch.context() as patch:
        for name in [n for n in os.environ if n.startswith("KVSWAP_")]:
            patch.delenv(name)
        yield


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
    save_file({n: t.clone() for n, t in model.state_dict().items()}, str(path))
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


def test_simulate_sizes_a_tiny_model_s_tier_in_bounded_time() -> None:
    """Sized from the card's memory, `tiny` with 1-token blocks is a GPU tier of ~70
    million blocks: slot accounting costs only the slots a run uses (it built lists
    of every slot, ~24 s before the first step)."""
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
