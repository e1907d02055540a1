"""kvswap's copy engine as vLLM's offloading worker (`OffloadingWorker`).

vLLM's worker process calls it: `submit_store` / `submit_load` (a job of GPU
blocks and host chunks), `get_finished`, `wait`, `shutdown`. It translates:

    vLLM's KV tensors            -> VllmDevicePages (a page per slot, pages.py)
    the host tier's chunk rows   -> kvswap's HostPool: one buffer of exactly
                                    num_chunks rows, allocated once, page-locked
                                    where CUDA exists; the file-backed kind, shared
                                    with the scheduler, when secondary tiers read it
    a job                        -> bounded chunks on kvswap's LocalCopyEngine:
                                    loads on HIGH, stores on LOW (transfers.py)

On a CPU platform vLLM's "GPU" tensors are host memory and the engine copies on
its threads. On CUDA the engine issues the same chunks on its copy streams with
events: written, never yet run (no CUDA machine has run this adapter).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult

from kvswap.data.copy_engine import LocalCopyEngine
from kvswap.data.host_pool import HostPool
from kvswap.data.shared_file import SharedFile
from kvswap.errors import KvSwapError
from kvswap.integrations.vllm.host_file import WORKER
from kvswap.integrations.vllm.pages import PageMap, VllmDevicePages, check_host_room
from kvswap.integrations.vllm.settings import AdapterSettings
from kvswap.integrations.vllm.transfers import PagedTransfers, TransferCounts

LOGGER = logging.getLogger("kvswap.vllm")


class KvswapOffloadingWorker(OffloadingWorker):
    """Moves vLLM's blocks between its KV tensors and kvswap's host pool."""

    def __init__(
        self,
        kv_caches: Any,  # vLLM's CanonicalKVCaches
        *,
        blocks_per_chunk: int,
        num_chunks: int,
        row_bytes: int,
        settings: AdapterSettings,
        shared_path: Path | None,
    ) -> None:
        """`row_bytes`: one host chunk's bytes as the spec sized the tier; the pages of
        a chunk must fill it exactly. `shared_path`: the file the scheduler's
        secondary tiers map too (None: a private pool)."""
        if len(kv_caches.group_data_refs) != 1:
            raise KvSwapError(
                f"kvswap's vLLM worker supports one KV cache group, got "
                f"{len(kv_caches.group_data_refs)} (hybrid models are not supported)"
            )
        self._device = VllmDevicePages([entry.tensor for entry in kv_caches.tensors])
        self._map = PageMap(self._device.num_tensors, self._device.num_gpu_blocks, blocks_per_chunk)
        chunk_bytes = self._map.pages_per_chunk * self._device.page_bytes
        if chunk_bytes != row_bytes:
            raise KvSwapError(
                f"a host chunk of {self._map.pages_per_chunk} pages x {self._device.page_bytes} "
                f"bytes is {chunk_bytes} bytes, but the spec sized rows of {row_bytes} bytes"
            )
        check_host_room(num_chunks * row_bytes, self._device)
        shared = None if shared_path is None else SharedFile(shared_path, WORKER)
        self._host = HostPool(
            self._device.layout, num_chunks * self._map.pages_per_chunk, shared=shared
        )
        try:
            self._engine = LocalCopyEngine(
                self._device, self._host, prefetch_streams=settings.prefetch_stream_count
            )
        except BaseException:
            self._host.close()
            raise
        self._transfers = PagedTransfers(
            self._engine,
            self._device.page_bytes,
            self._device.num_tensors,
            swap_in_chunk_blocks=settings.swap_in_chunk_blocks,
            swap_out_chunk_blocks=settings.swap_out_chunk_blocks,
        )
        self._closed = False

    @property
    def host_pool(self) -> HostPool:
        return self._host

    @property
    def counts(self) -> TransferCounts:
        """Jobs and bytes moved so far (loads: host -> device; stores: device -> host)."""
        return self._transfers.counts

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        """Device -> host (vLLM's GPULoadStoreSpec -> CPULoadStoreSpec)."""
        self._transfers.submit_store(job_id, self._pairs(src_spec, dst_spec))
        return True

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
    ) -> bool:
        """Host -> device. Every load goes on the HIGH queue, `expedited` (vLLM 0.33) or not."""
        self._transfers.submit_load(job_id, self._pairs(dst_spec, src_spec))
        return True

    def get_finished(self) -> list[Any]:
        results = []
        for done in self._transfers.finished():
            if not done.success:
                LOGGER.error("kvswap: vLLM transfer job %d failed: %s", done.job_id, done.error)
            results.append(
                TransferResult(
                    job_id=done.job_id,
                    success=done.success,
                    transfer_size=done.num_bytes,
                    transfer_time=done.transfer_time_s,
                )
            )
        return results

    def wait(self, job_ids: Iterable[int]) -> None:
        self._transfers.wait(job_ids)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._engine.close()  # queued chunks finish first
        self._host.close()

    def _pairs(self, gpu_spec: Any, host_spec: Any) -> list[tuple[int, int]]:
        (first_block_index,) = gpu_spec.block_indices  # one KV cache group
        return self._map.pairs(
            [int(block) for block in gpu_spec.block_ids],
            int(first_block_index),
            [int(chunk) for chunk in host_spec.block_ids],
        )
