"""What the vLLM scripts share: one result line, the LLM on the tiny model, and
test-only hooks that reach kvswap's objects inside the engine.

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by
`tests/vllm_support.py`, and the "uni" executor), so the scripts can find the
adapter's objects (`only`), damage what they hold, and step the engine until
its stores and cascades have landed (`settle`). None of this is in the
package's normal path.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULT_MARK = "KVSWAP_RESULT "
#: The README's LLM(...) arguments for vLLM's CPU backend, with a device pool of 8 blocks
#: of 32 tokens (one more for vLLM's null block) so that a few prompts push one out.
BLOCK_TOKENS = 32
NUM_DEVICE_BLOCKS = 8
SPEC = {"spec_name": "KvswapOffloadingSpec", "spec_module_path": "kvswap.integrations.vllm"}
SETTLE_LIMIT_S = 60.0


def emit(result: dict[str, Any]) -> None:
    print(RESULT_MARK + json.dumps(result), flush=True)


def llm_arguments(
    model_dir: Path, extra: dict[str, Any] | None, connector: dict[str, str] | None = None
) -> dict[str, Any]:
    """`connector`: the connector's names (vLLM's OffloadingConnector by default)."""
    arguments: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": "float32",
        "block_size": BLOCK_TOKENS,
        "enforce_eager": True,
        "num_gpu_blocks_override": NUM_DEVICE_BLOCKS + 1,
        "max_model_len": NUM_DEVICE_BLOCKS * BLOCK_TOKENS,
        "max_num_seqs": 4,
        "seed": 0,
        "gpu_memory_utilization": 0.1,  # on CPU: the share of RAM vLLM may reserve
        "distributed_executor_backend": "uni",
    }
    if extra is not None:
        arguments["kv_transfer_config"] = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {**SPEC, **extra},
            **(connector or {}),
        }
    return arguments


def make_llm(
    model_dir: Path, extra: dict[str, Any] | None, connector: dict[str, str] | None = None
) -> Any:
    from vllm import LLM

    return LLM(**llm_arguments(model_dir, extra, connector))


def generate(llm: Any, tokens: list[int], max_tokens: int = 8) -> dict[str, Any]:
    """Greedy tokens for one prompt, and how many prompt tokens vLLM did not compute.
    Then the engine is settled: the request's stores (and their cascades) landed."""
    (result,) = generate_all(llm, [tokens], max_tokens)
    return result


def generate_all(llm: Any, prompts: list[list[int]], max_tokens: int = 8) -> list[dict[str, Any]]:
    """`generate` for several prompts submitted together (vLLM batches them)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=tokens) for tokens in prompts], sampling, use_tqdm=False
    )
    settle(llm)
    return [
        {"tokens": list(output.outputs[0].token_ids), "cached": output.num_cached_tokens}
        for output in outputs
    ]


def settle(llm: Any) -> None:
    """Step the engine until its connector has nothing in flight: LLM.generate returns
    once the outputs are out, before the last stores are even submitted."""
    core = llm.llm_engine.engine_core.engine_core  # in-process engine core
    deadline_s = time.monotonic() + SETTLE_LIMIT_S
    while core.scheduler.has_requests():
        if time.monotonic() > deadline_s:
            raise RuntimeError(f"the engine still has work after {SETTLE_LIMIT_S} s")
        llm.llm_engine.step()
        time.sleep(0.002)  # let the copy threads run


def close(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def instances(cls: type) -> list[Any]:
    """The live instances of `cls` (the adapter's objects inside the engine). vLLM
    freezes the collector after start-up, which hides older objects from it."""
    gc.unfreeze()
    gc.collect()
    return [obj for obj in gc.get_objects() if type(obj) is cls]


def only(cls: type, *, besides: Sequence[Any] = ()) -> Any:
    """The one live instance of `cls` that is not in `besides` (those of an LLM closed
    earlier in this process may outlive it)."""
    found = [obj for obj in instances(cls) if all(obj is not old for old in besides)]
    if len(found) != 1:
        raise RuntimeError(f"expected one {cls.__name__}, found {len(found)}")
    return found[0]


def tokens(start: int, count: int) -> list[int]:
    """`count` distinct token ids from `start` (a prompt nobody else shares)."""
    return [3 + (start + i) % 500 for i in range(count)]
