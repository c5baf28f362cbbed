"""A commit's row-table part holds every batch it covers: built one array per column when
the batches hold the same numeric columns, one table per batch otherwise; both read back the
same rows, types and nulls."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from activationscope.store import StoreWriter, open_store

HP = "0.output"


def _capture(path, columns_of, monkeypatch, ids=torch.arange, one_table=False):
    w = StoreWriter(path, chunk_rows=4, shard_bytes=8 * 4 * 4)
    a = w.open_array(HP, (4,), torch.float32, "sample")
    with monkeypatch.context() as m:
        if one_table:  # the writer must not join one table per batch

            def no_concat(*a, **k):
                raise AssertionError("one table per batch")

            m.setattr(pa, "concat_tables", no_concat)
        for b in range(6):
            a.append(torch.full((3, 4), float(b)))
            w.add_batch(3, ids(3 * b, 3 * b + 3), None, columns_of(b))
        w.close()
    return open_store(path).row_table("sample")


def test_numeric_columns_of_every_batch_make_one_array_per_column(tmp_path, monkeypatch):
    t = _capture(tmp_path / "s.zarr", lambda b: {"label": torch.arange(3) + b, "score": torch.full((3,), b / 2),
                                                 "keep": torch.tensor([True, False, b % 2 == 0])},
                 monkeypatch, one_table=True)
    assert t.column("sample_id").to_pylist() == list(range(18))
    assert t.column("batch").to_pylist() == [b for b in range(6) for _ in range(3)]
    assert t.column("label").to_pylist() == [b + i for b in range(6) for i in range(3)]
    assert t.column("score").to_pylist() == [b / 2 for b in range(6) for _ in range(3)]
    assert t.column("keep").to_pylist() == [v for b in range(6) for v in (True, False, b % 2 == 0)]
    assert t.schema.field("sample_id").type == pa.int64() and t.schema.field("keep").type == pa.bool_()


def test_batches_with_other_columns_or_strings_are_joined_table_by_table(tmp_path, monkeypatch):
    def columns(b):
        out = {"name": [f"s{3 * b + i}" for i in range(3)]}
        if b >= 3:  # a column first given in a later batch: null before it
            out["late"] = np.arange(3, dtype=np.int64) + 10 * b
        return out

    t = _capture(tmp_path / "s.zarr", columns, monkeypatch, ids=lambda a, b: list(range(a, b)))
    assert t.column("name").to_pylist() == [f"s{i}" for i in range(18)]
    assert t.column("late").to_pylist() == [None] * 9 + [10 * b + i for b in range(3, 6) for i in range(3)]
    assert t.column("sample_id").to_pylist() == list(range(18))


def test_a_reused_ids_or_column_buffer_does_not_change_earlier_batches(tmp_path):
    """The row table is written at a commit: the writer keeps copies of each batch's sample
    ids and columns, not views of tensors or arrays the caller fills again for the next batch."""
    import activationscope as acs

    model = torch.nn.Sequential(torch.nn.Linear(4, 2)).eval()
    ids, label, arr = torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), np.zeros(3)
    with acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(model) as tr, torch.no_grad():
        for b in range(4):
            ids.copy_(torch.arange(3 * b, 3 * b + 3))
            label.fill_(b)
            arr[:] = b / 2
            tr.set_batch(sample_ids=ids, label=label, half=arr)
            model(torch.randn(3, 4))
    t = open_store(tmp_path / "s.zarr").row_table("sample")
    assert t.column("sample_id").to_pylist() == list(range(12))
    assert t.column("label").to_pylist() == [b for b in range(4) for _ in range(3)]
    assert t.column("half").to_pylist() == [b / 2 for b in range(4) for _ in range(3)]


def test_sample_ids_of_another_type_than_the_earlier_batches_are_refused(tmp_path):
    """int64 then int32 sample ids made a row table no reader could open (its parts disagree);
    now set_batch refuses them, naming both types, before the forward, also after a resume."""
    import activationscope as acs
    from activationscope.errors import ArgumentTypeError

    model = torch.nn.Sequential(torch.nn.Linear(4, 2)).eval()
    path = str(tmp_path / "s.zarr")
    with acs.ActivationScope(store=path).track(model) as tr, torch.no_grad():
        tr.set_batch(sample_ids=torch.arange(3))
        model(torch.randn(3, 4))
        with pytest.raises(ArgumentTypeError, match=r"sample_ids holds int32 values in this batch, but int64 in the "
                                                    r"earlier batches"):
            tr.set_batch(sample_ids=torch.arange(3, 6, dtype=torch.int32))
        with pytest.raises(ArgumentTypeError, match=r"sample_ids holds string values"):
            tr.set_batch(sample_ids=["a", "b", "c"])
        tr.set_batch(sample_ids=torch.arange(3, 6))
        model(torch.randn(3, 4))
    with acs.ActivationScope(store=path, store_options={"resume": True}).track(model) as tr, torch.no_grad():
        with pytest.raises(ArgumentTypeError, match=r"sample_ids holds int32 values in this batch, but int64"):
            tr.set_batch(sample_ids=torch.arange(6, 9, dtype=torch.int32))
        tr.set_batch(sample_ids=torch.arange(6, 9))
        model(torch.randn(3, 4))
    assert open_store(path).row_table("sample").column("sample_id").to_pylist() == list(range(9))


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
                                   np.float16, np.float32, np.float64, np.bool_])
@pytest.mark.parametrize("n", [0, 5])
def test_arrow_type_of_a_numeric_column_is_the_type_pyarrow_gives_it(dtype, n):
    from activationscope.store.writer import _arrow_type

    a = np.arange(n).astype(dtype)
    assert _arrow_type(a) == pa.array(a).type
    assert _arrow_type(list(a)) == (pa.array(list(a)).type if n else None)  # a list: no values, no type yet


def test_arrow_type_of_other_columns_is_found_by_pyarrow():
    from activationscope.store.writer import _arrow_type

    assert _arrow_type(np.array(["a", "bc"])) == pa.string()
    assert _arrow_type(np.array([None, None], dtype=object)) is None
    assert _arrow_type(np.array([None, 3], dtype=object)) == pa.int64()
    with pytest.raises(pa.ArrowNotImplementedError):  # as pyarrow: a byte-swapped array has no Arrow type
        _arrow_type(np.arange(3, dtype=">i4"))


def test_row_counts_match_the_rows_each_array_got_since_the_last_batch(tmp_path):
    """The native per-batch row check against the rule written out in Python: every array's
    rows now, and those whose rows since the last step are not the batch's samples (sample
    rows) or tokens (token rows)."""
    from activationscope.capture import _native

    _C = _native.load()
    core = _C.StoreCore(1 << 24, False)
    kinds = [False, True, False, True, False]  # token rows?
    writers = [_C.ArrayWriter(core, f"a{i}", str(tmp_path / f"a{i}"), str(tmp_path / f"a{i}"), torch.float32, [2],
                              4, 2, 0, False) for i in range(len(kinds))]
    counts = _C.RowCounts()
    last = [0] * len(kinds)
    for w, tok in zip(writers, kinds):
        counts.add(w, tok, 0)
    assert len(counts) == len(kinds)
    g = np.random.default_rng(0)
    for step in range(30):
        n, n_tok = int(g.integers(1, 5)), int(g.integers(0, 9))
        for i, (w, tok) in enumerate(zip(writers, kinds)):
            rows = (n_tok if tok else n) + (int(g.integers(-1, 2)) if g.random() < 0.3 else 0)
            if rows > 0:
                w.append(torch.zeros(rows, 2))
        now = [w.n_rows for w in writers]
        assert counts.since_last() == [a - b for a, b in zip(now, last)]
        cums, off = counts.step(n, n_tok)
        want = [(i, now[i] - last[i]) for i in range(len(kinds)) if now[i] - last[i] != (n_tok if kinds[i] else n)]
        assert cums == tuple(now) and off == want
        last = now
    assert counts.since_last() == [0] * len(kinds)
    for w in writers:
        w.flush()
    core.close()


def test_default_sample_ids_between_given_ones_number_on_from_every_sample_before(tmp_path):
    """Batches with default sample ids have their row-table rows made at the commit, a run of
    them at once; given ids, token masks and columns between them keep their own rows. The
    rows are those of the rule: a default id is the count of samples before it."""
    path = tmp_path / "s.zarr"
    w = StoreWriter(path, chunk_rows=4, shard_bytes=8 * 4 * 4, commit_interval=3600)
    a = w.open_array(HP, (4,), torch.float32, "sample")
    plan = [None, None, torch.arange(100, 103), None, "commit", None, torch.arange(200, 203), torch.arange(300, 303),
            None, None, None]
    want_ids, want_batch, b, n_before = [], [], 0, 0
    for step in plan:
        if isinstance(step, str):
            w._core.drain()
            w.commit()
            continue
        a.append(torch.full((3, 4), float(b)))
        w.add_batch(3, step)
        want_ids += list(range(n_before, n_before + 3)) if step is None else step.tolist()
        want_batch += [b] * 3
        b, n_before = b + 1, n_before + 3
    w.close()
    table = open_store(path).row_table("sample")
    assert table.column("sample_id").to_pylist() == want_ids
    assert table.column("batch").to_pylist() == want_batch
    assert table.schema.field("sample_id").type == pa.int64()


def test_default_sample_ids_after_ids_of_another_type_are_refused(tmp_path):
    w = StoreWriter(tmp_path / "s.zarr", chunk_rows=4, shard_bytes=8 * 4 * 4)
    a = w.open_array(HP, (4,), torch.float32, "sample")
    a.append(torch.zeros(2, 4))
    w.add_batch(2, ["a", "b"])
    with pytest.raises(TypeError, match=r"sample_ids holds int64 values in this batch, but string"):
        w.add_batch(2)
    a.append(torch.zeros(2, 4))
    w.add_batch(2, ["c", "d"])
    w.close()
    assert open_store(tmp_path / "s.zarr").row_table("sample").column("sample_id").to_pylist() == ["a", "b", "c", "d"]


@pytest.mark.parametrize("columns", [None, {"label": [1, 2]}])
def test_a_negative_number_of_samples_is_refused_and_the_rows_before_kept(tmp_path, columns):
    from activationscope.errors import ArgumentValueError

    w = StoreWriter(tmp_path / "s.zarr", chunk_rows=4, shard_bytes=8 * 4 * 4, commit_interval=0)
    a = w.open_array(HP, (4,), torch.float32, "sample")
    a.append(torch.ones(3, 4))
    w.add_batch(3)
    with pytest.raises(ArgumentValueError, match=r"n_samples must be an int in \[0, 2\*\*31\), got -2"):
        w.add_batch(-2, None, None, columns)
    w.close()
    s = open_store(tmp_path / "s.zarr")
    assert s.status == "complete" and s.n_samples == 3
    assert s.row_table("sample").column("sample_id").to_pylist() == [0, 1, 2]


@pytest.mark.parametrize("value, error", [
    (-0.5, TypeError), (2.7, TypeError), (np.float32(2.9), TypeError), (True, TypeError), ("3", TypeError),
    (torch.tensor([2.0]), TypeError), (float("nan"), TypeError), (2 ** 31, ValueError), (np.uint64(2 ** 63), ValueError),
    (2 ** 40, ValueError), (-1, ValueError), (np.int32(-1), ValueError),
])
def test_n_samples_that_is_no_count_is_refused_and_nothing_recorded(tmp_path, value, error):
    w = StoreWriter(tmp_path / "s.zarr", chunk_rows=4, shard_bytes=8 * 4 * 4, commit_interval=0)
    a = w.open_array(HP, (4,), torch.float32, "sample")
    a.append(torch.ones(2, 4))
    w.add_batch(2)
    with pytest.raises(error, match="n_samples must be an int"):
        w.add_batch(value)
    a.append(torch.ones(2, 4))
    w.add_batch(np.int64(2))
    w.add_batch(torch.tensor(0))
    w.close()
    s = open_store(tmp_path / "s.zarr")
    assert s.status == "complete" and s.row_table("sample").column("sample_id").to_pylist() == [0, 1, 2, 3]


def test_a_batch_of_many_default_ids_gets_them_at_once(tmp_path, monkeypatch):
    from activationscope.store import writer

    monkeypatch.setattr(writer, "_DEFERRED_IDS_MAX", 3)
    w = StoreWriter(tmp_path / "s.zarr", chunk_rows=4, shard_bytes=8 * 4 * 4)
    a = w.open_array(HP, (4,), torch.float32, "sample")
    for n in (2, 5, 3, 4):
        a.append(torch.ones(n, 4))
        w.add_batch(n)
    w.close()
    table = open_store(tmp_path / "s.zarr").row_table("sample")
    assert table.column("sample_id").to_pylist() == list(range(14))
    assert table.column("batch").to_pylist() == [0] * 2 + [1] * 5 + [2] * 3 + [3] * 4


@pytest.mark.parametrize("typ, values", [
    (pa.string_view(), ["a", None, "bc"]),
    (pa.binary_view(), [b"a", None, b"\x00c"]),
    (pa.list_view(pa.string()), [["a", None], ["b"], []]),
    (pa.large_list_view(pa.string_view()), [["a"], [], ["b", "c"]]),
    (pa.struct([("q", pa.list_view(pa.binary_view()))]), [{"q": [b"a"]}, None, {"q": None}]),
])
def test_view_columns_read_back_as_the_file_holds_them(tmp_path, monkeypatch, typ, values):
    """Columns of Arrow view types (an Arrow array of strings given as a column) read back as
    the plain Parquet read gives them: Arrow casts no dictionary to a view type, and the
    checked read first reads strings as dictionaries."""
    import pyarrow.parquet as pq

    column = pa.array(values * 6, typ)
    t = _capture(tmp_path / "s.zarr", lambda b: {"v": column.slice(3 * b, 3)}, monkeypatch)
    part = next((tmp_path / "s.zarr" / "rows" / "sample").iterdir())
    plain = pq.ParquetFile(part).read()
    assert plain.schema.field("v").type == typ
    assert t.schema.equals(plain.schema, check_metadata=True) and t.equals(plain)
    assert t.column("v").to_pylist() == values * 6


def test_a_list_view_of_long_dictionary_strings_counts_them_decoded():
    """A list view's strings count at their decoded size (as a list's): a small part whose
    list-view column decodes beyond the bound is refused."""
    import io

    import pyarrow.parquet as pq

    from activationscope._safeio import read_parquet_part
    from activationscope.errors import StoreCorruptError

    sink = io.BytesIO()
    pq.write_table(pa.table({"v": pa.array([["x" * 4096]] * 64, pa.list_view(pa.string()))}), sink)
    raw = sink.getvalue()
    assert len(raw) < 64 * 4096 // 4
    ok = read_parquet_part(raw, "s.zarr", "rows/sample/part-000000.parquet", max_decoded=1 << 20)
    assert ok.column("v").to_pylist() == [["x" * 4096]] * 64
    with pytest.raises(StoreCorruptError, match=r"part 'rows/sample/part-000000.parquet' decodes to \d+ bytes"):
        read_parquet_part(raw, "s.zarr", "rows/sample/part-000000.parquet", max_decoded=64 * 4096 - 1)


def test_a_read_of_some_columns_decodes_those_and_reads_them_as_the_whole_table(tmp_path, monkeypatch):
    """``row_table(kind, columns=[...])`` decodes only the columns named (Parquet column
    projection), in that order; a name the table has no column of is left out. Their values
    are those of the whole table, a column that starts in a later part null before it."""
    import pyarrow.parquet as pq

    def columns(b):
        out = {"name": [f"s{3 * b + i}" for i in range(3)], "score": torch.full((3,), b / 2)}
        if b >= 3:
            out["late"] = np.arange(3, dtype=np.int64) + 10 * b
        return out

    whole = _capture(tmp_path / "s.zarr", columns, monkeypatch, ids=lambda a, b: list(range(a, b)))
    decoded = []
    read = pq.ParquetFile.read

    def recorded(self, columns=None, **kwargs):
        decoded.append(columns)
        return read(self, columns=columns, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read", recorded)
    some = open_store(tmp_path / "s.zarr").row_table("sample", columns=["late", "sample_id", "absent", "late"])
    assert some.column_names == ["late", "sample_id"]
    assert some.column("late").to_pylist() == whole.column("late").to_pylist() == [None] * 9 + [
        10 * b + i for b in range(3, 6) for i in range(3)]
    assert some.column("sample_id").to_pylist() == whole.column("sample_id").to_pylist() == list(range(18))
    # (batch is read too: the order of the parts is checked by it)
    assert decoded and all(set(c) <= {"late", "sample_id", "batch"} and "name" not in c for c in decoded), decoded
    assert open_store(tmp_path / "s.zarr").row_table("sample", columns=[]).num_rows == 18


@pytest.mark.parametrize("columns", ["sample_id", ["sample_id", 3], 5])
def test_columns_that_are_no_list_of_names_are_refused(tmp_path, monkeypatch, columns):
    from activationscope.errors import ArgumentTypeError

    _capture(tmp_path / "s.zarr", lambda b: {}, monkeypatch)
    with pytest.raises(ArgumentTypeError, match=r"columns must be a list of column names \(str\), got "):
        open_store(tmp_path / "s.zarr").row_table("sample", columns=columns)


def test_a_part_s_footer_is_parsed_once_per_read(tmp_path, monkeypatch):
    """A row-table part's Parquet footer was parsed twice per read (once for the checks of its
    row counts and schema, again by the reader that decodes it: by a third reader where a
    column of a view type is read again, and a resume parsed it once more before): now once,
    the readers given the parsed footer. Each read still decodes what it did."""
    import io
    import sys
    from pathlib import Path

    import pyarrow.parquet as pq

    sys.path.insert(0, str(Path(__file__).parent))
    from parquet_footer import spy_footer_parses

    from activationscope._safeio import read_parquet_part

    def part(table, **kwargs):
        sink = io.BytesIO()
        pq.write_table(table, sink, **kwargs)
        return sink.getvalue()

    table = pa.table({"sample_id": pa.array(range(40), pa.int64()), "batch": pa.array([i // 8 for i in range(40)]),
                      "name": pa.array([f"s{i}" for i in range(40)])})
    views = pa.table({"v": pa.array([["a"], []] * 20, pa.list_view(pa.string()))})  # (read again as the file's type)
    parsed = spy_footer_parses(monkeypatch)
    for raw, kwargs, expected in [
            (part(table, row_group_size=16), {}, table),
            (part(table, row_group_size=16), {"columns": ["name", "batch"]}, table.select(["batch", "name"])),
            (part(table, row_group_size=16), {"each": lambda g: g.select(["name"]), "max_rows": 40}, table.select(["name"])),
            (part(views), {}, views)]:
        parsed.clear()
        schemas: list = []
        got = read_parquet_part(raw, "s.zarr", "rows/sample/part-000000.parquet", schemas=schemas, **kwargs)
        assert got.equals(expected) and schemas == [expected.schema if "v" in expected.column_names else table.schema]
        assert len(parsed) == 1, (kwargs, parsed)

    path = tmp_path / "s.zarr"
    _capture(path, lambda b: {"name": [f"s{3 * b + i}" for i in range(3)]}, monkeypatch)
    import json

    n_parts = len(json.loads((path / "zarr.json").read_text())["attributes"]["activationscope"]["row_tables"]
                  ["sample"]["parts"])
    s = open_store(path)
    parsed.clear()
    assert s.row_table("sample").column("name").to_pylist() == [f"s{i}" for i in range(18)]
    assert len(parsed) == n_parts, parsed
    parsed.clear()
    w = StoreWriter(path, resume=True, chunk_rows=4, shard_bytes=8 * 4 * 4)  # (its checks of the parts committed)
    try:
        assert len(parsed) == n_parts, parsed  # (the first part's column types: from the footer its check parsed)
    finally:
        w.close()


@pytest.mark.parametrize("typ, values", [
    (pa.list_(pa.string()), [["a", "bc"], [], None, ["d"]]),
    (pa.struct([("q", pa.list_(pa.binary()))]), [{"q": [b"a"]}, None, {"q": None}, {"q": []}]),
    (pa.list_(pa.list_(pa.string())), [[["a"], []], None, [["b", "c"]], []]),
])
def test_a_part_of_row_groups_with_nested_strings_reads_back(tmp_path, typ, values):
    """A part of more than one row group holding strings inside lists or structs (a column of
    token strings per sample: the writer's parts start a row group every 2**20 rows) was
    refused as "not a readable Parquet file" (ArrowNotImplementedError: Nested data
    conversions not implemented for chunked array outputs: its strings, read as dictionaries
    for the decoded-size bound, differ by row group). Now it is read row group by row group,
    as the file holds it, bound and checks unchanged."""
    import io

    import pyarrow.parquet as pq

    from activationscope._safeio import read_parquet_part
    from activationscope.errors import StoreCorruptError

    table = pa.table({"sample_id": pa.array(range(40), pa.int64()), "v": pa.array(values * 10, typ)})
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=16)
    raw = sink.getvalue()
    key = "rows/sample/part-000000.parquet"
    assert read_parquet_part(raw, "s.zarr", key).equals(table)
    assert read_parquet_part(raw, "s.zarr", key, columns=["v"]).equals(table.select(["v"]))
    assert read_parquet_part(raw, "s.zarr", key, columns=["sample_id"]).equals(table.select(["sample_id"]))
    with pytest.raises(StoreCorruptError, match=rf"part '{key}' decodes to \d+ bytes"):
        read_parquet_part(raw, "s.zarr", key, max_decoded=64)
