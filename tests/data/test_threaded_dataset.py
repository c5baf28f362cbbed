"""One ActivationDataset (its StoreSource) read from several threads while another thread
refreshes the store a live capture grows. The interleavings that went wrong are forced
deterministically: a slow point of one reader (monkeypatched) runs the other thread's
``refresh()`` right there."""

from __future__ import annotations

import pytest
import torch

from activationscope import open_store
from activationscope.data import ActivationDataset
from activationscope.data.dataset import collate
from activationscope.store import StoreWriter
from activationscope.store import reader as R
from acs_testing import write_rows

HP = "x"



def _refresh_inside(monkeypatch, name, ds):
    """``Store.<name>`` runs once as another thread's ``store.refresh()`` (and its next read
    of the dataset's source, which notices it) interleave with it: after it has read the
    old commit, before its caller caches what it returned."""
    real = getattr(R.Store, name)
    fired = []

    def patched(self, *args, **kwargs):
        got = real(self, *args, **kwargs)
        if not fired:
            fired.append(True)
            self.refresh()
            ds.source.store  # (the other thread's read: the source forgets its layouts)
        return got

    monkeypatch.setattr(R.Store, name, patched)
    return fired


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("cache", ["row table", "row layout"])
def test_what_the_source_read_from_the_commit_before_a_refresh_is_not_kept_for_the_new_one(
        tmp_path, monkeypatch, compression, cache):
    path = str(tmp_path / "s.zarr")
    data = torch.randn(100, 3, generator=torch.Generator().manual_seed(0))
    write_rows(path, data[:40], compression=compression)
    old = ActivationDataset(open_store(path))
    write_rows(path, data[40:], resume=True, compression=compression)  # a live capture grows it
    if cache == "row table":
        fired = _refresh_inside(monkeypatch, "row_table", old)
        old.source.row_table("sample")
    else:
        fired = _refresh_inside(monkeypatch, "row_blocks", old)
        assert torch.equal(old[0:8][HP], data[:8])
    assert fired
    new = ActivationDataset(old, columns=["sample_id"])  # made after the refresh: 100 rows
    assert len(new) == 100
    assert new[:]["sample_id"].tolist() == list(range(100))
    assert torch.equal(new[:][HP], data) and torch.equal(new[95][HP], data[95])
    assert torch.equal(new[[99, 3, 45, 70]][HP], data[[99, 3, 45, 70]])
    for a in range(0, 100, 7):
        assert torch.equal(collate(new.__getitems__(range(a, min(100, a + 7))))[HP], data[a : a + 7]), a
    assert torch.equal(new.block_boundaries(), ActivationDataset(path).block_boundaries())


def test_a_read_while_another_thread_notices_an_overwrite_refuses_the_new_run(tmp_path, monkeypatch):
    from activationscope.data import _source
    from activationscope.errors import StoreError

    path = str(tmp_path / "s.zarr")
    write_rows(path, torch.zeros(40, 3))
    store = open_store(path)
    run = store.attrs["run_id"]
    picked = ActivationDataset(store, rows=[3, 1, 39])
    picked[:]
    w = StoreWriter(path, overwrite=True, chunk_rows=8, shard_rows=32)  # another run in its place
    w.open_array(HP, (3,), torch.float32, "sample").append(torch.ones(50, 3))
    w.add_batch(50)
    w.close()
    store.refresh()
    real, got = _source.run_of, []

    def run_of(attrs):  # one thread notices the refresh; this dataset's read runs right then
        if not got:
            got.append(None)
            try:
                got[0] = picked[:]
            except StoreError as e:
                got[0] = e
        return real(attrs)

    monkeypatch.setattr(_source, "run_of", run_of)
    picked.source.store  # (the other thread)
    assert isinstance(got[0], StoreError) and f"run {run} then" in str(got[0]), got[0]
