"""Narrated scenarios: the remote tier's reads, its settings and summary, on tiny pools
(the fake store and processes: remote_control_support.py)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from kvswap.base.identity import chain_key
from kvswap.base.tier import Tier, keyed_tier
from kvswap.base.transfer import Direction, Priority, direction_between
from kvswap.base.write_policy import RemoteWritePolicy
from kvswap.config_load import load_config
from kvswap.control.settings import RemoteSettings
from kvswap.drive.assembly import build_control_plane, keyed_tiers
from kvswap.drive.settings import control_settings
from kvswap.drive.summary import StepTotals, build_summary
from kvswap.errors import KvSwapError
from tests.manual_engine import ManualCopyEngine
from tests.unit.remote_control_support import (
    NAMESPACE,
    FakeStore,
    LocalSlab,
    between_steps,
    extend_a_stored_prefix,
    make_process,
    serve_and_write,
)
from tests.unit.scheduler_support import chunks, computed, output_token, placement, run_step

# ---------------------------------------------------------------------------- reads


def test_a_second_process_restores_a_shared_prefix_from_the_store() -> None:
    store = FakeStore()
    # Process A serves [1 2] [3 4] [5] and finishes: its two full blocks go down to
    # the CPU at once (the finish offload), then behind that to the store.
    serve_and_write(store, [1, 2, 3, 4, 5])
    assert len(store.keys) == 2

    # Process B, a fresh start, gets a prompt with the same first 4 tokens. Nothing
    # is local, so the keys of its full prompt blocks before the last token ([1 2]
    # [3 4] [9 9]) are looked up in ONE call; the store holds the first two.
    b, engine = make_process(store)
    store.lookups.clear()  # A asked too, for its own prompt, and found nothing
    b.add_request(7, [1, 2, 3, 4, 9, 9, 9], 2, 0.0)
    plan, _ = run_step(b)
    assert [len(keys) for keys in store.lookups] == [3]
    # They were fetched into CPU slots on the HIGH queue, then up to the GPU, and the
    # step computes only from position 4: nothing recomputed.
    assert computed(plan) == [(7, (9, 9, 9), 4)]
    [fetch] = chunks(engine, Direction.REMOTE_TO_CPU)
    assert (fetch.priority, fetch.num_blocks, fetch.src_slots) == (Priority.HIGH, 2, (0, 1))
    # Each block goes up as soon as it lands in the CPU (as an NVMe block does).
    up = chunks(engine, Direction.CPU_TO_GPU)
    assert sum(c.num_blocks for c in up) == 2 and {c.priority for c in up} == {Priority.HIGH}
    run = b.runs[7]
    assert (run.prefix_hit_tokens, run.recomputed_tokens) == (4, 0)
    metrics = b.swapper.metrics
    assert metrics.prefix_hit_blocks_by_tier[Tier.REMOTE] == 2
    assert (metrics.remote_lookups, metrics.remote_found_blocks) == (1, 2)
    assert placement(b, 7)[:2] == ["gpu+cpu+remote"] * 2


def test_a_key_that_vanished_before_its_fetch_is_lost_and_recomputed() -> None:
    store = FakeStore()
    serve_and_write(store, [1, 2, 3, 4, 5])
    # The lookup will still report [3 4] present, but its value is gone by the fetch.
    gone_key = chain_key(chain_key(NAMESPACE.root_key(), [1, 2]), [3, 4])
    assert gone_key in store.keys
    store.keys.discard(gone_key)
    store.vanishing.add(gone_key)
    b, engine = make_process(store)

    # One fetch chunk of both blocks; the store fails the second block's slot only.
    # That was its only copy: lost, so the owner truncates at token 2 and the step
    # computes [3 4] again (2 recomputed tokens) and the rest for the first time.
    b.add_request(7, [1, 2, 3, 4, 9, 9, 9], 2, 0.0)
    plan, _ = run_step(b)
    assert computed(plan) == [(7, (3, 4, 9, 9, 9), 2)]
    metrics = b.swapper.metrics
    assert (metrics.remote_fetch_failures, metrics.lost_blocks) == (1, 1)
    assert b.runs[7].recomputed_tokens == 2
    # Two blocks were found, one landed: a remote hit is counted once its fetch lands.
    assert metrics.remote_found_blocks == 2
    assert metrics.prefix_hit_blocks_by_tier[Tier.REMOTE] == 1
    assert placement(b, 7) == ["gpu+cpu+remote", "gpu", "gpu", "gpu"]
    assert not b.swapper.has_lost_blocks()
    # It goes on and finishes; the recomputed block is written back to the store.
    _, finished = run_step(b)
    assert finished == [7]
    assert b.runs[7].output_ids == [output_token(7, 0), output_token(7, 1)]
    between_steps(b, engine, 2)
    between_steps(b, engine, 3)
    assert gone_key in store.keys


def test_a_store_down_at_fetch_time_fails_the_whole_chunk_and_everything_is_recomputed() -> None:
    store = FakeStore()
    serve_and_write(store, [1, 2, 3, 4, 5])
    b, _ = make_process(store)
    b.add_request(7, [1, 2, 3, 4, 9], 1, 0.0)
    # The lookup answers (both held), then the store goes down before the fetch.
    store.down_after_lookup = True
    plan, _ = run_step(b)
    assert computed(plan) == [(7, (1, 2, 3, 4, 9), 0)]
    assert b.swapper.metrics.remote_fetch_failures == 2
    assert b.runs[7].recomputed_tokens == 4
    assert b.swapper.metrics.prefix_hit_blocks_by_tier[Tier.REMOTE] == 0  # none landed


def test_the_lookup_is_bounded_and_never_asks_for_the_block_of_the_last_token() -> None:
    store = FakeStore()
    b, _ = make_process(store, max_lookup_blocks=2)
    # 8 tokens = 4 full blocks; the last holds the last prompt token: 3 candidates,
    # of which the bound lets 2 be asked.
    b.add_request(1, list(range(8)), 1, 0.0)
    run_step(b)
    assert [len(keys) for keys in store.lookups] == [2]
    assert b.swapper.metrics.remote_lookup_misses == 1
    # A 2-token prompt has no full block before its last token: no lookup at all.
    b.add_request(2, [50, 51], 1, 0.0)
    run_step(b)
    assert len(store.lookups) == 1


def test_a_prompt_longer_than_a_page_asks_the_next_page_while_each_is_found_whole() -> None:
    """`max_lookup_blocks` bounds one round trip, not the prefix a store can serve: a
    page found whole is followed by the next, and the first page with a miss ends it."""
    store = FakeStore()
    serve_and_write(store, list(range(1, 10)))  # 4 full blocks of 2 tokens in the store
    store.lookups.clear()
    b, _ = make_process(store, max_lookup_blocks=2)
    b.add_request(1, [*range(1, 9), 50], 1, 0.0)  # 4 candidates: pages of 2 and 2
    plan, _ = run_step(b)
    assert [len(keys) for keys in store.lookups] == [2, 2]
    assert computed(plan) == [(1, (50,), 8)]  # every full block came from the store
    assert b.swapper.metrics.remote_found_blocks == 4
    assert b.swapper.metrics.remote_lookup_misses == 0
    # The third block differs: the second page finds nothing and the lookups stop there.
    store.lookups.clear()
    b.add_request(2, [1, 2, 3, 4, 60, 61, 7, 8, 50], 1, 0.0)
    plan, _ = run_step(b)
    assert [len(keys) for keys in store.lookups] == [2]  # page 1 is a local hit now
    assert b.swapper.metrics.remote_lookup_misses == 1
    assert computed(plan) == [(2, (60, 61, 7, 8, 50), 4)]


def test_blocks_here_after_a_block_only_the_store_still_holds_are_shared_again() -> None:
    """A process forgets a block its store holds while keeping the blocks after it: a
    prompt through them takes the first run here, the forgotten block from the store,
    and the run after it here again, instead of computing everything past the gap."""
    store = FakeStore()
    serve_and_write(store, [1, 2, 3, 4, 5])  # [1 2] [3 4] in the store
    b, engine = make_process(store, write_policy=RemoteWritePolicy.OFF)
    b.add_request(1, [*range(1, 9), 9], 1, 0.0)  # [1 2] [3 4] restored, [5 6] [7 8] computed
    run_step(b)
    between_steps(b, engine, 2)
    between_steps(b, engine, 3)
    local = b.swapper.store
    (gap,) = [block for block in local.blocks.values() if block.token_ids == [3, 4]]
    for tier in (Tier.GPU, Tier.CPU):
        if tier in gap.copies:
            local.drop_copy(gap, tier)
    assert gap.block_id not in local.blocks  # only the store holds [3 4] now
    store.lookups.clear()
    b.add_request(2, [*range(1, 9), 50], 1, 0.0)
    plan, _ = run_step(b)
    assert [len(keys) for keys in store.lookups] == [3]  # [3 4] found, [5 6] not
    assert computed(plan) == [(2, (50,), 8)]
    assert b.runs[2].recomputed_tokens == 0
    assert b.swapper.metrics.prefix_hit_blocks_by_tier[Tier.REMOTE] == 3  # 2 earlier


def test_different_cache_salts_never_share_remote_kv() -> None:
    store = FakeStore()
    serve_and_write(store, [1, 2, 3, 4, 5], cache_salt="alice")
    # Bob sends the same prompt: his keys are rooted in another salt, so the store
    # holds none of them, and nothing is restored.
    bob, _ = make_process(store)
    bob.add_request(7, [1, 2, 3, 4, 5], 1, 0.0, cache_salt="bob")
    plan, _ = run_step(bob)
    assert computed(plan) == [(7, (1, 2, 3, 4, 5), 0)]
    assert set(store.lookups[-1]).isdisjoint(store.keys)
    # Without a salt it is another tenant again; with Alice's, her blocks come back.
    bob.add_request(8, [1, 2, 3, 4, 5], 1, 0.0)
    assert computed(run_step(bob)[0]) == [(8, (1, 2, 3, 4, 5), 0)]
    alice, _ = make_process(store)
    alice.add_request(9, [1, 2, 3, 4, 5], 1, 0.0, cache_salt="alice")
    assert computed(run_step(alice)[0]) == [(9, (5,), 4)]


def test_a_store_that_is_down_is_neither_asked_nor_written() -> None:
    store = FakeStore()
    store.up = False
    a, engine = make_process(store)
    a.add_request(1, [1, 2, 3, 4, 5], 1, 0.0)
    plan, _ = run_step(a)
    assert store.lookups == []  # no lookup while unavailable
    assert computed(plan) == [(1, (1, 2, 3, 4, 5), 0)]
    between_steps(a, engine, 2)
    between_steps(a, engine, 3)
    assert chunks(engine, Direction.CPU_TO_REMOTE) == []
    assert a.swapper.metrics.remote_writes_skipped == 2
    assert store.keys == set()


def test_without_a_remote_index_there_is_no_remote_tier() -> None:
    store = FakeStore()
    a, engine = make_process(store, remote=False)
    a.add_request(1, [1, 2, 3, 4, 5], 1, 0.0)
    run_step(a)
    between_steps(a, engine, 2)
    assert store.lookups == [] and store.keys == set()
    assert a.swapper.remotes == ()


# ------------------------------------------------------- several keyed tiers, one list


def keys_of(*blocks: list[int]) -> list[bytes]:
    """The keys of a prompt's first blocks (each given by its tokens), in order."""
    keys, parent = [], NAMESPACE.root_key()
    for tokens in blocks:
        parent = chain_key(parent, tokens)
        keys.append(parent)
    return keys


