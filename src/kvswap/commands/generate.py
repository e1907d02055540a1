"""`kvswap generate`: one generation from a prompt of token ids."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvswap.engine.engine import pick_device
from kvswap.errors import KvSwapError
from kvswap.model.generate import SamplingParams, generate_reference
from kvswap.model.loader import load_model


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "generate",
        help="generate tokens for one prompt of token ids (greedy or seeded sampling)",
    )
    parser.add_argument("--model", default="tiny", help="preset (tiny, small) or checkpoint dir")
    parser.add_argument("--prompt-ids", required=True, metavar="ID,ID,...")
    parser.add_argument("--max-new-tokens", type=int, default=16, metavar="N")
    parser.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default=None)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--temperature", type=float, default=None, help="sample (default greedy)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help='print {"output_ids": [...]}')
    parser.set_defaults(handler=run)


def parse_ids(text: str, vocab_size: int) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise KvSwapError(
            f"--prompt-ids = {text!r}: expected comma-separated token ids such as 1,2,3"
        ) from None
    if not ids:
        raise KvSwapError("--prompt-ids is empty; give at least one token id")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise KvSwapError(
            f"--prompt-ids: {bad[0]} is outside the model's vocabulary [0, {vocab_size})"
        )
    return ids


def run(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1:
        raise KvSwapError(f"--max-new-tokens = {args.max_new_tokens}: must be >= 1")
    model, arch = load_model(args.model, args.dtype, pick_device(args.device))
    prompt = parse_ids(args.prompt_ids, arch.vocab_size)
    sampling = None
    if args.temperature is not None:
        sampling = SamplingParams(temperature=args.temperature, seed=args.seed, top_p=args.top_p)
    result = generate_reference(model, prompt, args.max_new_tokens, sampling=sampling)
    if args.json:
        print(json.dumps({"output_ids": list(result.token_ids)}))
    else:
        print(",".join(str(token) for token in result.token_ids))
    return 0
