"""THE identity of a block's bytes: the one namespace every engine kvswap serves keys in.

A KV block is a function of its tokens and of everything that computed it. The
tokens are chained into the block key (`kvswap.base.identity`); everything
else is this record, digested into the `KeyNamespace` the chain is rooted in:

    compute      whose kernels made the bytes, in which mode, on which device
                 ("kvswap/exact/cpu", "vllm/<backend>", "transformers/sdpa/cpu"...)
    weights      the weights' digest (`kvswap.model.weights_identity`)
    config       every model config field the K/V path reads (below)
    kv_dtype     the dtype the KV is held in
    layout       the block's byte layout, as its engine describes it
    block_tokens tokens per block (vLLM: per offloaded chunk; SGLang: per page)
    block_bytes  bytes per block, chunk or half page
    shard        tensor / pipeline / context-parallel rank and size

Never a path or a served name: a checkpoint redeployed at the same path, or two
deployments under one name, differ in their weights or config and so never read
each other's KV; the same files anywhere are the same model.

`config` comes from the engine's own model config. For kvswap's engine that is
the decoder's `ModelArchConfig`, every field of it (`engine_config_fields`,
`kvswap_identity`); for
the engines that read a Hugging Face config (vLLM, SGLang, transformers) it is
the whole config, less only the keys that cannot change a K or V value for the
same token ids (`NOT_KV_CONFIG_KEYS`: token ids for generation, labels, output
switches, training-only settings, bookkeeping). A key not on that list counts,
so a field an engine reads that kvswap has never heard of still splits the
namespace: erring that way costs hits, never correctness.

Torch-free (the standard library and `kvswap.base.identity`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvswap.base.identity import KeyNamespace
from kvswap.errors import KvSwapError
from kvswap.model.arch_config import ModelArchConfig
from kvswap.model.description import ModelDescription
from kvswap.model.weights_identity import checkpoint_weights_identity
from kvswap.readers import MODEL_CONFIG_FILE, parse_json, read_user_file

#: Hashed into every fingerprint: bump it when the fields or their encoding change.
KV_IDENTITY_VERSION = "kvswap-kv-identity-v1"

#: Hugging Face config keys that never change a K or V value for the same token ids.
#: Everything else in a config is part of the identity. Keys starting with "_" are
#: transformers' bookkeeping (`_name_or_path`, `_commit_hash`, `_attn_implementation`:
#: the attention kernel is named in `compute` instead).
NOT_KV_CONFIG_KEYS = frozenset({
    # where and by what the config was written
    "name_or_path", "transformers_version", "tokenizer_class",
    # token ids that steer generation, not the forward pass
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
    "decoder_start_token_id", "forced_bos_token_id", "forced_eos_token_id",
    # heads and tasks other than causal LM
    "id2label", "label2id", "num_labels", "problem_type", "finetuning_task",
    "task_specific_params",
    # what a forward call returns, not what it computes
    "output_attentions", "output_hidden_states", "return_dict", "use_return_dict",
    "output_scores", "return_dict_in_generate", "torchscript", "use_cache",
    # training only: weights init and dropout (inactive in inference)
    "initializer_range", "attention_dropout",
})  # fmt: skip


@dataclass(frozen=True)
class Shard:
    """Which part of the model's KV a process holds: its tensor- (heads), pipeline-
    (layers) and context-parallel (tokens) rank out of each size."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1

    def __post_init__(self) -> None:
        for kind in ("tp", "pp", "cp"):
            rank, size = getattr(self, f"{kind}_rank"), getattr(self, f"{kind}_size")
            ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (rank, size))
            if not ints or not 0 <= rank < size:
                raise KvSwapError(
                    f"shard {kind}_rank={rank!r} of {kind}_size={size!r}; allowed: integers "
                    f"with 0 <= {kind}_rank < {kind}_size"
                )


@dataclass(frozen=True)
class KvIdentity:
    """Everything that decides a block's bytes (module docstring). `weights` None: not
    known, where nothing is shared (a simulation computes no byte; a `TieredCache`
    built from a bare config salts its keys per cache)."""

    compute: str
    weights: str | None
    config: str  # canonical JSON of the config fields (`config_json`)
    kv_dtype: str
    layout: str
    block_tokens: int
    block_bytes: int
    shard: Shard = Shard()

    def fingerprint(self) -> str:
        """A sha256 hex digest of every field: equal for the same bytes in any process
        or machine, different when any field differs."""
        fields = {"version": KV_IDENTITY_VERSION, **dataclasses.asdict(self)}
        encoded = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(encoded.encode("utf-8")).hexdigest()

    def namespace(self) -> KeyNamespace:
        """The namespace this identity's block keys are rooted in."""
        return KeyNamespace(model_fingerprint=self.fingerprint(), block_tokens=self.block_tokens)