def test_each_keyed_tier_is_asked_for_what_follows_and_read_from_where_it_is() -> None:
    """The store holds blocks 0, 1 and 4 of a prompt, the tier below it 2 and 3: the
    store is asked first, the tier below for what follows, the store again past
    that; every block is fetched from the tier that holds it, and each tier's hits
    are its own."""
    store, below = FakeStore(), FakeStore()
    k = keys_of([1, 2], [3, 4], [5, 6], [7, 8], [9, 10])
    store.keys.update((k[0], k[1], k[4]))
    below.keys.update((k[2], k[3]))
    b, engine = make_process(store, below=[(below, RemoteWritePolicy.ON_FINISH)])
    b.add_request(7, list(range(1, 12)), 2, 0.0)
    plan, _ = run_step(b)
    assert [len(keys) for keys in store.lookups] == [5, 1]  # then only what follows
    assert [len(keys) for keys in below.lookups] == [3]
    assert computed(plan) == [(7, (11,), 10)]  # five blocks hit, none recomputed
    second = keyed_tier(1)
    assert second.value == "remote2" and second.rank == Tier.REMOTE.rank + 1
    [from_store] = chunks(engine, Direction.REMOTE_TO_CPU)
    [from_below] = chunks(engine, direction_between(second, Tier.CPU))
    assert from_store.keys == (k[0], k[1], k[4]) and from_below.keys == (k[2], k[3])
    hits = b.swapper.metrics.prefix_hit_blocks_by_tier
    assert (hits[Tier.REMOTE], hits[second]) == (3, 2)
    assert placement(b, 7)[:5] == ["gpu+cpu+remote"] * 2 + ["gpu+cpu+remote2"] * 2 + [
        "gpu+cpu+remote"
    ]
    # A block both hold comes from the faster, the store.
    c, engine_c = make_process(store, below=[(below, RemoteWritePolicy.ON_FINISH)])
    store.keys.add(k[2])
    c.add_request(8, [1, 2, 3, 4, 5, 6, 0], 1, 0.0)
    run_step(c)
    [fetch] = chunks(engine_c, Direction.REMOTE_TO_CPU)
    assert fetch.keys == tuple(k[:3]) and chunks(engine_c, from_below.direction) == []


