"""Build a LlamaForCausal from a built-in preset or a local safetensors checkpoint.

The model is first built on the `meta` device (no memory, no random init),
then given uninitialised storage in the target dtype on the target device, and
every parameter is filled exactly once: from the checkpoint, one tensor at a
time (safetensors memory-maps the file, so a tensor is read when asked for and
dropped after its copy: there is never a second full copy of the weights), or,
for a preset, from a seeded CPU generator (identical weights on every device).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvswap.errors import KvSwapError
from kvswap.model.arch_config import ModelArchConfig
from kvswap.model.hf_config import parse_hf_config, read_config_json
from kvswap.model.llama import LlamaForCausal
from kvswap.model.presets import ENGINE_PRESET_NAMES, preset_arch_config
from kvswap.model.torch_dtypes import TORCH_DTYPES, weight_torch_dtype
from kvswap.readers import (
    SAFETENSORS_FILE,
    WEIGHT_INDEX_FILE,
    open_user_file,
    parse_json,
    read_user_file,
)

__all__ = [
    "PRESETS",
    "PRESET_SEED",
    "TORCH_DTYPES",
    "check_checkpoint_shapes",
    "load_model",
    "parse_dtype",
    "read_checkpoint_config",
    "resolve_model",
]

PRESET_SEED = 0
_INDEX_NAME = "model.safetensors.index.json"
# The safetensors format's own cap on its JSON header; a larger length is a corrupt file.
_MAX_HEADER_BYTES = 100_000_000
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")

#: The engine's random-weight presets, from the one preset table (kvswap.model.presets).
PRESETS: dict[str, ModelArchConfig] = {
    name: preset_arch_config(name) for name in ENGINE_PRESET_NAMES
}


def parse_dtype(name: str) -> torch.dtype:
    """'fp32' | 'fp16' | 'bf16' (or the checkpoint spelling 'float32', ...) -> torch dtype."""
    return weight_torch_dtype(name)


def resolve_model(
    source: str, dtype: str | None
) -> tuple[ModelArchConfig, torch.dtype, Path | None]:
    """The architecture and dtype `load_model` would use, without loading weights
    (so pools can be sized and checked first). The path is None for a preset.
    The config's description is in the dtype the weights (and the KV) will be held
    in, so `config.description.fingerprint()` names exactly this model's blocks."""
    if source in PRESETS:
        config = PRESETS[source]
        directory: Path | None = None
    else:
        directory = Path(source).expanduser()
        if not directory.is_dir():
            raise KvSwapError(
                f"model {source!r} is neither a preset ({', '.join(PRESETS)}) nor an existing "
                "directory with config.json and *.safetensors"
            )
        config = read_checkpoint_config(directory)
        # Before anything is allocated: the config's sizes must be the checkpoint's. A
        # directory with only config.json describes a model for sizing; load_model refuses it.
        if (directory / _INDEX_NAME).exists() or any(directory.glob("*.safetensors")):
            check_checkpoint_shapes(config, directory)
    # Unstated: fp32, which every device (a CPU included) computes in.
    dtype_name = dtype if dtype is not None else (config.description.checkpoint_dtype or "fp32")
    torch_dtype = parse_dtype(dtype_name)
    return config.with_dtype(dtype_name), torch_dtype, directory


def load_model(
    source: str, dtype: str | None, device: torch.device, *, batch_invariant: bool = False
) -> tuple[LlamaForCausal, ModelArchConfig]:
    """A preset name (`tiny`, `small`) or a directory with config.json + *.safetensors.

    `dtype` overrides the checkpoint's own dtype (presets default to fp32). The
    returned config's `dtype_name` is the dtype the weights were loaded in.
    `batch_invariant` builds the model in the exact mode (`kvswap.model.llama`);
    the weights are the same in both modes (the fast mode packs them for a CPU).
    """
    config, torch_dtype, directory = resolve_model(source, dtype)
    if directory is not None:
        # resolve_model skipped the check for a directory without weights; here it refuses.
        check_checkpoint_shapes(config, directory)
    model = _empty_model(config, torch_dtype, device, batch_invariant)
    if directory is None:
        _fill_random(model, PRESET_SEED)
    else:
        _fill_from_checkpoint(model, directory)
    model.pack_weights()
    return model.eval(), config


def read_checkpoint_config(directory: Path) -> ModelArchConfig:
    config_path = directory / "config.json"
    if not config_path.exists():  # a FIFO or a directory there is refused by the reader
        raise KvSwapError(f"no config.json in model directory {directory}")
    return parse_hf_config(read_config_json(config_path), str(config_path), directory.name)


def _empty_model(
    config: ModelArchConfig, dtype: torch.dtype, device: torch.device, batch_invariant: bool
) -> LlamaForCausal:
    with torch.device("meta"):
        model = LlamaForCausal(config, batch_invariant=batch_invariant).to(dtype=dtype)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives each parameter fresh storage: share again
    return model


