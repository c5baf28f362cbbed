"""``Store.rows(hook_point, start, stop)`` takes row positions as ints only: a bool is no position."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import activationscope as acs
from activationscope.errors import ArgumentTypeError


@pytest.fixture
def store(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(2, 3))
    with acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(model), torch.no_grad():
        model(torch.arange(10.0).reshape(5, 2))
    return acs.open_store(tmp_path / "s.zarr")


@pytest.mark.parametrize("start, stop", [(True, 3), (0, True), (np.bool_(False), 2), (torch.tensor(True), 3), (1.0, 3)])
def test_rows_refuses_positions_that_are_not_ints(store, start, stop):
    with pytest.raises(ArgumentTypeError, match=r"rows\('0.output', start, stop\): start and stop must be ints"):
        store.rows("0.output", start, stop)


def test_rows_takes_python_numpy_and_0d_torch_ints(store):
    whole = store["0.output"]
    for start, stop in [(1, 4), (np.int64(1), np.int32(4)), (torch.tensor(1), torch.tensor(4))]:
        got = store.rows("0.output", start, stop)
        assert got.shape == (3, 3) and got.dtype == torch.float32
        assert torch.equal(got, whole[1:4])


def test_reduction_specs_of_a_hook_point_not_in_the_store_raises(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 2))
    with acs.ActivationScope(store=str(tmp_path / "s.zarr"), reductions={"0.output": ["mean"]}).track(model), torch.no_grad():
        model(torch.ones(4, 2))
    store = acs.open_store(tmp_path / "s.zarr")
    assert store.reduction_specs("0.output") == {"mean": ("mean", {"per_feature": 1.0})}
    assert store.reduction_specs("1.output") == {}  # stored, without reductions
    with pytest.raises(acs.HookPointNotFoundError, match=r"hook point '0\.outptu' is not in the store"):
        store.reduction_specs("0.outptu")  # a typo is no "no reductions"
