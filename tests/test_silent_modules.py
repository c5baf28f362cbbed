"""Tracked modules that never run (fused fast paths, weights used directly, TorchScript) are
never silently absent: the capture records them, or says which and why, and a store with
no hook point is never a success. References: the same modules called in plain PyTorch."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn.functional as F

from activationscope import ActivationScope, CaptureError, CaptureWarning, open_store

from acs_testing import plain_hooks


def _encoder_layer():
    torch.manual_seed(0)
    return torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True).eval()


def _ref_linear1(layer, x):
    # post-norm layer, plain PyTorch, unfused: linear1 sees norm1(x + self_attn(x))
    with torch.no_grad():
        a = layer.self_attn(x, x, x, need_weights=False)[0]
        h = layer.norm1(x + a)
        return a, F.linear(h, layer.linear1.weight, layer.linear1.bias)


@pytest.mark.parametrize("grad", ["no_grad", "inference_mode"])
def test_issue_input_fused_encoder_layer(grad):
    layer = _encoder_layer()
    x = torch.randn(2, 5, 32)
    ctx = torch.no_grad() if grad == "no_grad" else torch.inference_mode()
    with ctx:
        with ActivationScope().track(layer, include=["linear1", "self_attn"]) as t:
            layer(x)
    assert torch.backends.mha.get_fastpath_enabled()  # restored after the capture
    a, lin1 = _ref_linear1(layer, x)
    torch.testing.assert_close(t.activations["linear1.output"][0], lin1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(t.activations["self_attn.output.0"][0], a, rtol=1e-5, atol=1e-5)


def test_fused_encoder_stack_with_nested_tensor_path():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x = torch.randn(3, 6, 16)
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[0, 4:] = True
    with torch.no_grad():
        ref = enc(x, src_key_padding_mask=pad)
        with ActivationScope().track(enc, include=["layers.*.linear2"]) as t:
            out = enc(x, src_key_padding_mask=pad)
    acts = t.activations
    assert sorted(acts) == ["layers.0.linear2.output", "layers.1.linear2.output"]
    # the unfused path keeps padded positions: compare the real ones
    torch.testing.assert_close(out[~pad], ref[~pad], rtol=1e-4, atol=1e-4)
    for a in acts.values():
        assert a[0].shape == (3, 6, 16) and not a[0].is_nested


def test_fast_path_restored_after_two_overlapping_trackers():
    layer = _encoder_layer()
    t1 = ActivationScope().track(layer, include=["linear1"]).attach()
    t2 = ActivationScope().track(layer, include=["linear2"]).attach()
    assert not torch.backends.mha.get_fastpath_enabled()
    t1.remove()
    assert not torch.backends.mha.get_fastpath_enabled()
    t2.remove()
    assert torch.backends.mha.get_fastpath_enabled()


def test_tracking_only_the_fused_layer_keeps_its_fast_path():
    layer = _encoder_layer()
    with ActivationScope().track(layer, include=[""]):
        assert torch.backends.mha.get_fastpath_enabled()


def test_module_whose_parent_uses_its_weights_is_named():
    class UsesWeights(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.head = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.head(F.linear(x, self.proj.weight))  # proj is never called

    m = UsesWeights()
    x = torch.randn(3, 4)
    with pytest.warns(CaptureWarning, match=r"'proj' \(Linear\).*exclude="):
        with ActivationScope().track(m) as t:
            m(x)
    torch.testing.assert_close(t.activations["head.output"][0], m.head(F.linear(x, m.proj.weight)))


def test_out_proj_of_attention_named_with_the_hook_point_to_use():
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 3, 8)
    with pytest.warns(CaptureWarning, match=r"'out_proj'.*track '' instead"):
        with ActivationScope().track(mha, include=["out_proj"]):
            mha(x, x, x)


def test_default_selection_of_a_transformer_is_quiet_and_complete(transformer):
    x = torch.randn(2, 5, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureWarning)
        with torch.no_grad(), ActivationScope().track(transformer) as t:
            transformer(x)
    assert "layers.0.linear1.output" in t.activations
    assert not any("out_proj" in h for h in t.activations)


def test_store_with_no_hook_point_is_an_error_and_incomplete(tmp_path):
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 3, 8)
    with pytest.raises(CaptureError, match=r"recorded no hook point.*'out_proj'"):
        with ActivationScope(store=tmp_path / "s.zarr").track(mha, include=["out_proj"]):
            mha(x, x, x)
    assert open_store(tmp_path / "s.zarr").status == "incomplete"


def test_cli_capture_of_silent_modules_fails(tmp_path, monkeypatch, capsys):
    from activationscope import cli

    model = tmp_path / "m.py"
    # a MultiheadAttention needs (q, k, v): run it through a wrapper module
    model.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)\n"
        "    def forward(self, x):\n"
        "        return self.attn(x, x, x)[0]\n"
        "def build():\n"
        "    return M()\n"
    )
    data = tmp_path / "x.pt"
    torch.save(torch.randn(4, 3, 8), data)
    monkeypatch.syspath_prepend(str(tmp_path))
    rc = cli.main(["capture", "--model", "m:build", "--data", str(data), "--out", str(tmp_path / "s.zarr"),
                   "--include", "attn.out_proj", "--no-progress"])
    err = capsys.readouterr().err
    assert rc != 0 and "recorded no hook point" in err and "attn.out_proj" in err


# ---------------------------------------------------------------- TorchScript


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


@pytest.mark.parametrize("how", ["script", "trace"])
def test_issue_input_scripted_model_records_its_output(how):
    eager = _mlp()
    x = torch.randn(3, 4)
    m = torch.jit.script(eager) if how == "script" else torch.jit.trace(eager, x)
    with pytest.warns(CaptureWarning, match=r"TorchScript.*\['0', '1', '2'\].*the model itself"):
        with ActivationScope().track(m) as t:
            m(x)
    assert list(t.activations) == ["output"]
    torch.testing.assert_close(t.activations["output"][0], eager(x))


def test_eager_parent_with_scripted_block_names_what_cannot_be_tracked():
    block = _mlp()
    torch.manual_seed(1)
    parent = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.jit.script(block))
    x = torch.randn(3, 4)
    with pytest.warns(CaptureWarning, match=r"\['1.0', '1.1', '1.2'\].*Tracking '1' instead"):
        with ActivationScope().track(parent, include=["1.*", "0"]) as t:
            parent(x)
    assert sorted(t.activations) == ["0.output", "1.output"]
    h = parent[0](x)
    torch.testing.assert_close(t.activations["0.output"][0], h)
    torch.testing.assert_close(t.activations["1.output"][0], block(h))


# ---------------------------------------------------------------- torch.export, torch.fx, quantized


class _Block(torch.nn.Module):
    """An MLP inside a block: torch.export and torch.fx trace through ``mlp``'s forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mlp = _mlp()
        self.ln = torch.nn.LayerNorm(2)

    def forward(self, x):
        return self.ln(self.mlp(x))


