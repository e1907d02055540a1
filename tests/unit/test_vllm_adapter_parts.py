"""The vLLM adapter's vLLM-free parts, without vLLM: settings, the page map, jobs on
kvswap's copy engine, keys, and a package that imports without vLLM."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvswap.base.identity import KEY_BYTES
from kvswap.base.transfer import Direction, Priority, TransferChunk, TransferResult
from kvswap.data.copy_engine import LocalCopyEngine
from kvswap.data.host_pool import HostPool
from kvswap.errors import ConfigError, KvSwapError
from kvswap.integrations.vllm.keys import VllmKeys, vllm_identity
from kvswap.integrations.vllm.pages import PageMap, VllmDevicePages
from kvswap.integrations.vllm.settings import adapter_settings
from kvswap.integrations.vllm.transfers import PagedTransfers
from tests.unit.test_llama import TINY_HF_CONFIG
from tests.unit.test_weights_identity import checkpoint, tensors

PAGE_BYTES = 64
NUM_TENSORS = 2  # layers
NUM_GPU_BLOCKS = 6


# --- settings ---------------------------------------------------------------------------


def test_kvswap_s_keys_take_kvswap_s_defaults_and_vllm_s_keys_are_left_alone() -> None:
    settings = adapter_settings({"cpu_bytes_to_use": 1 << 30, "block_size": 64})
    # Every key vLLM 0.32 / 0.33 reads from the dict is vLLM's, whatever its value.
    vllm_s = {
        "spec_name": "KvswapOffloadingSpec", "spec_module_path": "kvswap.integrations.vllm",
        "cpu_bytes_to_use": 1.5 * (1 << 30), "blocks_per_chunk": "2", "canonical_layout": 0,
        "sync_load_budget_bytes": 0, "offload_prompt_only": False,
        "self_describing_kv_events": True, "cache_policy_module_path": None,
        "store_threshold": "2", "max_tracker_size": 64_000, "secondary_tiers": [],
        "locality": "local",
    }  # fmt: skip
    assert adapter_settings(vllm_s) == settings
    assert settings.policy_name == "reuse"  # the reuse ranking, by default
    assert (settings.protected_sink_blocks, settings.policy.min_residency_steps) == (8, 64)
    assert (settings.nvme, settings.remote) == (None, None)
    assert not settings.has_secondary_tiers


def test_vllm_s_own_secondary_tiers_go_below_kvswap_s_with_their_backpressure() -> None:
    """vLLM's tiering keys are read, not left: in kvswap's spec they did nothing before."""
    entries = [{"type": "fs", "root_dir": "/tmp/x", "backpressure": {"high": 0.9}},
               {"type": "My", "module_path": "my.mod"}]  # fmt: skip
    settings = adapter_settings({"secondary_tiers": entries, "backpressure": {"high": 0.5,
                                 "low": 0.1}, "tier_poll_interval_s": 0.01})  # fmt: skip
    assert settings.has_secondary_tiers and settings.tier_poll_interval_s == 0.01
    assert [dict(entry) for entry in settings.vllm_tiers] == [
        {"type": "fs", "root_dir": "/tmp/x", "backpressure": {"high": 0.9, "low": 0.1}},
        {"type": "My", "module_path": "my.mod", "backpressure": {"high": 0.5, "low": 0.1}},
    ]
    assert entries[0]["backpressure"] == {"high": 0.9}  # the caller's dicts untouched
    for extra, words in (
        ({"secondary_tiers": {"type": "fs"}}, "secondary_tiers = {'type': 'fs'} (kv_conn"),
        ({"secondary_tiers": [{"root_dir": "/x"}]}, "secondary_tiers[0] = {'root_dir'"),
        ({"backpressure": {}}, "backpressure (kv_connector_extra_config) applies to vLLM's"),
        ({"secondary_tiers": [{"type": "fs"}], "backpressure": 1}, "backpressure = 1 (kv_"),
        ({"tier_poll_interval_s": "1"}, "tier_poll_interval_s = '1' (kv_connector_extra"),
    ):
        with pytest.raises(ConfigError) as refused:
            adapter_settings(extra)
        assert str(refused.value).startswith(words), str(refused.value)


def test_the_tiers_are_read_under_kvswap_s_names() -> None:
    settings = adapter_settings(
        {
            "nvme_dir": "/tmp",
            "nvme_kv_capacity_bytes": "2MiB",
            "remote_url": "redis://127.0.0.1:6379/0",
            "eviction_policy": "lru",
            "protected_sink_blocks": 0,
        }
    )
    assert settings.nvme is not None and settings.nvme.capacity_bytes == 2 << 20
    assert settings.remote is not None and settings.remote.timeout_ms == 50.0
    assert settings.policy_name == "lru"
    assert settings.policy.sink_protection is False


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"protected_sink_blocks": -1}, "protected_sink_blocks = -1 (from kv_connector_extra"),
        ({"eviction_policy": "mru"}, "eviction_policy = 'mru': unknown policy; allowed: 'kvswap'"),
        (
            {"eviction_policy": "reuse(dead_gaps=-1)"},
            "eviction_policy = 'reuse(dead_gaps=-1)': dead_gaps = '-1': allowed: a number of "
            "return gaps > 0",
        ),
        ({"eviction_policy": 3}, "eviction_policy = 3 (kv_connector_extra_config): not a name"),
        ({"nvme_dir": "/tmp"}, "nvme_dir is set but nvme_kv_capacity_bytes is not; allowed"),
        ({"remote_url": "http://x"}, "remote_url = 'http://x' (from kv_connector_extra_config)"),
        ({"swap_out_high_watermark": 0.9}, "'swap_out_high_watermark' is a setting of kvswap's"),
        ({"min_residency_steps": True}, "min_residency_steps = True (from kv_connector_extra"),
        (  # vLLM 0.33's key, which kvswap's connector reads on 0.32
            {"sync_load_budget_bytes": -1},
            "sync_load_budget_bytes = -1 (kv_connector_extra_config); allowed: a whole number "
            "of bytes >= 0",
        ),
        ({"sync_load_budget_bytes": "8"}, "sync_load_budget_bytes = '8' (kv_connector_extra"),
        ({"sync_load_budget_bytes": 1.5}, "sync_load_budget_bytes = 1.5 (kv_connector_extra"),
        (  # a misspelt key would do nothing
            {"protected_sink_block": 4},
            "unknown key 'protected_sink_block' (did you mean 'protected_sink_blocks'?); "
            "allowed: kvswap's protected_sink_blocks,",
        ),
        (  # a JSON string is not a count, though a TOML file's or a variable's text is read
            {"protected_sink_blocks": "8"},
            "protected_sink_blocks = '8' (from kv_connector_extra_config): wrong type (str); "
            "allowed: an integer",
        ),
        (
            {"remote_url": "redis://h", "remote_required": 1},
            "remote_required = 1 (from kv_connector_extra_config): wrong type (int); "
            "allowed: true or false",
        ),
        (
            {"remote_url": "redis://h", "remote_timeout_ms": "50"},
            "remote_timeout_ms = '50' (from kv_connector_extra_config): wrong type (str); "
            "allowed: a number",
        ),
    ],
)
def test_a_bad_value_is_one_line_naming_the_key_and_what_is_allowed(
    extra: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        adapter_settings(extra)
    assert message in str(info.value) and "\n" not in str(info.value)


# --- pages ------------------------------------------------------------------------------


def test_a_block_of_two_chunked_blocks_maps_each_layer_s_page() -> None:
    """Two blocks per chunk; the job starts mid-chunk (its first block is the second of
    host chunk 5), as vLLM's own worker reads a partly cached chunk."""
    page_map = PageMap(NUM_TENSORS, NUM_GPU_BLOCKS, blocks_per_chunk=2)
    pairs = page_map.pairs([4, 1, 3], first_block_index=3, host_chunks=[5, 0])
    # device slot = tensor * 6 + block; host slot = chunk * 4 + tensor * 2 + sub-block
    assert pairs == [(4, 21), (10, 23), (1, 0), (7, 2), (3, 1), (9, 3)]
    with pytest.raises(ValueError, match="need 2 host chunks of 2 blocks, got 1"):
        page_map.pairs([4, 1, 3], first_block_index=3, host_chunks=[5])


