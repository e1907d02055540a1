"""Paged attention for the fast mode: a few large SDPA calls per layer, not one per tile.

The step is planned once (`FastPagedAttention(kv, meta)`) and the plan is
shared by every layer:

    decode sequences (one new token each)     prefill chunks (several new tokens)
    ------------------------------------     -----------------------------------
    ONE SDPA call per length bucket:          ONE causal SDPA call per chunk:
    their blocks gathered through a padded    - a chunk that starts its sequence
    block index [S, max_blocks] into two        attends over this step's own K/V
    buffers reused by every layer,              (nothing is read from the pool);
    K, V [S, kv_heads, max_blocks * B, D],    - a later chunk attends over its
    keys past a context masked out.             gathered context, lower-right causal.

Sequences of similar lengths share a bucket (none is padded past twice its
own blocks), so one long context does not pad every short one to its length.
The last layer attends with each sequence's last token only (`last_tokens`):
every sequence is then a one-query sequence, bucketed the same.

GQA without copying K/V per query head: a one-query sequence's H = KVH * G
heads are viewed as [KVH, G] rows, so each KV head serves its G query heads as
G query rows (head h uses KV head h // G, as transformers' repeat_kv does);
prefill chunks use SDPA's own `enable_gqa`.

Nothing here depends on the device: on CUDA the same code is a handful of
kernels per layer (the K/V write, two gathers and one SDPA per bucket, one
SDPA per chunk), whatever the number of blocks. Results match the exact mode
(`paged_attention`) to fp32 rounding, not bit for bit: the shapes of the calls
depend on the batch. Padding keys hold finite stale bytes of the pool and get
exactly zero weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kvswap.model.paged_attention import AttentionMetadata, write_kv
from kvswap.units import ceil_div

#: A one-query sequence shares a bucket (and its padded length) only with
#: sequences at most this many times longer, in blocks.
MAX_PADDING_FACTOR = 2


@dataclass(frozen=True)
class _OneQueryBucket:
    """Sequences attending with one query each, in one SDPA call."""

    seqs: Tensor  # [S] int64: their indices in the batch
    rows: Tensor  # [S] int64: their last new token in the step's flat order
    block_index: Tensor  # [S * max_blocks] int64 pool slots, padded with a real slot
    num_keys: int  # max_blocks * block_tokens
    key_mask: Tensor | None  # [S, 1, 1, num_keys] bool (key < context_len); None: all real
    # Gather buffers [S * max_blocks, B, KVH, D], reused by every layer of the step.
    key_buffer: Tensor
    value_buffer: Tensor


@dataclass(frozen=True)
class _PrefillChunk:
    """One sequence's chunk of several new tokens, attended in one causal call."""

    start: int  # the chunk's first token in the step's flat order
    query_len: int
    context_len: int
    # None when the chunk starts its sequence (its keys are this step's own);
    # else the pool slots of its context and the lower-right causal mask [Q, C].
    blocks: Tensor | None
    mask: Tensor | None


