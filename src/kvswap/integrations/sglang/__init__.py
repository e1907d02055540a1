"""kvswap for SGLang: a HiCache storage backend over kvswap's shared store or NVMe slab.

`KvSwapStorage` (storage.py) is what SGLang's `dynamic` backend loads by
`module_path` "kvswap.integrations.sglang" and `class_name` "KvSwapStorage"; it
imports SGLang, which kvswap itself does not depend on, so it is loaded when
asked for. `options`, `pages` and `page_store` hold the SGLang-free parts.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "KvSwapStorage":
        from kvswap.integrations.sglang.storage import KvSwapStorage

        return KvSwapStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
