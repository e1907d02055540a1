"""One request of the host-tier replay: its tokens, block hashes and where its KV is.

What vLLM's `Request` carries that the replay needs: the prompt and the tokens
generated so far, the chain of block hashes over them (a full block's hash names
its whole prefix, as vLLM's does), how many tokens are computed, the device
blocks it holds, and the connector's per-request state (its offload keys and how
far its stores have got). The model is absent: `planned_output` is the tokens the
request will generate, a pure function of (session, turn, position) chosen by the
driver, so every policy sees the same prompts.
"""

from __future__ import annotations

import enum
import hashlib
from array import array
from dataclasses import dataclass, field
from typing import Any


class Status(enum.Enum):
    WAITING = "waiting"  # not admitted yet
    LOADING = "loading"  # admitted with a host-tier hit: its blocks are being loaded
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, its blocks freed
    FINISHED = "finished"


def chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    """A full block's hash: its parent's hash and its tokens (vLLM chains them the same way;
    the hash function itself changes no figure)."""
    return hashlib.sha256(parent + array("I", tokens).tobytes()).digest()


@dataclass(eq=False)
class ReplayRequest:
    """A request in the replay (module docstring). `context` is vLLM's `ReqContext`."""

    request_id: int  # the workload's id
    session_id: int
    turn: int
    prompt: tuple[int, ...]
    planned_output: tuple[int, ...]
    block_tokens: int
    context: Any
    tokens: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    blocks: list[int] = field(default_factory=list)  # device block ids, in token order
    num_committed_blocks: int = 0  # of `blocks`, those cached by hash
    num_preemptions: int = 0
    # The prefix hit of its (first) admission: vLLM's PrefillStats split.
    local_hit_tokens: int | None = None
    external_hit_tokens: int | None = None
    admitted_tick: int | None = None  # the tick its prefill ran
    finish_tick: int | None = None
    # --- the connector's state (vLLM's RequestOffloadState, one group) --------------
    offload_keys: list[bytes] = field(default_factory=list)
    next_stored_chunk: int = 0
    connector_blocks: int = 0  # device blocks the connector knows of (its block_ids)
    lookup_local_tokens: int = 0  # the device hit its last lookup started after
    jobs: set[int] = field(default_factory=set)  # transfers in flight
    load_done: bool = False  # its host-tier load landed (vLLM's finished_recving)

    def __post_init__(self) -> None:
        self._extend(self.prompt)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def output(self) -> tuple[int, ...]:
        return tuple(self.tokens[len(self.prompt) :])

    def append_output(self) -> bool:
        """The next planned token is sampled; True when the request is done."""
        done = len(self.tokens) - len(self.prompt)
        self._extend(self.planned_output[done : done + 1])
        return len(self.tokens) - len(self.prompt) == len(self.planned_output)

    def _extend(self, new_tokens: tuple[int, ...]) -> None:
        self.tokens.extend(new_tokens)
        size = self.block_tokens
        while (len(self.block_hashes) + 1) * size <= len(self.tokens):
            start = len(self.block_hashes) * size
            parent = self.block_hashes[-1] if self.block_hashes else b""
            self.block_hashes.append(chain_hash(parent, self.tokens[start : start + size]))