def test_device_pages_are_views_of_vllm_s_tensors() -> None:
    tensors = [torch.zeros(NUM_GPU_BLOCKS, PAGE_BYTES, dtype=torch.int8) for _ in range(2)]
    device = VllmDevicePages(tensors)
    assert (device.num_blocks, device.page_bytes, device.is_cuda) == (12, PAGE_BYTES, False)
    device.byte_view(NUM_GPU_BLOCKS + 2).fill_(255)  # tensor 1, block 2
    assert int(tensors[1][2][0]) == -1 and int(tensors[0].abs().sum()) == 0
    with pytest.raises(KvSwapError, match="one shape"):
        VllmDevicePages([tensors[0], torch.zeros(3, PAGE_BYTES, dtype=torch.int8)])
    with pytest.raises(KvSwapError, match="byte tensors"):
        VllmDevicePages([torch.zeros(NUM_GPU_BLOCKS, 8, dtype=torch.float32)])


# --- jobs on the copy engine -------------------------------------------------------------


@pytest.fixture
def stack() -> Iterator[tuple[list[torch.Tensor], HostPool, PagedTransfers, LocalCopyEngine]]:
    tensors = [
        torch.arange(NUM_GPU_BLOCKS * PAGE_BYTES, dtype=torch.int32).remainder(97).to(torch.int8)
        .add(t).view(NUM_GPU_BLOCKS, PAGE_BYTES)
        for t in range(NUM_TENSORS)
    ]  # fmt: skip
    device = VllmDevicePages(tensors)
    host = HostPool(device.layout, 4 * NUM_TENSORS)  # 4 chunks of one block
    engine = LocalCopyEngine(device, host)
    transfers = PagedTransfers(
        engine, PAGE_BYTES, NUM_TENSORS, swap_in_chunk_blocks=1, swap_out_chunk_blocks=2
    )
    yield tensors, host, transfers, engine
    engine.close()
    host.close()


