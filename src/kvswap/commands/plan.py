"""`kvswap plan`: the memory bill for a model, a context length and a concurrency."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvswap.bench.report import link_gb_per_s, load_report
from kvswap.commands.common import add_config_arguments, config_from_args
from kvswap.errors import KvSwapError
from kvswap.ledger import DEFAULT_LINK_GB_PER_S, Plan, PlanInputs, kv_bytes_per_block, make_plan
from kvswap.model.presets import describe_model
from kvswap.units import GIB, format_bytes


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "plan",
        help="the KV memory bill: bytes per token/block/request, tier capacities, chunk times",
        description="Compute the KV cache bill for a model before deploying it.",
    )
    parser.add_argument("--context-tokens", type=int, default=4096, metavar="N")
    parser.add_argument("--concurrency", type=int, default=8, metavar="N")
    parser.add_argument("--gpu-mem-gib", type=float, default=40.0, metavar="GIB")
    parser.add_argument(
        "--weights-gib",
        type=float,
        default=None,
        metavar="GIB",
        help="model weights (default: estimated from the parameter count)",
    )
    parser.add_argument(
        "--reserve-gib",
        type=float,
        default=6.0,
        metavar="GIB",
        help="GPU memory kept for activations and buffers (default 6)",
    )
    parser.add_argument("--cpu-pool-gib", type=float, default=None, metavar="GIB")
    parser.add_argument("--nvme-gib", type=float, default=None, metavar="GIB")
    link = parser.add_mutually_exclusive_group()
    link.add_argument(
        "--link-gb-per-s",
        "--link-gbps",
        dest="link_gb_per_s",
        type=float,
        default=None,
        metavar="GB_PER_S",
        help=(
            f"host<->device bandwidth in GB/s, 1e9 bytes per second (default "
            f"{DEFAULT_LINK_GB_PER_S:g}, PCIe 4.0 x16 real); replaces --link-gbps"
        ),
    )
    link.add_argument(
        "--bench", metavar="FILE", help="take the bandwidth from `kvswap bench --out`"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_config_arguments(parser, ("model", "cache", "swap"))
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    for name in ("context_tokens", "concurrency"):
        if getattr(args, name) < 1:
            raise KvSwapError(f"--{name.replace('_', '-')} = {getattr(args, name)}: must be >= 1")
    for name in ("gpu_mem_gib", "weights_gib", "reserve_gib", "cpu_pool_gib", "nvme_gib"):
        value = getattr(args, name)
        if value is not None and value < 0:
            raise KvSwapError(f"--{name.replace('_', '-')} = {value}: must be >= 0")
    if args.link_gb_per_s is not None and args.link_gb_per_s <= 0:
        raise KvSwapError(f"--link-gb-per-s = {args.link_gb_per_s}: must be > 0")
    if args.cpu_pool_gib is not None:
        args.cfg_cpu_kv_capacity_bytes = int(args.cpu_pool_gib * GIB)
    if args.nvme_gib is not None:
        args.cfg_nvme_kv_capacity_bytes = int(args.nvme_gib * GIB)
    config = config_from_args(args)
    dtype = config.model.dtype
    shape = describe_model(config.model.preset, config.model.hf_config).with_kv_dtype(dtype)
    block_bytes = kv_bytes_per_block(shape, dtype, config.cache.kv_block_tokens)
    capacities = config.tier_capacities(block_bytes)
    d2h_gb_per_s = h2d_gb_per_s = args.link_gb_per_s or DEFAULT_LINK_GB_PER_S
    link_note = None
    if args.bench is not None:
        report = load_report(args.bench)
        d2h_gb_per_s, h2d_gb_per_s = link_gb_per_s(report, "d2h"), link_gb_per_s(report, "h2d")
        if report.device == "cpu":
            link_note = (
                f"{args.bench} was measured without a GPU: chunk times use host memory copy "
                "bandwidth, not PCIe"
            )
    plan = make_plan(
        PlanInputs(
            shape=shape,
            dtype=dtype,
            block_tokens=config.cache.kv_block_tokens,
            context_tokens=args.context_tokens,
            concurrency=args.concurrency,
            gpu_mem_bytes=int(args.gpu_mem_gib * GIB),
            reserve_bytes=int(args.reserve_gib * GIB),
            weights_bytes=None if args.weights_gib is None else int(args.weights_gib * GIB),
            num_gpu_blocks=capacities.num_gpu_blocks if capacities.gpu_is_configured else None,
            num_cpu_blocks=capacities.num_cpu_blocks,
            num_nvme_blocks=capacities.num_nvme_blocks,
            swap_out_chunk_blocks=config.swap.swap_out_chunk_blocks,
            swap_in_chunk_blocks=config.swap.swap_in_chunk_blocks,
            swap_out_high_watermark=config.swap.swap_out_high_watermark,
            gpu_to_cpu_gb_per_s=d2h_gb_per_s,
            cpu_to_gpu_gb_per_s=h2d_gb_per_s,
            link_note=link_note,
        )
    )
    print(json.dumps(plan.to_json_dict(), indent=2) if args.json else render(plan))
    return 0


def render(plan: Plan) -> str:
    """The bill as an aligned two-column table, then the warnings."""

    def size(num_bytes: int) -> str:
        return f"{format_bytes(num_bytes):>12}  ({num_bytes:,} B)"

    rows = [
        ("model", f"{plan.model} ({plan.dtype}, {plan.block_tokens}-token blocks)"),
        ("KV per token", size(plan.kv_bytes_per_token)),
        ("KV per block", size(plan.kv_bytes_per_block)),
        (f"KV per request ({plan.context_tokens:,} tokens)", size(plan.kv_bytes_per_request)),
        (f"KV demand (x {plan.concurrency} requests)", size(plan.kv_demand_bytes)),
        ("weights" + (" (estimate)" if plan.weights_is_estimate else ""), size(plan.weights_bytes)),
        ("GPU KV budget", size(plan.gpu_kv_budget_bytes)),
        (
            "GPU tier",
            f"{plan.gpu_kv_capacity_blocks:>12,} blocks  "
            f"{format_bytes(plan.gpu_kv_capacity_bytes)}",
        ),
        (
            "CPU tier (pinned)",
            f"{plan.cpu_kv_capacity_blocks:>12,} blocks  "
            f"{format_bytes(plan.cpu_kv_capacity_bytes)}",
        ),
        (
            "NVMe tier",
            f"{plan.nvme_kv_capacity_blocks:>12,} blocks  "
            f"{format_bytes(plan.nvme_kv_capacity_bytes)}",
        ),
        ("max concurrency, GPU only", f"{plan.max_concurrency_gpu:>12,} requests"),
        ("max concurrency, GPU + CPU", f"{plan.max_concurrency_with_cpu:>12,} requests"),
        ("max concurrency, all tiers", f"{plan.max_concurrency_all_tiers:>12,} requests"),
        (
            f"swap-out chunk ({plan.swap_out_chunk_blocks} blocks)",
            f"{format_bytes(plan.swap_out_chunk_bytes):>12}  {plan.swap_out_chunk_ms:.3f} ms "
            f"at {plan.gpu_to_cpu_gb_per_s:g} GB/s",
        ),
        (
            f"swap-in chunk ({plan.swap_in_chunk_blocks} blocks)",
            f"{format_bytes(plan.swap_in_chunk_bytes):>12}  {plan.swap_in_chunk_ms:.3f} ms "
            f"at {plan.cpu_to_gpu_gb_per_s:g} GB/s",
        ),
    ]
    width = max(len(label) for label, _ in rows)
    lines = [f"{label:<{width}}  {value}" for label, value in rows]
    lines += [f"warning: {text}" for text in plan.warnings]
    return "\n".join(lines)
