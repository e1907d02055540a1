"""kvswap for Hugging Face transformers: `model.generate(..., cache=TieredCache(...))`.

Requires `transformers` (5.x), which kvswap itself does not depend on.
"""

from kvswap.integrations.transformers.cache import TieredCache, TieredLayer
from kvswap.integrations.transformers.report import CacheReport
from kvswap.integrations.transformers.settings import TieredCacheSettings

__all__ = ["CacheReport", "TieredCache", "TieredCacheSettings", "TieredLayer"]
