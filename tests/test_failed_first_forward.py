"""A capture whose first forward raises leaves no store behind when it made the store: the
corrected rerun needs neither overwrite=True nor resume=True. Stores that existed before, a
resumed store, or one holding committed rows are kept."""

from __future__ import annotations

import os

import pytest
import torch

import activationscope as acs
from activationscope import ActivationScope, open_store


class Breaks(torch.nn.Module):
    def __init__(self, at: int) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same weights in every run: a resume checks the model
        self.lin = torch.nn.Linear(3, 2)
        self.calls, self.at = 0, at

    def forward(self, x):
        y = self.lin(x)
        self.calls += 1
        if self.calls > self.at:
            raise ValueError("a shape bug in the model")
        return y.relu()


def _run(path, model, n=3, **options):
    with torch.no_grad(), ActivationScope(store=str(path), store_options=options).track(model):
        for _ in range(n):
            model(torch.randn(4, 3))


def test_a_new_store_whose_first_forward_raised_is_removed_and_the_rerun_just_works(tmp_path):
    path = tmp_path / "s.zarr"
    with pytest.raises(ValueError, match="a shape bug") as e:
        _run(path, Breaks(at=0))
    assert any("no row was committed, so the new store" in n and "was removed" in n for n in e.value.__notes__)
    assert not path.exists()
    _run(path, Breaks(at=10))  # no overwrite=True needed
    assert open_store(path).status == "complete" and open_store(path).n_samples == 12


def test_a_folder_that_existed_is_kept_empty(tmp_path):
    path = tmp_path / "s.zarr"
    path.mkdir()
    with pytest.raises(ValueError):
        _run(path, Breaks(at=0))
    assert path.is_dir() and os.listdir(path) == []


def test_a_store_with_committed_rows_is_kept(tmp_path):
    path = tmp_path / "s.zarr"
    with pytest.raises(ValueError) as e:
        _run(path, Breaks(at=2))
    assert not getattr(e.value, "__notes__", None)
    store = open_store(path)
    assert store.status == "incomplete" and store.n_samples == 8


@pytest.mark.parametrize("option", ["resume", "overwrite"])
def test_a_resume_or_overwrite_whose_first_forward_raised_keeps_the_store_as_found(tmp_path, option):
    path = tmp_path / "s.zarr"
    _run(path, Breaks(at=10), n=2)
    with pytest.raises(ValueError):
        _run(path, Breaks(at=0), **{option: True})
    store = open_store(path)
    assert store.status == "complete" and store.n_samples == 8


def test_a_memory_store_whose_first_forward_raised_is_removed():
    import zarr

    zs = zarr.storage.MemoryStore()
    with pytest.raises(ValueError):
        with torch.no_grad(), ActivationScope(store=zs).track(Breaks(at=0)) as tr:
            tr.model(torch.randn(4, 3))
    with pytest.raises(acs.StoreError):
        open_store(zs)


def test_an_overwrite_that_captured_no_forward_says_the_old_store_is_kept(tmp_path):
    path = tmp_path / "s.zarr"
    _run(path, Breaks(at=10), n=2)
    with pytest.raises(acs.CaptureError, match="the store that overwrite=True was to replace is kept as it was") as e:
        _run(path, Breaks(at=10), n=0, overwrite=True)
    assert "left incomplete" not in str(e.value)
    store = open_store(path)
    assert store.status == "complete" and store.n_samples == 8
