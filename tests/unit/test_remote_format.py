"""The remote tier's value format, on byte strings (no server).

One value per block: a 40-byte header (magic, version, layout fingerprint, key
digest, payload length, CRC-32) and the block's bytes. Every way a value can be
wrong is a named rejection, any single changed byte is caught, and a value read
under any key but its own is rejected.
"""

from __future__ import annotations

import struct
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvswap.data.layout import KVLayout
from kvswap.data.remote_format import (
    FORMAT_VERSION,
    HEADER_BYTES,
    MAGIC,
    Rejected,
    check_namespace,
    decode,
    encode,
    key_digest,
    key_name,
    layout_fingerprint,
)
from kvswap.errors import ConfigError

FINGERPRINT = bytes(range(1, 9))
OTHER_FINGERPRINT = bytes(range(2, 10))
NAME = key_name("ns", bytes(range(32)))  # the store key a value is written under
OTHER_NAME = key_name("ns", bytes(range(1, 33)))


def test_the_header_bytes_are_pinned() -> None:
    # A change here is a format change: bump FORMAT_VERSION with it.
    value = encode(b"abcd", b"\x01" * 8, NAME)
    assert bytes(value) == bytes.fromhex(
        "4b565342"  # magic "KVSB"
        "0200" "2800"  # version 2, header 40 bytes
        "0101010101010101"  # layout fingerprint
        + key_digest(NAME).hex()  # the store key's digest
        + "0400000000000000"  # payload bytes
        "11cd82ed"  # crc32(b"abcd"), little-endian
        "00000000"  # reserved
        "61626364"  # the payload
    )  # fmt: skip
    assert HEADER_BYTES == 40 and MAGIC == b"KVSB" and FORMAT_VERSION == 2
    assert struct.unpack_from("<I", value, 32)[0] == zlib.crc32(b"abcd")
    # The digest is blake2b-64 of the whole store key, namespace included, pinned too.
    assert key_digest(b"ns:" + b"00" * 32).hex() == "444b0df2f6e02f99"


def test_round_trip_returns_a_view_of_the_payload_without_copying() -> None:
    payload = bytes(range(256)) * 16
    value = bytes(encode(payload, FINGERPRINT, NAME))
    decoded = decode(value, FINGERPRINT, len(payload), NAME)
    assert isinstance(decoded, memoryview)
    assert decoded.tobytes() == payload
    assert decoded.obj is value  # a view into the stored value


def test_encode_takes_any_contiguous_buffer() -> None:
    block = torch.arange(64, dtype=torch.int16)
    value = encode(block.numpy().data, FINGERPRINT, NAME)
    decoded = decode(value, FINGERPRINT, block.numel() * 2, NAME)
    assert isinstance(decoded, memoryview)
    assert decoded.tobytes() == block.numpy().tobytes()


def _with(value: bytes, offset: int, replacement: bytes) -> bytes:
    return value[:offset] + replacement + value[offset + len(replacement) :]


GOOD = bytes(encode(b"0123456789abcdef", FINGERPRINT, NAME))


