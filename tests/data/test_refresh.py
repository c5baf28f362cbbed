"""A dataset sharing the source of one made before ``store.refresh()`` reads the rows the
store has after it: the source forgets the row layouts, segment views, read-ahead windows and
row tables it cached for the old commit (they held the old row count, and a last shard that
has grown since). Reference: the same store opened afresh, and plain PyTorch."""

from __future__ import annotations

import pytest
import torch

from activationscope import ActivationScope, open_store
from activationscope.data import ActivationDataset
from activationscope.data.dataset import collate
from activationscope.store import StoreWriter

HP = "x"


def _write(path, data, *, resume=False, overwrite=False, compression=None):
    """``data`` as rows of ``HP``, shards of 32 rows (so a store of 40 rows ends in a part-filled shard)."""
    w = StoreWriter(path, resume=resume, overwrite=overwrite, compression=compression, chunk_rows=8, shard_rows=32)
    a = w.open_array(HP, (3,), torch.float32, "sample")
    a.append(data)
    w.add_batch(len(data))
    w.close()


def _warm(ds):
    """Read the dataset every way it reads, so the source caches layouts, segments, windows, hints and tables."""
    n = len(ds)
    ds[:]
    ds[n - 1]
    ds[[n - 1, 0]]
    for a in range(0, n, 4):
        ds.__getitems__(range(a, min(n, a + 4)))
    ds.block_boundaries()
    ds.source.row_table("sample")


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_dataset_made_after_refresh_reads_the_rows_another_writer_added(tmp_path, compression):
    path = str(tmp_path / "s.zarr")
    data = torch.randn(100, 3, generator=torch.Generator().manual_seed(0))
    _write(path, data[:40], compression=compression)
    store = open_store(path)
    old = ActivationDataset(store, columns=["sample_id"])
    _warm(old)
    _write(path, data[40:], resume=True, compression=compression)  # a second writer grows the store
    assert len(ActivationDataset(old)) == 40  # not refreshed: the snapshot it was opened on
    store.refresh()
    fresh = open_store(path)
    for new in (ActivationDataset(old), ActivationDataset(old.source, columns=["sample_id"]), ActivationDataset(store)):
        assert len(new) == 100
        assert torch.equal(new[:][HP], data) and torch.equal(new[:][HP], fresh.rows(HP, 0, 100))
        assert torch.equal(new[99][HP], data[99]) and torch.equal(new[40][HP], data[40])
        assert torch.equal(new[[99, 3, 45, 70]][HP], data[[99, 3, 45, 70]])  # gather / take across the new shards
        assert torch.equal(new[torch.tensor([33, 63])][HP], data[[33, 63]])  # the shard that was part-filled
        for a in range(0, 100, 7):  # sequential batches (the source's and the dataset's windows)
            assert torch.equal(collate(new.__getitems__(range(a, min(100, a + 7))))[HP], data[a : a + 7]), a
        assert torch.equal(new.block_boundaries(), ActivationDataset(path).block_boundaries())
    shared = ActivationDataset(old, columns=["sample_id"])
    assert shared[:]["sample_id"].tolist() == list(range(100))  # the row table of the new commit
    # the dataset made before the refresh keeps its 40 rows, read through the new layout
    assert len(old) == 40
    assert torch.equal(old[:][HP], data[:40]) and torch.equal(old[[39, 0]][HP], data[[39, 0]])
    assert old[:]["sample_id"].tolist() == list(range(40))


def test_resumed_capture_then_refresh_reads_the_captured_activations(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(5, 4, generator=g) for _ in range(6)]
    path = tmp_path / "s.zarr"

    def capture(batches, resume=False):
        scope = ActivationScope(store=path, store_options={"resume": True} if resume else {})
        with torch.no_grad(), scope.track(model, include=["0"]):
            for x in batches:
                model(x)

    capture(xs[:2])
    store = open_store(path)
    ds = ActivationDataset(store, hook_points=["0.output"])
    _warm(ds)
    capture(xs[2:], resume=True)
    store.refresh()
    new = ActivationDataset(ds)
    with torch.no_grad():
        ref = torch.cat([model[0](x) for x in xs])
    assert len(new) == 30
    assert torch.equal(new[:]["0.output"], open_store(path).rows("0.output", 0, 30))
    torch.testing.assert_close(new[10:30]["0.output"], ref[10:30])
    torch.testing.assert_close(new[[29, 12]]["0.output"], ref[[29, 12]])