@torch.no_grad()
def _fill_random(model: LlamaForCausal, seed: int) -> None:
    """Seeded weights with O(1) activations: embeddings N(0, 1), linears N(0, 1/fan_in).

    Larger than the usual 0.02 init on purpose: logits spread widely, so greedy
    argmax is far from ties and tests comparing argmax are not flaky.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            values = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if param.dim() == 2 and "embed_tokens" not in name:
                values.mul_(1.0 / math.sqrt(param.shape[1]))
            param.copy_(values)


def _shard_inside(directory: Path, name: str, listed_in: Path) -> Path:
    """`directory / name`, refused when it leaves the model directory (.., absolute, links)."""
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts or not name.strip():
        raise KvSwapError(
            f"{listed_in}: shard path {name!r} leaves the model directory; "
            "expected a file name inside it"
        )
    path = directory / relative
    if not path.resolve().is_relative_to(directory.resolve()):
        raise KvSwapError(
            f"{listed_in}: shard {name!r} is a link to {path.resolve()}, outside the model "
            "directory; refusing to follow it"
        )
    return path


def _index_shard_names(index_path: Path) -> list[str]:
    """The shard file names of a `weight_map`, checked to be {tensor name: file name}."""
    try:
        raw = read_user_file(index_path, str(index_path), WEIGHT_INDEX_FILE)
    except OSError as exc:
        raise KvSwapError(f"cannot read weight_map from {index_path}: {exc.strerror}") from None
    index = parse_json(raw, str(index_path))
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        shown = type(weight_map).__name__ if weight_map is not None else "missing"
        raise KvSwapError(
            f"{index_path}: weight_map is {shown}; expected an object "
            "{tensor name: shard file name}"
        )
    for tensor, name in weight_map.items():
        if not isinstance(name, str):
            raise KvSwapError(
                f"{index_path}: weight_map[{tensor!r}] is {type(name).__name__}; "
                "expected a shard file name"
            )
    return sorted(set(weight_map.values()))


def _checkpoint_files(directory: Path) -> list[Path]:
    index_path = directory / _INDEX_NAME
    if index_path.exists():  # a FIFO or a directory there is refused by the reader
        files = [_shard_inside(directory, n, index_path) for n in _index_shard_names(index_path)]
        for path in files:
            if not path.is_file():
                raise KvSwapError(f"shard {path.name} listed in {_INDEX_NAME} is missing")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise KvSwapError(f"no *.safetensors files in model directory {directory}")
    return [_shard_inside(directory, path.name, directory) for path in files]


def _header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors header, read without loading any tensor.

    The format: an 8-byte little-endian header length, then that many bytes of JSON
    {name: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}.
    """
    try:
        with open_user_file(path, f"safetensors file {path}", SAFETENSORS_FILE) as file:
            file_bytes = os.fstat(file.fileno()).st_size
            prefix = file.read(8)
            header_bytes = int.from_bytes(prefix, "little") if len(prefix) == 8 else None
            if header_bytes is None or header_bytes > min(file_bytes - 8, _MAX_HEADER_BYTES):
                raise KvSwapError(
                    f"cannot read safetensors file {path}: no valid header "
                    f"(length {header_bytes} in a file of {file_bytes} bytes)"
                )
            header = parse_json(file.read(header_bytes), f"safetensors header of {path}")
    except OSError as exc:
        raise KvSwapError(f"cannot read safetensors file {path}: {exc.strerror}") from None
    if not isinstance(header, dict):
        raise KvSwapError(f"cannot read safetensors file {path}: the header is not an object")
    shapes: dict[str, tuple[int, ...]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise KvSwapError(
                f"cannot read safetensors file {path}: tensor {name} has no valid shape"
            )
        shapes[name] = tuple(shape)
    return shapes


def check_checkpoint_shapes(config: ModelArchConfig, directory: Path) -> None:
    """Refuse a config.json whose sizes are not the checkpoint's real tensors.

    Reads only the safetensors headers. The layer count is compared first, from tensor
    names, so that a config claiming 1e9 layers is refused before a model of that many
    layers is even built on the meta device.
    """
    shapes: dict[str, tuple[int, ...]] = {}
    where: dict[str, str] = {}
    for path in _checkpoint_files(directory):
        for name, shape in _header_shapes(path).items():
            shapes.setdefault(name, shape)
            where.setdefault(name, path.name)
    layers = {int(m.group(1)) for n in shapes if (m := _LAYER_NAME.match(n)) is not None}
    num_checkpoint_layers = max(layers) + 1 if layers else 0
    if num_checkpoint_layers != config.num_layers:
        raise KvSwapError(
            f"{directory / 'config.json'}: num_hidden_layers = {config.num_layers}, but the "
            f"checkpoint holds tensors for {num_checkpoint_layers} layers"
        )
    with torch.device("meta"):  # shapes only: no memory, no init
        expected = {n: tuple(p.shape) for n, p in LlamaForCausal(config).named_parameters()}
    missing = [name for name in expected if name not in shapes]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise KvSwapError(f"checkpoint {directory} is missing tensor {missing[0]}{more}")
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise KvSwapError(
                f"tensor {name} in {where[name]} has shape {shapes[name]}, expected {shape} "
                f"from {directory / 'config.json'}"
            )


@torch.no_grad()
def _fill_from_checkpoint(model: LlamaForCausal, directory: Path) -> None:
    # named_parameters drops the tied lm_head (it is the embedding), so a tied
    # checkpoint's lack of lm_head.weight is fine and a stray one is ignored.
    expected = dict(model.named_parameters())
    loaded: set[str] = set()
    for path in _checkpoint_files(directory):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as shard:
                for name in shard.keys():  # noqa: SIM118 (safe_open is not a dict)
                    param = expected.get(name)
                    if param is None or name in loaded:
                        continue  # e.g. rotary inv_freq buffers some exports carry
                    shape = tuple(shard.get_slice(name).get_shape())
                    if shape != tuple(param.shape):
                        raise KvSwapError(
                            f"tensor {name} in {path.name} has shape {shape}, "
                            f"expected {tuple(param.shape)}"
                        )
                    param.copy_(shard.get_tensor(name))
                    loaded.add(name)
        except (OSError, RuntimeError, SafetensorError) as exc:
            raise KvSwapError(f"cannot read safetensors file {path}: {exc}") from exc
    missing = [name for name in expected if name not in loaded]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise KvSwapError(f"checkpoint {directory} is missing tensor {missing[0]}{more}")
