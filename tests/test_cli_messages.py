"""What the command line says about stores, paths and files: named for what they are."""

from __future__ import annotations

import torch

import activationscope as acs
from activationscope.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_info_calls_its_size_ratio_data_over_disk(tmp_path, capsys):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(model):
        model(torch.randn(8, 4))
    code, out, _ = run(capsys, "info", str(tmp_path / "s.zarr"))
    assert code == 0
    assert "(compression ratio" not in out and "data/disk" in out and "not a compression ratio" in out
