"""The one validated configuration of kvswap: its sections, fields and their rules.

Sections group the fields, and every field name is unique across sections,
so a value can be written three ways and mean the same thing:

    [swap]                           # sectioned TOML
    swap_out_high_watermark = 0.85
    swap_out_high_watermark = 0.85   # flat TOML, as in the seed article's template
    KVSWAP_SWAP_OUT_HIGH_WATERMARK=0.85   # environment

Precedence, lowest first: defaults, the TOML file, `KVSWAP_*` variables, CLI
flags. The result is validated once (`config_load.load_config`) and frozen
afterwards.
Capacities given in bytes ("6GiB") become blocks only once the model's block
size is known: `KvSwapConfig.tier_capacities(block_bytes)`.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvswap.base.remote_names import REMOTE_URL_SCHEMES, is_cluster_url, namespace_problem
from kvswap.config_capacities import SizedRules, TierCapacities, tier_blocks, validate_capacities
from kvswap.errors import ConfigError
from kvswap.import_path import split_import_path
from kvswap.units import parse_size_bytes

ENV_PREFIX = "KVSWAP_"
SizeValue = int | str
#: The most blocks a tier (or a block count) may name: 2**40, past any machine, and
#: small enough that blocks x block bytes stays a finite float in every bill.
MAX_NUM_BLOCKS = 2**40


class _Section(BaseModel):
    # allow_inf_nan=False: a NaN or infinite rate or watermark is never a setting.
    # Attribute docstrings are the fields' descriptions: the help line of each flag.
    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False,
        use_attribute_docstrings=True,
    )  # fmt: skip

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads true as 1 and false as 0, so TOML
        # `kv_block_tokens = true` would become 1-token blocks; only bool fields take them.
        if not isinstance(value, bool) or info.field_name is None:
            return value
        annotation = cls.model_fields[info.field_name].annotation
        if annotation is bool:
            return value
        kinds = {annotation, *get_args(annotation)}
        if int in kinds or float in kinds:
            raise ValueError("a boolean is not a number; give a number")
        raise ValueError("a boolean is not allowed here")


class ModelSection(_Section):
    """Which model's KV is being stored."""

    preset: str | None = "article-8b"
    """a built-in model description (article-8b, tiny, small, ...) to size KV for"""
    hf_config: str | None = None
    """a checkpoint's config.json to size KV for (instead of a preset)"""
    dtype: Literal["fp32", "fp16", "bf16", "fp8"] = "fp16"
    """dtype of the KV (and weights) being sized: fp32, fp16, bf16, fp8"""


class CacheSection(_Section):
    """Block size and how many blocks each tier holds (blocks or bytes, not both)."""

    kv_block_tokens: int = Field(default=16, ge=1, le=4096)
    """tokens per KV block (a power of two, 1..4096; vLLM: --block-size)"""
    gpu_kv_capacity_blocks: int | None = Field(default=None, ge=0, le=MAX_NUM_BLOCKS)
    """device (GPU) tier size in blocks (or give _bytes)"""
    gpu_kv_capacity_bytes: SizeValue | None = None
    """device (GPU) tier size in bytes, e.g. 24GiB (or give _blocks)"""
    cpu_kv_capacity_blocks: int | None = Field(default=None, ge=0, le=MAX_NUM_BLOCKS)
    """pinned CPU tier size in blocks (or give _bytes)"""
    cpu_kv_capacity_bytes: SizeValue | None = None
    """pinned CPU tier size in bytes, e.g. 64GiB (or give _blocks)"""
    nvme_kv_capacity_blocks: int | None = Field(default=None, ge=0, le=MAX_NUM_BLOCKS)
    """NVMe tier size in blocks (needs nvme_dir; or give _bytes)"""
    nvme_kv_capacity_bytes: SizeValue | None = None
    """NVMe tier size in bytes, e.g. 500GiB (needs nvme_dir)"""

    @field_validator("kv_block_tokens")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"must be a power of two (1, 2, 4, ..., 4096), got {value}")
        return value

    @field_validator("gpu_kv_capacity_bytes", "cpu_kv_capacity_bytes", "nvme_kv_capacity_bytes")
    @classmethod
    def _size(cls, value: SizeValue | None) -> int | None:
        return None if value is None else _size_or_value_error(value)