@pytest.mark.parametrize(
    ("value", "block_bytes", "reason"),
    [
        (b"", 16, "short"),
        (GOOD[: HEADER_BYTES - 1], 16, "short"),
        (_with(GOOD, 0, b"X"), 16, "magic"),
        (_with(GOOD, 4, struct.pack("<H", 3)), 16, "version"),
        (_with(GOOD, 6, struct.pack("<H", 48)), 16, "version"),
        (_with(GOOD, 36, b"\x01"), 16, "version"),
        (_with(GOOD, 8, OTHER_FINGERPRINT), 16, "layout"),
        (_with(GOOD, 16, key_digest(OTHER_NAME)), 16, "key"),
        (GOOD, 32, "length"),  # a block of another size
        (GOOD[:-1], 16, "length"),  # truncated
        (GOOD + b"!", 16, "length"),  # trailing bytes
        (_with(GOOD, 24, struct.pack("<Q", 15)), 16, "length"),
        (_with(GOOD, HEADER_BYTES + 3, b"#"), 16, "checksum"),
        (_with(GOOD, 32, b"\x00\x00\x00\x00"), 16, "checksum"),
    ],
)
def test_every_failing_check_names_its_reason(value: bytes, block_bytes: int, reason: str) -> None:
    assert decode(value, FINGERPRINT, block_bytes, NAME) == Rejected(reason)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "other",
    [
        OTHER_NAME,  # another block of the same namespace (values swapped, a RENAME)
        key_name("ns2", bytes(range(32))),  # the same block key in another namespace
        NAME[:-1] + b"0",  # one hex digit apart
    ],
)
def test_a_value_read_under_another_key_is_rejected_as_key(other: bytes) -> None:
    # Regression: an intact value under another key passed every check (layout,
    # length, CRC) and was restored as the wrong block.
    assert other != NAME
    assert decode(GOOD, FINGERPRINT, 16, other) == Rejected("key")
    assert isinstance(decode(GOOD, FINGERPRINT, 16, NAME), memoryview)


def test_a_version_1_value_is_rejected_as_version() -> None:
    # The 32-byte header before the key digest: rejected, deleted, written again.
    payload = b"0123456789abcdef"
    header = struct.pack("<4sHH8sQII", MAGIC, 1, 32, FINGERPRINT, 16, zlib.crc32(payload), 0)
    old = header + payload + bytes(8)  # as long as a version-2 value of this block
    assert decode(old, FINGERPRINT, 16, NAME) == Rejected("version")


@settings(max_examples=200, deadline=None)
@given(payload=st.binary(min_size=1, max_size=512), data=st.data())
def test_any_single_changed_byte_is_rejected(payload: bytes, data: st.DataObject) -> None:
    value = bytearray(encode(payload, FINGERPRINT, NAME))
    assert isinstance(decode(value, FINGERPRINT, len(payload), NAME), memoryview)
    offset = data.draw(st.integers(0, len(value) - 1), label="offset")
    value[offset] ^= data.draw(st.integers(1, 255), label="xor")
    assert isinstance(decode(value, FINGERPRINT, len(payload), NAME), Rejected)


def _layout(**changes: object) -> KVLayout:
    fields: dict[str, object] = {
        "num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "block_tokens": 16,
        "dtype": torch.float16,
    }  # fmt: skip
    fields.update(changes)
    return KVLayout(**fields)  # type: ignore[arg-type]


def test_layout_fingerprint_is_stable_and_tells_layouts_apart() -> None:
    assert layout_fingerprint(_layout()).hex() == "667acfdc92dfd3a3"  # stable across runs
    variants = [
        _layout(),
        _layout(dtype=torch.bfloat16),
        _layout(num_kv_heads=4, head_dim=256),  # same block bytes, other meaning
        _layout(block_tokens=32),
        _layout(num_layers=16, block_tokens=32),
        _layout(num_kv_planes=1),
    ]
    fingerprints = {layout_fingerprint(layout) for layout in variants}
    assert len(fingerprints) == len(variants)
    assert all(len(fp) == 8 for fp in fingerprints)


def test_key_names_are_the_namespace_and_the_key_in_hex() -> None:
    key = bytes(range(32))
    assert key_name("llama-8b:fp16", key) == b"llama-8b:fp16:" + key.hex().encode()
    with pytest.raises(ValueError, match="32 bytes"):
        key_name("ns", b"short")


@pytest.mark.parametrize("namespace", ["", "has space", "tab\there", "nl\n", "x" * 201, "\x00"])
def test_a_bad_namespace_is_one_line(namespace: str) -> None:
    with pytest.raises(ConfigError, match="remote_namespace") as caught:
        check_namespace(namespace)
    assert "\n" not in str(caught.value)


def test_a_good_namespace_is_kept() -> None:
    assert check_namespace("0f3a9c:kv-v1") == "0f3a9c:kv-v1"