def _eager_outputs(model, x):
    """{"<path>.output": value} of every submodule of ``model``, by plain forward hooks."""
    recs, out = plain_hooks(model, lambda: model(x))
    return {k: v[-1] for k, v in recs.items()}, out


def _capture_warnings(caught):
    return [str(w.message) for w in caught if issubclass(w.category, CaptureWarning)]


@pytest.mark.parametrize("store", [False, True])
def test_exported_module_records_its_output_and_names_the_modules_it_inlines(tmp_path, store):
    # torch.export.export(...).module() computes every module inline from its parameters (no
    # module is called): the capture tracks the exported module itself and says why and what to do
    eager = _Block().eval()
    x = torch.randn(3, 4)
    exported = torch.export.export(eager, (x,)).module()
    path = str(tmp_path / "e.zarr")
    scope = ActivationScope(store=path) if store else ActivationScope()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), scope.track(exported) as t:
            exported(x)
            exported(x + 1)
    msgs = _capture_warnings(caught)
    assert len(msgs) == 1, msgs  # (its GuardsFn, which returns nothing, is not selected)
    assert "never called by the torch.fx graph of the model itself" in msgs[0]
    assert "['ln', 'mlp', 'mlp.0', 'mlp.2']" in msgs[0] and "torch.export.unflatten" in msgs[0]
    with torch.no_grad():
        want = torch.cat([eager(x), eager(x + 1)])
    got = open_store(path)["output"] if store else torch.cat(t.activations["output"])
    assert sorted(open_store(path).hook_points if store else t.activations) == ["output"]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_exported_module_with_an_inlined_module_included_tracks_the_exported_module():
    eager = _Block().eval()
    x = torch.randn(3, 4)
    exported = torch.export.export(eager, (x,)).module()
    with pytest.warns(CaptureWarning, match=r"1 selected module\(s\).*\['mlp\.0'\]\. Tracking the model itself"):
        with torch.no_grad(), ActivationScope().track(exported, include=["mlp.0"]) as t:
            exported(x)
    with torch.no_grad():
        torch.testing.assert_close(t.activations["output"][0], eager(x), rtol=0, atol=0)