class SwapSection(_Section):
    """The residency policy and the swapper's knobs (the seed article's names)."""

    swap_out_high_watermark: float = Field(default=0.85, gt=0.0, le=1.0)
    """device tier occupancy where swap-out starts (0..1]"""
    swap_out_low_watermark: float = Field(default=0.65, ge=0.0, lt=1.0)
    """where swap-out stops, and the admission ceiling [0..1)"""
    protected_sink_blocks: int = Field(default=8, ge=0, le=MAX_NUM_BLOCKS)
    """a sequence's first blocks (attention sinks), kept on the GPU while it holds them"""
    min_residency_steps: int = Field(default=64, ge=0, le=2**40)
    """decode steps a block brought back stays on the GPU before it may leave again"""
    gpu_eviction_policy: str = Field(default="kvswap", min_length=1, max_length=300)
    """which copies leave the GPU first: kvswap, lru, arc, reuse(dead_gaps=1.2), mod:Class"""
    cpu_eviction_policy: str = Field(default="kvswap", min_length=1, max_length=300)
    """which copies leave the CPU tier first: kvswap, lru, arc, reuse(once=oldest), mod:Class"""
    nvme_eviction_policy: str = Field(default="kvswap", min_length=1, max_length=300)
    """which copies leave NVMe first: kvswap, lru, arc, reuse, or package.module:ClassName"""
    swap_out_chunk_blocks: int = Field(default=8, ge=1, le=MAX_NUM_BLOCKS)
    """blocks per swap-out (and demotion) chunk on the LOW queue"""
    swap_in_chunk_blocks: int = Field(default=4, ge=1, le=MAX_NUM_BLOCKS)
    """blocks per swap-in chunk on the HIGH queue"""
    prefetch_stream_count: int = Field(default=2, ge=1, le=8)
    """HIGH-priority copy streams (CUDA) or worker threads (CPU) for swap-in, 1..8"""
    cpu_demote_high_watermark: float = Field(default=0.90, gt=0.0, le=1.0)
    """pinned CPU tier occupancy where demotion (to NVMe / the store) starts (0..1]"""
    cpu_demote_low_watermark: float = Field(default=0.80, ge=0.0, lt=1.0)
    """where demotion stops [0..1)"""

    @model_validator(mode="after")
    def _low_below_high(self) -> SwapSection:
        pairs = (
            ("swap_out_low_watermark", "swap_out_high_watermark"),
            ("cpu_demote_low_watermark", "cpu_demote_high_watermark"),
        )
        for low_name, high_name in pairs:
            low, high = getattr(self, low_name), getattr(self, high_name)
            if not low < high:
                raise ValueError(
                    f"{low_name} = {low} must be below {high_name} = {high}; "
                    "allowed: 0 <= low < high <= 1.0"
                )
        return self


