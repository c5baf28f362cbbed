"""Activations a capture cannot record (sparse, nested, meta-device tensors) raise
CaptureError naming the hook point, what it is and the fix; a store stays readable."""

from __future__ import annotations

import warnings

import pytest
import torch

import activationscope as acs


class Out(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x):
        if self.kind == "sparse":
            return x.to_sparse()
        if self.kind == "nested":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # nested tensors are a prototype
                return torch.nested.nested_tensor([x[0], x[1, :2]])
        return torch.empty(x.shape, device="meta")


KINDS = {"sparse": "sparse_coo tensor", "nested": "nested tensor", "meta": "meta device"}


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 3), Out(kind), torch.nn.Identity())


@pytest.mark.parametrize("kind", list(KINDS))
def test_in_memory_raises_capture_error_naming_hook_point(kind):
    model = _model(kind)
    with pytest.raises(acs.CaptureError, match=rf"hook point '1\.output' is .*{KINDS[kind]}.*exclude=\['1'\]"):
        with torch.no_grad(), acs.ActivationScope().track(model, include=["0", "1"]):
            model(torch.randn(2, 3))
    assert "forward" not in model[1].__dict__  # the wrappers are removed
    # excluding it, as the message says, captures the rest
    with torch.no_grad(), acs.ActivationScope().track(model, include=["0", "1"], exclude=["1"]) as tracker:
        model(torch.randn(2, 3))
    assert tracker.hook_points == ["0.output"]


@pytest.mark.parametrize("kind", list(KINDS))
def test_store_raises_and_stays_readable(kind, tmp_path):
    model = _model(kind)
    path = tmp_path / "run.zarr"
    x = torch.randn(2, 3)
    with pytest.raises(acs.CaptureError, match=rf"hook point '1\.output' is .*{KINDS[kind]}.*stored"):
        with torch.no_grad(), acs.ActivationScope(store=path).track(model, include=["0", "1"]):
            model(x)
    store = acs.open_store(path)
    for hp in store.hook_points:  # nothing half-recorded: the raised forward is not committed
        assert store[hp].shape[0] == 0
    # the store is whole when the hook point is excluded
    path2 = tmp_path / "run2.zarr"
    with torch.no_grad(), acs.ActivationScope(store=path2).track(model, include=["0", "1"], exclude=["1"]):
        model(x)
    store = acs.open_store(path2)
    assert store.hook_points == ["0.output"]
    assert torch.equal(store["0.output"], model[0](x).detach())


@pytest.mark.parametrize("kind", list(KINDS))
def test_reductions_raise(kind):
    model = _model(kind)
    scope = acs.ActivationScope(capture_mode=acs.CaptureMode.REFERENCE, reductions=["mean"])
    with pytest.raises(acs.CaptureError, match=r"hook point '1\.output'.*reduced"):
        with torch.no_grad(), scope.track(model, include=["1"]):
            model(torch.randn(2, 3))


@pytest.mark.parametrize("kind", list(KINDS))
def test_reference_in_memory_keeps_the_tensor(kind):
    model = _model(kind)
    with torch.no_grad(), acs.ActivationScope(capture_mode=acs.CaptureMode.REFERENCE).track(model, include=["1"]) as tr:
        out = model[1](model[0](torch.randn(2, 3)))
    record = tr.activations["1.output"][0]
    assert record.is_nested == out.is_nested and record.layout == out.layout and record.device == out.device
