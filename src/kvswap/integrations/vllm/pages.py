"""vLLM's KV memory in the copy engine's terms: one slot is one tensor's page of one block.

vLLM hands its offloading worker the KV caches as T tensors (one per layer, or
per group of layers that share bytes), each [num_gpu_blocks, page_bytes]: a
vLLM block is T pages, one per tensor, never one contiguous run. kvswap's copy
engine moves equal-sized slots between a device pool and a host pool, so here
a slot is one page, and a block moves as T slots:

    device slot   t * num_gpu_blocks + b            = tensors[t][b]

    host row c = one offloaded chunk (blocks_per_chunk blocks), exactly T x bpc pages,
    the layout vLLM's own CPU worker gives a chunk row:
    | tensor 0: block 0 | block 1 | ... | tensor 1: block 0 | block 1 | ... | ...
    host slot     c * T * bpc + t * bpc + j         = tensor t's page of block j of chunk c

Every page must be the same size (one KV cache group of one attention kind);
anything else is refused in one line. vLLM-free: tensors in, slot pairs out.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvswap.data.device_pool import DevicePool
from kvswap.data.layout import KVLayout
from kvswap.errors import KvSwapError
from kvswap.host_memory import host_memory
from kvswap.integrations.vllm.settings import SOURCE
from kvswap.units import format_bytes


class VllmDevicePages(DevicePool):
    """The copy engine's device pool over pages vLLM allocated: slot t * n + b is
    tensors[t][b]. It never allocates, so it does not run `DevicePool.__init__`
    (which allocates the engine's own pool); it sets what the copy engine reads
    (`layout`, `device`, `num_blocks`, `configured_bytes`) and answers `byte_view`."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        if not tensors:
            raise KvSwapError("vLLM gave the offloading worker no KV cache tensors")
        shapes = {tuple(tensor.shape) for tensor in tensors}
        if len(shapes) != 1 or len(next(iter(shapes))) != 2:
            raise KvSwapError(
                f"kvswap's vLLM worker needs KV tensors of one shape [num_blocks, page_bytes], "
                f"got {sorted(shapes)}: models whose layers differ in page size (hybrid "
                "attention, MLA beside MHA) are not supported"
            )
        num_gpu_blocks, page_bytes = next(iter(shapes))
        for tensor in tensors:
            if tensor.element_size() != 1 or tensor.stride(1) != 1:
                raise KvSwapError(
                    f"kvswap's vLLM worker needs byte tensors with contiguous pages, got "
                    f"{tensor.dtype} with strides {tensor.stride()}"
                )
        # pages[t]: [num_gpu_blocks, page_bytes] uint8, vLLM's memory (int8 viewed as uint8).
        self._pages = [tensor.view(torch.uint8) for tensor in tensors]
        self.num_tensors = len(tensors)
        self.num_gpu_blocks = num_gpu_blocks
        self.layout = KVLayout.from_block_bytes(page_bytes)
        self.device = tensors[0].device
        self.num_blocks = self.num_tensors * num_gpu_blocks  # the engine's slots: pages
        self.configured_bytes = self.num_blocks * page_bytes

    @property
    def page_bytes(self) -> int:
        return self.layout.block_bytes

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def block(self, slot: int) -> torch.Tensor:
        return self.byte_view(slot)

    def byte_view(self, slot: int) -> torch.Tensor:
        """Page `slot` as a flat uint8 view: [page_bytes]."""
        self._check_slot(slot)
        tensor, block = divmod(slot, self.num_gpu_blocks)
        return self._pages[tensor][block]

    def host_byte_rows(self) -> None:
        """None: vLLM's pages are one tensor per layer, not one pool of rows, so each
        page moves as a tensor copy (`block_copy.copy_block`)."""
        return None

    def check_integrity(self) -> None:
        for pages in self._pages:
            if tuple(pages.shape) != (self.num_gpu_blocks, self.page_bytes):
                raise AssertionError(f"a KV tensor changed shape: {tuple(pages.shape)}")


class PageMap:
    """Which page slots a job of whole vLLM blocks moves (the module docstring's map)."""

    def __init__(self, num_tensors: int, num_gpu_blocks: int, blocks_per_chunk: int) -> None:
        self.num_tensors = num_tensors
        self.num_gpu_blocks = num_gpu_blocks
        self.blocks_per_chunk = blocks_per_chunk

    @property
    def pages_per_chunk(self) -> int:
        """Pages in one host row (one offloaded chunk)."""
        return self.num_tensors * self.blocks_per_chunk

    def pairs(
        self, gpu_blocks: Sequence[int], first_block_index: int, host_chunks: Sequence[int]
    ) -> list[tuple[int, int]]:
        """(device slot, host slot) for every page of `gpu_blocks`, block by block.

        `gpu_blocks` are a request's blocks from its block `first_block_index` on
        (vLLM's `GPULoadStoreSpec.block_indices`), held by `host_chunks` in order: the
        first chunk may start before the first block (a chunk of several blocks whose
        head is already on the GPU), as vLLM's own worker reads it."""
        bpc = self.blocks_per_chunk
        first_chunk = first_block_index // bpc
        last = first_block_index + len(gpu_blocks) - 1
        needed = last // bpc - first_chunk + 1 if gpu_blocks else 0
        if needed != len(host_chunks):
            raise ValueError(
                f"{len(gpu_blocks)} blocks from block {first_block_index} need {needed} "
                f"host chunks of {bpc} blocks, got {len(host_chunks)}"
            )
        pairs: list[tuple[int, int]] = []
        for offset, gpu_block in enumerate(gpu_blocks):
            logical = first_block_index + offset
            chunk = host_chunks[logical // bpc - first_chunk]
            sub_block = logical % bpc
            for tensor in range(self.num_tensors):
                device_slot = tensor * self.num_gpu_blocks + gpu_block
                host_slot = chunk * self.pages_per_chunk + tensor * bpc + sub_block
                pairs.append((device_slot, host_slot))
        return pairs


def check_host_room(tier_bytes: int, device: VllmDevicePages) -> None:
    """The host tier must fit the host memory left; if it does not, say what holds it.
    On vLLM's CPU backend its own KV cache (the "device" pool) is host memory too,
    sized by --gpu-memory-utilization as a share of RAM: often the real culprit."""
    memory = host_memory()
    if tier_bytes <= memory.available_bytes:
        return
    holder = "lower cpu_bytes_to_use"
    if not device.is_cuda:
        holder = (
            f"vLLM's own KV cache already holds {format_bytes(device.configured_bytes)} of "
            "host memory on the CPU backend (--gpu-memory-utilization is a share of RAM "
            "there, 0.92 by default): lower --gpu-memory-utilization (the README uses 0.1), "
            "or lower cpu_bytes_to_use"
        )
    raise KvSwapError(
        f"{SOURCE}: cpu_bytes_to_use asks {format_bytes(tier_bytes)} for kvswap's host tier, "
        f"but only {format_bytes(memory.available_bytes)} of host memory is available "
        f"(limited by {memory.limit}): {holder}"
    )
