"""The SGLang-free parts of kvswap's HiCache backend, in this venv: the page keys,
the host pool as host slots, the NVMe slab as the tier, the extra-config checks.
(SGLang's own classes drive the backend in `test_sglang_backend.py`.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvswap.errors import ConfigError
from kvswap.integrations.sglang.options import StorageOptions
from kvswap.integrations.sglang.page_store import open_page_store
from kvswap.integrations.sglang.pages import (
    PageKeys,
    half_page_slots,
    page_numbers,
    page_shape,
    sglang_identity,
)
from tests.redis_server import RedisServer
from tests.unit.test_llama import TINY_HF_CONFIG
from tests.unit.test_weights_identity import checkpoint, tensors

LAYERS, HEADS, HEAD_DIM, PAGE, PAGES = 2, 2, 8, 4, 8


def host_pool(layout: str = "page_first") -> Any:
    """What kvswap reads of SGLang's MHATokenToKVPoolHost, page_first layout."""
    kv = torch.zeros(2, PAGES * PAGE, LAYERS, HEADS, HEAD_DIM)
    return SimpleNamespace(layout=layout, kv_buffer=kv, page_size=PAGE, layer_num=LAYERS,
                           head_num=HEADS, head_dim=HEAD_DIM)  # fmt: skip


def test_pages_round_trip_through_the_nvme_slab_and_the_slab_goes_at_close(
    tmp_path: Path,
) -> None:
    pool = host_pool()
    shape = page_shape(pool)
    (tmp_path / "nvme").mkdir()
    options = StorageOptions(nvme_dir=tmp_path / "nvme", nvme_pages=16)
    identity = sglang_identity(storage_config(), shape, model_dir(tmp_path / "m"))
    store = open_page_store(options, shape, identity, half_page_slots(pool.kv_buffer, shape))
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape))
    expected = pool.kv_buffer.clone()
    hashes = [f"{i:064x}" for i in range(3)]
    assert store.store(hashes, [0, 2, 5]) == [True] * 3
    assert store.exists_prefix([*hashes, "f" * 64]) == 3
    assert store.exists_prefix(["f" * 64, *hashes]) == 0
    pool.kv_buffer.zero_()
    assert store.load([hashes[2], "f" * 64], [5, 6]) == [True, False]
    assert torch.equal(pool.kv_buffer[:, 5 * PAGE : 6 * PAGE], expected[:, 5 * PAGE : 6 * PAGE])
    assert not pool.kv_buffer[:, : 5 * PAGE].any()  # nothing else was written
    assert store.counters()["hits_blocks"] == 2  # a page is two halves
    store.close()
    assert list((tmp_path / "nvme").iterdir()) == []


def test_the_slab_in_front_of_the_store_serves_what_a_new_slab_lacks(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """nvme_dir and remote_url together: a page stored goes to both; an engine started
    with an empty slab finds it in the store."""
    pool = host_pool()
    shape = page_shape(pool)
    identity = sglang_identity(storage_config(), shape, model_dir(tmp_path / "m"))
    slots = half_page_slots(pool.kv_buffer, shape)
    hashes = [f"{i:064x}" for i in range(3)]
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape))
    expected = pool.kv_buffer.clone()
    for run, slab in enumerate((tmp_path / "slab-1", tmp_path / "slab-2")):
        slab.mkdir()
        options = StorageOptions.from_extra_config(
            {"remote_url": redis_server.url, "nvme_dir": str(slab), "nvme_pages": 16}
        )
        store = open_page_store(options, shape, identity, slots)
        if run == 0:
            assert store.store(hashes, [0, 2, 5]) == [True] * 3
            counts = store.counters()
            assert counts["tier0_written_blocks"] == counts["tier1_written_blocks"] == 6
        pool.kv_buffer.zero_()
        assert store.exists_prefix(hashes) == 3
        assert store.load(hashes, [1, 3, 4]) == [True] * 3
        for page, source in ((1, 0), (3, 2), (4, 5)):
            got = pool.kv_buffer[:, page * PAGE : (page + 1) * PAGE]
            assert torch.equal(got, expected[:, source * PAGE : (source + 1) * PAGE])
        counts = store.counters()
        hits = (counts["tier0_hits_blocks"], counts["tier1_hits_blocks"])
        assert hits == ((6, 0) if run == 0 else (0, 6))  # the new slab missed: the store
        store.close()
        assert list(slab.iterdir()) == []


def storage_config(tp_rank: int = 0, tp_size: int = 1, model_name: str = "m") -> Any:
    """What kvswap reads of SGLang's HiCacheStorageConfig."""
    return SimpleNamespace(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1,
                           attn_cp_rank=0, attn_cp_size=1, model_name=model_name)  # fmt: skip