class FastPagedAttention:
    """The fast mode's `StepAttention`: writes the step's K/V, then attends.

    Call order per step: construct once, then call once per layer, layer 0 first
    (the last layer may call `last_tokens` instead). The gather buffers are
    reused from layer to layer: a call's result never aliases them."""

    def __init__(self, kv: Tensor, meta: AttentionMetadata) -> None:
        self.kv = kv  # [num_blocks, num_layers, 2, block_tokens, kv_heads, head_dim]
        self.meta = meta
        query_lens = meta.batch.query_lens
        decodes = [s for s, query_len in enumerate(query_lens) if query_len == 1]
        self._decodes = _plan_buckets(kv, meta, decodes)
        self._prefills = [
            _plan_prefill(meta, s, kv.device) for s, n in enumerate(query_lens) if n > 1
        ]
        self._decode_only = not self._prefills
        self._last_tokens: list[_OneQueryBucket] | None = None  # planned on first use

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, layer: int) -> Tensor:
        """q [T, H, D], k/v [T, KVH, D] (after RoPE) -> [T, H * D]."""
        write_kv(self.kv, layer, k, v, self.meta)
        num_tokens, num_heads, head_dim = q.shape
        if self._decode_only and len(self._decodes) == 1:
            return self._attend_one_query(q, layer, self._decodes[0])  # rows are the step
        if not self._decodes and len(self._prefills) == 1:
            return self._attend_prefill(q, k, v, layer, self._prefills[0])
        out = q.new_empty(num_tokens, num_heads * head_dim)
        for bucket in self._decodes:
            attended = self._attend_one_query(q[bucket.rows], layer, bucket)
            out.index_copy_(0, bucket.rows, attended)
        for chunk in self._prefills:
            out[chunk.start : chunk.start + chunk.query_len] = self._attend_prefill(
                q, k, v, layer, chunk
            )
        return out

    def last_tokens(self, q_last: Tensor, k: Tensor, v: Tensor, layer: int) -> Tensor:
        """The attention of each sequence's last new token only, for a layer whose other
        outputs nobody reads (the last one): q_last [S, H, D] (row s: sequence s's
        last token), k/v [T, KVH, D] for every token (the pool needs them all)
        -> [S, H * D]. One query per sequence sees its whole context."""
        write_kv(self.kv, layer, k, v, self.meta)
        if self._last_tokens is None:
            every_seq = list(range(len(self.meta.batch.query_lens)))
            self._last_tokens = (
                self._decodes if self._decode_only else _plan_buckets(self.kv, self.meta, every_seq)
            )
        if len(self._last_tokens) == 1:
            return self._attend_one_query(q_last, layer, self._last_tokens[0])
        out = q_last.new_empty(q_last.shape[0], q_last.shape[1] * q_last.shape[2])
        for bucket in self._last_tokens:
            out.index_copy_(
                0, bucket.seqs, self._attend_one_query(q_last[bucket.seqs], layer, bucket)
            )
        return out

    def _attend_one_query(self, q_rows: Tensor, layer: int, bucket: _OneQueryBucket) -> Tensor:
        """q_rows [S, H, D] -> [S, H * D]: one SDPA call over the gathered contexts."""
        num_seqs, num_heads, head_dim = q_rows.shape
        num_kv_heads = self.kv.shape[4]
        keys = _gather(self.kv, layer, 0, bucket.block_index, bucket.key_buffer)
        values = _gather(self.kv, layer, 1, bucket.block_index, bucket.value_buffer)
        # [S * max_blocks, B, KVH, D] -> [S, KVH, max_blocks * B, D] (a view)
        keys = keys.view(num_seqs, bucket.num_keys, num_kv_heads, head_dim).transpose(1, 2)
        values = values.view(num_seqs, bucket.num_keys, num_kv_heads, head_dim).transpose(1, 2)
        grouped = q_rows.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=bucket.key_mask)
        return out.reshape(num_seqs, num_heads * head_dim)  # [S, KVH, G, D] -> [S, H * D]

    def _attend_prefill(
        self, q: Tensor, k: Tensor, v: Tensor, layer: int, chunk: _PrefillChunk
    ) -> Tensor:
        """The chunk's rows of q -> [Q, H * D]: one causal SDPA call."""
        rows = slice(chunk.start, chunk.start + chunk.query_len)
        queries = q[rows].transpose(0, 1)[None]  # [1, H, Q, D]
        if chunk.blocks is None:
            # The chunk is the whole context: its keys are this step's own (the
            # bytes just written to the pool), and SDPA's top-left causal is right.
            keys = k[rows].transpose(0, 1)[None]  # [1, KVH, Q, D]
            values = v[rows].transpose(0, 1)[None]
            out = F.scaled_dot_product_attention(
                queries, keys, values, is_causal=True, enable_gqa=True
            )
        else:
            num_kv_heads, head_dim = self.kv.shape[4], self.kv.shape[5]
            context = slice(0, chunk.context_len)
            keys = _gather(self.kv, layer, 0, chunk.blocks, None)
            values = _gather(self.kv, layer, 1, chunk.blocks, None)
            keys = keys.view(-1, num_kv_heads, head_dim)[context].transpose(0, 1)[None]
            values = values.view(-1, num_kv_heads, head_dim)[context].transpose(0, 1)[None]
            out = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=chunk.mask, enable_gqa=True
            )
        return out[0].transpose(0, 1).reshape(chunk.query_len, -1)  # [1, H, Q, D] -> [Q, H*D]


