"""Attention that reads K and V from a paged KV pool through block tables; exact mode.

Pool layout (owned by the store; the model only receives it):

    kv: [num_blocks, num_layers, 2, block_tokens, num_kv_heads, head_dim]
          slot       layer      K|V  offset       kv head       channel

One block (all layers, K and V) is contiguous, so moving a block between tiers
is one contiguous copy. Index 0 of dim 2 is K (stored after RoPE), 1 is V.
Token `t` of a sequence lives in block `block_table[t // block_tokens]` at
offset `t % block_tokens`.

A step mixes prefill chunks and decode tokens, flattened to `[num_tokens]`.
The model calls a `StepAttention` once per layer; this module holds the step's
metadata, the K/V write and the exact mode's attention (`ExactPagedAttention`):
each sequence's attention is computed on its own, in block-aligned tiles with
shapes that depend only on the tile's position, over its blocks gathered into
a fresh contiguous tensor, so which physical slots hold them cannot change a
single bit of the result, and neither can the other sequences in the step.
The fast mode's attention (few large calls, fp32-close rather than
bit-identical) is `kvswap.model.fast_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from kvswap.units import ceil_div


@dataclass(frozen=True)
class AttentionBatch:
    """What one step computes; built by the engine's runner each step."""

    query_lens: tuple[int, ...]  # new tokens per sequence (prefill chunk, or 1 for decode)
    context_lens: tuple[int, ...]  # tokens per sequence INCLUDING this step's new ones
    # device slots of each sequence's logical blocks, in order
    # (len >= ceil(context_len / block_tokens))
    block_tables: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        num_seqs = len(self.query_lens)
        if num_seqs == 0:
            raise ValueError("AttentionBatch needs at least one sequence")
        if len(self.context_lens) != num_seqs or len(self.block_tables) != num_seqs:
            raise ValueError(
                f"AttentionBatch: {num_seqs} query_lens, {len(self.context_lens)} context_lens "
                f"and {len(self.block_tables)} block_tables must have the same length"
            )
        for index, (query_len, context_len) in enumerate(
            zip(self.query_lens, self.context_lens, strict=True)
        ):
            if not 1 <= query_len <= context_len:
                raise ValueError(
                    f"AttentionBatch sequence {index}: need 1 <= query_len ({query_len}) "
                    f"<= context_len ({context_len})"
                )

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


@dataclass(frozen=True)
class AttentionMetadata:
    """Device tensors derived from an AttentionBatch once per step, shared by all layers."""

    batch: AttentionBatch
    block_tokens: int
    positions: Tensor  # [num_tokens] int64: position of each new token in its sequence
    slot_mapping: Tensor  # [num_tokens] int64: block_slot * block_tokens + offset
    write_blocks: Tensor  # [num_tokens] int64: slot_mapping // block_tokens
    write_offsets: Tensor  # [num_tokens] int64: slot_mapping % block_tokens
    last_token_index: Tensor  # [num_seqs] int64: each sequence's last new token in the step
    query_starts: tuple[int, ...]  # first flat token index of each sequence
    context_blocks: tuple[Tensor, ...]  # per sequence [ceil(context_len / block_tokens)] int64


class StepAttention(Protocol):
    """One step's attention, built from the step's metadata, called once per layer
    in layer order: stores the layer's new K/V in the pool, then attends over each
    sequence's whole context (its own position included)."""

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, layer: int) -> Tensor:
        """q [T, H, D], k/v [T, KVH, D] (after RoPE) -> [T, H * D]."""
        ...


