"""``hook_points=``, ``columns=`` and ``open_options=`` of a kind the dataset cannot use raise
our ArgumentTypeError naming the argument and what it takes, instead of Python's bare
``'int' object is not iterable`` or ``open_store() got an unexpected keyword argument``;
the kinds it takes still read the rows written (plain-torch reference)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from activationscope.data import ActivationDataset, export_parquet
from activationscope import open_store
from activationscope.errors import ArgumentTypeError, ArgumentValueError, StoreCorruptError
from activationscope.store import StoreWriter


@pytest.fixture
def store(tmp_path):
    path = str(tmp_path / "s.zarr")
    data = torch.randn(6, 3, generator=torch.Generator().manual_seed(0))
    w = StoreWriter(path, chunk_rows=4, shard_rows=8)
    w.open_array("x", (3,), torch.float32, "sample").append(data)
    w.add_batch(6, sample_ids=list(range(10, 16)))
    w.close()
    return path, data


@pytest.mark.parametrize("kw, named", [
    ({"columns": 3}, "columns"), ({"columns": ["sample_id", None]}, "columns"),
    ({"hook_points": 3}, "hook_points"), ({"hook_points": ["x", 1]}, "hook_points"),
    ({"open_options": [("verify", True)]}, "open_options"), ({"open_options": {"verfy": True}}, "open_options"),
])
def test_a_wrong_kind_of_argument_is_named(store, kw, named):
    path, _ = store
    with pytest.raises(ArgumentTypeError, match=named) as e:
        ActivationDataset(path, **kw)
    assert isinstance(e.value, TypeError)


def test_export_names_columns_of_a_wrong_kind(store, tmp_path):
    path, _ = store
    with pytest.raises(ArgumentTypeError, match="columns"):
        export_parquet(path, str(tmp_path / "o.parquet"), columns=3)


def test_the_kinds_taken_still_read_the_rows(store):
    path, data = store
    for hps, cols in (("x", "sample_id"), (["x"], ["sample_id"]), (("x",), ("sample_id",)), (iter(["x"]), iter(["sample_id"]))):
        ds = ActivationDataset(path, hook_points=hps, columns=cols, open_options={"verify": True, "cache_bytes": 1 << 20})
        batch = ds[[5, 0, 2]]
        assert torch.equal(batch["x"], data[[5, 0, 2]])
        assert torch.equal(batch["sample_id"], torch.tensor([15, 10, 12]))


@pytest.mark.parametrize("ids", [pa.array(["a"]), pa.array([10.5]), pa.array([[10]])])
def test_sample_ids_as_a_pyarrow_array_of_another_type_is_named(store, ids):
    path, _ = store
    with pytest.raises(ArgumentTypeError, match=r"sample_ids= must hold ids of the store's sample_id type \(int64\)"):
        ActivationDataset(path, sample_ids=ids)


def test_sample_ids_as_a_pyarrow_array_of_ids_reads_their_rows(store):
    path, data = store
    for ids in (pa.array([15, 11]), pa.array([15, 11], pa.int32()), pa.array([15.0, 11.0])):
        ds = ActivationDataset(path, sample_ids=ids, columns=["sample_id"])
        assert torch.equal(ds[:]["x"], data[[1, 5]]) and ds[:]["sample_id"].tolist() == [11, 15]


def _flip_a_byte(path):
    (shard,) = [f for f in (path / "acts" / "x" / "c").rglob("*") if f.is_file()]
    raw = bytearray(shard.read_bytes())
    raw[100] ^= 0xFF
    shard.write_bytes(bytes(raw))


def test_open_options_given_with_an_open_store_apply_in_this_process_too(tmp_path):
    """verify=True given with a store opened without it checked nothing in this process (only
    DataLoader workers reopened the store with it): flipped bytes read silently."""
    path = tmp_path / "s.zarr"
    data = torch.randn(64, 1024, generator=torch.Generator().manual_seed(0))
    w = StoreWriter(path)
    w.open_array("x", (1024,), torch.float32, "sample").append(data)
    w.add_batch(64)
    w.close()
    assert torch.equal(ActivationDataset(open_store(path), open_options={"verify": True})[0:4]["x"], data[:4])
    _flip_a_byte(path)
    with pytest.raises(StoreCorruptError, match="crc32c mismatch"):
        ActivationDataset(open_store(path), open_options={"verify": True})[0:4]
    # the same options as the store's: the open store itself is used
    store = open_store(path, verify=True)
    assert ActivationDataset(store, open_options={"verify": True}).store is store


def test_open_options_cannot_apply_to_a_dataset_given_as_the_store(store):
    path, data = store
    ds = ActivationDataset(path)
    with pytest.raises(ArgumentValueError, match="open_options"):
        ActivationDataset(ds, open_options={"verify": True})
    again = ActivationDataset(ds, open_options={})  # nothing other than how it was opened
    assert again.source is ds.source and torch.equal(again[:]["x"], data)


@pytest.mark.parametrize("empty", [[], set(), (), range(0), torch.tensor([], dtype=torch.int64)])
def test_an_empty_sample_ids_collection_is_an_empty_dataset(store, empty):
    """An empty collection (the ids of a split that has none here) raised "none of the
    sample_ids= (e.g. []) is in this dataset"; it selects no sample, as rows=[] selects no row."""
    path, _ = store
    ds = ActivationDataset(path, sample_ids=empty, columns=["sample_id"])
    assert len(ds) == 0 and ds[:]["x"].shape == (0, 3) and ds[:]["sample_id"].tolist() == []
    with pytest.raises(ArgumentValueError, match="none of the sample_ids"):
        ActivationDataset(path, sample_ids=[99])  # ids that are not there are still a mistake


