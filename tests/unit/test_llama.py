"""The paged Llama decoder on the `tiny` preset (fp32, CPU): invariance, chunking, loading.

The bit-identity tests run the exact mode (`batch_invariant=True`), whose promise they
check; the fast mode is compared with it in test_fast_path.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from kvswap.errors import KvSwapError
from kvswap.model.arch_config import LinearRopeScaling, Llama3RopeScaling
from kvswap.model.generate import generate_reference
from kvswap.model.hf_config import parse_hf_config
from kvswap.model.llama import LlamaForCausal
from kvswap.model.loader import load_model
from kvswap.model.paged_attention import AttentionBatch
from kvswap.model.rope import RotaryEmbedding, apply_rope
from kvswap.sampling import SamplingParams

CPU = torch.device("cpu")
BLOCK_TOKENS = 4


@pytest.fixture(scope="module")
def tiny() -> LlamaForCausal:
    return load_model("tiny", None, CPU, batch_invariant=True)[0]


def _tokens(count: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(
    model: LlamaForCausal,
    kv: torch.Tensor,
    steps: list[list[tuple[list[int], int, tuple[int, ...]]]],
    **kwargs: Any,
) -> list[torch.Tensor]:
    """Each step is a list of (new token ids, context_len, block table); returns logits per step."""
    out = []
    for step in steps:
        ids = torch.tensor([t for new, _, _ in step for t in new])
        batch = AttentionBatch(
            tuple(len(new) for new, _, _ in step),
            tuple(ctx for _, ctx, _ in step),
            tuple(table for _, _, table in step),
        )
        out.append(model(ids, batch, kv, **kwargs))
    return out


def _two_sequence_steps(
    table_a: tuple[int, ...], table_b: tuple[int, ...]
) -> list[list[tuple[list[int], int, tuple[int, ...]]]]:
    a, b = _tokens(13, 1), _tokens(9, 2)
    return [
        [(a[:10], 10, table_a)],  # A prefills alone
        [(a[10:11], 11, table_a), (b[:6], 6, table_b)],  # A decodes, B prefills
        [(b[6:9], 9, table_b), (a[11:12], 12, table_a)],  # B's 2nd chunk, A decodes
        [(a[12:13], 13, table_a), (b[8:9], 10, table_b)],  # both decode
    ]


# --- invariance ----------------------------------------------------------------------


def test_slot_placement_does_not_change_a_single_bit(tiny: LlamaForCausal) -> None:
    contiguous = _run(
        tiny, tiny.allocate_kv(8, BLOCK_TOKENS), _two_sequence_steps((0, 1, 2, 3), (4, 5, 6))
    )
    # Same sequences scattered over a bigger pool whose free slots hold garbage.
    kv = tiny.allocate_kv(16, BLOCK_TOKENS).normal_(generator=torch.Generator().manual_seed(3))
    scattered = _run(tiny, kv, _two_sequence_steps((11, 2, 14, 7), (0, 9, 5)))
    for got, expected in zip(scattered, contiguous, strict=True):
        assert torch.equal(got, expected)


def test_chunked_and_token_by_token_prefill_match_prefill_in_one(tiny: LlamaForCausal) -> None:
    prompt = _tokens(23, 4)
    table = tuple(range(6))
    whole = _run(tiny, tiny.allocate_kv(6, BLOCK_TOKENS), [[(prompt, 23, table)]])[-1]
    for chunk_tokens in (5, 1):
        steps = [
            [(prompt[s : s + chunk_tokens], min(s + chunk_tokens, 23), table)]
            for s in range(0, 23, chunk_tokens)
        ]
        chunked = _run(tiny, tiny.allocate_kv(6, BLOCK_TOKENS), steps)[-1]
        torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)
        assert torch.equal(chunked.argmax(-1), whole.argmax(-1))


def test_prefill_in_one_in_chunks_or_token_by_token_is_bit_identical(
    tiny: LlamaForCausal,
) -> None:
    prompt, table = _tokens(23, 5), tuple(range(6))
    whole_kv = tiny.allocate_kv(6, BLOCK_TOKENS)
    whole = _run(tiny, whole_kv, [[(prompt, 23, table)]])[-1]
    for sizes in ([5, 7, 11], [1] * 23, [4, 4, 15]):
        kv = tiny.allocate_kv(6, BLOCK_TOKENS)
        steps, done = [], 0
        for size in sizes:
            steps.append([(prompt[done : done + size], done + size, table)])
            done += size
        assert torch.equal(_run(tiny, kv, steps)[-1], whole), sizes
        assert torch.equal(kv, whole_kv), f"KV differs for chunks {sizes}"


def test_each_sequence_in_a_mixed_batch_gets_exactly_what_it_gets_alone(
    tiny: LlamaForCausal,
) -> None:
    tables = ((0, 1), (2, 3, 4, 5, 6), (7, 8, 9))
    prompts = [_tokens(5, 10), _tokens(17, 11), _tokens(9, 12)]
    alone = [
        _run(tiny, tiny.allocate_kv(10, BLOCK_TOKENS), [[(p, len(p), t)]])[0]
        for p, t in zip(prompts, tables, strict=True)
    ]
    # Sequence 1 was prefilled (minus its last token) in an earlier step: it decodes now.
    kv = tiny.allocate_kv(10, BLOCK_TOKENS)
    _run(tiny, kv, [[(prompts[1][:16], 16, tables[1])]])
    mixed_step = [(prompts[0], 5, tables[0]), (prompts[1][16:], 17, tables[1])]
    mixed_step.append((prompts[2], 9, tables[2]))
    mixed = _run(tiny, kv, [mixed_step])[0]
    for seq, expected in enumerate(alone):
        assert torch.equal(mixed[seq : seq + 1], expected)


def test_k_is_stored_after_rope_and_v_as_projected(tiny: LlamaForCausal) -> None:
    prompt = _tokens(6, 6)
    kv = tiny.allocate_kv(3, BLOCK_TOKENS)
    _run(tiny, kv, [[(prompt, 6, (2, 0))]])
    with torch.no_grad():
        layer = tiny.model.layers[0]
        h = layer.input_layernorm(tiny.model.embed_tokens(torch.tensor(prompt)))
        k = layer.self_attn.k_proj(h).view(6, 2, 16)
        v = layer.self_attn.v_proj(h).view(6, 2, 16)
        cos, sin = tiny.rope.cos_sin(torch.arange(6))
        k = apply_rope(k, cos, sin)
    stored_k = torch.cat((kv[2, 0, 0], kv[0, 0, 0]))[:6]  # block 2 holds tokens 0-3, block 0 4-5
    stored_v = torch.cat((kv[2, 0, 1], kv[0, 0, 1]))[:6]
    assert torch.equal(stored_k, k)
    assert torch.equal(stored_v, v)


# --- generation -----------------------------------------------------------------------


def test_generation_is_independent_of_slots_and_chunking(tiny: LlamaForCausal) -> None:
    prompt = _tokens(19, 7)
    base = generate_reference(tiny, prompt, 8, block_tokens=BLOCK_TOKENS)
    moved = generate_reference(
        tiny, prompt, 8, block_tokens=BLOCK_TOKENS, block_table=[9, 3, 5, 1, 0, 2, 7],
        num_pool_blocks=12,
    )  # fmt: skip
    assert torch.equal(moved.logits, base.logits)
    chunked = generate_reference(tiny, prompt, 8, block_tokens=BLOCK_TOKENS, prefill_chunk_tokens=6)
    assert torch.equal(chunked.logits, base.logits)


def test_sampling_is_seeded_and_degenerates_to_greedy(tiny: LlamaForCausal) -> None:
    prompt = _tokens(11, 8)
    greedy = generate_reference(tiny, prompt, 10).token_ids
    hot = SamplingParams(temperature=2.0, seed=5)
    first = generate_reference(tiny, prompt, 10, sampling=hot).token_ids
    assert generate_reference(tiny, prompt, 10, sampling=hot).token_ids == first
    assert first != greedy
    for narrow in (SamplingParams(1.0, seed=5, top_p=1e-6), SamplingParams(1.0, seed=5, top_k=1)):
        assert generate_reference(tiny, prompt, 10, sampling=narrow).token_ids == greedy


def test_generation_stops_at_a_stop_token(tiny: LlamaForCausal) -> None:
    prompt = _tokens(11, 8)
    greedy = generate_reference(tiny, prompt, 10).token_ids
    stopped = generate_reference(tiny, prompt, 10, stop_token_ids=frozenset({greedy[3]}))
    assert stopped.token_ids == greedy[: greedy.index(greedy[3]) + 1]


# --- loading --------------------------------------------------------------------------

TINY_HF_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "torch_dtype": "float32",
}  # fmt: skip


def _save_checkpoint(model: LlamaForCausal, directory: Path, num_shards: int) -> None:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(TINY_HF_CONFIG))
    tensors = {name: t.clone() for name, t in model.state_dict().items()}
    if num_shards == 1:
        save_file(tensors, str(directory / "model.safetensors"))
        return
    names = list(tensors)
    weight_map = {}
    for shard in range(num_shards):
        file_name = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = names[shard::num_shards]
        save_file({n: tensors[n] for n in part}, str(directory / file_name))
        weight_map.update(dict.fromkeys(part, file_name))
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def test_presets_are_deterministic() -> None:
    a, config = load_model("tiny", None, CPU)
    b, _ = load_model("tiny", None, CPU)
    assert (config.num_layers, config.num_kv_heads, config.head_dim) == (2, 2, 16)
    # state_dict: a packed layer (fast mode, CPU) names its weight there, not as a parameter
    a_weights, b_weights = a.state_dict().values(), b.state_dict().values()
    assert sum(w.numel() for w in a_weights) == 106_816
    assert all(torch.equal(x, y) for x, y in zip(a_weights, b_weights, strict=True))


def test_sharded_checkpoint_equals_single_file(tiny: LlamaForCausal, tmp_path: Path) -> None:
    _save_checkpoint(tiny, tmp_path / "single", 1)
    _save_checkpoint(tiny, tmp_path / "sharded", 3)
    single, _ = load_model(str(tmp_path / "single"), None, CPU)
    sharded, config = load_model(str(tmp_path / "sharded"), None, CPU)
    assert config.dtype_name == "fp32"
    weights = (m.state_dict().values() for m in (single, sharded, tiny))
    for x, y, z in zip(*weights, strict=True):
        assert torch.equal(x, y) and torch.equal(x, z)


def test_dtype_override_loads_bf16(tiny: LlamaForCausal, tmp_path: Path) -> None:
    _save_checkpoint(tiny, tmp_path / "ckpt", 1)
    model, config = load_model(str(tmp_path / "ckpt"), "bf16", CPU)
    assert config.dtype_name == "bf16" and model.dtype == torch.bfloat16
    assert len(generate_reference(model, _tokens(5, 9), 3).token_ids) == 3


def _broken(tmp_path: Path, tiny: LlamaForCausal, what: str) -> Path:
    directory = tmp_path / "ckpt"
    _save_checkpoint(tiny, directory, 1)
    tensors = {name: t.clone() for name, t in tiny.state_dict().items()}
    if what == "missing":
        del tensors["model.layers.1.mlp.up_proj.weight"]
    else:
        tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda tmp, m: tmp / "nope", "neither a preset (tiny, small) nor an existing directory"),
        (lambda tmp, m: Path("huge"), "neither a preset (tiny, small)"),
        (lambda tmp, m: tmp, "no config.json"),
        (lambda tmp, m: _broken(tmp, m, "missing"), "missing tensor model.layers.1.mlp.up_proj"),
        (
            lambda tmp, m: _broken(tmp, m, "shape"),
            "tensor model.layers.0.self_attn.k_proj.weight in model.safetensors has shape "
            "(16, 64), expected (32, 64)",
        ),
    ],
)
def test_loader_errors_name_the_problem(
    tmp_path: Path, tiny: LlamaForCausal, setup: Any, message: str
) -> None:
    with pytest.raises(KvSwapError, match=None) as info:
        load_model(str(setup(tmp_path, tiny)), None, CPU)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_loader_refuses_missing_or_corrupt_safetensors_and_a_bad_dtype(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_HF_CONFIG))
    with pytest.raises(KvSwapError, match=r"no \*\.safetensors files"):
        load_model(str(tmp_path), None, CPU)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(KvSwapError, match="cannot read safetensors file"):
        load_model(str(tmp_path), None, CPU)
    with pytest.raises(KvSwapError, match="unknown dtype 'int8'; choose one of fp32, fp16, bf16"):
        load_model("tiny", "int8", CPU)


# --- config parsing -------------------------------------------------------------------


def test_config_parsing_covers_both_rope_spellings_and_qwen2_bias() -> None:
    v4 = parse_hf_config({**TINY_HF_CONFIG, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert v4.rope_scaling == LinearRopeScaling(factor=2.0)
    v5 = parse_hf_config(
        {**TINY_HF_CONFIG, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5,
         "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192}}
    )  # fmt: skip
    assert v5.rope_theta == 5e5 and isinstance(v5.rope_scaling, Llama3RopeScaling)
    no_head_dim = {k: v for k, v in TINY_HF_CONFIG.items() if k != "head_dim"}
    qwen = parse_hf_config({**no_head_dim, "model_type": "qwen2", "hidden_size": 96})
    assert (qwen.head_dim, qwen.qkv_bias, qwen.o_bias) == (24, True, False)
    with pytest.raises(KvSwapError, match="'yarn' is not supported; supported: default, linear"):
        parse_hf_config({**TINY_HF_CONFIG, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(KvSwapError, match=r"'gemma2'.*supported model_type values: llama, mis"):
        parse_hf_config({**TINY_HF_CONFIG, "model_type": "gemma2"})


def test_mistral_sliding_window_refuses_longer_contexts() -> None:
    config = parse_hf_config({**TINY_HF_CONFIG, "model_type": "mistral", "sliding_window": 8})
    assert config.sliding_window_tokens == 8
    with torch.device("meta"):
        model = LlamaForCausal(config)
    model.to_empty(device=CPU)
    kv = model.allocate_kv(3, BLOCK_TOKENS)
    _run(model, kv, [[(_tokens(8, 1), 8, (0, 1, 2))]])  # within the window: fine
    with pytest.raises(KvSwapError, match="9 tokens exceeds the model's sliding_window of 8"):
        _run(model, kv, [[([1], 9, (0, 1, 2))]])


def test_linear_rope_scaling_divides_positions() -> None:
    plain = RotaryEmbedding(16, 10000.0, None)
    scaled = RotaryEmbedding(16, 10000.0, LinearRopeScaling(factor=4.0))
    cos_scaled, _ = scaled.cos_sin(torch.tensor([8, 20]))
    cos_plain, _ = plain.cos_sin(torch.tensor([2, 5]))
    torch.testing.assert_close(cos_scaled, cos_plain)


def test_bad_step_inputs_are_refused(tiny: LlamaForCausal) -> None:
    kv = tiny.allocate_kv(2, BLOCK_TOKENS)
    with pytest.raises(ValueError, match="need 1 <= query_len"):
        AttentionBatch((3,), (2,), ((0,),))
    with pytest.raises(ValueError, match="block table has 1"):
        _run(tiny, kv, [[(_tokens(5, 1), 5, (0,))]])
    with pytest.raises(ValueError, match=r"block slots must be in \[0, 2\)"):
        _run(tiny, kv, [[(_tokens(5, 1), 5, (0, 2))]])
    with pytest.raises(ValueError, match="kv pool must be"):
        _run(tiny, torch.zeros(2, 3, 2, 4, 2, 16), [[([1], 1, (0,))]])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_path_matches_cpu_and_is_placement_invariant(tiny: LlamaForCausal) -> None:
    model, _ = load_model("tiny", None, torch.device("cuda"), batch_invariant=True)
    prompt = _tokens(19, 7)
    base = generate_reference(model, prompt, 8, block_tokens=BLOCK_TOKENS, prefill_chunk_tokens=6)
    moved = generate_reference(
        model, prompt, 8, block_tokens=BLOCK_TOKENS, prefill_chunk_tokens=6,
        block_table=[9, 3, 5, 1, 0, 2, 7], num_pool_blocks=12,
    )  # fmt: skip
    assert torch.equal(moved.logits, base.logits)
    on_cpu = generate_reference(tiny, prompt, 8, block_tokens=BLOCK_TOKENS, prefill_chunk_tokens=6)
    assert base.token_ids == on_cpu.token_ids
    torch.testing.assert_close(base.logits, on_cpu.logits, atol=1e-3, rtol=0)
