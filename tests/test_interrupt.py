"""Ctrl-C (``KeyboardInterrupt``) arriving at any line of the library, as in a notebook whose
cell is interrupted: the model is left without a wrapper of the capture, and the cell run again
captures as usual. The interruption is raised by a trace function at the k-th line run in the
library's own code, for every k (``acs_testing.InterruptAt``)."""

from __future__ import annotations

import pytest
import torch

import activationscope as acs

from acs_testing import InterruptAt, toy_mlp


def _wrapped(model: torch.nn.Module) -> list[str]:
    """Modules whose forward is still an instance attribute (a capture's wrapper)."""
    return [name for name, m in model.named_modules() if "forward" in m.__dict__]


def test_ctrl_c_at_any_line_of_a_with_block_leaves_no_wrapper():
    # the cell `with scope.track(model): model(x)` interrupted anywhere in the library (the block
    # entered, the forward captured, the block left), then run again
    model = toy_mlp()
    x = torch.randn(2, 16)
    with torch.no_grad():
        want = model(x)

    def cell():
        with torch.no_grad(), acs.ActivationScope().track(model) as tracker:
            model(x)
        return tracker

    cell()  # (first use: lazy imports)
    with InterruptAt(None) as count:
        cell()
    assert count.n > 100 and not _wrapped(model)
    for k in range(1, count.n + 1):
        with pytest.raises(KeyboardInterrupt), InterruptAt(k) as where:
            cell()
            raise KeyboardInterrupt("after the cell")
        assert not _wrapped(model), f"Ctrl-C at line {k} of the cell ({where.where}) left wrappers on {_wrapped(model)}"
    # the model runs as before, and a new capture records each call once
    with torch.no_grad():
        assert torch.equal(model(x), want)
    tracker = cell()
    assert tracker.activations and all(len(v) == 1 for v in tracker.activations.values())


def test_ctrl_c_in_a_store_capture_then_the_cell_again(tmp_path):
    # the cell of a store capture interrupted at one line in 20 of the library's (its store
    # opened, forwards captured and committed, the store closed), then run again: as it is where
    # no row was committed (the new store is removed), with resume=True where rows were (the
    # committed rows intact), never refused as locked; the store then holds every forward once
    model = toy_mlp(depth=1)
    xs = torch.randn(3, 2, 16)
    with torch.no_grad():
        want = {"0.output": torch.cat([model[0](x) for x in xs]), "1.output": torch.cat([model(x) for x in xs])}

    def cell(path, **options):
        scope = acs.ActivationScope(store=path, store_options=dict(options, commit_interval=0))
        with torch.no_grad(), scope.track(model) as tracker:
            for x in xs[tracker.resume_from // 2:]:
                model(x)

    cell(tmp_path / "first.zarr")  # (first use: lazy imports)
    with InterruptAt(None) as count:
        cell(tmp_path / "counted.zarr")
    assert count.n > 1000
    for k in range(1, count.n + 1, 20):
        path = tmp_path / f"{k}.zarr"
        with pytest.raises(KeyboardInterrupt), InterruptAt(k) as where:
            cell(path)
        assert not _wrapped(model), where.where
        n = acs.open_store(path).n_samples if (path / "zarr.json").exists() else 0
        if n:
            store = acs.open_store(path)
            assert store.status == "incomplete" or n == 6, where.where
            for hook_point in store.hook_points:
                assert torch.equal(store[hook_point], want[hook_point][:n]), where.where
            cell(path, resume=True)
        else:
            cell(path)  # (no row committed: no store left there, nor a lock)
        store = acs.open_store(path)
        assert store.status == "complete" and sorted(store.hook_points) == sorted(want), where.where
        for hook_point, rows in want.items():
            assert torch.equal(store[hook_point], rows), where.where
        assert store.row_table("sample")["sample_id"].to_pylist() == list(range(6)), where.where