def test_unflattened_export_records_every_module_as_the_eager_model():
    eager = _Block().eval()
    x = torch.randn(3, 4)
    unflat = torch.export.unflatten(torch.export.export(eager, (x,)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureWarning)
        with torch.no_grad(), ActivationScope().track(unflat) as t:
            unflat(x)
    ref, _ = _eager_outputs(eager, x)
    assert sorted(t.activations) == sorted(ref)
    for name, want in ref.items():
        torch.testing.assert_close(t.activations[name][0], want, rtol=0, atol=0, msg=name)


class _UsesWeights(torch.nn.Module):
    """Calls ``fc`` and uses ``proj``'s weight directly: symbolic_trace keeps ``proj`` for its
    parameters only."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 4)
        self.proj = torch.nn.Linear(4, 2)

    def forward(self, x):
        return F.linear(self.fc(x), self.proj.weight)


def test_symbolic_trace_records_the_modules_its_graph_calls_and_names_the_others():
    eager = _UsesWeights().eval()
    x = torch.randn(3, 4)
    traced = torch.fx.symbolic_trace(eager)
    with pytest.warns(CaptureWarning, match=r"torch.fx graph of the model itself.*\['proj'\]"):
        with torch.no_grad(), ActivationScope().track(traced) as t:
            traced(x)
    assert sorted(t.activations) == ["fc.output", "output"]
    with torch.no_grad():
        h = eager.fc(x)
        torch.testing.assert_close(t.activations["fc.output"][0], h, rtol=0, atol=0)
        torch.testing.assert_close(t.activations["output"][0], F.linear(h, eager.proj.weight), rtol=0, atol=0)


def test_symbolic_trace_of_nested_modules_records_the_leaves_and_names_what_it_traced_through():
    eager = _Block().eval()
    x = torch.randn(3, 4)
    traced = torch.fx.symbolic_trace(eager)
    # "mlp" is traced through (its forward inlined into the graph, its modules called by it): it
    # has no hook point of its own, unlike in the eager model, and the capture says so
    with pytest.warns(CaptureWarning, match=r"1 module\(s\) of _Block have no hook point of their own \['mlp'\]"):
        with torch.no_grad(), ActivationScope().track(traced) as t:
            traced(x)
    ref, out = _eager_outputs(eager, x)
    assert sorted(t.activations) == sorted(set(ref) - {"mlp.output"})
    for name, got in t.activations.items():
        torch.testing.assert_close(got[0], ref[name], rtol=0, atol=0, msg=name)
    with pytest.warns(CaptureWarning, match=r"1 selected module\(s\).*\['mlp'\].*Tracking the model itself instead"):
        with torch.no_grad(), ActivationScope().track(traced, include=["mlp"]) as t:
            traced(x)
    assert list(t.activations) == ["output"]
    torch.testing.assert_close(t.activations["output"][0], out, rtol=0, atol=0)


def _quantized():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch.ao.quantization's deprecation notices)
        return torch.ao.quantization.quantize_dynamic(_mlp().eval(), {torch.nn.Linear}, dtype=torch.qint8)


def test_dynamically_quantized_model_records_its_own_values_quietly():
    model = _quantized()
    x = torch.randn(3, 4)
    ref, _ = _eager_outputs(model, x)  # the quantized model's own hooks: its int8 matmuls' values
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), ActivationScope().track(model) as t:
            model(x)
    assert _capture_warnings(caught) == []  # the packed weights, never called, are not selected
    assert sorted(t.activations) == ["0.output", "1.output", "2.output"]
    for name, got in t.activations.items():
        torch.testing.assert_close(got[0], ref[name], rtol=0, atol=0, msg=name)


def test_packed_weights_of_a_quantized_linear_named_with_the_module_to_track():
    model = _quantized()
    with pytest.warns(CaptureWarning, match=r"'0\._packed_params' \(LinearPackedParams\): its parent never calls it.*"
                                            r"track '0' instead"):
        with torch.no_grad(), ActivationScope().track(model, include=["0._packed_params", "2"]):
            model(torch.randn(3, 4))


def test_capture_docs_export_example_prints_what_it_says(capsys):
    # docs/usage/capture.md, "Compiled, scripted, exported and quantized models"
    from pathlib import Path

    from acs_testing import python_blocks

    page = Path(__file__).resolve().parents[1] / "docs" / "usage" / "capture.md"
    block = next(b for b in python_blocks(page) if "torch.export.unflatten" in b)
    exec(compile(block, str(page), "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["['output']",
                       "2 module(s) of GraphModule are never called by the torch.fx graph of the model itself (GraphModule)",
                       "['0.output', '1.output', '2.output']"]
    for line in printed:
        assert f"# {line}" in block  # the page's comments say what it prints


def test_a_store_capture_that_captures_no_forward_is_an_error_and_its_new_store_is_removed(tmp_path):
    m = torch.nn.Linear(3, 2)
    path = str(tmp_path / "e.zarr")
    with pytest.raises(CaptureError, match=r"captured no forward of Linear, so the store holds no hook point "
                                           r"\(removed: it was new\)"):
        with ActivationScope(store=path, reductions=["mean"]).track(m):
            pass  # an exhausted data loader
    assert not os.path.exists(path)


def test_resuming_a_complete_store_with_nothing_left_to_capture_stays_complete(tmp_path):
    m = torch.nn.Linear(3, 2)
    path = str(tmp_path / "s.zarr")
    x = torch.randn(5, 3)
    with torch.no_grad(), ActivationScope(store=path).track(m):
        m(x)
    with ActivationScope(store=path, store_options={"resume": True}).track(m):
        pass
    s = open_store(path)
    assert s.status == "complete"
    with torch.no_grad():
        torch.testing.assert_close(s["output"], m(x), rtol=0, atol=0)


class _SometimesNone(torch.nn.Module):
    """Returns no tensor in the forwards listed in ``off``."""

    def __init__(self) -> None:
        super().__init__()
        self.off: set[int] = set()
        self.k = 0

    def forward(self, x):
        k, self.k = self.k, self.k + 1
        return None if k in self.off else x * 2


class _TwoBranches(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Identity()
        self.b = _SometimesNone()

    def forward(self, x):
        self.b(x)
        return self.a(x)


def _capture_two_branches(path, off, n_forwards=5):
    model = _TwoBranches()
    model.b.off = set(off)
    xs = [torch.full((2, 3), float(i)) for i in range(n_forwards)]
    with ActivationScope(store=str(path)).track(model, include=["a", "b"]):
        for x in xs:
            model(x)
    return xs


def test_module_returning_no_tensor_in_a_middle_forward_warns_once(tmp_path):
    with pytest.warns(CaptureWarning) as record:
        xs = _capture_two_branches(tmp_path / "s.zarr", off={1, 3})
    lost = [str(w.message) for w in record if "follow the sample row table" in str(w.message)]
    assert len(lost) == 1  # once per hook point, not once per forward without rows
    assert "hook point 'b.output' recorded 0 row(s) in forward 1 of the tracked model, where the row table got 2" in lost[0]
    assert "store.follows_row_table('b.output') is False" in lost[0] and "exclude=" in lost[0]
    s = open_store(tmp_path / "s.zarr")
    assert s.follows_row_table("a.output") and not s.follows_row_table("b.output")
    torch.testing.assert_close(s["b.output"], torch.cat([xs[i] * 2 for i in (0, 2, 4)]))
    torch.testing.assert_close(s["a.output"], torch.cat(xs))


def test_two_hook_points_losing_the_row_table_are_each_named(tmp_path):
    model = torch.nn.ModuleDict({"p": _SometimesNone(), "q": _SometimesNone()})
    model.p.off, model.q.off = {1}, {2, 3}

    class Root(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, x):
            self.m.p(x)
            self.m.q(x)
            return x

    root = Root()
    with pytest.warns(CaptureWarning) as record:
        with ActivationScope(store=str(tmp_path / "s.zarr")).track(root, include=["m.p", "m.q"]):
            for i in range(5):
                root(torch.ones(2, 3))
    lost = sorted(str(w.message) for w in record if "follow the sample row table" in str(w.message))
    assert [m.split("'")[1] for m in lost] == ["m.p.output", "m.q.output"]
    assert "in forward 1" in lost[0] and "in forward 2" in lost[1]


def test_modules_returning_tensors_every_forward_give_no_row_table_warning(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureWarning)
        _capture_two_branches(tmp_path / "s.zarr", off=())
    s = open_store(tmp_path / "s.zarr")
    assert s.follows_row_table("a.output") and s.follows_row_table("b.output")


def test_tracking_the_layers_of_an_encoder_given_a_padding_mask_stores_dense_rows(tmp_path):
    # nn.TransformerEncoder (and nn.Transformer's encoder) given src_key_padding_mask in eval
    # passes its layers a nested tensor of the real tokens: the layers' outputs could not be
    # stored. Tracking its layers turns that path off: one row per real token
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    enc = torch.nn.TransformerEncoder(layer, 2).eval()
    x = torch.randn(3, 6, 16)
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[0, 4:] = True
    pad[2, 2:] = True
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        ref, _ = plain_hooks(enc, lambda: enc(x, src_key_padding_mask=pad), ["layers.0", "layers.1"])
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    with torch.no_grad(), ActivationScope(store=tmp_path / "s.zarr").track(enc, include=["layers.?"]) as t:
        t.set_batch(attention_mask=~pad)
        enc(x, src_key_padding_mask=pad)
    assert torch.backends.mha.get_fastpath_enabled()
    store = open_store(tmp_path / "s.zarr")
    for i in range(2):
        assert store.row_kind(f"layers.{i}.output") == "token"
        torch.testing.assert_close(store[f"layers.{i}.output"], ref[f"layers.{i}.output"][-1][~pad],
                                   rtol=1e-5, atol=1e-5)


def test_tracking_the_layers_of_an_encoder_without_nested_tensors_keeps_the_fast_path():
    # its layers are called with dense tensors either way: only an encoder that uses nested
    # tensors (enable_nested_tensor=True, the default) turns the fast path off
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    dense = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    with ActivationScope().track(dense, include=["layers.0"]):
        assert torch.backends.mha.get_fastpath_enabled()
    nested = torch.nn.TransformerEncoder(layer, 2).eval()
    with ActivationScope().track(nested, include=["layers.0"]):
        assert not torch.backends.mha.get_fastpath_enabled()
    assert torch.backends.mha.get_fastpath_enabled()



@pytest.mark.parametrize("how", ["export", "symbolic_trace", "script", "exclude"])
@pytest.mark.parametrize("call", ["select_modules", "track"])
def test_module_selection_warnings_name_the_callers_line(how, call):
    # select_modules' warnings (modules a torch.fx graph inlines or traced through, modules
    # inside TorchScript, an exclude pattern matching nothing) named a line a fixed number of
    # frames above them, right for scope.track only: select_modules called directly (or track
    # called by the library's own capture functions) had them name a line of pytest, or of
    # the library
    from activationscope.capture.hooks import select_modules

    eager = _Block().eval()
    x = torch.randn(3, 4)
    model = {"export": lambda: torch.export.export(eager, (x,)).module(),
             "symbolic_trace": lambda: torch.fx.symbolic_trace(eager),
             "script": lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.jit.script(_mlp())),
             "exclude": lambda: eager}[how]()
    exclude = ["nothing_here"] if how == "exclude" else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if call == "select_modules":
            select_modules(model, exclude=exclude)
        else:
            ActivationScope().track(model, exclude=exclude)
    got = [(w.filename, str(w.message)[:60]) for w in caught if issubclass(w.category, CaptureWarning)]
    assert got and all(f == __file__ for f, _ in got), got