def config_json(fields: Mapping[str, object]) -> str:
    """`fields` as canonical JSON (sorted keys, no spaces): the identity's `config`.
    Floats keep every bit (`repr` round-trips), so 1e-5 and 1e-6 differ."""
    try:
        return json.dumps(_plain(fields), sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as error:
        raise KvSwapError(f"a model config field cannot name KV: {error}") from None


def hf_config_fields(config: Mapping[str, object]) -> dict[str, object]:
    """The fields of a Hugging Face config dict that decide K and V: all of them but
    `NOT_KV_CONFIG_KEYS` and private keys, in nested configs (a VLM's `text_config`) too."""
    return {
        key: hf_config_fields(value) if isinstance(value, Mapping) else value
        for key, value in config.items()
        if not key.startswith("_") and key not in NOT_KV_CONFIG_KEYS
    }


@dataclass(frozen=True)
class CheckpointIdentity:
    """What a Hugging Face checkpoint directory says of the KV it computes: its weights'
    digest and its config's K/V fields as canonical JSON (`KvIdentity.config`)."""

    weights: str
    config: str


def checkpoint_identity(directory: Path) -> CheckpointIdentity:
    """The weights and config.json of the checkpoint in `directory`, as an engine that
    reads the Hugging Face format (vLLM, SGLang) sees them; one line for what is not
    a checkpoint."""
    path = directory / "config.json"
    try:
        raw = parse_json(read_user_file(path, str(path), MODEL_CONFIG_FILE), str(path))
    except OSError as error:
        raise KvSwapError(f"cannot read {path}: {error.strerror}") from None
    if not isinstance(raw, dict):
        raise KvSwapError(f"{path}: allowed: a JSON object")
    return CheckpointIdentity(
        checkpoint_weights_identity(directory), config_json(hf_config_fields(raw))
    )


def find_checkpoint(model: str, revision: str | None = None) -> Path | None:
    """The local directory of the checkpoint an engine names `model`: the directory itself,
    or a Hugging Face hub id's snapshot in the local cache (nothing is downloaded).
    None: neither is here."""
    directory = Path(model).expanduser()
    if directory.is_dir():
        return directory
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # not installed, not an id, not cached: the weights are unknown here
        return None


def engine_config_fields(model: ModelArchConfig | ModelDescription) -> dict[str, object]:
    """The config fields kvswap's own K/V path reads: every field of the decoder's
    `ModelArchConfig` (norm epsilon, RoPE scaling, biases, window...), its description's
    by `ModelDescription.identity_fields` (its name and parameter estimate are not the
    model). A bare description (a simulation, which runs no decoder) gives its own."""
    if isinstance(model, ModelDescription):
        return model.identity_fields()
    fields: dict[str, object] = {}
    for field in dataclasses.fields(model):
        value = getattr(model, field.name)
        if isinstance(value, ModelDescription):
            fields.update(value.identity_fields())
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields[field.name] = {"type": type(value).__name__, **dataclasses.asdict(value)}
        else:
            fields[field.name] = value
    return fields


def kvswap_identity(
    model: ModelArchConfig | ModelDescription,
    weights: str | None,
    *,
    batch_invariant: bool,
    device_type: str,
    block_tokens: int,
    block_bytes: int,
) -> KvIdentity:
    """The identity of kvswap's own engine's blocks (and the simulator's: `weights`
    None, no bytes computed). The exact mode's KV is bit-identical whatever the batch
    and the fast path's is not, and each device has its own kernels, so both name
    the compute: an exact-mode process never reuses KV the fast path computed."""
    description = model if isinstance(model, ModelDescription) else model.description
    mode = "exact" if batch_invariant else "fast"
    return KvIdentity(
        compute="simulated" if weights is None else f"kvswap/{mode}/{device_type}",
        weights=weights,
        config=config_json(engine_config_fields(model)),
        kv_dtype=description.kv_dtype,
        layout=f"kvswap-block/planes={description.num_kv_planes}",
        block_tokens=block_tokens,
        block_bytes=block_bytes,
    )


def _plain(value: object) -> object:
    """JSON-ready: tuples as lists; a non-finite float is refused (json says why)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{value!r} is not a finite number")
    return value
