"""set_batch describes the next forward's batch: a description of another number of samples,
or a mask that is not 0/1, is refused naming the argument, expected and actual (issue 12)."""

from __future__ import annotations

import pytest
import torch

import activationscope as acs
from activationscope.errors import ActivationScopeError


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU()).eval()


@pytest.mark.parametrize("kwargs, what", [
    ({"sample_ids": [10, 11, 12]}, "sample_ids"),
    ({"label": [1, 0, 1, 0, 1]}, "column 'label'"),
    ({"attention_mask": torch.ones(3, 7, dtype=torch.bool)}, "attention_mask"),
])
@pytest.mark.parametrize("to_store", [False, True])
def test_batch_described_with_another_size_is_refused(tmp_path, kwargs, what, to_store):
    model = _model()
    x = torch.randn(4, 7, 6) if "attention_mask" in kwargs else torch.randn(4, 6)
    scope = acs.ActivationScope(store=str(tmp_path / "s.zarr")) if to_store else acs.ActivationScope()
    with pytest.raises(ValueError, match=rf"set_batch\({what}=\.\.\.\) describes \d samples, but the forward's batch has 4") as e:
        with scope.track(model) as tr, torch.no_grad():
            tr.set_batch(**kwargs)
            model(x)
    assert isinstance(e.value, ActivationScopeError)
    if to_store:
        assert acs.open_store(tmp_path / "s.zarr").n_samples == 0  # nothing committed for that forward


def test_matching_description_is_accepted(tmp_path):
    model = _model()
    scope = acs.ActivationScope(store=str(tmp_path / "s.zarr"))
    with scope.track(model) as tr, torch.no_grad():
        tr.set_batch(sample_ids=[10, 11, 12, 13], label=[1, 0, 1, 0])
        model(torch.randn(4, 6))
    s = acs.open_store(tmp_path / "s.zarr")
    assert s.row_table().column("sample_id").to_pylist() == [10, 11, 12, 13]
    assert s.n_rows("0") == 4 if "0" in s else s.n_rows(s.hook_points[0]) == 4


@pytest.mark.parametrize("mask, error, match", [
    (torch.ones(2, 3), TypeError, r"attention_mask must be bool or 0/1 integers, got dtype torch.float32"),
    (torch.tensor([[0, 2, 1], [1, 1, 0]]), ValueError, r"attention_mask must hold only 0 and 1, got values in \[0, 2\]"),
    (torch.tensor([[0, -1, 1], [1, 1, 0]]), ValueError, r"attention_mask must hold only 0 and 1"),
    (torch.ones(2, 3, 4, dtype=torch.bool), ValueError, r"attention_mask must be a \(batch, pos\) tensor"),
])
def test_bad_masks_are_refused(mask, error, match):
    tr = acs.ActivationScope().track(_model())
    with pytest.raises(error, match=match) as e:
        tr.set_batch(attention_mask=mask)
    assert isinstance(e.value, ActivationScopeError)


def test_integer_01_mask_is_accepted():
    tr = acs.ActivationScope().track(_model())
    tr.set_batch(attention_mask=torch.tensor([[1, 1, 0], [1, 0, 0]]))
