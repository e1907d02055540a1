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

An unknown name, a failed import or a class that is not an `EvictionPolicy`
is a `ConfigError` in one line naming the field, the value and what is allowed.
"""

from __future__ import annotations

import importlib

from kvswap.base.eviction_policy import (
    BUILTIN_POLICY_NAMES,
    EvictionPolicy,
    PolicyOptions,
    policy_field,
)
from kvswap.base.transfer import Tier
from kvswap.control.policy_arc import ArcPolicy
from kvswap.control.policy_kvswap import KvSwapGpuPolicy, KvSwapLowerTierPolicy
from kvswap.control.policy_lru import LruPolicy
from kvswap.control.policy_reuse import ReusePolicy
from kvswap.errors import ConfigError

__all__ = ["PolicyOptions", "build_policy", "check_policy_names", "named_policy", "policy_class"]

_ALLOWED = (
    f"{', '.join(repr(name) for name in BUILTIN_POLICY_NAMES[:-1])} or "
    f"{BUILTIN_POLICY_NAMES[-1]!r}, or an import path 'package.module:ClassName' of an "
    "EvictionPolicy subclass"
)
_BUILTIN_CLASSES = (KvSwapGpuPolicy, KvSwapLowerTierPolicy, LruPolicy, ArcPolicy, ReusePolicy)


def policy_class(field: str, value: str, tier: Tier) -> type[EvictionPolicy]:
    """The class `value` names for `tier`; importing a user's module if it is a path."""
    if value == "kvswap":
        return KvSwapGpuPolicy if tier is Tier.GPU else KvSwapLowerTierPolicy
    if value == "lru":
        return LruPolicy
    if value == "arc":
        return ArcPolicy
    if value == "reuse":
        return ReusePolicy
    module_name, colon, class_name = value.partition(":")
    if not colon or not module_name or not class_name:
        raise ConfigError(f"{field} = {value!r}: unknown policy; allowed: {_ALLOWED}")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # any failure of a user's module is one config error
        raise ConfigError(
            f"{field} = {value!r}: cannot import {module_name!r} ({_one_line(error)}); "
            f"allowed: {_ALLOWED}"
        ) from None
    found = getattr(module, class_name, None)
    if not isinstance(found, type) or not issubclass(found, EvictionPolicy):
        what = "nothing" if found is None else f"a {type(found).__name__}"
        raise ConfigError(
            f"{field} = {value!r}: {module_name}.{class_name} is {what}, not an "
            f"EvictionPolicy subclass; allowed: {_ALLOWED}"
        )
    return found


def build_policy(tier: Tier, options: PolicyOptions, *, field: str | None = None) -> EvictionPolicy:
    """`tier`'s policy as `options` names it (`options.gpu_eviction_policy`, ...).
    `field`: the setting an error names, when the caller's users know the policy by
    another name (vLLM's adapter: "eviction_policy"); default `policy_field(tier)`."""
    field = policy_field(tier) if field is None else field
    cls = policy_class(field, options.policy_name(tier), tier)
    if cls in _BUILTIN_CLASSES:
        return cls(tier, options)
    try:
        return cls(tier, options)
    except Exception as error:  # a user's constructor: reported like its import
        raise ConfigError(
            f"{field} = {options.policy_name(tier)!r}: {cls.__name__}(tier, options) "
            f"failed ({_one_line(error)}); allowed: {_ALLOWED}"
        ) from None


def named_policy(tier: Tier, name: str) -> EvictionPolicy:
    """`tier`'s policy by its name alone (a keyed tier of an adapter: the NVMe slab under
    vLLM or SGLang), the other switches at their defaults."""
    named = {
        Tier.GPU: PolicyOptions(gpu_eviction_policy=name),
        Tier.CPU: PolicyOptions(cpu_eviction_policy=name),
        Tier.NVME: PolicyOptions(nvme_eviction_policy=name),
    }
    return build_policy(tier, named[tier])


def check_policy_names(options: PolicyOptions) -> None:
    """Resolve every tier's policy name once (imports included), at the edge."""
    for tier in (Tier.GPU, Tier.CPU, Tier.NVME):
        policy_class(policy_field(tier), options.policy_name(tier), tier)


def _one_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
