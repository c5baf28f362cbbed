"""Cold reads: ``Store.will_read`` asks the kernel to read a sequential reader's next pages
ahead (madvise WILLNEED), checked with a residency count (mincore) after eviction."""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import time

import pytest
import torch

from activationscope.data import ActivationDataset, SequentialBatchSampler
from activationscope.errors import StoreCorruptError
from activationscope.store import StoreWriter, open_store
from activationscope.store import reader
from activationscope.data import _source
from benchmark import pagecache


def _write(path, t: torch.Tensor, **options) -> None:
    w = StoreWriter(path, capture_config={}, model=None, storage_dtype=None, **options)
    arr = w.open_array("x", tuple(t.shape[1:]), t.dtype, "sample")
    for s in range(0, t.shape[0], 512):
        e = min(t.shape[0], s + 512)
        arr.append(t[s:e])
        w.add_batch(e - s, list(range(s, e)), None, {})
    w.close()


def _shards(path):
    return str(path / "acts" / "x" / "c")


def _cold_store(tmp_path, n_rows=8192, width=256, shard_bytes=1 << 20, name="s.zarr"):
    """``(rows, path)`` of a store of one array ``x`` (default 1 KiB rows: 8 MiB, shards of
    1 MiB) whose shard files are not in the page cache (skipped where they cannot be evicted)."""
    t = torch.randn(n_rows, width)
    path = tmp_path / name
    _write(path, t, shard_bytes=shard_bytes)
    pagecache.evict(_shards(path))
    if pagecache.resident(_shards(path))[0]:
        pytest.skip("this filesystem keeps the pages in memory (tmpfs?): no cold reads to test")
    return t, path


def _wait_resident(path, at_least: int, timeout_s: float = 20.0) -> int:
    end = time.monotonic() + timeout_s  # the kernel reads asynchronously
    while True:
        n = pagecache.resident(_shards(path))[0]
        if n >= at_least or time.monotonic() > end:
            return n
        time.sleep(0.02)


