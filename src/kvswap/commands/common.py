"""Options shared by several commands: the config file, config fields as flags, model shape."""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from kvswap.config import FIELD_SECTIONS, KvSwapConfig, load_config
from kvswap.model.shapes import ModelShape, preset_shape, shape_from_hf_config

#: Flags whose names differ from the config field they set.
FLAG_ALIASES: dict[str, tuple[str, ...]] = {"kv_block_tokens": ("--block-tokens",)}
#: Fields given in bytes on the command line replace the same tier's count in blocks.
_BYTES_REPLACE_BLOCKS = {
    f"{tier}_kv_capacity_bytes": f"{tier}_kv_capacity_blocks" for tier in ("gpu", "cpu", "nvme")
}


def add_config_arguments(parser: argparse.ArgumentParser, sections: Iterable[str]) -> None:
    """--config FILE plus one `--field-name VALUE` flag per field of `sections`."""
    parser.add_argument("--config", metavar="FILE", help="TOML configuration file")
    wanted = set(sections)
    group = parser.add_argument_group("configuration overrides (win over --config and KVSWAP_*)")
    for field, section in FIELD_SECTIONS.items():
        if section not in wanted:
            continue
        flags = ("--" + field.replace("_", "-"), *FLAG_ALIASES.get(field, ()))
        group.add_argument(*flags, dest=f"cfg_{field}", metavar="VALUE", default=None)


def config_from_args(args: argparse.Namespace) -> KvSwapConfig:
    overrides = {
        name.removeprefix("cfg_"): value
        for name, value in vars(args).items()
        if name.startswith("cfg_") and value is not None
    }
    unset: list[str] = []
    for size, blocks in _BYTES_REPLACE_BLOCKS.items():
        if (size in overrides) != (blocks in overrides):
            unset.append(blocks if size in overrides else size)
    return load_config(args.config, overrides=overrides, unset=tuple(unset))


def shape_from_config(config: KvSwapConfig) -> ModelShape:
    """The [model] section's shape: `hf_config` when given, else `preset`."""
    if config.model.hf_config is not None:
        return shape_from_hf_config(config.model.hf_config)
    return preset_shape(config.model.preset or "article-8b")
