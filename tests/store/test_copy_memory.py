"""``store[hook_point]`` of an array that is no view (more shards than the mapping budget,
``reader._MAP_BUDGET``, or compressed) is one copy of all its rows. A copy larger than the
memory available was killed by the out-of-memory killer; it now raises StoreError before
anything is allocated, naming the hook point, the size and the fixes. The budget and the
available memory are patched small: no large allocation here."""

from __future__ import annotations

import pytest
import torch

import activationscope as acs
from activationscope.capture import _native
from activationscope.errors import StoreError
from activationscope.store import reader as R

ROWS, SHARD_ROWS, D = 80, 16, 64  # 5 shards of 16 rows of 64 float32 (4 KiB a shard row block)


def _capture(path, compression=None):
    torch.manual_seed(0)
    model = torch.nn.Linear(D, D)
    xs = [torch.randn(8, D) for _ in range(ROWS // 8)]
    opts = {"chunk_rows": SHARD_ROWS, "shard_rows": SHARD_ROWS, "compression": compression}
    with torch.no_grad(), acs.ActivationScope(store=str(path), store_options=opts).track(model):
        for x in xs:
            model(x)
    with torch.no_grad():
        return model(torch.cat(xs))


@pytest.mark.parametrize("layout", ["per-shard", "compressed"])
def test_a_copy_larger_than_available_memory_raises(tmp_path, monkeypatch, layout):
    ref = _capture(tmp_path / "s.zarr", compression="zstd" if layout == "compressed" else None)
    monkeypatch.setattr(R, "_MAP_BUDGET", 2)  # fewer mappings than the array's 5 shards: no single view
    monkeypatch.setattr(R, "_COPY_CHECK_BYTES", 0)  # (every copy checked, however small)
    st = acs.open_store(tmp_path / "s.zarr")
    nbytes = ROWS * D * 4
    monkeypatch.setattr(R, "_available_memory_bytes", lambda: nbytes // 2)
    with pytest.raises(StoreError) as e:
        st["output"]
    msg = str(e.value)
    assert "'output'" in msg and f"{nbytes} bytes" in msg and f"{nbytes // 2} bytes available" in msg
    assert "store['output', a:b]" in msg and "ActivationDataset" in msg
    assert ("compressed" in msg) == (layout == "compressed")
    if layout == "per-shard":  # (the budget keeps the shards from one view: its fixes)
        assert "shard_bytes" in msg and "vm.max_map_count" in msg
    else:  # (no view of a compressed array, whatever its shards: their fixes would not help)
        assert "'compression': None" in msg and "vm.max_map_count" not in msg and "shard_bytes" not in msg
    # a slice that fits is read, with its values; so is the whole array once memory allows it
    assert torch.equal(st["output", 0:30], ref[0:30])
    monkeypatch.setattr(R, "_available_memory_bytes", lambda: nbytes * 2)
    assert torch.equal(st["output"], ref)


@pytest.mark.parametrize("cause", ["no native extension", "shards not whole pages"])
def test_the_refusal_names_why_the_shards_are_no_view(tmp_path, monkeypatch, cause):
    """Shards within the mapping budget that are still read as a copy: the message names why
    (the native extension that maps them back to back is absent; a shard's rows are not a whole
    number of memory pages), never the budget or vm.max_map_count, which would not help."""
    d = D if cause == "no native extension" else D - 16  # (16 rows of 48 float32: 3 KiB, no whole page)
    torch.manual_seed(0)
    model = torch.nn.Linear(d, d)
    opts = {"chunk_rows": SHARD_ROWS, "shard_rows": SHARD_ROWS, "compression": None}
    with torch.no_grad(), acs.ActivationScope(store=str(tmp_path / "s.zarr"), store_options=opts).track(model):
        for _ in range(ROWS // 8):
            model(torch.randn(8, d))
    if cause == "no native extension":
        monkeypatch.setattr(_native, "optional", lambda: None)
    monkeypatch.setattr(R, "_COPY_CHECK_BYTES", 0)
    monkeypatch.setattr(R, "_available_memory_bytes", lambda: 1024)
    st = acs.open_store(tmp_path / "s.zarr")
    with pytest.raises(StoreError) as e:
        st["output"]
    msg = str(e.value)
    assert "'output'" in msg and f"{ROWS * d * 4} bytes" in msg and "ActivationDataset" in msg
    assert "budget" not in msg and "vm.max_map_count" not in msg, msg
    if cause == "no native extension":
        assert "native extension" in msg, msg
    else:
        assert "whole number of memory pages" in msg and "shard_rows" in msg, msg


@pytest.mark.skipif(_native.optional() is None, reason="needs the native extension (shards mapped back to back)")
def test_a_view_is_never_refused(tmp_path, monkeypatch):
    """A view copies nothing: the whole array mapped back to back reads whatever the memory."""
    ref = _capture(tmp_path / "s.zarr")
    st = acs.open_store(tmp_path / "s.zarr")
    monkeypatch.setattr(R, "_COPY_CHECK_BYTES", 0)
    monkeypatch.setattr(R, "_available_memory_bytes", lambda: 1)
    got = st["output"]
    assert torch.equal(got, ref)
    assert st._span_is_view("output", 0, ROWS)


def test_a_copy_below_the_check_size_does_not_read_the_available_memory(tmp_path, monkeypatch):
    """Reads smaller than ``_COPY_CHECK_BYTES`` (here all of them) are read without opening
    /proc/meminfo: a batch read pays no file read for the check."""
    ref = _capture(tmp_path / "s.zarr", compression="zstd")

    def unread():
        raise AssertionError("MemAvailable read for a small copy")

    monkeypatch.setattr(R, "_available_memory_bytes", unread)
    st = acs.open_store(tmp_path / "s.zarr")
    assert torch.equal(st["output"], ref) and torch.equal(st["output", 3:9], ref[3:9])


def test_available_memory_is_read_from_meminfo():
    got = R._available_memory_bytes()
    try:
        with open("/proc/meminfo") as f:
            line = next(line for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        assert got is None
        return
    assert got is not None and abs(got - int(line.split()[1]) * 1024) < (1 << 30)
