"""Tracking a torch.compile'd model: captures run as custom ops inside the compiled graph.

References are plain PyTorch: forward hooks (clones) on the eager model, in call order. The
compiled graphs and breaks are counted by TorchDynamo itself (torch._dynamo.explain and its
counters).
"""

from __future__ import annotations

import dataclasses
import typing
import warnings

import numpy as np
import pytest
import torch

torch._dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.utils import counters  # noqa: E402

from activationscope import (ActivationScope, CaptureMode, CaptureWarning, HookPointNotFoundError,  # noqa: E402
                             open_store)

from acs_testing import plain_hooks  # noqa: E402


class Block(torch.nn.Module):
    """A pre-LayerNorm transformer block: attention (tuple output) and an MLP (a Sequential
    whose output is its last child's: an alias)."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ln1 = torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = torch.nn.LayerNorm(d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        x = x + a
        return x + self.mlp(self.ln2(x))


class MLP(torch.nn.Module):
    """A model class of its own (TorchDynamo starts tracing at its forward) with an in-place
    ReLU after a hook point, so a record that is not a copy would change."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(d, 2 * d)
        self.act = torch.nn.ReLU()
        self.fc2 = torch.nn.Linear(2 * d, d)

    def forward(self, x):
        h = self.fc1(x)
        out = self.act(h)
        h.mul_(2.0)  # in place, after fc1's hook point
        return self.fc2(out) + h.sum(-1, keepdim=True)


def make(kind: str) -> tuple[torch.nn.Module, callable]:
    if kind == "sequential":
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        return model.eval(), lambda b: torch.randn(b, 8)
    if kind == "mlp":
        return MLP().eval(), lambda b: torch.randn(b, 8)
    return Block().eval(), lambda b: torch.randn(b, 5, 16)


def reference(model, names, xs, side="output"):
    """{hook point: [clone per forward]} from plain forward hooks on the eager model."""
    return plain_hooks(model, lambda: [model(x) for x in xs], names, side=side, structured="leaves")


def assert_records(got, ref):
    assert sorted(got) == sorted(ref)
    for name in ref:
        assert len(got[name]) == len(ref[name]), name
        for a, b in zip(got[name], ref[name]):
            assert a.shape == b.shape, name
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


_INDUCTOR: list[str | None] = []  # [None] once the inductor backend compiled here, [why not] when it cannot


@pytest.fixture
def inductor():
    """Skips the test when TorchInductor, the default ``torch.compile`` backend, cannot compile
    on this machine (no working C++ compiler): tried once, on a function of its own."""
    if not _INDUCTOR:
        torch._dynamo.reset()
        try:
            torch.compile(lambda t: t * 2 + 1)(torch.ones(3))
            _INDUCTOR.append(None)
        except Exception as e:  # noqa: BLE001 - any failure to build a kernel means no inductor here
            _INDUCTOR.append(f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}")
        finally:
            torch._dynamo.reset()
    if _INDUCTOR[0] is not None:
        pytest.skip(f"torch.compile's default backend (inductor) cannot compile here: {_INDUCTOR[0]}")


def tracked_names(model):
    return [n for n, _ in model.named_modules() if n and not n.endswith("out_proj")]


def explain_tracked(model, x, **track):
    torch._dynamo.reset()
    with ActivationScope().track(model, **track) as tracker:
        with torch.no_grad():
            explained = torch._dynamo.explain(model)(x)
    return explained, tracker


@pytest.mark.parametrize("kind", ["sequential", "mlp", "block"])
def test_tracked_model_compiles_to_one_graph_without_breaks(kind):
    model, make_x = make(kind)
    explained, tracker = explain_tracked(model, make_x(3))
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    # the ops are in that graph, one call_begin / call_end per tracked module call (the root's
    # bookkeeping runs in the native wrapper around the compiled frame: compiled after tracking)
    ops = [n.target for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]
    n_begin = sum("call_begin" in str(t) for t in ops)
    assert n_begin == len(tracked_names(model))
    assert sum("call_end" in str(t) for t in ops) == n_begin
    assert set(tracker.activations) >= {f"{n}.output" for n in tracked_names(model) if n != "attn"}


