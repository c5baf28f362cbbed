"""``plain_hooks`` of acs_testing, the plain-PyTorch reference the capture tests compare with:
its records are checked against values computed by hand, so that a broken reference cannot
make those comparisons pass with nothing to compare."""

from __future__ import annotations

import torch

from acs_testing import plain_hooks


class _Pair(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x, scale=2):
        h = self.lin(x)
        return h, (h * scale, None)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pair = _Pair()
        self.act = torch.nn.ReLU(inplace=True)

    def forward(self, x):
        h, _ = self.pair(x, 3)
        return self.act(h)


def test_outputs_of_every_submodule_per_call():
    model = _Net()
    xs = [torch.randn(2, 3), torch.randn(4, 3)]
    got, result = plain_hooks(model, lambda: [model(x) for x in xs])
    lin = [model.pair.lin(x).detach() for x in xs]
    assert sorted(got) == ["act.output", "pair.lin.output"]  # (the pair's tuple output is skipped)
    for key, want in (("pair.lin.output", lin), ("act.output", [v.relu() for v in lin])):
        assert len(got[key]) == 2 and all(torch.equal(a, b) for a, b in zip(got[key], want)), key
    # cloned at the call: the in-place ReLU changed the linear's output after its hook ran
    assert (lin[0] < 0).any()  # (the inputs are drawn after the model's seed: always so)
    assert not torch.equal(got["pair.lin.output"][0], got["act.output"][0])
    assert len(result) == 2 and torch.equal(result[1], lin[1].relu())
    assert not result[0].requires_grad  # (under no_grad)


def test_inputs_structured_outputs_and_options():
    model = _Net()
    x = torch.randn(2, 3)
    h = model.pair.lin(x).detach()
    got, _ = plain_hooks(model, lambda: model(x), ["", "pair"], side="both", structured="leaves",
                         to=torch.float64)
    assert sorted(got) == ["input.0", "output", "pair.input.0", "pair.output.0", "pair.output.1.0"]
    assert torch.equal(got["pair.output.1.0"][0], (h * 3).double())  # (the int argument is no input)
    assert got["input.0"][0].dtype == torch.float64 and torch.equal(got["input.0"][0], x.double())
    first, _ = plain_hooks(model, lambda: model(x), ["pair"], structured="first")
    assert list(first) == ["pair.output"] and torch.equal(first["pair.output"][0], h)
    kept, _ = plain_hooks(model, lambda: model(x), ["pair.lin"], clone=False, grad=True)
    assert kept["pair.lin.output"][0].grad_fn is not None  # (neither detached nor under no_grad)
    assert model.pair.lin._forward_hooks == {} and model._forward_pre_hooks == {}  # (removed)
