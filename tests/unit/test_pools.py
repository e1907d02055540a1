"""The data plane's pools: exact sizes, shared views, NVMe slab checks and faults.

All pools are tiny (a few KiB per block, 4-8 slots)."""

from __future__ import annotations

import errno
import mmap
import os
import re
import stat
from pathlib import Path
from typing import Any

import pytest
import torch

from kvswap import host_memory as host_memory_module
from kvswap.data import host_pool as host_pool_module
from kvswap.data import pinned as pinned_module
from kvswap.data.device_pool import DevicePool
from kvswap.data.disk_pool import SLOT_ALIGN_BYTES, DiskPool, DiskSlotError
from kvswap.data.host_pool import HostPool
from kvswap.data.layout import KVLayout
from kvswap.data.pinned import PinnedBuffer
from kvswap.data.shared_file import SharedFile
from kvswap.errors import ConfigError, KvSwapError

BLOCK_BYTES = 8192  # a multiple of 4096: the O_DIRECT-eligible case


def random_bytes(num_bytes: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=generator)


def assert_one_line(exc: BaseException) -> None:
    assert "\n" not in str(exc)


# --- layout -------------------------------------------------------------------


def test_layout_of_an_8b_model_block_is_2_mib() -> None:
    layout = KVLayout(
        num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16, dtype=torch.float16
    )
    assert layout.block_shape == (32, 2, 16, 8, 128)
    assert layout.token_bytes == 131_072
    assert layout.block_bytes == 2 * 1024 * 1024


def test_layout_from_block_bytes_is_raw_uint8() -> None:
    layout = KVLayout.from_block_bytes(5000)
    assert layout.dtype == torch.uint8
    assert layout.block_bytes == 5000
    with pytest.raises(ConfigError, match="block_bytes"):
        KVLayout.from_block_bytes(4097)


def test_layout_rejects_a_zero_field_by_name() -> None:
    with pytest.raises(ConfigError, match="num_kv_heads"):
        KVLayout(num_layers=2, num_kv_heads=0, head_dim=8, block_tokens=4, dtype=torch.float16)


# --- device pool --------------------------------------------------------------


def test_device_pool_is_one_exact_tensor_with_views_into_it() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4, dtype=torch.float16)
    pool = DevicePool(layout, num_blocks=4, device="cpu")
    assert pool.configured_bytes == 4 * layout.block_bytes
    assert tuple(pool.kv.shape) == (4, *layout.block_shape)
    assert pool.kv.numel() * pool.kv.element_size() == pool.configured_bytes
    pool.byte_view(2).fill_(7)
    assert pool.kv[2].view(torch.uint8).eq(7).all()
    assert pool.kv[1].view(torch.uint8).eq(0).all()
    assert pool.block(2).data_ptr() == pool.byte_view(2).data_ptr()
    pool.check_integrity()
    with pytest.raises(ValueError, match="out of range"):
        pool.byte_view(4)
    rows = pool.host_byte_rows()  # the CPU copy path's numpy rows: the same memory
    assert rows is not None and rows.shape == (4, layout.block_bytes)
    assert rows[2].ctypes.data == pool.byte_view(2).data_ptr()
    assert DevicePool(layout, num_blocks=1, device="meta").host_byte_rows() is None


def test_device_pool_larger_than_memory_is_refused() -> None:
    layout = KVLayout.from_block_bytes(1 << 30)
    with pytest.raises(KvSwapError, match="device pool") as info:
        DevicePool(layout, num_blocks=1 << 20, device="cpu")  # 1 PiB
    assert_one_line(info.value)


# --- host pool ----------------------------------------------------------------


def test_host_pool_slots_are_exact_and_share_one_buffer() -> None:
    layout = KVLayout.from_block_bytes(BLOCK_BYTES)
    with HostPool(layout, num_slots=4) as pool:
        assert pool.configured_bytes == 4 * BLOCK_BYTES
        assert tuple(pool.slots.shape) == (4, *layout.block_shape)
        assert pool.is_pinned == torch.cuda.is_available()
        assert pool.base_address % SLOT_ALIGN_BYTES == 0
        # Populated at start-up: resident equals configured (a whole number of pages here).
        resident = pool.resident_bytes()
        assert resident is None or resident == pool.configured_bytes
        data = random_bytes(BLOCK_BYTES, seed=1)
        pool.byte_view(3).copy_(data)
        assert torch.equal(pool.slot(3).reshape(-1), data)
        assert pool.byte_view(3).data_ptr() == pool.base_address + 3 * BLOCK_BYTES
        pool.check_integrity()
        with pytest.raises(ValueError, match="out of range"):
            pool.slot(-1)
        rows = pool.byte_rows()  # the CPU copy path's numpy rows: the same buffer
        assert rows.shape == (4, BLOCK_BYTES)
        assert rows[3].ctypes.data == pool.byte_view(3).data_ptr()
        del rows  # a live view would keep the mapping after close
    assert pool.resident_bytes() == 0
    with pytest.raises(ValueError, match="closed"):
        pool.byte_rows()
    pool.close()  # twice is fine