def test_each_keyed_tier_is_written_by_its_own_policy_and_never_twice() -> None:
    """The store is written when a sequence finishes (on_finish), the tier below when a
    block leaves the pinned pool (on_demote): each tier gets each block once."""
    store, below = FakeStore(), FakeStore()
    a, engine = make_process(
        store, num_cpu_blocks=4, below=[(below, RemoteWritePolicy.ON_DEMOTE)],
        cpu_demote_high_watermark=0.5, cpu_demote_low_watermark=0.25,
    )  # fmt: skip
    a.add_request(1, list(range(1, 10)), 1, 0.0)  # four full blocks and a partial one
    _, finished = run_step(a)
    assert finished == [1]
    for step in range(2, 6):
        between_steps(a, engine, step)
    blocks = keys_of([1, 2], [3, 4], [5, 6], [7, 8])
    assert sorted(store.written) == sorted(blocks)  # at finish: every full block, once
    # The pinned pool (4 slots) demotes down to its low watermark (1): three blocks
    # leave it, each written to the tier below, once, and then dropped.
    assert len(below.written) == len(set(below.written)) == 3
    assert set(below.written) <= set(blocks)
    assert a.swapper.store.tiers[Tier.CPU].num_used_slots == 1
    demoted = direction_between(Tier.CPU, keyed_tier(1))
    assert a.swapper.metrics.bytes_by_direction[demoted] == 3 * 64