def test_the_sequential_window_is_not_used_after_a_refresh(tmp_path):
    """A store overwritten by another run and refreshed: a dataset's sequential window (a view
    of the old run's mapped rows) must not serve the old rows: the dataset refuses to read (its
    length and selection are the old run's); one made after the refresh reads the new rows."""
    from activationscope.errors import StoreError

    path = str(tmp_path / "s.zarr")
    first = torch.randn(64, 3, generator=torch.Generator().manual_seed(1))
    second = torch.randn(64, 3, generator=torch.Generator().manual_seed(2))
    _write(path, first)
    store = open_store(path)
    ds = ActivationDataset(store)
    assert torch.equal(collate(ds.__getitems__(range(0, 4)))[HP], first[:4])
    assert ds._window is not None and ds._window[1] > 8  # the next batches come from the window
    _write(path, second, overwrite=True)
    store.refresh()
    assert torch.equal(store.rows(HP, 4, 8), second[4:8])
    with pytest.raises(StoreError, match="holds another run than when this dataset was made"):
        ds.__getitems__(range(4, 8))
    assert torch.equal(ds.source.read(HP, 8, 12), second[8:12])
    new = ActivationDataset(ds)
    assert torch.equal(collate(new.__getitems__(range(4, 8)))[HP], second[4:8])
    assert torch.equal(collate(new.__getitems__(range(12, 16)))[HP], second[12:16])


def test_a_dataset_made_before_another_run_overwrote_the_store_refuses_to_read_after_refresh(tmp_path):
    """Its length, row selection and columns are the old run's: paired with the new run's rows
    they would be silently wrong, so it raises, naming both runs; a dataset made after the
    refresh reads the new run."""
    from activationscope.errors import StoreError

    path = str(tmp_path / "s.zarr")
    old_data, new_data = torch.arange(120.0).reshape(40, 3), 1000 + torch.arange(150.0).reshape(50, 3)
    _write(path, old_data)
    store = open_store(path)
    run = store.attrs["run_id"]
    plain = ActivationDataset(store, columns=["sample_id"])
    picked = ActivationDataset(store, rows=[3, 1, 39])
    _warm(plain)
    _warm(picked)
    assert torch.equal(picked[:][HP], old_data[[3, 1, 39]])
    _write(path, new_data, overwrite=True)  # another run in its place
    store.refresh()
    assert store.attrs["run_id"] != run
    for ds in (plain, picked):
        for read in (lambda d: d[:], lambda d: d[0], lambda d: d[torch.tensor(1)], lambda d: d[[0, 1]],
                     lambda d: d.__getitems__(range(0, 2)), lambda d: d.get_batch(slice(0, 2))):
            with pytest.raises(StoreError, match=rf"holds another run than when this dataset was made \(run {run} then"):
                read(ds)
    new = ActivationDataset(store, columns=["sample_id"])
    assert len(new) == 50 and torch.equal(new[:][HP], new_data) and new[:]["sample_id"].tolist() == list(range(50))
    assert torch.equal(ActivationDataset(plain.source)[:][HP], new_data)  # the shared source reads the new run


def test_a_dataset_of_a_store_grown_by_a_resume_keeps_reading_its_rows_after_refresh(tmp_path):
    path = str(tmp_path / "s.zarr")
    data = torch.randn(70, 3, generator=torch.Generator().manual_seed(1))
    _write(path, data[:40])
    store = open_store(path)
    ds = ActivationDataset(store, columns=["sample_id"])
    _warm(ds)
    _write(path, data[40:], resume=True)
    store.refresh()
    assert len(ds) == 40 and torch.equal(ds[:][HP], data[:40]) and ds[:]["sample_id"].tolist() == list(range(40))
    assert torch.equal(collate(ds.__getitems__(range(32, 40)))[HP], data[32:40])


