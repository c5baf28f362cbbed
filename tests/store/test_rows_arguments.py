"""``Store.rows(hook_point, start, stop)`` takes row positions as ints only: a bool is no position."""

from __future__ import annotations

import re

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


@pytest.mark.parametrize("rows", [-1, 3, 1.5, [0, 2], np.int64(2)])
def test_store_getitem_with_rows_that_are_no_slice_says_how_to_read_them(store, rows):
    # the message said only what it takes, not how to read one row or a list of positions
    with pytest.raises(ArgumentTypeError, match=re.escape(
            f"store[...] takes a hook point or (hook point, slice), got ('0.output', {rows!r}); rows are read by a "
            "slice: store[hook_point, i:i + 1] for row i, or for rows at other positions "
            "ActivationDataset(store, hook_points=hook_point)[positions]")):
        store["0.output", rows]
    assert torch.equal(store["0.output", 3:4], store["0.output"][3:4])
    with pytest.raises(ArgumentTypeError, match=r"got \('0\.output', slice\(0, 1, None\), 0\)$"):
        store["0.output", 0:1, 0]


@pytest.mark.parametrize("start, stop", [(-1, 2), (0, 6), (-3, -1), (3, 9)])
def test_rows_out_of_range_say_the_bounds_and_the_slice_that_clips(store, start, stop):
    # the message said "out of range" only: not the bounds (no negative position) nor the read that clips
    with pytest.raises(acs.errors.RowIndexError, match=re.escape(
            f"rows [{start}, {stop}) out of range for hook point '0.output' with 5 rows: start and stop must satisfy "
            f"0 <= start <= stop <= 5 (positions from 0, none negative); store['0.output', {start}:{stop}] reads a "
            "slice, clipped to the rows there are and counting negative positions from the end")):
        store.rows("0.output", start, stop)
    assert torch.equal(store["0.output", start:stop], store["0.output"][start:stop])


@pytest.mark.parametrize("start, stop", [(4, 2), (9, 6), (2, -1)])
def test_rows_with_start_after_stop_says_start_must_not_exceed_stop(store, start, stop):
    # the message suggested store[hp, start:stop], a slice that reads nothing
    with pytest.raises(acs.errors.RowIndexError) as info:
        store.rows("0.output", start, stop)
    message = str(info.value)
    assert f"start must not exceed stop, got start={start} > stop={stop}" in message
    assert "0 <= start <= stop <= 5" in message
    assert "store[" not in message
