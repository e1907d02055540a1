"""The text form of a several-engine simulation (`kvswap simulate --engines N`).

    engine  requests  tok/s  TTFT p50  TTFT p99  hits gpu/cpu/nvme/remote  recomputed  prefill
    0       ...
    all     ...                                  (the combined summary)
    shared remote store: lookups, keys found, reads, writes, evictions, bytes
    with --compare-remote: each figure with the store, without it, and the ratio

Reads only the JSON object the command prints with --json, so both forms
always say the same thing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvswap.units import format_bytes

_COLUMNS = ("engine", "requests", "tok/s", "TTFT p50 ms", "TTFT p99 ms",
            "prefix hits gpu/cpu/nvme/remote", "recomputed", "prefill computed")  # fmt: skip


def _row(label: str, summary: Mapping[str, Any]) -> tuple[str, ...]:
    hits = summary["prefix_hit_tokens"]
    return (
        label,
        str(summary["requests_completed"]),
        f"{summary['throughput_tok_s']:.1f}",
        f"{summary['ttft_ms']['p50']:.1f}",
        f"{summary['ttft_ms']['p99']:.1f}",
        "/".join(str(hits[tier]) for tier in ("gpu", "cpu", "nvme", "remote")),
        str(summary["recomputed_tokens"]),
        str(summary["prefill_tokens_computed"]),
    )


def table(rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns, two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in rows]  # fmt: skip


def render_store(store: Mapping[str, Any]) -> str:
    capacity = store["capacity_bytes"]
    size = "unbounded" if capacity is None else format_bytes(capacity)
    return (
        f"shared remote store ({size}): {store['lookups']} lookups found "
        f"{store['lookup_hit_keys']} of {store['lookup_hit_keys'] + store['lookup_miss_keys']} "
        f"keys; reads {store['read_hit_keys']} hit / {store['read_miss_keys']} gone; "
        f"{store['written_keys']} keys written ({format_bytes(store['bytes_written'])}); "
        f"{store['evictions']} evicted, {store['expirations']} expired; "
        f"peak {format_bytes(store['peak_used_bytes'])}"
    )


def render_comparison(rows: Mapping[str, Mapping[str, Any]]) -> list[str]:
    labels = {
        "ttft_p50_ms": "TTFT p50 (ms)",
        "ttft_p99_ms": "TTFT p99 (ms)",
        "throughput_tok_s": "throughput (tok/s)",
        "prefill_tokens_computed": "prefill tokens computed",
    }
    cells = [("", "with store", "without", "ratio")]
    for key, label in labels.items():
        row = rows[key]
        ratio = row["ratio"]
        cells.append(
            (label, f"{row['with_remote']:g}", f"{row['without_remote']:g}",
             "n/a" if ratio is None else f"{ratio:.3f}")
        )  # fmt: skip
    return table(cells)


def render_engines(result: Mapping[str, Any]) -> str:
    """The whole text report of `result` (the command's JSON object)."""
    rows: list[tuple[str, ...]] = [_COLUMNS]
    rows += [_row(str(engine["engine"]), engine) for engine in result["per_engine"]]
    rows.append(_row("all", result["combined"]))
    lines = [f"{result['engines']} engines, {result['route']}; workload {result['workload']}"]
    lines += table(rows)
    if result.get("shared_remote_store") is not None:
        lines.append(render_store(result["shared_remote_store"]))
    if "remote_vs_without" in result:
        lines.append("the same engines with and without the shared store (ratio: with / without)")
        lines += render_comparison(result["remote_vs_without"])
    return "\n".join(lines)
