"""An array that follows its row table with fewer rows than the table: legitimate only at the
end of a forward (a resume through StoreWriter that never opened the array again), never in a
store committed from rank stores. verify() names the others; stores the writer makes verify
clean."""

from __future__ import annotations

import io
import json
import time

import pyarrow as pa
import pytest
import pyarrow.parquet as pq
import torch

import activationscope as acs
from activationscope.store import StoreWriter, open_store
from activationscope.errors import StoreCorruptError
from activationscope.store import _format as F


def _resumed_without_b(path):
    """Forwards 0-1 into arrays a and b (4 samples each, label = sample id % 3), aborted; a
    resume feeds forwards 2-3 into a only: b keeps 8 of the table's 16 rows, and follows it."""
    w = StoreWriter(path, chunk_rows=2, shard_bytes=4 * 4 * 4)
    a, b = (w.open_array(hp, (4,), torch.float32, "sample") for hp in ("a", "b"))
    for f in range(2):
        a.append(torch.full((4, 4), float(f)))
        b.append(torch.full((4, 4), float(f)))
        w.add_batch(4, list(range(4 * f, 4 * f + 4)), None, {"label": torch.arange(4 * f, 4 * f + 4) % 3})
        w.commit()
    deadline = time.monotonic() + 60  # (a commit lists the rows the writer thread has made durable)
    while open_store(path).n_samples < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
        w.commit()
    assert open_store(path).n_samples == 8
    w.abort()  # the run stops: its committed forwards stay, the store incomplete
    w = StoreWriter(path, chunk_rows=2, shard_bytes=4 * 4 * 4, resume=True)
    a = w.open_array("a", (4,), torch.float32, "sample")
    for f in range(2, 4):
        a.append(torch.full((4, 4), float(f)))
        w.add_batch(4, list(range(4 * f, 4 * f + 4)), None, {"label": torch.arange(4 * f, 4 * f + 4) % 3})
        w.commit()
    w.close()


def _rewrite_sample_parts(path, fn):
    """Rewrite each part of the sample table as ``fn(part, first_row, last)`` (``first_row``:
    the table row of its first row; ``last``: whether it is the last part), each crc32c
    recomputed and the table's n_rows and n_samples set to the rows there are then: a forged
    store that every checksum and count check passes."""
    doc = json.loads((path / "zarr.json").read_text())
    attrs = doc["attributes"]["activationscope"]
    info = attrs["row_tables"]["sample"]
    first = 0
    for i, key in enumerate(info["parts"]):
        t = pq.read_table(path / key)
        n = t.num_rows
        t = fn(t, first, i == len(info["parts"]) - 1)
        first += n
        sink = io.BytesIO()
        pq.write_table(t, sink)
        (path / key).write_bytes(sink.getvalue())
        info["crc32c"][key] = F.crc32c(sink.getvalue())
        info["n_rows"] += t.num_rows - n
        attrs["n_samples"] += t.num_rows - n
    (path / "zarr.json").write_text(json.dumps(doc))


def _batch_of_rows(rows, value):
    """``fn`` for :func:`_rewrite_sample_parts`: the batch column set to ``value`` in ``rows``."""
    def fn(t, first, _last):
        batch = [value if first + i in rows else b for i, b in enumerate(t.column("batch").to_pylist())]
        return t.set_column(t.schema.get_field_index("batch"), "batch", pa.array(batch, pa.int64()))
    return fn


def _last_row_again(t, _first, last):
    """``fn`` for :func:`_rewrite_sample_parts`: the table's last row written twice."""
    return pa.concat_tables([t, t.slice(t.num_rows - 1, 1)]) if last else t


def test_an_array_a_resume_never_opened_again_verifies_clean_and_reads_its_rows(tmp_path):
    path = tmp_path / "s.zarr"
    _resumed_without_b(path)
    store = open_store(path)
    assert store.status == "complete" and store.verify() == []
    assert (store.n_rows("a"), store.n_rows("b"), store.row_table().num_rows) == (16, 8, 16)
    assert store.follows_row_table("b")
    got = acs.ActivationDataset(path, hook_points="b", columns=["label"])[:]
    assert got["label"].tolist() == [i % 3 for i in range(8)]
    assert got["b"][:, 0].tolist() == [0.0] * 4 + [1.0] * 4


