"""Sequential batches (``range`` indices) take a short path through ActivationDataset and the
source's last mapped window; every batch must equal the stored rows, at every shard and
read-ahead window boundary, for sub-ranges of the dataset too."""

from __future__ import annotations

import pytest
import torch

from activationscope import ActivationDataset
from activationscope.data.dataset import Batch, collate

from fake_store import FakeStore, write_fake_store


class WindowedFake(FakeStore):
    """A store whose read-ahead hints cover ``window`` rows from the hinted start (as the
    real store's ``will_read`` does), and which counts the hints."""

    window = 11

    def will_read(self, hp, start, stop):
        self.hints = getattr(self, "hints", 0) + 1
        return (start, min(self.n_rows(hp), max(stop, start + self.window)))


def _open_windowed(spec, **options):
    return WindowedFake(spec)


@pytest.fixture
def data(tmp_path):
    torch.manual_seed(0)
    a = torch.randn(61, 3)
    b = torch.arange(61 * 2, dtype=torch.float32).reshape(61, 2)
    path = write_fake_store(tmp_path / "s", {"a": a, "b": b}, shard_rows=7)
    return path, {"a": a, "b": b}


@pytest.mark.parametrize("hook_points", [None, ["b"]], ids=["two", "one"])  # one: the dataset's own window
@pytest.mark.parametrize("rows", [None, range(5, 50)])
@pytest.mark.parametrize("batch", [1, 3, 7, 16])
def test_sequential_batches_equal_the_stored_rows(data, rows, batch, hook_points):
    path, ref = data
    ds = ActivationDataset(path, rows=rows, hook_points=hook_points, open_options={"opener": _open_windowed})
    base = 0 if rows is None else rows.start
    n = len(ds)
    for epoch in range(2):  # the second epoch starts over, behind the last window
        for a in range(0, n, batch):
            idx = range(a, min(n, a + batch))
            got = collate(ds.__getitems__(idx))
            for hp in hook_points or ("a", "b"):
                assert torch.equal(got[hp], ref[hp][base + idx.start : base + idx.stop]), (epoch, idx, hp)
            assert list(got) == (hook_points or ["a", "b"])
    # backwards and skipping about, and past the end of the window's rows
    for a in (n - 2, 0, n // 2, 3, n - 1):
        got = collate(ds.__getitems__(range(a, min(n, a + batch))))
        for hp in hook_points or ("a", "b"):
            assert torch.equal(got[hp], ref[hp][base + a : base + min(n, a + batch)]), (a, hp)


def test_the_window_of_sequential_reads_is_not_pickled_and_not_used_after_the_source_reopens(data):
    import pickle

    path, ref = data
    ds = ActivationDataset(path, hook_points=["a"], open_options={"opener": _open_windowed})
    ds.__getitems__(range(7, 9))
    assert ds._window is not None and ds._window[:2] == (7, 14)  # the mapped shard's rows, all hinted
    again = pickle.loads(pickle.dumps(ds))
    assert again._window is None
    assert torch.equal(collate(again.__getitems__(range(8, 10)))["a"], ref["a"][8:10])
    old = ds._window
    ds.source._drop_handles()  # what a fork or an unpickle does: the window's rows are not used
    got = ds.__getitems__(range(8, 10))
    assert ds._window is not old and ds._window[3] is ds.source._recent  # read through the source again
    assert torch.equal(collate(got)["a"], ref["a"][8:10])


def test_a_batch_inside_one_shard_is_a_view_and_hints_are_not_repeated(data):
    path, ref = data
    ds = ActivationDataset(path, hook_points=["a"], open_options={"opener": _open_windowed})
    first = ds.__getitems__(range(7, 9))
    assert isinstance(first, Batch)
    shard = ds.source.store._shard("a", 1)
    assert first.data["a"].untyped_storage().data_ptr() == shard.untyped_storage().data_ptr()
    hints = ds.source.store.hints
    ds.__getitems__(range(9, 11))  # inside the hinted [7, 18) and mapped [7, 14) rows
    ds.__getitems__(range(14, 16))  # the next shard, still inside the hint
    assert ds.source.store.hints == hints
    assert torch.equal(ds.__getitems__(range(14, 16)).data["a"], ref["a"][14:16])
    ds.__getitems__(range(18, 20))  # past the hinted rows: a new hint
    assert ds.source.store.hints == hints + 1
    assert torch.equal(ds.__getitems__(range(9, 11)).data["a"], ref["a"][9:11])


def test_out_of_range_and_stepped_ranges_take_the_checked_path(data):
    path, ref = data
    ds = ActivationDataset(path, rows=range(5, 50), open_options={"opener": _open_windowed})
    with pytest.raises(IndexError):
        ds.__getitems__(range(40, 46))
    got = collate(ds.__getitems__(range(0, 10, 3)))
    assert torch.equal(got["a"], ref["a"][5:15:3])
    assert collate(ds.__getitems__(range(3, 3)))["a"].shape == (0, 3)


def test_reads_across_a_shard_boundary_are_one_copy_of_the_right_rows(data):
    path, ref = data
    ds = ActivationDataset(path, open_options={"opener": _open_windowed})
    ds.__getitems__(range(0, 3))
    got = ds.__getitems__(range(5, 9)).data["a"]  # rows 5, 6 of shard 0 and 7, 8 of shard 1
    assert torch.equal(got, ref["a"][5:9])