def build_attention_metadata(
    batch: AttentionBatch, block_tokens: int, num_pool_blocks: int, device: torch.device
) -> AttentionMetadata:
    """Check the block tables against the pool and build the step's index tensors."""
    positions: list[int] = []
    slots: list[int] = []
    last_index: list[int] = []
    query_starts: list[int] = []
    context_block_ids: list[int] = []
    blocks_per_seq: list[int] = []
    start = 0
    for index, (query_len, context_len, table) in enumerate(
        zip(batch.query_lens, batch.context_lens, batch.block_tables, strict=True)
    ):
        num_blocks = ceil_div(context_len, block_tokens)
        if len(table) < num_blocks:
            raise ValueError(
                f"AttentionBatch sequence {index}: {context_len} tokens need {num_blocks} "
                f"blocks of {block_tokens} tokens, block table has {len(table)}"
            )
        used = table[:num_blocks]
        if min(used) < 0 or max(used) >= num_pool_blocks:
            raise ValueError(
                f"AttentionBatch sequence {index}: block slots must be in "
                f"[0, {num_pool_blocks}), got {list(used)}"
            )
        first_position = context_len - query_len
        for position in range(first_position, context_len):
            positions.append(position)
            slots.append(table[position // block_tokens] * block_tokens + position % block_tokens)
        query_starts.append(start)
        start += query_len
        last_index.append(start - 1)
        context_block_ids.extend(used)
        blocks_per_seq.append(num_blocks)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    all_blocks = torch.tensor(context_block_ids, dtype=torch.int64, device=device)
    return AttentionMetadata(
        batch=batch,
        block_tokens=block_tokens,
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=slot_mapping,
        write_blocks=slot_mapping // block_tokens,
        write_offsets=slot_mapping % block_tokens,
        last_token_index=torch.tensor(last_index, dtype=torch.int64, device=device),
        query_starts=tuple(query_starts),
        context_blocks=tuple(torch.split(all_blocks, blocks_per_seq)),
    )


def allocate_kv_pool(
    num_blocks: int,
    num_layers: int,
    block_tokens: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Tensor:
    """A zeroed pool [num_blocks, num_layers, 2, block_tokens, num_kv_heads, head_dim]."""
    shape = (num_blocks, num_layers, 2, block_tokens, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def write_kv(kv: Tensor, layer: int, k: Tensor, v: Tensor, meta: AttentionMetadata) -> None:
    """Store this step's k, v [num_tokens, num_kv_heads, head_dim] into the pool."""
    kv[meta.write_blocks, layer, 0, meta.write_offsets] = k
    kv[meta.write_blocks, layer, 1, meta.write_offsets] = v


class ExactPagedAttention:
    """The exact mode's `StepAttention`: `write_kv`, then `paged_attention`."""

    def __init__(self, kv: Tensor, meta: AttentionMetadata) -> None:
        self.kv = kv
        self.meta = meta

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, layer: int) -> Tensor:
        write_kv(self.kv, layer, k, v, self.meta)
        return paged_attention(q, self.kv, layer, self.meta)


def paged_attention(q: Tensor, kv: Tensor, layer: int, meta: AttentionMetadata) -> Tensor:
    """q [num_tokens, num_heads, head_dim] (after RoPE) -> [num_tokens, num_heads * head_dim].

    This step's K/V must already be written (`write_kv`): each query attends to
    its sequence's whole context up to and including its own position.

    Queries are computed in tiles aligned to the sequence's blocks: the tile of
    block t holds positions [t * B, (t + 1) * B) and attends to keys [0, (t + 1) * B)
    under a causal mask. Every SDPA call therefore has a shape fixed by t alone,
    so a token's attention output is bit-identical whether it is computed in a
    long prefill, a short chunk, a recompute after preemption, or a decode step
    (rows outside this step's queries are padding; masked keys past the context
    hold finite stale bytes and get exactly zero weight).
    """
    outputs = []
    block_tokens = meta.block_tokens
    for seq, (query_len, context_len) in enumerate(
        zip(meta.batch.query_lens, meta.batch.context_lens, strict=True)
    ):
        start = meta.query_starts[seq]
        blocks = meta.context_blocks[seq]
        gathered = kv[blocks, layer]  # [n, 2, block_tokens, kv_heads, head_dim] (a copy)
        n, _, _, num_kv_heads, _ = gathered.shape
        # -> [2, kv_heads, n * block_tokens, head_dim]: whole blocks, tail past the context kept
        k_and_v = gathered.permute(1, 3, 0, 2, 4).reshape(2, num_kv_heads, n * block_tokens, -1)
        first = context_len - query_len
        q_seq = q[start : start + query_len]
        for tile in range(first // block_tokens, n):
            lo = max(first, tile * block_tokens)
            hi = min(context_len, (tile + 1) * block_tokens)
            out = _attend_tile(
                q_seq[lo - first : hi - first],
                lo - tile * block_tokens,
                k_and_v,
                tile,
                block_tokens,
            )
            outputs.append(out)
    return torch.cat(outputs, dim=0)


def _attend_tile(
    q_rows: Tensor, row_offset: int, k_and_v: Tensor, tile: int, block_tokens: int
) -> Tensor:
    """q_rows [R, H, D] at tile offsets [row_offset, row_offset + R) -> [R, H * D].

    Padded to a full tile [B, H, D]; keys [KVH, (tile + 1) * B, D]. GQA without
    copying K/V per query head: the H = KVH * G query heads are regrouped so
    each KV head sees its G heads' rows stacked, [KVH, G * B, D] (head h uses
    KV head h // G, as transformers' repeat_kv does).
    """
    rows, num_heads, head_dim = q_rows.shape
    num_kv_heads = k_and_v.shape[1]
    group = num_heads // num_kv_heads
    num_keys = (tile + 1) * block_tokens
    padded = q_rows.new_zeros(block_tokens, num_heads, head_dim)
    padded[row_offset : row_offset + rows] = q_rows
    grouped = padded.reshape(block_tokens, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    grouped = grouped.reshape(num_kv_heads, group * block_tokens, head_dim)  # [KVH, G * B, D]
    query_positions = torch.arange(tile * block_tokens, num_keys, device=q_rows.device)
    key_positions = torch.arange(num_keys, device=q_rows.device)
    causal = key_positions[None, :] <= query_positions[:, None]  # [B, L]
    mask = causal.repeat(group, 1)  # [G * B, L], matching the grouped rows
    k = k_and_v[0, :, :num_keys]
    v = k_and_v[1, :, :num_keys]
    # 4-D with a batch of 1: the fused CUDA kernels refuse 3-D inputs.
    out = F.scaled_dot_product_attention(grouped[None], k[None], v[None], attn_mask=mask)
    # [1, KVH, G * B, D] -> [B, KVH, G, D] -> [B, H * D], then the real rows
    out = out[0].reshape(num_kv_heads, group, block_tokens, head_dim).permute(2, 0, 1, 3)
    return out.reshape(block_tokens, num_heads * head_dim)[row_offset : row_offset + rows]
