"""The fast mode (the default) against the exact mode on the `tiny` preset (fp32, CPU).

The fast mode batches: one matmul per linear over the whole step, one SDPA call
for every decode sequence together, one per prefill chunk. Its logits equal the
exact mode's to fp32 rounding (not bit for bit), and it is still deterministic:
for the same steps, where the blocks live changes nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from kvswap.cli import main
from kvswap.control.scheduler_records import ScheduledSeq, StepPlan
from kvswap.engine.runner import ModelRunner
from kvswap.model.fast_attention import FastPagedAttention
from kvswap.model.generate import generate_reference, sample_token
from kvswap.model.linear import LINEAR_TILE_ROWS, SlicedLinear, TiledLinear, make_linear
from kvswap.model.llama import LlamaForCausal
from kvswap.model.loader import PRESETS, load_model
from kvswap.model.paged_attention import AttentionBatch, build_attention_metadata
from kvswap.openmp_env import (
    ONEDNN_CACHE_ENTRIES,
    ONEDNN_CACHE_VARIABLES,
    USER_SETTINGS,
    cap_onednn_caches,
    model_threads,
    prefer_passive_openmp_wait,
)
from kvswap.sampling import SamplingParams

CPU = torch.device("cpu")
BLOCK_TOKENS = 4
ATOL = 1e-5

Step = list[tuple[list[int], int, tuple[int, ...]]]  # (new ids, context_len, block table)


@pytest.fixture(scope="module")
def fast() -> LlamaForCausal:
    return load_model("tiny", None, CPU)[0]


@pytest.fixture(scope="module")
def exact() -> LlamaForCausal:
    return load_model("tiny", None, CPU, batch_invariant=True)[0]


def _tokens(count: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(model: LlamaForCausal, kv: torch.Tensor, steps: list[Step]) -> list[torch.Tensor]:
    out = []
    for step in steps:
        ids = torch.tensor([t for new, _, _ in step for t in new], device=model.device)
        batch = AttentionBatch(
            tuple(len(new) for new, _, _ in step),
            tuple(ctx for _, ctx, _ in step),
            tuple(table for _, _, table in step),
        )
        out.append(model(ids, batch, kv))
    return out


def _mixed_steps(tables: tuple[tuple[int, ...], ...]) -> list[Step]:
    """Every shape of step the fast mode plans differently, over three sequences."""
    a, b, c = _tokens(16, 1), _tokens(16, 2), _tokens(32, 3)
    ta, tb, tc = tables
    return [
        [(a[:10], 10, ta)],  # one whole prefill: this step's own K/V, no gather
        [(a[10:11], 11, ta), (b[:6], 6, tb)],  # a decode and a whole prefill
        [(b[6:9], 9, tb), (a[11:12], 12, ta), (c[:30], 30, tc)],  # a later chunk: gathered
        [(a[12:13], 13, ta), (b[9:10], 10, tb), (c[30:31], 31, tc)],  # decodes, padded keys
        [(c[31:32], 32, tc), (a[13:14], 14, ta)],  # decodes of very different lengths
        [(b[10:11], 11, tb), (a[14:15], 15, ta)],
        [(b[11:12], 12, tb), (a[15:16], 16, ta)],  # whole blocks, padded to the longest
        [(b[12:16], 16, tb)],  # a later chunk alone
        [(a[:1], 16, ta), (b[:1], 16, tb)],  # rewrites position 15 of both: no padding
    ]


CONTIGUOUS = ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11, 12, 13, 14, 15))
SCATTERED = ((11, 2, 19, 7), (0, 9, 5, 17), (1, 3, 4, 6, 8, 10, 12, 13))


def test_the_mode_decides_the_linear_layers_and_keeps_the_parameter_names() -> None:
    assert type(make_linear(4, 8, bias=False, batch_invariant=False)) is nn.Linear
    assert isinstance(make_linear(4, 8, bias=True, batch_invariant=True), TiledLinear)
    fast_model, _ = load_model("tiny", None, CPU)
    exact_model, _ = load_model("tiny", None, CPU, batch_invariant=True)
    assert not fast_model.batch_invariant and exact_model.batch_invariant
    assert not any(isinstance(m, TiledLinear) for m in fast_model.modules())
    assert isinstance(exact_model.model.layers[0].mlp.up_proj, TiledLinear)
    fast_state, exact_state = fast_model.state_dict(), exact_model.state_dict()
    assert list(fast_state) == list(exact_state)
    assert all(torch.equal(fast_state[n], exact_state[n]) for n in fast_state)


def test_a_tiled_linear_equals_one_matmul_to_rounding() -> None:
    layer = TiledLinear(16, 8, bias=True)
    x = torch.randn(3 * LINEAR_TILE_ROWS + 5, 16, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias))


def test_fast_logits_and_kv_match_the_exact_mode_in_every_kind_of_step(
    fast: LlamaForCausal, exact: LlamaForCausal
) -> None:
    garbage = torch.Generator().manual_seed(4)
    kv_exact = exact.allocate_kv(20, BLOCK_TOKENS).normal_(generator=garbage)
    kv_fast = kv_exact.clone()
    expected = _run(exact, kv_exact, _mixed_steps(SCATTERED))
    got = _run(fast, kv_fast, _mixed_steps(SCATTERED))
    for step, (g, e) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=0, msg=f"step {step}")
        assert torch.equal(g.argmax(-1), e.argmax(-1))
    torch.testing.assert_close(kv_fast, kv_exact, atol=ATOL, rtol=0)


def test_fast_mode_is_deterministic_and_placement_invariant(fast: LlamaForCausal) -> None:
    contiguous = _run(fast, fast.allocate_kv(16, BLOCK_TOKENS), _mixed_steps(CONTIGUOUS))
    # The same steps over a bigger pool whose free slots (and block tails) hold garbage.
    kv = fast.allocate_kv(20, BLOCK_TOKENS).normal_(generator=torch.Generator().manual_seed(3))
    scattered = _run(fast, kv, _mixed_steps(SCATTERED))
    for got, expected in zip(scattered, contiguous, strict=True):
        assert torch.equal(got, expected)


def test_decodes_of_very_different_lengths_attend_in_buckets(
    fast: LlamaForCausal, exact: LlamaForCausal
) -> None:
    """A 31-token context and two of 2 and 3 tokens: padding the short ones to the long
    one would spend 8 blocks each on 1, so they attend in a bucket of their own."""
    tables = ((0, 1, 2, 3, 4, 5, 6, 7), (8,), (9,))
    prompts = [_tokens(32, 30), _tokens(3, 31), _tokens(4, 32)]
    prefill = [[(p[:-1], len(p) - 1, t)] for p, t in zip(prompts, tables, strict=True)]
    decode = [(p[-1:], len(p), t) for p, t in zip(prompts, tables, strict=True)]
    batch = AttentionBatch((1, 1, 1), (32, 3, 4), tables)
    plan = FastPagedAttention(fast.allocate_kv(10, BLOCK_TOKENS), build_attention_metadata(
        batch, BLOCK_TOKENS, 10, CPU
    ))  # fmt: skip
    assert [bucket.seqs.tolist() for bucket in plan._decodes] == [[0], [1, 2]]
    results = []
    for model in (exact, fast):
        kv = model.allocate_kv(10, BLOCK_TOKENS)
        results.append(_run(model, kv, [*prefill, decode])[-1])
    torch.testing.assert_close(results[1], results[0], atol=ATOL, rtol=0)


def test_a_decode_batched_with_others_matches_it_alone(fast: LlamaForCausal) -> None:
    prompts = [_tokens(8, 10), _tokens(17, 11), _tokens(3, 12)]
    tables = ((0, 1, 2), (3, 4, 5, 6, 7), (8, 9))
    kv = fast.allocate_kv(10, BLOCK_TOKENS)
    # Prefill all but the last token of each, one at a time; then decode all three at once.
    for prompt, table in zip(prompts, tables, strict=True):
        _run(fast, kv, [[(prompt[:-1], len(prompt) - 1, table)]])
    together = _run(fast, kv, [[(p[-1:], len(p), t) for p, t in zip(prompts, tables, strict=True)]])
    for seq, (prompt, table) in enumerate(zip(prompts, tables, strict=True)):
        alone = _run(fast, kv, [[(prompt[-1:], len(prompt), table)]])[0]
        torch.testing.assert_close(together[0][seq : seq + 1], alone, atol=ATOL, rtol=0)


def test_fast_generation_matches_exact_generation(
    fast: LlamaForCausal, exact: LlamaForCausal
) -> None:
    prompt = _tokens(19, 7)
    expected = generate_reference(exact, prompt, 12, block_tokens=BLOCK_TOKENS)
    for chunk_tokens in (None, 6, 1):
        got = generate_reference(
            fast, prompt, 12, block_tokens=BLOCK_TOKENS, prefill_chunk_tokens=chunk_tokens
        )
        assert got.token_ids == expected.token_ids
        torch.testing.assert_close(got.logits, expected.logits, atol=ATOL, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_cuda_fast_path_matches_the_cpu_and_is_placement_invariant(
    fast: LlamaForCausal,
) -> None:
    model, _ = load_model("tiny", None, torch.device("cuda"))
    on_cpu = _run(fast, fast.allocate_kv(16, BLOCK_TOKENS), _mixed_steps(CONTIGUOUS))
    contiguous = _run(model, model.allocate_kv(16, BLOCK_TOKENS), _mixed_steps(CONTIGUOUS))
    kv = model.allocate_kv(20, BLOCK_TOKENS).normal_()
    scattered = _run(model, kv, _mixed_steps(SCATTERED))
    for cuda_logits, moved, cpu_logits in zip(contiguous, scattered, on_cpu, strict=True):
        assert torch.equal(moved, cuda_logits)
        torch.testing.assert_close(cuda_logits.cpu(), cpu_logits, atol=1e-3, rtol=0)
        assert torch.equal(cuda_logits.argmax(-1).cpu(), cpu_logits.argmax(-1))


# --- per-request sampling ---------------------------------------------------------------


def _plan(step: int, *items: tuple[int, list[int], int, SamplingParams | None]) -> StepPlan:
    """items: (seq_id, new token ids, start position, its sampling); every item samples."""
    seqs = tuple(
        ScheduledSeq(seq, tuple(ids), start, True, sampling) for seq, ids, start, sampling in items
    )
    return StepPlan(step=step, seqs=seqs, swap_wait_s=0.0)


def test_each_sequence_samples_with_the_params_its_plan_carries(exact: LlamaForCausal) -> None:
    a, b = _tokens(6, 20), _tokens(9, 21)
    tables = {1: (0, 1), 2: (2, 3, 4)}
    hot = SamplingParams(temperature=2.0, seed=9)

    def sampled(plans: list[StepPlan]) -> dict[int, int]:
        runner = ModelRunner(exact, exact.allocate_kv(5, BLOCK_TOKENS))
        out: dict[int, int] = {}
        for plan in plans:
            out.update(runner.run(plan, tables).sampled)
        return out

    got = sampled([_plan(0, (1, a, 0, None), (2, b, 0, hot))])
    # Each alone, in other steps: the same tokens (the seed is per sequence and position).
    assert sampled([_plan(3, (2, b, 0, hot))]) == {2: got[2]}
    assert sampled([_plan(7, (1, a, 0, None))]) == {1: got[1]}
    logits_a = exact(
        torch.tensor(a),
        AttentionBatch((6,), (6,), (tables[1],)),
        exact.allocate_kv(5, BLOCK_TOKENS),
    )[0]
    assert got[1] == sample_token(logits_a, None, None)  # None: greedy
    # One sampling for a whole run (`kvswap run --temperature`) is every request carrying
    # the same params: the same token as that sequence's own params give it.
    run_wide = sampled([_plan(0, (1, a, 0, hot), (2, b, 0, hot))])
    assert run_wide[2] == got[2]
    assert sampled([_plan(5, (1, a, 0, hot))]) == {1: run_wide[1]}


# --- kvswap generate follows [engine] batch_invariant -----------------------------------


def test_generate_runs_in_either_mode_and_refuses_a_bad_switch(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    modes: list[bool] = []
    real = load_model

    def recording(*args: object, **kwargs: object) -> object:
        modes.append(bool(kwargs.get("batch_invariant")))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr("kvswap.commands.generate.load_model", recording)
    base = ["generate", "--model", "tiny", "--prompt-ids", "1,2,3", "--device", "cpu", "--json"]
    outputs = []
    for extra, environ in (
        ([], {}),
        (["--batch-invariant"], {}),
        ([], {"KVSWAP_BATCH_INVARIANT": "1"}),
    ):
        for name, value in environ.items():
            monkeypatch.setenv(name, value)
        assert main([*base, *extra]) == 0
        outputs.append(json.loads(capsys.readouterr().out)["output_ids"])
    assert modes == [False, True, True]
    assert outputs[0] == outputs[1] == outputs[2]
    monkeypatch.delenv("KVSWAP_BATCH_INVARIANT")
    assert main([*base, "--batch-invariant", "maybe"]) == 2
    err = capsys.readouterr().err
    assert "batch_invariant" in err and "allowed: true, false" in err
    assert len(err.strip().splitlines()) == 1


# --- the model has every core -----------------------------------------------------------


def test_the_passive_openmp_wait_is_chosen_before_torch_loads_and_never_over_a_user() -> None:
    probe = (
        "import os, sys\n"
        "from kvswap.openmp_env import prefer_passive_openmp_wait\n"
        "assert 'torch' not in sys.modules\n"
        "print(prefer_passive_openmp_wait(), os.environ.get('OMP_WAIT_POLICY'))\n"
    )
    clean = {k: v for k, v in os.environ.items() if k not in USER_SETTINGS}
    for extra, expected in (({}, "True PASSIVE"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "False ACTIVE")):
        done = subprocess.run(
            [sys.executable, "-c", probe], env={**clean, **extra}, capture_output=True,
            text=True, check=True,
        )  # fmt: skip
        assert done.stdout.split() == expected.split()
    # Here torch is loaded: setting it now would reach only child processes.
    environ: dict[str, str] = {}
    assert prefer_passive_openmp_wait(environ) is False and environ == {}


def test_the_command_line_caps_onednn_caches_before_torch_loads() -> None:
    # Uncapped, each row count a server sees adds a compiled primitive to two caches
    # of 1,024 entries: its memory grew with every new one (benchmarks/serve_soak.py).
    probe = (
        "import os, sys\n"
        "from kvswap.__main__ import entry\n"
        "sys.argv = ['kvswap', 'plan', '--preset', 'article-8b', '--json']\n"
        "code = entry()\n"
        "print(code, *(os.environ[name] for name in sys.argv[1:]))\n"
    )
    clean = {k: v for k, v in os.environ.items() if k not in ONEDNN_CACHE_VARIABLES}
    done = subprocess.run(
        [sys.executable, "-c", probe.replace("sys.argv[1:]", repr(ONEDNN_CACHE_VARIABLES))],
        env=clean, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert done.stdout.split()[-3:] == ["0", *[str(ONEDNN_CACHE_ENTRIES)] * 2]
    environ = {"LRU_CACHE_CAPACITY": "7"}  # a user's own choice is kept
    assert cap_onednn_caches(environ) is False and environ == {"LRU_CACHE_CAPACITY": "7"}


def test_the_model_takes_every_core_unless_told_otherwise() -> None:
    cores = os.cpu_count() or 1
    assert model_threads(None, {}) == cores
    assert model_threads(3, {"OMP_NUM_THREADS": "1"}) == 3  # the caller's choice wins
    # A user's OMP_NUM_THREADS, which torch read when it loaded, is kept (None: leave
    # torch's count); an empty one is no choice.
    assert model_threads(None, {"OMP_NUM_THREADS": "1"}) is None
    assert model_threads(None, {"OMP_NUM_THREADS": " "}) == cores


def test_a_sliced_linear_equals_one_matmul_to_rounding() -> None:
    layer = SlicedLinear(16, 2500, bias=True, slice_features=1024)  # 1024 + 1024 + 452
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        layer.bias.normal_(generator=generator)
        for rows in (1, 2, 16):
            x = torch.randn(rows, 16, generator=generator)
            expected = nn.functional.linear(x, layer.weight, layer.bias)
            torch.testing.assert_close(layer(x), expected)
    with torch.device("meta"):  # shapes only
        small = LlamaForCausal(PRESETS["small"])
    assert isinstance(small.lm_head, SlicedLinear) and small.lm_head.out_features == 32000
    with torch.device("meta"):
        exact_small = LlamaForCausal(PRESETS["small"], batch_invariant=True)
    assert isinstance(exact_small.lm_head, TiledLinear)
