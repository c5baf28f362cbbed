"""Datasets read only the row-table columns they need (Parquet column projection).

A dataset with ``filter=``, ``sample_ids=`` or ``columns=`` read the whole row table, every
column, and its source kept it cached with the dataset: 1.2 GB for a token table of 50
million rows, next to the column tensors made of it. Here the columns each read decodes are
recorded (every row-table part goes through ``read_parquet_part``): no read decodes a column
the dataset does not need, no whole table is cached, and the rows and columns selected are
those of the whole table's (computed here with plain pyarrow)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch

import activationscope as acs
from activationscope.analysis.pooling import sentence_rows
from activationscope.data import ActivationDataset
from activationscope.store import reader as R

N_FORWARDS, BATCH, POS = 4, 6, 5


@pytest.fixture(scope="module")
def token_store(tmp_path_factory):
    """A token store of 4 forwards (a row-table part each) with a per-sample ``label`` and
    ``text`` and a per-token ``tag``."""
    path = tmp_path_factory.mktemp("proj") / "t.zarr"
    model = torch.nn.Sequential(torch.nn.Embedding(20, 4), torch.nn.Linear(4, 4)).eval()
    gen = torch.Generator().manual_seed(0)
    with acs.ActivationScope(store=str(path)).track(model, include=["1"]) as tracker, torch.no_grad():
        for f in range(N_FORWARDS):
            ids = torch.randint(0, 20, (BATCH, POS), generator=gen)
            mask = torch.arange(POS)[None, :] < torch.randint(2, POS + 1, (BATCH, 1), generator=gen)
            tracker.set_batch(attention_mask=mask, sample_ids=list(range(f * BATCH, (f + 1) * BATCH)),
                              tag=ids % 3, label=[(f + i) % 2 for i in range(BATCH)],
                              text=[f"s{f}-{i}" for i in range(BATCH)])
            model(ids)
    return str(path)


@pytest.fixture
def decoded(monkeypatch):
    """The columns each row-table part read decodes (None: every column)."""
    seen: list = []
    real = R.read_parquet_part

    def spy(raw, where, key, *args, columns=None, **kw):
        seen.append(None if columns is None else sorted(columns))
        return real(raw, where, key, *args, columns=columns, **kw)

    monkeypatch.setattr(R, "read_parquet_part", spy)
    return seen


def _whole(path):
    """The token rows with their sample's label, as plain pyarrow reads them."""
    st = acs.open_store(path)
    tokens, samples = st.row_table("token"), st.row_table("sample")
    label = dict(zip(zip(samples["batch"].to_pylist(), samples["sample_id"].to_pylist()),
                     samples["label"].to_pylist()))
    labels = [label[k] for k in zip(tokens["batch"].to_pylist(), tokens["sample_id"].to_pylist())]
    return tokens, np.array(labels)


def _columns_decoded(seen) -> set:
    assert None not in seen, "a read decoded every column"
    return {c for cols in seen for c in cols}


def test_a_filter_reads_the_columns_it_names(token_store, decoded):
    tokens, _ = _whole(token_store)
    decoded.clear()
    ds = ActivationDataset(token_store, filter=pc.field("pos") > 0)
    want = np.flatnonzero(tokens["pos"].to_numpy() > 0)
    assert ds.store_rows().tolist() == want.tolist()
    assert _columns_decoded(decoded) <= {"pos", "batch", "rank"}  # (the table's checks)
    assert ds.source._tables == {}  # no whole table kept


def test_a_filter_on_a_sample_column_of_token_rows(token_store, decoded):
    tokens, labels = _whole(token_store)
    decoded.clear()
    ds = ActivationDataset(token_store, columns=["tag"], filter=(pc.field("label") == 1) & (pc.field("pos") < 3))
    want = np.flatnonzero((labels == 1) & (tokens["pos"].to_numpy() < 3))
    assert ds.store_rows().tolist() == want.tolist()
    assert ds[:]["tag"].tolist() == tokens["tag"].to_numpy()[want].tolist()
    assert "text" not in _columns_decoded(decoded)
    assert ds.source._tables == {}


