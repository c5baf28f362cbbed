"""Row-table parts merged by commits (FORMAT.md section 4): every commit wrote one part per row
kind and the root listed them all, so a capture committing every second for 10 hours held
~36,000 parts, a root rewritten at every commit that grew with them and a ``row_table()`` that
opened each. A commit now merges runs of parts (a K-ary counter over the commits each part
holds); the tables read the same (rows, columns, order, types), readers opened before a merge
read on, and a kill at any write of a merging commit loses nothing."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pyarrow as pa
import pytest

from activationscope.errors import StoreError
from activationscope.store import copy_store, open_store
from activationscope.store import writer as W
from activationscope.store._backend import LocalBackend, ZarrBackend, resolve

import merge_child

HERE = Path(__file__).parent


def _rows(table: pa.Table) -> list[dict]:
    """The table's rows, NaN written "nan" (NaN == NaN is False)."""
    return [{k: ("nan" if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
            for row in table.to_pylist()]


def _same_table(got: pa.Table, want: pa.Table) -> None:
    assert got.schema == want.schema
    assert _rows(got) == _rows(want)


def _tables(target, storage_options=None) -> dict:
    st = open_store(target, storage_options=storage_options)
    return {kind: st.row_table(kind) for kind in ("sample", "token")}


def _part_files(target, storage_options=None) -> dict[str, list[str]]:
    """The part keys each row table lists, and those found under rows/ (sorted)."""
    st = open_store(target, storage_options=storage_options)
    b = resolve(target, read_only=True, storage_options=storage_options)
    listed = sorted(k for t in st.attrs["row_tables"].values() for k in t["parts"])
    return {"listed": listed, "found": sorted(k for k in b.list("rows/") if not k.endswith(".tmp"))}


@pytest.fixture(scope="module")
def unmerged(tmp_path_factory):
    """The tables of 200 forwards committed one by one, without merges (one part a commit)."""
    path = tmp_path_factory.mktemp("unmerged") / "s.zarr"
    before = W.ROW_PARTS_BEFORE_MERGE
    W.ROW_PARTS_BEFORE_MERGE = 1 << 40
    try:
        merge_child.capture(str(path), 200)
    finally:
        W.ROW_PARTS_BEFORE_MERGE = before
    assert len(open_store(path).attrs["row_tables"]["sample"]["parts"]) == 200
    return _tables(path)


def test_a_long_capture_keeps_few_parts_and_reads_the_tables_it_would_unmerged(tmp_path, monkeypatch, unmerged):
    merged: list[tuple[int, int]] = []  # the commits each merged part written holds
    write = W.StoreWriter._merged_part

    def noted(self, kind, group, span):
        key = write(self, kind, group, span)
        if key is not None and kind == "sample":
            merged.append(span)
        return key

    monkeypatch.setattr(W.StoreWriter, "_merged_part", noted)
    path = tmp_path / "s.zarr"
    merge_child.capture(str(path), 200)
    st = open_store(path)
    for kind in ("sample", "token"):
        parts = st.attrs["row_tables"][kind]["parts"]
        assert len(parts) <= W.ROW_PARTS_BEFORE_MERGE, parts
        _same_table(st.row_table(kind), unmerged[kind])
        # (and the columns read alone: the projection of each part)
        assert st.row_table(kind, ["batch"]).equals(unmerged[kind].select(["batch"]))
    # a K-ary counter: each commit's rows rewritten at most log_K(200) times (a merge of every
    # part every time would rewrite the first commit's rows some 46 times)
    times = [sum(a <= i <= b for a, b in merged) for i in range(200)]
    assert 0 < max(times) <= math.ceil(math.log(200, W.ROW_PART_MERGE_FACTOR)), times
    # the parts merged are gone once a root no longer lists them: only listed parts are left
    files = _part_files(str(path))
    assert files["found"] == files["listed"]
    assert st.verify() == []
    # copies hold the tables (a local folder, fsspec memory)
    for target in (tmp_path / "copy.zarr", f"memory://acs-merges/{uuid.uuid4().hex}.zarr"):
        copy_store(str(path), str(target))
        copy = open_store(str(target))
        assert copy.verify() == []
        for kind in ("sample", "token"):
            _same_table(copy.row_table(kind), unmerged[kind])


def test_a_resume_of_a_store_of_one_part_a_commit_merges_them_and_names_new_parts_past_them(tmp_path, monkeypatch,
                                                                                            unmerged):
    """A store written before merges (``part-<i>.parquet`` of every commit) resumed: its parts
    are merged with the new ones, the new parts named after the last commit's."""
    path = tmp_path / "s.zarr"
    monkeypatch.setattr(W, "ROW_PARTS_BEFORE_MERGE", 1 << 40)
    c = merge_child.Capture(str(path))
    for i in range(60):
        c.forward(i, 100)
    c.w.abort(RuntimeError("stopped"))
    assert len(open_store(path).attrs["row_tables"]["sample"]["parts"]) == 60
    monkeypatch.undo()
    merge_child.capture(str(path), 200, resume=True)
    st = open_store(path)
    parts = st.attrs["row_tables"]["sample"]["parts"]
    assert len(parts) <= W.ROW_PARTS_BEFORE_MERGE and parts[-1] == "rows/sample/part-000199.parquet", parts
    for kind in ("sample", "token"):
        _same_table(st.row_table(kind), unmerged[kind])
    files = _part_files(str(path))
    assert files["found"] == files["listed"] and st.verify() == []


def test_a_resume_names_no_new_part_as_a_listed_part_of_a_longer_number(tmp_path, monkeypatch):
    """A store from elsewhere listing ``part-999999999999.parquet`` (12 digits): a resume named
    its next parts ``part-1000000000000.parquet`` on (13 digits, which the part names it reads
    never matched), so a second resume named its first part ``part-1000000000000.parquet``
    again, overwrote that listed part with other rows and listed it twice (a store no reader
    opens). New parts are named past every listed name now."""
    path = tmp_path / "s.zarr"
    monkeypatch.setattr(W, "ROW_PARTS_BEFORE_MERGE", 1 << 40)
    merge_child.capture(str(path), 3)
    doc = json.loads((path / "zarr.json").read_text())
    attrs = doc["attributes"]["activationscope"]
    for kind, table in attrs["row_tables"].items():
        old, new = f"rows/{kind}/part-000002.parquet", f"rows/{kind}/part-999999999999.parquet"
        os.rename(path / old, path / new)
        table["parts"][table["parts"].index(old)] = new
        table["crc32c"][new] = table["crc32c"].pop(old)
    (path / "zarr.json").write_text(json.dumps(doc))
    merge_child.capture(str(path), 5, resume=True)
    merge_child.capture(str(path), 7, resume=True)
    st = open_store(path)
    parts = st.attrs["row_tables"]["sample"]["parts"]
    assert len(set(parts)) == len(parts) == 7, parts
    assert st.verify() == []
    assert st.row_table("sample").column("batch").to_pylist() == [i for i in range(7) for _ in (0, 1)]
    assert st.row_table("token").column("tok").to_pylist()[-3:] == [6, 7, 8]


def test_a_reader_opened_before_commits_merged_its_parts_reads_the_rows_it_was_opened_with(tmp_path):
    """A reader (and a dataset) opened while a capture runs lists the parts of its commit; a
    later commit merged them and removed them: its row_table() raised StoreCorruptError ("part
    ... listed in the metadata is missing"), and verify() listed each as missing. It now reads
    the rows of its commit from the parts listed now (the same run): the same rows and columns
    (not the column first given since), and verifies clean."""
    from activationscope.data import ActivationDataset

    path = str(tmp_path / "s.zarr")
    c = merge_child.Capture(path)
    for i in range(10):
        c.forward(i, 20)
    old = open_store(path)
    before = {kind: old.row_table(kind) for kind in ("sample", "token")}
    ds = ActivationDataset(path, hook_points=["x"], columns=["name"])
    listed = old.attrs["row_tables"]["sample"]["parts"]
    for i in range(10, 40):  # merges every part the reader lists, while the capture runs
        c.forward(i, 20)
    assert not any(os.path.exists(os.path.join(path, key)) for key in listed)
    for kind in ("sample", "token"):
        _same_table(old.row_table(kind), before[kind])
    assert old.row_table("sample", ["name", "late"]).equals(before["sample"].select(["name"]))
    assert old.verify() == []
    assert ds[:]["name"] == [f"s{i}" for i in range(20)] and len(ds) == 20
    c.w.close()
    assert open_store(path).row_table("sample").column("late").to_pylist()[-1] == 39


def test_a_reader_of_a_table_whose_part_is_missing_without_a_merge_still_says_it_is_missing(tmp_path):
    """The read of a later commit is taken only where the root lists other parts: a part
    deleted from a store no writer changes is damage, named as such."""
    from activationscope.errors import StoreCorruptError

    path = tmp_path / "s.zarr"
    merge_child.capture(str(path), 3)
    st = open_store(path)
    key = st.attrs["row_tables"]["sample"]["parts"][1]
    os.unlink(path / key)
    with pytest.raises(StoreCorruptError, match=f"row-table part {key!r} listed in the metadata is missing"):
        st.row_table("sample")
    assert f"row table 'sample': part {key!r} is missing" in st.verify()


def _killed_capture(target: str, kill_at: int, storage_options=None) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent.parent),
                                                       os.environ.get("PYTHONPATH", "")]))
    args = [sys.executable, str(HERE / "merge_child.py"), target, str(N_KILLED), str(kill_at), "0"]
    if storage_options:
        args.append(json.dumps(storage_options))
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr


