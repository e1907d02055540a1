"""`kvswap checkpoint`: a built-in preset saved as a checkpoint directory vLLM and SGLang load."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvswap.model.presets import ENGINE_PRESET_NAMES
from kvswap.serve.checkpoint_writer import write_checkpoint


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "checkpoint",
        help="save a built-in random-weight model (tiny, small) as a Hugging Face checkpoint "
        "with its tokenizer, to try kvswap inside vLLM, SGLang or transformers",
    )
    parser.add_argument("preset", choices=ENGINE_PRESET_NAMES, help="the built-in model")
    parser.add_argument("directory", type=Path, help="where to write it (new or empty)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    files = write_checkpoint(args.preset, args.directory)
    total_bytes = sum(path.stat().st_size for path in files)
    print(f"kvswap checkpoint: wrote {args.preset} to {args.directory} "
          f"({len(files)} files, {total_bytes / 2**20:.1f} MiB)")  # fmt: skip
    return 0