@pytest.mark.parametrize("order", ["compile_then_track", "track_then_compile", "track_the_compiled"])
@pytest.mark.parametrize("kind,dynamic", [("sequential", False), ("mlp", True), ("block", False), ("block", True)])
def test_compiled_records_equal_plain_hooks_across_recompiles(kind, dynamic, order, inductor):
    model, make_x = make(kind)
    xs = [make_x(b) for b in (4, 4, 7, 2, 7)]  # new batch sizes recompile (or hit the dynamic graph)
    ref, ref_out = reference(model, tracked_names(model), xs)
    torch._dynamo.reset()
    counters.clear()
    scope = ActivationScope()
    outs = []
    with torch.no_grad():
        if order == "compile_then_track":
            compiled = torch.compile(model, dynamic=dynamic)
            compiled(make_x(3))  # compiled once without a tracker
            with scope.track(model) as tracker:
                outs = [compiled(x) for x in xs]
        elif order == "track_then_compile":
            with scope.track(model) as tracker:
                compiled = torch.compile(model, dynamic=dynamic)
                outs = [compiled(x) for x in xs]
        else:
            compiled = torch.compile(model, dynamic=dynamic)
            with scope.track(compiled) as tracker:  # hook points named as in the model itself
                outs = [compiled(x) for x in xs]
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1
    assert tracker.n_forwards == len(xs)
    assert_records(tracker.activations, ref)
    for a, b in zip(outs, ref_out):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_inputs_and_outputs_with_sample_policy(inductor):
    model, make_x = make("block")
    xs = [make_x(b) for b in (3, 3, 5, 2)]
    names = ["ln1", "attn", "mlp.0"]
    ref, _ = reference(model, names, xs[::2], side="both")
    # attn is called with three positional inputs (h, h, h) and need_weights as a keyword
    torch._dynamo.reset()
    counters.clear()
    scope = ActivationScope(capture="both", capture_policy="sample_n", sample_every=2)
    with scope.track(model, include=names) as tracker, torch.no_grad():
        compiled = torch.compile(model)
        for x in xs:
            compiled(x)
    assert sum(counters["graph_break"].values()) == 0
    got = tracker.activations
    assert tracker.n_forwards == 4
    assert_records({k: v for k, v in got.items() if k in ref}, ref)
    assert sorted(set(got) - set(ref)) == []


def test_snapshot_into_a_store_equals_plain_hooks(tmp_path, inductor):
    model, make_x = make("block")
    xs = [make_x(b) for b in (4, 6, 3)]
    names = tracked_names(model)
    ref, _ = reference(model, names, xs)
    torch._dynamo.reset()
    counters.clear()
    scope = ActivationScope(store=tmp_path / "s.zarr", reductions=["mean"])
    with scope.track(model) as tracker, torch.no_grad():
        compiled = torch.compile(model, dynamic=True)
        for x in xs:
            compiled(x)
    assert sum(counters["graph_break"].values()) == 0
    store = open_store(tmp_path / "s.zarr")
    assert sorted(store.hook_points) == sorted(ref)
    for name, recs in ref.items():
        want = torch.cat(recs).numpy()
        got = np.asarray(store[name][:])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)
        mean = torch.cat(recs).double().mean(0)
        torch.testing.assert_close(tracker.reductions[name]["mean"], mean, rtol=1e-4, atol=1e-5)