def test_a_block_the_store_has_waits_for_a_faster_tier_written_on_demotion() -> None:
    """A slab by key in front of the store: blocks the store took at finish still go to
    the slab as they leave the pinned pool, one write at a time when the slab's room
    for writes is one block, never dropped for the slower store's copy meanwhile."""
    slab, store = FakeStore(), FakeStore()
    a, engine = make_process(
        slab, write_policy=RemoteWritePolicy.ON_DEMOTE, num_cpu_blocks=4,
        max_inflight_write_chunks=1, swap_out_chunk_blocks=1,
        below=[(store, RemoteWritePolicy.ON_FINISH)],
        cpu_demote_high_watermark=0.5, cpu_demote_low_watermark=0.25,
    )  # fmt: skip
    a.add_request(1, list(range(1, 10)), 1, 0.0)
    run_step(a)
    for step in range(2, 10):
        between_steps(a, engine, step)
    blocks = keys_of([1, 2], [3, 4], [5, 6], [7, 8])
    assert sorted(store.written) == sorted(blocks)
    # Down to the low watermark (one block): every block that left is on the slab.
    left = [b.key for b in a.swapper.store.blocks.values() if Tier.CPU not in b.copies]
    assert len(left) == 3 and set(left) <= set(slab.written)
    assert len(slab.written) == len(set(slab.written)) == 3


