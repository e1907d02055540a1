"""The fast mode (the default) under offload: the same greedy tokens as a no-offload run.

The fast mode is not bit-exact: a step's matmul and attention shapes depend on
what shares the step, so logits differ from run to run in the last fp32 bits.
Tokens still cannot change when every argmax wins by far more than that, so
these runs use a "peaky" model (the `tiny` preset with its LM head scaled up)
and check that premise: the smallest top-1/top-2 logit gap of the reference run
is recorded and must dwarf fp32 rounding. Then a tight pool with swap
preemption, with recompute preemption, and with an NVMe tier must all give the
reference digest. (Block bytes through the tiers are checked by the copy-engine
tests; bit-identical output is the exact mode's, in test_engine_outputs.py.)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from kvswap.config_load import load_config
from kvswap.engine import runner
from kvswap.engine.engine import Engine
from kvswap.engine.settings import EngineOptions, engine_settings
from kvswap.model.generate import sample_token
from kvswap.model.loader import load_model
from kvswap.sampling import SamplingParams
from kvswap.workload.synthetic import generate_synthetic
from tests.integration.test_engine_outputs import BASE, SPEC
from tests.unit.test_llama import TINY_HF_CONFIG

# The sessions and pools of the exact-mode output tests, run on the fast path.
FAST_BASE: dict[str, object] = {**BASE, "batch_invariant": False}
LM_HEAD_SCALE = 8.0
#: The fast mode's logits of the unscaled model stay within 1e-5 of the exact mode's
#: (test_fast_path's tolerance; ~1e-6 seen), so within 1e-5 * LM_HEAD_SCALE here:
#: every greedy choice must win by a hundred times that.
MIN_MARGIN = 100 * 1e-5 * LM_HEAD_SCALE


@pytest.fixture(scope="module")
def peaky(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A checkpoint directory: the tiny preset's weights, LM head x LM_HEAD_SCALE."""
    model, _ = load_model("tiny", None, torch.device("cpu"))
    tensors = {name: t.clone() for name, t in model.state_dict().items()}
    tensors["lm_head.weight"] *= LM_HEAD_SCALE
    directory = tmp_path_factory.mktemp("peaky")
    (directory / "config.json").write_text(json.dumps(TINY_HF_CONFIG))
    save_file(tensors, str(directory / "model.safetensors"))
    return str(directory)


def run(model: str, **settings: object) -> dict[str, Any]:
    config = load_config(environ={}, overrides={**FAST_BASE, **settings})
    with Engine(engine_settings(config, EngineOptions(model=model))) as engine:
        assert engine.model.batch_invariant is bool(settings.get("batch_invariant", False))
        return engine.run(generate_synthetic(SPEC)).to_json()


@pytest.fixture(scope="module")
def margins(peaky: str) -> Iterator[list[float]]:
    """Records the top-1/top-2 logit gap of every greedy token the engine samples."""
    recorded: list[float] = []

    def recording(
        logits: torch.Tensor, sampling: SamplingParams | None, generator: torch.Generator | None
    ) -> int:
        if sampling is None:
            top2 = torch.topk(logits, 2).values
            recorded.append(float(top2[0] - top2[1]))
        return sample_token(logits, sampling, generator)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner, "sample_token", recording)
        yield recorded


@pytest.fixture(scope="module")
def reference(peaky: str, margins: list[float]) -> dict[str, Any]:
    """Fast mode, everything fits on the GPU: nothing is ever swapped."""
    margins.clear()
    summary = run(peaky, gpu_kv_capacity_blocks=200, cpu_kv_capacity_blocks=0)
    assert summary["preemptions"] == 0 and summary["bytes_gpu_to_cpu"] == 0
    assert summary["requests_completed"] == 8
    assert len(margins) == summary["tokens_generated"]
    assert min(margins) > MIN_MARGIN, f"the model is not peaky enough: {min(margins)}"
    return summary


def test_the_peaky_model_gives_the_exact_modes_tokens(
    peaky: str, reference: dict[str, Any]
) -> None:
    exact = run(peaky, gpu_kv_capacity_blocks=200, cpu_kv_capacity_blocks=0, batch_invariant=True)
    assert exact["outputs_digest"] == reference["outputs_digest"]


def test_swap_preemption_in_a_tight_pool_keeps_every_token(
    peaky: str, reference: dict[str, Any]
) -> None:
    summary = run(peaky, gpu_kv_capacity_blocks=10, cpu_kv_capacity_blocks=64)
    assert summary["preemptions"] > 0
    assert summary["bytes_gpu_to_cpu"] > 0 and summary["bytes_cpu_to_gpu"] > 0
    assert summary["outputs_digest"] == reference["outputs_digest"]


def test_recompute_preemption_in_a_tight_pool_keeps_every_token(
    peaky: str, reference: dict[str, Any]
) -> None:
    summary = run(
        peaky, gpu_kv_capacity_blocks=10, cpu_kv_capacity_blocks=0, preemption="recompute"
    )
    assert summary["preemptions"] > 0 and summary["recomputed_tokens"] > 0
    assert summary["outputs_digest"] == reference["outputs_digest"]


def test_an_nvme_tier_keeps_every_token(
    peaky: str, reference: dict[str, Any], tmp_path: Path
) -> None:
    summary = run(
        peaky, gpu_kv_capacity_blocks=10, cpu_kv_capacity_blocks=6, nvme_kv_capacity_blocks=64,
        nvme_dir=str(tmp_path), cpu_demote_high_watermark=0.5, cpu_demote_low_watermark=0.2,
    )  # fmt: skip
    assert summary["bytes_cpu_to_nvme"] > 0
    assert summary["outputs_digest"] == reference["outputs_digest"]
    assert list(tmp_path.iterdir()) == []
