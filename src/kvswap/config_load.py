"""Reading the configuration: layers (defaults, a TOML file, `KVSWAP_*` variables,
flags, or another engine's mapping) validated into one `KvSwapConfig`, and the one-line
errors that name what was wrong, where it came from and what is allowed.

    config = load_config("kvswap.toml", overrides={"cpu_kv_capacity_bytes": "64GiB"})
    config = config_from_values(vllm_extra_config, "kv_connector_extra_config")
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_args

from pydantic import ValidationError

from kvswap.config import (
    CAPACITY_TWINS,
    ENV_PREFIX,
    FIELD_SECTIONS,
    FIELD_SPELLINGS,
    SECTION_MODELS,
    KvSwapConfig,
)
from kvswap.config_sources import read_toml, source_values
from kvswap.errors import ConfigError
from kvswap.redact import redact_url


def suggest(name: str, choices: list[str] | tuple[str, ...]) -> str:
    """' (did you mean X?)' for the closest valid name, or ''."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


_DEFAULTS_LAYER = "command defaults"


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    overrides: Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
    defaults: Mapping[str, object] | None = None,
) -> KvSwapConfig:
    """Defaults <- TOML file <- KVSWAP_* environment <- `overrides` (CLI flags), validated once.

    `overrides` maps field names to values; None values are ignored so that
    unset CLI flags do not clobber the file. A tier capacity set in one unit
    (blocks or bytes) replaces the same tier's capacity from a lower layer in the
    other unit. `defaults` are a command's own defaults, below the file.
    """
    layers: list[tuple[str, dict[str, Any]]] = []
    if defaults:
        layers.append((_DEFAULTS_LAYER, dict(defaults)))
    if path is not None:
        layers.append((str(path), read_toml(Path(path))))
    env_values = source_values(
        environ if environ is not None else os.environ, ENV_PREFIX, FIELD_SPELLINGS
    )
    if env_values:
        layers.append(("environment", env_values))
    if overrides:
        layers.append(("command line", {k: v for k, v in overrides.items() if v is not None}))
    return _validated(layers)


def config_from_values(values: Mapping[str, object], source: str) -> KvSwapConfig:
    """Defaults <- `values` (field names, old spellings included), validated as
    `load_config` validates; an error names `source` ("kv_connector_extra_config"
    for vLLM's adapter), not a file or a flag. No environment is read.

    Strict about types: these values arrive typed (JSON, Python), so "8" for a count
    or 1 for a switch is a mistake refused by name, not read as 8 or true as a
    TOML file's or an environment variable's text is."""
    return _validated([(source, dict(values))], strict=True)


def _validated(layers: list[tuple[str, dict[str, Any]]], *, strict: bool = False) -> KvSwapConfig:
    """`layers` (lowest first) merged field by field, then validated once; `strict`:
    no value is converted from another type (pydantic's strict mode)."""
    origin_names: dict[str, str] = {}
    merged: dict[str, dict[str, Any]] = {section: {} for section in SECTION_MODELS}
    origin: dict[str, str] = {}
    for source, values in layers:
        flat = _flatten(values, source, origin_names)
        for key, value in flat.items():
            twin = CAPACITY_TWINS.get(key)
            if twin is not None and twin not in flat:
                merged["cache"].pop(twin, None)
            merged[FIELD_SECTIONS[key]][key] = value
            origin[key] = source
    try:
        config = KvSwapConfig.model_validate(merged, strict=strict)
    except ValidationError as error:
        raise ConfigError(_one_line(error, origin, origin_names, strict=strict)) from None
    _check_nvme_dir_has_a_tier(config, origin, [source for source, _ in layers])
    return config