class TiersSection(_Section):
    """Where the lower tiers live."""

    nvme_dir: str | None = None
    """directory of the NVMe slab file (removed at exit unless nvme_persist)"""
    nvme_persist: bool = False
    """keep the NVMe slab file at exit"""
    remote_url: str | None = None
    """the shared remote tier: redis://host:port/db, rediss:// (TLS) or unix:///path; unset:
    none (password in the URL or KVSWAP_REMOTE_PASSWORD)"""
    remote_namespace: str | None = None
    """key prefix in the store (default: the model's block fingerprint)"""
    remote_ttl_s: float = Field(default=0.0, ge=0.0, le=10 * 365 * 86400)
    """seconds a stored block lives in the store (0: no expiry)"""
    remote_timeout_ms: float = Field(default=50.0, gt=0.0, le=60_000.0)
    """timeout of one store round trip, ms"""
    remote_max_inflight_chunks: int = Field(default=64, ge=1, le=1024)
    """remote write chunks in flight at most (kvswap's engine holds more back; inside vLLM a
    store past it is skipped and counted)"""
    remote_write_policy: Literal["on_finish", "on_demote", "off"] = "on_finish"
    """when blocks are written to the store: on_finish, on_demote, off"""
    remote_required: bool = False
    """a store unreachable at start is an error (else one warning, tier off)"""
    secondary_tiers: str | None = Field(default=None, min_length=1, max_length=2000)
    """tiers of one's own below the store, fastest first: package.module:factory[,...], each
    called as factory(host_slots, layout) and returning a SecondaryTier (kvswap run, serve)"""

    @property
    def secondary_tier_paths(self) -> tuple[str, ...]:
        """`secondary_tiers` as import paths, fastest first (none when unset)."""
        value = self.secondary_tiers
        return () if value is None else tuple(path.strip() for path in value.split(","))

    @field_validator("secondary_tiers")
    @classmethod
    def _import_paths(cls, value: str | None) -> str | None:
        for path in () if value is None else value.split(","):
            if split_import_path(path.strip()) is None:
                raise ValueError(
                    f"{path.strip()!r} is not an import path; allowed: "
                    "package.module:factory, several separated by commas"
                )
        return value

    @field_validator("nvme_dir")
    @classmethod
    def _a_real_path(cls, value: str | None) -> str | None:
        # An empty path would put the slab in the current directory, unasked.
        if value is not None and not value.strip():
            raise ValueError("an empty path is not a directory; name the slab's directory")
        if value is not None and "\0" in value:
            raise ValueError("a path cannot contain a NUL byte; name the slab's directory")
        return value

    @field_validator("remote_namespace")
    @classmethod
    def _a_key_prefix(cls, value: str | None) -> str | None:
        # Here, not only where a store is built: the simulator and vLLM's tier take it alone.
        if value is not None and (problem := namespace_problem(value)) is not None:
            raise ValueError(problem)
        return value

    @field_validator("remote_url")
    @classmethod
    def _a_store_url(cls, value: str | None) -> str | None:
        if value is None:
            return value
        scheme, sep, rest = value.partition("://")
        if not sep or scheme not in REMOTE_URL_SCHEMES or not rest:
            raise ValueError(
                "not a store URL; allowed: "
                + ", ".join(f"{s}://..." for s in REMOTE_URL_SCHEMES)
                + " (e.g. redis://127.0.0.1:6379/0)"
            )
        return value

    @model_validator(mode="after")
    def _a_cluster_key_prefix(self) -> TiersSection:
        namespace, url = self.remote_namespace, self.remote_url
        if namespace is not None and url is not None and is_cluster_url(url):
            problem = namespace_problem(namespace, cluster=True)
            if problem is not None:
                raise ValueError(f"remote_namespace = {namespace!r:.80} on a cluster: {problem}")
        return self


class EngineSection(_Section):
    """The reference engine."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """where the model runs: auto, cpu, cuda"""
    preemption: Literal["swap", "recompute"] = "swap"
    """how a sequence is preempted under pressure: swap (keep its KV below) or recompute"""
    max_num_seqs: int = Field(default=64, ge=1)
    """sequences running at once, at most"""
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    """tokens computed in one step, at most (prefill is chunked by it)"""
    batch_invariant: bool = False
    """the exact mode: fixed tiles, output bit-identical whatever the batch, tiering or chunking"""


class SimulatorSection(_Section):
    """The simulator's hardware model and randomness."""

    hardware: str = "article-40gb"
    """the simulated hardware profile (e.g. article-40gb, h200) or a bench JSON file"""
    seed: int = 0
    """the simulator's random seed"""