def test_a_local_keyed_tier_is_the_nvme_slab_its_blocks_remembered_until_it_evicts() -> None:
    """The slab by key, this process's own: the swapper names it `nvme`; a block whose
    only copy is on it stays in the block table (a prefix hit with no lookup), and goes
    once the slab says it evicted the block's key."""
    slab = LocalSlab()
    a, engine = make_process(
        slab, write_policy=RemoteWritePolicy.ON_DEMOTE, num_gpu_blocks=5, num_cpu_blocks=4,
        cpu_demote_high_watermark=0.5, cpu_demote_low_watermark=0.25,
    )  # fmt: skip
    assert [remote.tier for remote in a.swapper.remotes] == [Tier.NVME]
    a.add_request(1, list(range(1, 10)), 1, 0.0)  # four full blocks and a partial one
    run_step(a)
    for step in range(2, 6):
        between_steps(a, engine, step)
    a.add_request(2, list(range(50, 58)), 1, 0.0)  # takes the GPU from the first's blocks
    run_step(a)
    for step in range(7, 10):
        between_steps(a, engine, step)
    blocks = keys_of([1, 2], [3, 4], [5, 6], [7, 8])
    # The first request's blocks left the pinned pool for the slab, and then the GPU:
    # each is remembered with the slab's copy alone (a shared store's is forgotten).
    table = {b.key: b for b in a.swapper.store.blocks.values()}
    assert all(set(table[key].copies) == {Tier.NVME} for key in blocks)
    assert set(blocks) <= set(slab.written) and len(slab.written) == len(set(slab.written))
    snapshot = a.swapper.metrics.snapshot()
    assert snapshot["bytes_cpu_to_nvme"] == 64 * len(slab.written)  # reported as nvme
    assert a.swapper.store.num_remote_copies == 0  # its copies are not a shared store's
    assert a.swapper.metrics.bytes_by_direction[Direction.CPU_TO_NVME] == 64 * len(slab.written)
    # The slab evicts the third block: its copy goes, and the block with it.
    slab.evict(blocks[2])
    between_steps(a, engine, 10)
    assert blocks[2] not in {b.key for b in a.swapper.store.blocks.values()}
    assert a.swapper.metrics.evictions_by_reason["nvme_discard"] == 1
    # A sequence that finds the first two blocks in the block table takes references
    # to blocks the slab alone holds: the slab holds their keys until they are on the
    # GPU again or nobody references them (it would evict them otherwise).
    assert not slab.held
    assert a.swapper.open_sequence(99, list(range(1, 10))) == 4
    assert slab.held == {blocks[0]: 1, blocks[1]: 1}
    a.swapper.check_integrity()
    a.swapper.release(99)
    assert not slab.held
    # The first prompt again: its first two blocks are found in the block table, on the
    # slab; the slab is asked only for what follows them, once.
    lookups = len(slab.lookups)
    a.add_request(3, list(range(1, 10)), 1, 0.0)
    run_step(a)
    assert [keys[0] for keys in slab.lookups[lookups:]] == [blocks[2]]
    between_steps(a, engine, 11)
    # Two hits each, sequence 99's and request 3's.
    assert a.swapper.metrics.snapshot()["prefix_hit_blocks_by_tier"]["nvme"] == 4


def test_an_eviction_from_the_local_tier_reaches_every_block_with_that_key() -> None:
    """Two sequences computing the same prompt at once make two blocks of each key (the
    prefix index names the first); both are written to the slab, and when it evicts a
    key both copies go, not only the indexed block's."""
    slab = LocalSlab()
    a, engine = make_process(
        slab, write_policy=RemoteWritePolicy.ON_DEMOTE, num_cpu_blocks=4,
        cpu_demote_high_watermark=0.5, cpu_demote_low_watermark=0.0,
    )  # fmt: skip
    a.add_request(1, [1, 2, 3, 4, 5], 1, 0.0)
    a.add_request(2, [1, 2, 3, 4, 6], 1, 0.0)
    run_step(a)
    for step in range(2, 6):
        between_steps(a, engine, step)
    first = keys_of([1, 2])[0]
    twins = [b for b in a.swapper.store.blocks.values() if b.key == first]
    assert len(twins) == 2 and all(Tier.NVME in b.copies for b in twins)
    slab.evict(first)
    between_steps(a, engine, 6)
    assert all(Tier.NVME not in b.copies for b in twins)
    assert a.swapper.metrics.evictions_by_reason["nvme_discard"] == 2


