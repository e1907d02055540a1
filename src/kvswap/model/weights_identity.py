"""Which weights a model runs with, as a short digest: part of the block identity.

Two checkpoints of one architecture (a base model and its fine-tune) compute
different KV for the same tokens, so they must never share a block key, and
above all never a remote store's namespace. This module names the weights;
`kvswap.model.kv_identity` joins them with the config, dtype, layout and shard
into THE identity every engine roots its block keys in.

* A built-in preset's weights are drawn from a seeded generator
  (`kvswap.model.loader`): its identity is the preset's name, the seed and the
  fill recipe's name (`PRESET_FILL_RECIPE`; a change to the loader's fill must
  change that name).
* A checkpoint directory's identity is a SHA-256 over each safetensors file
  (sorted by name): its name, its size, its whole header (every tensor's name,
  dtype, shape and offsets) and a deterministic sample of its data: 64 KiB at
  `NUM_SAMPLE_WINDOWS` offsets spread evenly over the file, plus the first
  `TENSOR_HEAD_BYTES` of every tensor. About 2 MiB per shard whatever its size,
  so a 16 GB checkpoint is named in milliseconds from a warm page cache.

The limit: bytes outside the sample are not read. A fine-tune (or a merged
LoRA) changes every value of the tensors it touches, and each tensor's head is
sampled, so it is seen; an edit of a few values deep inside one tensor is not.
Name such a checkpoint's store explicitly (`remote_namespace`). The directory's
path is not part of the identity: the same files copied to another machine are
the same weights.

Torch-free: the standard library and `kvswap.readers` only.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Sequence
from pathlib import Path

from kvswap.errors import KvSwapError
from kvswap.model.presets import ENGINE_PRESET_NAMES
from kvswap.readers import (
    SAFETENSORS_FILE,
    WEIGHT_INDEX_FILE,
    open_user_file,
    parse_json,
    read_user_file,
)

#: Hashed into every identity: bump it when what is read or how it is hashed changes.
WEIGHTS_IDENTITY_VERSION = "kvswap-weights-v1"
#: How the loader fills a preset's weights from its seed (kvswap.model.loader._fill_random).
PRESET_FILL_RECIPE = "normal-fan-in-v1"
NUM_SAMPLE_WINDOWS = 32
SAMPLE_WINDOW_BYTES = 64 * 1024
TENSOR_HEAD_BYTES = 256
#: The safetensors format's cap on its JSON header.
MAX_HEADER_BYTES = 100_000_000
_INDEX_NAME = "model.safetensors.index.json"


def preset_weights_identity(name: str, seed: int) -> str:
    """The identity of a preset's seeded random weights."""
    digest = hashlib.sha256()
    for part in (WEIGHTS_IDENTITY_VERSION, "preset", name, str(seed), PRESET_FILL_RECIPE):
        digest.update(_length_prefixed(part.encode("utf-8")))
    return digest.hexdigest()


def checkpoint_weights_identity(directory: Path) -> str:
    """The identity of the safetensors weights in `directory` (module docstring)."""
    files = checkpoint_files(directory)
    digest = hashlib.sha256(_length_prefixed(WEIGHTS_IDENTITY_VERSION.encode()))
    for relative in files:
        _digest_file(digest, directory, relative)
    return digest.hexdigest()


def weights_identity(source: str, *, preset_seed: int) -> str:
    """The identity of the weights `source` names, read as the loader reads it: an
    engine preset's name (its weights drawn from `preset_seed`: the engine passes
    `kvswap.model.loader.PRESET_SEED`) or a checkpoint directory."""
    if source in ENGINE_PRESET_NAMES:
        return preset_weights_identity(source, preset_seed)
    directory = Path(source).expanduser()
    if not directory.is_dir():
        raise KvSwapError(
            f"model {source!r} is neither a preset ({', '.join(ENGINE_PRESET_NAMES)}) nor "
            "a directory with *.safetensors"
        )
    return checkpoint_weights_identity(directory)