def test_sample_ids_read_the_sample_id_column(token_store, decoded):
    tokens, _ = _whole(token_store)
    decoded.clear()
    ds = ActivationDataset(token_store, sample_ids=[3, 7, 22])
    want = np.flatnonzero(np.isin(tokens["sample_id"].to_numpy(), [3, 7, 22]))
    assert ds.store_rows().tolist() == want.tolist()
    assert _columns_decoded(decoded) <= {"sample_id", "pos", "batch", "rank"}
    assert "tag" not in _columns_decoded(decoded) and "text" not in _columns_decoded(decoded)
    assert ds.source._tables == {}


def test_columns_read_those_columns(token_store, decoded):
    tokens, labels = _whole(token_store)
    decoded.clear()
    ds = ActivationDataset(token_store, columns=["tag", "label"], rows=slice(3, 40))
    got = ds[:]
    assert got["tag"].tolist() == tokens["tag"].to_pylist()[3:40]
    assert got["label"].tolist() == labels[3:40].tolist()
    assert "text" not in _columns_decoded(decoded)
    assert ds.source._tables == {}


def test_an_expression_naming_no_column_is_refused_as_before(token_store):
    with pytest.raises(ValueError, match=r"names field 'nope', which is not a column of the token row table.*"
                                         r"its columns are \[sample_id: int64, pos: int64, batch: int64, tag"):
        ActivationDataset(token_store, filter=pc.field("nope") == 1)


def test_a_callable_filter_still_sees_the_whole_table(token_store):
    tokens, labels = _whole(token_store)
    ds = ActivationDataset(token_store, filter=lambda t: pc.equal(t["text"], "s1-2"))
    want = np.flatnonzero((tokens["batch"].to_numpy() == 1) & (tokens["sample_id"].to_numpy() == BATCH + 2))
    assert ds.store_rows().tolist() == want.tolist()


def test_pooling_reads_the_label_and_the_keys_only(token_store, decoded):
    st = acs.open_store(token_store)
    x, labels = sentence_rows(st, "1.output", label_column="label")
    assert "text" not in _columns_decoded(decoded) and "tag" not in _columns_decoded(decoded)
    assert labels == st.row_table("sample")["label"].to_pylist()


def test_verify_holds_the_keys_of_the_row_tables_only(token_store, monkeypatch):
    """verify read each table whole (1.2 GB for 50 million token rows); it decodes each part
    on its own, then reads the columns that pair token rows with their samples."""
    asked = []
    real = R.Store.row_table

    def spy(self, kind="sample", columns=None, **kw):
        asked.append((kind, columns))
        return real(self, kind, columns, **kw)

    monkeypatch.setattr(R.Store, "row_table", spy)
    assert acs.open_store(token_store).verify() == []
    assert asked and all(columns is not None and "tag" not in columns for _, columns in asked)


def test_an_expression_mask_keeps_the_rows_table_filter_keeps():
    """Expressions are evaluated as one bool column (not by filtering a copy of the table with
    a row-number column: 2.7 GB peak for 20 million token rows); nulls are left out as
    ``Table.filter`` leaves them out, and a non-bool expression is refused as it refuses it."""
    import pyarrow as pa

    from activationscope.data.dataset import _expression_mask

    t = pa.table({"x": pa.array([1, None, 3, 4, None, 0] * 50), "y": pa.array(list(range(300)))})
    t = pa.concat_tables([t.slice(0, 100), t.slice(100)])  # (two chunks)
    for expr in (pc.field("x") > 0, (pc.field("x") > 0) | (pc.field("y") < 3), pc.field("x").is_null(),
                 pc.scalar(True), pc.field("y") * 7 == 21):
        want = np.zeros(t.num_rows, dtype=bool)
        want[t.append_column("i", pa.array(np.arange(t.num_rows))).filter(expr)["i"].to_numpy()] = True
        got = _expression_mask(expr, t)
        assert got.dtype == bool and got.tolist() == want.tolist(), expr
    with pytest.raises(pa.ArrowTypeError, match="must evaluate to bool"):
        _expression_mask(pc.field("y") + 1, t)


