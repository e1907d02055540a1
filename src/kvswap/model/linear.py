"""The model's linear layers, in the engine's two modes.

- Fast (default): `nn.Linear`, one matmul over every row of the step. BLAS
  picks its blocking from the matrix shape, so a token's output may differ in
  the last bits with the number of rows that share its step. On a CPU the
  loaded model replaces these by `packed_linear.PackedLinear`.
- Exact (`batch_invariant=True`): `TiledLinear`, fixed [LINEAR_TILE_ROWS, in]
  tiles (the last one zero-padded). Every matmul call has the same shape, so a
  row's output is bit-identical whatever else is in the batch.

The fast mode's LM head is a `SlicedLinear`: a vocabulary-sized output is
computed in slices of output features on a CPU (see there).

Both modes hold the same parameters under the same names (`weight`, `bias`),
so a checkpoint loads into either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: Rows per matmul call in exact mode: decode batches up to this size cost one
#: weight read, and no result depends on how many rows a step has. Small,
#: because on a CPU a padded row costs real compute.
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


#: Output features per matmul of the fast mode's LM head on a CPU.
LM_HEAD_SLICE_FEATURES = 1024


class SlicedLinear(nn.Linear):
    """nn.Linear computed over slices of `slice_features` output features on a CPU.

    A few rows against a [32000, 768] weight ran at less than half the speed of
    the same work in [1024, 768] weight slices (MKL, 2 cores: 16 rows 85 ms
    against 31 ms; 64 rows 114 ms against 80 ms): the slice's weight stays in
    cache while every row uses it. One row (nothing to share the weight with),
    and CUDA, take one matmul."""

    def __init__(
        self, in_features: int, out_features: int, *, bias: bool, slice_features: int
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.slice_features = slice_features

    def forward(self, x: Tensor) -> Tensor:
        """x [T, in] -> [T, out]."""
        step = self.slice_features
        if x.device.type != "cpu" or x.shape[0] == 1 or self.out_features <= step:
            return F.linear(x, self.weight, self.bias)
        parts = [
            F.linear(
                x,
                self.weight[start : start + step],
                None if self.bias is None else self.bias[start : start + step],
            )
            for start in range(0, self.out_features, step)
        ]
        return torch.cat(parts, dim=1)


def make_lm_head(hidden_size: int, vocab_size: int, *, batch_invariant: bool) -> nn.Linear:
    """The LM head for the model's mode (no bias, as in every supported family)."""
    if batch_invariant:
        return TiledLinear(hidden_size, vocab_size, bias=False)
    return SlicedLinear(hidden_size, vocab_size, bias=False, slice_features=LM_HEAD_SLICE_FEATURES)


def make_linear(
    in_features: int, out_features: int, *, bias: bool, batch_invariant: bool
) -> nn.Linear:
    """A linear layer for the model's mode (see the module docstring)."""
    if batch_invariant:
        return TiledLinear(in_features, out_features, bias=bias)
    return nn.Linear(in_features, out_features, bias=bias)
