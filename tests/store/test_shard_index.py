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


def test_a_chunk_a_running_resume_rewrote_is_named_as_such_by_a_verifying_reader(tmp_path):
    """FORMAT.md section 5: the chunk that holds the last committed rows is rewritten by a
    resume that appends to it; until that resume commits, its crc32c is not the manifest's. A
    verifying reader says so (not only "damaged"), and reads it once the resume has closed."""
    import time

    import torch

    from activationscope.store import StoreWriter

    path = tmp_path / "s.zarr"
    x = torch.randn(100, 1024, generator=torch.Generator().manual_seed(1))
    w = StoreWriter(path, chunk_rows=4, shard_bytes=16 * 4096)
    w.open_array(HP, (1024,), torch.float32, "sample").append(x[:78])
    w.add_batch(78, list(range(78)), None, {})
    w.commit()
    w.close()
    w = StoreWriter(path, resume=True, chunk_rows=4, shard_bytes=16 * 4096)
    shard4 = shard(path, 4)  # chunks 16-19 (16 KiB each)
    before = shard4.read_bytes()
    w.open_array(HP, (1024,), torch.float32, "sample").append(x[78:87])
    w.add_batch(9, list(range(78, 87)), None, {})
    w.commit()
    deadline = time.monotonic() + 30
    while shard4.read_bytes() == before and time.monotonic() < deadline:  # the writer thread rewrites chunk 19
        time.sleep(0.01)
    assert open_store(path)[HP].equal(x[:78])
    with pytest.raises(StoreCorruptError, match=r"chunk 19 \(rows 76-77\).*crc32c mismatch.*: the chunk was rewritten "
                                                r"by a resumed capture \(it holds the last committed rows, 76-77.*"
                                                r"or it is damaged; restore"):
        open_store(path, verify=True)[HP]
    problems = open_store(path).verify()
    assert len(problems) == 1 and "chunk 19" in problems[0] and "rewritten by a resumed capture" in problems[0]
    w.close()
    assert open_store(path, verify=True)[HP].equal(x[:87])


def test_a_compressed_chunk_a_running_resume_rewrote_is_named_as_such_by_reads_and_verify(tmp_path):
    """As above, compressed: the rewritten chunk (more rows) has another size than the manifest
    lists, and its shard another file size; a read and verify() name the resume as the likely
    cause, not only damage."""
    import time

    import torch

    from activationscope.store import StoreWriter

    path = tmp_path / "s.zarr"
    x = torch.randn(100, 64, generator=torch.Generator().manual_seed(1))
    opts = {"chunk_rows": 4, "shard_rows": 16, "compression": "zstd"}
    w = StoreWriter(path, **opts)
    w.open_array(HP, (64,), torch.float32, "sample").append(x[:78])
    w.add_batch(78)
    w.close()
    w = StoreWriter(path, resume=True, **opts)
    shard4 = shard(path, 4)
    before = shard4.stat().st_size
    w.open_array(HP, (64,), torch.float32, "sample").append(x[78:87])  # completes shard 4 (rows 64-79)
    w.add_batch(9)
    w.commit()  # not the forward: its rows 80-86 are not durable yet
    deadline = time.monotonic() + 30
    while shard4.stat().st_size == before and time.monotonic() < deadline:  # the writer thread renames shard 4
        time.sleep(0.01)
    s = open_store(path)
    assert s.n_rows(HP) == 78 and s.rows(HP, 0, 76).equal(x[:76])
    with pytest.raises(StoreCorruptError, match=r"chunk 19 \(rows 76-77.*gives the chunk \d+ bytes, the manifest .* \d+: "
                                                r"the chunk was rewritten by a resumed capture"):
        s.rows(HP, 76, 78)
    problems = open_store(path).verify()
    assert problems and all("rewritten by a resume" in p for p in problems), problems
    w.close()
    assert open_store(path)[HP].equal(x[:87]) and open_store(path).verify() == []


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
