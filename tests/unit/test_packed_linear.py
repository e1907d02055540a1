"""The fast mode's pre-packed CPU linears: the same results as `F.linear` to fp32
rounding, the dense weight replaced (not copied), and only where they apply."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from kvswap.model.generate import generate_reference
from kvswap.model.linear import SlicedLinear, TiledLinear
from kvswap.model.llama import LlamaForCausal
from kvswap.model.loader import PRESETS, load_model
from kvswap.model.packed_linear import PackedLinear, pack_linears, packing_supported

CPU = torch.device("cpu")

needs_packing = pytest.mark.skipif(
    not packing_supported(torch.float32), reason="this torch has no oneDNN linear packing"
)


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_equals_one_matmul_to_rounding(bias: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    dense = nn.Linear(48, 80, bias=bias)
    with torch.no_grad():
        for param in dense.parameters():
            param.normal_(generator=generator)
    packed = PackedLinear(dense)
    wide = torch.randn(40, 96, generator=generator)
    inputs = [torch.randn(rows, 48, generator=generator) for rows in (1, 2, 7, 16, 300)]
    inputs += [wide[:, :48], wide[::2, 48:]]  # strided rows, as x[rows] and slices give
    with torch.inference_mode():
        for x in inputs:
            torch.testing.assert_close(packed(x), dense(x), rtol=1e-5, atol=1e-5)
        assert packed(torch.empty(0, 48)).shape == (0, 80)
    state = packed.state_dict()  # the same bytes under the same names
    assert torch.equal(state["weight"], dense.weight) and ("bias" in state) == bias


@needs_packing
def test_the_fast_model_packs_every_linear_and_the_exact_model_none() -> None:
    fast, _ = load_model("tiny", None, CPU)
    exact, _ = load_model("tiny", None, CPU, batch_invariant=True)
    layer = fast.model.layers[0]
    linears = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
               layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
               layer.mlp.down_proj, fast.lm_head]  # fmt: skip
    assert all(isinstance(m, PackedLinear) for m in linears)
    assert not any(isinstance(m, (nn.Linear, TiledLinear)) for m in fast.modules())
    assert not any(isinstance(m, PackedLinear) for m in exact.modules())
    # No dense copy stays behind: the packed model holds only norms and the embedding.
    dense_params = {name for name, _ in fast.named_parameters()}
    assert dense_params == {n for n in exact.state_dict() if "norm" in n or "embed" in n}
    assert fast.pack_weights() == 0  # nothing left to pack
    prompt = list(range(3, 40))
    fast_ids = generate_reference(fast, prompt, 12).token_ids
    assert fast_ids == generate_reference(exact, prompt, 12).token_ids


@needs_packing
def test_a_tied_lm_head_stays_dense_and_shared() -> None:
    config = replace(PRESETS["tiny"], tie_word_embeddings=True)
    model = LlamaForCausal(config).eval()
    assert model.pack_weights() == 7 * config.num_layers  # every layer's linears, no head
    assert isinstance(model.lm_head, SlicedLinear)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_only_fp32_on_a_cpu_is_packed() -> None:
    assert not packing_supported(torch.bfloat16) and not packing_supported(torch.float16)
    model, _ = load_model("tiny", "bf16", CPU)
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    with torch.device("meta"):
        shapes_only = LlamaForCausal(PRESETS["tiny"])
    assert pack_linears(shapes_only) == 0  # not on a CPU: left as it was
