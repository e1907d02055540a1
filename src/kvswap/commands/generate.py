"""`kvswap generate`: one generation from a text prompt or a prompt of token ids."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvswap.commands.argument_text import utf8_text
from kvswap.commands.engine_flags import add_model_arguments, dtype_flag, model_flag
from kvswap.commands.run import engine_model
from kvswap.config_load import load_config
from kvswap.engine.settings import pick_device
from kvswap.errors import KvSwapError
from kvswap.model.generate import check_generation_length, generate_reference
from kvswap.model.loader import load_model, resolve_model
from kvswap.sampling import sampling_or_greedy
from kvswap.serve.tokenizer import load_text


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "generate",
        help="generate for one prompt, text or token ids (greedy or seeded sampling)",
    )
    add_model_arguments(parser, model_help="preset (tiny, small) or checkpoint dir (default tiny)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument(
        "--prompt", metavar="TEXT",
        help="a text prompt, tokenized by the model's tokenizer.json (a preset's: bytes); "
        "the output is printed as text",
    )  # fmt: skip
    prompt.add_argument("--prompt-ids", metavar="ID,ID,...", help="a prompt of token ids")
    parser.add_argument(
        "--max-new-tokens", type=int, default=16, metavar="N",
        help="tokens to generate (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto",
        help="where the model runs (default auto: CUDA when present)",
    )  # fmt: skip
    parser.add_argument("--temperature", type=float, default=None, help="sample (default greedy)")
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling's mass (0, 1]; 1: off"
    )
    parser.add_argument("--seed", type=int, default=0, help="the sampling's seed (default 0)")
    parser.add_argument(
        "--json", action="store_true", help='print {"output_ids": [...]} (and "text" for --prompt)'
    )
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
    model_name, dtype = engine_model(model_flag(args), dtype_flag(args), config, "tiny")
    if args.max_new_tokens < 1:
        raise KvSwapError(f"--max-new-tokens = {args.max_new_tokens}: must be >= 1")
    # Everything the flags alone can refuse is refused before the weights load.
    sampling = sampling_or_greedy(args.temperature, args.seed, args.top_p)
    device = pick_device(args.device)
    arch, _, _ = resolve_model(model_name, dtype)  # config only, no weights
    codec = None
    if args.prompt is not None:
        if not utf8_text(args.prompt, "--prompt").strip():
            raise KvSwapError("--prompt is empty; give some text")
        codec = load_text(model_name, arch.vocab_size)
        if codec is None:
            raise KvSwapError(
                f"--prompt: {model_name} has no tokenizer.json; give --prompt-ids instead"
            )
        prompt = codec.encode(args.prompt)
    else:
        prompt = parse_ids(args.prompt_ids, arch.vocab_size)
    check_generation_length(len(prompt), args.max_new_tokens, arch, name="--max-new-tokens")
    model, arch = load_model(
        model_name, dtype, device, batch_invariant=config.engine.batch_invariant
    )
    result = generate_reference(model, prompt, args.max_new_tokens, sampling=sampling)
    output_ids = list(result.token_ids)
    text = codec.decode(output_ids) if codec is not None else None
    if args.json:
        print(json.dumps({"output_ids": output_ids} | ({} if text is None else {"text": text})))
    elif text is not None:
        print(text)
    else:
        print(",".join(str(token) for token in output_ids))
    return 0
