"""Copying, pickling and saving a model while it is tracked gives an untracked copy."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import activationscope as acs


class Scaled(torch.nn.Module):
    """A module whose class defines forward normally."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * 2


class Swapped(torch.nn.Module):
    """A module whose forward the user replaced on the instance."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.forward = self.other

    def other(self, x):
        return self.lin(x) - 1


def _deepcopy(m):
    return copy.deepcopy(m)


def _pickle(m):
    return pickle.loads(pickle.dumps(m))


def _torch_save(m):
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


COPIERS = [_deepcopy, _pickle, _torch_save]


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "sequential":
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    if kind == "class_forward":
        return torch.nn.Sequential(Scaled(), torch.nn.ReLU())
    return torch.nn.Sequential(Swapped(), torch.nn.ReLU())


@pytest.mark.parametrize("copier", COPIERS, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("kind", ["sequential", "class_forward", "instance_forward"])
@pytest.mark.parametrize("part", ["model", "submodule"])
def test_copy_of_tracked_model_is_untracked_and_equal(copier, kind, part):
    model = _model(kind)
    x = torch.randn(3, 4)
    with torch.no_grad(), acs.ActivationScope().track(model, include=["*"]) as tracker:
        model(x)
        target = model if part == "model" else model[0]
        clone = copier(target)
        n_before = {hp: len(r) for hp, r in tracker.activations.items()}
        out_copy = clone(x)
        assert {hp: len(r) for hp, r in tracker.activations.items()} == n_before  # the copy records nothing
        assert torch.equal(out_copy, target(x))  # the original, tracked, records that call
        if part == "model":
            assert all(len(r) == n_before[hp] + 1 for hp, r in tracker.activations.items())
        else:
            assert len(tracker.activations["0.output"]) == n_before["0.output"] + 1
        for m in clone.modules():
            assert not isinstance(m.__dict__.get("forward"), acs.capture.scope._C.ForwardWrapper)
    # the copy's forward is the original one, bound to the copy
    inner = clone if part == "submodule" else clone[0]
    if kind == "instance_forward":
        assert inner.forward.__func__ is Swapped.other and inner.forward.__self__ is inner
    else:
        assert type(inner).forward is inner.forward.__func__ and inner.forward.__self__ is inner
    # the copy stays untracked after the original is untracked; the original is as before
    assert "forward" not in model[2 if kind == "sequential" else 1].__dict__
    assert torch.equal(clone(x), target(x))
    copy.deepcopy(model)


def test_pickle_of_tracked_model_does_not_need_activationscope():
    model = _model("sequential")
    with acs.ActivationScope().track(model):
        data = pickle.dumps(model)
    assert b"activationscope" not in data


def test_copy_of_untracked_copy_parameters_are_independent():
    model = _model("sequential")
    with acs.ActivationScope().track(model):
        clone = copy.deepcopy(model)
    with torch.no_grad():
        clone[0].weight.add_(1)
    assert not torch.equal(clone[0].weight, model[0].weight)
