"""Eviction policies by name: what `gpu_eviction_policy` / `cpu_eviction_policy` /
`nvme_eviction_policy` accept, and the factory the store builds its policies with.

    "kvswap"                    kvswap's ranked LRU (policy_kvswap.py): the GPU rank
                                table on the GPU, the lower-tier one below it
    "lru"                       plain LRU (policy_lru.py)
    "arc"                       ARC as vLLM runs it (policy_arc.py): recency and
                                frequency lists, ghost lists, an adaptive target
    "reuse"                     the copy whose next use is furthest away leaves first
                                (policy_reuse.py): dead copies, then copies used
                                once (newest first), then reused ones by prediction
    "package.module:ClassName"  a user's `EvictionPolicy` subclass, built as
                                `ClassName(tier, options)`
    NAME(key=value, ...)        any of these with the parameters its class declares
                                (`EvictionPolicy.PARAMETERS`): "reuse(once=oldest)"

"kvswap" names one of two rank tables: the top tier's (sinks, residency, cost
ranks: the GPU in kvswap's engine, and the host tier inside vLLM, whose device
pool vLLM ranks itself) or the one for the tiers below it. The builder says
which (`top`), and gives the policy the size of its tier (`capacity_blocks`).

An unknown name, a failed import, a class that is not an `EvictionPolicy`, or a
parameter the class does not take or cannot read is a `ConfigError` in one line
naming the field, the value and what is allowed.
"""

from __future__ import annotations

from dataclasses import replace

from kvswap.base.eviction_policy import (
    BUILTIN_POLICY_NAMES,
    EvictionPolicy,
    PolicyOptions,
    policy_field,
)
from kvswap.base.tier import Tier
from kvswap.control.policy_arc import ArcPolicy
from kvswap.control.policy_kvswap import KvSwapGpuPolicy, KvSwapLowerTierPolicy
from kvswap.control.policy_lru import LruPolicy
from kvswap.control.policy_reuse import ReusePolicy
from kvswap.errors import ConfigError
from kvswap.import_path import import_object, one_line, split_import_path

__all__ = [
    "PolicyOptions", "build_named", "build_policy", "check_policy_names", "named_policy",
    "policy_class", "resolve_policy",
]  # fmt: skip

_ALLOWED = (
    f"{', '.join(repr(name) for name in BUILTIN_POLICY_NAMES[:-1])} or "
    f"{BUILTIN_POLICY_NAMES[-1]!r}, or an import path 'package.module:ClassName' of an "
    "EvictionPolicy subclass"
)
_BUILTIN_CLASSES = (KvSwapGpuPolicy, KvSwapLowerTierPolicy, LruPolicy, ArcPolicy, ReusePolicy)


def policy_class(field: str, value: str, *, top: bool) -> type[EvictionPolicy]:
    """The class `value` names, for the top tier kvswap ranks or one below it (`top`);
    importing a user's module if it is a path. Its parameters, if any, are checked."""
    return resolve_policy(field, value, top=top)[0]


def resolve_policy(
    field: str, value: str, *, top: bool
) -> tuple[type[EvictionPolicy], tuple[tuple[str, object], ...]]:
    """The class `value` names (`policy_class`) and the parameters it gives it, read
    by the class's `PARAMETERS`: "reuse(once=oldest)" -> (ReusePolicy, (("once",
    "oldest"),)). Anything it cannot read is one line naming `field` and what is
    allowed."""
    name, texts = _split_parameters(field, value)
    cls = _class_named(field, value, name, top=top)
    readers = cls.PARAMETERS
    parameters: list[tuple[str, object]] = []
    for key, text in texts:
        reader = readers.get(key)
        if reader is None:
            takes = ", ".join(readers) if readers else "none"
            raise ConfigError(
                f"{field} = {value!r}: {name} takes no parameter {key!r}; allowed: {takes}"
            )
        try:
            parameters.append((key, reader(text)))
        except ValueError as error:
            raise ConfigError(f"{field} = {value!r}: {key} = {text!r}: {error}") from None
    return cls, tuple(parameters)


