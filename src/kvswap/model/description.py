"""ONE description of a model: its shape, its KV bytes and its identity.

Built from a preset (`kvswap.model.presets`) or a Hugging Face `config.json`
(`kvswap.model.hf_config`, the one reader). The ledger, `kvswap plan`, the
simulator, the engine's `KVLayout` and the torch decoder's config are all
built from a `ModelDescription`, so they cannot disagree about a block's size.

THE KV formula, values cached per token per layer:

    MHA/GQA/MQA   K and V, one head_dim-wide vector per KV head:
                  num_kv_planes (2) x num_kv_heads x head_dim
    MLA           one latent vector shared by K and V plus the decoupled RoPE
                  key: num_kv_planes (1) x 1 x (kv_lora_rank + qk_rope_head_dim)

    kv_bytes_per_token = values per token per layer x num_layers x dtype bytes

A uniform sliding window (Mistral) leaves the per-token size unchanged; the
ledger counts every token of context, an upper bound for windowed layers.

Torch-free on purpose: `kvswap plan` and the simulator run without torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from kvswap.model.dtypes import DTYPE_BYTES, dtype_bytes, normalise_dtype

AttentionKind = Literal["mha", "gqa", "mqa", "mla"]
#: A rope parameter as read from a config: numbers, names, or tuples of numbers.
RopeValue = float | int | str | bool | tuple[float | int, ...]


def kv_bytes_per_token(
    *, num_layers: int, num_kv_planes: int, num_kv_heads: int, head_dim: int, value_bytes: int
) -> int:
    """THE KV formula (module docstring); `KVLayout` and the description both call it."""
    return num_kv_planes * num_kv_heads * head_dim * num_layers * value_bytes


@dataclass(frozen=True)
class RopeSpec:
    """The rotary embedding settings as the config states them, normalised.

    `params` are the scaling parameters (sorted by key) for a non-default
    `rope_type`; which types the decoder can run is decided by
    `kvswap.model.arch_config`, not here: the ledger can size a model whose
    RoPE scaling the decoder does not implement.
    """

    theta: float = 10000.0
    rope_type: str = "default"
    params: tuple[tuple[str, RopeValue], ...] = ()

    def param(self, key: str) -> RopeValue | None:
        return dict(self.params).get(key)


@dataclass(frozen=True)
class MlaShape:
    """Multi-head latent attention (DeepSeek-V2/V3): what one token caches per layer."""

    kv_lora_rank: int
    qk_rope_head_dim: int


@dataclass(frozen=True)
class ModelDescription:
    """What kvswap knows about a model; see the module docstring."""

    name: str
    architecture: str
    # The family as transformers names it ("llama", "qwen2"); None if the config does not say.
    model_type: str | None
    attention: AttentionKind
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int  # MLA: 1, the latent vector
    head_dim: int  # MLA: kv_lora_rank + qk_rope_head_dim
    hidden_size: int
    intermediate_size: int | None
    vocab_size: int | None
    num_params: int | None
    num_params_is_estimate: bool
    # The weights dtype the config states (fp32/fp16/bf16); None when it states none.
    checkpoint_dtype: str | None
    # The dtype the KV cache is held in; readers start from `default_dtype`.
    kv_dtype: str
    rope: RopeSpec
    mla: MlaShape | None

    def __post_init__(self) -> None:
        if self.kv_dtype not in DTYPE_BYTES:
            raise ValueError(f"kv_dtype {self.kv_dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        if self.mla is not None and self.head_dim != (
            self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        ):
            raise ValueError("an MLA model's head_dim is kv_lora_rank + qk_rope_head_dim")

    @property
    def default_dtype(self) -> str:
        """The checkpoint's dtype, else fp16 (the usual serving dtype) for the ledger."""
        return self.checkpoint_dtype or "fp16"

    @property
    def num_kv_planes(self) -> int:
        """2 for separate K and V; 1 for MLA's latent vector shared by K and V."""
        return 1 if self.mla is not None else 2

    @property
    def kv_values_per_token_per_layer(self) -> int:
        return self.num_kv_planes * self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype: str | None = None) -> int:
        """KV bytes one token occupies across all layers, in `dtype` (default: `kv_dtype`)."""
        return kv_bytes_per_token(
            num_layers=self.num_layers, num_kv_planes=self.num_kv_planes,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            value_bytes=dtype_bytes(dtype if dtype is not None else self.kv_dtype),
        )  # fmt: skip

    def kv_bytes_per_block(self, block_tokens: int, dtype: str | None = None) -> int:
        return self.kv_bytes_per_token(dtype) * block_tokens

    def with_kv_dtype(self, dtype: str) -> ModelDescription:
        """The same model with its KV cache held in `dtype` (any accepted spelling)."""
        return dataclasses.replace(self, kv_dtype=normalise_dtype(dtype))

    def identity_fields(self, kv_dtype: str | None = None) -> dict[str, object]:
        """The description's part of a block's identity (`kvswap.model.kv_identity`):
        everything it holds that decides a block's bytes and their meaning, and nothing
        that varies between copies of one model (its name, where its config was read
        from, the parameter-count estimate)."""
        return {
            "model_type": self.model_type,
            "architecture": self.architecture,
            "attention": self.attention,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope": [self.rope.theta, self.rope.rope_type, [list(p) for p in self.rope.params]],
            "vocab_size": self.vocab_size,
            "mla": None if self.mla is None else dataclasses.asdict(self.mla),
            "kv_dtype": normalise_dtype(kv_dtype) if kv_dtype is not None else self.kv_dtype,
        }
