"""`kvswap generate`: one generation from a prompt of token ids."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvswap.commands.run import engine_model
from kvswap.config import load_config
from kvswap.engine.engine import pick_device
from kvswap.errors import KvSwapError
from kvswap.model.choice import ENGINE_DTYPES
from kvswap.model.generate import check_generation_length, generate_reference
from kvswap.model.loader import load_model, resolve_model
from kvswap.sampling import sampling_or_greedy


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "generate",
        help="generate tokens for one prompt of token ids (greedy or seeded sampling)",
    )
    parser.add_argument(
        "--model", default=None, help="preset (tiny, small) or checkpoint dir (default tiny)"
    )
    parser.add_argument("--prompt-ids", required=True, metavar="ID,ID,...")
    parser.add_argument("--max-new-tokens", type=int, default=16, metavar="N")
    parser.add_argument("--dtype", choices=ENGINE_DTYPES, default=None)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--temperature", type=float, default=None, help="sample (default greedy)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help='print {"output_ids": [...]}')
    # The engine's [engine] batch_invariant field (KVSWAP_BATCH_INVARIANT too), as in `run`.
    parser.add_argument(
        "--batch-invariant", metavar="BOOL", nargs="?", const="true", default=None,
        help="exact mode: fixed tiles, bit-identical however the prompt is chunked",
    )  # fmt: skip
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
    # KVSWAP_* variables apply here as everywhere (an unknown one is an error), and
    # [model] preset/dtype set by them name the model when the flags do not.
    config = load_config(overrides={"batch_invariant": args.batch_invariant})
    model_name, dtype = engine_model(args, config, default_model="tiny")
    if args.max_new_tokens < 1:
        raise KvSwapError(f"--max-new-tokens = {args.max_new_tokens}: must be >= 1")
    # Everything the flags alone can refuse is refused before the weights load.
    sampling = sampling_or_greedy(args.temperature, args.seed, args.top_p)
    device = pick_device(args.device)
    arch, _, _ = resolve_model(model_name, dtype)  # config only, no weights
    prompt = parse_ids(args.prompt_ids, arch.vocab_size)
    check_generation_length(len(prompt), args.max_new_tokens, arch, name="--max-new-tokens")
    model, arch = load_model(
        model_name, dtype, device, batch_invariant=config.engine.batch_invariant
    )
    result = generate_reference(model, prompt, args.max_new_tokens, sampling=sampling)
    if args.json:
        print(json.dumps({"output_ids": list(result.token_ids)}))
    else:
        print(",".join(str(token) for token in result.token_ids))
    return 0
