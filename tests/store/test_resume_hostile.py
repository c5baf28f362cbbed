"""A store's files swapped, linked or replaced by another process while a writer (a new
capture or a resume) writes it: the writer never writes through a link or into a file that
has another name elsewhere, and the store keeps every committed row."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from activationscope.errors import StoreCorruptError
from activationscope.store import StoreWriter, open_store
from activationscope.store._backend import LOCK_KEY


def _store(path: Path, rows: torch.Tensor) -> None:
    with StoreWriter(path) as w:
        a = w.open_array("x", (rows.shape[1],), rows.dtype, "sample")
        a.append(rows)
        w.add_batch(rows.shape[0])


def _wait_for_spares(w: StoreWriter, keys: set[str]) -> None:
    """Until the writer's background thread has made the spare temporary files of ``keys``
    (the documents its last commit wrote, made for the next one)."""
    import time

    deadline = time.monotonic() + 10
    while not keys <= set(w._backend._spare) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert keys <= set(w._backend._spare)


def test_a_writer_lock_hard_linked_to_another_file_is_refused_and_that_file_left_as_it_is(tmp_path):
    """The lock file is truncated and written by the writer that takes it: a lock that is a
    hard link of a file outside the store (planted, or a store copied with ``cp -al``) is
    refused before it is written, naming it and the fix, and the other file keeps its bytes."""
    path = tmp_path / "s.zarr"
    rows = torch.randn(6, 3)
    _store(path, rows)
    victim = tmp_path / "notes.txt"
    victim.write_bytes(b"precious\n")
    (path / LOCK_KEY).unlink()
    os.link(victim, path / LOCK_KEY)
    with pytest.raises(StoreCorruptError, match=rf"{LOCK_KEY}.*2 names.*delete .*{LOCK_KEY}"):
        StoreWriter(path, resume=True)
    assert victim.read_bytes() == b"precious\n"
    s = open_store(path)
    assert torch.equal(s["x"], rows) and s.verify() == []
    (path / LOCK_KEY).unlink()  # the fix the error names
    w = StoreWriter(path, resume=True)
    w.close()
    assert victim.read_bytes() == b"precious\n" and open_store(path).verify() == []


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
def test_a_spare_document_file_swapped_for_a_link_is_never_written_through(tmp_path, how):
    """A commit writes each document into a spare temporary file made ahead of time (then
    renames it over the key): one swapped meanwhile for a link to a file outside the store
    (by another process) is not written through; the document is written into a new file,
    the outside file keeps its bytes, and the store's documents are regular files."""
    path = tmp_path / "s.zarr"
    w = StoreWriter(path, chunk_rows=1, shard_bytes=8, commit_interval=0)
    a = w.open_array("x", (2,), torch.float32, "sample")
    a.append(torch.ones(3, 2))
    w.add_batch(3)
    w._core.drain()
    w.commit()
    _wait_for_spares(w, {"zarr.json", "acts/x/zarr.json", "acts/x/manifest.json"})
    spares = list(w._backend._spare.values())
    victim = tmp_path / "notes.txt"
    victim.write_bytes(b"precious\n")
    for spare in spares:
        spare.unlink()
        (os.symlink if how == "symlink" else os.link)(victim, spare)
    a.append(torch.full((2, 2), 2.0))
    w.add_batch(2)
    w._core.drain()
    w.commit()
    w.close()
    assert victim.read_bytes() == b"precious\n"
    for key in ("zarr.json", "acts/x/zarr.json", "acts/x/manifest.json"):
        assert not (path / key).is_symlink() and (path / key).stat().st_nlink == 1, key
    assert not [p for p in path.rglob("*.tmp")]
    s = open_store(path)
    assert s.verify() == [] and torch.equal(s["x"], torch.cat([torch.ones(3, 2), torch.full((2, 2), 2.0)]))


