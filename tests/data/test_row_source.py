"""The RowSource protocol: the store and the test fake implement it, a store lacking part of
it is refused by name, and the store's row blocks are its shards (views) or its chunks
(decoded per read)."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch
from fake_store import FakeStore, write_fake_store

import activationscope as acs
from activationscope.data import ActivationDataset
from activationscope.data._source import RowSource, StoreSource
from activationscope.store import StoreWriter


def _store(tmp_path, name, **options):
    x = torch.arange(100 * 3, dtype=torch.float32).reshape(100, 3)
    w = StoreWriter(str(tmp_path / name), chunk_rows=8, shard_bytes=16 * 3 * 4, **options)
    arr = w.open_array("x", (3,), torch.float32, "sample")
    arr.append(x)
    w.add_batch(100, sample_ids=list(range(100)))
    w.close()
    return acs.open_store(tmp_path / name), x


def test_store_and_fake_implement_the_protocol(tmp_path):
    store, _ = _store(tmp_path, "a.zarr")
    assert isinstance(store, RowSource)
    path = write_fake_store(tmp_path / "f", {"x": torch.zeros(4, 2)}, tables={"sample": pa.table({"sample_id": [0, 1, 2, 3]})})
    assert isinstance(FakeStore(path), RowSource)


def test_row_blocks_are_shards_or_chunks(tmp_path):
    plain, x = _store(tmp_path, "plain.zarr")
    bounds, views = plain.row_blocks("x")
    assert views is True and bounds == plain.segments("x") and bounds[0] == 0 and bounds[-1] == 100
    packed, _ = _store(tmp_path, "zstd.zarr", compression="zstd")
    bounds, views = packed.row_blocks("x")
    assert views is False and bounds == list(range(0, 100, 8)) + [100]
    idx = torch.tensor([99, 0, 17, 8, 64, 63])
    for store in (plain, packed):
        src = StoreSource(store)
        torch.testing.assert_close(src.take("x", idx), x[idx])
        torch.testing.assert_close(src.read("x", 5, 70), x[5:70])
        assert store.follows_row_table("x") is True


class _NoRows:
    hook_points = ["x"]

    def n_rows(self, hp):
        return 1


def test_a_store_without_the_protocol_is_refused_by_name():
    src = StoreSource("somewhere", {"opener": lambda spec, **o: _NoRows()})
    with pytest.raises(acs.ActivationScopeError, match=r"_NoRows from 'somewhere' .* lacks \[.*'row_blocks'.*\] of the RowSource protocol"):
        src.store
    with pytest.raises(acs.ActivationScopeError, match="RowSource"):
        ActivationDataset("somewhere", open_options={"opener": lambda spec, **o: _NoRows()})


def test_a_store_that_reads_its_row_table_whole_is_read_once(tmp_path):
    # (a store whose row_table takes no columns= was read whole again for each projected read:
    # the columns' names, the filter's columns and the columns= tensors, three reads for one)
    import pyarrow.compute as pc

    n = 12
    table = pa.table({"sample_id": list(range(n)), "label": [i % 3 for i in range(n)], "w": [0.5] * n})
    path = write_fake_store(tmp_path / "f", {"x": torch.arange(n * 2, dtype=torch.float32).reshape(n, 2)},
                            tables={"sample": table})
    store = FakeStore(path)
    reads = []
    whole = store.row_table
    store.row_table = lambda kind: reads.append(kind) or whole(kind)
    ds = ActivationDataset(store, columns=["w", "label"], filter=pc.field("label") > 0, sample_ids=range(2, n))
    got = ds[:]
    assert got["label"].tolist() == [i % 3 for i in range(2, n) if i % 3]
    assert got["x"].tolist() == [[2.0 * i, 2.0 * i + 1] for i in range(2, n) if i % 3]
    assert reads == ["sample"]