def model_dir(directory: Path, seed: int = 0) -> str:
    checkpoint(directory, tensors(seed))
    (directory / "config.json").write_text(json.dumps(TINY_HF_CONFIG))
    return str(directory)


def test_page_keys_differ_by_model_shard_layout_and_salt(tmp_path: Path) -> None:
    shape = page_shape(host_pool())
    direct = page_shape(host_pool("page_first_direct"))
    model, other_model = model_dir(tmp_path / "m"), model_dir(tmp_path / "other", seed=1)

    def keys(model: str = model, shape: Any = shape, salt: str | None = None, **shard: Any) -> Any:
        config = storage_config(**{"tp_size": 2, **shard})
        return PageKeys(sglang_identity(config, shape, model), salt)

    base = keys().halves("ab")
    assert len(set(base)) == 2  # K and V halves
    for other in (
        keys(tp_rank=1),
        keys(shape=direct),
        keys(salt="tenant"),
        keys(model=other_model),
    ):
        assert not set(other.halves("ab")) & set(base)
    assert keys().halves("ab") == base  # stable
    # Issue 30, finding 4: the served name is no part of a page's key; its bytes are.
    same = [sglang_identity(storage_config(model_name=name), shape, model).fingerprint()
            for name in ("org/m", "org-m", None, "unnamed")]  # fmt: skip
    assert len(set(same)) == 1
    copied = shutil.copytree(model, tmp_path / "copy")  # the same files anywhere: one model
    assert keys(model=str(copied)).halves("ab") == base


def test_a_model_kvswap_cannot_read_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read those of model 'org/not-cached'"):
        sglang_identity(storage_config(), page_shape(host_pool()), "org/not-cached")


def test_host_indices_must_be_whole_pages() -> None:
    assert page_numbers(torch.arange(8, 16), PAGE, PAGES) == [2, 3]
    for bad in (torch.arange(1, 5), torch.arange(0, 6), torch.arange(28, 36)):
        with pytest.raises(ValueError, match="whole pages"):
            page_numbers(bad, PAGE, PAGES)


def test_extra_config_mistakes_are_one_line() -> None:
    for extra, words in (
        ({}, r"give remote_url \(the shared store\), nvme_dir \(the NVMe slab\), or both"),
        ({"remote_url": "redis://h", "nvme_dir": "/tmp"}, "nvme_pages = 0; allowed"),
        ({"remote_url": "http://h"}, "unknown scheme http://"),
        ({"remote_url": "redis://h", "remote_timeout_ms": 0}, "remote_timeout_ms = 0"),
        ({"remote_url": "redis://h", "remote_required": "yes"}, "remote_required = 'yes'"),
        ({"nvme_dir": "/tmp"}, "nvme_pages = 0; allowed: an integer >= 1 with nvme_dir"),
        # -1 and 0 are refused alike (the two messages once disagreed: >= 0, >= 1).
        ({"nvme_dir": "/tmp", "nvme_pages": -1}, "nvme_pages = -1; allowed: an integer >= 1 "),
        ({"nvme_dir": "/tmp", "nvme_pages": "8"}, "nvme_pages = '8'; allowed: an integer >= 1"),
        ({"nvme_dir": "/tmp", "nvme_pages": True}, "nvme_pages = True; allowed: an integer"),
        ({"remote_url": "redis://h", "nvme_pages": 8}, "nvme_pages is set but nvme_dir is not"),
        ({"nvme_dir": "/tmp", "nvme_pages": 4, "nvme_eviction_policy": "x"}, "'x'"),
        (  # a misspelt key would do nothing
            {"remote_url": "redis://h", "remote_timeout": 5},
            r"unknown key 'remote_timeout' \(did you mean 'remote_timeout_ms'\?\); allowed: ",
        ),
    ):
        with pytest.raises(ConfigError, match=words) as caught:
            StorageOptions.from_extra_config({"backend_name": "kvswap", **extra})
        assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="page_first"):
        page_shape(host_pool("layer_first"))


def test_sglang_s_own_keys_pass_through() -> None:
    """The keys SGLang reads from (or adds to) the same object are SGLang's."""
    sglang_s = {
        "backend_name": "kvswap", "module_path": "kvswap.integrations.sglang",
        "class_name": "KvSwapStorage", "interface_v1": 1, "tp_lcm_size": 4,
        "prefetch_threshold": 256, "prefetch_timeout_base": 1,
        "prefetch_timeout_per_ki_token": 0.25, "hicache_storage_pass_prefix_keys": False,
        "file_storage_path": "/tmp/hicache",
    }  # fmt: skip
    options = StorageOptions.from_extra_config({**sglang_s, "nvme_dir": "/tmp", "nvme_pages": 4})
    assert (options.nvme_dir, options.nvme_pages) == (Path("/tmp"), 4)