class KvSwapConfig(_Section):
    """All of kvswap's settings, validated and frozen."""

    model: ModelSection = ModelSection()
    cache: CacheSection = CacheSection()
    swap: SwapSection = SwapSection()
    tiers: TiersSection = TiersSection()
    engine: EngineSection = EngineSection()
    simulator: SimulatorSection = SimulatorSection()

    def tier_capacities(self, block_bytes: int, *, slab_needed: bool = True) -> TierCapacities:
        """Blocks per tier for a model whose KV block is `block_bytes` long.

        Tiers given in bytes hold floor(bytes / block_bytes) blocks. A tier left
        unset holds 0 blocks here; `kvswap plan` fills the GPU tier from the GPU
        size instead. Raises ConfigError for a chunk larger than the tier it
        moves from or a GPU tier no larger than the protected blocks. `slab_needed`
        False (`kvswap plan`: a bill, no slab is made) skips the NVMe directory rule.
        """
        if block_bytes <= 0:
            raise ConfigError(f"block size must be > 0 bytes, got {block_bytes}")
        cache = self.cache
        gpu = tier_blocks(
            "gpu", cache.gpu_kv_capacity_blocks, cache.gpu_kv_capacity_bytes, block_bytes
        )
        cpu = tier_blocks(
            "cpu", cache.cpu_kv_capacity_blocks, cache.cpu_kv_capacity_bytes, block_bytes
        )
        nvme = tier_blocks(
            "nvme", cache.nvme_kv_capacity_blocks, cache.nvme_kv_capacity_bytes, block_bytes
        )
        capacities = TierCapacities(gpu or 0, cpu or 0, nvme or 0, gpu is not None)
        validate_capacities(self.sized_rules(), capacities, slab_needed=slab_needed)
        return capacities

    def sized_rules(self) -> SizedRules:
        """The fields `validate_capacities` checks against the tiers' sizes."""
        swap = self.swap
        return SizedRules(swap.protected_sink_blocks, swap.swap_out_chunk_blocks,
                          swap.swap_in_chunk_blocks, self.tiers.nvme_dir)  # fmt: skip


def _size_or_value_error(value: SizeValue) -> int:
    try:
        return parse_size_bytes(value, "size")
    except ConfigError as error:
        raise ValueError(str(error).removeprefix("size: ")) from None


#: section name -> its model.
SECTION_MODELS: dict[str, type[_Section]] = {
    name: field.annotation  # type: ignore[misc]
    for name, field in KvSwapConfig.model_fields.items()
}
#: field name -> section name, for every settable field.
FIELD_SECTIONS: dict[str, str] = {
    field: section for section, model in SECTION_MODELS.items() for field in model.model_fields
}


#: The seed article's names that were renamed to say what they mean: old -> new. The
#: old names stay accepted in TOML, `KVSWAP_*` variables and flags, so the seed article's
#: template (configs/article-8b-40gb.toml) loads unchanged.
#: Fields that are on/off switches (a flag alone turns them on).
SWITCH_FIELDS: frozenset[str] = frozenset(
    field
    for model in SECTION_MODELS.values()
    for field, info in model.model_fields.items()
    if info.annotation is bool
)

RENAMED_FIELDS: dict[str, str] = {
    "swap_in_low_watermark": "swap_out_low_watermark",
    "evict_protected_blocks": "protected_sink_blocks",
}
#: every accepted spelling -> the field it sets
FIELD_SPELLINGS: dict[str, str] = {
    **{field: field for field in FIELD_SECTIONS},
    **RENAMED_FIELDS,
}

CAPACITY_TWINS: dict[str, str] = {}
for _tier in ("gpu", "cpu", "nvme"):
    CAPACITY_TWINS[f"{_tier}_kv_capacity_blocks"] = f"{_tier}_kv_capacity_bytes"
    CAPACITY_TWINS[f"{_tier}_kv_capacity_bytes"] = f"{_tier}_kv_capacity_blocks"
