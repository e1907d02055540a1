"""The plain records of the block store: its layout, a sequence's table, a transfer's outcome."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvswap.base.identity import KeyNamespace


@dataclass(frozen=True)
class StoreLayout:
    """Sizes the store is built with, and the namespace its block keys live in."""

    block_tokens: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    protected_blocks: int
    # None: a namespace of an unnamed model (enough while one store serves one model;
    # a tier shared between processes needs the real model fingerprint).
    namespace: KeyNamespace | None = None

    def key_namespace(self) -> KeyNamespace:
        """The namespace given, or the default one for this block size."""
        if self.namespace is None:
            return KeyNamespace(model_fingerprint="unnamed", block_tokens=self.block_tokens)
        return self.namespace


class TransferOutcome(NamedTuple):
    """What one block's finished transfer did to its copies (`finish_transfer`)."""

    ready: bool  # the destination copy is ready (its bytes arrived, nothing went stale)
    arrived: bool  # ready, and the block still lives
    lost_now: bool  # its last copy failed: the block became lost


@dataclass
class SequenceState:
    block_ids: list[int]
    num_tokens: int
    root_key: bytes  # parent key of the first block: the namespace root, salted
    running: bool = False