def test_host_pool_larger_than_memory_is_refused_before_allocating(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_allocation(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the pinned buffer must not be allocated")

    monkeypatch.setattr(host_pool_module, "PinnedBuffer", no_allocation)
    layout = KVLayout.from_block_bytes(1 << 30)
    with pytest.raises(KvSwapError, match="host pool") as info:
        HostPool(layout, num_slots=1 << 20)  # 1 PiB
    assert_one_line(info.value)


# --- NVMe slab: set-up --------------------------------------------------------


def test_disk_pool_file_is_private_preallocated_and_removed_on_close(tmp_path: Path) -> None:
    pool = DiskPool(tmp_path, BLOCK_BYTES, num_slots=4)
    assert re.fullmatch(rf"kvswap-{os.getpid()}-[0-9a-f]+\.kvslab", pool.path.name)
    info = os.stat(pool.path)
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert info.st_size == pool.configured_bytes == 4 * BLOCK_BYTES
    assert pool.io_mode in ("direct", "buffered")
    assert pool.check_integrity() == ()
    pool.close()
    assert not pool.path.exists()
    pool.close()


def test_disk_pool_persist_keeps_the_file(tmp_path: Path) -> None:
    with DiskPool(tmp_path, BLOCK_BYTES, num_slots=2, persist=True) as pool:
        pool.write_slot(1, random_bytes(BLOCK_BYTES, seed=2))
    assert pool.path.exists()


def test_disk_pool_slots_are_4096_aligned(tmp_path: Path) -> None:
    with DiskPool(tmp_path, 5000, num_slots=3) as pool:
        assert pool.slot_stride_bytes == 8192
        assert pool.configured_bytes == 3 * 8192
        assert pool.io_mode == "buffered"  # 5000-byte blocks cannot use O_DIRECT


def test_missing_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(KvSwapError, match="does not exist") as info:
        DiskPool(tmp_path / "absent", BLOCK_BYTES, num_slots=4)
    assert_one_line(info.value)


def test_file_instead_of_directory_is_refused(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"x")
    with pytest.raises(KvSwapError, match="not a directory"):
        DiskPool(not_a_dir, BLOCK_BYTES, num_slots=4)


def test_unwritable_directory_is_refused_before_creating_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if os.geteuid() == 0:  # root ignores mode bits: make access() answer as for a user
        monkeypatch.setattr(os, "access", lambda path, mode: False)
    try:
        with pytest.raises(KvSwapError, match="not writable") as info:
            DiskPool(locked, BLOCK_BYTES, num_slots=4)
        assert_one_line(info.value)
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o700)


def test_too_little_free_space_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.statvfs(tmp_path)

    class TinyDisk:
        f_bavail = 1
        f_frsize = real.f_frsize

    monkeypatch.setattr(os, "statvfs", lambda path: TinyDisk())
    with pytest.raises(KvSwapError, match="free") as info:
        DiskPool(tmp_path, BLOCK_BYTES, num_slots=4)
    assert_one_line(info.value)
    assert list(tmp_path.iterdir()) == []


def test_preallocation_failure_is_refused_and_cleaned_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def disk_full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", disk_full)
    with pytest.raises(KvSwapError, match="ENOSPC"):
        DiskPool(tmp_path, BLOCK_BYTES, num_slots=4)
    assert list(tmp_path.iterdir()) == []


def test_unsupported_fallocate_falls_back_to_ftruncate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unsupported(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    with DiskPool(tmp_path, BLOCK_BYTES, num_slots=4) as pool:
        assert os.stat(pool.path).st_size == pool.configured_bytes


# --- NVMe slab: I/O -----------------------------------------------------------


@pytest.mark.parametrize("block_bytes", [BLOCK_BYTES, 5000])
def test_disk_round_trip_is_exact(tmp_path: Path, block_bytes: int) -> None:
    layout = KVLayout.from_block_bytes(block_bytes)
    with DiskPool(tmp_path, block_bytes, num_slots=4) as disk, HostPool(layout, 4) as host:
        for slot in range(4):
            host.byte_view(slot).copy_(random_bytes(block_bytes, seed=10 + slot))
        expected = host.slots.clone()
        for slot in range(4):
            disk.write_slot(3 - slot, host.byte_view(slot))
        host.slots.zero_()
        for slot in range(4):
            disk.read_slot(3 - slot, host.byte_view(slot))
        assert torch.equal(host.slots, expected)
        assert disk.check_integrity(verify_checksums=True) == ()


def test_disk_accepts_memoryviews_and_unaligned_buffers(tmp_path: Path) -> None:
    data = bytes(random_bytes(BLOCK_BYTES, seed=3).tolist())
    with DiskPool(tmp_path, BLOCK_BYTES, num_slots=2) as disk:
        disk.write_slot(0, memoryview(data))
        # One byte past an aligned start: O_DIRECT cannot take it, the buffered fd must.
        backing = bytearray(BLOCK_BYTES + 1)
        unaligned = memoryview(backing)[1:]
        disk.read_slot(0, unaligned)
        assert bytes(unaligned) == data
        if disk.io_mode == "direct":
            assert disk.num_buffered_fallback_ios >= 1
        with pytest.raises(ValueError, match="writable"):
            disk.read_slot(0, memoryview(data))
        with pytest.raises(ValueError, match="expected"):
            disk.write_slot(1, memoryview(data)[:100])
        with pytest.raises(ValueError, match="out of range"):
            disk.write_slot(2, memoryview(data))


def test_reading_a_never_written_slot_fails(tmp_path: Path) -> None:
    with DiskPool(tmp_path, BLOCK_BYTES, num_slots=2) as disk:
        with pytest.raises(DiskSlotError, match="never written") as info:
            disk.read_slot(1, bytearray(BLOCK_BYTES))
        assert info.value.slot == 1


def test_enospc_on_write_raises_a_slot_error_and_poisons_the_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with DiskPool(tmp_path, BLOCK_BYTES, num_slots=2) as disk:
        data = random_bytes(BLOCK_BYTES, seed=4)
        disk.write_slot(0, data)
        with monkeypatch.context() as patch:
            patch.setattr(os, "pwritev", _raise_oserror(errno.ENOSPC))
            with pytest.raises(DiskSlotError, match="ENOSPC") as info:
                disk.write_slot(0, random_bytes(BLOCK_BYTES, seed=5))
        assert info.value.slot == 0
        # The old bytes may be half-overwritten: the slot must not read back as good.
        assert not disk.is_written(0)
        with pytest.raises(DiskSlotError):
            disk.read_slot(0, bytearray(BLOCK_BYTES))
        disk.write_slot(0, data)  # the pool still works once the disk has room
        out = torch.empty(BLOCK_BYTES, dtype=torch.uint8)
        disk.read_slot(0, out)
        assert torch.equal(out, data)


def test_corrupted_slot_fails_its_checksum(tmp_path: Path) -> None:
    with DiskPool(tmp_path, BLOCK_BYTES, num_slots=3) as disk:
        for slot in range(3):
            disk.write_slot(slot, random_bytes(BLOCK_BYTES, seed=20 + slot))
        flip_byte(disk.path, 1 * disk.slot_stride_bytes + 123)
        with pytest.raises(DiskSlotError, match="checksum") as info:
            disk.read_slot(1, bytearray(BLOCK_BYTES))
        assert info.value.slot == 1
        assert disk.check_integrity(verify_checksums=True) == (1,)


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as slab:
        slab.seek(offset)
        value = slab.read(1)[0]
        slab.seek(offset)
        slab.write(bytes([value ^ 0xFF]))
        slab.flush()
        os.fsync(slab.fileno())


def _raise_oserror(code: int) -> Any:
    def fail(*args: Any, **kwargs: Any) -> int:
        raise OSError(code, os.strerror(code))

    return fail


# --- host memory pre-check: rlimits and cgroups ---------------------------------


def fake_cgroup(tmp_path: Path, proc_line: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A /sys/fs/cgroup tree and a /proc/self/cgroup file under tmp_path."""
    root = tmp_path / "cgroup"
    for relative, text in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(proc_line + "\n")
    return root, proc


def test_the_cgroup_v2_limit_binds_when_it_is_the_tightest(tmp_path: Path) -> None:
    root, proc = fake_cgroup(
        tmp_path,
        "0::/job",
        {
            "job/memory.max": "max\n",  # no limit here: the parent's applies
            "memory.max": str(64 << 20),
            "memory.current": str(48 << 20),
            "memory.stat": f"anon 1\ninactive_file {16 << 20}\n",
        },
    )
    memory = host_memory_module.host_memory(root, proc)
    # 64 MiB limit - (48 MiB used - 16 MiB reclaimable cache) = 32 MiB
    assert memory.available_bytes == 32 << 20
    assert "memory.max" in memory.limit


def test_the_cgroup_v1_limit_binds_and_v1_unlimited_is_ignored(tmp_path: Path) -> None:
    root, proc = fake_cgroup(
        tmp_path,
        "4:memory:/docker/abc",
        {
            "memory/docker/abc/memory.limit_in_bytes": str(1 << 63),  # "unlimited"
            "memory/docker/memory.limit_in_bytes": str(40 << 20),
            "memory/docker/memory.usage_in_bytes": str(8 << 20),
        },
    )
    memory = host_memory_module.host_memory(root, proc)
    assert memory.available_bytes == 32 << 20
    assert "memory.limit_in_bytes" in memory.limit


def test_a_binding_limit_is_named_in_the_one_line_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit = host_memory_module.HostMemory(1 << 20, "the address-space limit RLIMIT_AS (ulimit -v)")
    monkeypatch.setattr(host_memory_module, "host_memory", lambda: limit)
    with pytest.raises(KvSwapError, match="RLIMIT_AS") as info:
        HostPool(KVLayout.from_block_bytes(BLOCK_BYTES), num_slots=1024)
    assert_one_line(info.value)


def test_an_mmap_refused_by_the_kernel_is_a_one_line_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refuse)
    with pytest.raises(KvSwapError, match="ulimit -v") as info:
        PinnedBuffer(BLOCK_BYTES)
    assert_one_line(info.value)


def test_the_pinned_fill_goes_piece_by_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    pieces: list[int] = []
    monkeypatch.setattr(pinned_module, "FILL_CHUNK_BYTES", 2 * BLOCK_BYTES)
    monkeypatch.setattr(pinned_module, "_touch_pages", lambda piece: pieces.append(piece.numel()))
    with PinnedBuffer(5 * BLOCK_BYTES):
        assert pieces == [2 * BLOCK_BYTES, 2 * BLOCK_BYTES, BLOCK_BYTES]


def test_a_shared_buffer_is_one_file_for_two_parties_and_leaves_no_name(tmp_path: Path) -> None:
    path = tmp_path / "pool.host"
    first = PinnedBuffer(2 * BLOCK_BYTES, shared=SharedFile(path, "worker"))
    assert first.created_file and path.stat().st_size == 2 * BLOCK_BYTES + mmap.PAGESIZE
    second = PinnedBuffer(2 * BLOCK_BYTES, shared=SharedFile(path, "scheduler"))
    assert not second.created_file
    assert not path.exists()  # the second party mapped it: nobody else can open it
    first.tensor[BLOCK_BYTES:] = 7  # one set of pages: what one writes, the other reads
    assert int(second.tensor[BLOCK_BYTES:].sum()) == 7 * BLOCK_BYTES
    second.close()
    first.close()


def test_a_shared_buffer_nobody_joined_loses_its_name_at_close(tmp_path: Path) -> None:
    path = tmp_path / "pool.host"
    shared = SharedFile(path, "worker")
    with HostPool(KVLayout.from_block_bytes(BLOCK_BYTES), 2, shared=shared) as pool:
        assert path.exists() and pool.configured_bytes == 2 * BLOCK_BYTES
    assert not path.exists()


def test_a_shared_buffer_of_another_size_is_a_one_line_error(tmp_path: Path) -> None:
    path = tmp_path / "pool.host"
    with PinnedBuffer(2 * BLOCK_BYTES, shared=SharedFile(path, "worker")):
        with pytest.raises(KvSwapError, match="holds a pool of 16384 bytes, expected 8192") as info:
            PinnedBuffer(BLOCK_BYTES, shared=SharedFile(path, "scheduler"))
        assert_one_line(info.value)
