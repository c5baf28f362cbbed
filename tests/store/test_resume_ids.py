"""Resume with the tracker's default sample ids continues the numbering."""

from __future__ import annotations

import pytest
import torch

import activationscope as acs


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())


def test_resume_with_default_sample_ids_equals_uninterrupted(tmp_path):
    model = _model()
    xs = [torch.randn(4, 8) for _ in range(6)]
    with acs.ActivationScope(store=str(tmp_path / "ref.zarr")).track(model), torch.no_grad():
        for x in xs:
            model(x)

    path = str(tmp_path / "run.zarr")
    with pytest.raises(KeyboardInterrupt):
        with acs.ActivationScope(store=path).track(model), torch.no_grad():
            for x in xs[:3]:
                model(x)
            raise KeyboardInterrupt
    assert acs.open_store(path).status == "incomplete"

    tracker = acs.ActivationScope(store=path, store_options={"resume": True}).track(model)
    with tracker, torch.no_grad():
        start = tracker.resume_from
        assert start % 4 == 0 and 0 < start <= 12
        for x in xs[start // 4:]:
            model(x)

    got, ref = acs.open_store(path), acs.open_store(tmp_path / "ref.zarr")
    assert got.status == "complete"
    for hp in ref.hook_points:
        assert torch.equal(got[hp], ref[hp])
    assert got.row_table("sample").column("sample_id").to_pylist() == list(range(24))
    assert ref.row_table("sample").column("sample_id").to_pylist() == list(range(24))


def test_custom_script_reduction_is_kept_with_the_store(tmp_path):
    from typing import Optional

    def total(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        s = x.double().sum(0)
        return s if acc is None else acc + s

    model = _model()
    xs = [torch.randn(4, 8) for _ in range(3)]
    with acs.ActivationScope(store=str(tmp_path / "s.zarr"), reductions=[total]).track(model), torch.no_grad():
        for x in xs:
            model(x)
    store = acs.open_store(tmp_path / "s.zarr")
    with torch.no_grad():
        want = torch.cat([model[0](x) for x in xs]).double().sum(0)
    torch.testing.assert_close(store.reductions["0.output"]["total"], want)
    script = store.reduction_script("0.output", "total")
    assert script is not None and len(script) > 0
    # a colleague can recompute it from the kept TorchScript
    import io

    fn = torch.jit.load(io.BytesIO(script))
    torch.testing.assert_close(fn(None, store["0.output"]), want)


def test_exception_inside_a_forward_commits_only_whole_forwards(tmp_path):
    class Flaky(torch.nn.Module):
        calls = 0
        fail_at = 3

        def forward(self, x):
            Flaky.calls += 1
            if Flaky.calls == Flaky.fail_at:
                raise RuntimeError("boom")
            return x * 2

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Flaky(), torch.nn.Linear(8, 8))
    xs = [torch.randn(4, 8) for _ in range(5)]
    path = str(tmp_path / "run.zarr")
    with pytest.raises(RuntimeError, match="boom"):
        with acs.ActivationScope(store=path).track(model), torch.no_grad():
            for x in xs:
                model(x)
    store = acs.open_store(path)
    assert store.status == "incomplete"
    assert store.n_samples == 8  # two whole forwards; the third raised after layer 0 was captured
    assert all(store.n_rows(hp) == 8 for hp in store.hook_points)
    Flaky.fail_at = -1
    tracker = acs.ActivationScope(store=path, store_options={"resume": True}).track(model)
    with tracker, torch.no_grad():
        for x in xs[tracker.resume_from // 4:]:
            model(x)
    store = acs.open_store(path)
    with torch.no_grad():
        want = torch.cat([model[0](x) for x in xs])
    assert store.status == "complete" and torch.equal(store["0.output"], want)
    assert store.row_table("sample").column("sample_id").to_pylist() == list(range(20))