N_KILLED = 8


@pytest.fixture(scope="module")
def merging_ops(tmp_path_factory):
    """The writes and deletes of row-table parts and roots of the capture the kill tests run
    (merging often), the reference store's tables, and the first op of its commit of forward 7
    (which merges every part of each table into one)."""
    path = tmp_path_factory.mktemp("ops") / "s.zarr"
    log: list = []
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(W, "ROW_PARTS_BEFORE_MERGE", 2)
        mp.setattr(W, "ROW_PART_MERGE_FACTOR", 2)
        for cls in (LocalBackend, ZarrBackend):
            for op in ("set", "delete"):
                mp.setattr(cls, op, cls.__dict__[op])  # (put back after: merge_child.counting wraps them)
        merge_child.counting(0, log)
        merge_child.capture(str(path), N_KILLED)
    finally:
        mp.undo()
    first = log.index(("set", "rows/sample/part-000007.parquet"))
    assert ("set", "rows/sample/part-000000-000007.parquet") in log[first:]
    return log, first, _tables(path)


def _resumed_equals_the_reference(target, reference, storage_options=None) -> None:
    W_before = (W.ROW_PARTS_BEFORE_MERGE, W.ROW_PART_MERGE_FACTOR)
    W.ROW_PARTS_BEFORE_MERGE, W.ROW_PART_MERGE_FACTOR = 2, 2
    try:
        merge_child.capture(target, N_KILLED, resume=True, storage_options=storage_options)
    finally:
        W.ROW_PARTS_BEFORE_MERGE, W.ROW_PART_MERGE_FACTOR = W_before
    st = open_store(target, storage_options=storage_options)
    assert st.status == "complete" and st.verify() == []
    for kind in ("sample", "token"):
        _same_table(st.row_table(kind), reference[kind])
    assert st["x"][:, 0].tolist() == [float(i) for i in range(N_KILLED) for _ in range(2)]
    files = _part_files(target, storage_options)
    assert files["found"] == files["listed"]  # (the resume removed the parts no root lists)


