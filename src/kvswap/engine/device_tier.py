"""vLLM's `--gpu-memory-utilization`: the device tier as a share of the device's memory.

    device tier bytes = F x device memory - the weights' bytes
    device memory     = CUDA: the GPU's total memory
                        CPU:  the host memory this process may still allocate
                              (`kvswap.host_memory`: MemAvailable, ulimit -v, cgroups)

Activations and the copy engine's buffers are not subtracted, as vLLM subtracts
its profiled peak: leave them room with F < 1. Nothing is allocated here.
"""

from __future__ import annotations

from kvswap.errors import KvSwapError
from kvswap.host_memory import host_memory
from kvswap.model.arch_config import ModelArchConfig
from kvswap.model.dtypes import dtype_bytes
from kvswap.model.params import count_params
from kvswap.units import format_bytes


def weight_bytes(arch: ModelArchConfig) -> int:
    """The bytes of `arch`'s weights in the dtype they are held in."""
    d = arch.description
    config = {
        "model_type": arch.model_type, "tie_word_embeddings": arch.tie_word_embeddings,
        "attention_bias": arch.qkv_bias, "mlp_bias": arch.mlp_bias,
    }  # fmt: skip
    num_params = count_params(config, d)
    if num_params is None:
        raise KvSwapError(f"{d.name}: its weights cannot be counted; size the GPU tier in bytes")
    return num_params * dtype_bytes(arch.dtype_name)


def device_memory_bytes(cuda: bool) -> tuple[int, str]:
    """The memory `--gpu-memory-utilization` is a share of, and what it is (for messages)."""
    if cuda:
        import torch  # only on a CUDA device: this module is read by commands too

        return torch.cuda.get_device_properties(0).total_memory, "the GPU's memory"
    memory = host_memory()
    return memory.available_bytes, f"host memory ({memory.limit})"


def device_tier_blocks(
    utilization: float, arch: ModelArchConfig, block_bytes: int, *, cuda: bool
) -> int:
    """Blocks of the device tier at `utilization` of the device's memory."""
    total_bytes, what = device_memory_bytes(cuda)
    weights_bytes = weight_bytes(arch)
    room_bytes = int(utilization * total_bytes) - weights_bytes
    if room_bytes < block_bytes:
        raise KvSwapError(
            f"--gpu-memory-utilization {utilization}: {utilization:g} x "
            f"{format_bytes(total_bytes)} ({what}) leaves {format_bytes(max(0, room_bytes))} after "
            f"{format_bytes(weights_bytes)} of weights, less than one {format_bytes(block_bytes)} "
            "block; allowed: a larger share, or --gpu-kv-capacity-bytes"
        )
    return room_bytes // block_bytes