def test_a_stored_job_loads_back_into_other_blocks(
    stack: tuple[list[torch.Tensor], HostPool, PagedTransfers, LocalCopyEngine],
) -> None:
    tensors, _host, transfers, _engine = stack
    page_map = PageMap(NUM_TENSORS, NUM_GPU_BLOCKS, 1)
    expected = [tensor[[0, 1, 2]].clone() for tensor in tensors]
    transfers.submit_store(7, page_map.pairs([0, 1, 2], 0, [3, 1, 0]))
    transfers.wait([7])
    (stored,) = transfers.finished()
    assert (stored.job_id, stored.success, stored.num_bytes) == (7, True, 6 * PAGE_BYTES)
    transfers.submit_load(8, page_map.pairs([5, 4, 3], 0, [3, 1, 0]))
    transfers.wait([8])
    assert [done.job_id for done in transfers.finished()] == [8]
    for tensor, before in zip(tensors, expected, strict=True):
        assert torch.equal(tensor[[5, 4, 3]], before)
    assert transfers.counts.num_loads == 1 and transfers.counts.stored_bytes == 6 * PAGE_BYTES


class RecordingEngine(LocalCopyEngine):
    """Records the chunks it is handed (the adapter's bounded chunks and their queues)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.chunks: list[TransferChunk] = []

    def submit(self, chunk: TransferChunk) -> None:
        self.chunks.append(chunk)
        super().submit(chunk)


def test_loads_go_high_and_stores_low_in_chunks_of_whole_blocks() -> None:
    tensors = [torch.zeros(NUM_GPU_BLOCKS, PAGE_BYTES, dtype=torch.int8) for _ in range(2)]
    device = VllmDevicePages(tensors)
    with HostPool(device.layout, 6 * NUM_TENSORS) as host:
        engine = RecordingEngine(device, host)
        transfers = PagedTransfers(
            engine, PAGE_BYTES, NUM_TENSORS, swap_in_chunk_blocks=2, swap_out_chunk_blocks=3
        )
        page_map = PageMap(NUM_TENSORS, NUM_GPU_BLOCKS, 1)
        transfers.submit_store(1, page_map.pairs([0, 1, 2, 3, 4], 0, [0, 1, 2, 3, 4]))
        transfers.submit_load(2, page_map.pairs([5, 0, 1], 0, [5, 0, 1]))
        transfers.wait([1, 2])
        results = {done.job_id: done.success for done in transfers.finished()}
        engine.close()
    assert results == {1: True, 2: True}
    shapes = [(c.priority, c.direction, c.num_blocks) for c in engine.chunks]
    assert shapes == [
        (Priority.LOW, Direction.GPU_TO_CPU, 6),  # 3 blocks x 2 layers
        (Priority.LOW, Direction.GPU_TO_CPU, 4),
        (Priority.HIGH, Direction.CPU_TO_GPU, 4),  # 2 blocks x 2 layers
        (Priority.HIGH, Direction.CPU_TO_GPU, 2),
    ]


class FailingEngine(RecordingEngine):
    """Reports every chunk failed (the bytes moved, but a test says they must not count)."""

    def poll(self) -> list[TransferResult]:
        return [_failed(result) for result in super().poll()]

    def wait(self, transfer_id: int) -> TransferResult:
        return _failed(super().wait(transfer_id))


def _failed(result: TransferResult) -> TransferResult:
    return TransferResult(
        result.transfer_id, False, result.num_bytes, result.start_s, result.end_s, "EIO: test"
    )


def test_a_job_with_a_failed_chunk_is_reported_failed_with_why() -> None:
    tensors = [torch.zeros(NUM_GPU_BLOCKS, PAGE_BYTES, dtype=torch.int8) for _ in range(2)]
    device = VllmDevicePages(tensors)
    with HostPool(device.layout, 2 * NUM_TENSORS) as host:
        engine = FailingEngine(device, host)
        transfers = PagedTransfers(
            engine, PAGE_BYTES, NUM_TENSORS, swap_in_chunk_blocks=1, swap_out_chunk_blocks=1
        )
        transfers.submit_store(3, PageMap(NUM_TENSORS, NUM_GPU_BLOCKS, 1).pairs([0], 0, [1]))
        transfers.wait([3])
        (result,) = transfers.finished()
        assert transfers.finished() == []  # reported once
        engine.close()
    assert (result.success, result.error) == (False, "EIO: test")
    assert transfers.counts.num_failed == 1


# --- keys and imports ---------------------------------------------------------------------


def _offload_config(model: str, **changes: object) -> SimpleNamespace:
    """vLLM's OffloadingConfig, as far as kvswap's keys read it."""
    parallel = {"world_size": 1, "tp_size": 1, "pp_size": 1, "pcp_size": 1, "dcp_size": 1}
    parallel.update({k: v for k, v in changes.items() if k in parallel})
    return SimpleNamespace(
        model=SimpleNamespace(name=model, dtype=changes.get("dtype", "float16")),
        parallel=SimpleNamespace(**parallel),
        kv_cache_layout=changes.get("kv_cache_layout", "NHD"),
    )


def _keys(model: str, *, tokens: int = 32, row_bytes: int = 4096, **changes: object) -> VllmKeys:
    return VllmKeys(
        vllm_identity(
            _offload_config(model, **changes), tokens_per_chunk=tokens, row_bytes=row_bytes,
            shared=True, source="test",
        )
    )  # fmt: skip


def _vllm_checkpoint(directory: Path, seed: int = 0, **config: object) -> str:
    checkpoint(directory, tensors(seed))
    (directory / "config.json").write_text(json.dumps({**TINY_HF_CONFIG, **config}))
    return str(directory)


def test_vllm_keys_name_the_checkpoint_s_bytes_not_its_path(tmp_path: Path) -> None:
    """Issue 30, finding 3: the model's path named vLLM's chunks, so a checkpoint
    redeployed at the same path read the old one's KV."""
    model = _vllm_checkpoint(tmp_path / "current")
    keys = _keys(model)
    offload_key = bytes(36)
    assert len(keys.key(offload_key)) == KEY_BYTES
    assert keys.key(offload_key) == _keys(model).key(offload_key)
    # The same files at another path are the same model.
    copy = shutil.copytree(model, tmp_path / "copy")
    assert _keys(str(copy)).key(offload_key) == keys.key(offload_key)
    others = [
        _keys(_vllm_checkpoint(tmp_path / "tuned", seed=1)),  # other weights
        _keys(_vllm_checkpoint(tmp_path / "eps", rms_norm_eps=1e-5)),  # other config
        _keys(model, dtype="bfloat16"),
        _keys(model, tokens=64),
        _keys(model, row_bytes=8192),
        _keys(model, tp_size=2, world_size=2),
        _keys(model, kv_cache_layout="HND"),
    ]
    for other in others:
        assert other.key(offload_key) != keys.key(offload_key)
        assert other.store_prefix != keys.store_prefix
    assert keys.store_prefix.startswith("kvswap-vllm-") and " " not in keys.store_prefix
    # Redeployed at the same path: another model.
    shutil.rmtree(model)
    _vllm_checkpoint(tmp_path / "current", seed=2)
    assert _keys(model).key(offload_key) != keys.key(offload_key)