class Spectral(torch.nn.Module):
    """Complex activations: a complex output, a conjugate view of it, and a complex input."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(6, 6)
        self.to_complex = _Lambda(lambda h: torch.complex(h, h * 2))
        self.conj = _Lambda(lambda z: z.conj())
        self.mag = _Lambda(lambda z: z.real * z.imag)

    def forward(self, x):
        return self.mag(self.conj(self.to_complex(self.fc(x))))


class _Lambda(torch.nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


@pytest.mark.parametrize("mode", ["snapshot", "reference", "store"])
def test_complex_activations_compile_with_inductor(tmp_path, mode, inductor):
    """A tracked module returning (or, with capture="both", taking) a complex tensor made
    inductor fail to compile the model ("auto_functionalized_v2 was not removed": it cannot
    lower the capture ops given complex tensors), where the untracked model compiled. The ops
    now take their real views and the capture views them as complex again: the records, the
    stored rows and the model's output equal the eager model's."""
    model = Spectral()
    xs = [torch.randn(b, 6) for b in (4, 4)]
    names = ["fc", "to_complex", "conj", "mag"]
    ref, eager = plain_hooks(model, lambda: [model(x) for x in xs], names, side="both")
    torch._dynamo.reset()
    kw = {"store": tmp_path / "s.zarr"} if mode == "store" else \
        {"capture_mode": CaptureMode.REFERENCE} if mode == "reference" else {}
    with ActivationScope(capture="both", **kw).track(model) as tracker, torch.no_grad():
        compiled = torch.compile(model)
        outs = [compiled(x) for x in xs]
    for out, want in zip(outs, eager):
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    assert ref["conj.output"][0].is_complex() and ref["conj.input.0"][0].is_complex()
    for name, recs in ref.items():
        got = open_store(tmp_path / "s.zarr")[name][:] if mode == "store" else torch.cat(tracker.activations[name])
        assert got.dtype == recs[0].dtype, name
        torch.testing.assert_close(got, torch.cat(recs), rtol=1e-5, atol=1e-6, msg=name)


def test_reference_mode_keeps_copies_the_graph_cannot_overwrite(inductor):
    model, make_x = make("mlp")
    xs = [make_x(b) for b in (4, 4, 4, 6)]
    names = tracked_names(model)
    ref, _ = reference(model, names, xs)
    torch._dynamo.reset()
    with ActivationScope(capture_mode=CaptureMode.REFERENCE).track(model) as tracker, torch.no_grad():
        compiled = torch.compile(model)
        for x in xs:
            compiled(x)  # the graph reuses its buffers from call to call, and mul_ changes fc1's in place
    assert_records(tracker.activations, ref)


def test_grad_mode_training_step(inductor):
    model, make_x = make("block")
    model.train()
    x = make_x(3)
    ref, _ = reference(model, ["ln1", "mlp.2"], [x])
    torch._dynamo.reset()
    counters.clear()
    with ActivationScope().track(model, include=["ln1", "mlp.2"]) as tracker:
        compiled = torch.compile(model)
        loss = compiled(x).square().mean()
        loss.backward()
    assert sum(counters["graph_break"].values()) == 0
    assert model.ln1.weight.grad is not None
    assert_records(tracker.activations, ref)


def test_stop_after_last_leaves_the_graph_with_a_capture_warning(inductor):
    model, make_x = make("sequential")
    xs = [make_x(3), make_x(3)]
    ref, _ = reference(model, ["0", "1"], xs)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ActivationScope(stop_after_last=True).track(model, include=["0", "1"]) as tracker, torch.no_grad():
            compiled = torch.compile(model)
            for x in xs:
                compiled(x)
    msgs = [str(w.message) for w in caught if issubclass(w.category, CaptureWarning)]
    assert any("stop_after_last" in m and "'0'" in m and "graph break" in m for m in msgs), msgs
    assert_records(tracker.activations, ref)


def test_detached_tracker_leaves_the_compiled_model_plain(inductor):
    model, make_x = make("sequential")
    x = make_x(3)
    torch._dynamo.reset()
    compiled = torch.compile(model)
    with torch.no_grad():
        with ActivationScope().track(model) as tracker:
            compiled(x)
        want = model(x)
        got = compiled(x)  # recompiled (or the plain graph again): no capture
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert [len(v) for v in tracker.activations.values()] == [1, 1, 1]
    assert "forward" not in model.__dict__


class Nested(torch.nn.Module):
    """Returns ``(x + 1, ((...(x * 3,)...),))``: ``x * 3`` inside ``levels`` one-element tuples."""

    def __init__(self, levels: int) -> None:
        super().__init__()
        self.levels = levels

    def forward(self, x):
        deep = x * 3
        for _ in range(self.levels):
            deep = (deep,)
        return (x + 1, deep)


def test_deeply_nested_output_in_a_graph_is_captured_or_warned(inductor):
    # the names and leaves of the graph path are the eager wrapper's: 12 levels are walked,
    # a container 32 levels down is not, and a CaptureWarning names it
    x = torch.randn(2, 3)
    model = torch.nn.Sequential(Nested(12), Nested(40))
    torch._dynamo.reset()
    with pytest.warns(CaptureWarning, match=r"'1\.output\.1(\.0){31}'.*nested 32 levels deep"):
        with ActivationScope().track(model) as tracker, torch.no_grad():
            torch.compile(model[0])(x)
            torch.compile(model[1])(x)
    got = tracker.activations
    deep = "0.output.1" + ".0" * 12
    assert sorted(got) == sorted(["0.output.0", deep, "1.output.0"])
    assert torch.equal(got[deep][0], x * 3)
    assert torch.equal(got["1.output.0"][0], x + 1)


@dataclasses.dataclass
class WithClassVar:
    SCALE: typing.ClassVar[torch.Tensor] = torch.full((2,), 7.0)  # of the class, not a field
    hidden: torch.Tensor


class ReturnsDataclass(torch.nn.Module):
    def forward(self, x):
        return WithClassVar(hidden=x * 2)


def test_dataclass_output_in_a_graph_records_its_fields_only(inductor):
    model = torch.nn.Sequential(ReturnsDataclass())
    x = torch.randn(2, 3)
    torch._dynamo.reset()
    with ActivationScope().track(model) as tracker, torch.no_grad():
        torch.compile(model)(x)
    assert list(tracker.activations) == ["0.output.hidden"]
    assert torch.equal(tracker.activations["0.output.hidden"][0], x * 2)


@pytest.mark.parametrize("how,backend,dtype,grad", [
    ("wrapper", "eager", torch.float16, "no_grad"),
    ("wrapper", "aot_eager", torch.bfloat16, "inference_mode"),
    ("wrapper", "aot_eager", torch.float64, "no_grad"),
    ("in_place", "eager", torch.float64, "enable_grad"),
    ("in_place", "eager", torch.bfloat16, "enable_grad"),
    ("in_place", "aot_eager", torch.float16, "inference_mode"),
])
def test_compiled_in_each_dtype_and_grad_mode_records_what_it_computes(how, backend, dtype, grad, tmp_path):
    # torch.compile(model) tracked through its wrapper, or model.compile() in place: hook points
    # named as in the model, records in the model's dtype, equal to plain hooks on the eager
    # model, bit for bit (inductor, whose fused kernels may round otherwise, is tested above in float32)
    model, make_x = make("mlp")
    model = model.to(dtype)
    xs = [make_x(b).to(dtype) for b in (4, 3)]
    names = tracked_names(model)
    ref, _ = reference(model, names, xs)
    ctx = getattr(torch, grad)
    torch._dynamo.reset()
    if how == "wrapper":
        compiled = tracked = torch.compile(model, backend=backend)
    else:
        model.compile(backend=backend)
        compiled = tracked = model
    path = tmp_path / "s.zarr"
    with ctx(), ActivationScope(store=path).track(tracked):
        for x in xs:
            compiled(x)
    store = open_store(path)
    assert sorted(store.hook_points) == sorted(ref)
    for name, recs in ref.items():
        got = store[name]
        assert got.dtype == dtype, name
        assert torch.equal(got, torch.cat(recs)), name


class UsesWeights(torch.nn.Module):
    """Calls ``fc`` and uses ``proj``'s weight directly: the forward torch.fx generates reads a
    parameter itself (a get_attr node), as every forward of torch.export's modules does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(8, 8)
        self.proj = torch.nn.Linear(8, 4)

    def forward(self, x):
        return torch.nn.functional.linear(self.fc(x), self.proj.weight)