def _check_nvme_dir_has_a_tier(
    config: KvSwapConfig, origin: Mapping[str, str], layer_order: list[str]
) -> None:
    """An nvme_dir without an NVMe capacity would be ignored without a word (the slab is
    never made, a missing directory never noticed): refused in one line. Allowed: a
    directory that only a command's defaults name, and a tier turned off (capacity 0)
    in a later layer than the one naming the directory (`--config x.toml
    --nvme-kv-capacity-blocks 0`: the file's directory, deliberately unused)."""
    nvme_dir = config.tiers.nvme_dir
    dir_source = origin.get("nvme_dir")
    if nvme_dir is None or dir_source is None or dir_source == _DEFAULTS_LAYER:
        return
    cache = config.cache
    if cache.nvme_kv_capacity_blocks or cache.nvme_kv_capacity_bytes:
        return
    in_bytes = cache.nvme_kv_capacity_bytes is not None
    field = "nvme_kv_capacity_bytes" if in_bytes else "nvme_kv_capacity_blocks"
    capacity_source = origin.get(field)
    if capacity_source is not None and layer_order.index(capacity_source) > layer_order.index(
        dir_source
    ):
        return
    value = getattr(cache, field)
    shown = "unset" if value is None else str(value)
    raise ConfigError(
        f"nvme_dir = {nvme_dir!r} (from {dir_source}) is set but {field} is {shown}: no "
        "NVMe tier uses it; allowed: an NVMe capacity > 0 with it (--nvme-kv-capacity-blocks "
        "N or nvme_kv_capacity_bytes), or no nvme_dir (drop --nvme-dir)"
    )


def _flatten(values: dict[str, Any], source: str, spelled: dict[str, str]) -> dict[str, Any]:
    """Accept both `[section] key = v` and top-level `key = v`, old names included
    (`spelled` records field -> the name the user wrote); reject unknown names."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if key in SECTION_MODELS and not isinstance(value, dict):
            # A section name with a plain value (`model = "x"`): say it is a section, not
            # "unknown key 'model' (did you mean 'model'?)".
            raise ConfigError(
                f"{source}: {key!r} is a section, not a setting: {key} = {value!r} is not "
                f"allowed; write [{key}] and its keys "
                f"({', '.join(SECTION_MODELS[key].model_fields)})"
            )
        if key in SECTION_MODELS and isinstance(value, dict):
            valid = list(SECTION_MODELS[key].model_fields)
            for inner_key, inner_value in value.items():
                field = FIELD_SPELLINGS.get(inner_key)
                if field not in valid:
                    raise ConfigError(
                        f"{source}: unknown key {key}.{inner_key!r}{suggest(inner_key, valid)}; "
                        f"[{key}] allows: {', '.join(valid)}"
                    )
                flat[field] = inner_value
                spelled[field] = inner_key
        elif key in FIELD_SPELLINGS:
            flat[FIELD_SPELLINGS[key]] = value
            spelled[FIELD_SPELLINGS[key]] = key
        else:
            known = list(FIELD_SECTIONS) + list(SECTION_MODELS)
            raise ConfigError(f"{source}: unknown key {key!r}{suggest(key, known)}")
    return flat


#: pydantic's error types for a value of the wrong type (strict mode converts none).
_STRICT_TYPES = frozenset({"int_type", "float_type", "bool_type", "string_type"})
_TYPE_WORDS: dict[object, str] = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
}


def _field_types(field: str) -> str:
    """The types `field` takes, in words ("an integer", "an integer or a string")."""
    section = FIELD_SECTIONS.get(field)
    if section is None:
        return "a value of the field's type"
    annotation = SECTION_MODELS[section].model_fields[field].annotation
    kinds = get_args(annotation) or (annotation,)
    return " or ".join(_TYPE_WORDS[kind] for kind in kinds if kind in _TYPE_WORDS)


def _one_line(
    error: ValidationError,
    origin: Mapping[str, str],
    spelled: Mapping[str, str],
    *,
    strict: bool = False,
) -> str:
    first = error.errors()[0]
    loc = [str(part) for part in first["loc"]]
    field = next((part for part in reversed(loc) if part in FIELD_SECTIONS), ".".join(loc))
    message = str(first["msg"]).removeprefix("Value error, ")
    if strict and first["type"] in _STRICT_TYPES:
        given = type(first.get("input")).__name__
        message = f"wrong type ({given}); allowed: {_field_types(field)}"
    elif first["type"] in ("bool_parsing", "bool_type"):
        message += "; allowed: true, false (or 1/0, yes/no, on/off)"
    if field not in FIELD_SECTIONS:
        return message
    where = f" (from {origin[field]})" if field in origin else ""
    value = first.get("input")
    if field == "remote_url" and isinstance(value, str):
        value = redact_url(value)  # a password never reaches a message
    name = spelled.get(field, field)
    shown = field if name == field else f"{name} (now {field})"
    # A 400-digit number stays one readable line: show its first 60 characters.
    return f"{shown} = {value!r:.60}{where}: {message}"
