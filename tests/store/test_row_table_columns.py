"""A row table's required columns (FORMAT.md §4: ``sample_id`` and ``batch`` of the sample
table, ``sample_id``, ``pos`` and ``batch`` of the token table) in every part: a part that is
intact (its crc32c rewritten to match) but lacks one, or holds one of another type, is
refused by every read of the table, named by verify(), and a resume refuses the store before
it changes a byte. Before, a sample part without ``sample_id`` verified clean, and a resume
appended after it: the ids read back as [None, None, None, 3, 4]."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import activationscope as acs
from activationscope.errors import StoreCorruptError
from activationscope.store import StoreWriter, open_store
from activationscope.store import _format as F

OPTIONS = {"chunk_rows": 4, "shard_bytes": 16 * 4 * 4}


def _store(path: Path, ids=((0, 1), (2, 3))) -> None:
    """Two forwards, the second by a resume (so two parts per row table), of 2 samples, 2 and 3
    tokens each: a sample array ``x``, a token array ``t`` and a per-sample ``label``."""
    for b, pair in enumerate(ids):
        w = StoreWriter(path, resume=b > 0, **OPTIONS)
        w.open_array("x", (4,), torch.float32, "sample").append(torch.randn(2, 4))
        w.open_array("t", (4,), torch.float32, "token").append(torch.randn(5, 4))
        w.add_batch(2, list(pair), torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool),
                    {"label": torch.tensor([b, b + 1])})
        w.close()
    assert all(len(open_store(path).attrs["row_tables"][k]["parts"]) == 2 for k in ("sample", "token"))


def _files(p: Path) -> dict[str, bytes]:
    return {str(q.relative_to(p)): q.read_bytes() for q in sorted(p.rglob("*")) if q.is_file()}


def _edit_part(path: Path, kind: str, index: int, edit) -> str:
    """Rewrite part ``index`` of row table ``kind`` as ``edit(table)``, its crc32c recomputed in
    the root (an intact, readable part: only a check of its columns can tell). Its key."""
    doc = json.loads((path / "zarr.json").read_text())
    info = doc["attributes"]["activationscope"]["row_tables"][kind]
    key = info["parts"][index]
    sink = io.BytesIO()
    pq.write_table(edit(pq.read_table(path / key)), sink)
    (path / key).write_bytes(sink.getvalue())
    info["crc32c"][key] = F.crc32c(sink.getvalue())
    (path / "zarr.json").write_text(json.dumps(doc))
    return key


def _set(column: str, array):
    def edit(t):
        return t.set_column(t.schema.get_field_index(column), column, array(t))
    return edit


def _drop(column: str):
    return lambda t: t.drop_columns([column])


CASES = {
    # (kind, edit, what the message says of the column)
    "sample without sample_id": ("sample", _drop("sample_id"), r"has no 'sample_id' column"),
    "sample without batch": ("sample", _drop("batch"), r"has no 'batch' column"),
    "token without sample_id": ("token", _drop("sample_id"), r"has no 'sample_id' column"),
    "token without pos": ("token", _drop("pos"), r"has no 'pos' column"),
    "token without batch": ("token", _drop("batch"), r"has no 'batch' column"),
    "pos as strings": ("token", _set("pos", lambda t: pa.array([str(v) for v in t.column("pos").to_pylist()])),
                       r"has a 'pos' column of string, where the format says integers"),
    "pos as floats": ("token", _set("pos", lambda t: t.column("pos").cast(pa.float64())),
                      r"has a 'pos' column of double, where the format says integers"),
    "pos with a null": ("token", _set("pos", lambda t: pa.array([None] + t.column("pos").to_pylist()[1:], pa.int64())),
                        r"has 1 nulls in its 'pos' column"),
    "batch as floats": ("sample", _set("batch", lambda t: t.column("batch").cast(pa.float64())),
                        r"has a 'batch' column of double, where the format says integers"),
    "sample_id as lists": ("sample", _set("sample_id", lambda t: pa.array([[v] for v in t.column("sample_id").to_pylist()])),
                           r"has a 'sample_id' column of list<\w+: int64>, where a sample id is one value a row"),
    "sample_id twice": ("sample", lambda t: t.append_column("sample_id", t.column("sample_id")),
                        r"has 2 columns named 'sample_id'"),
}


@pytest.mark.parametrize("index", [0, 1])
@pytest.mark.parametrize("case", list(CASES))
def test_a_part_without_a_required_column_or_of_another_type_is_refused_everywhere(tmp_path, case, index):
    kind, edit, said = CASES[case]
    path = tmp_path / "s.zarr"
    _store(path)
    assert open_store(path).verify() == []
    key = _edit_part(path, kind, index, edit)
    named = rf"store '{re.escape(str(path))}': row table '{kind}': part '{re.escape(key)}' {said}"
    s = open_store(path)
    problems = s.verify()
    # (each verify line is this store's: the table named once, not the store again)
    assert len(problems) == 1 and re.fullmatch(rf"row table '{kind}': part '{re.escape(key)}' {said}.*",
                                               problems[0]), problems
    with pytest.raises(StoreCorruptError, match=named):
        s.row_table(kind)
    other = "label" if kind == "sample" else "t"
    with pytest.raises(StoreCorruptError, match=named):  # a read of another column raises as the whole table's
        s.row_table(kind, columns=[other] if kind == "sample" else ["sample_id"])
    before = _files(path)
    with pytest.raises(StoreCorruptError, match=rf"store '{re.escape(str(path))}': cannot resume: row table '{kind}': "
                                                rf"part '{re.escape(key)}' {said}.*nothing was deleted or written"):
        StoreWriter(path, resume=True, **OPTIONS)
    assert _files(path) == before
    assert open_store(path).verify() == problems  # (and the lock was let go)


def test_a_capture_resume_of_a_sample_part_without_sample_id_changes_nothing(tmp_path):
    """The capture API's resume (one more forward) raised nothing: it resumed, and the ids read
    back as [None, None, None, 3, 4]. Now it raises naming the store, the table, the part and
    the column, and leaves every file as it was."""
    path = tmp_path / "s.zarr"
    m = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with acs.ActivationScope(store=str(path)).track(m) as t, torch.no_grad():
        t.set_batch(label=[0, 1, 0])
        m(torch.randn(3, 4))
    key = _edit_part(path, "sample", 0, _drop("sample_id"))
    assert open_store(path).verify() != []
    before = _files(path)
    with pytest.raises(StoreCorruptError, match=rf"store '{re.escape(str(path))}': cannot resume: row table 'sample': "
                                                rf"part '{re.escape(key)}' has no 'sample_id' column"):
        with acs.ActivationScope(store=str(path), store_options={"resume": True}).track(m) as t, torch.no_grad():
            t.set_batch(label=[1, 1])
            m(torch.randn(2, 4))
    assert _files(path) == before


@pytest.mark.parametrize("ids", [((0.5, 1.5), (2.5, 3.5)), (("a", "b"), ("c", "d")), ((b"a", b"b"), (b"c", b"d"))])
def test_sample_ids_of_a_type_the_writer_stores_are_read_and_resumed(tmp_path, ids):
    """``sample_id`` holds the user's type (FORMAT.md §4): float, string and bytes ids the writer
    stores are not refused by the column checks."""
    path = tmp_path / "s.zarr"
    _store(path, ids)
    s = open_store(path)
    assert s.verify() == []
    assert s.row_table("sample").column("sample_id").to_pylist() == [v for pair in ids for v in pair]
    assert s.row_table("token").column("pos").to_pylist() == [0, 1, 0, 1, 2] * 2
    w = StoreWriter(path, resume=True, **OPTIONS)
    w.close()
    assert open_store(path).verify() == []


def test_row_table_dask_refuses_a_part_without_sample_id(tmp_path):
    """row_table_dask reads each part in its own task: a part of the same schema as the others
    (every part lacking sample_id) is refused when the graph is made."""
    pytest.importorskip("dask.dataframe")
    from activationscope.analysis.dask import row_table_dask

    path = tmp_path / "s.zarr"
    _store(path)
    keys = [_edit_part(path, "sample", i, _drop("sample_id")) for i in (0, 1)]
    with pytest.raises(StoreCorruptError, match=rf"row table 'sample': part '{re.escape(keys[0])}' has no 'sample_id'"):
        row_table_dask(str(path), "sample").compute()


def test_row_table_dask_refuses_a_part_that_lost_sample_id_after_the_graph_was_made(tmp_path):
    """A partition checks its part when it reads it: a part without recorded crc32c (a store
    written before parts were checksummed) rewritten without sample_id after the graph was made,
    same rows and batch values, is refused instead of giving a frame without its ids."""
    pytest.importorskip("dask.dataframe")
    from activationscope.analysis.dask import row_table_dask

    path = tmp_path / "s.zarr"
    _store(path)
    doc = json.loads((path / "zarr.json").read_text())
    info = doc["attributes"]["activationscope"]["row_tables"]["sample"]
    del info["crc32c"]
    (path / "zarr.json").write_text(json.dumps(doc))
    frame = row_table_dask(str(path), "sample")
    key = info["parts"][1]
    sink = io.BytesIO()
    pq.write_table(pq.read_table(path / key).drop_columns(["sample_id"]), sink)
    (path / key).write_bytes(sink.getvalue())
    with pytest.raises(StoreCorruptError, match=rf"row table 'sample': part '{re.escape(key)}' has no 'sample_id'"):
        frame.compute()


def test_a_part_of_a_store_committed_from_rank_stores_without_its_rank_column_is_refused(tmp_path):
    """A store committed from rank stores pairs (rank, sample_id) and orders batches per rank
    (FORMAT.md §10): a part that lost its rank column is refused, not read as one rank."""
    from activationscope.store.ranks import commit_ranks

    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    path = tmp_path / "m.zarr"
    for task in range(2):
        with acs.ActivationScope(store=str(path), store_options={"process_group": acs.RankStore(task, 2)}).track(
                model), torch.no_grad():
            model(torch.randn(2, 3))
    commit_ranks(path)
    assert open_store(path).verify() == []
    key = _edit_part(path, "sample", 0, _drop("rank"))
    s = open_store(path)
    with pytest.raises(StoreCorruptError, match=rf"row table 'sample': part '{re.escape(key)}' has no 'rank' column"):
        s.row_table("sample")
    assert len(s.verify()) == 1 and "has no 'rank' column" in s.verify()[0]


def _edit_part_in_row_groups(path: Path, kind: str, index: int, edit, rows: int) -> str:
    """:func:`_edit_part`, the part written in row groups of ``rows`` rows."""
    doc = json.loads((path / "zarr.json").read_text())
    info = doc["attributes"]["activationscope"]["row_tables"][kind]
    key = info["parts"][index]
    sink = io.BytesIO()
    pq.write_table(edit(pq.read_table(path / key)), sink, row_group_size=rows)
    (path / key).write_bytes(sink.getvalue())
    info["crc32c"][key] = F.crc32c(sink.getvalue())
    (path / "zarr.json").write_text(json.dumps(doc))
    return key


def test_a_read_of_some_columns_of_a_part_of_many_row_groups_checks_and_keeps_it_group_by_group(tmp_path, monkeypatch):
    """A read of some columns decodes a part row group by row group: the columns its checks
    read (``pos``, ``batch``) held for one group at a time, those kept one chunk a group (a
    part of 20 million token rows read for two columns held its three columns and a combined
    copy of each: 760 MB). The values are the whole table's; a null ``pos`` in a later group
    is refused naming the whole part's count, as the whole table's read does."""
    path = tmp_path / "s.zarr"
    _store(path)
    whole = open_store(path).row_table("token")
    _edit_part_in_row_groups(path, "token", 0, lambda t: t, rows=2)
    assert pq.ParquetFile(path / open_store(path).attrs["row_tables"]["token"]["parts"][0]).num_row_groups == 3
    read = pq.ParquetFile.read

    def whole_part(self, *args, **kwargs):  # (a part of one row group is read whole, as before)
        assert self.num_row_groups < 2, "a part of many row groups was decoded whole"
        return read(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(pq.ParquetFile, "read", whole_part)
        some = open_store(path).row_table("token", columns=["sample_id"])
    assert some.column_names == ["sample_id"] and some.column("sample_id").num_chunks == 4  # (3 groups + part 1)
    assert some.column("sample_id").to_pylist() == whole.column("sample_id").to_pylist()
    assert open_store(path).row_table("token", columns=[]).num_rows == whole.num_rows == 10
    key = _edit_part_in_row_groups(
        path, "token", 0, _set("pos", lambda t: pa.array(t.column("pos").to_pylist()[:2] + [None, 1, None], pa.int64())),
        rows=2)
    said = rf"store '{re.escape(str(path))}': row table 'token': part '{re.escape(key)}' has 2 nulls in its 'pos' column"
    with pytest.raises(StoreCorruptError, match=said):
        open_store(path).row_table("token", columns=["sample_id"])
    with pytest.raises(StoreCorruptError, match=said):
        open_store(path).row_table("token")


def _put_part(path: Path, kind: str, index: int, data: bytes) -> str:
    """Part ``index`` of row table ``kind`` replaced by the bytes ``data``, its crc32c
    recomputed in the root. Its key."""
    doc = json.loads((path / "zarr.json").read_text())
    info = doc["attributes"]["activationscope"]["row_tables"][kind]
    key = info["parts"][index]
    (path / key).write_bytes(data)
    info["crc32c"][key] = F.crc32c(data)
    (path / "zarr.json").write_text(json.dumps(doc))
    return key


@pytest.mark.parametrize("columns", [None, ["sample_id"], ["pos"], []])
def test_a_read_of_many_row_groups_and_parts_of_no_rows_gives_the_rows_pyarrow_reads(tmp_path, columns):
    """Parts of one row a group, and parts of no row among them: the rows and values of each
    column read are those pyarrow reads of the parts, in order."""
    path = tmp_path / "s.zarr"
    _store(path)
    doc = json.loads((path / "zarr.json").read_text())
    info = doc["attributes"]["activationscope"]["row_tables"]["token"]
    parts = []
    for index, key in enumerate(info["parts"]):
        sink = io.BytesIO()
        pq.write_table(pq.read_table(path / key), sink, row_group_size=1)
        _put_part(path, "token", index, sink.getvalue())
        parts.append(pq.read_table(path / key))
    sink = io.BytesIO()
    pq.write_table(parts[0].slice(0, 0), sink)
    doc = json.loads((path / "zarr.json").read_text())
    info = doc["attributes"]["activationscope"]["row_tables"]["token"]
    for at, key in ((0, "rows/token/part-empty-0.parquet"), (2, "rows/token/part-empty-1.parquet")):
        (path / key).write_bytes(sink.getvalue())
        info["parts"].insert(at, key)
        info["crc32c"][key] = F.crc32c(sink.getvalue())
    (path / "zarr.json").write_text(json.dumps(doc))
    store = open_store(path)
    assert [pq.ParquetFile(path / k).num_row_groups for k in store.attrs["row_tables"]["token"]["parts"]] == [1, 5, 1, 5]
    want = pa.concat_tables(parts)
    got = store.row_table("token", columns=columns)
    if columns is not None:
        want = want.select(columns)
    assert got.num_rows == want.num_rows == 10 and got.column_names == want.column_names
    assert got.to_pydict() == want.to_pydict()


@pytest.mark.parametrize("columns", [None, ["sample_id"]])
@pytest.mark.parametrize("lie", ["group", "group and values", "group, values and file", "negative", "too few"])
def test_a_part_whose_footer_lies_about_its_row_counts_is_refused_before_it_is_decoded(tmp_path, monkeypatch,
                                                                                        lie, columns):
    """Parquet allocates each column of a row group by the row count its footer gives: a part
    (its crc32c rewritten to match) whose footer says a row group of 2 rows holds 2**24 had
    hundreds of MB allocated for it, and its rows read as the pages have them. Now the footer's
    counts are checked first: a row group of more rows than its columns have values, a file of
    another count than its groups', a footer that agrees with itself but says more rows than
    the table's n_rows leaves, or a negative count, is refused naming the part, before a value
    is decoded; a group that says fewer rows than it has reads other rows, which the table's
    n_rows refuses."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from parquet_footer import lying_row_counts, spy_decodes

    path = tmp_path / "s.zarr"
    _store(path)
    key = open_store(path).attrs["row_tables"]["token"]["parts"][0]
    sink = io.BytesIO()
    pq.write_table(pq.read_table(path / key), sink, row_group_size=2)
    good = sink.getvalue()
    big = 2**24
    bad, said = {
        "group": (lying_row_counts(good, {0: big}), rf"its row group 0 holds {big} rows, but its column 'sample_id' 2 "
                                                    "values"),
        "group and values": (lying_row_counts(good, {0: big}, values=True),
                             rf"says in its footer that it holds 5 rows, but its row groups {big + 3}"),
        "group, values and file": (lying_row_counts(good, {0: big}, file_rows=big + 3, values=True),
                                   rf"says in its footer that it holds {big + 3} rows, more than the 10 rows the "
                                   r"table's metadata \(n_rows\) leaves for it"),
        "negative": (lying_row_counts(good, {0: -1}, file_rows=4), "its row group 0 holds -1 rows"),
        "too few": (lying_row_counts(good, {0: 1}, file_rows=4, values=True), "row table 'token' has 9 rows in its "
                                                                               "parts, but the metadata says n_rows 10"),
    }[lie]
    assert _put_part(path, "token", 0, bad) == key
    decoded = spy_decodes(monkeypatch)
    with pytest.raises(StoreCorruptError, match=said):
        open_store(path).row_table("token", columns=columns)
    if lie != "too few":
        assert decoded == [], "a part whose footer lies was decoded"
    assert open_store(path).verify() != []  # (verify names the damage too)