def test_a_local_keyed_tier_is_first_and_alone() -> None:
    with pytest.raises(ValueError, match="allowed: at most one, first in the list"):
        make_process(FakeStore(), below=[(LocalSlab(), RemoteWritePolicy.ON_DEMOTE)])
    with pytest.raises(ValueError, match="allowed: at most one, first in the list"):
        make_process(LocalSlab(), slab=LocalSlab())


# ------------------------------------------------------------------ settings, summary


def test_control_settings_read_the_remote_tier_and_name_its_namespace() -> None:
    base = load_config(environ={})
    capacities = base.tier_capacities(1024, slab_needed=False)
    plain = control_settings(base, capacities, block_bytes=1024, model_fingerprint="fp")
    assert plain.remote is None  # no remote_url: no remote tier
    # A caller that brings its own store (the simulator's modelled one) needs no URL.
    brought = control_settings(
        base, capacities, block_bytes=1024, model_fingerprint="fp", shared_store=True
    )
    assert brought.remote == RemoteSettings(namespace="fp")
    config = load_config(
        environ={},
        overrides={"remote_url": "redis://127.0.0.1:6379/0", "remote_write_policy": "on_demote",
                   "remote_max_inflight_chunks": 3},
    )  # fmt: skip
    settings = control_settings(config, capacities, block_bytes=1024, model_fingerprint="fp")
    assert settings.remote == RemoteSettings(
        namespace="fp", write_policy=RemoteWritePolicy.ON_DEMOTE, max_inflight_write_chunks=3
    )
    named = load_config(
        environ={}, overrides={"remote_url": "redis://h:1/0", "remote_namespace": "team-a"}
    )
    remote = control_settings(named, capacities, block_bytes=1024, model_fingerprint="fp").remote
    assert remote is not None and remote.namespace == "team-a"
    # The plane is built with the index the edge hands it, or without a remote tier.
    plane = build_control_plane(
        settings, ManualCopyEngine(), lambda: 0.0, keyed_tiers(settings, [FakeStore()])
    )
    (remote,) = plane.swapper.remotes
    assert remote.tier is Tier.REMOTE
    assert remote.settings.write_policy is RemoteWritePolicy.ON_DEMOTE
    assert build_control_plane(settings, ManualCopyEngine(), lambda: 0.0).swapper.remotes == ()
    # Each keyed tier may be written by its own policy; the next ones are tiers of their own.
    first, second = keyed_tiers(settings, [FakeStore(), FakeStore()], [None, "on_finish"])
    assert first.settings.write_policy is RemoteWritePolicy.ON_DEMOTE
    assert second.settings == replace(settings.remote, write_policy=RemoteWritePolicy.ON_FINISH)


def test_remote_settings_refuse_what_cannot_work() -> None:
    with pytest.raises(KvSwapError, match="namespace"):
        RemoteSettings("")
    with pytest.raises(KvSwapError, match="max_lookup_blocks"):
        RemoteSettings("fp", max_lookup_blocks=0)


def test_the_summary_has_one_remote_object_with_the_data_planes_counters() -> None:
    store = FakeStore()
    b, _ = extend_a_stored_prefix(store)
    extras = {"device": "cpu", "remote": {"outages": 2, "corrupt": 1, "reconnects": 5}}
    summary = build_summary(b, 1.0, StepTotals(1, 1.0, 0.0), extras).to_json()
    remote = summary["remote"]
    assert isinstance(remote, dict)
    assert remote["enabled"] is True
    assert (remote["hit_tokens"], remote["lookups"], remote["found_blocks"]) == (4, 1, 2)
    assert remote["bytes_from_remote"] == 2 * 64 and remote["bytes_to_remote"] == 64
    assert (remote["writes"], remote["misses"], remote["hit_rate"]) == (1, 0, round(2 / 3, 6))
    assert (remote["outages"], remote["corrupt"], remote["reconnects"]) == (2, 1, 5)
    assert (remote["skipped_writes"], remote["already_present"]) == (0, 0)
    assert summary["device"] == "cpu"
    prefix = summary["prefix_hit_tokens"]
    assert isinstance(prefix, dict) and prefix["remote"] == 4
    # Without a remote tier the object is there, all zero and disabled.
    a, _ = make_process(store, remote=False)
    plain = build_summary(a, 1.0, StepTotals(0, 0.0, 0.0), {}).to_json()["remote"]
    assert isinstance(plain, dict) and plain["enabled"] is False and plain["lookups"] == 0


