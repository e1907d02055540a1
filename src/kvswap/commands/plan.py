"""`kvswap plan`: the memory bill for a model, a context length and a concurrency."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from kvswap.bench.report import link_gb_per_s, load_report
from kvswap.commands.common import add_config_arguments, config_from_args
from kvswap.config import KvSwapConfig
from kvswap.config_capacities import validate_capacities
from kvswap.errors import KvSwapError
from kvswap.ledger import (
    DEFAULT_LINK_GB_PER_S,
    Plan,
    PlanInputs,
    check_link_gb_per_s,
    check_measured_link,
    kv_bytes_per_block,
    make_plan,
)
from kvswap.model.presets import describe_model
from kvswap.units import format_bytes, gib_to_bytes

#: Upper bounds of the count flags, so that the bill stays a finite float: a 1 G-token
#: context and a million concurrent requests are past any deployment a plan is for.
MAX_CONTEXT_TOKENS = 2**30
MAX_CONCURRENCY = 2**20
DEFAULT_GPU_MEM_GIB = 40.0


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "plan",
        help="the KV memory bill: bytes per token/block/request, tier capacities, chunk times",
        description="Compute the KV cache bill for a model before deploying it.",
    )
    parser.add_argument(
        "--context-tokens", type=int, default=4096, metavar="N",
        help="tokens of one request's context (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--concurrency", type=int, default=8, metavar="N",
        help="requests held at once (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--gpu-mem-gib", type=float, default=DEFAULT_GPU_MEM_GIB, metavar="GIB",
        help="the GPU's memory (default 40, the seed's card); the bill states it",
    )  # fmt: skip
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
    parser.add_argument(
        "--cpu-pool-gib", type=float, default=None, metavar="GIB",
        help="the pinned CPU tier, GiB (or --cpu-kv-capacity-bytes)",
    )  # fmt: skip
    parser.add_argument(
        "--nvme-gib", type=float, default=None, metavar="GIB",
        help="the NVMe tier, GiB (or --nvme-kv-capacity-bytes)",
    )  # fmt: skip
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
    parser.add_argument(
        "--remote-gb-per-s",
        type=float,
        default=None,
        metavar="GB_PER_S",
        help="bandwidth to a shared remote store (Redis), GB/s: shows a chunk's time over it",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_config_arguments(parser, ("model", "cache", "swap"))
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    _check_count("--context-tokens", args.context_tokens, MAX_CONTEXT_TOKENS)
    _check_count("--concurrency", args.concurrency, MAX_CONCURRENCY)
    gpu_mem_bytes = gib_to_bytes(args.gpu_mem_gib, "--gpu-mem-gib")
    reserve_bytes = gib_to_bytes(args.reserve_gib, "--reserve-gib")
    weights_bytes = _optional_gib(args.weights_gib, "--weights-gib")
    cpu_pool_bytes = _optional_gib(args.cpu_pool_gib, "--cpu-pool-gib")
    nvme_bytes = _optional_gib(args.nvme_gib, "--nvme-gib")
    if args.link_gb_per_s is not None:
        check_link_gb_per_s(args.link_gb_per_s, "--link-gb-per-s")
    if args.remote_gb_per_s is not None:
        check_link_gb_per_s(args.remote_gb_per_s, "--remote-gb-per-s")
    if cpu_pool_bytes is not None:
        args.cfg_cpu_kv_capacity_bytes = cpu_pool_bytes
    if nvme_bytes is not None:
        args.cfg_nvme_kv_capacity_bytes = nvme_bytes
    config = config_from_args(args)
    described = describe_model(config.model.preset, config.model.hf_config)
    dtype, dtype_source = _kv_dtype(config, described.checkpoint_dtype)
    shape = described.with_kv_dtype(dtype)
    block_bytes = kv_bytes_per_block(shape, dtype, config.cache.kv_block_tokens)
    # A plan makes no slab, so an NVMe tier needs no directory here (plan has no --nvme-dir).
    capacities = config.tier_capacities(block_bytes, slab_needed=False)
    d2h_gb_per_s = h2d_gb_per_s = args.link_gb_per_s or DEFAULT_LINK_GB_PER_S
    link_note = None
    if args.bench is not None:
        report = load_report(args.bench)
        d2h_gb_per_s, h2d_gb_per_s = link_gb_per_s(report, "d2h"), link_gb_per_s(report, "h2d")
        check_measured_link(h2d_gb_per_s, d2h_gb_per_s, args.bench)
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
            gpu_mem_bytes=gpu_mem_bytes,
            reserve_bytes=reserve_bytes,
            weights_bytes=weights_bytes,
            num_gpu_blocks=capacities.num_gpu_blocks if capacities.gpu_is_configured else None,
            num_cpu_blocks=capacities.num_cpu_blocks,
            num_nvme_blocks=capacities.num_nvme_blocks,
            swap_out_chunk_blocks=config.swap.swap_out_chunk_blocks,
            swap_in_chunk_blocks=config.swap.swap_in_chunk_blocks,
            swap_out_high_watermark=config.swap.swap_out_high_watermark,
            gpu_to_cpu_gb_per_s=d2h_gb_per_s,
            cpu_to_gpu_gb_per_s=h2d_gb_per_s,
            link_note=link_note,
            remote_gb_per_s=args.remote_gb_per_s,
        )
    )
    if not capacities.gpu_is_configured:
        # The GPU tier came from the GPU's size: hold it to the rules a configured one
        # meets (protected blocks and chunks vs the tier), as `simulate` does.
        derived = dataclasses.replace(capacities, num_gpu_blocks=plan.gpu_kv_capacity_blocks)
        validate_capacities(config.sized_rules(), derived, slab_needed=False)
    # allow_nan=False: NaN and Infinity are not JSON; the checks above keep them out, and
    # should one slip through this fails rather than print what no JSON reader takes.
    assumptions = {
        "gpu_mem_bytes": gpu_mem_bytes,
        "gpu_mem_source": "--gpu-mem-gib" if args.gpu_mem_gib != DEFAULT_GPU_MEM_GIB
        else "the default, the seed's card; --gpu-mem-gib to change",
        "dtype": dtype,
        "dtype_source": dtype_source,
        "link_source": "--bench" if args.bench is not None else "--link-gb-per-s"
        if args.link_gb_per_s is not None
        else "the default; --link-gb-per-s or --bench FILE to change",
    }  # fmt: skip
    if args.json:
        print(json.dumps({**plan.to_json_dict(), "assumptions": assumptions}, indent=2,
                         allow_nan=False))  # fmt: skip
    else:
        print(render(plan))
        print(
            f"assumed: a {format_bytes(gpu_mem_bytes)} GPU ({assumptions['gpu_mem_source']}); "
            f"KV in {dtype} ({dtype_source}); links at {d2h_gb_per_s:g} / {h2d_gb_per_s:g} GB/s "
            f"out / in ({assumptions['link_source']})"
        )
    return 0


def _kv_dtype(config: KvSwapConfig, checkpoint_dtype: str | None) -> tuple[str, str]:
    """The dtype of the KV to bill, and where it came from: [model] dtype when set (a
    flag, a file, KVSWAP_DTYPE), else the checkpoint's torch_dtype / dtype, else fp16."""
    if "dtype" in config.model.model_fields_set:
        return config.model.dtype, "--dtype / [model] dtype"
    if config.model.hf_config is not None and checkpoint_dtype is not None:
        return checkpoint_dtype, "config.json's torch_dtype"
    return config.model.dtype, "the default; --dtype to change"


def _optional_gib(value: float | None, flag: str) -> int | None:
    return None if value is None else gib_to_bytes(value, flag)


def _check_count(flag: str, value: int, maximum: int) -> None:
    if not 1 <= value <= maximum:
        raise KvSwapError(f"{flag} = {value}: allowed: 1..{maximum}")


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
    if plan.remote_gb_per_s is not None:
        remote = f"at {plan.remote_gb_per_s:g} GB/s (remote link)"
        rows += [
            (
                f"remote fetch chunk ({plan.swap_in_chunk_blocks} blocks)",
                f"{format_bytes(plan.swap_in_chunk_bytes):>12}  "
                f"{plan.remote_fetch_chunk_ms:.3f} ms {remote}",
            ),
            (
                f"remote write chunk ({plan.swap_out_chunk_blocks} blocks)",
                f"{format_bytes(plan.swap_out_chunk_bytes):>12}  "
                f"{plan.remote_write_chunk_ms:.3f} ms {remote}",
            ),
        ]
    width = max(len(label) for label, _ in rows)
    lines = [f"{label:<{width}}  {value}" for label, value in rows]
    lines += [f"warning: {text}" for text in plan.warnings]
    return "\n".join(lines)