def test_the_gather_plan_of_shuffled_batches_is_not_used_after_a_refresh(tmp_path):
    """The plan of a dataset's shuffled batches (the native gather over the old run's mapped
    segments) must not serve the old rows after another run was written in the store's place
    and the store refreshed: the dataset refuses to read; after a resume that grows the store
    it reads its own rows, of the new layout."""
    from activationscope.errors import StoreError

    path = str(tmp_path / "s.zarr")
    first = torch.randn(64, 3, generator=torch.Generator().manual_seed(1))
    second = torch.randn(64, 3, generator=torch.Generator().manual_seed(2))
    _write(path, first)
    store = open_store(path)
    ds = ActivationDataset(store)
    assert torch.equal(collate(ds.__getitems__([5, 40, 2]))[HP], first[[5, 40, 2]])
    assert ds._plan is not None  # the next shuffled batches take the plan
    assert torch.equal(collate(ds.__getitems__([63, 0, 33]))[HP], first[[63, 0, 33]])
    _write(path, second, overwrite=True)
    store.refresh()
    with pytest.raises(StoreError, match="holds another run than when this dataset was made"):
        ds.__getitems__([1, 50, 7])
    new = ActivationDataset(store)
    assert torch.equal(collate(new.__getitems__([1, 50, 7]))[HP], second[[1, 50, 7]])
    grown = torch.randn(30, 3, generator=torch.Generator().manual_seed(3))
    _write(path, grown, resume=True)
    store.refresh()
    assert len(new) == 64 and torch.equal(collate(new.__getitems__([50, 1, 63]))[HP], second[[50, 1, 63]])
    assert new._plan is not None and new._plan[3][1] is store.attrs  # planned again, on the new layout
    assert torch.equal(collate(ActivationDataset(store).__getitems__([93, 64, 2]))[HP],
                       torch.cat([second, grown])[[93, 64, 2]])


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("verify", [False, True])
def test_a_dataset_opened_before_a_resume_that_has_committed_reads_its_rows_without_refresh(tmp_path, compression, verify):
    """The chunk holding the last committed rows (40 rows: chunk 5 holds rows 40..47 after the
    resume) is rewritten and listed anew by the resume; a dataset opened before it, not
    refreshed, reads its rows (not StoreCorruptError: "rewritten by a resumed capture that is
    still running ... or it is damaged")."""
    path = str(tmp_path / "s.zarr")
    data = torch.randn(100, 3, generator=torch.Generator().manual_seed(1))
    _write(path, data[:42], compression=compression)
    old = ActivationDataset(path, columns=["sample_id"], open_options={"verify": verify})
    _write(path, data[42:], resume=True, compression=compression)  # ended and committed
    assert len(old) == 42
    assert torch.equal(old[:][HP], data[:42])
    assert torch.equal(old[[41, 40, 0]][HP], data[[41, 40, 0]])
    assert torch.equal(old[41][HP], data[41]) and old[:]["sample_id"].tolist() == list(range(42))
    assert torch.equal(ActivationDataset(path)[:][HP], data)


def _labels_of_a_dataset(store, tmp_path):
    return ActivationDataset(store, columns=["label"])[:]["label"].tolist()


def _labels_of_an_export(store, tmp_path):
    # (export_parquet's columns= said only that the column was not there, the dataset's the reason)
    import pyarrow.parquet as pq

    from activationscope.data import export_parquet

    export_parquet(store, tmp_path / "out.parquet", columns=["label"])
    return pq.read_table(tmp_path / "out.parquet").column("label").to_pylist()


@pytest.mark.parametrize("labels", [_labels_of_a_dataset, _labels_of_an_export], ids=["dataset", "export"])
def test_a_column_of_a_store_with_no_committed_row_yet_names_the_status_and_refresh(tmp_path, labels):
    # a store opened while its capture has committed nothing: set_batch's columns reach the
    # row table with the first commit, so the error says so instead of only listing the columns
    path = tmp_path / "live.zarr"
    model = torch.nn.Sequential(torch.nn.Linear(2, 3))
    with ActivationScope(store=str(path)).track(model) as tracker:
        tracker.set_batch(label=[1, 2])
        model(torch.randn(2, 2))
        store = open_store(str(path))
        assert store.status == "incomplete" and store.n_samples == 0
        with pytest.raises(ValueError) as e:
            labels(store, tmp_path)
        msg = str(e.value)
        assert "columns ['label'] are not in the sample row table" in msg
        assert "incomplete" in msg and "no committed row" in msg and "store.refresh()" in msg
        assert len(ActivationDataset(store)) == 0 and not (tmp_path / "out.parquet").exists()
    store.refresh()
    assert labels(store, tmp_path) == [1, 2]


def test_a_store_whose_capture_has_listed_no_hook_point_yet_names_the_status_and_refresh(tmp_path):
    # opened before the capture's first commit: the store has no hook points yet, and saying
    # only that read as if the capture had recorded nothing
    from activationscope.errors import HookPointNotFoundError

    path = tmp_path / "live.zarr"
    model = torch.nn.Sequential(torch.nn.Linear(2, 3))
    with ActivationScope(store=str(path)).track(model) as tracker:
        store = open_store(str(path))
        assert store.status == "incomplete" and store.hook_points == []
        for hook_points in (None, "0.output", "0.*"):
            with pytest.raises(HookPointNotFoundError) as e:
                ActivationDataset(store, hook_points=hook_points)
            msg = str(e.value)
            assert "incomplete" in msg and "first commit" in msg and "store.refresh()" in msg, msg
        tracker.set_batch(label=[1, 2])
        model(torch.randn(2, 2))
    store.refresh()
    assert ActivationDataset(store, hook_points="0.output", columns=["label"])[:]["label"].tolist() == [1, 2]