@pytest.mark.parametrize("kind", ["export", "symbolic_trace"])
def test_compiled_graph_module_with_its_own_forward_tracked(kind):
    # TorchDynamo tracing a GraphModule's generated forward reads module.forward.__code__: the
    # tracked root's forward is the capture's wrapper, which must answer it (it failed with
    # InternalTorchDynamoError: 'ForwardWrapper' object has no attribute '__code__')
    eager = UsesWeights().eval()
    x = torch.randn(3, 8)
    if kind == "export":
        model = torch.export.export(eager, (x,)).module()
    else:
        model = torch.fx.symbolic_trace(eager)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    with pytest.warns(CaptureWarning, match=r"never called by the torch.fx graph of the model itself"):
        with torch.no_grad(), ActivationScope().track(compiled) as tracker:
            compiled(x)
            compiled(x + 1)
    with torch.no_grad():
        want = [eager(x), eager(x + 1)]
    assert sorted(tracker.activations) == (["output"] if kind == "export" else ["fc.output", "output"])
    for got, ref in zip(tracker.activations["output"], want):
        assert torch.equal(got, ref)
    assert "forward" not in model.__dict__


class Net(torch.nn.Module):
    """An MLP block, a head and an eval-mode dropout, for compiling the block alone."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = MLP()
        self.head = torch.nn.Linear(8, 4)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        return self.drop(self.head(self.block(x)))


def test_submodule_replaced_by_its_compiled_wrapper_is_named_as_in_the_eager_model(tmp_path):
    # model.block = torch.compile(model.block): the wrapper (an OptimizedModule) holds the block as
    # "_orig_mod"; hook points are named as in the eager model (they were block._orig_mod.fc1.output,
    # with both block.output and block._orig_mod.output), recorded inside the compiled graph
    model = Net().eval()
    xs = [torch.randn(b, 8) for b in (4, 3)]
    names = [n for n, _ in model.named_modules() if n]
    ref, _ = reference(model, names, xs)
    torch._dynamo.reset()
    counters.clear()
    model.block = torch.compile(model.block, backend="aot_eager")
    with torch.no_grad(), ActivationScope(store=tmp_path / "s.zarr").track(model):
        for x in xs:
            model(x)
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] >= 1
    store = open_store(tmp_path / "s.zarr")
    assert sorted(store.hook_points) == sorted(ref)
    for name, recs in ref.items():
        assert torch.equal(store[name], torch.cat(recs)), name
    with pytest.raises(HookPointNotFoundError, match=r"named as in the eager model, without '_orig_mod' "
                                                     r"\('block\._orig_mod\.fc1' is 'block\.fc1'\): include=\['block\.fc1'\]"):
        ActivationScope().track(model, include=["block._orig_mod.fc1"])


def test_children_of_a_fused_layer_compiled_as_a_submodule_are_recorded():
    # the fused fast path of a TransformerEncoderLayer is turned off for the capture also when the
    # layer is inside a torch.compile wrapper, so its children run and are recorded
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True),
                                torch.nn.Linear(16, 4)).eval()
    x = torch.randn(2, 5, 16)
    ref, _ = reference(model, ["0.linear1"], [x])  # (forward hooks turn the fast path off themselves)
    torch._dynamo.reset()
    model[0] = torch.compile(model[0], backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureWarning)
        with torch.no_grad(), ActivationScope().track(model, include=["0.linear1"]) as tracker:
            model(x)
    assert torch.backends.mha.get_fastpath_enabled()
    assert_records(tracker.activations, ref)


def test_parameters_of_a_submodule_compiled_alone_are_named_as_in_the_eager_model():
    model = Net().eval()
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch._dynamo.reset()
    model.block = torch.compile(model.block, backend="eager")
    with ActivationScope(capture_parameters=True).track(model) as tracker:
        pass
    assert list(tracker.parameters) == list(want)  # block.fc1.weight, not block._orig_mod.fc1.weight
    for name, p in want.items():
        assert torch.equal(tracker.parameters[name], p), name


@pytest.mark.parametrize("torch_like", ["2.11", "2.13", "without allow_override"])
def test_fake_implementations_register_beside_the_meta_kernels_under_each_torch(monkeypatch, torch_like):
    """csrc/compiled_ops.cpp registers a Meta kernel for each op; torch 2.11's register_fake
    refuses an op that has one unless given allow_override=True, 2.13's allows it by default,
    and a torch without the argument refuses it always: the ops get their fake implementations
    where torch takes them, and loading the package fails under none of them."""
    from activationscope.capture import compiled

    registered = []

    def refuse_beside_meta(op, allow_override):
        if not allow_override and torch._C._dispatch_has_kernel_for_dispatch_key(op, "Meta"):
            raise RuntimeError(f"register_fake(...): the operator {op} already has an DispatchKey::Meta implementation")
        return lambda fn: registered.append((op, fn))

    if torch_like == "without allow_override":
        def register_fake(op, func=None, /, *, lib=None, _stacklevel=1):
            return refuse_beside_meta(op, False)
    else:
        def register_fake(op, func=None, /, *, lib=None, _stacklevel=1, allow_override=torch_like == "2.13"):
            return refuse_beside_meta(op, allow_override)

    monkeypatch.setattr(torch.library, "register_fake", register_fake)
    monkeypatch.setattr(compiled, "_installed", False)
    compiled.install()
    assert compiled._installed
    want = [("activationscope::call_begin", compiled._fake_call_begin),
            ("activationscope::call_end", compiled._fake_call_end)]
    assert registered == ([] if torch_like == "without allow_override" else want)
