"""transformers' `generate` with kvswap's `TieredCache` vs `DynamicCache`, side by side.

A random-weight Llama (nothing downloaded) generates greedily twice from the same
prompt: with `DynamicCache` (every layer's KV on the device) and with
`TieredCache` holding a quarter of the final context's blocks on the device, the
rest paged to the pinned CPU pool, `--repeats` times each, alternated. Reported:
the median tokens/s of each and the ratio
(goal: >= 0.8), the bytes moved per direction, the cache's four numbers, and
that the tokens are identical (a ratio of runs that differ is no ratio).

    .venv/bin/python benchmarks/hf_cache.py --quick      # validation, a few seconds
    .venv/bin/python benchmarks/hf_cache.py --json

Timings on a shared machine are noise; take final figures on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict
from typing import Any

from kvswap.openmp_env import prefer_passive_openmp_wait

prefer_passive_openmp_wait()  # before torch loads, as the command line does
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

from kvswap.integrations.transformers import TieredCache  # noqa: E402
from machine import add_out_argument, keep_result  # noqa: E402 - a sibling script in benchmarks/

RESIDENT_SHARE = 0.25
GOAL = 0.8


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, for validation")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--block-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, alternated")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    for name in ("layers", "hidden", "prompt_tokens", "new_tokens", "batch", "block_tokens",
                 "threads", "repeats"):  # fmt: skip
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            parser.error(f"{flag} {getattr(args, name)}: allowed: >= 1")
    if args.quick:
        args.hidden, args.prompt_tokens, args.new_tokens = 128, 64, 16
        args.block_tokens = 8
    return args


def build_model(args: argparse.Namespace) -> Any:
    torch.manual_seed(0)
    heads = max(4, args.hidden // 64)
    config = transformers.LlamaConfig(
        vocab_size=4096, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75),
        num_hidden_layers=args.layers, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4), max_position_embeddings=8192,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval().to(args.device)


def timed_generate(model: Any, prompt: torch.Tensor, cache: Any, new_tokens: int) -> Any:
    start_s = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
            cache=cache,
        )  # fmt: skip
    return out, time.perf_counter() - start_s


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build_model(args)
    prompt = torch.randint(0, 4096, (args.batch, args.prompt_tokens)).to(args.device)
    context_tokens = args.prompt_tokens + args.new_tokens
    total_blocks = args.layers * args.batch * math.ceil(context_tokens / args.block_tokens)
    resident_blocks = math.ceil(RESIDENT_SHARE * total_blocks)
    timed_generate(model, prompt, transformers.DynamicCache(config=model.config), 2)  # warm-up
    dynamic_times, tiered_times = [], []
    for _ in range(args.repeats):  # alternated, so that a noisy minute hits both
        dynamic_out, dynamic_s = timed_generate(
            model, prompt, transformers.DynamicCache(config=model.config), args.new_tokens
        )
        dynamic_times.append(dynamic_s)
        with TieredCache(
            model, resident_blocks=resident_blocks, cpu_blocks=total_blocks,
            block_tokens=args.block_tokens,
        ) as cache:  # fmt: skip
            tiered_out, tiered_s = timed_generate(model, prompt, cache, args.new_tokens)
            report = cache.take_report()
        tiered_times.append(tiered_s)
    dynamic_s, tiered_s = statistics.median(dynamic_times), statistics.median(tiered_times)
    if not torch.equal(dynamic_out, tiered_out):
        print("FAILED: TieredCache's tokens differ from DynamicCache's", file=sys.stderr)
        return 1
    tokens = args.batch * args.new_tokens
    ratio = dynamic_s / tiered_s
    result = {
        "shape": {
            "layers": args.layers, "hidden": args.hidden, "batch": args.batch,
            "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
            "block_tokens": args.block_tokens, "total_blocks": total_blocks,
            "resident_blocks": resident_blocks, "device": args.device, "threads": args.threads,
        },
        "dynamic_tok_per_s": round(tokens / dynamic_s, 2),
        "tiered_tok_per_s": round(tokens / tiered_s, 2),
        "tiered_over_dynamic": round(ratio, 3),
        "goal": GOAL,
        "report": asdict(report),
    }  # fmt: skip
    keep_result(args.out, "hf_cache", "hf_cache.py", argv, result)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    shape = result["shape"]
    print(f"model: {shape}")
    print(
        f"DynamicCache {result['dynamic_tok_per_s']} tok/s, TieredCache "
        f"{result['tiered_tok_per_s']} tok/s with {resident_blocks}/{total_blocks} blocks "
        f"resident: ratio {ratio:.3f} (goal >= {GOAL})"
    )
    moved = {d: n for d, n in report.bytes_by_direction.items() if n}
    print(f"bytes moved: {moved}")
    print(*report.lines(), sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
