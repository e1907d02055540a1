"""kvswap: a tiered KV cache (GPU, pinned CPU, NVMe) for LLM inference."""

__version__ = "0.1.0"
