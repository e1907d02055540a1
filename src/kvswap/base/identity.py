"""Block identity: a stable, collision-proof key for the KV of a token prefix.

A full block's KV is a function of every token before and in it, and of what
produced it (the model, the block size, the KV layout). Its key is therefore a
chain: a SHA-256 digest over the parent block's key and the block's own token
ids, rooted in a namespace key that fixes the model and layout (and, per
request, an optional cache salt so tenants share KV only when they share the
salt). Keys are plain bytes, equal across processes, runs and machines: no
`hash()`, no per-process randomization. They are meant to outlive a process
(the key format of a shared remote tier), so the byte format below is stable;
any change to it bumps `KEY_FORMAT_VERSION`, which is hashed into every key.

Byte format, version 1 (all integers little-endian; u8/u32 unsigned, i64
two's-complement signed):

    root_key  = SHA-256( b"kvswap/root\\x00"                  12 bytes, domain tag
                         u8  KEY_FORMAT_VERSION              = 1
                         u32 layout_version
                         u32 block_tokens
                         u32 len(fingerprint) | fingerprint   UTF-8 bytes
                         u8  0                                no salt (None or "")
                       | u8  1 | u32 len(salt) | salt         UTF-8 bytes )

    chain_key = SHA-256( b"kvswap/block\\x00"                 13 bytes, domain tag
                         u8  KEY_FORMAT_VERSION              = 1
                         parent_key                          32 bytes (root or block key)
                         u32 num_tokens
                         i64 x num_tokens                     token ids in order )

    foreign_key = SHA-256( b"kvswap/foreign\\x00"               15 bytes, domain tag
                           u8  KEY_FORMAT_VERSION            = 1
                           root_key                          32 bytes
                           u32 len(foreign_id) | foreign_id  the other engine's bytes )

A foreign key names a block that another engine identifies itself: vLLM's
`OffloadKey` (its block hash, a chain over the tokens like ours, and its KV
cache group). The root key puts it under a namespace (model, layout), since
such an id is only as specific as that engine made it.

Every variable-length field is length-prefixed and the parent key has a fixed
size, so no two different inputs serialize to the same bytes; the distinct
domain tags keep a root key from ever equalling a block key. Token ids are any
integers in [-2**63, 2**63 - 1] (in practice non-negative: vocabulary ids, or
Mooncake hash ids standing in for tokens in the simulator).

Torch-free: the standard library and `kvswap.errors` only, like the rest of `control/`.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from kvswap.errors import KvSwapError

#: Hashed into every key: bump it whenever the byte format above changes.
KEY_FORMAT_VERSION = 1
#: Size of every key (SHA-256).
KEY_BYTES = 32
#: Longest cache salt accepted (characters).
MAX_CACHE_SALT_CHARS = 256

_ROOT_TAG = b"kvswap/root\x00" + struct.pack("<B", KEY_FORMAT_VERSION)
_BLOCK_TAG = b"kvswap/block\x00" + struct.pack("<B", KEY_FORMAT_VERSION)
_FOREIGN_TAG = b"kvswap/foreign\x00" + struct.pack("<B", KEY_FORMAT_VERSION)
_U32_MAX = 2**32 - 1


def _length_prefixed(field: str, text: str) -> bytes:
    data = text.encode("utf-8")
    if len(data) > _U32_MAX:
        raise KvSwapError(f"{field} is {len(data)} bytes long; allowed: at most {_U32_MAX}")
    return struct.pack("<I", len(data)) + data


@dataclass(frozen=True)
class KeyNamespace:
    """What makes KV reusable: the same model, block size and KV layout.

    `model_fingerprint` must change whenever the KV bytes for the same tokens
    would (another checkpoint, dtype, RoPE scaling...); `layout_version` when the
    block's byte layout does. Two stores share KV only under equal namespaces.
    """

    model_fingerprint: str
    block_tokens: int
    layout_version: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.model_fingerprint, str) or not self.model_fingerprint:
            raise KvSwapError(
                f"model_fingerprint = {self.model_fingerprint!r}; allowed: a non-empty string"
            )
        for name, value in (
            ("block_tokens", self.block_tokens),
            ("layout_version", self.layout_version),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _U32_MAX:
                raise KvSwapError(f"{name} = {value!r}; allowed: an integer in 1..{_U32_MAX}")

    def root_key(self, cache_salt: str | None = None) -> bytes:
        """The parent key of a sequence's first block.

        None and "" both mean "no salt" and give the same key; any non-empty
        salt gives a different one (it is flagged and length-prefixed).
        """
        parts = [
            _ROOT_TAG,
            struct.pack("<II", self.layout_version, self.block_tokens),
            _length_prefixed("model_fingerprint", self.model_fingerprint),
        ]
        salt = check_cache_salt(cache_salt)
        if salt is None:
            parts.append(b"\x00")
        else:
            parts.append(b"\x01" + _length_prefixed("cache_salt", salt))
        return hashlib.sha256(b"".join(parts)).digest()


def check_cache_salt(cache_salt: object) -> str | None:
    """`cache_salt` if a key can be salted with it, None for no salt (None or ""); one
    line naming the rule otherwise. The scheduler refuses a request whose salt fails
    this, so no sequence reaches `root_key` with one."""
    if cache_salt is None or cache_salt == "":
        return None
    if not isinstance(cache_salt, str) or len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise KvSwapError(
            f"cache_salt = {cache_salt!r:.60}; allowed: None or a string of at most "
            f"{MAX_CACHE_SALT_CHARS} characters"
        )
    try:
        cache_salt.encode("utf-8")
    except UnicodeEncodeError as error:
        raise KvSwapError(
            f"cache_salt: a lone surrogate at character {error.start} is not text; allowed: "
            "valid Unicode"
        ) from None
    return cache_salt


@lru_cache(maxsize=64)
def _count_and_int64s(num_tokens: int) -> struct.Struct:
    """u32 count + that many i64, little-endian on any host. Cached per block size:
    packing through a compiled Struct is the cheapest serialization measured
    (benchmarks/identity_cost.py), and a store uses one or two sizes."""
    return struct.Struct(f"<I{num_tokens}q")


def chain_key(parent_key: bytes, token_ids: Sequence[int]) -> bytes:
    """Key of a full block: its parent's key (root or block) and its token ids."""
    if len(parent_key) != KEY_BYTES:
        raise ValueError(f"parent key is {len(parent_key)} bytes; keys are {KEY_BYTES}")
    try:
        tokens = _count_and_int64s(len(token_ids)).pack(len(token_ids), *token_ids)
    except struct.error:
        raise KvSwapError(
            f"token ids {list(token_ids)[:4]}...: one is not an integer in range; "
            "allowed: integers in [-2**63, 2**63 - 1]"
        ) from None
    return hashlib.sha256(_BLOCK_TAG + parent_key + tokens).digest()


def foreign_key(root_key: bytes, foreign_id: bytes) -> bytes:
    """Key of a block another engine names `foreign_id`, under the namespace whose
    root key is `root_key` (the module docstring's byte format)."""
    if len(root_key) != KEY_BYTES:
        raise ValueError(f"root key is {len(root_key)} bytes; keys are {KEY_BYTES}")
    if not 1 <= len(foreign_id) <= _U32_MAX:
        raise ValueError(f"a foreign id is 1 to {_U32_MAX} bytes, got {len(foreign_id)}")
    size = struct.pack("<I", len(foreign_id))
    return hashlib.sha256(_FOREIGN_TAG + root_key + size + foreign_id).digest()


def key_hex(key: bytes) -> str:
    """A key as lowercase hex (64 characters): for logs and a remote tier's key names."""
    return key.hex()