@pytest.mark.parametrize("ids", [torch.tensor(2), np.array(2), torch.tensor([2]), 2])
def test_int_ids_given_to_a_store_of_str_ids_are_named(tmp_path, ids):
    # a 0-d tensor or array raised Python's own "iteration over a 0-d tensor"
    path = str(tmp_path / "s.zarr")
    w = StoreWriter(path, chunk_rows=4, shard_rows=8)
    w.open_array("x", (3,), torch.float32, "sample").append(torch.zeros(3, 3))
    w.add_batch(3, sample_ids=["a", "b", "c"])
    w.close()
    with pytest.raises(ArgumentTypeError, match=r"sample_ids= must be .*str \(this store's sample ids are strings\)") as e:
        ActivationDataset(path, sample_ids=ids)
    assert isinstance(e.value, TypeError)
    assert [*ActivationDataset(path, sample_ids=np.array("b"), columns=["sample_id"])[:]["sample_id"]] == ["b"]


def _store_of_ids(tmp_path, ids):
    path = str(tmp_path / "ids.zarr")
    data = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    w = StoreWriter(path, chunk_rows=4, shard_rows=8)
    w.open_array("x", (3,), torch.float32, "sample").append(data)
    w.add_batch(4, sample_ids=ids)
    w.close()
    return path, data


_BIG = [2**63 + 5, 2**64 - 1, 7, 2**63]


@pytest.mark.parametrize("sel", [[2**64 - 1, 2**63], 2**64 - 1, np.array([2**64 - 1, 2**63], dtype=np.uint64),
                                 torch.tensor([2**64 - 1, 2**63], dtype=torch.uint64), {2**63, 2**64 - 1}])
def test_uint64_sample_ids_beyond_int64_are_selected(tmp_path, sel):
    """Sample ids of a store captured with uint64 ids (hashes of documents) beyond int64 were
    refused ("beyond int64: no sample has that id") though the store has them."""
    path, data = _store_of_ids(tmp_path, np.array(_BIG, dtype=np.uint64))
    ds = ActivationDataset(path, sample_ids=sel)
    want = [1] if isinstance(sel, int) else [1, 3]
    assert ds.store_rows().tolist() == want and torch.equal(ds[:]["x"], data[want])
    assert open_store(path).row_table()["sample_id"].type == pa.uint64()


@pytest.mark.parametrize("sel, error, match", [
    ([-1], ArgumentValueError, r"holds -1, which no sample has \(this store's sample ids are uint64\)"),
    ([2**64], ArgumentValueError, "holds 18446744073709551616"),
    ([True], ArgumentTypeError, r"must be ints in \[0, 2\*\*64\)"), ([1.5], ArgumentTypeError, "got 1.5"),
    (["7"], ArgumentTypeError, "got '7'"), (np.array([7.0]), ArgumentTypeError, "numpy array"),
    (torch.tensor([-1]), ArgumentValueError, "holds -1"), ([99], ArgumentValueError, "none of the sample_ids"),
])
def test_uint64_sample_ids_refused_name_why(tmp_path, sel, error, match):
    path, _ = _store_of_ids(tmp_path, np.array(_BIG, dtype=np.uint64))
    with pytest.raises(error, match=match):
        ActivationDataset(path, sample_ids=sel)


@pytest.mark.parametrize("sel", [[1.5, 0.25], 1.5, np.array([1.5, 0.25]), torch.tensor([1.5, 0.25], dtype=torch.float64),
                                 (np.float32(1.5), 0.25)])
def test_float_sample_ids_are_selected(tmp_path, sel):
    """A store captured with float sample ids (times, scores) could not be selected from:
    sample_ids= took ints only."""
    path, data = _store_of_ids(tmp_path, [0.5, 1.5, 2.25, 0.25])
    ds = ActivationDataset(path, sample_ids=sel)
    want = [1] if isinstance(sel, float) else [1, 3]
    assert ds.store_rows().tolist() == want and torch.equal(ds[:]["x"], data[want])


@pytest.mark.parametrize("sel, error", [([float("nan")], ArgumentValueError), ([True], ArgumentTypeError),
                                        ([None], ArgumentTypeError), ([3.0], ArgumentValueError)])
def test_float_sample_ids_refused_name_why(tmp_path, sel, error):
    path, _ = _store_of_ids(tmp_path, [0.5, 1.5, 2.25, 0.25])
    with pytest.raises(error, match="sample_ids="):
        ActivationDataset(path, sample_ids=sel)
