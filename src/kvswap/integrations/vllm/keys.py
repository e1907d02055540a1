"""vLLM's chunk keys in kvswap's key space, under THE identity of the bytes (`kv_identity`).

vLLM names an offloaded chunk by its `OffloadKey`: the block hash (a SHA-256
chain over the tokens, seeded the same in every process unless PYTHONHASHSEED
says otherwise) and the KV cache group. It says nothing of the model, so a
store shared by two models would mix their KV. kvswap's secondary tiers take
32-byte keys; each OffloadKey becomes `identity.foreign_key` under the root of
the `KvIdentity` of vLLM's chunks: the weights' digest and config.json of the
checkpoint vLLM serves (found by its path, or in the Hugging Face cache for a hub
id: never the path or the name itself, so a checkpoint redeployed at one path is
another model), the KV dtype, vLLM's KV cache layout, the chunk's tokens and bytes,
and the parallel sizes. The store's key prefix is derived from the same identity.
vLLM-free.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

from kvswap.base.identity import foreign_key
from kvswap.errors import ConfigError
from kvswap.model.kv_identity import KvIdentity, Shard, checkpoint_identity, find_checkpoint


class VllmKeys:
    """Maps vLLM's OffloadKeys to kvswap keys under one `KvIdentity`."""

    def __init__(self, identity: KvIdentity) -> None:
        self.identity = identity
        self._root = identity.namespace().root_key()

    @property
    def store_prefix(self) -> str:
        """The Redis key prefix: short, printable, one per identity."""
        return "kvswap-vllm-" + hashlib.sha256(self._root).hexdigest()[:16]

    def key(self, offload_key: bytes) -> bytes:
        return foreign_key(self._root, bytes(offload_key))


def vllm_identity(
    config: Any, *, tokens_per_chunk: int, row_bytes: int, shared: bool, source: str
) -> KvIdentity:
    """The identity of the chunks of vLLM's `OffloadingConfig` (`config`: its model's
    name and KV dtype, parallel sizes and KV cache layout). `shared`: the keys leave
    this process (a store): a checkpoint whose weights cannot be read here is then a
    one-line error naming `source`; otherwise its chunks get an identity of their own
    that nothing else can share."""
    name = str(config.model.name)
    directory = find_checkpoint(name)
    if directory is not None:
        found = checkpoint_identity(directory)
        weights, model_config = found.weights, found.config
    elif shared:
        raise ConfigError(
            f"{source}: kvswap names a shared store's KV by the checkpoint's weights and "
            f"config, and cannot read those of model {name!r} here; allowed: a model that is "
            "a local directory with config.json and *.safetensors, or a hub id in the local "
            "Hugging Face cache"
        )
    else:
        weights = model_config = "unread-" + secrets.token_hex(16)
    parallel = config.parallel
    context_parallel = int(getattr(parallel, "pcp_size", 1)) * int(getattr(parallel, "dcp_size", 1))
    return KvIdentity(
        compute="vllm",
        weights=weights,
        config=model_config,
        kv_dtype=str(config.model.dtype),
        layout=f"vllm-offload-chunk/{getattr(config, 'kv_cache_layout', None)}",
        block_tokens=tokens_per_chunk,
        block_bytes=row_bytes * int(parallel.world_size),
        shard=Shard(
            tp_size=int(parallel.tp_size), pp_size=int(parallel.pp_size), cp_size=context_parallel
        ),
    )
