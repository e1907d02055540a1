"""How a KV block is stored in the remote tier: one key, one self-checking value.

One key per block and nothing else: a store that evicts keys on its own (Redis
under `maxmemory`) can drop a block, never half of one. The value carries its
own header, so a reader needs no second lookup and trusts nothing it cannot
check, not even that it was found under the right key:

    key   = b"<namespace>:<key hex>"      namespace: model, dtype, block size apart
                                          (default: the model fingerprint)
    value = header (40 bytes) | payload (block_bytes, the pool's bytes as they are)

    header, little-endian (struct "<4sHH8s8sQII"):
      offset  size  field
           0     4  magic            b"KVSB"
           4     2  format version   FORMAT_VERSION; any change to this table bumps it
           6     2  header bytes     40 (lets a reader name a future, longer header)
           8     8  layout fingerprint  `layout_fingerprint(layout)`
          16     8  key digest       `key_digest(store key)`: blake2b-64 of the whole
                                     key, b"<namespace>:<key hex>"
          24     8  payload bytes    == block_bytes
          32     4  checksum         zlib.crc32(payload)
          36     4  reserved         zero (anything else is rejected as "version")

Version 1 (a 32-byte header without the key digest) is rejected as "version".

Nothing read from the store is evaluated: the header is unpacked with
`struct`, the payload is copied as bytes. `decode` checks, in order, the
value's size, magic, version, layout fingerprint, key digest, payload length
and checksum; the first that fails names the reason, and the caller treats
the block as a miss (and deletes the value).

The checksum is zlib's CRC-32: it catches torn, truncated and bit-flipped
values (not an adversary, whom the store's ACLs keep out). Measured on 1 MiB on
the development machine: zlib.crc32 about 0.6 ms (1.7 GB/s), blake2b with an
8-byte digest about 2.1 ms (0.5 GB/s); zlib releases the GIL on large
buffers, so read lanes check values in parallel.

The key digest catches a whole, intact value under another key (a RENAME, values
swapped between keys, a copy into another namespace): its CRC holds, so only
the block's identity can tell. It is a field of its own, not the CRC continued
over the key, so such a value is named ("key", not "checksum") and the
payload's CRC stays the payload's alone. Hashing the ~80-byte key costs about
2 us per block whatever the block size (the CRC of 1 MiB: 0.6 ms), and 8 bytes
of blake2b make two keys agreeing by chance a 2**-64 event (a CRC-32 over the
key: 2**-32, and linear).
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from kvswap.base.identity import KEY_BYTES, key_hex
from kvswap.base.remote_names import namespace_problem
from kvswap.errors import ConfigError

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from kvswap.data.layout import KVLayout

MAGIC = b"KVSB"
FORMAT_VERSION = 2
_HEADER = struct.Struct("<4sHH8s8sQII")
HEADER_BYTES = _HEADER.size  # 40
LAYOUT_FINGERPRINT_BYTES = 8
KEY_DIGEST_BYTES = 8
#: Longest namespace accepted (characters); keys stay short next to their values.

RejectReason = Literal["short", "magic", "version", "layout", "key", "length", "checksum"]


@dataclass(frozen=True)
class Rejected:
    """A stored value that failed a check: the block is a miss."""

    reason: RejectReason


def layout_fingerprint(layout: KVLayout) -> bytes:
    """8 bytes that differ whenever two layouts' block bytes would mean different
    things: shape, planes, dtype. Stable across processes and machines."""
    text = (
        f"kvswap-layout-v1:{layout.num_layers}:{layout.num_kv_planes}:{layout.block_tokens}:"
        f"{layout.num_kv_heads}:{layout.head_dim}:{layout.dtype}"
    )
    return hashlib.blake2b(text.encode("ascii"), digest_size=LAYOUT_FINGERPRINT_BYTES).digest()


def key_digest(store_key: bytes) -> bytes:
    """8 bytes naming `store_key` (`key_name`'s bytes: the namespace included)."""
    return hashlib.blake2b(
        store_key, digest_size=KEY_DIGEST_BYTES, person=b"kvswap-key-v1"
    ).digest()


def check_namespace(namespace: str, *, cluster: bool = False) -> str:
    """`namespace` if usable as a key prefix (`namespace_problem`; `cluster`: on one)."""
    problem = namespace_problem(namespace, cluster=cluster)
    if problem is not None:
        raise ConfigError(f"remote_namespace {namespace!r:.80}: {problem}")
    return namespace


def key_name(namespace: str, key: bytes) -> bytes:
    """The store key of block `key`: b"<namespace>:<64 hex digits>"."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"block keys are {KEY_BYTES} bytes, got {len(key)}")
    return f"{namespace}:{key_hex(key)}".encode()


def encode(payload: Buffer, fingerprint: bytes, store_key: bytes) -> bytearray:
    """Header + `payload` in one new buffer (one copy of the payload), for
    `store_key`."""
    value = bytearray(HEADER_BYTES + memoryview(payload).nbytes)
    encode_into(value, payload, fingerprint, store_key)
    return value


def encode_into(
    buffer: bytearray, payload: Buffer, fingerprint: bytes, store_key: bytes
) -> memoryview:
    """Header + `payload` for `store_key`, written into the start of `buffer`
    (reused by a writer, so nothing is allocated per block); returns the view of
    the value's bytes."""
    view = memoryview(payload).cast("B")
    value_bytes = HEADER_BYTES + view.nbytes
    if len(buffer) < value_bytes:
        raise ValueError(f"buffer of {len(buffer)} bytes cannot hold a {value_bytes}-byte value")
    fields = (
        MAGIC, FORMAT_VERSION, HEADER_BYTES, fingerprint, key_digest(store_key), view.nbytes,
        zlib.crc32(view), 0,
    )  # fmt: skip
    _HEADER.pack_into(buffer, 0, *fields)
    value = memoryview(buffer)[:value_bytes]
    value[HEADER_BYTES:] = view
    return value


def decode(
    value: Buffer, fingerprint: bytes, block_bytes: int, store_key: bytes
) -> memoryview | Rejected:
    """The payload of a `value` found under `store_key` (a view into it, no
    copy), or why it is not that block in this layout."""
    view = memoryview(value).cast("B")
    if view.nbytes < HEADER_BYTES:
        return Rejected("short")
    fields = _HEADER.unpack_from(view)
    magic, version, header_bytes, stored_fingerprint, stored_key_digest = fields[:5]
    payload_bytes, checksum, reserved = fields[5:]
    if magic != MAGIC:
        return Rejected("magic")
    if version != FORMAT_VERSION or header_bytes != HEADER_BYTES or reserved != 0:
        return Rejected("version")
    if stored_fingerprint != fingerprint:
        return Rejected("layout")
    if stored_key_digest != key_digest(store_key):
        return Rejected("key")
    if payload_bytes != block_bytes or view.nbytes - HEADER_BYTES != payload_bytes:
        return Rejected("length")
    payload = view[HEADER_BYTES:]
    if zlib.crc32(payload) != checksum:
        return Rejected("checksum")
    return payload
