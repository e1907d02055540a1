"""The model's linear layers, in the engine's two modes.

- Fast (default): `nn.Linear`, one matmul over every row of the step. BLAS
  picks its blocking from the matrix shape, so a token's output may differ in
  the last bits with the number of rows that share its step.
- Exact (`batch_invariant=True`): `TiledLinear`, fixed [LINEAR_TILE_ROWS, in]
  tiles (the last one zero-padded). Every matmul call has the same shape, so a
  row's output is bit-identical whatever else is in the batch.

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


def make_linear(
    in_features: int, out_features: int, *, bias: bool, batch_invariant: bool
) -> nn.Linear:
    """A linear layer for the model's mode (see the module docstring)."""
    if batch_invariant:
        return TiledLinear(in_features, out_features, bias=bias)
    return nn.Linear(in_features, out_features, bias=bias)
