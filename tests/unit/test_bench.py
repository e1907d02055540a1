"""The bandwidth benchmark: rows measured, report schema, JSON file, link speed.

Every run here is tiny (1 MiB transfers, 64 KiB blocks, 2 repeats); the tests
check what was measured and how it is labelled, never how fast it was.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kvswap.bench import bandwidth
from kvswap.bench.bandwidth import (
    CPU_NOTE,
    FULL_TRANSFER_SIZES_BYTES,
    QUICK_TRANSFER_SIZES_BYTES,
    run_bandwidth_bench,
    transfer_sizes_bytes,
)
from kvswap.bench.report import (
    BenchReport,
    BenchResult,
    format_result,
    link_gb_per_s,
    load_report,
    save_report,
)
from kvswap.errors import KvSwapError
from kvswap.units import GIB, KIB, MIB

HAS_CUDA = torch.cuda.is_available()
# The PinnedBuffer is page-locked only where CUDA exists; otherwise it is an mmap.
POOL_MEMORY = "pinned" if HAS_CUDA else "mmap"
SMALL_RUN: dict[str, Any] = {
    "max_bytes": MIB,
    "block_bytes": 64 * KIB,
    "chunk_blocks": (2, 4),
    "repeats": 2,
    "device": "cpu",
}


@pytest.fixture(scope="module")
def cpu_run() -> tuple[BenchReport, list[str]]:
    messages: list[str] = []
    report = run_bandwidth_bench(progress=messages.append, **SMALL_RUN)
    return report, messages


def _row(op: str, memory: str, num_bytes: int, gb_per_s: float, **gather: Any) -> BenchResult:
    return BenchResult(op, memory, num_bytes, gb_per_s, gb_per_s * 0.9, gb_per_s * 1.1, 3, **gather)  # type: ignore[arg-type]


def _report(device: str, *rows: BenchResult) -> BenchReport:
    note = CPU_NOTE if device == "cpu" else None
    return BenchReport(device, "test device", note, rows, 1.7e9, "2.13.0")  # type: ignore[arg-type]


def test_transfer_sizes_quick_subset_and_full_powers_of_two() -> None:
    assert transfer_sizes_bytes() == QUICK_TRANSFER_SIZES_BYTES
    assert transfer_sizes_bytes(full=True) == FULL_TRANSFER_SIZES_BYTES
    assert FULL_TRANSFER_SIZES_BYTES[0] == MIB and FULL_TRANSFER_SIZES_BYTES[-1] == GIB
    assert tuple(MIB * 2**power for power in range(11)) == FULL_TRANSFER_SIZES_BYTES
    assert set(QUICK_TRANSFER_SIZES_BYTES) <= set(FULL_TRANSFER_SIZES_BYTES)
    assert transfer_sizes_bytes(full=True, max_bytes=5 * MIB) == (MIB, 2 * MIB, 4 * MIB)


def test_cpu_run_is_labelled_host_memory(cpu_run: tuple[BenchReport, list[str]]) -> None:
    report, _ = cpu_run
    assert report.device == "cpu"
    assert report.note is not None and "not a PCIe transfer" in report.note
    assert report.torch_version == str(torch.__version__)
    assert report.device_name


def test_cpu_run_rows_and_memory_labels(cpu_run: tuple[BenchReport, list[str]]) -> None:
    report, _ = cpu_run
    copies = [(r.op, r.memory, r.num_bytes) for r in report.results if r.op != "gather_chunk"]
    # The plain tensor is "pageable"; the PinnedBuffer-backed one is named for what it is.
    assert copies == [("memcpy", "pageable", MIB), ("memcpy", POOL_MEMORY, MIB)]
    assert not any(r.op in ("h2d", "d2h") for r in report.results)
    for result in report.results:
        assert result.num_repeats == 2
        assert 0 < result.gb_per_s_min <= result.gb_per_s_median <= result.gb_per_s_max


def test_gather_chunk_rows_carry_a_positive_ratio(cpu_run: tuple[BenchReport, list[str]]) -> None:
    report, _ = cpu_run
    gathers = [r for r in report.results if r.op == "gather_chunk"]
    assert [r.num_blocks for r in gathers] == [2, 4]
    for row in gathers:
        assert row.memory == POOL_MEMORY  # the chunk lands in the PinnedBuffer
        assert row.block_bytes == 64 * KIB
        assert row.num_bytes == (row.num_blocks or 0) * 64 * KIB
        assert row.ratio_to_memcpy is not None and row.ratio_to_memcpy > 0
    plain = [r for r in report.results if r.op != "gather_chunk"]
    assert all(r.ratio_to_memcpy is None and r.num_blocks is None for r in plain)


def test_progress_called_once_per_row(cpu_run: tuple[BenchReport, list[str]]) -> None:
    report, messages = cpu_run
    assert messages == [format_result(r) for r in report.results]


def test_oversized_chunks_are_skipped_with_a_progress_note() -> None:
    messages: list[str] = []
    report = run_bandwidth_bench(
        **{**SMALL_RUN, "chunk_blocks": (2, 32), "repeats": 1}, progress=messages.append
    )
    assert [r.num_blocks for r in report.results if r.op == "gather_chunk"] == [2]
    assert any(m.startswith("skipped gather_chunk of 32 blocks") for m in messages)


def test_rows_that_do_not_fit_in_memory_are_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bandwidth, "available_host_bytes", lambda: 64 * KIB)
    messages: list[str] = []
    report = run_bandwidth_bench(**SMALL_RUN, progress=messages.append)
    assert report.results == ()
    assert messages and all(m.startswith("skipped") for m in messages)
    assert "host memory" in messages[0]


def test_to_json_dict_schema(cpu_run: tuple[BenchReport, list[str]]) -> None:
    report, _ = cpu_run
    doc = report.to_json_dict()
    json.dumps(doc)  # plain JSON types only
    assert doc["device"] == "cpu" and doc["note"] == report.note
    assert {"device_name", "torch_version", "created_unix_s", "results"} <= doc.keys()
    base_keys = {
        "op",
        "memory",
        "bytes",
        "gb_per_s_median",
        "gb_per_s_min",
        "gb_per_s_max",
        "num_repeats",
    }
    for row in doc["results"]:
        if row["op"] == "gather_chunk":
            assert row.keys() == base_keys | {"ratio_to_memcpy", "num_blocks", "block_bytes"}
        else:
            assert row.keys() == base_keys
    assert doc["results"][0]["bytes"] == MIB


def test_save_load_round_trip(cpu_run: tuple[BenchReport, list[str]], tmp_path: Path) -> None:
    report, _ = cpu_run
    path = tmp_path / "bench.json"
    save_report(report, path)
    assert load_report(path) == report
    assert load_report(str(path)) == report


def test_save_into_missing_folder_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "no" / "bench.json"
    with pytest.raises(KvSwapError, match="cannot write"):
        save_report(_report("cpu", _row("memcpy", "mmap", MIB, 10.0)), path)


def _valid_doc() -> dict[str, Any]:
    return _report(
        "cuda",
        _row("d2h", "pinned", MIB, 20.0),
        _row(
            "gather_chunk",
            "pinned",
            4 * MIB,
            15.0,
            ratio_to_memcpy=0.75,
            num_blocks=2,
            block_bytes=2 * MIB,
        ),
    ).to_json_dict()


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda d: [1, 2], "must be a JSON object"),
        (lambda d: {**d, "device": "tpu"}, "device is 'tpu'"),
        (lambda d: {**d, "schema_version": 2}, "schema_version"),
        (lambda d: {k: v for k, v in d.items() if k != "results"}, "results must be a list"),
        (lambda d: {k: v for k, v in d.items() if k != "torch_version"}, "torch_version"),
        (lambda d: {**d, "note": 3}, "note must be"),
        (lambda d: {**d, "results": [7]}, r"results\[0\] must be a JSON object"),
        (lambda d: _edit_row(d, 0, op="copy"), r"results\[0\]: op is 'copy'"),
        (lambda d: _edit_row(d, 0, memory="shared"), "memory is 'shared'"),
        (lambda d: _edit_row(d, 0, bytes=0), "bytes must be a whole number > 0"),
        (lambda d: _edit_row(d, 0, bytes="1MiB"), "bytes must be"),
        (
            lambda d: _edit_row(d, 0, gb_per_s_median="fast"),
            "gb_per_s_median must be a finite number",
        ),
        (
            lambda d: _edit_row(d, 0, gb_per_s_min=99.0),
            "gb_per_s_min <= gb_per_s_median <= gb_per_s_max",
        ),
        (lambda d: _edit_row(d, 0, num_blocks=2), "only allowed on gather_chunk rows"),
        (lambda d: _edit_row(d, 1, num_blocks=None), r"results\[1\]: num_blocks"),
        (lambda d: _edit_row(d, 1, ratio_to_memcpy=None), "ratio_to_memcpy"),
        (lambda d: _edit_row(d, 1, num_blocks=3), "num_blocks x block_bytes"),
    ],
)
def test_load_rejects_wrong_schema(tmp_path: Path, edit: Any, expected: str) -> None:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(edit(_valid_doc())), encoding="utf-8")
    with pytest.raises(KvSwapError, match=expected) as caught:
        load_report(path)
    message = str(caught.value)
    assert str(path) in message and "\n" not in message


def _edit_row(doc: dict[str, Any], index: int, **changes: Any) -> dict[str, Any]:
    rows = [dict(row) for row in doc["results"]]
    rows[index].update(changes)
    return {**doc, "results": rows}


def test_valid_document_loads(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(_valid_doc()), encoding="utf-8")
    assert link_gb_per_s(load_report(path), "d2h") == 20.0


def test_load_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.json"
    with pytest.raises(KvSwapError, match="no such benchmark report") as caught:
        load_report(path)
    assert str(path) in str(caught.value)


@pytest.mark.parametrize("text", ["{not json", "", '{"device": "cpu",}'])
def test_load_malformed_json(tmp_path: Path, text: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(KvSwapError, match="not valid JSON") as caught:
        load_report(path)
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)


def test_load_binary_file(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(KvSwapError, match="not UTF-8"):
        load_report(path)


def test_link_gb_per_s_uses_largest_pinned_transfer_on_cuda() -> None:
    report = _report(
        "cuda",
        _row("h2d", "pinned", MIB, 10.0),
        _row("h2d", "pinned", 256 * MIB, 25.0),
        _row("h2d", "pageable", GIB, 8.0),  # bigger, but the pool is pinned
        _row("d2h", "pinned", 16 * MIB, 22.0),
        _row("d2h", "pinned", 64 * MIB, 24.0),
        _row(
            "gather_chunk",
            "pinned",
            GIB,
            3.0,
            ratio_to_memcpy=0.1,
            num_blocks=512,
            block_bytes=2 * MIB,
        ),
    )
    assert link_gb_per_s(report, "h2d") == 25.0
    assert link_gb_per_s(report, "d2h") == 24.0


def test_link_gb_per_s_on_cpu_uses_largest_memcpy_preferring_the_pool_buffer() -> None:
    report = _report(
        "cpu",
        _row("memcpy", "pageable", 256 * MIB, 12.0),
        _row("memcpy", "mmap", 256 * MIB, 11.0),
        _row("memcpy", "mmap", 16 * MIB, 30.0),
    )
    assert link_gb_per_s(report, "h2d") == 11.0
    assert link_gb_per_s(report, "d2h") == 11.0


def test_link_gb_per_s_errors() -> None:
    cuda_without_pinned = _report("cuda", _row("h2d", "pageable", MIB, 5.0))
    with pytest.raises(KvSwapError, match="no pinned h2d rows"):
        link_gb_per_s(cuda_without_pinned, "h2d")
    with pytest.raises(KvSwapError, match="no memcpy rows"):
        link_gb_per_s(_report("cpu"), "d2h")
    with pytest.raises(KvSwapError, match="link direction"):
        link_gb_per_s(cuda_without_pinned, "sideways")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"block_bytes": 0}, "block_bytes"),
        ({"block_bytes": -2}, "block_bytes"),
        ({"block_bytes": 1.5}, "block_bytes"),
        ({"block_bytes": True}, "block_bytes"),
        ({"repeats": 0}, "repeats"),
        ({"chunk_blocks": ()}, "chunk_blocks"),
        ({"chunk_blocks": (4, 0)}, "chunk_blocks"),
        ({"chunk_blocks": (4, 4)}, "must not repeat"),
        ({"chunk_blocks": [4, 8]}, "chunk_blocks"),
        ({"max_bytes": 1000}, "max_bytes"),
        ({"full": "yes"}, "full"),
        ({"seed": "x"}, "seed"),
        ({"device": "tpu"}, "device"),
        ({"device": "not a device"}, "device"),
    ],
)
def test_bad_input_is_rejected(changes: dict[str, Any], expected: str) -> None:
    with pytest.raises(KvSwapError, match=expected):
        run_bandwidth_bench(**{**SMALL_RUN, **changes})


@pytest.mark.skipif(HAS_CUDA, reason="checks the message given where CUDA is missing")
def test_cuda_asked_for_without_cuda() -> None:
    with pytest.raises(KvSwapError, match="no CUDA device"):
        run_bandwidth_bench(**{**SMALL_RUN, "device": "cuda"})


@pytest.mark.skipif(HAS_CUDA, reason="the default device is CUDA where it exists")
def test_default_device_is_cpu_without_cuda() -> None:
    report = run_bandwidth_bench(**{**SMALL_RUN, "device": None, "repeats": 1})
    assert report.device == "cpu" and report.note == CPU_NOTE


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_rows_use_pinned_buffer_and_pageable() -> None:
    messages: list[str] = []
    report = run_bandwidth_bench(
        max_bytes=16 * MIB, chunk_blocks=(4, 8), repeats=2, device="cuda", progress=messages.append
    )
    assert report.device == "cuda" and report.note is None
    copies = {(r.op, r.memory, r.num_bytes) for r in report.results if r.op != "gather_chunk"}
    assert copies == {
        (op, memory, size)
        for op in ("h2d", "d2h")
        for memory in ("pinned", "pageable")
        for size in (MIB, 16 * MIB)
    }
    gathers = [r for r in report.results if r.op == "gather_chunk"]
    assert [r.num_blocks for r in gathers] == [4, 8]
    assert all(r.memory == "pinned" and (r.ratio_to_memcpy or 0) > 0 for r in gathers)
    assert len(messages) == len(report.results)
    assert link_gb_per_s(report, "h2d") > 0 and link_gb_per_s(report, "d2h") > 0
