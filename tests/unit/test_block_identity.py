"""Block identity: keys equal across processes, scoped by namespace and salt, and a
prefix hit that can never hand out KV computed after a different prefix."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from collections.abc import Sequence

import pytest

from kvswap.base import identity
from kvswap.base.identity import KeyNamespace, chain_key, key_hex
from kvswap.control.policy import PolicyOptions
from kvswap.control.store import BlockStore
from kvswap.control.store_records import StoreLayout
from kvswap.errors import KvSwapError
from kvswap.workload.request import Request

BT = 2  # tokens per block: two tokens fill one


def make_store(namespace: KeyNamespace | None = None, block_tokens: int = BT) -> BlockStore:
    return BlockStore(
        StoreLayout(block_tokens, 16, 0, 0, namespace),
        PolicyOptions(sink_protection=False, min_residency_steps=0),
    )


def run_prompt(
    store: BlockStore, seq_id: int, prompt: Sequence[int], cache_salt: str | None = None
) -> int:
    """Admit a sequence, compute what it did not hit, publish; returns how many blocks hit."""
    hits = store.open_sequence(seq_id, prompt, cache_salt=cache_salt)
    store.append_tokens(seq_id, prompt[len(hits) * store.block_tokens :])
    store.publish_computed()
    return len(hits)


def test_a_forced_collision_of_first_blocks_never_shares_kv_computed_after_the_other() -> None:
    # The bug this module fixes: the old index confirmed a hit's own tokens but not
    # its parent, so a collision between two FIRST blocks let a later block computed
    # after one of them be served to a sequence that starts with the other.
    real_chain_key = identity.chain_key

    def colliding(parent_key: bytes, token_ids: Sequence[int]) -> bytes:
        # [2,2] gets exactly the key of [1,1]; everything else keeps its real key.
        ids = [1, 1] if list(token_ids) == [2, 2] else list(token_ids)
        return real_chain_key(parent_key, ids)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(identity, "chain_key", colliding)
        store = make_store()
        # Sequence 1 caches [1,1].
        assert run_prompt(store, 1, [1, 1, 7]) == 0
        # Sequence 2 computes [2,2] (key taken by [1,1]: not indexed, and [1,1]'s
        # tokens differ, so no hit) and then [5,5] chained under that same key.
        assert run_prompt(store, 2, [2, 2, 5, 5, 9]) == 0
        two_two, five_five = store.sequence_blocks(2)[:2]
        one_one = store.sequence_blocks(1)[0]
        assert one_one.key is not None and two_two.key == one_one.key  # the collision is real
        # Sequence 3 looks [5,5] up under [1,1]'s key and finds sequence 2's block:
        # same key, same tokens, same parent KEY. Only its parent block ([2,2], not
        # [1,1]) gives it away. Sequence 3 may share [1,1], never that [5,5].
        assert real_chain_key(one_one.key, [5, 5]) == five_five.key
        assert five_five.parent_key == one_one.key and five_five.parent is two_two
        hits = store.open_sequence(3, [1, 1, 5, 5, 9])
        assert [block.block_id for block in hits] == [one_one.block_id]
        store.check_integrity()


def test_the_same_prompt_computed_twice_at_once_still_shares_what_follows_either_copy() -> None:
    # Two sequences admitted in one step both compute [1,1][2,2]; the first copy is
    # indexed, the second is not (its keys are taken). Sequence 2 then decodes [3,3],
    # whose parent is sequence 2's own [2,2]. A third sequence hits sequence 1's
    # [1,1][2,2] and still shares [3,3]: its parent holds the same prefix.
    store = make_store()
    for seq_id in (1, 2):
        assert store.open_sequence(seq_id, [1, 1, 2, 2, 0]) == []
    for seq_id in (1, 2):
        store.append_tokens(seq_id, [1, 1, 2, 2])
    store.publish_computed()
    store.append_tokens(2, [3, 3])
    store.publish_computed()
    hits = store.open_sequence(3, [1, 1, 2, 2, 3, 3, 4])
    first = store.sequence_blocks(1)
    assert [b.block_id for b in hits] == [
        first[0].block_id,
        first[1].block_id,
        store.sequence_blocks(2)[2].block_id,
    ]


def test_two_processes_with_different_hash_seeds_derive_the_same_keys() -> None:
    # Keys must be equal across processes and machines (a shared remote tier will be
    # addressed by them): nothing may depend on Python's per-process hash seed.
    cases = [([1, 2, 3, 4], None), ([2**40, 0, 7, 2**63 - 1], "tenant-a"), ([5] * 16, "")]
    code = (
        "import json, sys\n"
        "from kvswap.base.identity import KeyNamespace, chain_key\n"
        "ns = KeyNamespace('llama-3-8b/bf16', 4)\n"
        "out = []\n"
        "for ids, salt in json.loads(sys.argv[1]):\n"
        "    root = ns.root_key(salt)\n"
        "    out.append([root.hex(), chain_key(chain_key(root, ids), ids).hex()])\n"
        "print(json.dumps(out))\n"
    )
    namespace = KeyNamespace("llama-3-8b/bf16", 4)
    expected = []
    for ids, salt in cases:
        root = namespace.root_key(salt)
        expected.append([root.hex(), chain_key(chain_key(root, ids), ids).hex()])
    for seed in ("1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", code, json.dumps(cases)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        assert json.loads(result.stdout) == expected


def test_keys_follow_the_documented_byte_format() -> None:
    # The module docstring is the format spec; rebuild both keys from it by hand.
    namespace = KeyNamespace("m", 4, layout_version=3)
    root = hashlib.sha256(
        b"kvswap/root\x00\x01"
        + struct.pack("<II", 3, 4)
        + struct.pack("<I", 1)
        + b"m"
        + b"\x01"
        + struct.pack("<I", 4)
        + b"salt"
    ).digest()
    assert namespace.root_key("salt") == root
    block = hashlib.sha256(
        b"kvswap/block\x00\x01" + root + struct.pack("<I", 2) + struct.pack("<2q", 9, 2**40)
    ).digest()
    assert chain_key(root, [9, 2**40]) == block
    assert key_hex(block) == block.hex() and len(key_hex(block)) == 64
    foreign = hashlib.sha256(
        b"kvswap/foreign\x00\x01" + root + struct.pack("<I", 6) + b"k:abcd"
    ).digest()
    assert identity.foreign_key(root, b"k:abcd") == foreign


def test_a_cache_salt_scopes_prefix_sharing() -> None:
    store = make_store()
    prompt = [1, 2, 3, 4, 5]
    assert run_prompt(store, 1, prompt, cache_salt="tenant-a") == 0
    # Another tenant's salt (or none) shares nothing, even with identical tokens.
    assert run_prompt(store, 2, prompt, cache_salt="tenant-b") == 0
    assert run_prompt(store, 3, prompt) == 0
    # The same salt shares both full blocks of the prompt; so do None and "".
    assert run_prompt(store, 4, prompt, cache_salt="tenant-a") == 2
    assert run_prompt(store, 5, prompt, cache_salt="") == 2


def test_salts_are_length_prefixed_and_none_equals_empty() -> None:
    namespace = KeyNamespace("m", 16)
    assert namespace.root_key(None) == namespace.root_key("")
    salts = ["a", "ab", "b", "\x00", "a\x00"]
    roots = {namespace.root_key(salt) for salt in salts}
    assert len(roots) == len(salts)
    assert namespace.root_key(None) not in roots


def test_model_fingerprint_block_size_and_layout_version_change_every_key() -> None:
    base = KeyNamespace("llama-3-8b/bf16", 16)
    others = [
        KeyNamespace("llama-3-8b/fp8", 16),
        KeyNamespace("llama-3-8b/bf16", 32),
        KeyNamespace("llama-3-8b/bf16", 16, layout_version=2),
    ]
    ids = list(range(16))
    base_key = chain_key(base.root_key(), ids)
    for other in others:
        assert other.root_key() != base.root_key()
        assert chain_key(other.root_key(), ids) != base_key
    # A store roots its chains in the namespace it was built with.
    store = make_store(KeyNamespace("model-a", BT))
    run_prompt(store, 1, [1, 2, 3])
    first = store.sequence_blocks(1)[0]
    assert first.parent_key == KeyNamespace("model-a", BT).root_key()
    assert first.parent_key != KeyNamespace("model-b", BT).root_key()


def test_large_token_ids_work_and_out_of_range_ones_are_refused() -> None:
    # Mooncake hash ids stand in for token ids in the simulator: they can be huge.
    store = make_store()
    prompt = [2**40, 2**40, 2**63 - 1, 2**63 - 1, 3]
    assert run_prompt(store, 1, prompt) == 0
    assert run_prompt(store, 2, prompt) == 2
    root = KeyNamespace("m", 2).root_key()
    assert chain_key(root, [2**40, 1]) != chain_key(root, [2**40 + 1, 1])
    with pytest.raises(KvSwapError, match="token id"):
        chain_key(root, [2**63, 0])


def test_bad_namespace_salt_and_request_values_are_one_line_errors() -> None:
    with pytest.raises(KvSwapError, match="model_fingerprint"):
        KeyNamespace("", 16)
    with pytest.raises(KvSwapError, match="block_tokens = 0"):
        KeyNamespace("m", 0)
    with pytest.raises(KvSwapError, match="cache_salt"):
        KeyNamespace("m", 16).root_key("x" * 257)
    with pytest.raises(KvSwapError, match="cache_salt: a lone surrogate at character 1"):
        KeyNamespace("m", 16).root_key("a\udcff")  # not UnicodeEncodeError's traceback
    with pytest.raises(KvSwapError, match="namespace block_tokens = 8"):
        make_store(KeyNamespace("m", 8), block_tokens=4)
    with pytest.raises(KvSwapError, match="request 0: cache_salt"):
        Request(
            request_id=0, arrival_s=0.0, prompt_ids=(1,), max_new_tokens=1, cache_salt="x" * 257
        )
    with pytest.raises(KvSwapError, match="request 0: cache_salt"):
        Request(request_id=0, arrival_s=0.0, prompt_ids=(1,), max_new_tokens=1, cache_salt=5)  # type: ignore[arg-type]
    salted = Request(request_id=0, arrival_s=0.0, prompt_ids=(1,), max_new_tokens=1, cache_salt="t")
    assert salted.cache_salt == "t"


def test_a_foreign_id_gets_a_key_of_its_namespace_only() -> None:
    """vLLM's OffloadKey under kvswap's namespace: equal ids share a key only within
    one namespace, and never equal a key of our own chain."""
    root = KeyNamespace("model-a", 32).root_key()
    other_root = KeyNamespace("model-b", 32).root_key()
    vllm_key = bytes(range(36))
    key = identity.foreign_key(root, vllm_key)
    assert len(key) == identity.KEY_BYTES
    assert key == identity.foreign_key(root, vllm_key)
    assert key != identity.foreign_key(other_root, vllm_key)
    assert key != identity.foreign_key(KeyNamespace("model-a", 32).root_key("tenant"), vllm_key)
    assert key != identity.foreign_key(root, vllm_key[:-1] + b"\xff")
    assert key != chain_key(root, list(vllm_key))
    with pytest.raises(ValueError, match="root key is 3 bytes"):
        identity.foreign_key(b"abc", vllm_key)
    with pytest.raises(ValueError, match="a foreign id is 1 to"):
        identity.foreign_key(root, b"")
