"""SGLang's own HiCache classes against kvswap's backend; runs in .venv-sglang.

    .venv-sglang/bin/python tests/integration/sglang_checks.py REDIS_URL REDIS_PID

`test_sglang_backend.py` starts the redis-server and runs this script once (one
SGLang import, ~10 s on two busy cores). The backend is built the way SGLang's
`dynamic` backend builds it (`StorageBackendFactory.create_backend`, then
`register_mem_pool_host`) over a real `MHATokenToKVPoolHost` on CPU tensors
(`layout="page_first"`, `pin_memory=False`). Prints one JSON line per check,
{"check": name, "ok": bool, "detail": text}; the last check kills the store.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

STUBS = Path(__file__).resolve().parent / "sglang_stubs"
NAMESPACE = "kvswap-sglang"
LAYERS, HEADS, HEAD_DIM, PAGE_TOKENS, DEVICE_TOKENS = 2, 2, 8, 4, 64
MODELS = Path(tempfile.mkdtemp(prefix="kvswap-sglang-models-"))


def import_sglang() -> None:
    """torch and transformers decide first that triton and torchvision are absent (the
    stand-ins would fool them); then SGLang imports with the stand-ins on the path."""
    import torch._dynamo.repro.after_dynamo
    import torch._inductor.runtime.triton_compat  # noqa: F401
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()
    sys.path.insert(0, str(STUBS))


import_sglang()

import redis  # noqa: E402
import torch  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import (  # noqa: E402
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvswap.data.remote_format import key_name  # noqa: E402
from kvswap.errors import ConfigError  # noqa: E402

CHECKS: list[Callable[[str, int], None]] = []


def check(fn: Callable[[str, int], None]) -> Callable[[str, int], None]:
    CHECKS.append(fn)
    return fn


def host_pool(layout: str = "page_first") -> Any:
    """A real MHA host pool on CPU tensors, with a device pool's buffers to describe."""
    k = tuple(torch.zeros(DEVICE_TOKENS + PAGE_TOKENS, HEADS, HEAD_DIM) for _ in range(LAYERS))
    v = tuple(torch.zeros(DEVICE_TOKENS + PAGE_TOKENS, HEADS, HEAD_DIM) for _ in range(LAYERS))

    def pointers(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)

    buffers = KVBuffers(
        k=k, v=v, k_data_ptrs=pointers(k), v_data_ptrs=pointers(v), layout=KVBufferLayout.NHD
    )
    info = MHABufferInfo(
        buffers=buffers, page_size=PAGE_TOKENS, head_num=HEADS, head_dim=HEAD_DIM,
        v_head_dim=HEAD_DIM, dtype=torch.float32, device=torch.device("cpu"),
    )  # fmt: skip
    return MHATokenToKVPoolHost(
        info, 2.0, 0, PAGE_TOKENS, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=DEVICE_TOKENS, start_layer=0, end_layer=LAYERS,
    )  # fmt: skip


def model_dir(seed: int) -> str:
    """A checkpoint (config.json and weights drawn from `seed`) whose bytes name the pages:
    the checks' engines serve no model, so each names one by `model_path`."""
    from safetensors.torch import save_file

    directory = MODELS / f"model-{seed}"
    if not directory.exists():
        directory.mkdir()
        weights = torch.randn(16, 16, generator=torch.Generator().manual_seed(seed))
        save_file({"model.embed_tokens.weight": weights}, str(directory / "model.safetensors"))
        (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return str(directory)


def backend(pool: Any, url: str, *, model_name: str | None = "tiny/llama", **extra: Any) -> Any:
    """kvswap's backend exactly as `--hicache-storage-backend dynamic` builds it."""
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name=model_name,
        extra_config={
            "backend_name": "kvswap", "module_path": "kvswap.integrations.sglang",
            "class_name": "KvSwapStorage", "interface_v1": 1, "remote_url": url,
            "model_path": model_dir(0), **extra,
        },
    )  # fmt: skip
    storage = StorageBackendFactory.create_backend("dynamic", config, pool)
    storage.register_mem_pool_host(pool)  # as SGLang's cache controller does next
    return storage


