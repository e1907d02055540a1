"""vLLM's chunk keys in kvswap's key space, under a namespace of the model and layout.

vLLM names an offloaded chunk by its `OffloadKey`: the block hash (a SHA-256
chain over the tokens, seeded the same in every process unless PYTHONHASHSEED
says otherwise) and the KV cache group. It says nothing of the model, so a
store shared by two models would mix their KV. kvswap's secondary tiers take
32-byte keys; each OffloadKey becomes `identity.foreign_key` under the root of
a `KeyNamespace` naming the model, its KV dtype, the chunk's tokens and bytes.
The store's key prefix is derived from the same namespace. vLLM-free.
"""

from __future__ import annotations

import hashlib

from kvswap.control.identity import KeyNamespace, foreign_key


class VllmKeys:
    """Maps vLLM's OffloadKeys to kvswap keys for one model and host layout."""

    def __init__(
        self, model: str, kv_dtype: str, tokens_per_chunk: int, row_bytes: int, world_size: int
    ) -> None:
        self.namespace = KeyNamespace(
            model_fingerprint=(
                f"vllm-offload:model={model}:kv_dtype={kv_dtype}:row_bytes={row_bytes}:"
                f"world_size={world_size}"
            ),
            block_tokens=tokens_per_chunk,
        )
        self._root = self.namespace.root_key()

    @property
    def store_prefix(self) -> str:
        """The Redis key prefix: short, printable, one per namespace."""
        return "kvswap-vllm-" + hashlib.sha256(self._root).hexdigest()[:16]

    def key(self, offload_key: bytes) -> bytes:
        return foreign_key(self._root, bytes(offload_key))
