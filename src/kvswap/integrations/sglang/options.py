"""kvswap's part of SGLang's `--hicache-storage-backend-extra-config`, read and checked once.

SGLang hands the backend the whole JSON object: its own keys (`SGLANG_KEYS`:
`backend_name`, `module_path`, `class_name`, `interface_v1`, ...) pass through
untouched; these are kvswap's:

    remote_url           the shared store (`tiers.remote_url` forms: redis://, rediss://,
                         unix://); its password may come from KVSWAP_REMOTE_PASSWORD
    remote_namespace     the store's key prefix (default "kvswap-sglang")
    remote_timeout_ms    every store call's bound (default 500)
    remote_required      true: a store that cannot be used at start is an error
                         (default false: one warning, pages miss until it answers)
    tenant_salt          pages are shared only between engines with the same salt
    nvme_dir, nvme_pages the NVMe slab: a directory, and how many pages it holds; with
                         remote_url too, the slab goes in front of the store
    nvme_eviction_policy which page leaves a full slab ("kvswap", "lru", "module:Class")
    model_path           the checkpoint whose weights and config name the pages (default:
                         the --model-path SGLang serves, from its published server args)

`remote_url`, `nvme_dir`, or both. A bad value, a value of the wrong type
("8" for a count) and a key neither kvswap nor SGLang reads (a misspelt key would do
nothing) are each one `ConfigError` line naming the key and what is allowed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

from kvswap.base.eviction_policy import PolicyOptions
from kvswap.base.identity import check_cache_salt
from kvswap.config_load import suggest
from kvswap.control.policy import check_policy_names
from kvswap.data.remote_format import check_namespace
from kvswap.data.remote_url import parse_remote_url
from kvswap.errors import ConfigError, KvSwapError

DEFAULT_NAMESPACE = "kvswap-sglang"
_WHERE = "--hicache-storage-backend-extra-config"
#: The keys SGLang (0.5.x) reads from the same object, or adds to it, left to SGLang:
#: the dynamic backend's name and class, the zero-copy switch, the prefetch knobs and
#: `tp_lcm_size` (popped by SGLang's cache controllers, when they are), and the
#: `--file-storage-path` it adds.
SGLANG_KEYS = frozenset(
    {
        "backend_name", "module_path", "class_name", "interface_v1",
        "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys", "tp_lcm_size", "file_storage_path",
    }
)  # fmt: skip
_NVME_PAGES_ALLOWED = "an integer >= 1 with nvme_dir"


@dataclass(frozen=True)
class StorageOptions:
    """What kvswap's HiCache backend is built with (module docstring)."""

    remote_url: str | None = None
    remote_namespace: str = DEFAULT_NAMESPACE
    remote_timeout_ms: float = 500.0
    remote_required: bool = False
    tenant_salt: str | None = None
    nvme_dir: Path | None = None
    nvme_pages: int = 0
    nvme_eviction_policy: str = "kvswap"
    model_path: str | None = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, object] | None) -> StorageOptions:
        extra = extra or {}
        _check_keys(extra)
        options = cls(
            remote_url=_optional_str(extra, "remote_url"),
            remote_namespace=_str(extra, "remote_namespace", DEFAULT_NAMESPACE),
            remote_timeout_ms=_positive_number(extra, "remote_timeout_ms", 500.0),
            remote_required=_bool(extra, "remote_required", False),
            tenant_salt=_optional_str(extra, "tenant_salt"),
            model_path=_optional_str(extra, "model_path"),
            nvme_dir=None if (d := _optional_str(extra, "nvme_dir")) is None else Path(d),
            nvme_pages=_nvme_pages(extra),
            nvme_eviction_policy=_str(extra, "nvme_eviction_policy", "kvswap"),
        )
        options.check()
        return options

    def check(self) -> None:
        if self.remote_url is None and self.nvme_dir is None:
            raise ConfigError(
                f"{_WHERE}: give remote_url (the shared store), nvme_dir (the NVMe slab), or "
                "both (the slab in front of the store)"
            )
        if self.remote_url is not None:
            parse_remote_url(self.remote_url)  # one line naming what is wrong, if anything
            check_namespace(self.remote_namespace)
        if self.nvme_dir is not None and self.nvme_pages < 1:
            raise _bad("nvme_pages", self.nvme_pages, _NVME_PAGES_ALLOWED)
        if self.nvme_dir is None and self.nvme_pages:
            raise ConfigError(
                f"{_WHERE}: nvme_pages is set but nvme_dir is not; allowed: both (the NVMe "
                "slab) or neither"
            )
        try:
            check_cache_salt(self.tenant_salt)
        except KvSwapError as error:
            raise ConfigError(f"{_WHERE}: tenant_salt: {error}") from None
        check_policy_names(PolicyOptions(nvme_eviction_policy=self.nvme_eviction_policy))


def _check_keys(extra: Mapping[str, object]) -> None:
    """Every key is kvswap's or SGLang's; one line naming the first that is neither."""
    kvswap_keys = [field.name for field in fields(StorageOptions)]
    for key in extra:
        if key in kvswap_keys or key in SGLANG_KEYS:
            continue
        known = [*kvswap_keys, *sorted(SGLANG_KEYS)]
        raise ConfigError(
            f"{_WHERE}: unknown key {key!r}{suggest(str(key), known)}; allowed: kvswap's "
            f"{', '.join(kvswap_keys)}; SGLang's {', '.join(sorted(SGLANG_KEYS))}"
        )


def _bad(key: str, value: object, allowed: str) -> ConfigError:
    return ConfigError(f"{_WHERE}: {key} = {value!r:.80}; allowed: {allowed}")


def _optional_str(extra: Mapping[str, object], key: str) -> str | None:
    value = extra.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise _bad(key, value, "a non-empty string")
    return value


def _str(extra: Mapping[str, object], key: str, default: str) -> str:
    value = _optional_str(extra, key)
    return default if value is None else value


def _bool(extra: Mapping[str, object], key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if not isinstance(value, bool):
        raise _bad(key, value, "true or false")
    return value


def _positive_number(extra: Mapping[str, object], key: str, default: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise _bad(key, value, "a number > 0")
    return float(value)


def _nvme_pages(extra: Mapping[str, object]) -> int:
    """The slab's pages; 0 when not given (then `check` wants it with nvme_dir)."""
    value = extra.get("nvme_pages", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _bad("nvme_pages", value, _NVME_PAGES_ALLOWED)
    return value