def filled_pages(pool: Any, num_pages: int, seed: int) -> tuple[torch.Tensor, list[str]]:
    """`num_pages` host pages of random KV; their token indices and page hashes."""
    indices = pool.alloc(num_pages * PAGE_TOKENS)
    generator = torch.Generator().manual_seed(seed)
    for first in indices[::PAGE_TOKENS].tolist():
        page = pool.kv_buffer[:, first : first + PAGE_TOKENS]
        page.copy_(torch.randn(page.shape, generator=generator))
    hashes = [f"{seed:08x}{page:056x}" for page in range(num_pages)]
    return indices, hashes


def pages_of(pool: Any, indices: torch.Tensor) -> torch.Tensor:
    return torch.stack([pool.get_data_page(first) for first in indices[::PAGE_TOKENS].tolist()])


def store_key(storage: Any, page_hash: str, half: int) -> bytes:
    """The store's key of one half (0: K, 1: V) of a page, as kvswap names it."""
    return key_name(NAMESPACE, storage._pages.keys.halves(page_hash)[half])


@check
def host_pool_round_trip(url: str, _pid: int) -> None:
    pool = host_pool()
    storage = backend(pool, url)
    indices, hashes = filled_pages(pool, 4, seed=1)
    expected = pages_of(pool, indices)
    assert storage.batch_set_v1(hashes, indices) == [True] * 4
    pool.kv_buffer.zero_()
    assert storage.batch_get_v1(hashes, indices) == [True] * 4
    assert torch.equal(pages_of(pool, indices), expected), "KV changed on the way"
    # Another engine (its own host pool and backend) finds and loads the same pages.
    other_pool = host_pool()
    other = backend(other_pool, url)
    other_indices = other_pool.alloc(4 * PAGE_TOKENS)
    assert other.batch_get_v1(hashes, other_indices) == [True] * 4
    assert torch.equal(pages_of(other_pool, other_indices), expected)
    for each in (storage, other):
        each.close()


@check
def present_prefix(url: str, _pid: int) -> None:
    pool = host_pool()
    storage = backend(pool, url)
    indices, hashes = filled_pages(pool, 4, seed=2)
    assert storage.batch_set_v1(hashes, indices) == [True] * 4
    assert storage.batch_exists(hashes) == 4
    assert storage.batch_exists([*hashes[:2], "0" * 64, *hashes[3:]]) == 2
    assert storage.batch_exists(["0" * 64, *hashes]) == 0
    assert storage.exists(hashes[0]) and not storage.exists("0" * 64)
    # Another tenant's salt, or another model, shares nothing.
    salted = backend(host_pool(), url, tenant_salt="tenant-b")
    assert salted.batch_exists(hashes) == 0
    storage.close()
    salted.close()


@check
def the_served_name_is_no_part_of_a_page_s_key(url: str, _pid: int) -> None:
    """Issue 30, finding 4: pages were keyed by the served name with "/" folded into "-"
    ("org/m" read "org-m"'s pages; None read "unnamed"'s). Now by the model's bytes."""
    pool = host_pool()
    storage = backend(pool, url, model_name="org/m")
    indices, hashes = filled_pages(pool, 2, seed=7)
    assert storage.batch_set_v1(hashes, indices) == [True] * 2
    for name in ("org-m", None, "unnamed"):  # another checkpoint under a colliding name
        other = backend(host_pool(), url, model_name=name, model_path=model_dir(1))
        assert other.batch_exists(hashes) == 0, name
        other.close()
    same = backend(host_pool(), url, model_name="another-name")  # the same checkpoint
    assert same.batch_exists(hashes) == 2
    for each in (storage, same):
        each.close()