def test_a_shared_store_needs_weights_kvswap_can_read(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read those of model 'org/not-cached'"):
        _keys("org/not-cached")
    private = [
        vllm_identity(
            _offload_config("org/not-cached"), tokens_per_chunk=32, row_bytes=4096,
            shared=False, source="test",
        ).fingerprint()
        for _ in range(2)
    ]  # fmt: skip
    assert private[0] != private[1]  # unknown weights share nothing, not even with themselves


def test_kvswap_and_the_adapter_package_import_without_vllm() -> None:
    code = (
        "import sys, kvswap.integrations.vllm as a, kvswap.integrations.vllm.settings, "
        "kvswap.integrations.vllm.pages, kvswap.integrations.vllm.transfers, "
        "kvswap.integrations.vllm.keys;"
        "assert 'vllm' not in sys.modules, 'vllm imported';"
        "print(sorted(a.__all__))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "KvswapOffloadingSpec" in done.stdout


def test_only_the_adapter_package_imports_vllm() -> None:
    from tests.unit.test_layering import imported_modules

    src = Path(__file__).resolve().parents[2] / "src" / "kvswap"
    importers = sorted(
        str(path.relative_to(src))
        for path in src.rglob("*.py")
        if any(name.split(".")[0] == "vllm" for name in imported_modules(path))
    )
    assert importers == [
        "integrations/vllm/cache_policy.py",
        "integrations/vllm/connector.py",
        "integrations/vllm/manager.py",
        "integrations/vllm/spec.py",
        "integrations/vllm/tiers.py",
        "integrations/vllm/worker.py",
    ]


def test_a_host_tier_that_does_not_fit_names_vllm_s_own_reservation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 31, item 6: on vLLM's CPU backend its own KV cache is host memory (92 % of
    RAM by default): a host tier that does not fit says so, instead of blaming itself."""
    from kvswap.host_memory import HostMemory
    from kvswap.integrations.vllm import pages

    monkeypatch.setattr(pages, "host_memory", lambda: HostMemory(1 << 30, "MemAvailable"))
    device = VllmDevicePages([torch.zeros(8, 4096, dtype=torch.uint8) for _ in range(2)])
    pages.check_host_room(512 << 20, device)  # fits: nothing said
    with pytest.raises(KvSwapError) as refused:
        pages.check_host_room(4 << 30, device)
    message = str(refused.value)
    assert "\n" not in message and "cpu_bytes_to_use asks 4.00 GiB" in message
    assert "only 1.00 GiB of host memory is available (limited by MemAvailable)" in message
    assert "vLLM's own KV cache already holds" in message
    assert "lower --gpu-memory-utilization" in message


def test_the_host_tier_s_policy_takes_parameters_in_its_name() -> None:
    settings = adapter_settings({"eviction_policy": "reuse(once=oldest, dead_gaps=1.2)"})
    assert settings.policy_name == "reuse(once=oldest, dead_gaps=1.2)"


def test_the_connector_s_stats_line_reads_back_from_a_log() -> None:
    """What kvswap's connector writes to vLLM's log is what benchmarks read back: the
    last of its lines, none where it wrote none."""
    from kvswap.integrations.vllm.host_report import SyncLoadCounts

    first, last = SyncLoadCounts(2, 352, 0, 0, 0), SyncLoadCounts(154, 62752, 3, 40, 17)
    log = f"INFO [connector.py:1] {first.line()}\nINFO other\nINFO [connector.py:1] {last.line()}"
    assert SyncLoadCounts.last_in(log) == last
    assert SyncLoadCounts.last_in("INFO kvswap host tier: 1 of 2 chunks looked up hit") is None


def test_a_stats_line_is_due_once_an_interval_when_its_counts_moved() -> None:
    """The host tier's and the connector's lines keep one cadence: never twice within
    `interval_s`, never a line that repeats the last one."""
    from kvswap.integrations.vllm.host_report import StatsCadence, SyncLoadCounts

    now_s = [0.0]
    counts = SyncLoadCounts()
    cadence = StatsCadence(counts, clock=lambda: now_s[0], interval_s=10.0)
    now_s[0] = 11.0
    assert not cadence.due(counts)  # nothing moved since start
    counts.within_step += 1
    now_s[0] = 12.0
    assert cadence.changed(counts) and cadence.due(counts)
    assert not cadence.changed(counts)
    counts.between_steps += 1
    now_s[0] = 21.0
    assert not cadence.due(counts)  # moved, but within the interval of the last line
    now_s[0] = 22.0
    assert cadence.due(counts)
