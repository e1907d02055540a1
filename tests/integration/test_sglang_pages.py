"""The SGLang-free parts of kvswap's HiCache backend, in this venv: the page keys,
the host pool as host slots, the NVMe slab as the tier, the extra-config checks.
(SGLang's own classes drive the backend in `test_sglang_backend.py`.)"""

from __future__ import annotations

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
)

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
    options = StorageOptions(nvme_dir=tmp_path, nvme_pages=16)
    store = open_page_store(options, shape, "m/tp0of1", half_page_slots(pool.kv_buffer, shape))
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
    assert list(tmp_path.iterdir()) == []


def test_page_keys_differ_by_shard_layout_and_salt() -> None:
    shape = page_shape(host_pool())
    direct = page_shape(host_pool("page_first_direct"))
    base = PageKeys("m/tp0of2", shape, None).halves("ab")
    assert len(set(base)) == 2  # K and V halves
    for other in (
        PageKeys("m/tp1of2", shape, None),
        PageKeys("m/tp0of2", direct, None),
        PageKeys("m/tp0of2", shape, "tenant"),
    ):
        assert not set(other.halves("ab")) & set(base)
    assert PageKeys("m/tp0of2", shape, None).halves("ab") == base  # stable


def test_host_indices_must_be_whole_pages() -> None:
    assert page_numbers(torch.arange(8, 16), PAGE, PAGES) == [2, 3]
    for bad in (torch.arange(1, 5), torch.arange(0, 6), torch.arange(28, 36)):
        with pytest.raises(ValueError, match="whole pages"):
            page_numbers(bad, PAGE, PAGES)


def test_extra_config_mistakes_are_one_line() -> None:
    for extra, words in (
        ({}, "exactly one of remote_url"),
        ({"remote_url": "redis://h", "nvme_dir": "/tmp"}, "exactly one of remote_url"),
        ({"remote_url": "http://h"}, "unknown scheme http://"),
        ({"remote_url": "redis://h", "remote_timeout_ms": 0}, "remote_timeout_ms = 0"),
        ({"remote_url": "redis://h", "remote_required": "yes"}, "remote_required = 'yes'"),
        ({"nvme_dir": "/tmp"}, "nvme_pages = 0"),
        ({"nvme_dir": "/tmp", "nvme_pages": 4, "nvme_eviction_policy": "x"}, "'x'"),
    ):
        with pytest.raises(ConfigError, match=words) as caught:
            StorageOptions.from_extra_config({"backend_name": "kvswap", **extra})
        assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="page_first"):
        page_shape(host_pool("layer_first"))