def test_a_resume_reads_each_row_table_part_once_and_keeps_its_column_types(tmp_path, monkeypatch):
    """A resume read each row table's first part twice: once for the types of its user columns,
    once for its check (crc32c, footer, required columns). Now once, the types still taken from
    it: a resumed batch giving a column of another type is refused, and one of the stored type
    is stored."""
    from activationscope.errors import ArgumentTypeError
    from activationscope.store._backend import LocalBackend

    path = tmp_path / "s.zarr"
    _store(path)
    parts = [p for kind in ("sample", "token") for p in open_store(path).attrs["row_tables"][kind]["parts"]]
    reads: dict[str, int] = {}
    get = LocalBackend.get

    def counted(self, key, *args, **kwargs):
        reads[key] = reads.get(key, 0) + 1
        return get(self, key, *args, **kwargs)

    monkeypatch.setattr(LocalBackend, "get", counted)
    w = StoreWriter(path, resume=True, **OPTIONS)
    assert {p: reads.get(p, 0) for p in parts} == {p: 1 for p in parts}
    monkeypatch.undo()
    w.open_array("x", (4,), torch.float32, "sample").append(torch.randn(2, 4))
    w.open_array("t", (4,), torch.float32, "token").append(torch.randn(5, 4))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    with pytest.raises(ArgumentTypeError, match=r"column 'label' holds string values in this batch, but int64 in the "
                                                r"earlier batches"):
        w.add_batch(2, [4, 5], mask, {"label": ["a", "b"]})
    with pytest.raises(ArgumentTypeError, match=r"column 'sample_id'|sample ids? .*int64"):
        w.add_batch(2, ["e", "f"], mask, {"label": torch.tensor([7, 8])})
    w.add_batch(2, [4, 5], mask, {"label": torch.tensor([7, 8])})
    w.close()
    s = open_store(path)
    assert s.verify() == []
    assert s.row_table("sample").column("label").to_pylist() == [0, 1, 1, 2, 7, 8]