def checkpoint_files(directory: Path) -> list[str]:
    """The shard names, relative to `directory`, sorted: those the index's
    `weight_map` names when there is one, else every top-level `*.safetensors`."""
    index_path = directory / _INDEX_NAME
    if index_path.exists():  # a FIFO or a directory there is refused by the reader
        try:
            raw = read_user_file(index_path, str(index_path), WEIGHT_INDEX_FILE)
            index = parse_json(raw, str(index_path))
        except OSError as exc:
            raise KvSwapError(f"cannot read {index_path}: {exc.strerror}") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        names = set(weight_map.values()) if isinstance(weight_map, dict) else set()
        if not names or not all(isinstance(n, str) and _inside(directory, n) for n in names):
            raise KvSwapError(
                f"{index_path}: weight_map must map tensor names to shard files inside {directory}"
            )
        return sorted(names)
    files = sorted(path.name for path in directory.glob("*.safetensors") if path.is_file())
    if not files:
        raise KvSwapError(f"no *.safetensors files in model directory {directory}")
    return files


def sample_ranges(
    data_start: int, file_bytes: int, tensor_starts: Sequence[int]
) -> list[tuple[int, int]]:
    """(offset, bytes) of every sample, in reading order: `NUM_SAMPLE_WINDOWS` windows of
    `SAMPLE_WINDOW_BYTES` spread evenly over the data section, then the first
    `TENSOR_HEAD_BYTES` of each tensor (`tensor_starts` relative to the data section)."""
    data_bytes = file_bytes - data_start
    if data_bytes <= 0:
        return []
    span = max(0, data_bytes - SAMPLE_WINDOW_BYTES)
    last = max(1, NUM_SAMPLE_WINDOWS - 1)
    windows = sorted({data_start + span * i // last for i in range(NUM_SAMPLE_WINDOWS)})
    heads = sorted({data_start + t for t in tensor_starts if 0 <= t < data_bytes})
    return [(o, SAMPLE_WINDOW_BYTES) for o in windows] + [(o, TENSOR_HEAD_BYTES) for o in heads]


def _digest_file(digest: hashlib._Hash, directory: Path, relative: str) -> None:
    path = directory / relative
    try:
        with open_user_file(path, f"safetensors file {path}", SAFETENSORS_FILE) as file:
            file_bytes = os.fstat(file.fileno()).st_size
            prefix = file.read(8)
            header_bytes = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else None
            if header_bytes is None or header_bytes > min(file_bytes - 8, MAX_HEADER_BYTES):
                raise KvSwapError(f"cannot read safetensors file {path}: no valid header")
            header = file.read(header_bytes)
            digest.update(_length_prefixed(relative.encode("utf-8")))
            digest.update(struct.pack("<Q", file_bytes))
            digest.update(_length_prefixed(header))
            tensor_starts = _tensor_starts(header, path)
            for offset, size in sample_ranges(8 + header_bytes, file_bytes, tensor_starts):
                digest.update(struct.pack("<Q", offset))
                digest.update(_length_prefixed(os.pread(file.fileno(), size, offset)))
    except OSError as exc:
        raise KvSwapError(f"cannot read safetensors file {path}: {exc.strerror}") from None


def _tensor_starts(header: bytes, path: Path) -> list[int]:
    """Each tensor's first data byte, relative to the data section."""
    parsed = parse_json(header, f"safetensors header of {path}")
    if not isinstance(parsed, dict):
        raise KvSwapError(f"cannot read safetensors file {path}: the header is not an object")
    starts = []
    for name, entry in parsed.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if name == "__metadata__" or not isinstance(offsets, list) or not offsets:
            continue
        if isinstance(offsets[0], int) and not isinstance(offsets[0], bool):
            starts.append(offsets[0])
    return starts


def _inside(directory: Path, name: str) -> bool:
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts or not name.strip():
        return False
    return (directory / relative).resolve().is_relative_to(directory.resolve())


def _length_prefixed(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data