def _split_parameters(field: str, value: str) -> tuple[str, list[tuple[str, str]]]:
    """'name(a=1, b=x)' -> ('name', [('a', '1'), ('b', 'x')]); a value without
    parentheses is a name alone."""
    name, paren, rest = value.partition("(")
    if not paren:
        return value, []
    texts: list[tuple[str, str]] = []
    inside = rest[:-1] if rest.endswith(")") else None
    for item in [] if inside is None or not inside.strip() else inside.split(","):
        key, equals, text = (part.strip() for part in item.partition("="))
        if not key or not equals or not text or any(key == seen for seen, _ in texts):
            inside = None
            break
        texts.append((key, text))
    if inside is None or not name.strip():
        raise ConfigError(
            f"{field} = {value!r}: not a policy with parameters; allowed: "
            "NAME(key=value, ...), each key once, as in 'reuse(once=oldest, dead_gaps=1.2)'"
        )
    return name.strip(), texts


def _class_named(field: str, value: str, name: str, *, top: bool) -> type[EvictionPolicy]:
    """The class `name` (the policy's name in the setting's `value`) names."""
    if name == "kvswap":
        return KvSwapGpuPolicy if top else KvSwapLowerTierPolicy
    if name == "lru":
        return LruPolicy
    if name == "arc":
        return ArcPolicy
    if name == "reuse":
        return ReusePolicy
    if split_import_path(name) is None:
        raise ConfigError(f"{field} = {value!r}: unknown policy; allowed: {_ALLOWED}")
    found = import_object(field, name, _ALLOWED, shown=value)
    if not isinstance(found, type) or not issubclass(found, EvictionPolicy):
        what = "nothing" if found is None else f"a {type(found).__name__}"
        raise ConfigError(
            f"{field} = {value!r}: {name.replace(':', '.')} is {what}, not an "
            f"EvictionPolicy subclass; allowed: {_ALLOWED}"
        )
    return found


def build_named(
    name: str,
    tier: Tier,
    options: PolicyOptions,
    *,
    field: str,
    top: bool,
    capacity_blocks: int | None = None,
) -> EvictionPolicy:
    """The policy `name` names for `tier` (`top`: the top tier kvswap ranks), with the
    switches of `options` and the tier's size. `field`: the setting an error names."""
    cls, parameters = resolve_policy(field, name, top=top)
    options = replace(options, parameters=parameters)
    if capacity_blocks is not None:
        options = replace(options, capacity_blocks=capacity_blocks)
    if cls in _BUILTIN_CLASSES:
        return cls(tier, options)
    try:
        return cls(tier, options)
    except Exception as error:  # a user's constructor: reported like its import
        raise ConfigError(
            f"{field} = {name!r}: {cls.__name__}(tier, options) failed "
            f"({one_line(error)}); allowed: {_ALLOWED}"
        ) from None


def build_policy(
    tier: Tier, options: PolicyOptions, *, capacity_blocks: int | None = None
) -> EvictionPolicy:
    """A tier of kvswap's engine: its policy as `options` names it
    (`options.gpu_eviction_policy`, ...); the GPU is the top tier."""
    return build_named(
        options.policy_name(tier), tier, options, field=policy_field(tier),
        top=tier is Tier.GPU, capacity_blocks=capacity_blocks,
    )  # fmt: skip


def named_policy(tier: Tier, name: str, *, capacity_blocks: int | None = None) -> EvictionPolicy:
    """A keyed tier of an adapter (the NVMe slab under vLLM or SGLang), below the top
    one: its policy by its name alone, the switches at their defaults."""
    return build_named(
        name, tier, PolicyOptions(), field=policy_field(tier), top=False,
        capacity_blocks=capacity_blocks,
    )  # fmt: skip


def check_policy_names(options: PolicyOptions) -> None:
    """Resolve every tier's policy name once (imports included), at the edge."""
    for tier in (Tier.GPU, Tier.CPU, Tier.NVME):
        policy_class(policy_field(tier), options.policy_name(tier), top=tier is Tier.GPU)