@check
def legacy_calls(url: str, _pid: int) -> None:
    """get/set/batch_* with flat page tensors, as SGLang's generic path makes them."""
    pool = host_pool()
    storage = backend(pool, url)
    indices, hashes = filled_pages(pool, 3, seed=3)
    firsts = indices[::PAGE_TOKENS].tolist()
    flat = [pool.get_data_page(first) for first in firsts]
    assert storage.batch_set(hashes[:2], flat[:2]) is True
    assert storage.set(hashes[2], flat[2]) is True
    targets = [pool.get_dummy_flat_data_page() for _ in hashes]
    got = storage.batch_get(hashes, targets)
    assert all(g is t for g, t in zip(got, targets, strict=True))
    assert all(torch.equal(t, f) for t, f in zip(targets, flat, strict=True))
    assert storage.get("0" * 64, pool.get_dummy_flat_data_page()) is None
    # Without a target (HiCacheStorage.get's default), the page comes back in its own.
    got_alone = storage.get(hashes[1])
    assert got_alone is not None and got_alone.dtype == flat[1].dtype
    assert torch.equal(got_alone, flat[1].reshape(-1))
    assert storage.get("0" * 64) is None
    assert [page is not None for page in storage.batch_get([hashes[0], "0" * 64])] == [True, False]
    # The legacy and zero-copy paths name a page alike: v1 loads what set stored.
    pool.kv_buffer.zero_()
    assert storage.batch_get_v1(hashes, indices) == [True] * 3
    assert all(torch.equal(pool.get_data_page(f), g) for f, g in zip(firsts, flat, strict=True))
    storage.close()


@check
def corrupted_value_is_a_miss(url: str, _pid: int) -> None:
    pool = host_pool()
    storage = backend(pool, url)
    indices, hashes = filled_pages(pool, 3, seed=4)
    assert storage.batch_set_v1(hashes, indices) == [True] * 3
    raw = redis.Redis.from_url(url)
    name = store_key(storage, hashes[1], 1)
    value = bytearray(raw.get(name) or b"")
    value[-1] ^= 0xFF  # one bit pattern of the V half's last byte
    raw.set(name, bytes(value))
    assert storage.batch_get_v1(hashes, indices) == [True, False, True]
    assert raw.exists(name) == 0, "a value that failed its check is deleted"
    assert storage.counters()["corrupt_blocks"] == 1
    assert storage.batch_exists(hashes) == 1
    storage.close()


@check
def value_under_the_wrong_key_is_a_miss(url: str, _pid: int) -> None:
    pool = host_pool()
    storage = backend(pool, url)
    indices, hashes = filled_pages(pool, 2, seed=5)
    assert storage.batch_set_v1(hashes, indices) == [True] * 2
    raw = redis.Redis.from_url(url)
    # Page 0's intact K half, copied under page 1's K key: its CRC holds, its key does not.
    raw.set(store_key(storage, hashes[1], 0), raw.get(store_key(storage, hashes[0], 0)) or b"")
    assert storage.batch_get_v1(hashes, indices) == [True, False]
    storage.close()


@check
def other_layouts_and_models_are_refused_in_one_line(url: str, _pid: int) -> None:
    pool = host_pool(layout="layer_first")
    try:
        backend(pool, url)
    except ConfigError as error:
        assert "page_first" in str(error) and "\n" not in str(error), error
    else:
        raise AssertionError("a layer_first host pool was accepted")
    try:
        backend(host_pool(), url, remote_timeout_ms=-1)
    except ConfigError as error:
        assert "remote_timeout_ms = -1" in str(error), error
    else:
        raise AssertionError("a negative timeout was accepted")


@check
def killed_store_is_misses(url: str, pid: int) -> None:
    pool = host_pool()
    storage = backend(pool, url, remote_timeout_ms=200)
    indices, hashes = filled_pages(pool, 2, seed=6)
    assert storage.batch_set_v1(hashes, indices) == [True] * 2
    os.kill(pid, signal.SIGKILL)
    assert storage.batch_get_v1(hashes, indices) == [False] * 2
    assert storage.batch_exists(hashes) == 0
    assert storage.batch_set_v1(hashes, indices) == [False] * 2
    assert storage.batch_get([hashes[0]], [pool.get_dummy_flat_data_page()]) == [None]
    storage.close()


def main() -> int:
    url, pid = sys.argv[1], int(sys.argv[2])
    try:
        for fn in CHECKS:
            try:
                fn(url, pid)
                outcome = {"check": fn.__name__, "ok": True, "detail": ""}
            except BaseException:
                outcome = {"check": fn.__name__, "ok": False, "detail": traceback.format_exc()}
            print(json.dumps(outcome), flush=True)
    finally:
        shutil.rmtree(MODELS, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