# offsets in the merging commit: its new sample part, the merged sample part, the merged token
# part, its root, the first and a later delete of a replaced part (after the root)
@pytest.mark.parametrize("offset", [0, 1, 3, 4, 5, 8])
def test_sigkill_at_any_write_of_a_merging_commit_then_resume_gives_the_uninterrupted_tables(tmp_path, merging_ops,
                                                                                             offset):
    log, first, reference = merging_ops
    path = str(tmp_path / "s.zarr")
    _killed_capture(path, first + offset + 1)
    st = open_store(path)  # killed: the rows of a commit, each table as a root lists it
    n = st.n_samples
    for kind in ("sample", "token"):
        table = st.row_table(kind)
        _same_table(table, reference[kind].slice(0, table.num_rows).select(table.column_names))
    assert n in (14, 16)
    _resumed_equals_the_reference(path, reference)


@pytest.mark.parametrize("offset", [1, 4, 5])
def test_sigkill_during_a_merging_commit_on_s3_then_resume_gives_the_uninterrupted_tables(request, merging_ops,
                                                                                          offset):
    options = request.getfixturevalue("s3")
    log, first, reference = merging_ops
    url = f"s3://acs-bucket/merges-{uuid.uuid4().hex}.zarr"
    _killed_capture(url, first + offset + 1, options)
    _resumed_equals_the_reference(url, reference, options)


