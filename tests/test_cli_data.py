"""The data files of ``activationscope capture --data``: what each holds, how it is checked,
and what a ``--resume`` compares it with."""

from __future__ import annotations

import numpy as np
import torch

from activationscope import cli

NETS = """
    import os

    import torch

    class Fails(torch.nn.Module):
        # a Linear(6, 8) that raises on a batch holding NaN while STOP_ON_NAN is set: a
        # capture stopped part way
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a = torch.nn.Linear(6, 8)

        def forward(self, x):
            if os.environ.get("STOP_ON_NAN") and torch.isnan(x).any():
                raise ValueError("nan in input")
            return self.a(x)

    def fails():
        return Fails()

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
"""


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _one_error_line(err: str, *needles: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]


def _files(out):
    return sorted((p.relative_to(out).as_posix(), p.stat().st_size) for p in out.rglob("*") if p.is_file())


def test_resume_with_a_tensor_file_cut_and_rewritten_since_is_refused(tmp_path, user_package, capsys, monkeypatch):
    # a capture of 100 rows stopped after 50; the file was then rewritten with 80 other rows:
    # the fingerprint covered 100 samples, more than the file holds, so it was not compared,
    # and the resume stored rows 50..79 of the new file under rows 0..49 of the old one
    import activationscope as acs

    user_package("cutnets", NETS)
    monkeypatch.setenv("STOP_ON_NAN", "1")
    x = np.random.default_rng(0).standard_normal((100, 6)).astype(np.float32)
    x[55, 0] = np.nan  # the model raises on the batch of samples 50..59
    data = tmp_path / "d.npy"
    np.save(data, x)
    out = tmp_path / "a.zarr"
    args = ["capture", "--model", "cutnets.nets:fails", "--data", str(data), "--out", str(out),
            "--batch-size", "10", "--no-progress"]
    code, _, err = run(capsys, *args, "--shard-bytes", "100")
    assert code == 1 and acs.open_store(str(out)).n_samples == 50, err
    before = _files(out)
    np.save(data, np.random.default_rng(1).standard_normal((80, 6)).astype(np.float32))
    code, _, err = run(capsys, *args, "--resume")
    assert code == 1
    _one_error_line(err, "--resume: store", "holds 50 samples", "is not the data they were captured from",
                    "it has 80 samples, and the run that captured them read 100", "nothing was changed")
    assert _files(out) == before
    assert acs.open_store(str(out)).n_samples == 50


def test_resume_compares_the_fingerprint_of_the_run_that_stored_the_last_rows(tmp_path, user_package, capsys,
                                                                              monkeypatch):
    # a first run of 20 samples, a resume to 80 stopped at 50, then a resume with samples 20..49
    # changed: the first run's fingerprint (20 samples) was the only one compared, so rows of
    # two data sets were mixed without a word
    import activationscope as acs

    user_package("chainnets", NETS)
    monkeypatch.setenv("STOP_ON_NAN", "1")
    x = np.random.default_rng(0).standard_normal((100, 6)).astype(np.float32)
    x[55, 0] = np.nan
    data = tmp_path / "d.npy"
    np.save(data, x)
    out = tmp_path / "a.zarr"
    args = ["capture", "--model", "chainnets.nets:fails", "--data", str(data), "--out", str(out),
            "--batch-size", "10", "--no-progress", "--shard-bytes", "100"]
    code, _, err = run(capsys, *args, "--max-samples", "20")
    assert code == 0, err
    code, _, err = run(capsys, *args, "--resume", "--max-samples", "80")
    assert code == 1 and acs.open_store(str(out)).n_samples == 50, err
    before = _files(out)
    y = x.copy()
    y[30] += 1  # a stored sample of the second run
    np.save(data, y)
    code, _, err = run(capsys, *args, "--resume")
    assert code == 1
    _one_error_line(err, "--resume: store", "holds 50 samples", "its first 80 samples", "nothing was changed")
    assert _files(out) == before
    y = x  # the stored samples as they were: resumed
    np.save(data, y)
    monkeypatch.delenv("STOP_ON_NAN")
    code, _, err = run(capsys, *args, "--resume")
    assert code == 0, err
    store = acs.open_store(str(out))
    assert store.n_samples == 100
    ref = torch.nn.functional.linear(torch.from_numpy(y), *_weights())
    assert torch.allclose(store["a.output"][:], ref, atol=1e-6, equal_nan=True)


def _weights():
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 8)
    return lin.weight.detach(), lin.bias.detach()
