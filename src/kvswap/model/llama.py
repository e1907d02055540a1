"""A Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV pool.

Module names mirror transformers' (`model.layers.N.self_attn.q_proj`, ...), so
a checkpoint's tensor names are this model's parameter names.

Numerics follow transformers step for step (RMSNorm in float32, RoPE tables in
float32 cast to the model dtype, logits cast to float32) so fp32 logits match
`LlamaForCausalLM` to ~1e-5.

The model is built in one of two modes (`batch_invariant`), fixed for its life:
- fast (default): every linear is one matmul over the whole step (on a CPU
  over weights pre-packed for oneDNN once loaded: `packed_linear`), attention
  is a few large SDPA calls per layer (`fast_attention`), and the last layer
  computes only what the LM head reads (each sequence's last token) besides
  the K/V of every token. Logits match the exact mode and transformers to fp32
  rounding.
- exact (`batch_invariant=True`): a token's logits and K/V are bit-identical
  whatever physical slots its blocks occupy, whatever other sequences share the
  step, and however its prompt was chunked (one prefill, many chunks, token by
  token, or a recompute): attention runs per sequence in block-aligned query
  tiles whose shapes depend only on the tile's position (`paged_attention`),
  and every linear layer runs in fixed row tiles (`linear.TiledLinear`). Norms,
  RoPE and activations are per row already.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvswap.errors import KvSwapError
from kvswap.model.arch_config import ModelArchConfig
from kvswap.model.fast_attention import FastPagedAttention
from kvswap.model.linear import make_linear, make_lm_head
from kvswap.model.packed_linear import pack_linears
from kvswap.model.paged_attention import (
    AttentionBatch,
    ExactPagedAttention,
    StepAttention,
    allocate_kv_pool,
    build_attention_metadata,
)
from kvswap.model.rope import RotaryEmbedding, apply_rope


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
    def __init__(self, config: ModelArchConfig, batch_invariant: bool) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        hidden, qkv_bias, exact = config.hidden_size, config.qkv_bias, batch_invariant
        self.q_proj = make_linear(hidden, q_size, bias=qkv_bias, batch_invariant=exact)
        self.k_proj = make_linear(hidden, kv_size, bias=qkv_bias, batch_invariant=exact)
        self.v_proj = make_linear(hidden, kv_size, bias=qkv_bias, batch_invariant=exact)
        self.o_proj = make_linear(q_size, hidden, bias=config.o_bias, batch_invariant=exact)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, attend: StepAttention, layer: int
    ) -> Tensor:
        """x [T, hidden] -> [T, hidden]; `attend` stores this step's K (after RoPE) and V."""
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        out: Tensor = self.o_proj(attend(q, k, v, layer))
        return out

    def last_tokens(
        self, x: Tensor, cos: Tensor, sin: Tensor, attend: FastPagedAttention, layer: int,
        rows: Tensor,
    ) -> Tensor:  # fmt: skip
        """x [T, hidden] -> [S, hidden] for the `rows` [S] only (each sequence's last
        token); K and V are still computed and stored for every token."""
        num_tokens = x.shape[0]
        q = self.q_proj(x[rows]).view(rows.shape[0], self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        q = apply_rope(q, cos[rows], sin[rows])
        k = apply_rope(k, cos, sin)
        out: Tensor = self.o_proj(attend.last_tokens(q, k, v, layer))
        return out


class MLP(nn.Module):
    def __init__(self, config: ModelArchConfig, batch_invariant: bool) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        exact = batch_invariant
        self.gate_proj = make_linear(hidden, inner, bias=bias, batch_invariant=exact)
        self.up_proj = make_linear(hidden, inner, bias=bias, batch_invariant=exact)
        self.down_proj = make_linear(inner, hidden, bias=bias, batch_invariant=exact)

    def forward(self, x: Tensor) -> Tensor:
        """SwiGLU: x [T, hidden] -> [T, hidden]."""
        # In place: the same bits as silu(gate) * up without two fresh [T, inner]
        # buffers, each a page-faulted allocation on a CPU (4096 x 2048 fp32, 2 cores:
        # 52 ms out of place against 10 ms in place).
        gated = F.silu(self.gate_proj(x), inplace=True).mul_(self.up_proj(x))
        out: Tensor = self.down_proj(gated)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelArchConfig, batch_invariant: bool) -> None:
        super().__init__()
        self.self_attn = Attention(config, batch_invariant)
        self.mlp = MLP(config, batch_invariant)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, attend: StepAttention, layer: int
    ) -> Tensor:
        # Residual adds in place (x is this step's own activation; the same bits).
        x = x.add_(self.self_attn(self.input_layernorm(x), cos, sin, attend, layer))
        out: Tensor = x.add_(self.mlp(self.post_attention_layernorm(x)))
        return out

    def last_tokens(
        self, x: Tensor, cos: Tensor, sin: Tensor, attend: FastPagedAttention, layer: int,
        rows: Tensor,
    ) -> Tensor:  # fmt: skip
        """The last layer of the fast mode: x [T, hidden] -> [S, hidden] for `rows` only.

        Only each sequence's last token reaches the LM head, so the rest of the
        step needs nothing from this layer but its K/V: for a prefill the query
        projection, attention, o_proj and MLP of every other row are skipped."""
        h = self.self_attn.last_tokens(self.input_layernorm(x), cos, sin, attend, layer, rows)
        x = x[rows].add_(h)  # x[rows] is a copy
        out: Tensor = x.add_(self.mlp(self.post_attention_layernorm(x)))
        return out


class LlamaModel(nn.Module):
    def __init__(self, config: ModelArchConfig, batch_invariant: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, batch_invariant) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausal(nn.Module):
    """The decoder plus LM head; `forward` runs one engine step over a paged pool.

    `batch_invariant` picks the mode (module docstring): True for the exact mode."""

    def __init__(self, config: ModelArchConfig, *, batch_invariant: bool = False) -> None:
        super().__init__()
        self.config = config
        self.batch_invariant = batch_invariant
        self.model = LlamaModel(config, batch_invariant)
        self.lm_head = make_lm_head(
            config.hidden_size, config.vocab_size, batch_invariant=batch_invariant
        )
        self.rope = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.tie_weights()

    def pack_weights(self) -> int:
        """The fast mode on a CPU: every linear's weight pre-packed (`packed_linear`), once
        the weights are loaded; returns how many were. The exact mode and an LM head
        tied to the embedding stay dense."""
        if self.batch_invariant:
            return 0
        skip = frozenset({"lm_head"}) if self.config.tie_word_embeddings else frozenset()
        return pack_linears(self, skip=skip)

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
        layers: list[DecoderLayer] = list(self.model.layers)  # type: ignore[arg-type]
        if self.batch_invariant:
            exact = ExactPagedAttention(kv, meta)
            for layer, decoder_layer in enumerate(layers):
                x = decoder_layer(x, cos, sin, exact, layer)
            x = x[meta.last_token_index]  # [num_seqs, hidden]
        else:
            fast = FastPagedAttention(kv, meta)
            for layer, decoder_layer in enumerate(layers[:-1]):
                x = decoder_layer(x, cos, sin, fast, layer)
            last_layer = len(layers) - 1
            x = layers[-1].last_tokens(x, cos, sin, fast, last_layer, meta.last_token_index)
        # RMSNorm is per row, so normalising only the rows we need changes nothing.
        logits: Tensor = self.lm_head(self.model.norm(x)).to(torch.float32)  # [num_seqs, vocab]
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
