"""Options shared by several commands: the config file and config fields as flags."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Literal, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from kvswap.config import FIELD_SECTIONS, RENAMED_FIELDS, SWITCH_FIELDS, KvSwapConfig
from kvswap.config_load import load_config

#: Flags whose names differ from the config field they set.
FLAG_ALIASES: dict[str, tuple[str, ...]] = {
    "kv_block_tokens": ("--block-tokens", "--block-size"),  # --block-size: vLLM's name
}


def add_config_arguments(parser: argparse.ArgumentParser, sections: Iterable[str]) -> None:
    """--config FILE plus one `--field-name VALUE` flag per field of `sections`."""
    parser.add_argument("--config", metavar="FILE", help="TOML configuration file")
    wanted = set(sections)
    group = parser.add_argument_group("configuration overrides (win over --config and KVSWAP_*)")
    for field, section in FIELD_SECTIONS.items():
        if section not in wanted:
            continue
        old = [name for name, new in RENAMED_FIELDS.items() if new == field]
        flags = (
            _flag(field),
            *FLAG_ALIASES.get(field, ()),
            *(_flag(name) for name in old),
        )
        info = _field_info(field)
        help_text = info.description or ""
        if old:
            help_text += f" (replaces the seed's {', '.join(map(_flag, old))})"
        help_text = help_text.replace("%", "%%")  # argparse formats help with %
        if field in SWITCH_FIELDS:
            # A switch: `--batch-invariant` alone means true; `--batch-invariant false` works too.
            group.add_argument(
                *flags, dest=f"cfg_{field}", metavar="BOOL", nargs="?", const="true",
                default=None, help=help_text,
            )  # fmt: skip
            continue
        group.add_argument(
            *flags, dest=f"cfg_{field}", metavar=_metavar(field), default=None, help=help_text
        )


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _field_info(field: str) -> FieldInfo:
    section = KvSwapConfig.model_fields[FIELD_SECTIONS[field]].annotation
    assert isinstance(section, type) and issubclass(section, BaseModel)
    info: FieldInfo = section.model_fields[field]
    return info


def _metavar(field: str) -> str:
    """What a flag takes, by its field's type: N, X (a number), SIZE, one of a list."""
    annotation = _field_info(field).annotation
    kinds = {annotation, *get_args(annotation)} - {type(None)}
    choices = [arg for kind in kinds for arg in get_args(kind) if isinstance(arg, str)]
    if get_origin(annotation) is Literal or choices:
        return "{" + ",".join(choices or map(str, get_args(annotation))) + "}"
    if field.endswith("_bytes"):
        return "SIZE"
    if int in kinds:
        return "N"
    if float in kinds:
        return "X"
    if field.endswith("_dir"):
        return "DIR"
    if field.endswith("_tiers"):
        return "MODULE:FACTORY[,...]"
    return "URL" if field.endswith("_url") else "NAME"


def config_from_args(
    args: argparse.Namespace, defaults: dict[str, object] | None = None
) -> KvSwapConfig:
    overrides = {
        name.removeprefix("cfg_"): value
        for name, value in vars(args).items()
        if name.startswith("cfg_") and value is not None
    }
    return load_config(args.config, overrides=overrides, defaults=defaults)
