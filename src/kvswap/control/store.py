"""The block store: sequences' block tables, block copies on each tier, prefix sharing.

Bookkeeping only: the store never plans a transfer (the swapper does) and
never touches bytes (the data plane does). It owns every `Block`, the slot
accounting of each slot tier, the prefix index and one eviction policy per slot
tier (GPU, CPU; built by name, `kvswap.control.policy`), and keeps them consistent:
every change to a block's references or copies goes through here, and the
store alone tells the policies, each call with the `BlockFacts` of that tier's
copy. Only the tiers holding a copy hear of a change, and not those whose
facts it cannot alter (a copy placed but not yet written). The swapper's
parts take victims from the store (`victims(tier)`: a `VictimRound`), never from
a policy, and never rank one again themselves.

    sequence 3: [b0 b1 b2 b3]      b0, b1 shared with sequence 5 (same prefix)
                  |  |  |  '-- partial, GPU only
                  |  |  '----- GPU + CPU copies (dropping the GPU copy is free)
                  '--'-------- protected sinks: never leave the GPU while referenced

Copy state has one owner too: a transfer's reservation of its source, its
arrival and its failure are store calls (`reserve_source`, `release_source`,
`finish_transfer`), so the policies hear every change from here and no caller
asks for a re-rank.

Each tier is described once (`Tier`: its rank, addressing, ...). A tier
addressed by slots gets a `TierSlots`; one addressed by key (`Tier.REMOTE`,
`keyed_tier`) takes no slot: the store addresses its copies by block key. An
unreferenced block left with no local copy is forgotten (the store is asked
again by the next lookup), so what this process remembers stays bounded by its
own tiers and the tables that reference blocks.

A keyed store that can hold keys keeps a paused or waiting sequence's blocks
(`store_holds`): the store tells its `KeyHolds` of every change that can alter
whether a block's key is held.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kvswap.base import identity
from kvswap.base.eviction_policy import EvictionPolicy, PolicyOptions
from kvswap.base.remote_index import RemoteIndex
from kvswap.base.tier import GPU_TIER, SLOT_TIERS, Tier, tier_rank
from kvswap.control.blocks import Block, Copy
from kvswap.control.local_keys import LocalKeys
from kvswap.control.prefix_index import PrefixIndex
from kvswap.control.store_holds import key_holds
from kvswap.control.store_integrity import check_store_integrity
from kvswap.control.store_policies import TierPolicies, VictimRound
from kvswap.control.store_records import SequenceState, StoreLayout, TransferOutcome
from kvswap.control.tiers import TierSlots
from kvswap.errors import KvSwapError
from kvswap.units import ceil_div

# TransferOutcome is a NamedTuple: built without its Python-level __new__ (one per block moved).
_new_outcome = tuple.__new__


class BlockStore:
    def __init__(
        self,
        layout: StoreLayout,
        options: PolicyOptions,
        *,
        keyed_indexes: Mapping[Tier, RemoteIndex] | None = None,
    ):
        """`keyed_indexes`: the keyed tiers' indexes by tier, each asked to hold keys
        when it can (`store_holds`)."""
        self.layout = layout
        self.block_tokens = layout.block_tokens
        self.namespace = layout.key_namespace()
        if self.namespace.block_tokens != layout.block_tokens:
            raise KvSwapError(
                f"namespace block_tokens = {self.namespace.block_tokens}; allowed: the "
                f"store's block_tokens ({layout.block_tokens})"
            )
        num_slots = {
            Tier.GPU: layout.num_gpu_blocks,
            Tier.CPU: layout.num_cpu_blocks,
        }
        # Only the tiers addressed by slots have slots here (not the keyed ones).
        self.tiers = {tier: TierSlots(tier, num_slots[tier]) for tier in SLOT_TIERS}
        self.blocks: dict[int, Block] = {}
        self.sequences: dict[int, SequenceState] = {}
        self.index = PrefixIndex(layout.block_tokens)
        self._policies = TierPolicies(options, self.blocks, num_slots)
        self._next_block_id = 0
        self._unpublished: list[Block] = []
        # Blocks marked lost while referenced: lets the scheduler skip its per-step
        # scan of every table when (as almost always) none is.
        self._lost_referenced: set[int] = set()
        # Copies known (or being written) on the shared keyed tiers (the store, ...; the
        # local one's are listed by key below).
        self.num_remote_copies = 0
        # Blocks with a copy on the local keyed tier, by key (`drop_evicted`).
        self.local_keys = LocalKeys()
        self._holds = key_holds(keyed_indexes or {})

    # ----------------------------------------------------------------- sequences

    def open_sequence(
        self, seq_id: int, prompt_ids: Sequence[int], *, cache_salt: str | None = None
    ) -> list[Block]:
        """Start a sequence; share the longest indexed prefix of `prompt_ids`.

        The sequence's chain is rooted in the namespace salted with `cache_salt`:
        it shares blocks only with sequences opened with the same salt.

        Returns the shared blocks (their KV exists somewhere and need not be
        computed). The rest of the prompt is added with `append_tokens`. At
        least one token is always left to compute, so the step that admits the
        sequence produces its logits.
        """
        if seq_id in self.sequences:
            raise ValueError(f"sequence {seq_id} is already open")
        root_key = self.namespace.root_key(cache_salt)
        self.sequences[seq_id] = SequenceState(block_ids=[], num_tokens=0, root_key=root_key)
        return self.attach_indexed_prefix(seq_id, prompt_ids)

    def attach_indexed_prefix(self, seq_id: int, prompt_ids: Sequence[int]) -> list[Block]:
        """Share the indexed blocks that continue the sequence's table (full blocks
        only, so far) along `prompt_ids`, never the block holding its last token;
        returns them. Asked again after blocks from the remote store joined the table:
        the blocks after a run the store served may still be here."""
        state = self.sequences[seq_id]
        size = self.block_tokens
        start = len(state.block_ids)
        assert state.num_tokens == start * size, "asked while the table holds full blocks"
        previous = self.blocks[state.block_ids[-1]] if state.block_ids else None
        parent_key = state.root_key if previous is None else previous.key
        assert parent_key is not None, "a table's blocks before its last are full"
        tail = prompt_ids[start * size : max(start * size, len(prompt_ids) - 1)]
        hits = self.index.match(parent_key, tail, previous)
        for block in hits:
            self._attach(state, block)
            state.num_tokens += size
        return hits

    def num_new_blocks_needed(self, seq_id: int, num_new_tokens: int) -> int:
        state = self.sequences[seq_id]
        used = len(state.block_ids) * self.block_tokens
        return max(0, ceil_div(state.num_tokens + num_new_tokens - used, self.block_tokens))

    def append_tokens(self, seq_id: int, token_ids: Sequence[int]) -> list[Block]:
        """Add tokens; returns the blocks created for them (each needs a GPU slot).

        Writing into the partial last block invalidates its lower-tier copies:
        they hold the block as it was.
        """
        state = self.sequences[seq_id]
        created: list[Block] = []
        position = 0
        size = self.block_tokens  # a local: read several times per block of a prompt
        while position < len(token_ids):
            block: Block
            if state.num_tokens % size == 0:
                block = self._new_block(state)
                self._attach(state, block)
                created.append(block)
            else:
                block = self.blocks[state.block_ids[-1]]
                self.invalidate_lower_copies(block)
            room = size - len(block.token_ids)
            taken = token_ids[position : position + room]
            block.token_ids.extend(taken)
            position += len(taken)
            state.num_tokens += len(taken)
            if len(block.token_ids) == size:  # full (`Block.is_full`)
                # Through the module so that tests can force collisions.
                block.key = identity.chain_key(block.parent_key, block.token_ids)
                self._unpublished.append(block)
        return created

    def publish_computed(self) -> None:
        """Index the blocks filled this step. Called after the step computed their KV,
        so a sequence admitted in the same step never shares a block not yet written."""
        for block in self._unpublished:
            if block.block_id in self.blocks and not block.lost:
                self.index.insert(block)
        self._unpublished.clear()

    def next_prompt_blocks(
        self, seq_id: int, prompt_ids: Sequence[int], max_blocks: int
    ) -> list[tuple[bytes, list[int]]]:
        """(key, tokens) of the full prompt blocks after the sequence's table, at most
        `max_blocks`: the candidates of a remote lookup. Never the block holding the
        last prompt token, as for a local hit (the admitting step computes it)."""
        state = self.sequences[seq_id]
        size = self.block_tokens
        start = len(state.block_ids)
        assert state.num_tokens == start * size, "asked right after the local prefix hits"
        stop = min((len(prompt_ids) - 1) // size, start + max_blocks)
        parent_key = self.blocks[state.block_ids[-1]].key if state.block_ids else state.root_key
        assert parent_key is not None, "a table's blocks before its last are full"
        candidates: list[tuple[bytes, list[int]]] = []
        for position in range(start, stop):
            tokens = list(prompt_ids[position * size : (position + 1) * size])
            parent_key = identity.chain_key(parent_key, tokens)
            candidates.append((parent_key, tokens))
        return candidates

    def attach_remote_blocks(
        self, seq_id: int, found: Sequence[tuple[bytes, list[int]]], tier: Tier
    ) -> list[Block]:
        """Append blocks the keyed `tier` holds (`next_prompt_blocks` candidates, in
        order) to the sequence: full, keyed, with a ready copy there and no local one.
        They are indexed at once: their KV exists, so a sequence admitted in the same
        step shares them (and their fetch) instead of asking the store again."""
        state = self.sequences[seq_id]
        attached: list[Block] = []
        for key, tokens in found:
            block = self._new_block(state)
            block.token_ids = list(tokens)
            block.key = key
            assert identity.chain_key(block.parent_key, block.token_ids) == key
            self._attach(state, block)
            state.num_tokens += self.block_tokens
            self.place(block, tier, ready=True)  # held until it reaches the GPU
            self.index.insert(block)
            attached.append(block)
        return attached

    def set_running(self, seq_id: int, running: bool) -> None:
        """Mark a sequence as running (its blocks must stay on the GPU) or paused."""
        state = self.sequences[seq_id]
        if state.running == running:
            return
        state.running = running
        delta, flipped = (1, 1) if running else (-1, 0)
        blocks, changed_gpu = self.blocks, self._policies.changed_gpu  # locals: every block
        for block_id in state.block_ids:
            block = blocks[block_id]
            block.num_running_refs += delta
            if block.num_running_refs == flipped:  # `running` flipped
                changed_gpu(block)

    def close_sequence(self, seq_id: int) -> list[Block]:
        """End a sequence. Returns the full blocks nobody references any more
        (kept for prefix reuse; the caller offloads them). Partial blocks go."""
        self.set_running(seq_id, False)
        state = self.sequences.pop(seq_id)
        released: list[Block] = []
        blocks, block_ids = self.blocks, state.block_ids  # locals: read for every block
        num_protected = self.layout.protected_blocks
        # Tail first, so the head ends up most recently used: eviction then takes a
        # prefix chain from its end, and what stays cached is still a usable prefix.
        for position in range(len(block_ids) - 1, -1, -1):
            block = blocks[block_ids[position]]
            block.ref_count -= 1
            protected_position = position < num_protected
            if protected_position:
                block.num_protected_refs -= 1
            if block.ref_count > 0:
                if protected_position and block.num_protected_refs == 0:
                    self._policies.changed_gpu(block)  # else no copy's facts changed
                continue
            if block.key is None or block.lost or not block.has_local_copy():
                self.delete_block(block)
            else:
                self._policies.changed(block)
                self._holds.sync(block)
                released.append(block)
        released.reverse()
        return released

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Drop a sequence's tokens from `num_tokens` on (to recompute lost blocks)."""
        state = self.sequences[seq_id]
        keep_blocks = num_tokens // self.block_tokens
        running = state.running
        self.set_running(seq_id, False)
        for position in range(len(state.block_ids) - 1, keep_blocks - 1, -1):
            block = self.blocks[state.block_ids.pop()]
            block.ref_count -= 1
            if position < self.layout.protected_blocks:
                block.num_protected_refs -= 1
            if block.ref_count == 0 and (
                block.key is None or block.lost or not block.has_local_copy()
            ):
                self.delete_block(block)
            else:
                self._policies.changed(block)
                self._holds.sync(block)
        state.num_tokens = keep_blocks * self.block_tokens
        self.set_running(seq_id, running)

    def has_lost_blocks(self) -> bool:
        """Whether some sequence may hold a lost block (False: no table does).
        A lost block is never shared again, so once unreferenced it is forgotten."""
        for block_id in list(self._lost_referenced):
            block = self.blocks.get(block_id)
            if block is None or block.ref_count == 0:
                self._lost_referenced.discard(block_id)
        return bool(self._lost_referenced)

    def first_lost_token(self, seq_id: int) -> int | None:
        """Token index where the sequence's first lost block starts, if any."""
        for position, block_id in enumerate(self.sequences[seq_id].block_ids):
            if self.blocks[block_id].lost:
                return position * self.block_tokens
        return None

    def sequence_blocks(self, seq_id: int) -> list[Block]:
        return [self.blocks[block_id] for block_id in self.sequences[seq_id].block_ids]

    def gpu_block_table(self, seq_id: int) -> list[int]:
        """GPU slots of the sequence's blocks, in order; all must be ready."""
        table = []
        for block in self.sequence_blocks(seq_id):
            copy = block.ready_copy(GPU_TIER)
            if copy is None or copy.slot is None:
                raise AssertionError(f"block {block.block_id} of sequence {seq_id} is not on GPU")
            table.append(copy.slot)
        return table

    def touch(self, blocks: Iterable[Block]) -> None:
        """The blocks were read by a step: every tier's policy hears it."""
        self._policies.touch(block.block_id for block in blocks)

    # ------------------------------------------------------------------ eviction

    @property
    def policies(self) -> dict[Tier, EvictionPolicy]:
        """Each tier's eviction policy (to look at: only the store calls them)."""
        return self._policies.by_tier

    def advance(self, step: int) -> None:
        """A decode step began (residency windows age)."""
        self._policies.advance(step)

    def victims(self, tier: Tier, *, droppable_only: bool = False) -> VictimRound:
        """A round over `tier`'s victims as its policy ranks them (`VictimRound`): with
        `droppable_only`, only copies that go without a transfer and without a sequence
        losing its KV. The store ranks again, at the round's end, every victim whose
        copy stayed."""
        return VictimRound(self._policies, tier, droppable_only=droppable_only)

    def num_eviction_candidates(self, tier: Tier) -> int:
        """Copies `tier`'s policy could evict now."""
        return self.policies[tier].num_candidates()

    def swapped_in(self, block: Block) -> None:
        """A GPU copy of `block` arrived from a slower tier (its residency window starts)."""
        self._policies.swapped_in(block)

    # -------------------------------------------------------------------- copies

    def place(self, block: Block, tier: Tier, *, ready: bool) -> Copy | None:
        """Give `block` a slot on `tier` (None when the tier is full). A copy on a tier
        addressed by key takes no slot: the store has room for it as far as the control
        plane knows."""
        assert tier not in block.copies, f"block {block.block_id} already has a {tier.value} copy"
        if tier.keyed:
            assert block.key is not None, "only full (keyed) blocks go to a keyed tier"
            if tier.local:  # more than one block may hold a key: each hears its eviction
                self.local_keys.add(block)
            else:
                self.num_remote_copies += 1
            copy = Copy(slot=None, ready=ready)
        else:
            slot = self.tiers[tier].allocate(block.block_id)
            if slot is None:
                return None
            copy = Copy(slot=slot, ready=ready)
        block.copies[tier] = copy
        if copy.slot is None:
            self._holds.sync(block)  # a paused sequence's block: held from its write on
        self._policies.placed(block, tier, copy)
        return copy

    def drop_copy(self, block: Block, tier: Tier) -> None:
        """Free `block`'s copy on `tier`. A block left with no copy is deleted if
        nobody references it, else marked lost (its owners recompute it); one nobody
        references left with only a remote copy is forgotten (a lookup finds it)."""
        copy = block.copies.pop(tier)
        assert copy.num_readers == 0, f"dropping a {tier.value} copy that a transfer still reads"
        self._release(block, tier, copy)
        self._policies.dropped(block, tier)
        if block.copies and (block.ref_count > 0 or block.has_local_copy()):
            self._policies.changed(block)
        elif block.ref_count == 0:
            self.delete_block(block)
        else:
            block.lost = True
            self._lost_referenced.add(block.block_id)
            self.index.remove(block)
            self._policies.changed(block)
        self._holds.sync(block)

    def drop_evicted(self, tier: Tier, keys: Iterable[bytes]) -> int:
        """A local keyed tier evicted `keys`: drop the ready, idle copies it held of the
        blocks with those keys (as `drop_copy`; a key may be more than one block's, two
        sequences having computed the same prefix at once); returns how many. A copy still
        written or read stays: a read of a key gone fails, and its block is recomputed."""
        dropped = 0
        for key in keys:
            for block in self.local_keys.blocks(key):
                if not block.copies[tier].is_busy:
                    self.drop_copy(block, tier)
                    dropped += 1
        return dropped

    def invalidate_lower_copies(self, block: Block) -> None:
        """The block's bytes changed on the GPU: its copies below are out of date.
        Idle copies go now; busy ones are marked stale and go when their transfer ends."""
        copies = block.copies
        if len(copies) == 1 and GPU_TIER in copies:  # most calls: on the GPU alone
            return
        lower = [tier for tier in copies if tier is not GPU_TIER]
        lower.sort(key=tier_rank)  # fastest first
        marked = False
        for tier in lower:
            copy = copies[tier]
            if copy.is_busy:
                copy.stale = True
                marked = True
            else:
                self.drop_copy(block, tier)
        if marked:  # no longer a ready copy below: what the other copies are ranked by
            self._policies.changed(block)

    def delete_block(self, block: Block) -> None:
        """Forget a block nobody references. Copies a transfer still uses are marked
        stale and released when that transfer ends; until then the block stays,
        marked lost so that no lookup or policy picks it."""
        self.index.remove(block)
        for tier, copy in list(block.copies.items()):
            if copy.is_busy:
                copy.stale = True
            else:
                del block.copies[tier]
                self._release(block, tier, copy)
        self._policies.forget(block)
        if block.copies:
            block.lost = True
        else:
            del self.blocks[block.block_id]
        self._holds.sync(block)

    # ----------------------------------------------------------------- transfers

    def reserve_source(self, block: Block, tier: Tier) -> None:
        """A planned transfer will read `block`'s `tier` copy: from now on it is busy
        (not freed, not a victim) until `finish_transfer` or `release_source`."""
        block.copies[tier].num_readers += 1
        self._policies.changed(block)

    def release_source(self, block: Block, tier: Tier) -> None:
        """Give back a source reserved for a transfer that will not be submitted."""
        block.copies[tier].num_readers -= 1
        self._policies.changed(block)

    def finish_transfer(
        self, block: Block, src_tier: Tier, dst_tier: Tier, *, intact: bool, evict: bool
    ) -> TransferOutcome:
        """Apply one block's finished transfer from `src_tier` to `dst_tier` (`intact`:
        its bytes arrived whole and checked).

        The destination copy becomes ready, unless the bytes failed or either copy went
        stale meanwhile: then it is dropped, and a failed read from a tier with checked
        reads marks that source stale (never read again). A stale source is freed once
        no transfer reads it; with `evict`, so is a good source once its bytes are safe
        below, unless the block became needed on the GPU meanwhile.
        """
        src = block.copies[src_tier]
        dst = block.copies[dst_tier]
        src.num_readers -= 1
        ok = intact and not src.stale and not dst.stale
        if ok:
            dst.ready = True
            self._holds.sync(block)  # on the GPU again: released
        else:
            if src_tier.checked_reads and not intact:
                src.stale = True
            # May forget the block (nobody references it, only a remote copy is left).
            self.drop_copy(block, dst_tier)
        lost_now = False
        if block.copies.get(src_tier) is not src:
            pass  # the block was forgotten with its source copy
        elif src.stale and src.num_readers == 0:
            was_lost = block.lost
            self.drop_copy(block, src_tier)
            lost_now = block.lost and not was_lost
        elif (
            ok
            and evict
            and src.num_readers == 0
            and not (src_tier is GPU_TIER and block.num_running_refs > 0)
        ):
            self.drop_copy(block, src_tier)
        else:
            self._policies.changed(block)
        return _new_outcome(TransferOutcome, (ok, ok and block.block_id in self.blocks, lost_now))

    # ------------------------------------------------------------------ internal

    def _release(self, block: Block, tier: Tier, copy: Copy) -> None:
        """Give back what a copy held: its slot, its place among the local keyed tier's
        blocks, or its place in the remote count."""
        if copy.slot is None:
            if tier.local:
                self.local_keys.remove(block)
            else:
                self.num_remote_copies -= 1
        else:
            self.tiers[tier].release(copy.slot, block.block_id)

    def _new_block(self, state: SequenceState) -> Block:
        """A new, empty block chained after the sequence's last (full) block."""
        parent = self.blocks[state.block_ids[-1]] if state.block_ids else None
        if parent is None:
            parent_key = state.root_key
        else:
            assert parent.key is not None, "a new block follows only a full block"
            parent_key = parent.key
        block = Block(block_id=self._next_block_id, parent_key=parent_key, parent=parent)
        self._next_block_id += 1
        self.blocks[block.block_id] = block
        return block

    def _attach(self, state: SequenceState, block: Block) -> None:
        position = len(state.block_ids)
        state.block_ids.append(block.block_id)
        block.ref_count += 1
        protected = position < self.layout.protected_blocks
        if protected:
            block.num_protected_refs += 1
        if state.running:
            block.num_running_refs += 1
        # The GPU copy's facts change only when a count leaves zero; the CPU policy
        # hears every reference taken (kvswap's counts it as a use).
        first = block.ref_count == 1 or (protected and block.num_protected_refs == 1)
        running_now = state.running and block.num_running_refs == 1
        self._policies.changed(block, gpu=first or running_now)
        if block.ref_count == 1:  # a prefix hit on a block a keyed tier alone holds
            self._holds.sync(block)

    def check_integrity(self) -> None:
        """Every slot has one owner, each tier's occupancy equals the copies on it,
        references equal the tables that hold each block (`store_integrity`)."""
        check_store_integrity(self.tiers, self.blocks, self.sequences, self.num_remote_copies)
        self.local_keys.check(self.blocks.values())
        self._policies.check_integrity()
        self._holds.check(self.blocks.values())
