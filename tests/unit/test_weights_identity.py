"""The weights' identity: two checkpoints of one architecture never share a namespace."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvswap.errors import KvSwapError
from kvswap.model import weights_identity as wid
from kvswap.model.weights_identity import (
    checkpoint_weights_identity,
    preset_weights_identity,
    weights_identity,
)


def tensors(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=generator),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16, generator=generator),
        "model.norm.weight": torch.ones(16),
    }


def checkpoint(directory: Path, weights: dict[str, torch.Tensor]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(directory / "model.safetensors"))
    (directory / "config.json").write_text("{}")
    return directory


def test_a_preset_is_named_by_its_name_and_seed() -> None:
    tiny = preset_weights_identity("tiny", 0)
    assert len(tiny) == 64 and tiny == preset_weights_identity("tiny", 0)
    assert tiny != preset_weights_identity("tiny", 1) != preset_weights_identity("small", 0)
    assert weights_identity("tiny", preset_seed=0) == tiny


def test_the_same_files_anywhere_are_the_same_weights(tmp_path: Path) -> None:
    base = checkpoint(tmp_path / "a", tensors(0))
    copy = tmp_path / "elsewhere" / "b"
    shutil.copytree(base, copy)
    assert checkpoint_weights_identity(base) == checkpoint_weights_identity(copy)
    assert weights_identity(str(copy), preset_seed=0) == checkpoint_weights_identity(base)


def test_a_fine_tune_of_the_same_architecture_is_other_weights(tmp_path: Path) -> None:
    base = checkpoint_weights_identity(checkpoint(tmp_path / "base", tensors(0)))
    tuned = tensors(0)
    tuned["model.layers.0.self_attn.q_proj.weight"] += 0.01  # a whole tensor moves
    assert checkpoint_weights_identity(checkpoint(tmp_path / "tuned", tuned)) != base
    # One value at the start of one tensor is seen too (every tensor's head is read).
    one = tensors(0)
    one["model.norm.weight"][0] = 2.0
    assert checkpoint_weights_identity(checkpoint(tmp_path / "one", one)) != base


def test_a_sharded_checkpoint_is_named_by_the_shards_its_index_lists(tmp_path: Path) -> None:
    directory = tmp_path / "sharded"
    directory.mkdir()
    weights = tensors(0)
    names = sorted(weights)
    save_file({n: weights[n] for n in names[:2]}, str(directory / "a.safetensors"))
    save_file({n: weights[n] for n in names[2:]}, str(directory / "b.safetensors"))
    index = {
        "weight_map": {n: ("a" if i < 2 else "b") + ".safetensors" for i, n in enumerate(names)}
    }
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    identity = checkpoint_weights_identity(directory)
    # A stray file the index does not list is not part of the weights.
    save_file({"x": torch.zeros(1)}, str(directory / "consolidated.safetensors"))
    assert checkpoint_weights_identity(directory) == identity
    # A shard renamed (and its index with it) is another checkpoint's layout.
    os.rename(directory / "b.safetensors", directory / "c.safetensors")
    index["weight_map"] = {n: f.replace("b.", "c.") for n, f in index["weight_map"].items()}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    assert checkpoint_weights_identity(directory) != identity
    # An index that leaves the directory is refused in one line.
    index["weight_map"][names[0]] = "../a.safetensors"
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(KvSwapError, match="weight_map"):
        checkpoint_weights_identity(directory)


def test_a_large_checkpoint_is_named_from_a_bounded_sample(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A 4 GiB shard of two 2 GiB tensors (sparse: only the header is written).
    header = json.dumps(
        {
            f"t{i}": {
                "dtype": "F16",
                "shape": [2**30],
                "data_offsets": [i * 2**31, (i + 1) * 2**31],
            }
            for i in range(2)
        }
    ).encode()
    path = tmp_path / "big" / "model.safetensors"
    path.parent.mkdir()
    with path.open("wb") as file:
        file.write(struct.pack("<Q", len(header)) + header)
        file.truncate(8 + len(header) + 2**32)
    read_bytes: list[int] = []
    real_pread = os.pread

    def counting_pread(fd: int, size: int, offset: int) -> bytes:
        data = real_pread(fd, size, offset)
        read_bytes.append(len(data))
        return data

    monkeypatch.setattr(os, "pread", counting_pread)
    assert len(checkpoint_weights_identity(path.parent)) == 64
    budget = wid.NUM_SAMPLE_WINDOWS * wid.SAMPLE_WINDOW_BYTES + 2 * wid.TENSOR_HEAD_BYTES
    assert sum(read_bytes) == budget  # about 2 MiB of a 4 GiB file


def test_a_source_that_is_neither_is_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(KvSwapError, match="neither a preset"):
        weights_identity(str(tmp_path / "missing"), preset_seed=0)
    with pytest.raises(KvSwapError, match=r"no \*\.safetensors"):
        weights_identity(str(tmp_path), preset_seed=0)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 8)
    with pytest.raises(KvSwapError, match="no valid header"):
        weights_identity(str(tmp_path), preset_seed=0)
