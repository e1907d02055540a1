"""The byte layout of one KV block, shared by every pool.

A block holds `block_tokens` tokens of K and V for every layer, and it is one
contiguous run of bytes in every tier, so moving a block between tiers is one
copy (one DMA, one pwrite) whatever the model:

    one block = block_bytes, contiguous, shape block_shape =
        [num_layers, 2, block_tokens, num_kv_heads, head_dim]

    +------------------------ layer 0 ------------------------+-- layer 1 --+ ...
    | K: [block_tokens, num_kv_heads, head_dim] | V: (same)    | K    | V    |
    +-------------------------------------------+--------------+------+------+

    a pool = [num_blocks, *block_shape]: block b starts at byte b * block_bytes.

The attention kernel reads layer l's K of every block as the strided view
`kv[:, l, 0]`: [num_blocks, block_tokens, num_kv_heads, head_dim].

A layout is built from the one model description (`KVLayout.for_model`), and
its bytes come from the description's KV formula, so a block the engine
allocates is exactly the block the ledger and the simulator bill. An MLA model
caches one latent vector shared by K and V: `num_kv_planes` = 1, one "head"
of kv_lora_rank + qk_rope_head_dim (sized here; the decoder does not run it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvswap.errors import ConfigError
from kvswap.model.description import ModelDescription, kv_bytes_per_token
from kvswap.model.torch_dtypes import torch_dtype

# Index of K and V along the block's second axis.
K_INDEX = 0
V_INDEX = 1


@dataclass(frozen=True)
class KVLayout:
    """Shape and dtype of one KV block; all pools of one cache share one layout."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: torch.dtype
    # 2: separate K and V planes; 1: MLA's latent vector, shared by K and V.
    num_kv_planes: int = 2

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "block_tokens"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"KV layout {field}: {value!r} is invalid; expected an int >= 1")
        if self.num_kv_planes not in (1, 2):
            raise ConfigError(f"KV layout num_kv_planes: {self.num_kv_planes!r}; expected 1 or 2")
        if not isinstance(self.dtype, torch.dtype):
            raise ConfigError(f"KV layout dtype: {self.dtype!r} is not a torch.dtype")

    @classmethod
    def for_model(cls, description: ModelDescription, block_tokens: int) -> KVLayout:
        """The layout of `description`'s KV blocks in its `kv_dtype`."""
        return cls(
            num_layers=description.num_layers,
            num_kv_heads=description.num_kv_heads,
            head_dim=description.head_dim,
            block_tokens=block_tokens,
            dtype=torch_dtype(description.kv_dtype),
            num_kv_planes=description.num_kv_planes,
        )

    @classmethod
    def from_block_bytes(cls, block_bytes: int) -> KVLayout:
        """A raw uint8 layout of exactly `block_bytes` per block, for tests and
        benchmarks that move bytes and do not care about the model's shape.
        block_shape = [1, 2, 1, 1, block_bytes // 2]."""
        if isinstance(block_bytes, bool) or block_bytes < 2 or block_bytes % 2 != 0:
            raise ConfigError(
                f"block_bytes: {block_bytes!r} is invalid; expected an even byte count >= 2"
            )
        return cls(
            num_layers=1,
            num_kv_heads=1,
            head_dim=block_bytes // 2,
            block_tokens=1,
            dtype=torch.uint8,
        )

    @property
    def dtype_bytes(self) -> int:
        return self.dtype.itemsize

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """[num_layers, num_kv_planes (K, V), block_tokens, num_kv_heads, head_dim]."""
        return (
            self.num_layers, self.num_kv_planes, self.block_tokens, self.num_kv_heads,
            self.head_dim,
        )  # fmt: skip

    @property
    def block_numel(self) -> int:
        return self.block_bytes // self.dtype_bytes

    @property
    def token_bytes(self) -> int:
        """KV bytes per token, by the description's formula:
        planes (2) x layers x kv_heads x head_dim x dtype bytes."""
        return kv_bytes_per_token(
            num_layers=self.num_layers, num_kv_planes=self.num_kv_planes,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, value_bytes=self.dtype_bytes,
        )  # fmt: skip

    @property
    def block_bytes(self) -> int:
        return self.token_bytes * self.block_tokens
