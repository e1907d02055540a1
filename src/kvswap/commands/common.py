"""Options shared by several commands: the config file, config fields as flags, model shape."""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from kvswap.config import FIELD_SECTIONS, KvSwapConfig, load_config
from kvswap.model.shapes import ModelShape, preset_shape, shape_from_hf_config

#: Flags whose names differ from the config field they set.
FLAG_ALIASES: dict[str, tuple[str, ...]] = {"kv_block_tokens": ("--block-tokens",)}


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


def config_from_args(
    args: argparse.Namespace, defaults: dict[str, object] | None = None
) -> KvSwapConfig:
    overrides = {
        name.removeprefix("cfg_"): value
        for name, value in vars(args).items()
        if name.startswith("cfg_") and value is not None
    }
    return load_config(args.config, overrides=overrides, defaults=defaults)


def shape_from_config(config: KvSwapConfig) -> ModelShape:
    """The [model] section's shape: `hf_config` when given, else `preset`."""
    if config.model.hf_config is not None:
        return shape_from_hf_config(config.model.hf_config)
    return preset_shape(config.model.preset or "article-8b")
