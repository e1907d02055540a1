"""The memory bill: how much KV a model needs and where it fits.

Pure functions over a `ModelDescription` and a few sizes; used by `kvswap plan`,
the engine (admission) and the simulator. Torch-free.

    kv_bytes_per_token = values cached per token per layer x layers x dtype bytes
                       = 2 (K and V) x layers x kv_heads x head_dim x dtype bytes
                         for MHA / GQA / MQA; MLA caches one latent vector instead.

The formula itself lives in `kvswap.model.description`, the one place the
engine's `KVLayout` also takes it from.

A request holds whole blocks, so its bill is ceil(context / block_tokens) blocks.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from kvswap.errors import KvSwapError
from kvswap.model.description import ModelDescription
from kvswap.model.dtypes import dtype_bytes
from kvswap.units import MIB, ceil_div, format_bytes

#: The seed article's measured PCIe 4.0 x16 bandwidth, GB/s (1e9 bytes/s).
DEFAULT_LINK_GB_PER_S = 25.0
#: The link rates a plan or a model takes, GB/s: 1 MB/s (slower is a broken measurement)
#: to 100 TB/s (past any host link). Within it every transfer time is a finite float.
MIN_LINK_GB_PER_S = 0.001
MAX_LINK_GB_PER_S = 100_000.0
#: The seed article's sweet spot for one transfer: 8-32 MB.
CHUNK_MIN_BYTES = 8 * MIB
CHUNK_MAX_BYTES = 32 * MIB


@dataclass(frozen=True)
class PlanInputs:
    """Everything the ledger needs; sizes in bytes, None = derive or not given."""

    shape: ModelDescription
    dtype: str
    block_tokens: int
    context_tokens: int
    concurrency: int
    gpu_mem_bytes: int
    reserve_bytes: int
    weights_bytes: int | None
    num_gpu_blocks: int | None
    num_cpu_blocks: int
    num_nvme_blocks: int
    swap_out_chunk_blocks: int
    swap_in_chunk_blocks: int
    swap_out_high_watermark: float
    gpu_to_cpu_gb_per_s: float = DEFAULT_LINK_GB_PER_S
    cpu_to_gpu_gb_per_s: float = DEFAULT_LINK_GB_PER_S
    link_note: str | None = None
    # The link to a shared remote store (network, GB/s); None: no remote tier planned.
    remote_gb_per_s: float | None = None


@dataclass(frozen=True)
class Plan:
    """The bill. Field names are the `kvswap plan --json` keys."""

    model: str
    dtype: str
    block_tokens: int
    context_tokens: int
    concurrency: int
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    blocks_per_request: int
    kv_bytes_per_request: int
    kv_demand_bytes: int
    weights_bytes: int
    weights_is_estimate: bool
    gpu_mem_bytes: int
    reserve_bytes: int
    gpu_kv_budget_bytes: int
    gpu_kv_capacity_blocks: int
    cpu_kv_capacity_blocks: int
    nvme_kv_capacity_blocks: int
    gpu_kv_capacity_bytes: int
    cpu_kv_capacity_bytes: int
    nvme_kv_capacity_bytes: int
    max_concurrency_gpu: int
    max_concurrency_with_cpu: int
    max_concurrency_all_tiers: int
    gpu_to_cpu_gb_per_s: float
    cpu_to_gpu_gb_per_s: float
    swap_out_chunk_blocks: int
    swap_out_chunk_bytes: int
    swap_out_chunk_ms: float
    swap_in_chunk_blocks: int
    swap_in_chunk_bytes: int
    swap_in_chunk_ms: float
    # Over the remote store's link (None without --remote-gb-per-s): a fetch moves
    # swap-in chunks (remote -> CPU), the write-behind swap-out chunks (CPU -> remote).
    remote_gb_per_s: float | None = None
    remote_fetch_chunk_ms: float | None = None
    remote_write_chunk_ms: float | None = None
    warnings: list[str] = field(default_factory=list)

    def to_json_dict(self) -> dict[str, object]:
        return asdict(self)


def kv_bytes_per_token(shape: ModelDescription, dtype: str) -> int:
    return shape.kv_bytes_per_token(dtype)


def kv_bytes_per_block(shape: ModelDescription, dtype: str, block_tokens: int) -> int:
    return shape.kv_bytes_per_block(block_tokens, dtype)


def blocks_for_tokens(num_tokens: int, block_tokens: int) -> int:
    return ceil_div(num_tokens, block_tokens)


def check_link_gb_per_s(gb_per_s: float, name: str) -> float:
    """`gb_per_s` if it is a usable link rate, else KvSwapError naming `name` and the range.

    NaN, infinity, 0 and negative rates all fail here, so a transfer time is never a
    division by zero, NaN or infinity (which `--json` could not print as JSON).
    """
    if not math.isfinite(gb_per_s) or not MIN_LINK_GB_PER_S <= gb_per_s <= MAX_LINK_GB_PER_S:
        raise KvSwapError(
            f"{name} = {gb_per_s:g} GB/s: allowed: a finite rate in "
            f"{MIN_LINK_GB_PER_S:g}..{MAX_LINK_GB_PER_S:g} GB/s"
        )
    return gb_per_s


def check_measured_link(h2d_gb_per_s: float, d2h_gb_per_s: float, source: str) -> None:
    """The one check of the link a `kvswap bench` report measured, shared by `plan`,
    `simulate` and `tune`: KvSwapError naming `source` when a direction is unusable
    (a report that measured 0 GB/s is well-formed JSON but no link to plan with)."""
    for direction, gb_per_s in (("h2d", h2d_gb_per_s), ("d2h", d2h_gb_per_s)):
        try:
            check_link_gb_per_s(gb_per_s, f"the measured {direction} link")
        except KvSwapError as error:
            raise KvSwapError(f"{source}: {error}; rerun `kvswap bench`") from None


def transfer_ms(num_bytes: int, gb_per_s: float) -> float:
    """Time one transfer holds a link of `gb_per_s` GB/s (1e9 bytes/s)."""
    return num_bytes / (gb_per_s * 1e9) * 1e3


def make_plan(inputs: PlanInputs) -> Plan:
    """Compute the bill and the seed article's warnings for one configuration."""
    check_link_gb_per_s(inputs.gpu_to_cpu_gb_per_s, "gpu_to_cpu_gb_per_s")
    check_link_gb_per_s(inputs.cpu_to_gpu_gb_per_s, "cpu_to_gpu_gb_per_s")
    if inputs.remote_gb_per_s is not None:
        check_link_gb_per_s(inputs.remote_gb_per_s, "remote_gb_per_s")
    shape = inputs.shape
    per_token = kv_bytes_per_token(shape, inputs.dtype)
    per_block = per_token * inputs.block_tokens
    blocks_per_request = blocks_for_tokens(inputs.context_tokens, inputs.block_tokens)
    per_request = blocks_per_request * per_block
    demand = per_request * inputs.concurrency
    warnings: list[str] = []

    weights_is_estimate = inputs.weights_bytes is None
    if inputs.weights_bytes is not None:
        weights = inputs.weights_bytes
    elif shape.num_params is not None:
        weights = shape.num_params * dtype_bytes(inputs.dtype)
    else:
        weights = 0
        warnings.append(
            f"the parameter count of {shape.name} is unknown, so weights count as 0 bytes; "
            "pass --weights-gib"
        )
    budget = max(0, inputs.gpu_mem_bytes - weights - inputs.reserve_bytes)
    if inputs.num_gpu_blocks is None:
        num_gpu_blocks = budget // per_block
    else:
        num_gpu_blocks = inputs.num_gpu_blocks
        if num_gpu_blocks * per_block > budget:
            warnings.append(
                f"gpu_kv_capacity_blocks = {num_gpu_blocks} needs "
                f"{format_bytes(num_gpu_blocks * per_block)} but the GPU has only "
                f"{format_bytes(budget)} left after weights and reserve"
            )
    gpu_bytes = num_gpu_blocks * per_block
    cpu_bytes = inputs.num_cpu_blocks * per_block
    nvme_bytes = inputs.num_nvme_blocks * per_block
    out_bytes = inputs.swap_out_chunk_blocks * per_block
    in_bytes = inputs.swap_in_chunk_blocks * per_block
    out_ms = transfer_ms(out_bytes, inputs.gpu_to_cpu_gb_per_s)
    in_ms = transfer_ms(in_bytes, inputs.cpu_to_gpu_gb_per_s)

    warnings += _chunk_warnings(
        "swap_out_chunk_blocks", inputs.swap_out_chunk_blocks, out_bytes, out_ms
    )
    warnings += _chunk_warnings(
        "swap_in_chunk_blocks", inputs.swap_in_chunk_blocks, in_bytes, in_ms
    )
    if inputs.swap_out_high_watermark >= 1.0:
        warnings.append(
            "swap_out_high_watermark = 1.0: swap-out starts only when the GPU pool is full, "
            "so new requests wait on a synchronous swap-out in the decode path; use ~0.85"
        )
    if demand > gpu_bytes + cpu_bytes + nvme_bytes:
        warnings.append(
            f"KV demand {format_bytes(demand)} exceeds every tier together "
            f"({format_bytes(gpu_bytes + cpu_bytes + nvme_bytes)}): requests will be rejected "
            "or recomputed; add capacity or lower context or concurrency"
        )
    elif demand > gpu_bytes + cpu_bytes:
        warnings.append(
            f"KV demand {format_bytes(demand)} exceeds GPU + CPU tiers "
            f"({format_bytes(gpu_bytes + cpu_bytes)}): the NVMe tier (~7 GB/s) will be on the path"
        )
    if weights_is_estimate and shape.num_params is not None:
        warnings.append(
            f"weights {format_bytes(weights)} is an estimate from the parameter count "
            f"({shape.num_params / 1e9:.2f}B x {dtype_bytes(inputs.dtype)} B); "
            "pass --weights-gib for the real figure"
        )
    if inputs.link_note:
        warnings.append(inputs.link_note)
    remote_fetch_ms = remote_write_ms = None
    if inputs.remote_gb_per_s is not None:
        remote_fetch_ms = round(transfer_ms(in_bytes, inputs.remote_gb_per_s), 4)
        remote_write_ms = round(transfer_ms(out_bytes, inputs.remote_gb_per_s), 4)

    return Plan(
        model=shape.name,
        dtype=inputs.dtype,
        block_tokens=inputs.block_tokens,
        context_tokens=inputs.context_tokens,
        concurrency=inputs.concurrency,
        kv_bytes_per_token=per_token,
        kv_bytes_per_block=per_block,
        blocks_per_request=blocks_per_request,
        kv_bytes_per_request=per_request,
        kv_demand_bytes=demand,
        weights_bytes=weights,
        weights_is_estimate=weights_is_estimate,
        gpu_mem_bytes=inputs.gpu_mem_bytes,
        reserve_bytes=inputs.reserve_bytes,
        gpu_kv_budget_bytes=budget,
        gpu_kv_capacity_blocks=num_gpu_blocks,
        cpu_kv_capacity_blocks=inputs.num_cpu_blocks,
        nvme_kv_capacity_blocks=inputs.num_nvme_blocks,
        gpu_kv_capacity_bytes=gpu_bytes,
        cpu_kv_capacity_bytes=cpu_bytes,
        nvme_kv_capacity_bytes=nvme_bytes,
        max_concurrency_gpu=num_gpu_blocks // blocks_per_request,
        max_concurrency_with_cpu=(num_gpu_blocks + inputs.num_cpu_blocks) // blocks_per_request,
        max_concurrency_all_tiers=(num_gpu_blocks + inputs.num_cpu_blocks + inputs.num_nvme_blocks)
        // blocks_per_request,
        gpu_to_cpu_gb_per_s=inputs.gpu_to_cpu_gb_per_s,
        cpu_to_gpu_gb_per_s=inputs.cpu_to_gpu_gb_per_s,
        swap_out_chunk_blocks=inputs.swap_out_chunk_blocks,
        swap_out_chunk_bytes=out_bytes,
        swap_out_chunk_ms=round(out_ms, 4),
        swap_in_chunk_blocks=inputs.swap_in_chunk_blocks,
        swap_in_chunk_bytes=in_bytes,
        swap_in_chunk_ms=round(in_ms, 4),
        remote_gb_per_s=inputs.remote_gb_per_s,
        remote_fetch_chunk_ms=remote_fetch_ms,
        remote_write_chunk_ms=remote_write_ms,
        warnings=warnings,
    )


def _chunk_warnings(name: str, num_blocks: int, num_bytes: int, ms: float) -> list[str]:
    if num_bytes > CHUNK_MAX_BYTES:
        return [
            f"{name} = {num_blocks} moves {format_bytes(num_bytes)} per transfer and holds the "
            f"link for {ms:.1f} ms; swap-ins queue behind it and P99 rises. Keep transfers "
            f"within 8-32 MiB ({math.ceil(CHUNK_MIN_BYTES / (num_bytes / num_blocks))}-"
            f"{max(1, CHUNK_MAX_BYTES // (num_bytes // num_blocks))} blocks here)"
        ]
    if num_bytes < CHUNK_MIN_BYTES:
        per_block = num_bytes // num_blocks
        low = math.ceil(CHUNK_MIN_BYTES / per_block)
        high = max(low, CHUNK_MAX_BYTES // per_block)
        return [
            f"{name} = {num_blocks} moves only {format_bytes(num_bytes)} per transfer; "
            f"per-transfer overhead lowers link throughput below ~8 MiB ({low}-{high} blocks here)"
        ]
    return []