def _listing(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


class _Const:
    kind = "custom"

    def __init__(self, value: float) -> None:
        self.value = value

    def result(self) -> dict:
        return {"m": torch.full((2,), self.value)}


@pytest.mark.parametrize("folder", ["rows", "rows/sample", "reductions", "reductions/x", "acts/x"])
def test_a_folder_swapped_for_a_link_leaving_the_store_mid_capture_is_never_written_through(tmp_path, folder):
    """Another process moves one of the store's folders outside it and leaves a symbolic link in
    its place after the writer has written there: the writer's next commit, stored reduction
    and close write nothing through the link (each refuses, naming the key), so the files
    outside keep their bytes."""
    import shutil

    from activationscope.errors import StoreError

    path = tmp_path / "s.zarr"
    w = StoreWriter(path, chunk_rows=1, shard_bytes=8, commit_interval=0)
    a = w.open_array("x", (2,), torch.float32, "sample")
    for i in range(2):
        a.append(torch.full((3, 2), float(i)))
        w.add_batch(3)
        w._core.drain()
        w.commit()
    w.add_reductions("x", "m", _Const(1.0))
    _wait_for_spares(w, {"zarr.json", "acts/x/zarr.json", "acts/x/manifest.json"})
    outside = tmp_path / "outside"
    shutil.copytree(path / folder, outside, symlinks=True)
    shutil.rmtree(path / folder)
    os.symlink(outside, path / folder)
    before = _listing(outside)
    raised = []

    def more_rows():
        a.append(torch.full((3, 2), 2.0))
        w.add_batch(3)
        w._core.drain()

    for step in (more_rows, w.commit, lambda: w.add_reductions("x", "m", _Const(2.0)), w.close):
        try:
            step()
        except StoreError as e:
            raised.append(str(e))
    assert raised and all("outside the store" in e or "symbolic link" in e for e in raised), raised
    assert _listing(outside) == before


def test_an_s3_store_written_by_another_process_since_it_was_last_opened_reopens_as_it_is_now(s3):
    """fsspec's S3 file system is one object per process (same options) and caches the
    listings it made: a store opened (and verified) once, then resumed by another process,
    reopened in the first one read its new documents and shards as missing. Opening a store,
    and refreshing it, sees what is there now. (The other process is a writer with a file
    system object of its own.)"""
    url = "s3://acs-bucket/listed-before-a-resume.zarr"
    other = {**s3, "skip_instance_cache": True}
    rows = torch.randn(16, 2)

    def write(part, resume):
        with StoreWriter(url, resume=resume, chunk_rows=4, shard_bytes=4 * 2 * 4, storage_options=other) as w:
            a = w.open_array("x", (2,), torch.float32, "sample")
            a.append(part)
            w.add_batch(part.shape[0])

    with StoreWriter(url, storage_options=other) as w:  # a new store, listed before it has an array
        w.add_batch(0)
    first = open_store(url, storage_options=s3)
    assert first.verify() == [] and first.n_samples == 0
    write(rows[:6], resume=True)
    store = open_store(url, storage_options=s3)
    assert store.n_samples == 6 and store.verify() == [] and torch.equal(store["x"], rows[:6])
    write(rows[6:], resume=True)
    store.refresh()
    assert store.n_samples == 16 and store.verify() == [] and torch.equal(store["x"], rows)
    again = open_store(url, storage_options=s3)
    assert again.verify() == [] and torch.equal(again["x"], rows)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_resume_refuses_a_damaged_committed_chunk_of_the_shard_it_rewrites(tmp_path, compression):
    """A resume re-reads the committed rows of the partial last shard and writes them again,
    with new crc32c records, into its rewrite of that shard: a committed chunk there whose bytes
    no longer match its crc32c (a flipped bit) is refused, naming it, before anything is
    written. (An uncompressed shard was read through its memory map, unchecked: the damage was
    written again under a fresh crc32c, and verify() found nothing any more.)"""
    path = tmp_path / "s.zarr"
    options = {"chunk_rows": 4, "shard_bytes": 4 * 4 * 4 * 2, "compression": compression}  # 8-row shards
    rows = torch.randn(12, 4)
    with StoreWriter(path, **options) as w:  # shard 1 holds rows 8-11, in one whole chunk
        w.open_array("x", (4,), torch.float32, "sample").append(rows)
        w.add_batch(12)
    shard = path / "acts/x/c/1/0"
    damaged = bytearray(shard.read_bytes())
    damaged[5] ^= 0x40
    shard.write_bytes(bytes(damaged))
    before = _listing(path)
    found = open_store(path).verify()
    assert len(found) == 1 and "crc32c mismatch" in found[0]
    with pytest.raises(StoreCorruptError, match=r"chunk 2 \(rows 8-11.*acts/x/c/1/0.*crc32c mismatch"):
        with StoreWriter(path, resume=True, **options) as w:
            w.open_array("x", (4,), torch.float32, "sample").append(torch.zeros(4, 4))
            w.add_batch(4)
    assert {k: v for k, v in _listing(path).items() if k != LOCK_KEY} == \
        {k: v for k, v in before.items() if k != LOCK_KEY}
    assert open_store(path).verify() == found


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("damaged", [None, "c"])
def test_a_resume_reads_the_committed_rows_of_every_partial_last_shard_from_one_store(tmp_path, monkeypatch,
                                                                                   compression, damaged):
    """A resume re-reads the committed rows of each hook point's partial last shard: it opened
    the store again for each hook point (on object storage a read of its root each); now one
    store reads them all. The rows are the written ones, and a damaged committed chunk of the
    last hook point read is still refused, naming it, before anything is written."""
    from acs_testing import count_store_reads

    path = tmp_path / "s.zarr"
    options = {"chunk_rows": 4, "shard_bytes": 4 * 4 * 4 * 2, "compression": compression}  # 8-row shards
    rows = {hp: torch.randn(12, 4) for hp in ("a", "b", "c")}
    with StoreWriter(path, **options) as w:  # shard 1 of each holds rows 8-11, in one whole chunk
        for hp, r in rows.items():
            w.open_array(hp, (4,), torch.float32, "sample").append(r)
        w.add_batch(12)
    more = {hp: torch.randn(3, 4) for hp in rows}
    if damaged:
        shard = path / f"acts/{damaged}/c/1/0"
        flipped = bytearray(shard.read_bytes())
        flipped[5] ^= 0x40
        shard.write_bytes(bytes(flipped))
        before = _listing(path)
        with pytest.raises(StoreCorruptError, match=rf"chunk 2 \(rows 8-11.*acts/{damaged}/c/1/0.*crc32c mismatch"):
            with StoreWriter(path, resume=True, **options) as w:
                for hp in rows:
                    w.open_array(hp, (4,), torch.float32, "sample").append(more[hp])
                w.add_batch(3)
        assert {k: v for k, v in _listing(path).items() if k != LOCK_KEY} == \
            {k: v for k, v in before.items() if k != LOCK_KEY}
        return
    counts = count_store_reads(monkeypatch)
    with StoreWriter(path, resume=True, **options) as w:
        for hp in rows:
            w.open_array(hp, (4,), torch.float32, "sample").append(more[hp])
        w.add_batch(3)
    # the store as found (its committed shards put back), and the reader of the partial last
    # shards of all three hook points (before: one each)
    assert counts["opens"] == 1 + 1, counts
    st = open_store(path)
    assert st.verify() == [] and st.n_samples == 15
    for hp in rows:
        assert torch.equal(st[hp], torch.cat([rows[hp], more[hp]]))


def test_a_file_planted_at_the_next_shard_s_temporary_name_is_never_written_into(tmp_path):
    """The shard writer's temporary names (``shard-<writer>-<shard>-<pid>.tmp``) are known once
    one is seen: a hard link to a file elsewhere planted at the next one's name, before the
    writer opens that shard, is not written into (the writer makes a file of its own there),
    so the other file keeps its bytes and the store its rows."""
    import re

    path = tmp_path / "s.zarr"
    w = StoreWriter(path, chunk_rows=4, shard_bytes=4 * 2 * 4 * 2, commit_interval=0)  # 8-row shards
    a = w.open_array("x", (2,), torch.float32, "sample")
    rows = torch.randn(24, 2)
    a.append(rows[:4])  # shard 0 open, its temporary file made
    w.add_batch(4)
    w._core.drain()
    names = [p.name for p in (path / "acts/x").iterdir() if re.fullmatch(r"shard-\d+-0-\d+\.tmp", p.name)]
    assert len(names) == 1
    victim = tmp_path / "notes.txt"
    victim.write_bytes(b"precious\n")
    for k in (1, 2):
        os.link(victim, path / "acts/x" / names[0].replace("-0-", f"-{k}-", 1))
    a.append(rows[4:])
    w.add_batch(20)
    w.close()
    assert victim.read_bytes() == b"precious\n"
    s = open_store(path)
    assert torch.equal(s["x"], rows) and s.verify() == []


@pytest.mark.parametrize("damage", ["truncated", "grown", "folder", "fifo"])
def test_a_resume_refuses_a_damaged_whole_committed_shard_before_it_writes(tmp_path, damage):
    """A committed whole shard (which a resume never reads again) truncated, written past its
    end, or replaced by a folder or a FIFO: the resume refuses the store, naming the shard and
    the fix, before it deletes or writes anything (it went on and closed the store as
    complete around the damaged shard)."""
    path = tmp_path / "s.zarr"
    options = {"chunk_rows": 4, "shard_bytes": 4 * 4 * 4 * 2}  # 8-row shards
    with StoreWriter(path, **options) as w:
        w.open_array("x", (4,), torch.float32, "sample").append(torch.randn(20, 4))
        w.add_batch(20)
    shard = path / "acts/x/c/0/0"
    if damage == "truncated":
        os.truncate(shard, 100)
    elif damage == "grown":
        with open(shard, "ab") as f:
            f.write(bytes(64))
    else:
        shard.unlink()
        shard.mkdir() if damage == "folder" else os.mkfifo(shard)
    before = {k: v for k, v in _listing(path).items() if k != LOCK_KEY}
    what = {"truncated": "100 bytes where its manifest records 164",
            "grown": "228 bytes where its manifest records 164", "folder": "a directory", "fifo": "a FIFO"}[damage]
    with pytest.raises(StoreCorruptError, match=rf"'acts/x/c/0/0', whose rows 0\.\.7 are committed, is {what}.*"
                                                r"nothing was deleted or written.*activationscope verify"):
        StoreWriter(path, resume=True, **options)
    assert {k: v for k, v in _listing(path).items() if k != LOCK_KEY} == before
    assert open_store(path).status == "complete"


@pytest.mark.parametrize("damage", ["missing", "folder", "fifo"])
def test_a_resume_refuses_a_missing_row_table_part_before_it_writes(tmp_path, damage):
    """A row-table part the root lists, missing or replaced by a folder or a FIFO: the resume
    refuses the store, naming the part and the fix, before it deletes or writes anything (it
    warned that the stored sample ids could not be read, then closed the store as complete
    without those rows)."""
    path = tmp_path / "s.zarr"
    options = {"chunk_rows": 4, "shard_bytes": 4 * 4 * 4 * 2, "commit_interval": 0}
    w = StoreWriter(path, **options)
    a = w.open_array("x", (4,), torch.float32, "sample")
    for i in range(3):
        a.append(torch.randn(8, 4))
        w.add_batch(8, list(range(8 * i, 8 * i + 8)))
        w._core.drain()
        w.commit()
    w.close()
    part = path / "rows/sample/part-000001.parquet"
    part.unlink()
    if damage == "folder":
        part.mkdir()
    elif damage == "fifo":
        os.mkfifo(part)
    before = {k: v for k, v in _listing(path).items() if k != LOCK_KEY}
    what = {"missing": "missing", "folder": "a directory", "fifo": "a FIFO"}[damage]
    with pytest.raises(StoreCorruptError, match=rf"row table 'sample': its part 'rows/sample/part-000001\.parquet', "
                                                rf"listed in zarr\.json, is {what}.*nothing was deleted or written"):
        StoreWriter(path, resume=True, **options)
    assert {k: v for k, v in _listing(path).items() if k != LOCK_KEY} == before


def test_a_resume_after_a_killed_overwrite_names_the_store_it_moved_aside(tmp_path):
    """``overwrite=True`` moves the old store aside (``.<name>.replaced-<hex>``) until its new
    store commits; killed before, it leaves the old store there and a new one of no rows at
    the path, and a resume (or another overwrite) went on without a word about it. They warn,
    naming the folder; a writer settling its own aside does not."""
    import subprocess
    import sys
    import warnings

    path = tmp_path / "s.zarr"
    rows = torch.randn(5, 3)
    _store(path, rows)
    code = ("import os, sys, torch\nfrom activationscope.store import StoreWriter\n"
            "w = StoreWriter(sys.argv[1], overwrite=True)\nos.kill(os.getpid(), 9)\n")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    aside = [p for p in tmp_path.iterdir() if p.name.startswith(".s.zarr.replaced-")]
    assert len(aside) == 1 and torch.equal(open_store(aside[0])["x"], rows)
    with pytest.warns(RuntimeWarning, match=rf"{aside[0].name}.*moved aside and never settled.*move its entries back"):
        StoreWriter(path, resume=True).close()
    with pytest.warns(RuntimeWarning, match=rf"{aside[0].name}"):
        StoreWriter(path, overwrite=True).close()
    import shutil

    shutil.rmtree(aside[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _store(tmp_path / "t.zarr", rows)
        with StoreWriter(tmp_path / "t.zarr", overwrite=True) as w:  # its own aside, settled: no warning
            w.open_array("x", (3,), torch.float32, "sample").append(rows)
            w.add_batch(5)
        StoreWriter(tmp_path / "t.zarr", resume=True).close()


def test_a_document_s_temporary_file_swapped_for_a_link_before_its_rename_is_refused(tmp_path, monkeypatch):
    """Another process replacing a document's temporary file by a symbolic link between its
    write and its rename puts the link at the key: that is StoreCorruptError naming the key
    (never a document read through a link leaving the store), and the linked file keeps its
    bytes."""
    from activationscope.store._backend import LocalBackend

    b = LocalBackend(tmp_path / "s.zarr")
    b.set("acts/x/manifest.json", b"{}")
    victim = tmp_path / "notes.txt"
    victim.write_bytes(b"precious\n")
    replace = os.replace

    def swapping(src, dst, **kw):
        if str(src).endswith(".tmp"):
            os.unlink(src)
            os.symlink(victim, src)
        return replace(src, dst, **kw)

    monkeypatch.setattr(os, "replace", swapping)
    with pytest.raises(StoreCorruptError, match=r"'acts/x/manifest\.json': its temporary file .* was replaced"):
        b.set("acts/x/manifest.json", b'{"hook_point": "x"}')
    monkeypatch.setattr(os, "replace", replace)
    assert victim.read_bytes() == b"precious\n"


def _three_parts(target) -> dict:
    """A store of 24 rows of ``x`` committed in three parts of 8 sample rows each."""
    options = {"chunk_rows": 4, "shard_bytes": 4 * 4 * 4 * 2, "commit_interval": 0}
    w = StoreWriter(target, **options)
    a = w.open_array("x", (4,), torch.float32, "sample")
    for i in range(3):
        a.append(torch.randn(8, 4))
        w.add_batch(8, list(range(8 * i, 8 * i + 8)))
        w._core.drain()
        w.commit()
    w.close()
    return options


def _small_part(rows: int) -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.table({"sample_id": pa.array(range(rows), pa.int64()), "batch": pa.array([1] * rows, pa.int64())}),
                   buf)
    return buf.getvalue()


def test_a_resume_refuses_a_part_whose_footer_says_more_rows_than_the_table_before_it_decodes_it(tmp_path,
                                                                                                     monkeypatch):
    """A part (no crc32c recorded) whose Parquet footer says, consistently with itself, that its
    row group of 8 rows holds 2**24: the resume decoded its integer columns (pyarrow allocating
    by that count, hundreds of MB) before it compared the parts' rows with n_rows. Now it
    compares each part's count as it goes and refuses the store before decoding that part."""
    import io
    import json
    import sys

    import pyarrow.parquet as pq

    sys.path.insert(0, str(Path(__file__).parent))
    from parquet_footer import lying_row_counts, spy_decodes

    target = tmp_path / "s.zarr"
    options = _three_parts(target)
    key = "rows/sample/part-000001.parquet"
    doc = json.loads((target / "zarr.json").read_text())
    del doc["attributes"]["activationscope"]["row_tables"]["sample"]["crc32c"][key]
    (target / "zarr.json").write_text(json.dumps(doc))
    sink = io.BytesIO()
    pq.write_table(pq.read_table(target / key), sink)
    big = 2**24
    (target / key).write_bytes(lying_row_counts(sink.getvalue(), {0: big}, file_rows=big, values=True))
    decoded = spy_decodes(monkeypatch)
    before = {k: (target / k).read_bytes() for k in ["zarr.json", key, "acts/x/manifest.json"]}
    with pytest.raises(StoreCorruptError, match=rf"cannot resume: row table 'sample': its parts up to '{key}' hold "
                                                rf"{big + 8} rows by their footers, but zarr\.json says n_rows 24.*nothing "
                                                r"was deleted or written"):
        StoreWriter(target, resume=True, **options)
    assert len(decoded) == 1, decoded  # (part 0's integer columns only)
    assert {k: (target / k).read_bytes() for k in before} == before


@pytest.mark.parametrize("damage", ["flipped byte", "not parquet", "fewer rows"])
@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_resume_refuses_a_damaged_row_table_part_before_it_writes(tmp_path, damage, where):
    """A row-table part the root lists whose bytes fail their recorded crc32c, or (no crc32c
    recorded) that is not Parquet, or parts holding fewer rows than the table's n_rows: readers
    and verify() refuse that table, and a resume, which keeps every listed part and appends
    after it, refuses the store before it deletes or writes anything, naming the part and the
    fix (it warned, then closed the store complete on the damaged table)."""
    import json
    import uuid

    import fsspec

    key = "rows/sample/part-000001.parquet"
    if where == "local":
        target = tmp_path / "s.zarr"
        options = _three_parts(target)
        get, put = (lambda k: (target / k).read_bytes()), (lambda k, v: (target / k).write_bytes(v))
    else:
        target = f"memory://acs-resume-parts-{uuid.uuid4().hex}/s.zarr"
        options = _three_parts(target)
        fs, base = fsspec.filesystem("memory"), target[len("memory://"):]
        get, put = (lambda k: fs.cat_file(f"{base}/{k}")), (lambda k, v: fs.pipe_file(f"{base}/{k}", v))
    doc = json.loads(get("zarr.json"))
    table = doc["attributes"]["activationscope"]["row_tables"]["sample"]
    recorded = table["crc32c"][key]
    if damage == "flipped byte":
        raw = bytearray(get(key))
        raw[len(raw) // 2] ^= 0x01
        put(key, bytes(raw))
        match = rf"part '{key}' has crc32c [0-9a-f]{{8}}, but zarr\.json records {recorded:08x} for it"
    else:
        del table["crc32c"][key]  # (a store written before parts were checksummed)
        put("zarr.json", json.dumps(doc).encode())
        put(key, b"PAR1 not a parquet file PAR1" if damage == "not parquet" else _small_part(4))
        match = (rf"part '{key}' is not a readable Parquet file" if damage == "not parquet"
                 else r"its parts hold 20 rows, but zarr\.json says n_rows 24")
    s = open_store(target)
    problems = s.verify()
    said = {"flipped byte": f"part {key!r}: crc32c mismatch", "not parquet": f"part {key!r} is not a readable Parquet",
            "fewer rows": "its parts hold 20 rows, the metadata says n_rows 24"}[damage]
    assert len(problems) == 1 and said in problems[0]
    with pytest.raises(StoreCorruptError):
        s.row_table()
    before = {k: get(k) for k in ["zarr.json", key, "rows/sample/part-000002.parquet", "acts/x/manifest.json"]}
    with pytest.raises(StoreCorruptError, match=rf"cannot resume: row table 'sample': {match}.*nothing was deleted or "
                                                r"written; restore that file from an intact copy"):
        StoreWriter(target, resume=True, **options)
    assert {k: get(k) for k in before} == before
    assert open_store(target).verify() == problems  # (and the lock was let go: the fix can be applied)
    w = StoreWriter(target, overwrite=True, **options)
    w.close()
