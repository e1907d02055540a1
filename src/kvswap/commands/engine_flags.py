"""The engine's model flags, as vLLM users type them.

    kvswap serve MODEL | --model MODEL     a preset (tiny, small) or a checkpoint dir
    --dtype auto|half|float16|bfloat16|float|float32|fp16|bf16|fp32
    --max-model-len N                      prompt + output of one request, at most
    --gpu-memory-utilization F             the device tier: F x the device's memory
                                           less the weights (with --block-size N)
    --enable-prefix-caching                always on here; --no-enable-prefix-caching
                                           is refused with the reason

vLLM flags with no meaning in kvswap are accepted only where nothing changes
(`--enforce-eager`, `--trust-remote-code`, `--tensor-parallel-size 1`): one
note on stderr. The others stop with one line naming what to use instead.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from kvswap.engine.settings import check_model_len
from kvswap.errors import KvSwapError
from kvswap.model.choice import ENGINE_DTYPES
from kvswap.model.dtypes import normalise_dtype


@dataclass(frozen=True)
class _Unused:
    """A vLLM flag kvswap has no use for: `note` when giving it changes nothing here
    (at `neutral`, when it takes a value), else the reason it is refused."""

    takes_value: bool
    reason: str
    neutral: str | None = None  # the value that changes nothing ("1"); None: any


UNUSED_VLLM_FLAGS: dict[str, _Unused] = {
    "--enforce-eager": _Unused(False, "kvswap's engine runs eagerly (no CUDA graphs)", ""),
    "--trust-remote-code": _Unused(
        False, "kvswap runs Llama-family checkpoints with its own code; none is downloaded", ""
    ),
    "--tensor-parallel-size": _Unused(
        True,
        "one kvswap engine runs on one device; run one per device and share "
        "a remote tier (--remote-url)",
        "1",
    ),
    "--pipeline-parallel-size": _Unused(
        True, "one kvswap engine runs on one device; run one per device", "1"
    ),
    "--swap-space": _Unused(
        True, "the pinned CPU tier is sized by --cpu-kv-capacity-bytes (e.g. 4GiB)"
    ),
    "--cpu-offload-gb": _Unused(
        True, "kvswap offloads KV, not weights; size the CPU tier with --cpu-kv-capacity-bytes"
    ),
    "--kv-cache-dtype": _Unused(True, "the KV is held in the weights' dtype (--dtype)", "auto"),
    "--quantization": _Unused(True, "kvswap runs unquantized fp32/bf16/fp16 checkpoints"),
    "--tokenizer": _Unused(True, "the tokenizer is the checkpoint's tokenizer.json"),
    "--download-dir": _Unused(True, "kvswap never downloads; give a local checkpoint directory"),
    "--revision": _Unused(True, "kvswap never downloads; give a local checkpoint directory"),
}


def add_model_arguments(parser: argparse.ArgumentParser, *, model_help: str) -> None:
    """MODEL (positional, as `vllm serve MODEL`) or --model, and --dtype."""
    parser.add_argument("model_positional", nargs="?", metavar="MODEL", help=model_help)
    parser.add_argument("--model", default=None, help="the same as MODEL")
    parser.add_argument(
        "--dtype", type=_dtype, default=None, metavar="{auto," + ",".join(ENGINE_DTYPES) + "}",
        help="weights and KV dtype; vLLM's names work too (half, bfloat16, float32); "
        "auto or unset: the checkpoint's own",
    )  # fmt: skip


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's common engine flags, mapped onto kvswap's settings or explained."""
    group = parser.add_argument_group("vLLM's flags")
    group.add_argument(
        "--max-model-len", type=int, default=None, metavar="N",
        help="prompt + output tokens of one request, at most (default: the model's "
        "maximum position; longer requests get 400)",
    )  # fmt: skip
    group.add_argument(
        "--gpu-memory-utilization", type=float, default=None, metavar="F",
        help="size the device tier as F (0..1] of the device's memory less the weights "
        "(CUDA: the GPU's memory; CPU: the host memory this process may allocate)",
    )  # fmt: skip
    group.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
        help="prefix caching is always on in kvswap (blocks are shared by their key)",
    )  # fmt: skip
    for flag, unused in UNUSED_VLLM_FLAGS.items():
        dest = "unused_" + flag.removeprefix("--").replace("-", "_")
        if unused.takes_value:
            group.add_argument(flag, dest=dest, default=None, metavar="V", help=unused.reason)
        else:
            group.add_argument(flag, dest=dest, action="store_const", const="", help=unused.reason)


def model_flag(args: argparse.Namespace) -> str | None:
    """The model given as MODEL or --model (both: they must agree)."""
    positional: str | None = args.model_positional
    flag: str | None = args.model
    if positional is not None and flag is not None and positional != flag:
        raise KvSwapError(
            f"the model is given twice: MODEL {positional!r} and --model {flag!r}; give one"
        )
    return positional if positional is not None else flag


def check_vllm_arguments(args: argparse.Namespace) -> None:
    """Refuse, in one line, a vLLM flag that cannot mean here what it means in vLLM;
    note on stderr one that changes nothing."""
    if args.enable_prefix_caching is False:
        raise KvSwapError(
            "--no-enable-prefix-caching: kvswap always shares a prefix's KV between requests "
            "(a block is found by the key of its tokens); use a per-request cache_salt to "
            "keep tenants apart"
        )
    if args.max_model_len is not None:
        check_model_len(args.max_model_len)
    utilization = args.gpu_memory_utilization
    if utilization is not None and not 0.0 < utilization <= 1.0:
        raise KvSwapError(f"--gpu-memory-utilization {utilization}: allowed: 0 < F <= 1")
    for flag, unused in UNUSED_VLLM_FLAGS.items():
        value = getattr(args, "unused_" + flag.removeprefix("--").replace("-", "_"))
        if value is None:
            continue
        if unused.neutral is not None and value == unused.neutral:
            shown = f"{flag} {value}" if value else flag
            print(f"kvswap: note: {shown} changes nothing here: {unused.reason}", file=sys.stderr)
            continue
        raise KvSwapError(f"{flag} {value}: not a kvswap setting: {unused.reason}".strip())


def _dtype(text: str) -> str:
    """--dtype's value in kvswap's spelling (vLLM's "half", "bfloat16", ... too);
    "auto": the checkpoint's own."""
    if text == "auto":
        return text
    allowed = f"auto, {', '.join(ENGINE_DTYPES)} (or half, float16, bfloat16, float, float32)"
    try:
        name = normalise_dtype(text)
    except KvSwapError:
        raise argparse.ArgumentTypeError(f"{text!r}; allowed: {allowed}") from None
    if name not in ENGINE_DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r}: the engine computes in {allowed}")
    return name


def dtype_flag(args: argparse.Namespace) -> str | None:
    """--dtype as kvswap names it; None for unset or auto (the checkpoint's own)."""
    value: str | None = args.dtype
    return None if value in (None, "auto") else value
