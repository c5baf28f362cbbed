"""A forward refused or raised partway records nothing: hook points first seen in it committed
no row, so neither the store nor the tracker lists them, and the store keeps no file of
theirs. Hook points first seen in a forward that was recorded stay listed."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import activationscope as acs
from activationscope import ActivationScope, open_store


class Scale(torch.nn.Module):
    def forward(self, x):
        return x * 2


class Grows(torch.nn.Module):
    """Forward 1 calls ``a`` only. Later forwards first call ``b`` (a hook point new there),
    then fail the way ``how`` says (``None``: they do not fail)."""

    def __init__(self, how: str | None) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same weights in every run: a resume checks the model
        self.a, self.b, self.ident = Scale(), torch.nn.Linear(3, 3), torch.nn.Identity()
        self.calls, self.how = 0, how

    def forward(self, x):
        self.calls += 1
        if self.calls == 1:
            return self.a(x)
        if self.how == "alias":  # a hook point new there that is the same tensor as a.output
            y = self.ident(self.a(x))
            raise ValueError("a bug in the model")
        y = self.b(x)
        if self.how == "model":
            raise ValueError("a bug in the model")
        if self.how == "dtype":
            return self.a(x.double())  # refused: a.output was float32
        if self.how == "shape":
            return self.a(x[:, :2])  # refused: a.output had 3 features
        return self.a(y)


def _files(path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


def _capture(target, model, n=3, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", acs.CaptureWarning)
        with torch.no_grad(), ActivationScope(store=target, store_options=options).track(model) as tr:
            for _ in range(n):
                model(torch.randn(4, 3))
    return tr


@pytest.mark.parametrize("how, error", [("model", ValueError), ("dtype", acs.CaptureError),
                                        ("shape", acs.CaptureError), ("alias", ValueError)])
@pytest.mark.parametrize("shard_rows", [None, 2])  # 2: b's shards were finished before the failure
def test_hook_points_first_seen_in_a_failed_forward_are_not_listed(tmp_path, how, error, shard_rows):
    path = tmp_path / "s.zarr"
    options = {} if shard_rows is None else {"shard_rows": shard_rows}
    model = Grows(how)
    tracker = None
    with pytest.raises(error):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", acs.CaptureWarning)
            with torch.no_grad(), ActivationScope(store=str(path), store_options=options).track(model) as tracker:
                for _ in range(3):
                    model(torch.randn(4, 3))
    store = open_store(path)
    assert store.status == "incomplete" and store.n_samples == 4
    assert store.hook_points == ["a.output"] and store.n_rows("a.output") == 4
    assert store.attrs["aliases"] == {}
    assert store.verify() == []
    assert tracker.hook_points == ["a.output"]
    assert [f for f in _files(path) if "b.output" in f or "ident" in f] == []
    assert sorted(os.listdir(path / "acts")) == ["a.output", "zarr.json"]
    # a resume continues after the committed forward
    tracker = _capture(str(path), Grows(None), n=1, resume=True)
    store = open_store(path)
    assert store.status == "complete" and store.n_samples == 8 and store.verify() == []


def test_a_forward_raised_and_caught_last_lists_none_of_its_new_hook_points(tmp_path):
    path = tmp_path / "s.zarr"
    model = Grows("model")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", acs.CaptureWarning)
        with torch.no_grad(), ActivationScope(store=str(path), reductions=["mean"]).track(model) as tracker:
            model(torch.randn(4, 3))
            with pytest.raises(ValueError):
                model(torch.randn(4, 3))
    store = open_store(path)
    assert store.status == "complete" and store.n_samples == 4
    assert store.hook_points == ["a.output"] and store.verify() == []
    assert sorted(store.reductions) == ["a.output"]
    assert tracker.hook_points == ["a.output"] and sorted(tracker.reductions) == ["a.output"]
    assert not (path / "acts" / "b.output").exists()


def test_a_memory_store_lists_no_hook_point_of_a_failed_forward():
    import zarr

    from activationscope.store._backend import resolve

    zs = zarr.storage.MemoryStore()
    with pytest.raises(ValueError):
        _capture(zs, Grows("model"), shard_rows=2)
    store = open_store(zs)
    assert store.hook_points == ["a.output"] and store.n_samples == 4 and store.verify() == []
    assert [k for k in resolve(zs).list("acts/") if "b.output" in k] == []


def test_hook_points_first_seen_in_a_recorded_forward_stay_listed(tmp_path):
    path = tmp_path / "s.zarr"
    tracker = _capture(str(path), Grows(None), n=3)
    store = open_store(path)
    assert store.status == "complete" and store.hook_points == ["a.output", "b.output"]
    assert store.n_rows("b.output") == 8 and not store.follows_row_table("b.output")
    assert tracker.hook_points == ["a.output", "b.output"] and store.verify() == []


def test_a_hook_point_of_a_forward_in_progress_is_listed_once_the_forward_is_recorded(tmp_path):
    path = tmp_path / "s.zarr"
    model = Grows(None)
    seen = {}

    def look(module, args, out):
        seen["during"] = open_store(path).hook_points

    model.a.register_forward_hook(look)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", acs.CaptureWarning)
        with torch.no_grad(), ActivationScope(store=str(path)).track(model):
            model(torch.randn(4, 3))
            model(torch.randn(4, 3))  # b first, then a: b is not listed while its forward runs
            seen["after"] = open_store(path).hook_points
    assert seen["during"] == ["a.output"] and seen["after"] == ["a.output", "b.output"]


def test_the_writer_lists_an_array_from_the_batch_that_records_it(tmp_path):
    from activationscope.store import StoreWriter

    path = tmp_path / "s.zarr"
    w = StoreWriter(path, chunk_rows=2, shard_rows=4)
    a = w.open_array("a", (3,), torch.float32, "sample")
    a.append(torch.ones(4, 3))
    w.add_batch(4)
    b = w.open_array("b", (3,), torch.float32, "sample")  # opened in a forward never recorded
    b.append(torch.ones(8, 3))  # two whole shards
    w._core.drain()
    assert w.unrecorded_hook_points == ["b"]
    w.commit()
    assert open_store(path).hook_points == ["a"]
    w.close()
    store = open_store(path)
    assert store.hook_points == ["a"] and store.n_rows("a") == 4 and store.verify() == []
    assert not (path / "acts" / "b").exists()


def test_a_capture_whose_only_forward_raised_inside_the_block_stores_nothing_and_says_why(tmp_path):
    path = tmp_path / "s.zarr"
    model = Grows("model")
    model.calls = 1  # its first forward is one that raises
    with pytest.raises(acs.CaptureError, match=r"captured no whole forward of Grows: the 1 forward\(s\) it captured "
                                               r"raised before their end .*removed: it was new.*fix the error"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", acs.CaptureWarning)
            with torch.no_grad(), ActivationScope(store=str(path)).track(model) as tracker:
                with pytest.raises(ValueError):
                    model(torch.randn(4, 3))
    assert not path.exists() and tracker.hook_points == []