def test_will_read_starts_reading_the_rows_and_the_window_after_them(tmp_path, monkeypatch):
    monkeypatch.setattr(reader, "READ_AHEAD_BYTES", 4 << 20)
    _t, path = _cold_store(tmp_path)
    store = open_store(path)
    store.will_read("x", 0, 256)  # a first sequential batch: its rows and 4 MiB after them
    pages = _wait_resident(path, (4 << 20) // 4096)
    assert pages >= (4 << 20) // 4096
    assert pages < (8 << 20) // 4096  # not the whole array: a window


def test_random_reads_are_not_read_ahead(tmp_path, monkeypatch):
    monkeypatch.setattr(reader, "READ_AHEAD_BYTES", 4 << 20)
    _t, path = _cold_store(tmp_path)
    store = open_store(path)
    store.will_read("x", 6000, 6016)  # a jump: just those 16 KiB
    assert _wait_resident(path, 4) >= 4
    time.sleep(0.2)
    assert pagecache.resident(_shards(path))[0] < 256


def test_sequential_dataset_reads_hint_and_return_the_same_rows(tmp_path):
    t, path = _cold_store(tmp_path)
    ds = ActivationDataset(path)
    calls = []
    real = ds.store.will_read
    ds.store.will_read = lambda hp, a, b: (calls.append((a, b)), real(hp, a, b))[1]
    batches = list(SequentialBatchSampler(ds, batch_size=1000))
    got = torch.cat([ds.get_batch(b)["x"] for b in batches])
    assert torch.equal(got, t)
    assert calls[0] == (0, 1000)
    # the store says which rows its hint covers: batches inside them are not hinted again
    covered = real("x", 0, 1000)
    assert covered[0] == 0 and covered[1] > 1000
    assert all(a >= 1000 for a, _b in calls[1:]) and len(calls) < len(batches)


def test_a_source_whose_hint_returns_nothing_is_hinted_for_every_read(tmp_path):
    t, path = _cold_store(tmp_path)
    ds = ActivationDataset(path)
    calls = []
    ds.store.will_read = lambda hp, a, b: calls.append((a, b))  # returns None
    batches = list(SequentialBatchSampler(ds, batch_size=1000))
    got = torch.cat([ds.get_batch(b)["x"] for b in batches])
    assert torch.equal(got, t)
    assert calls == [(b.start, b.stop) for b in batches]


def test_a_warm_range_is_not_advised_again(tmp_path, monkeypatch):
    t, path = _cold_store(tmp_path)
    store = open_store(path)
    assert torch.equal(store["x"].clone(), t)  # every page now in the page cache
    advised = []
    monkeypatch.setattr(reader, "_madvise", lambda addr, n, advice: advised.append(n) or 0)
    store.will_read("x", 0, 256)
    assert advised == []
    monkeypatch.setattr(reader, "_resident", lambda page: False)  # as if evicted
    store2 = open_store(path)
    store2.will_read("x", 0, 256)
    assert advised and advised[0] > 0


def test_will_read_is_a_no_op_for_compressed_arrays_and_clips_ranges(tmp_path):
    t = torch.randn(300, 8)
    _write(tmp_path / "z.zarr", t, compression="zstd")
    store = open_store(tmp_path / "z.zarr")
    store.will_read("x", 0, 10_000)
    assert torch.equal(store["x"], t)
    _write(tmp_path / "r.zarr", t)
    store = open_store(tmp_path / "r.zarr")
    store.will_read("x", -5, 10_000)
    store.will_read("x", 200, 100)
    assert torch.equal(store["x"], t)


def _warm_store(tmp_path, monkeypatch, n_rows=16384):
    monkeypatch.setattr(reader, "READ_AHEAD_BYTES", 1 << 20)  # 1024 rows of 1 KiB
    t = torch.randn(n_rows, 256)
    path = tmp_path / "w.zarr"
    _write(path, t, shard_bytes=1 << 20)
    store = open_store(path)
    return t, store


def test_a_warm_window_grows_by_the_warm_rows_after_it(tmp_path, monkeypatch):
    t, store = _warm_store(tmp_path, monkeypatch)
    monkeypatch.setattr(reader, "_resident", lambda page: True)  # every page in the page cache
    # rows 0-256 and one read-ahead (1024 rows) after them, then three more read-aheads,
    # less half a read-ahead (where the next hint is due)
    assert store.will_read("x", 0, 256) == (0, 256 + 4 * 1024 - 512)
    assert store.will_read("x", 256, 512) == (256, 256 + 4 * 1024 - 512)  # inside it: nothing to do


def test_a_jump_on_a_warm_store_does_not_grow_a_window(tmp_path, monkeypatch):
    t, store = _warm_store(tmp_path, monkeypatch)
    probed = []
    monkeypatch.setattr(reader, "_resident", lambda page: probed.append(page) or True)
    assert store.will_read("x", 6000, 6016) == (6000, 6016)  # a jump: just its rows, as on a cold store
    assert len(probed) == 3  # the rows themselves only: no read-ahead after them is probed


def test_a_warm_window_stops_at_the_first_cold_read_ahead(tmp_path, monkeypatch):
    t, store = _warm_store(tmp_path, monkeypatch)
    base = store["x"].data_ptr()
    cold_from = base + (256 + 2 * 1024) * 1024  # rows from 2304 on are not in the page cache
    monkeypatch.setattr(reader, "_resident", lambda page: page < cold_from)
    assert store.will_read("x", 0, 256) == (0, 256 + 2 * 1024 - 512)


def test_a_cold_window_does_not_grow(tmp_path, monkeypatch):
    t, store = _warm_store(tmp_path, monkeypatch)
    advised = []
    monkeypatch.setattr(reader, "_madvise", lambda addr, n, advice: advised.append(n) or 0)
    monkeypatch.setattr(reader, "_resident", lambda page: False)
    assert store.will_read("x", 0, 256) == (0, 256 + 1024 - 512)
    assert advised == [(256 + 1024) * 1024]


def test_a_warm_window_ends_at_the_last_row(tmp_path, monkeypatch):
    t, store = _warm_store(tmp_path, monkeypatch, n_rows=2048)
    monkeypatch.setattr(reader, "_resident", lambda page: True)
    assert store.will_read("x", 0, 256) == (0, 2048)
    ds = ActivationDataset(store)
    got = torch.cat([b["x"] for b in (ds.get_batch(range(s, min(2048, s + 256))) for s in range(0, 2048, 256))])
    assert torch.equal(got, t)


def _damage(path, shard: int, how: str) -> None:
    f = path / "acts" / "x" / "c" / str(shard) / "0"
    if how == "missing":
        f.unlink()
    else:  # one bit of the shard index
        raw = bytearray(f.read_bytes())
        raw[-1] ^= 0x01
        f.write_bytes(bytes(raw))


@pytest.mark.parametrize("how", ["missing", "index"])
@pytest.mark.parametrize("shard", [1, 3])  # in the first read-ahead; in the warm rows after it
def test_a_damaged_shard_after_the_rows_read_does_not_fail_their_reads(tmp_path, monkeypatch, shard, how):
    """The read-ahead (and the warm rows a window takes in) lie past the rows read: a hint
    for them must not raise for a shard the reader does not read (shards of 9 rows, not
    page-aligned: each mapped alone, as the hint reaches it)."""
    monkeypatch.setattr(reader, "READ_AHEAD_BYTES", 9 * 64)  # one shard of 9 rows of 64 bytes
    monkeypatch.setattr(reader, "_resident", lambda page: True)  # a warm store
    t = torch.randn(90, 16)
    path = tmp_path / "d.zarr"
    _write(path, t, chunk_rows=3, shard_rows=9)
    _damage(path, shard, how)
    store = open_store(path)
    lo, hi = store.will_read("x", 0, 3)
    assert lo == 0 and hi >= 3
    ds = ActivationDataset(store, rows=range(0, 9))
    for _epoch in range(2):
        got = torch.cat([ds.__getitems__(range(a, a + 3)).data["x"] for a in range(0, 9, 3)])
        assert torch.equal(got, t[:9])
    with pytest.raises(StoreCorruptError):  # the damaged rows themselves still say so
        store.rows("x", 9 * shard, 9 * shard + 1)


def test_a_refresh_forgets_the_rows_hinted_before_it(tmp_path, monkeypatch):
    """After another run was written in the store's place and the store refreshed, the rows
    hinted for the old run are not taken as hinted: the range a hint returns ends at the new
    run's last row, and the new run's (cold) rows are hinted."""
    monkeypatch.setattr(reader, "READ_AHEAD_BYTES", 64 << 10)  # 64 rows of 1 KiB
    path = tmp_path / "o.zarr"
    _write(path, torch.randn(3000, 256))
    store = open_store(path)
    assert store.will_read("x", 0, 3000) == (0, 3000)  # (a reader of every row)
    _write(path, torch.randn(100, 256), overwrite=True)
    store.refresh()
    lo, hi = store.will_read("x", 0, 10)
    assert lo == 0 and 10 <= hi <= 100
    _write(path, torch.randn(5000, 256), overwrite=True)
    store.refresh()
    advised = []
    monkeypatch.setattr(reader, "_madvise", lambda addr, n, advice: advised.append(n) or 0)
    monkeypatch.setattr(reader, "_resident", lambda page: False)  # the new run's files: cold
    lo, hi = store.will_read("x", 0, 10)
    assert advised and advised[0] >= 10 * 1024
    assert lo == 0 and 10 <= hi <= 5000


@pytest.mark.parametrize("layout", [dict(chunk_rows=4, shard_rows=16), dict(chunk_rows=3, shard_rows=9)])
def test_warm_windows_of_a_dataset_of_some_rows_of_a_growing_store(tmp_path, monkeypatch, layout):
    """Sequential batches sliced from warm windows (one read-ahead of 5 rows, three more
    taken in) hold the dataset's rows and no others: not past its last row, nor past the
    rows committed when it was made, before and after the store grows and is refreshed."""
    monkeypatch.setattr(reader, "READ_AHEAD_BYTES", 5 * 64)
    monkeypatch.setattr(reader, "_resident", lambda page: True)
    t = torch.randn(200, 16)
    path = tmp_path / "g.zarr"

    def append(first, stop, **options):
        w = StoreWriter(path, capture_config={}, model=None, storage_dtype=None, **layout, **options)
        w.open_array("x", (16,), torch.float32, "sample").append(t[first:stop])
        w.add_batch(stop - first, list(range(first, stop)), None, {})
        w.close()

    append(0, 70)
    store = open_store(path)

    def epoch(ds, bs):
        return torch.cat([ds.__getitems__(range(a, min(len(ds), a + bs))).data["x"].clone()
                          for a in range(0, len(ds), bs)])

    some, every = ActivationDataset(store, rows=range(5, 61)), ActivationDataset(store)
    for bs in (3, 7, 3):
        assert torch.equal(epoch(some, bs), t[5:61]) and torch.equal(epoch(every, bs), t[:70])
    some.__getitems__(range(50, 53))
    for a, b in [(54, 57), (55, 57), (53, 58)]:  # the window holds rows after its last: not its
        with pytest.raises(IndexError):
            some.__getitems__(range(a, b))
    append(70, 200, resume=True)
    assert torch.equal(epoch(every, 4), t[:70])  # not refreshed: the rows it was made with
    store.refresh()
    grown = ActivationDataset(store, rows=range(60, 190))
    for bs in (3, 11):
        assert torch.equal(epoch(every, bs), t[:70]) and torch.equal(epoch(some, bs), t[5:61])
        assert torch.equal(epoch(grown, bs), t[60:190])
        assert torch.equal(epoch(ActivationDataset(store), bs), t)


@pytest.mark.filterwarnings("ignore:.*sample id 0 was recorded more than once")
def test_a_hint_given_while_another_thread_refreshes_is_not_kept_for_the_new_commit(tmp_path, monkeypatch):
    path = tmp_path / "s.zarr"
    t = torch.randn(1000, 256)
    _write(path, t[:600])  # one shard (1 KiB rows), part-filled
    store = open_store(path)
    store.will_read("x", 0, 100)  # a sequential reader: rows 0-99 and the read-ahead after them
    _write(path, t[600:], resume=True)  # a resume rewrites the last shard (a new file) and grows it

    class RefreshedMeanwhile(dict):  # another thread's refresh() lands inside this hint
        def get(self, *args):
            got = super().get(*args)
            if not fired:
                fired.append(True)
                store.refresh()
            return got

    fired = []

    store._advised = RefreshedMeanwhile(store._advised)
    store.will_read("x", 100, 200)
    hinted = []
    monkeypatch.setattr(reader, "_will_need", lambda addr, nbytes: hinted.append(nbytes) or False)
    assert store.n_rows("x") == 1000
    store.will_read("x", 200, 300)  # the rows of the new commit's files were never hinted: hinted now
    assert fired and sum(hinted) == (1000 - 200) * 1024  # (its rows and the read-ahead after them)
    assert torch.equal(store.rows("x", 0, 1000), t)


def _cold_wide_store(tmp_path, n_rows=2048):
    return _cold_store(tmp_path, n_rows, width=4096, shard_bytes=4 << 20, name="w.zarr")  # 16 KiB rows: 32 MiB


def _gathered(ds, idx, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return ds.get_batch(idx)["x"]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_shuffled_batch_of_a_cold_store_larger_than_memory_reads_its_rows_and_not_the_pages_around_them(
        tmp_path, monkeypatch, threads):
    """A gathered batch (shuffled sampler) of cold rows of a store larger than memory is read
    as those rows (madvise WILLNEED per row, all in flight at once), not by page faults that
    each read the device's read-ahead around the row (128 KiB to 8 MiB a fault: a batch of 64
    rows of 16 KiB read the whole 32 MiB array). Both copy paths: one thread (row copies) and
    two (index_select)."""
    monkeypatch.setattr(_source, "_memory_bytes", lambda: 32 << 20)  # (the store: 32 MiB)
    t, path = _cold_wide_store(tmp_path)
    ds = ActivationDataset(path)
    idx = torch.randperm(len(ds), generator=torch.Generator().manual_seed(0))[:64].tolist()
    assert torch.equal(_gathered(ds, idx, threads), t[idx])
    rows_pages = len(idx) * (4 + 1)  # each row's 4 pages, one more where it straddles a page
    assert rows_pages // 2 <= pagecache.resident(_shards(path))[0] <= 2 * rows_pages


@pytest.mark.parametrize("threads", [1, 2])
def test_a_shuffled_batch_of_a_cold_store_that_fits_in_memory_reads_the_blocks_around_its_rows(
        tmp_path, monkeypatch, threads):
    """A store that fits in memory: the blocks of GATHER_HINT_BLOCK bytes around each cold row
    (an epoch reads every row: fewer, larger reads), and no more."""
    monkeypatch.setattr(_source, "_memory_bytes", lambda: 1 << 40)
    t, path = _cold_wide_store(tmp_path)
    ds = ActivationDataset(path)
    idx = torch.randperm(len(ds), generator=torch.Generator().manual_seed(0))[:8].tolist()
    assert torch.equal(_gathered(ds, idx, threads), t[idx])
    block_pages = _source.GATHER_HINT_BLOCK // 4096
    # every page of each row's block is read (the kernel's own read-around of a fault, 128 KiB
    # on many disks, or a smaller block would leave some out), and not much more
    blocks = _row_blocks(ds, "x", idx, _source.GATHER_HINT_BLOCK)
    end = time.monotonic() + 20.0  # (the kernel reads asynchronously)
    while not all(_all_resident(a, b) for a, b in blocks) and time.monotonic() < end:
        time.sleep(0.02)
    assert all(_all_resident(a, b) for a, b in blocks)
    assert pagecache.resident(_shards(path))[0] <= len(idx) * (block_pages + 5)


def _row_blocks(ds, hp, idx, block):
    """The address ranges the gather asks the kernel for around rows ``idx`` of ``hp``: each
    row's aligned block of ``block`` bytes in the mapping, clipped to the row's segment."""
    src = ds.source
    bl, segs = src._layout(hp)[3], src._seg_lists[hp]
    out = []
    for r in idx:
        k = bisect.bisect_right(bl, r) - 1
        seg = segs[k]
        rb = seg[0].numel() * seg.element_size()
        base = seg.data_ptr()
        a = base + (r - bl[k]) * rb
        lo = max(a & ~(block - 1), base & ~(mmap.PAGESIZE - 1))
        hi = min((a + rb + block - 1) & ~(block - 1), base + seg.shape[0] * rb)
        out.append((lo, hi))
    return out


def _all_resident(lo, hi):
    """Whether every page of addresses [lo, hi) of this process's mappings is in memory."""
    n = -(-(hi - lo) // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * n)()
    assert pagecache._libc.mincore(lo, n * mmap.PAGESIZE, vec) == 0
    return all(v & 1 for v in vec)


def test_gather_hint_block_is_a_block_for_an_array_that_fits_in_memory_else_rows(monkeypatch):
    monkeypatch.setattr(_source, "_memory_bytes", lambda: 1000)
    assert _source.gather_hint_block(500) == _source.GATHER_HINT_BLOCK
    assert _source.gather_hint_block(501) == 0


def test_a_shuffled_batch_of_a_warm_store_reads_the_same_rows(tmp_path):
    """After a first epoch (warm pages) and with some rows evicted since, every batch has the
    stored rows."""
    t, path = _cold_wide_store(tmp_path, n_rows=512)
    ds = ActivationDataset(path)
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(1)).tolist()
    for s in range(0, len(order), 100):
        assert torch.equal(ds.get_batch(order[s:s + 100])["x"], t[order[s:s + 100]])
    pagecache.evict(_shards(path))  # (pages this process maps stay: some rows warm, some cold)
    for s in range(0, len(order), 100):
        assert torch.equal(ds.get_batch(order[s:s + 100])["x"], t[order[s:s + 100]])


def test_the_hint_block_of_a_hook_point_is_worked_out_once_not_per_shuffled_batch(tmp_path, monkeypatch):
    """get_batch of positions (a dataset with columns or several hook points in a DataLoader
    reads every batch that way) works out the gather's hint_block once per hook point and
    store commit, not in each batch (it asks the store for the row shape and dtype and the
    system for its memory: microseconds of Python a batch); a refresh works it out again."""
    calls = []
    monkeypatch.setattr(_source, "_memory_bytes", lambda: calls.append(1) or 1 << 40)
    t = torch.randn(256, 64)
    path = tmp_path / "h.zarr"
    _write(path, t)
    ds = ActivationDataset(path)
    for s in range(10):
        idx = torch.randperm(256, generator=torch.Generator().manual_seed(s))[:32].tolist()
        assert torch.equal(ds.get_batch(idx)["x"], t[idx])
    assert len(calls) == 1
    ds.source.store.refresh()
    assert torch.equal(ds.get_batch([3, 1, 2])["x"], t[[3, 1, 2]])
    assert len(calls) == 2


def test_a_warm_array_is_checked_for_cold_pages_in_ever_fewer_batches_and_a_cold_one_in_each():
    """The gather's state of an array (``hint`` [block, skip, streak]): after warm batches in a
    row the next 1, 3, 7, ... up to 63 are taken as warm unchecked (a warm epoch costs one
    residency check in 64 batches); a cold batch starts over."""
    from activationscope.capture import _native

    gather = _native.load().gather_rows
    seg = torch.randn(1000, 8)  # anonymous memory just written: resident
    hint = torch.tensor([0, 0, 0], dtype=torch.int64)
    states = []
    for _ in range(12):
        rows, a, b, _ids = gather([5, 1, 700], 1000, 0, [0, 1000], [seg], False, None, hint)
        assert torch.equal(rows, seg[[5, 1, 700]]) and a == b == -1
        states.append(tuple(hint[1:].tolist()))
    assert states == [(1, 1), (0, 1), (3, 3), (2, 3), (1, 3), (0, 3), (7, 7), (6, 7), (5, 7), (4, 7), (3, 7), (2, 7)]
    hint[1:] = torch.tensor([0, 63])
    gather([5, 1], 1000, 0, [0, 1000], [seg], False, None, hint)
    assert hint[1:].tolist() == [63, 63]  # (at most 63)
    for bad in (torch.zeros(3, dtype=torch.int32), torch.zeros(4, dtype=torch.int64), "0"):  # not a hint: none
        rows, *_ = gather([5, 1], 1000, 0, [0, 1000], [seg], False, None, bad)
        assert torch.equal(rows, seg[[5, 1]])
    for streak in (2**62, -5):  # any state a caller left: clipped, never overflowing
        hint[1:] = torch.tensor([0, streak])
        gather([5, 1], 1000, 0, [0, 1000], [seg], False, None, hint)
        assert hint[1:].tolist() == [63, 63] if streak > 0 else [1, 1]
    for block in (2**70, -(2**70), 2**63 - 1):  # an int beyond int64: clipped, not a TypeError
        rows, *_ = gather([5, 1], 1000, 0, [0, 1000], [seg], False, None, block)
        assert torch.equal(rows, seg[[5, 1]])


def test_a_cold_batch_resets_the_warm_streak(tmp_path):
    t, path = _cold_wide_store(tmp_path, n_rows=512)
    ds = ActivationDataset(path)
    assert torch.equal(ds.get_batch([3, 400, 100])["x"], t[[3, 400, 100]])  # cold: hinted, read
    hint = ds.source._hints["x"]
    assert hint[1:].tolist() == [0, 0]
    assert torch.equal(ds.get_batch([3, 400, 100])["x"], t[[3, 400, 100]])  # warm now
    assert hint[1:].tolist() == [1, 1]


def test_memory_is_the_containers_limit_when_lower(tmp_path, monkeypatch):
    v2 = tmp_path / "memory.max"
    monkeypatch.setattr(_source, "_CGROUP_MEMORY_LIMITS", (str(v2), str(tmp_path / "missing")))
    machine = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    v2.write_text("max\n")  # no limit: the machine's memory
    total = _source._memory_bytes()
    assert total == machine
    v2.write_text(f"{1 << 20}\n")
    assert _source._memory_bytes() == 1 << 20
    v2.write_text(f"{total * 4}\n")  # a limit above the machine's memory: the machine's
    assert _source._memory_bytes() == total


def _write_two(path, a: torch.Tensor, b: torch.Tensor, **options) -> None:
    w = StoreWriter(path, capture_config={}, model=None, storage_dtype=None, shard_bytes=1 << 14, **options)
    arrs = {"a": w.open_array("a", tuple(a.shape[1:]), a.dtype, "sample"),
            "b": w.open_array("b", tuple(b.shape[1:]), b.dtype, "sample")}
    for s in range(0, a.shape[0], 100):
        e = min(a.shape[0], s + 100)
        arrs["a"].append(a[s:e])
        arrs["b"].append(b[s:e])
        w.add_batch(e - s, list(range(s, e)), None, {})
    w.close()


@pytest.mark.parametrize("idx", [[5, 1, 700], [7, 8, 9], range(7, 10)])
def test_a_batch_of_several_hook_points_read_while_another_thread_refreshes_an_overwritten_store_is_one_runs(
        tmp_path, monkeypatch, idx):
    """Another thread's ``store.refresh()`` between the reads of a batch's hook points (a
    shuffled batch: the gather of the first, then the others) once the store was overwritten
    by another run: the batch was the old run's first hook point and the new run's others,
    silently. Now it is one run's rows, or the StoreError of a dataset of another run."""
    from activationscope.errors import StoreError

    old = (torch.randn(1000, 8), torch.randint(0, 255, (1000, 1), dtype=torch.uint8))
    new = (torch.randn(1000, 8), torch.randint(0, 255, (1000, 1), dtype=torch.uint8))
    path = tmp_path / "s.zarr"
    _write_two(path, *old)
    ds = ActivationDataset(path)
    assert ds.hook_points == ["a", "b"]
    store = ds.source.store
    for batch in ([5, 1, 700], [7, 8, 9]):  # (the old run's layouts, cached)
        assert torch.equal(ds.get_batch(batch)["b"], old[1][batch])
    _write_two(path, *new, overwrite=True)  # another capture's run in its place (not refreshed yet)
    source = type(ds.source)
    seen = []

    def refreshed_between(method):
        def call(self, hp, *args):
            if hp == "b" and not seen:
                seen.append(hp)
                store.refresh()  # (another thread, between the hook points)
            return method(self, hp, *args)
        return call

    for name in ("gather", "read", "take"):
        monkeypatch.setattr(source, name, refreshed_between(getattr(source, name)))
    try:
        got = ds.__getitems__(idx).data if type(idx) is range else ds.get_batch(idx)  # (range: a sequential sampler's)
    except StoreError as e:
        assert "another run" in str(e) or "was replaced since it was opened" in str(e)
    else:
        one_run = torch.equal(got["a"], old[0][list(idx)]) and torch.equal(got["b"], old[1][list(idx)])
        assert seen and one_run


def test_a_batch_read_while_another_thread_refreshes_a_store_being_overwritten_says_another_run(tmp_path, monkeypatch):
    """The same, while the other run is still being written (no hook point yet): the batch
    raised HookPointNotFoundError ("it has []") for its second hook point; now the StoreError
    of a dataset of another run."""
    from activationscope.errors import StoreError

    old = (torch.randn(1000, 8), torch.randint(0, 255, (1000, 1), dtype=torch.uint8))
    path = tmp_path / "s.zarr"
    _write_two(path, *old)
    ds = ActivationDataset(path)
    store = ds.source.store
    assert torch.equal(ds.get_batch([5, 1, 700])["b"], old[1][[5, 1, 700]])
    w = StoreWriter(path, capture_config={}, model=None, storage_dtype=None, overwrite=True)
    try:
        source = type(ds.source)
        gather = source.gather

        def refreshed_between(self, hp, *args):
            if hp == "b":
                store.refresh()  # (another thread, between the hook points)
            return gather(self, hp, *args)

        monkeypatch.setattr(source, "gather", refreshed_between)
        with pytest.raises(StoreError, match="another run"):
            ds.get_batch([5, 1, 700])
    finally:
        w.close()


def test_a_hint_over_small_shards_advises_a_bounded_number_of_them(tmp_path, monkeypatch):
    # an array read per shard is advised one shard at a time: a window of READ_AHEAD_BYTES of
    # 4 KiB shards walked every shard of the array at each hinted read (milliseconds per row of
    # a dataset read in random order)
    monkeypatch.setattr(reader, "_MAP_BUDGET", 64)  # (the store's 200 shards do not fit: read per shard)
    t = torch.randn(3200, 64)
    path = tmp_path / "s.zarr"
    _write(path, t, shard_rows=16, chunk_rows=16)  # 200 shards of 4 KiB
    advised: list[int] = []
    monkeypatch.setattr(reader, "_will_need", lambda addr, nbytes: advised.append(nbytes) or False)
    store = open_store(path)
    calls, lo, hi = [], 1, 0
    for s in range(0, 3200, 16):  # a sequential reader, hinting as ActivationDataset does
        if not (lo <= s and s + 16 <= hi):
            n = len(advised)
            lo, hi = store.will_read("x", s, s + 16)
            calls.append(len(advised) - n)
    assert max(calls) <= reader.READ_AHEAD_SHARDS + 1
    assert sum(advised) >= 3200 * 256  # every row advised once it is read
    assert torch.equal(store["x", 0:3200], t)