def test_an_array_short_of_its_table_inside_a_forward_is_named_by_verify(tmp_path):
    # the third forward's part says its rows are of forward 1: b's 8 rows now end inside forward 1
    path = tmp_path / "s.zarr"
    _resumed_without_b(path)
    _rewrite_sample_parts(path, _batch_of_rows(range(8, 12), 1))
    (line,) = open_store(path).verify()
    assert line.startswith("hook point 'b': n_rows 8 is fewer than the 16 rows of the sample row table it follows, "
                           "and ends inside forward (batch) 1, whose rows continue at table row 8"), line
    assert line.endswith("restore the store from its source")


def test_a_sample_row_added_to_the_last_forward_is_named_by_verify(tmp_path):
    # one more row of forward 3 in the table (n_rows and n_samples raised to match): the
    # arrays' 16 rows end inside that forward
    path = tmp_path / "s.zarr"
    _resumed_without_b(path)
    _rewrite_sample_parts(path, _last_row_again)
    (line,) = open_store(path).verify()
    assert line.startswith("hook point 'a': n_rows 16 is fewer than the 17 rows of the sample row table it follows, "
                           "and ends inside forward (batch) 3"), line


def _committed_ranks(path):
    from activationscope.store.ranks import commit_ranks

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    for r in range(2):
        options = {"process_group": acs.RankStore(r, 2), "chunk_rows": 2, "shard_rows": 4}
        with acs.ActivationScope(store=path, store_options=options).track(model, include=["0"]) as tracker, \
                torch.no_grad():
            for _ in range(2):
                tracker.set_batch(label=[r, r, r])
                model(torch.randn(3, 4))
    commit_ranks(path)


def test_a_committed_rank_store_with_a_row_more_in_its_table_is_named_by_verify(tmp_path):
    # in a store committed from rank stores no array that follows its table is short of it,
    # not even at the end of a forward
    path = tmp_path / "r.zarr"
    _committed_ranks(path)
    store = open_store(path)
    assert store.verify() == [] and store.n_rows("0.output") == store.row_table().num_rows == 12
    _rewrite_sample_parts(path, _last_row_again)
    (line,) = open_store(path).verify()
    assert line.startswith("hook point '0.output': n_rows 12 is fewer than the 13 rows of the sample row table it "
                           "follows: in a store committed from rank stores"), line


def test_a_dataset_refuses_an_array_short_of_its_table_inside_a_forward(tmp_path):
    # where verify names the shortfall, the dataset does not trim the table to the array's rows
    # without a word (it would pair rows 0-7 of b with rows of a forward cut in two)
    path = tmp_path / "s.zarr"
    _resumed_without_b(path)
    _rewrite_sample_parts(path, _batch_of_rows(range(8, 12), 1))
    with pytest.raises(StoreCorruptError, match=r"hook point 'b': n_rows 8 is fewer than the 16 rows of the sample "
                       r"row table it follows, and ends inside forward \(batch\) 1.*run store.verify\(\)"):
        acs.ActivationDataset(path, hook_points="b", columns=["label"])
    with pytest.raises(StoreCorruptError, match="ends inside forward"):
        acs.ActivationDataset(path, hook_points="b", filter=lambda t: t["label"] == 1)
    got = acs.ActivationDataset(path, hook_points="b")[:]  # (no row table read: the rows themselves)
    assert got["b"][:, 0].tolist() == [0.0] * 4 + [1.0] * 4


def test_a_dataset_refuses_a_committed_rank_store_short_of_its_table(tmp_path):
    path = tmp_path / "r.zarr"
    _committed_ranks(path)
    assert sorted(acs.ActivationDataset(path, columns=["label"])[:]["label"].tolist()) == [0] * 6 + [1] * 6
    _rewrite_sample_parts(path, _last_row_again)
    with pytest.raises(StoreCorruptError, match="in a store committed from rank stores"):
        acs.ActivationDataset(path, columns=["label"])
