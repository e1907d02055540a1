"""A Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV pool.

Module names mirror transformers' (`model.layers.N.self_attn.q_proj`, ...), so
a checkpoint's tensor names are this model's parameter names.

Numerics follow transformers step for step (RMSNorm in float32, RoPE tables in
float32 cast to the model dtype, logits cast to float32) so fp32 logits match
`LlamaForCausalLM` to ~1e-5.

Invariance (the product promises identical output with and without offload):
a token's logits and K/V are bit-identical whatever physical slots its blocks
occupy, whatever other sequences share the step, and however its prompt was
chunked (one prefill, many chunks, token by token, or a recompute):
- attention runs per sequence in block-aligned query tiles whose shapes depend
  only on the tile's position (see `paged_attention`);
- every linear layer runs in fixed tiles of `LINEAR_TILE_ROWS` rows (the last
  one zero-padded). BLAS picks its blocking from the matrix shape, so a row
  count that varies with the batch would change the last bits; a fixed tile
  shape cannot. Norms, RoPE and activations are per row already.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvswap.errors import KvSwapError
from kvswap.model.arch_config import ModelArchConfig
from kvswap.model.paged_attention import (
    AttentionBatch,
    AttentionMetadata,
    allocate_kv_pool,
    build_attention_metadata,
    paged_attention,
    write_kv,
)
from kvswap.model.rope import RotaryEmbedding, apply_rope

#: Rows per matmul call in every linear layer: decode batches up to this size
#: cost one weight read, and no result depends on how many rows a step has.
#: Small, because on a CPU a padded row costs real compute.
LINEAR_TILE_ROWS = 8


class TiledLinear(nn.Linear):
    """nn.Linear computed in fixed [LINEAR_TILE_ROWS, in] tiles (batch-invariant)."""

    def forward(self, x: Tensor) -> Tensor:
        """x [T, in] -> [T, out]."""
        rows = x.shape[0]
        tiles = []
        for start in range(0, rows, LINEAR_TILE_ROWS):
            part = x[start : start + LINEAR_TILE_ROWS]
            if part.shape[0] < LINEAR_TILE_ROWS:
                part = torch.cat(
                    [part, part.new_zeros(LINEAR_TILE_ROWS - part.shape[0], x.shape[1])]
                )
            tiles.append(F.linear(part, self.weight, self.bias))
        out = tiles[0] if len(tiles) == 1 else torch.cat(tiles)
        return out[:rows]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """x [..., size] -> same shape; the statistic is taken in float32."""
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.q_proj = TiledLinear(config.hidden_size, q_size, bias=config.qkv_bias)
        self.k_proj = TiledLinear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.v_proj = TiledLinear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.o_proj = TiledLinear(q_size, config.hidden_size, bias=config.o_bias)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv: Tensor, layer: int, meta: AttentionMetadata
    ) -> Tensor:
        """x [T, hidden] -> [T, hidden]; writes this step's K (after RoPE) and V to `kv`."""
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        write_kv(kv, layer, k, v, meta)
        out: Tensor = self.o_proj(paged_attention(q, kv, layer, meta))
        return out


class MLP(nn.Module):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = TiledLinear(hidden, inner, bias=bias)
        self.up_proj = TiledLinear(hidden, inner, bias=bias)
        self.down_proj = TiledLinear(inner, hidden, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        """SwiGLU: x [T, hidden] -> [T, hidden]."""
        out: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv: Tensor, layer: int, meta: AttentionMetadata
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, layer, meta)
        out: Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class LlamaModel(nn.Module):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausal(nn.Module):
    """The decoder plus LM head; `forward` runs one engine step over a paged pool."""

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = TiledLinear(config.hidden_size, config.vocab_size, bias=False)
        self.rope = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config says so (again after to_empty)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def allocate_kv(self, num_blocks: int, block_tokens: int) -> Tensor:
        """A zeroed pool for this model in its dtype and on its device (tests, reference runs)."""
        c = self.config
        return allocate_kv_pool(
            num_blocks, c.num_layers, block_tokens, c.num_kv_heads, c.head_dim, self.dtype,
            self.device,
        )  # fmt: skip

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, batch: AttentionBatch, kv: Tensor) -> Tensor:
        """One step: input_ids [num_tokens] int64 (sequences' new tokens, concatenated in
        batch order) -> float32 logits [num_seqs, vocab] of each sequence's last new token.

        Writes the step's K/V into `kv` at the slots named by the block tables first,
        then attends over each sequence's whole context.
        """
        self._check_step(input_ids, batch, kv)
        return self._step(input_ids, batch, kv)

    def _step(self, input_ids: Tensor, batch: AttentionBatch, kv: Tensor) -> Tensor:
        meta = build_attention_metadata(batch, kv.shape[3], kv.shape[0], kv.device)
        cos, sin = self.rope.cos_sin(meta.positions)  # [T, head_dim] float32 each
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        for layer, decoder_layer in enumerate(self.model.layers):
            x = decoder_layer(x, cos, sin, kv, layer, meta)
        # RMSNorm is per row, so normalising only the rows we need changes nothing.
        last = self.model.norm(x[meta.last_token_index])  # [num_seqs, hidden]
        logits: Tensor = self.lm_head(last).to(torch.float32)  # [num_seqs, vocab]
        return logits

    def _check_step(self, input_ids: Tensor, batch: AttentionBatch, kv: Tensor) -> None:
        c = self.config
        if input_ids.dim() != 1 or input_ids.shape[0] != batch.num_tokens:
            raise ValueError(
                f"input_ids must be [num_tokens={batch.num_tokens}], got {tuple(input_ids.shape)}"
            )
        if kv.dim() != 6 or (kv.shape[1], kv.shape[2], kv.shape[4], kv.shape[5]) != (
            c.num_layers,
            2,
            c.num_kv_heads,
            c.head_dim,
        ):
            raise ValueError(
                f"kv pool must be [num_blocks, num_layers={c.num_layers}, 2, block_tokens, "
                f"num_kv_heads={c.num_kv_heads}, head_dim={c.head_dim}], got {tuple(kv.shape)}"
            )
        if kv.dtype != self.dtype or kv.device != self.device:
            raise ValueError(
                f"kv pool is {kv.dtype} on {kv.device}; the model is {self.dtype} on {self.device}"
            )
        longest = max(batch.context_lens)
        window = c.sliding_window_tokens
        if window is not None and longest > window:
            raise KvSwapError(
                f"a context of {longest} tokens exceeds the model's sliding_window of {window} "
                f"tokens; sliding-window attention is not supported, keep contexts <= {window}"
            )
        if longest > c.max_position_tokens:
            raise KvSwapError(
                f"a context of {longest} tokens exceeds max_position_embeddings="
                f"{c.max_position_tokens} of this model"
            )
