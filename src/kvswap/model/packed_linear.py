"""The fast mode's linear layers on a CPU: weights pre-packed once into oneDNN's layout.

A plain `nn.Linear` on a CPU hands BLAS the row-major weight at every call, and
for the few rows of a decode step BLAS spends much of its time re-arranging it.
oneDNN can arrange a weight once into its own blocked layout (`packed`); every
later call reads it as is. Measured on 2 AVX2 cores (fp32, `small` preset
shapes, median of repeats): 16 rows x [2048 -> 768] 1.02 -> 0.49 ms, the 32,000-
word LM head 30.7 -> 15.7 ms (16 rows); a whole 16-sequence decode step 1.36x,
a 4-sequence one 1.65x; prefill (thousands of rows) about the same.

The packed copy *replaces* the dense weight (the layer keeps no `weight`
parameter; `state_dict()` unpacks one on demand): the model's memory stays what
its parameters are. An LM head tied to the embedding stays dense: the
embedding needs the row-major bytes, and a packed second copy would add a
vocabulary x hidden matrix to memory.

Only for fp32 on a CPU whose torch has oneDNN, probed once by comparing a packed
result with `F.linear`; anywhere else the layers stay `nn.Linear`. Results equal
`F.linear`'s to fp32 rounding, not bit for bit: the exact mode never packs.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvswap.model.linear import SlicedLinear


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's packed layout (built from a dense layer)."""

    def __init__(self, dense: nn.Linear) -> None:
        super().__init__()
        self.in_features = dense.in_features
        self.out_features = dense.out_features
        # Not a parameter or buffer: an opaque oneDNN tensor that `.to()` must not move.
        self.packed_weight = _pack(dense.weight.detach())
        self.bias = None if dense.bias is None else nn.Parameter(dense.bias.detach(), False)

    def forward(self, x: Tensor) -> Tensor:
        """x [T, in] -> [T, out] (float32, on the CPU)."""
        out: Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.packed_weight, self.bias, "none", [], ""
        )
        return out

    def _save_to_state_dict(
        self, destination: dict[str, Any], prefix: str, keep_vars: bool
    ) -> None:
        """`state_dict()` still names a dense `weight` (unpacked on demand, the same bytes)."""
        destination[prefix + "weight"] = self.packed_weight.to_dense()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def _pack(weight: Tensor) -> Tensor:
    packed: Tensor = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    return packed


@functools.cache
def packing_supported(dtype: torch.dtype) -> bool:
    """Whether this torch can pack a CPU weight of `dtype` and get `F.linear`'s result."""
    if dtype != torch.float32 or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 40, generator=generator)
    x = torch.randn(5, 40, generator=generator)
    try:
        with torch.inference_mode():
            got = PackedLinear(_dense(weight))(x)
    except (AttributeError, RuntimeError):  # a build without these oneDNN ops
        return False
    return bool(torch.allclose(got, F.linear(x, weight), rtol=1e-4, atol=1e-5))


def _dense(weight: Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    return layer


def pack_linears(model: nn.Module, *, skip: frozenset[str] = frozenset()) -> int:
    """Replace every fast-mode linear (`nn.Linear`, `SlicedLinear`) of a CPU model by a
    `PackedLinear`, except the modules named in `skip`; returns how many were packed
    (0 where packing is not supported: the model is left as it was)."""
    count = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full_name = f"{parent_name}.{name}" if parent_name else name
            if type(child) not in (nn.Linear, SlicedLinear) or full_name in skip:
                continue
            weight = child.weight
            if weight.device.type != "cpu" or not packing_supported(weight.dtype):
                continue
            setattr(parent, name, PackedLinear(child))  # the dense weight is freed here
            count += 1
    return count