def _gather(kv: Tensor, layer: int, k_or_v: int, slots: Tensor, out: Tensor | None) -> Tensor:
    """kv[slots, layer, k_or_v] -> [len(slots), B, KVH, D], into `out` when given.

    The source is viewed as 2-D [num_blocks, B * KVH * D] (strided rows, each
    one contiguous): index_select copies such rows with one memcpy each, while
    on the 4-D view it falls back to an element-wise copy over ten times slower."""
    num_blocks, num_layers, _, block_tokens, num_kv_heads, head_dim = kv.shape
    rows = kv.view(num_blocks, num_layers * 2, -1)[:, 2 * layer + k_or_v]  # [num_blocks, E]
    if out is None:
        gathered = torch.index_select(rows, 0, slots)
    else:
        gathered = torch.index_select(rows, 0, slots, out=out.view(len(slots), -1))
    return gathered.view(len(slots), block_tokens, num_kv_heads, head_dim)


def _plan_buckets(kv: Tensor, meta: AttentionMetadata, seqs: list[int]) -> list[_OneQueryBucket]:
    """`seqs` (each attending with its last token only) in buckets of similar lengths:
    longest first, a sequence joins the current bucket when the bucket's longest
    context is at most MAX_PADDING_FACTOR times its own (in blocks)."""
    num_blocks = {s: ceil_div(meta.batch.context_lens[s], meta.block_tokens) for s in seqs}
    buckets: list[list[int]] = []
    for seq in sorted(seqs, key=lambda s: -num_blocks[s]):
        if buckets and num_blocks[buckets[-1][0]] <= MAX_PADDING_FACTOR * num_blocks[seq]:
            buckets[-1].append(seq)
        else:
            buckets.append([seq])
    return [_plan_bucket(kv, meta, sorted(bucket)) for bucket in buckets]


def _plan_bucket(kv: Tensor, meta: AttentionMetadata, seqs: list[int]) -> _OneQueryBucket:
    batch, block_tokens, device = meta.batch, meta.block_tokens, kv.device
    context_lens = [batch.context_lens[s] for s in seqs]
    max_blocks = ceil_div(max(context_lens), block_tokens)
    slots: list[int] = []
    for s, context_len in zip(seqs, context_lens, strict=True):
        used = batch.block_tables[s][: ceil_div(context_len, block_tokens)]
        # Padding repeats one of the sequence's own slots: a valid index, masked out.
        slots.extend(used)
        slots.extend([used[0]] * (max_blocks - len(used)))
    num_keys = max_blocks * block_tokens
    key_mask = None
    if any(context_len < num_keys for context_len in context_lens):
        lens = torch.tensor(context_lens, dtype=torch.int64, device=device)
        key_positions = torch.arange(num_keys, device=device)
        key_mask = (key_positions[None, :] < lens[:, None]).view(len(seqs), 1, 1, num_keys)
    rows = [meta.query_starts[s] + batch.query_lens[s] - 1 for s in seqs]
    buffer_shape = (len(slots), *kv.shape[3:])  # [S * max_blocks, B, KVH, D]
    return _OneQueryBucket(
        seqs=torch.tensor(seqs, dtype=torch.int64, device=device),
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        block_index=torch.tensor(slots, dtype=torch.int64, device=device),
        num_keys=num_keys,
        key_mask=key_mask,
        key_buffer=kv.new_empty(buffer_shape),
        value_buffer=kv.new_empty(buffer_shape),
    )


def _plan_prefill(meta: AttentionMetadata, seq: int, device: torch.device) -> _PrefillChunk:
    query_len = meta.batch.query_lens[seq]
    context_len = meta.batch.context_lens[seq]
    first = context_len - query_len
    if first == 0:
        return _PrefillChunk(meta.query_starts[seq], query_len, context_len, None, None)
    query_positions = torch.arange(first, context_len, device=device)
    key_positions = torch.arange(context_len, device=device)
    mask = key_positions[None, :] <= query_positions[:, None]  # [Q, C]
    return _PrefillChunk(
        meta.query_starts[seq], query_len, context_len, meta.context_blocks[seq], mask
    )
