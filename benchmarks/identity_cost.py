"""Cost of one block key (`identity.chain_key`) at 16 and 512 tokens per block.

Measured side by side in one run: the key as built (SHA-256), the same bytes
through BLAKE2b-256 (the alternative the format could have used), and the
serialization alone (token ids -> little-endian int64 bytes, by the compiled
Struct chain_key uses and by array("q")), which is most of the cost at 512
tokens. Token ids are large (around 2**40, like Mooncake hash
ids) so no small-int shortcut flatters the figure. Prints one JSON line.
"""

from __future__ import annotations

import hashlib
import json
import struct
import timeit
from array import array
from collections.abc import Callable
from functools import partial

from kvswap.base.identity import KeyNamespace, chain_key

BLOCK_SIZES_TOKENS = (16, 512)
REPEATS = 7


def best_ns_per_call(functions: dict[str, Callable[[], object]], number: int) -> dict[str, float]:
    """Best of a few repeats, taken in turns so that load from other work on a shared
    machine disturbs every candidate alike."""
    best_s = {name: float("inf") for name in functions}
    for _ in range(REPEATS):
        for name, function in functions.items():
            best_s[name] = min(best_s[name], timeit.timeit(function, number=number))
    return {name: seconds / number * 1e9 for name, seconds in best_s.items()}


def blake2b_key(parent_key: bytes, token_ids: list[int]) -> bytes:
    """chain_key's bytes digested by BLAKE2b-256 instead (for comparison only)."""
    count = len(token_ids)
    data = b"kvswap/block\x00\x01" + parent_key + struct.pack(f"<I{count}q", count, *token_ids)
    return hashlib.blake2b(data, digest_size=32).digest()


def serialize_array(token_ids: list[int]) -> bytes:
    """The other serialization considered: array("q") (native order; a byteswap on
    big-endian hosts), slower than chain_key's compiled Struct for big ids."""
    return array("q", token_ids).tobytes()


def sha256_digest(message: bytes) -> bytes:
    return hashlib.sha256(message).digest()


def blake2b_digest(message: bytes) -> bytes:
    return hashlib.blake2b(message, digest_size=32).digest()


def serialize_struct(packer: struct.Struct, token_ids: list[int]) -> bytes:
    return packer.pack(len(token_ids), *token_ids)


def section_identity_cost() -> dict[str, float]:
    root = KeyNamespace("bench", 16).root_key()
    report: dict[str, float] = {}
    for block_tokens in BLOCK_SIZES_TOKENS:
        ids = [2**40 + 7 * i for i in range(block_tokens)]
        message = root + serialize_array(ids)  # the bytes a key digests (about)
        number = 20_000 if block_tokens <= 16 else 4_000
        timings = best_ns_per_call(
            {
                "sha256": partial(chain_key, root, ids),
                "blake2b": partial(blake2b_key, root, ids),
                "serialize_struct": partial(
                    serialize_struct, struct.Struct(f"<I{block_tokens}q"), ids
                ),
                "serialize_array": partial(serialize_array, ids),
                "sha256_digest_only": partial(sha256_digest, message),
                "blake2b_digest_only": partial(blake2b_digest, message),
            },
            number,
        )
        sha, blake = timings["sha256"], timings["blake2b"]
        report[f"sha256_ns_per_key_{block_tokens}_tokens"] = sha
        report[f"blake2b_ns_per_key_{block_tokens}_tokens"] = blake
        report[f"serialize_struct_ns_{block_tokens}_tokens"] = timings["serialize_struct"]
        report[f"serialize_array_ns_{block_tokens}_tokens"] = timings["serialize_array"]
        report[f"sha256_digest_only_ns_{block_tokens}_tokens"] = timings["sha256_digest_only"]
        report[f"blake2b_digest_only_ns_{block_tokens}_tokens"] = timings["blake2b_digest_only"]
        report[f"blake2b_vs_sha256_ratio_{block_tokens}_tokens"] = blake / sha
    report["sha256_ns_per_token_512_tokens"] = report["sha256_ns_per_key_512_tokens"] / 512
    return report


if __name__ == "__main__":
    result = section_identity_cost()
    for name, value in result.items():
        print(f"  {name:<40} {value:.2f}")
    print(json.dumps({name: round(value, 3) for name, value in result.items()}))