def test_a_filter_that_is_not_bool_is_refused_as_before(token_store):
    with pytest.raises(ValueError, match=r"cannot be evaluated on the token row table.*must evaluate to bool"):
        ActivationDataset(token_store, filter=pc.field("pos") + 1)


def test_token_rows_take_their_sample_columns_with_one_index_of_the_rows():
    """Each token row's sample was found through three int64 arrays of every token row (a
    cumulative sum, it less one, the index taken: 480 MB at 20 million token rows) and a
    fourth for the take; now each run's sample is repeated over its rows, one array."""
    import tracemalloc

    import pyarrow as pa

    from activationscope.data.dataset import _with_sample_columns

    n_samples, per = 2000, 500
    nt = n_samples * per
    samples = pa.table({"sample_id": np.arange(n_samples), "batch": np.arange(n_samples) // 64,
                        "label": np.arange(n_samples) % 3})
    tokens = pa.table({"sample_id": np.repeat(np.arange(n_samples), per), "pos": np.tile(np.arange(per), n_samples),
                       "batch": np.repeat(np.arange(n_samples) // 64, per)})

    class Source:
        def row_table(self, kind, columns=None):
            assert kind == "sample"
            return samples if columns is None else samples.select([c for c in columns if c in samples.column_names])

        def describe(self):
            return "a table"

    tracemalloc.start()
    try:
        got = _with_sample_columns(tokens, Source(), ["label"], tokens.column_names)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got["label"].to_numpy().tolist() == np.repeat(np.arange(n_samples) % 3, per).tolist()
    assert peak < 2 * nt * 8, peak  # (before: 18 MB, now 9)


def _exported(fmt, path):
    """The row-table columns of an export as a pyarrow Table (an HF folder's data included)."""
    import pyarrow.parquet as pq

    if fmt == "arrow":
        with pa.ipc.open_file(pa.memory_map(str(path))) as f:
            return f.read_all()
    if fmt == "hf":
        import datasets

        return datasets.load_from_disk(str(path)).data.table
    return pq.read_table(str(path))


@pytest.mark.parametrize("fmt", ["arrow", "parquet", "hf"])
def test_an_export_with_columns_reads_those_columns(token_store, decoded, tmp_path, fmt):
    """export_* with columns= read every column of the row table (the per-sample text of each
    token row joined on, too) and the source cached it: it decodes the columns it writes and
    their join keys, and writes the same file as an export of every column, those selected."""
    from activationscope.data import export_arrow, export_hf, export_parquet

    if fmt == "hf":
        pytest.importorskip("datasets")
    export = {"arrow": export_arrow, "parquet": export_parquet, "hf": export_hf}[fmt]
    tokens, labels = _whole(token_store)
    whole = _exported(fmt, export(token_store, tmp_path / "all", batch_rows=7))
    decoded.clear()
    ds = ActivationDataset(token_store, filter=pc.field("pos") > 0)
    decoded.clear()
    got = _exported(fmt, export(ds, tmp_path / "some", columns=["label", "tag"], batch_rows=7))
    assert "text" not in _columns_decoded(decoded)
    assert ds.source._tables == {}  # no whole table kept
    want = np.flatnonzero(tokens["pos"].to_numpy() > 0)
    assert got.column_names == ["1.output", "label", "tag"]
    assert got["tag"].to_pylist() == tokens["tag"].to_numpy()[want].tolist()
    assert got["label"].to_pylist() == labels[want].tolist()
    full = whole.take(pa.array(want, pa.int64()))
    for name in got.column_names:
        assert got[name].combine_chunks().equals(full[name].combine_chunks()), name
    assert got.schema.field("label") == whole.schema.field("label")


def test_an_export_with_no_columns_decodes_none(token_store, decoded, tmp_path):
    from activationscope.data import export_parquet

    decoded.clear()
    got = _exported("parquet", export_parquet(token_store, tmp_path / "x.parquet", columns=[]))
    assert got.column_names == ["1.output"]
    assert _columns_decoded(decoded) <= {"pos", "batch", "rank"}  # (the table's checks)


@pytest.mark.parametrize("sample_ids", [None, list(range(3, 20))])
def test_a_filter_naming_a_column_by_its_position_sees_the_whole_table(token_store, sample_ids):
    """``pc.field(i)`` names the i-th column of the whole row table: a table of only the
    columns named in the expression's text put another column (or a row number) at that place,
    and the filter selected by it without a word."""
    tokens, _ = _whole(token_store)
    ids = tokens["sample_id"].to_numpy()
    keep = ids >= 5 if sample_ids is None else (ids >= 5) & np.isin(ids, sample_ids)
    ds = ActivationDataset(token_store, filter=pc.field(0) >= 5, sample_ids=sample_ids)
    assert ds.store_rows().tolist() == np.flatnonzero(keep).tolist()
    pos, tag = tokens["pos"].to_numpy(), tokens["tag"].to_numpy()  # (column 1, column 3)
    keep = (pos > 0) & (tag < 2) & (True if sample_ids is None else np.isin(ids, sample_ids))
    ds = ActivationDataset(token_store, filter=(pc.field(1) > 0) & (pc.field("tag") < 2), sample_ids=sample_ids,
                           columns=["tag"])
    assert ds.store_rows().tolist() == np.flatnonzero(keep).tolist()


def test_a_sample_column_of_token_rows_is_made_in_about_the_memory_of_its_tensor(tmp_path):
    """``columns=["label"]`` of token rows held, at once, every key of the token table (its
    ``batch`` and ``sample_id``), the ``pos`` column its checks read, a combined copy of each,
    an index of the token rows, the label taken at them and a copy of that for the tensor:
    about 870 MB for a 160 MB tensor at 20 million rows. Now the keys are read one at a time
    (each part row group by row group), each run of a sample's rows repeats its label into
    the tensor's own memory: Arrow's and numpy's peaks together stay under 3.5 times it."""
    import tracemalloc

    from activationscope.store import StoreWriter

    per_forward, pos, n_forwards = 4096, 128, 8  # (4 Mi token rows: the writer's row groups hold 1 Mi)
    path = tmp_path / "t.zarr"
    w = StoreWriter(path, commit_interval=60.0)
    x = w.open_array("x", (1,), torch.float16, "token")
    for f in range(n_forwards):
        x.append(torch.zeros(per_forward * pos, 1, dtype=torch.float16))
        ids = list(range(f * per_forward, (f + 1) * per_forward))
        w.add_batch(per_forward, ids, torch.ones(per_forward, pos, dtype=torch.bool),
                    columns={"label": torch.tensor(ids) % 7})
    w.close()
    store = acs.open_store(path)
    store.row_table("sample", ["sample_id"])  # (the store's own first reads: not the dataset's)
    default = pa.default_memory_pool()
    arrow = pa.proxy_memory_pool(default)
    pa.set_memory_pool(arrow)
    tracemalloc.start()
    try:
        ds = ActivationDataset(store, columns=["label"])
        numpy_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        pa.set_memory_pool(default)
    label = ds._column_values()["label"]
    n = per_forward * pos * n_forwards
    assert label.dtype == torch.int64 and label.shape == (n,)
    assert torch.equal(label, (torch.arange(n) // pos) % 7)
    assert arrow.max_memory() + numpy_peak < 3.5 * label.nbytes, (arrow.max_memory(), numpy_peak, label.nbytes)