def test_a_sequence_released_while_its_blocks_come_from_the_store_leaves_nothing_behind() -> None:
    store = FakeStore()
    serve_and_write(store, [1, 2, 3, 4, 5])
    b, engine = make_process(store)
    swapper = b.swapper
    # Opened with both blocks found in the store, their fetch started (HIGH)...
    assert swapper.open_sequence(7, [1, 2, 3, 4, 9]) == 4
    swapper.prefetch([7])
    [fetch] = chunks(engine, Direction.REMOTE_TO_CPU)
    # ...and released before it lands (a recompute preemption): the blocks are cache
    # entries now. One key vanished meanwhile, so its read fails.
    swapper.release(7)
    store.keys.discard(fetch.keys[1])
    engine.finish()
    swapper.begin_step(1)
    swapper.check_integrity()
    # The block that arrived stays as cache (CPU + remote); the one that failed had
    # only its remote copy left and nobody needs it: forgotten, not lost.
    kept = [b for b in swapper.store.blocks.values() if b.key is not None]
    assert [(b.token_ids, b.ready_copy(Tier.CPU) is not None) for b in kept] == [([1, 2], True)]
    assert swapper.metrics.lost_blocks == 0 and swapper.metrics.remote_fetch_failures == 1


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("policy", list(RemoteWritePolicy))
def test_random_conversations_over_three_processes_all_complete(
    seed: int, policy: RemoteWritePolicy
) -> None:
    # Seeded: shared system prompts, transfers landing at random, keys vanishing and
    # outages. Every request completes with exactly its own tokens, the store stays
    # consistent at every step, and nothing is counted twice.
    rng = random.Random(seed)
    store = FakeStore()
    found_total = 0
    for process in range(3):
        num_cpu_blocks, num_nvme_blocks = rng.choice([2, 4, 8]), rng.choice([0, 6])
        scheduler, engine = make_process(
            store, num_gpu_blocks=10, num_cpu_blocks=num_cpu_blocks,
            slab=LocalSlab(num_nvme_blocks) if num_nvme_blocks else None, write_policy=policy,
            swap_out_chunk_blocks=2, swap_in_chunk_blocks=2,
            cpu_demote_high_watermark=0.75, cpu_demote_low_watermark=0.5,
        )  # fmt: skip
        for seq_id in range(8):
            system = [rng.choice([1, 2]), 0, 0, 0]
            prompt = [*system, *(rng.randrange(100) for _ in range(rng.randrange(1, 7)))]
            scheduler.add_request(100 * process + seq_id, prompt, rng.randrange(1, 4), 0.0)
        for step in range(400):
            if not scheduler.has_work():
                break
            if store.keys and rng.random() < 0.1:
                store.keys.discard(rng.choice(sorted(store.keys)))  # a TTL ran out
            store.up = rng.random() > 0.1
            for transfer_id in list(engine.pending):
                if rng.random() < 0.5:
                    engine.finish(transfer_id)
            plan, _ = run_step(scheduler, float(step))
            if not plan.seqs and not scheduler.swapper.wait_any():
                engine.finish()
        assert not scheduler.has_work(), f"process {process} stalled"
        store.up = True
        scheduler.swapper.drain()
        scheduler.swapper.check_integrity()
        for seq_id, run in scheduler.runs.items():
            assert run.output_ids == [output_token(seq_id, i) for i in range(run.max_new_tokens)]
        metrics = scheduler.swapper.metrics
        # Found blocks are hits; so are later sequences sharing them before they land.
        assert metrics.prefix_hit_blocks_by_tier[Tier.REMOTE] >= metrics.remote_found_blocks
        found_total += metrics.remote_found_blocks
    if policy is RemoteWritePolicy.OFF:
        assert found_total == 0 and store.keys == set()  # nobody ever wrote
