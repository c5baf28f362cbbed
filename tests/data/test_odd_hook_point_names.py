"""Hook points whose module names hold characters a store key may not (a backslash, NUL: a
``ModuleDict`` takes any str key) are captured and read back. Their array folders escape
those characters (``%5C``, ``%00``) as ``/`` is escaped; before, the commit refused its own key
as a damaged store. Reference: the modules called in plain PyTorch."""

from __future__ import annotations

import torch

import activationscope as acs
from activationscope.data import ActivationDataset


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.m = torch.nn.ModuleDict({"a\\b": torch.nn.Linear(3, 2), "c\x00d": torch.nn.Linear(3, 2),
                                      "e%5Cf": torch.nn.Linear(3, 2)})

    def forward(self, x):
        return sum(layer(x) for layer in self.m.values())


def test_backslash_and_nul_in_a_module_name_are_captured_and_read_back(tmp_path):
    torch.manual_seed(0)
    model = _Model()
    x = torch.randn(5, 3)
    path = str(tmp_path / "s.zarr")
    with acs.ActivationScope(store=path).track(model, include=["m.*"]):
        with torch.no_grad():
            model(x)
    store = acs.open_store(path)
    names = {"a\\b": "m.a\\b.output", "c\x00d": "m.c\x00d.output", "e%5Cf": "m.e%5Cf.output"}
    assert sorted(store.hook_points) == sorted(names.values())
    with torch.no_grad():
        for key, hp in names.items():
            ds = ActivationDataset(path, hook_points=[hp], columns=["sample_id"])
            assert torch.equal(ds[:][hp], model.m[key](x)), hp
            assert torch.equal(ds[[4, 0]][hp], model.m[key](x)[[4, 0]]), hp
    assert store.verify() == []