@pytest.mark.parametrize("where", ["local", "memory"])
@pytest.mark.parametrize("offset", [1, 2, 3, 4, 5])
def test_a_merging_commit_that_fails_at_any_write_keeps_the_tables_for_the_next_commits(tmp_path, monkeypatch,
                                                                                       merging_ops, where, offset):
    """A write that fails (a transient I/O error) in a merging commit: the commit raises (or,
    a delete after its root, is tried again later), and the capture, going on, ends with the
    tables of a run without the failure and no part its root does not list."""
    log, first, reference = merging_ops
    target = str(tmp_path / "s.zarr") if where == "local" else f"memory://acs-merge-fails/{uuid.uuid4().hex}.zarr"
    monkeypatch.setattr(W, "ROW_PARTS_BEFORE_MERGE", 2)
    monkeypatch.setattr(W, "ROW_PART_MERGE_FACTOR", 2)
    fail = first + offset
    seen = [0]
    for cls in (LocalBackend, ZarrBackend):
        for op in ("set", "delete"):
            original = cls.__dict__[op]

            def failing(self, key, *args, _original=original, **kwargs):
                if key.startswith("rows/") or key == "zarr.json":
                    seen[0] += 1
                    if seen[0] == fail + 1:
                        raise StoreError(f"writing {key!r} failed: Input/output error")
                return _original(self, key, *args, **kwargs)

            monkeypatch.setattr(cls, op, failing)
    c = merge_child.Capture(target)
    failed = 0
    for i in range(N_KILLED):
        try:
            c.forward(i, N_KILLED // 2)
        except StoreError as e:
            assert "Input/output error" in str(e)
            failed += 1
    c.w.close()
    assert failed == (1 if log[fail][0] == "set" else 0)
    st = open_store(target)
    assert st.verify() == []
    for kind in ("sample", "token"):
        _same_table(st.row_table(kind), reference[kind])
    files = _part_files(target)
    assert files["found"] == files["listed"]


def test_no_root_lists_the_part_a_writer_of_an_earlier_version_would_write_next(tmp_path):
    """A writer of an earlier version resuming the store names its next part
    ``part-<number of parts>.parquet``. Merges shorten the table: after 31 commits it listed
    ``part-000000-000015`` and the 15 parts ``part-000016`` .. ``part-000030``, 16 parts, so such a
    writer would have overwritten ``part-000016`` (listed) with other rows. That part is now
    listed under another name, with the same bytes."""
    path = tmp_path / "s.zarr"
    c = merge_child.Capture(str(path))
    renamed = 0
    for i in range(70):
        c.forward(i, 100)
        for kind in ("sample", "token"):
            parts = open_store(path).attrs["row_tables"][kind]["parts"]
            assert f"rows/{kind}/part-{len(parts):06d}.parquet" not in parts, (i, parts)
            renamed += f"rows/{kind}/part-000016-000016.parquet" in parts
    c.w.close()
    assert renamed  # (the case above came)
    st = open_store(path)
    assert st.verify() == []
    assert st.row_table("sample").column("batch").to_pylist() == [i for i in range(70) for _ in (0, 1)]


def test_a_dask_graph_of_parts_merged_since_says_to_make_it_again(tmp_path):
    """A Dask graph of the row table reads the parts listed when it was made: one that a
    commit merged since read as damage ("listed in the metadata is missing"); now the error
    says what happened and to make the graph again."""
    pytest.importorskip("dask.dataframe")
    from activationscope.analysis.dask import row_table_dask

    path = str(tmp_path / "s.zarr")
    c = merge_child.Capture(path)
    for i in range(10):
        c.forward(i, 100)
    graph = row_table_dask(path)
    for i in range(10, 40):
        c.forward(i, 100)
    with pytest.raises(StoreError, match="merged with other parts by a commit since the graph was made .* make the "
                                         r"graph again \(row_table_dask\)"):
        graph.compute()
    c.w.close()
    assert row_table_dask(path).compute()["sample_id"].tolist() == list(range(80))


def test_a_reader_whose_parts_are_merged_again_at_every_read_is_told_to_refresh(tmp_path, monkeypatch):
    """Commits that merge the parts again each time the reader has read the root (a capture
    committing fast) end the reads after 3 roots with StoreError asking for a refresh, never
    with a loop or with rows of another commit."""
    path = tmp_path / "s.zarr"
    merge_child.capture(str(path), 3)
    st = open_store(path)
    backend = st._backend
    get = type(backend).get
    roots = [0]

    def merged_each_time(self, key, *args, **kwargs):
        if key.startswith("rows/"):
            return None  # (every part gone: merged meanwhile)
        raw = get(self, key, *args, **kwargs)
        if key == "zarr.json" and raw is not None:  # a later root listing parts of other names
            roots[0] += 1
            doc = json.loads(raw)
            doc["attributes"]["activationscope"]["row_tables"]["sample"]["parts"] = [
                f"rows/sample/part-000000-{roots[0]:06d}.parquet"]
            raw = json.dumps(doc).encode()
        return raw

    monkeypatch.setattr(type(backend), "get", merged_each_time)
    with pytest.raises(StoreError, match=r"row table 'sample': commits since it was opened merged its parts 3 times "
                                         r"while they were read .* call store.refresh\(\)"):
        st.row_table("sample")
    assert roots[0] == 3


def _four_unmerged_parts(tmp_path, monkeypatch):
    """A capture (merges held off) of four forwards of 2 rows: (path, capture, the sample
    row table's writer record, its 4 part keys)."""
    path = tmp_path / "s.zarr"
    monkeypatch.setattr(W, "ROW_PARTS_BEFORE_MERGE", 1 << 40)
    c = merge_child.Capture(str(path))
    for i in range(4):
        c.forward(i, 100)
    info = c.w._row_tables["sample"]
    parts = list(info["parts"])
    assert len(parts) == 4 and info["n_rows"] == 8
    return path, c, info, parts


def test_a_merge_refuses_a_part_whose_footer_says_more_rows_than_the_table_holds_before_decoding(tmp_path,
                                                                                                 monkeypatch):
    """A listed part replaced, its crc32c as the writer holds it matching, by one whose footer
    agrees with itself but says 2**24 rows: the merge read it with no bound but the footer's
    own (Parquet allocating each column by that count), where a reader bounds each part by the
    table's n_rows. Now the merge refuses it before a value is decoded and leaves the parts as
    they are; the capture goes on."""
    import pyarrow.parquet as pq
    from parquet_footer import lying_row_counts

    from activationscope.store import _format as F

    path, c, info, group = _four_unmerged_parts(tmp_path, monkeypatch)
    raw = (path / group[1]).read_bytes()
    lie = lying_row_counts(raw, {0: 2**24}, file_rows=2**24, values=True)
    (path / group[1]).write_bytes(lie)
    info["crc32c"][group[1]] = F.crc32c(lie)
    decoded = []
    for name in ("read", "read_row_group"):
        def spy(self, *args, _read=getattr(pq.ParquetFile, name), _name=name, **kwargs):
            decoded.append(_name)
            return _read(self, *args, **kwargs)

        monkeypatch.setattr(pq.ParquetFile, name, spy)
    assert c.w._merged_part("sample", group, (0, 3)) is None
    assert decoded == ["read"], "a part whose footer lies was decoded"  # (the first part's only)
    assert info["parts"] == group and not (path / "rows/sample/part-000000-000003.parquet").exists()
    c.w.abort(RuntimeError("stopped"))


def test_a_merge_bounds_a_part_s_rows_by_those_the_table_s_other_parts_leave(tmp_path, monkeypatch):
    """A merge of the table's last two parts (of 2 rows each, n_rows 8), the second replaced,
    its crc32c as the writer holds it matching, by one whose footer says 5 rows: the merge
    bounded it by n_rows less the rows of the group's parts before it (6), though the two
    parts before the group hold 4 rows the writer wrote: it decoded it, and wrote a merged part
    of its rows. Now its bound is the
    rows the table's other parts leave (2): refused before a value is decoded, the parts left
    as they are."""
    from parquet_footer import lying_row_counts, spy_decodes

    from activationscope.store import _format as F

    path, c, info, parts = _four_unmerged_parts(tmp_path, monkeypatch)
    group = parts[2:]
    raw = (path / group[1]).read_bytes()
    lie = lying_row_counts(raw, {0: 5}, file_rows=5, values=True)
    (path / group[1]).write_bytes(lie)
    info["crc32c"][group[1]] = F.crc32c(lie)
    decoded = spy_decodes(monkeypatch)
    assert c.w._merged_part("sample", group, (2, 3)) is None
    assert decoded == ["read"], "a part whose footer says more rows than the table's other parts leave was decoded"
    assert info["parts"] == parts and not (path / "rows/sample/part-000002-000003.parquet").exists()
    c.w.abort(RuntimeError("stopped"))
