"""A commit's row-table part holds every batch it covers: built one array per column when
the batches hold the same numeric columns, one table per batch otherwise; both read back the
same rows, types and nulls."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
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
