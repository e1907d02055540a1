"""kvswap's paged decoder against transformers' reference implementations.

Random-weight Llama (GQA, explicit head_dim, llama3 RoPE scaling), Qwen2 (q/k/v
bias, tied embeddings) and Mistral (linear RoPE scaling) models are saved with
`save_pretrained` (one file and sharded), loaded by kvswap, and compared: the
logits at every prompt position within fp32 tolerance, and 16 greedy tokens
identical to `generate(do_sample=False)`, in both of the model's modes (fast:
whole-batch matmuls and batched attention; exact: fixed tiles). transformers is
a test-only dependency; nothing is downloaded.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")

from kvswap.model.generate import generate_reference  # noqa: E402
from kvswap.model.llama import LlamaForCausal  # noqa: E402
from kvswap.model.loader import load_model  # noqa: E402
from kvswap.model.paged_attention import AttentionBatch  # noqa: E402

CPU = torch.device("cpu")
ATOL = 1e-4
PROMPT_TOKENS = 37
NEW_TOKENS = 16
BLOCK_TOKENS = 4  # small blocks: a 53-token context spans 14 of them

_COMMON: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}


def _llama() -> Any:
    config = transformers.LlamaConfig(
        **_COMMON,
        head_dim=32,  # explicit, != hidden_size / num_heads
        rope_theta=10000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )
    return transformers.LlamaForCausalLM(config)


def _qwen2() -> Any:
    config = transformers.Qwen2Config(**_COMMON, tie_word_embeddings=True)
    return transformers.Qwen2ForCausalLM(config)


def _mistral() -> Any:
    config = transformers.MistralConfig(
        **_COMMON, sliding_window=None, rope_scaling={"rope_type": "linear", "factor": 2.0}
    )
    return transformers.MistralForCausalLM(config)


BUILDERS = {"llama": _llama, "qwen2": _qwen2, "mistral": _mistral}


@torch.no_grad()
def _randomize(model: Any, seed: int) -> None:
    """O(1) activations (the default 0.02 init makes near-uniform logits, i.e. argmax ties);
    non-trivial biases and norm weights so loading them is actually tested."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.1 * noise)
        elif name.endswith(".bias"):
            param.copy_(0.1 * noise)
        elif "embed_tokens" in name:
            param.copy_(noise)
        else:
            param.copy_(noise / math.sqrt(param.shape[1]))


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(hf_model, single-file dir, sharded dir) for one architecture."""
    torch.manual_seed(0)
    hf_model = BUILDERS[request.param]().eval()
    _randomize(hf_model, seed=1)
    single = tmp_path_factory.mktemp(f"{request.param}_single")
    sharded = tmp_path_factory.mktemp(f"{request.param}_sharded")
    hf_model.save_pretrained(single, safe_serialization=True)
    hf_model.save_pretrained(sharded, safe_serialization=True, max_shard_size="20KB")
    return hf_model, single, sharded


def _prompt() -> list[int]:
    generator = torch.Generator().manual_seed(7)
    return torch.randint(0, _COMMON["vocab_size"], (PROMPT_TOKENS,), generator=generator).tolist()


MODES = {"fast": False, "exact": True}  # mode name -> batch_invariant


def _load(directory: Path, mode: str = "fast") -> LlamaForCausal:
    model, config = load_model(str(directory), None, CPU, batch_invariant=MODES[mode])
    assert config.dtype_name == "fp32"
    assert model.batch_invariant is MODES[mode]
    return model


def _hf_logits(hf_model: Any, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = hf_model(torch.tensor([prompt]), use_cache=False)
    return out.logits[0].float()  # [T, vocab]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_prompt_position_matches_token_by_token(saved: Any, mode: str) -> None:
    hf_model, single, _ = saved
    model = _load(single, mode)
    prompt = _prompt()
    expected = _hf_logits(hf_model, prompt)
    table = tuple(range(-(-PROMPT_TOKENS // BLOCK_TOKENS)))
    kv = model.allocate_kv(len(table), BLOCK_TOKENS)
    for position, token in enumerate(prompt):
        batch = AttentionBatch((1,), (position + 1,), (table,))
        got = model(torch.tensor([token]), batch, kv)[0]
        torch.testing.assert_close(got, expected[position], atol=ATOL, rtol=0)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_prefill_in_one_and_in_chunks_match(saved: Any, mode: str) -> None:
    hf_model, single, _ = saved
    model = _load(single, mode)
    prompt = _prompt()
    expected = _hf_logits(hf_model, prompt)[-1]
    table = tuple(range(-(-PROMPT_TOKENS // BLOCK_TOKENS)))
    for chunk_tokens in (PROMPT_TOKENS, 10):
        kv = model.allocate_kv(len(table), BLOCK_TOKENS)
        for start in range(0, PROMPT_TOKENS, chunk_tokens):
            chunk = prompt[start : start + chunk_tokens]
            batch = AttentionBatch((len(chunk),), (start + len(chunk),), (table,))
            got = model(torch.tensor(chunk), batch, kv)[0]
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_a_mixed_batch_matches_hf_for_every_sequence(saved: Any) -> None:
    """Fast mode, three sequences sharing steps: a whole prefill, a chunk after an
    earlier chunk, and decodes of different context lengths batched in one call."""
    hf_model, single, _ = saved
    model = _load(single, "fast")
    prompt = _prompt()
    expected = _hf_logits(hf_model, prompt)  # [T, vocab]
    tables = ((0, 1, 2, 3, 4, 5, 6, 7, 8, 9), (19, 11, 15, 13, 17, 10, 12, 14, 16, 18))
    tables = (*tables, tuple(range(20, 30)))
    kv = model.allocate_kv(30, BLOCK_TOKENS).normal_(generator=torch.Generator().manual_seed(2))
    # (sequence, first position, new tokens) per step; every sequence reads `prompt`.
    steps = [
        [(0, 0, 9), (1, 0, 5)],
        [(0, 9, 1), (1, 5, 14), (2, 0, 23)],
        [(2, 23, 1), (0, 10, 1), (1, 19, 1)],
        [(1, 20, 1), (2, 24, 1), (0, 11, 1)],
    ]
    for step in steps:
        ids = [t for _, first, n in step for t in prompt[first : first + n]]
        batch = AttentionBatch(
            tuple(n for _, _, n in step),
            tuple(first + n for _, first, n in step),
            tuple(tables[seq] for seq, _, _ in step),
        )
        got = model(torch.tensor(ids), batch, kv)
        for row, (_, first, n) in enumerate(step):
            torch.testing.assert_close(got[row], expected[first + n - 1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_generation_matches_hf_generate(saved: Any, mode: str) -> None:
    hf_model, single, _ = saved
    model = _load(single, mode)
    prompt = _prompt()
    with torch.no_grad():
        hf_out = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False
        )
    hf_tokens = tuple(hf_out[0, PROMPT_TOKENS:].tolist())
    ours = generate_reference(model, prompt, NEW_TOKENS, block_tokens=BLOCK_TOKENS)
    assert len(hf_tokens) == NEW_TOKENS
    assert ours.token_ids == hf_tokens


def test_sharded_checkpoint_loads_identically(saved: Any) -> None:
    _, single, sharded = saved
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    a, b = _load(single), _load(sharded)
    for (name_a, pa), (name_b, pb) in zip(
        a.state_dict().items(), b.state_dict().items(), strict=True
    ):
        assert name_a == name_b
        assert torch.equal(pa, pb), name_a
    prompt = _prompt()
    assert torch.equal(
        generate_reference(a, prompt, 4).logits, generate_reference(b, prompt, 4).logits
    )
