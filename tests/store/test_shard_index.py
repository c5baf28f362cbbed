"""The shard index check: the one-compare path for the dense layout every uncompressed
capture writes agrees with the per-chunk check, and never accepts what that check refuses."""

from __future__ import annotations

import pytest

from activationscope.errors import StoreCorruptError
from activationscope.store import open_store
from activationscope.store import reader as reader_mod

from hostile import CHUNK_ROWS, FEATURE, HP, N_ROWS, SHARD_ROWS, make_store, set_index, shard

N_SHARDS = -(-N_ROWS // SHARD_ROWS)


def _indexes(path, monkeypatch=None, dense=True):
    if not dense:  # no template ever matches: every shard takes the per-chunk check
        monkeypatch.setattr(reader_mod, "_dense_index", lambda *a: (b"", ()))
    s = open_store(path)
    meta = s._meta(HP)
    return [s._shard_index(meta, k) for k in range(N_SHARDS)]


@pytest.mark.parametrize("n_rows", [N_ROWS, N_ROWS - 24])  # whole shards; a last shard of 2 committed chunks
def test_dense_index_equals_the_per_chunk_check(tmp_path, monkeypatch, n_rows):
    path = tmp_path / "s.zarr"
    data = make_store(path, n_rows=n_rows)
    fast = _indexes(path)
    slow = _indexes(path, monkeypatch, dense=False)
    assert [(i.key, i.file_bytes, i.entries, i.contiguous, i.bad) for i in fast] == \
           [(i.key, i.file_bytes, i.entries, i.contiguous, i.bad) for i in slow]
    chunk_bytes = CHUNK_ROWS * FEATURE * 4
    assert fast[0].entries == tuple((j * chunk_bytes, chunk_bytes) for j in range(SHARD_ROWS // CHUNK_ROWS))
    assert all(i.contiguous and not i.bad for i in fast)
    monkeypatch.undo()
    assert open_store(path)[HP].equal(data)


def test_index_past_the_data_is_not_taken_as_dense(tmp_path):
    """A shard cut short and given back its (valid, dense) index: the committed chunks would lie
    past the end of its data, so the per-chunk check runs and names the chunk."""
    path = tmp_path / "s.zarr"
    make_store(path)
    f = shard(path, 1)
    raw = f.read_bytes()
    n_chunks = SHARD_ROWS // CHUNK_ROWS
    index = raw[-(16 * n_chunks + 4):]
    chunk_bytes = CHUNK_ROWS * FEATURE * 4
    f.write_bytes(raw[: (n_chunks - 1) * chunk_bytes] + index)  # the last chunk's bytes are gone
    s = open_store(path)
    with pytest.raises(StoreCorruptError, match=r"chunk 7 .*points past the end of the chunk data"):
        s.rows(HP, SHARD_ROWS + 3 * CHUNK_ROWS, SHARD_ROWS + 3 * CHUNK_ROWS + 1)
    assert s.rows(HP, SHARD_ROWS, SHARD_ROWS + 1).shape == (1, FEATURE)  # the shard's other chunks stay readable


def test_moved_chunk_is_not_taken_as_dense(tmp_path):
    path = tmp_path / "s.zarr"
    data = make_store(path)
    chunk_bytes = CHUNK_ROWS * FEATURE * 4
    set_index(path, 0, 1, 0, chunk_bytes)  # slot 1 points at slot 0's bytes
    idx = _indexes(path)[0]
    assert not idx.contiguous
    assert idx.entries[1] == (0, chunk_bytes)
    s = open_store(path)
    with pytest.raises(StoreCorruptError, match=r"chunk 1 .*crc32c mismatch"):  # checked, not mapped
        s.rows(HP, CHUNK_ROWS, CHUNK_ROWS + 1)
    assert s.rows(HP, 0, 1).equal(data[0:1])


def test_shards_of_many_chunks_take_the_per_chunk_check(tmp_path, monkeypatch):
    path = tmp_path / "s.zarr"
    data = make_store(path)
    monkeypatch.setattr(reader_mod, "_DENSE_MAX_CHUNKS", SHARD_ROWS // CHUNK_ROWS - 1)
    calls = []
    monkeypatch.setattr(reader_mod, "_dense_index", lambda *a: calls.append(a))
    assert all(i.contiguous and not i.bad for i in _indexes(path))
    assert calls == []
    assert open_store(path)[HP].equal(data)


def _closed_store(path, compression, n_rows=78):
    """A closed store of ``n_rows`` of 100 random rows of 64 floats (16-row shards of 4-row
    chunks: its last shard is partial); returns (the 100 rows, the writer options)."""
    import torch

    from activationscope.store import StoreWriter

    x = torch.randn(100, 64, generator=torch.Generator().manual_seed(1))
    opts = {"chunk_rows": 4, "shard_rows": 16, "compression": compression}
    w = StoreWriter(path, **opts)
    w.open_array(HP, (64,), torch.float32, "sample").append(x[:n_rows])
    w.add_batch(n_rows)
    w.close()
    return x, opts


def _killed_after_rename(path, killed, x, opts, start, stop):
    """Resume the store at ``path`` with rows ``start..stop`` of ``x`` and commit (shard 4's
    rewrite is written, not yet renamed); copy the store to ``killed`` as a resume killed right
    after renaming that rewrite over the key, before the manifest and root, leaves it. Returns
    the resume's writer (still open on ``path``)."""
    import os
    import shutil

    import torch

    from activationscope.store import StoreWriter

    w = StoreWriter(path, resume=True, **opts)
    w.open_array(HP, (64,), torch.float32, "sample").append(x[start:stop])
    w.add_batch(stop - start)
    w.commit()
    held = shard(path, 4).with_name(shard(path, 4).name + ".resumed.tmp")
    _wait_for(held)
    shutil.copytree(path, killed, symlinks=True)
    os.replace(shard(killed, 4).with_name(held.name), shard(killed, 4))  # the rewrite installed, root not written
    return w


def _wait_for(path, timeout=30.0):
    import time

    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:  # the writer thread writes it
        time.sleep(0.01)
    assert path.exists(), f"{path} was never written"


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_running_resume_leaves_the_committed_last_shard_as_it_is_until_its_commit(tmp_path, compression):
    """FORMAT.md section 7: the shard that holds the last committed rows is rewritten by a
    resume that appends to it, under ``<key>.resumed.tmp``; the committed file keeps its key,
    bytes and checksums until the commit that lists the new one renames it over the key. A
    verifying reader and verify() see the committed store clean the whole time."""
    import torch

    from activationscope.store import StoreWriter

    path = tmp_path / "s.zarr"
    x, opts = _closed_store(path, compression)
    w = StoreWriter(path, resume=True, **opts)
    shard4 = shard(path, 4)  # rows 64-79; 78 committed
    before = shard4.read_bytes()
    w.open_array(HP, (64,), torch.float32, "sample").append(x[78:87])  # completes shard 4
    w.add_batch(9)
    w.commit()  # not the forward: its rows 80-86 are not durable yet
    held = shard4.with_name(shard4.name + ".resumed.tmp")
    _wait_for(held)
    assert shard4.read_bytes() == before  # the committed file, untouched
    s = open_store(path, verify=True)
    assert s.n_rows(HP) == 78 and s[HP].equal(x[:78]) and open_store(path).verify() == []
    w.close()
    assert not held.exists() and shard4.read_bytes() != before
    assert open_store(path, verify=True)[HP].equal(x[:87]) and open_store(path).verify() == []
    assert not list(path.rglob("*.tmp"))


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_resume_killed_between_installing_its_rewrite_and_its_root_is_put_back_by_the_next(tmp_path, compression):
    """The one window left (FORMAT.md section 7): the commit renamed the rewritten last shard
    over its key, and the process died before the root document listed the new rows. The
    committed file is still kept as ``<key>.committed.tmp``, which readers read meanwhile; the next resume puts it back
    (the file whose chunks match the manifest wins) and ends as an uninterrupted run."""
    import torch

    from activationscope.store import StoreWriter

    path, killed = tmp_path / "s.zarr", tmp_path / "killed.zarr"
    x, opts = _closed_store(path, compression)
    committed = shard(path, 4).read_bytes()
    _killed_after_rename(path, killed, x, opts, 78, 87).abort()
    assert shard(killed, 4).with_name(shard(killed, 4).name + ".committed.tmp").read_bytes() == committed
    # the installed rewrite does not match the manifest the root points to: readers read the kept file
    assert open_store(killed, verify=True)[HP].equal(x[:78]) and open_store(killed).verify() == []
    StoreWriter(killed, resume=True, **opts).abort()  # a resume opened and stopped at once: the committed file is back
    assert shard(killed, 4).read_bytes() == committed
    assert open_store(killed, verify=True)[HP].equal(x[:78]) and open_store(killed).verify() == []
    w = StoreWriter(killed, resume=True, **opts)
    w.open_array(HP, (64,), torch.float32, "sample").append(x[78:])
    w.add_batch(22)
    w.close()
    assert open_store(killed, verify=True)[HP].equal(x) and open_store(killed).verify() == []
    assert not list(killed.rglob("*.tmp"))


def test_a_damaged_chunk_before_the_last_committed_rows_is_only_damaged(tmp_path):
    path = tmp_path / "s.zarr"
    make_store(path, n_rows=N_ROWS - 8)
    f = shard(path, 0)
    raw = bytearray(f.read_bytes())
    raw[5] ^= 0xFF
    f.write_bytes(bytes(raw))
    with pytest.raises(StoreCorruptError, match=r"crc32c mismatch \(manifest [0-9a-f]+, data [0-9a-f]+\): the chunk is "
                                                r"damaged; restore"):
        open_store(path, verify=True)[HP]


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_reader_that_read_before_a_resume_verifies_clean_after_its_close(tmp_path, compression):
    """A reader that read the partial last shard before a resume rewrote it (and listed the
    rewrite in its manifest) checks the files as they are now: verify() reads the shard indexes
    again instead of comparing the ones it read before with the new manifest."""
    import torch

    from activationscope.store import StoreWriter

    path = tmp_path / "s.zarr"
    x, opts = _closed_store(path, compression)
    before = open_store(path)
    assert before[HP].equal(x[:78])
    w = StoreWriter(path, resume=True, **opts)
    w.open_array(HP, (64,), torch.float32, "sample").append(x[78:])
    w.add_batch(22)
    w.close()
    assert before.verify() == []
    before._cache.clear()
    assert before[HP].equal(x[:78])  # still its own snapshot: the rows it was opened with
    before.refresh()
    assert before[HP].equal(x) and before.verify() == []


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_reader_that_read_during_a_resume_still_reads_its_rows_after_the_close(tmp_path, compression):
    """A reader opened before a resume, that read the partial last shard after the resume's
    commit (the committed file it read is removed at the close), reads its rows again after
    the close: the shard index it had is read again from the file at the key."""
    import torch

    from activationscope.store import StoreWriter

    path = tmp_path / "s.zarr"
    x, opts = _closed_store(path, compression)
    reader = open_store(path)
    w = StoreWriter(path, resume=True, **opts)
    a = w.open_array(HP, (64,), torch.float32, "sample")
    a.append(x[78:95])
    w.add_batch(17)
    w.commit()
    assert reader[HP].equal(x[:78])
    a.append(x[95:])
    w.add_batch(5)
    w.close()
    reader._cache.clear()
    assert reader[HP].equal(x[:78]) and reader[HP][76:78].equal(x[76:78])
    assert open_store(path)[HP].equal(x)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_resume_killed_after_its_rename_with_rows_ending_on_a_chunk_boundary_verifies(tmp_path, compression):
    """The committed rows end on a chunk boundary inside the partial last shard: the rewrite
    a killed resume renamed over the key holds every committed chunk unchanged but more bytes
    than the manifest records; readers (verify's file_bytes check too) read the kept file."""
    path, killed = tmp_path / "s.zarr", tmp_path / "killed.zarr"
    x, opts = _closed_store(path, compression, n_rows=76)
    _killed_after_rename(path, killed, x, opts, 76, 87).abort()
    store = open_store(killed, verify=True)
    assert store.verify() == [] and store[HP].equal(x[:76])
