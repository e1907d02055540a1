"""Deterministic token ids for workloads that have lengths but no text.

Synthetic workloads and request traces give lengths and, for traces, block
hashes; the engine needs concrete token ids. Two rules make those ids useful:

- equal block hash -> equal tokens, so prefix caching sees exactly the
  sharing the trace describes (and no sharing it does not);
- the same inputs give the same ids on every run and platform: nothing uses
  the global generator or `hash()` (salted per process for strings).

Free-form streams (synthetic prompts) are `random.Random`s seeded from a
string (`seeded_rng`; a str seed is hashed with SHA-512, not `hash()`).

Block tokens are counter-based instead: token i of block h is
splitmix64(splitmix64(h + salt * K) + (i + 1) * GOLDEN) mod vocab_size, a
pure function of (salt, hash id, position) whatever the block size. That lets
numpy make all the new blocks of a prompt in one vectorised call (a trace of
12k requests with ~12k-token prompts would otherwise spend minutes seeding a
generator per block); each block is then cached as a tuple, once per distinct
hash id, and a prompt is a concatenation of cached tuples.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvswap.errors import KvSwapError
from kvswap.units import ceil_div

_MASK_64 = (1 << 64) - 1
_GOLDEN_64 = 0x9E3779B97F4A7C15  # splitmix64's increment (2**64 / golden ratio)
_SALT_MULTIPLIER = 0xD1B54A32D192ED03  # spreads salts far apart in the seed space

U64Array = npt.NDArray[np.uint64]


def random_token_ids(rng: random.Random, num_tokens: int, vocab_size: int) -> tuple[int, ...]:
    """`num_tokens` ids drawn uniformly from [0, vocab_size) with `rng`."""
    # choices() without weights is floor(random() * n) in a tight loop: about
    # 5x faster than randrange per token, and just as reproducible.
    return tuple(rng.choices(range(vocab_size), k=num_tokens))


def seeded_rng(*key: object) -> random.Random:
    """A private generator for `key` (ints and strings), stable across runs and platforms."""
    return random.Random(":".join(str(part) for part in ("kvswap", *key)))


def _splitmix64(state: U64Array) -> U64Array:
    # The splitmix64 output function; uint64 array arithmetic wraps mod 2**64.
    z = state
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class BlockTokenSynthesizer:
    """Token ids for hashed prefix blocks: block tokens depend only on (salt, hash id).

    A shorter block size yields a prefix of the same tokens. The modulo bias
    is below vocab_size / 2**64: nil.
    """

    def __init__(self, *, vocab_size: int, block_tokens: int, salt: int = 0) -> None:
        if vocab_size < 1:
            raise KvSwapError(f"vocab_size = {vocab_size}: allowed >= 1")
        if block_tokens < 1:
            raise KvSwapError(f"block_tokens = {block_tokens}: allowed >= 1")
        self.vocab_size = vocab_size
        self.block_tokens = block_tokens
        self.salt = salt
        self._blocks: dict[int, tuple[int, ...]] = {}
        # (1, block_tokens): the per-position counter offsets of the stream.
        positions = np.arange(1, block_tokens + 1, dtype=np.uint64)
        self._offsets: U64Array = (positions * np.uint64(_GOLDEN_64)).reshape(1, -1)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._blocks)

    def _make_blocks(self, hash_ids: Sequence[int]) -> None:
        """Compute and cache the blocks of `hash_ids` (distinct, not cached yet)."""
        salt_key = self.salt * _SALT_MULTIPLIER
        seeds = np.array([(h + salt_key) & _MASK_64 for h in hash_ids], dtype=np.uint64)
        states = _splitmix64(seeds).reshape(-1, 1) + self._offsets  # (blocks, block_tokens)
        tokens = _splitmix64(states) % np.uint64(self.vocab_size)
        for hash_id, row in zip(hash_ids, tokens.tolist(), strict=True):
            self._blocks[hash_id] = tuple(row)

    def block(self, hash_id: int) -> tuple[int, ...]:
        """The `block_tokens` ids of block `hash_id` (cached)."""
        if hash_id not in self._blocks:
            self._make_blocks([hash_id])
        return self._blocks[hash_id]

    def prompt(self, hash_ids: Sequence[int], num_tokens: int) -> tuple[int, ...]:
        """The first `num_tokens` ids of the blocks `hash_ids` laid end to end.

        The last block used may be partial; hash ids past `num_tokens` are not
        touched. Raises KvSwapError if the blocks hold fewer than `num_tokens`.
        """
        num_blocks = ceil_div(num_tokens, self.block_tokens)
        if num_blocks > len(hash_ids):
            raise KvSwapError(
                f"{num_tokens} prompt tokens need {num_blocks} blocks of {self.block_tokens} "
                f"tokens; {len(hash_ids)} hash ids given"
            )
        used = hash_ids[:num_blocks]
        missing = [h for h in dict.fromkeys(used) if h not in self._blocks]
        if missing:
            self._make_blocks(missing)
        pieces: list[int] = []
        for hash_id in used:
            pieces.extend(self._blocks[hash_id])
        del pieces[num_tokens:]  # the last block may be partial
        return tuple(pieces)
