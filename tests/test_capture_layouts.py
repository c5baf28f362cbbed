"""Activations a capture cannot record (sparse, nested, meta-device tensors, tensor subclasses
with no bytes of their own) raise CaptureError naming the hook point, what it is and the fix,
on a hook point's first call or a later one; a store stays readable."""

from __future__ import annotations

import warnings

import pytest
import torch

import activationscope as acs


class Wrapper(torch.Tensor):
    """A ``__torch_dispatch__`` wrapper subclass (as DTensor and torchao's tensors are): sizes
    and strides, no bytes of its own (a null data pointer); its values are ``elem``'s."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.size(), strides=elem.stride(), dtype=elem.dtype,
                                                   device=elem.device)

    def __init__(self, elem):
        self.elem = elem

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map

        out = func(*tree_map(lambda a: a.elem if isinstance(a, Wrapper) else a, args),
                   **tree_map(lambda a: a.elem if isinstance(a, Wrapper) else a, kwargs or {}))
        return tree_map(lambda a: Wrapper(a) if isinstance(a, torch.Tensor) else a, out)


class Out(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x):
        if self.kind == "sparse":
            return x.to_sparse()
        if self.kind == "wrapper":
            return Wrapper(x * 2)
        if self.kind == "nested":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # nested tensors are a prototype
                return torch.nested.nested_tensor([x[0], x[1, :2]])
        return torch.empty(x.shape, device="meta")


KINDS = {"sparse": "sparse_coo tensor", "nested": "nested tensor", "meta": "meta device",
         "wrapper": "tensor subclass with no bytes of its own"}


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
    # nothing half-recorded: the raised forward is not committed, and the new store, holding no
    # row, is removed
    assert not path.exists()
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


@pytest.mark.parametrize("reductions", [[], {"0.output": ["mean"]}], ids=["empty", "other-hook-point"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_reference_keeps_the_tensor_when_reductions_are_for_other_hook_points(kind, reductions):
    """REFERENCE keeps a sparse / nested / meta tensor also where reductions= is given but none
    applies to its hook point (a nested tensor of the default layout raised torch's
    'NestedTensorImpl doesn't support sizes' from sizing reductions it does not have)."""
    model = _model(kind)
    x = torch.randn(2, 3)
    scope = acs.ActivationScope(capture_mode=acs.CaptureMode.REFERENCE, reductions=reductions)
    with torch.no_grad(), scope.track(model, include=["0", "1"]) as tr:
        model(x)
    with torch.no_grad():
        first = model[0](x)
        out = model[1](first)
    record = tr.activations["1.output"][0]
    assert record.is_nested == out.is_nested and record.layout == out.layout and record.device == out.device
    assert torch.equal(tr.activations["0.output"][0], first)
    if reductions:
        assert "1.output" not in tr.reductions
        torch.testing.assert_close(tr.reductions["0.output"]["mean"], first.double().mean(0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("later", [False, True], ids=["first-call", "later-call"])
@pytest.mark.parametrize("kind", ["sparse", "nested", "meta"])
def test_reference_under_inference_mode_names_the_copy_and_the_fix_that_works(kind, later):
    """Under torch.inference_mode() REFERENCE copies (an inference tensor has no version
    counter), so such a tensor is refused there too; the message said 'cannot be copied
    (CaptureMode.SNAPSHOT)' and offered REFERENCE without reductions as the fix, which the
    capture already was. It now names the inference tensor and torch.no_grad(), under which
    the same capture keeps the tensor."""
    model = _later_model(kind) if later else _model(kind)
    scope = acs.ActivationScope(capture_mode=acs.CaptureMode.REFERENCE)
    call = 2 if later else 1
    with pytest.raises(acs.CaptureError, match=rf"hook point '1\.output' is .*{KINDS[kind]}.*cannot be copied \(an "
                                               r"inference tensor, made under torch\.inference_mode\(\).*"
                                               r"REFERENCE and no reductions keeps such a tensor as it is, in a "
                                               r"forward under torch\.no_grad\(\)"):
        with torch.inference_mode(), scope.track(model, include=["1"]):
            for _ in range(call):
                model(torch.randn(2, 3))
    if later:
        model[1].n_calls = 0
    with torch.no_grad(), scope.track(model, include=["1"]) as tr:  # the fix it names
        for _ in range(call):
            out = model(torch.randn(2, 3))
    record = tr.activations["1.output"][-1]
    assert record.is_nested == out.is_nested and record.layout == out.layout and record.device == out.device


@pytest.mark.parametrize("later", [False, True], ids=["first-call", "later-call"])
@pytest.mark.parametrize("kind", ["sparse", "nested", "meta"])
def test_reference_with_storage_dtype_names_the_cast_and_the_fix_that_works(kind, later):
    """storage_dtype= casts a copy under REFERENCE too, so such a tensor is refused there; the
    message said 'cannot be copied (CaptureMode.SNAPSHOT)' and offered an in-memory REFERENCE
    capture without reductions under torch.no_grad() as the fix, which the capture already was.
    It now names storage_dtype and offers the capture without it, which keeps the tensor."""
    model = _later_model(kind) if later else _model(kind)
    call = 2 if later else 1
    said = (rf"hook point '1\.output' is .*{KINDS[kind]}.*cannot be copied \(CaptureMode\.SNAPSHOT, or "
            r"storage_dtype=torch\.bfloat16, whose cast is a copy\).*REFERENCE and no reductions keeps such a tensor "
            r"as it is, in a forward under torch\.no_grad\(\) \(not torch\.inference_mode\(\)\) and without "
            r"storage_dtype=")
    with pytest.raises(acs.CaptureError, match=said):
        with torch.no_grad(), acs.ActivationScope(capture_mode=acs.CaptureMode.REFERENCE,
                                                  storage_dtype=torch.bfloat16).track(model, include=["1"]):
            for _ in range(call):
                model(torch.randn(2, 3))
    if later:
        model[1].n_calls = 0
    scope = acs.ActivationScope(capture_mode=acs.CaptureMode.REFERENCE)
    with torch.no_grad(), scope.track(model, include=["1"]) as tr:  # the fix it names
        for _ in range(call):
            out = model(torch.randn(2, 3))
    record = tr.activations["1.output"][-1]
    assert record.is_nested == out.is_nested and record.layout == out.layout and record.device == out.device


class IntSparseOut(torch.nn.Module):
    """Integer values (x * 10, truncated) as a sparse tensor, or dense on the first call when
    ``dense_first``: storage_dtype= does not cast an integer hook point."""

    def __init__(self, dense_first: bool) -> None:
        super().__init__()
        self.dense_first = dense_first
        self.n_calls = 0

    def forward(self, x):
        self.n_calls += 1
        values = (x * 10).to(torch.int64)
        return values if self.dense_first and self.n_calls == 1 else values.to_sparse()


@pytest.mark.parametrize("dense_first", [False, True], ids=["sparse-first-call", "sparse-later-call"])
def test_reference_with_storage_dtype_keeps_an_integer_sparse_tensor_on_every_call(dense_first):
    """storage_dtype= does not cast an integer hook point, so REFERENCE makes no copy of it: a
    sparse one was refused on the hook point's first call ('whose cast is a copy') but kept on
    a later call (the native sink of a hook point first seen dense). Both calls now keep it,
    the record being the model's tensor (same values, layout and dtype as a plain forward's)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), IntSparseOut(dense_first))
    xs = [torch.randn(2, 3) for _ in range(3)]
    scope = acs.ActivationScope(capture_mode=acs.CaptureMode.REFERENCE, storage_dtype=torch.bfloat16)
    with torch.no_grad(), scope.track(model, include=["1"]) as tr:
        outs = [model(x) for x in xs]
    records = tr.activations["1.output"]
    assert len(records) == 3
    for record, out, x in zip(records, outs, xs):
        with torch.no_grad():
            ref = (model[0](x) * 10).to(torch.int64)  # the plain PyTorch values
        assert record.layout == out.layout and record.dtype == torch.int64
        assert torch.equal(record.to_dense(), ref)
    assert records[-1].layout == torch.sparse_coo


@pytest.mark.parametrize("dense_first", [False, True], ids=["sparse-first-call", "sparse-later-call"])
def test_snapshot_with_storage_dtype_refuses_an_integer_sparse_tensor_alike_on_every_call(dense_first):
    """SNAPSHOT copies: an integer sparse tensor is refused on its first call and on a later one
    with the same words (the copy is SNAPSHOT's: storage_dtype= casts no integer)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), IntSparseOut(dense_first))
    said = (r"hook point '1\.output' is a sparse_coo tensor \(not strided\), shape \(2, 3\), in its call \d+, "
            if dense_first else r"hook point '1\.output' is a sparse_coo tensor \(not strided\), shape \(2, 3\), ")
    said += r"which cannot be copied \(CaptureMode\.SNAPSHOT\): .*exclude=\['1'\]"
    with pytest.raises(acs.CaptureError, match=said):
        with torch.no_grad(), acs.ActivationScope(storage_dtype=torch.bfloat16).track(model, include=["1"]):
            for _ in range(2):
                model(torch.randn(2, 3))


# ------------------------------------------------- dense first, sparse / nested / meta later


class LaterOut(Out):
    """Dense (x * 2) on its first call, ``kind`` on every later call."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.n_calls = 0

    def forward(self, x):
        self.n_calls += 1
        return x * 2 if self.n_calls == 1 else super().forward(x)


def _later_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 3), LaterOut(kind), torch.nn.Identity())


@pytest.mark.parametrize("kind", list(KINDS))
def test_later_call_in_memory_raises_capture_error_and_keeps_earlier_records(kind):
    """The native sink checks every call: a hook point dense on its first call and not on its
    second raises the first call's CaptureError (not a torch error from the copy), and the
    records of the first forward stay as they were."""
    model = _later_model(kind)
    x1, x2 = torch.randn(2, 3), torch.randn(2, 3)
    with pytest.raises(acs.CaptureError, match=rf"hook point '1\.output' is .*{KINDS[kind]}.*in its call 2, "
                                               rf"which cannot be copied.*exclude=\['1'\]"):
        with torch.no_grad(), acs.ActivationScope().track(model) as tracker:
            model(x1)
            model(x2)
    assert "forward" not in model[1].__dict__  # the wrappers are removed
    with torch.no_grad():
        first = model[0](x1)
    acts = tracker.activations
    assert len(acts["1.output"]) == 1 and len(acts["2.output"]) == 1  # the refused call kept nothing
    assert torch.equal(acts["0.output"][0], first)
    assert torch.equal(acts["1.output"][0], first * 2) and torch.equal(acts["2.output"][0], first * 2)


@pytest.mark.parametrize("kind", list(KINDS))
def test_later_call_into_a_store_raises_and_keeps_earlier_forwards(kind, tmp_path):
    model = _later_model(kind)
    path = tmp_path / "run.zarr"
    x1 = torch.randn(2, 3)
    with pytest.raises(acs.CaptureError, match=rf"hook point '1\.output' is .*{KINDS[kind]}.*in its call 2, "
                                               rf"which cannot be copied \(CaptureMode.SNAPSHOT\) or stored.*"
                                               rf"exclude=\['1'\]"):
        with torch.no_grad(), acs.ActivationScope(store=path).track(model):
            model(x1)
            model(torch.randn(2, 3))
    store = acs.open_store(path)
    assert store.hook_points == ["0.output", "1.output", "2.output"]
    with torch.no_grad():
        first = model[0](x1)
    assert torch.equal(store["0.output"][:], first)  # the first forward's rows, and only those
    assert torch.equal(store["1.output"][:], first * 2) and torch.equal(store["2.output"][:], first * 2)


@pytest.mark.parametrize("kind", list(KINDS))
def test_later_call_reductions_raise(kind):
    model = _later_model(kind)
    scope = acs.ActivationScope(capture_mode=acs.CaptureMode.REFERENCE, reductions=["mean"])
    with pytest.raises(acs.CaptureError, match=rf"hook point '1\.output' is .*{KINDS[kind]}.*which cannot be reduced"):
        with torch.no_grad(), scope.track(model, include=["1"]):
            model(torch.randn(2, 3))
            model(torch.randn(2, 3))


@pytest.mark.parametrize("kind", list(KINDS))
def test_later_call_reference_in_memory_keeps_the_tensor(kind):
    model = _later_model(kind)
    with torch.no_grad(), acs.ActivationScope(capture_mode=acs.CaptureMode.REFERENCE).track(model, include=["1"]) as tr:
        model(torch.randn(2, 3))
        out = model(torch.randn(2, 3))
    dense, record = tr.activations["1.output"]
    assert dense.layout == torch.strided and not dense.is_nested and dense.device.type == "cpu"
    assert record.is_nested == out.is_nested and record.layout == out.layout and record.device == out.device


class Turns(torch.nn.Module):
    """Dense float on its first call, then ``kind``: quantized or complex."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.calls = kind, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 1:
            return x * 1.0
        if self.kind == "quantized":
            return torch.quantize_per_tensor(x, 0.1, 0, torch.qint8)
        return torch.complex(x, torch.ones_like(x))


@pytest.mark.parametrize("where", ["first", "later"])
@pytest.mark.parametrize("setup", ["store_cast", "reductions", "snapshot"])
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
def test_quantized_activations_raise_capture_error(where, setup, tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), Turns("quantized"))
    if where == "first":
        model[1].calls = 1
    kw = {"store_cast": {"store": tmp_path / "q.zarr", "storage_dtype": torch.bfloat16},
          "reductions": {"reductions": ["mean"], "reduction_policy": acs.ReductionPolicy.STREAMING},
          "snapshot": {}}[setup]
    x = torch.randn(2, 3)
    with pytest.raises(acs.CaptureError, match=r"hook point '1\.output' is a quantized tensor \(torch\.qint8\).*dequantize"):
        with torch.no_grad(), acs.ActivationScope(**kw).track(model) as tracker:
            for _ in range(3):
                model(x)
    if where == "later" and setup == "snapshot":  # the first forward's records are whole
        assert torch.equal(tracker.activations["1.output"][0], model[0](x))
    if where == "later" and setup == "store_cast":
        store = acs.open_store(tmp_path / "q.zarr")
        assert store.n_rows("1.output") == 2
        assert torch.equal(store["1.output"], model[0](x).to(torch.bfloat16))


def test_a_later_complex_activation_with_a_real_storage_dtype_raises(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Turns("complex"))
    x = torch.randn(2, 4)
    with pytest.raises(acs.CaptureError, match=r"hook point '1\.output' is complex \(.*\) in its call 2.*imaginary"):
        with torch.no_grad(), acs.ActivationScope(store=tmp_path / "c.zarr", storage_dtype=torch.float32).track(model):
            for _ in range(3):
                model(x)
    store = acs.open_store(tmp_path / "c.zarr")
    assert store.n_rows("1.output") == 2 and torch.equal(store["1.output"], model[0](x))


# ------------------------------------------------- zero tensors: values without bytes

_ZERO_TENSOR_SCRIPT = r"""
import sys, warnings
sys.path.insert(0, {tests!r})
import torch
import activationscope as acs
from acs_testing import plain_hooks

class Zeros(torch.nn.Module):
    # a ZeroTensor (what autograd makes for gradients known to be zero): zeros, data pointer null;
    # x * 2 on its first {dense} call(s)
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls <= {dense}:
            return x * 2
        return torch._efficientzerotensor(x.shape[0], 3, dtype=x.dtype)

def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 3), Zeros(), torch.nn.Identity())

xs = [torch.randn(2, 3), torch.randn(4, 3)]
m = model()
want, _ = plain_hooks(m, lambda: [m(x) for x in xs])
assert all(not t._is_zerotensor() and not t.any() for t in want["1.output"][{dense}:])
setups = {{
    "snapshot": {{}},
    "reference": {{"capture_mode": acs.CaptureMode.REFERENCE}},
    "reductions": {{"reductions": ["mean", "var", "max"]}},
    "store": {{"store": {store!r} + "/a.zarr", "reductions": ["mean", "var"]}},
    "store_cast": {{"store": {store!r} + "/b.zarr", "storage_dtype": torch.bfloat16}},
    "inference": {{"reductions": ["mean"]}},
    "store_inference": {{"store": {store!r} + "/c.zarr"}},
}}
for setup, kw in setups.items():
    m = model()
    grad = torch.inference_mode() if setup.endswith("inference") else torch.no_grad()
    with grad, acs.ActivationScope(**kw).track(m) as tracker:
        for x in xs:
            m(x)
    for hp in ("0.output", "1.output", "2.output"):
        rows = torch.cat(want[hp])
        if "store" in kw:
            store = acs.open_store(kw["store"])
            got = store[hp][:]
            rows = rows.to(got.dtype) if "storage_dtype" in kw else rows
            assert got.dtype == rows.dtype and torch.equal(got, rows), (setup, hp)
            red = store.reductions
        else:
            got = tracker.activations[hp]
            assert len(got) == 2 and all(torch.equal(g, w) for g, w in zip(got, want[hp])), (setup, hp)
            red = tracker.reductions
        for kind in kw.get("reductions", []):
            ref = {{"mean": rows.double().mean(0), "var": rows.double().var(0, correction=0),
                    "max": rows.double().amax(0)}}[kind]
            torch.testing.assert_close(red[hp][kind].double(), ref, rtol=1e-12, atol=1e-12)
print("ok")
"""


@pytest.mark.parametrize("dense", [0, 1], ids=["first-call", "later-call"])
def test_zero_tensor_activations_are_captured_as_zeros(tmp_path, dense):
    """A ZeroTensor (torch._efficientzerotensor, as autograd makes for gradients known to be
    zero) has values, zeros, but a null data pointer: the native copy into a record, into a
    store or for the bytes check read address 0 and the process died (SIGSEGV). Its records,
    stored rows and reductions are now those of zeros, as plain forward hooks see them. In a
    later call (dense=1) the Identity after it, stored as its alias, was refused in a store as
    'another tensor': the check compared the zeros made of each call, not the model's tensor."""
    import subprocess
    import sys
    from pathlib import Path

    script = _ZERO_TENSOR_SCRIPT.format(tests=str(Path(__file__).parent), store=str(tmp_path), dense=dense)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stdout, done.stderr[-2000:])


def test_a_forward_under_fake_tensor_mode_is_refused_naming_fake_tensors():
    """A forward under FakeTensorMode gives FakeTensors: shapes without values. The refusal
    called them wrappers whose 'values are computed by its Python code' and asked for 'a plain
    torch.Tensor of its values', which they do not have; it now names FakeTensorMode and the
    fix (the forward outside it). REFERENCE in memory keeps them, as for other such tensors."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with pytest.raises(acs.CaptureError, match=r"hook point '0\.output' is a FakeTensor \(a shape without values, made "
                                               r"under torch\._subclasses\.FakeTensorMode\), shape \(2, 3\).*the forward "
                                               r"run outside FakeTensorMode"):
        with torch.no_grad(), acs.ActivationScope().track(model):
            with mode:
                model(torch.randn(2, 3))
    scope = acs.ActivationScope(capture_mode=acs.CaptureMode.REFERENCE)
    with torch.no_grad(), scope.track(model) as tracker:
        with mode:
            out = model(torch.randn(2, 3))
    record = tracker.activations["1.output"][0]
    assert isinstance(record, FakeTensor) and record.shape == out.shape == (2, 3)
    x = torch.randn(2, 3)  # the fix it names: the same capture outside the mode records the values
    with torch.no_grad(), acs.ActivationScope().track(model) as tracker:
        model(x)
    assert torch.equal(tracker.activations["1.output"][0], model(x).detach())


@pytest.mark.parametrize("kw, use", [({}, r"copied \(CaptureMode\.SNAPSHOT\)"),
                                     ({"capture_mode": acs.CaptureMode.REFERENCE, "reductions": ["mean"]}, "reduced")])
def test_a_later_forward_under_fake_tensor_mode_is_refused_naming_fake_tensors(kw, use):
    """A forward under FakeTensorMode after real ones: the native check of that later call
    called its FakeTensors wrappers whose 'values are computed by its Python code' with 'a
    plain torch.Tensor of its values' as the fix, as the first call's message no longer does;
    it names FakeTensorMode and the forward outside it, as the first call's message."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
    x = torch.randn(2, 3)
    with pytest.raises(acs.CaptureError, match=r"hook point '0\.output' is a FakeTensor \(a shape without values, made "
                                               rf"under torch\._subclasses\.FakeTensorMode\), shape \(2, 3\), in its call "
                                               rf"2, which cannot be {use}: .*\(or give the capture a dense tensor: the "
                                               r"forward run outside FakeTensorMode, on real tensors\)"):
        with torch.no_grad(), acs.ActivationScope(**kw).track(model):
            model(x)
            with FakeTensorMode(allow_non_fake_inputs=True):
                model(torch.randn(2, 3))


# ------------------------------------- freed storage: a shape over memory given back (FSDP)

_FREED_SCRIPT = r"""
import sys
sys.path.insert(0, {tests!r})
import torch
import activationscope as acs

class Frees(torch.nn.Module):
    # x * 2 whose storage is resized to 0 bytes before it is returned (as FSDP frees a parameter
    # it reshards), from call {freed_from} on
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        y = x * 2
        if self.calls >= {freed_from}:
            y.untyped_storage().resize_(0)
        return y

def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 3), Frees(), torch.nn.Linear(3, 3))

xs = [torch.randn(2, 3), torch.randn(4, 3)]
setups = {{
    "snapshot": {{}},
    "reference": {{"capture_mode": acs.CaptureMode.REFERENCE}},
    "snapshot_reductions": {{"reductions": ["mean"]}},
    "reference_reductions": {{"capture_mode": acs.CaptureMode.REFERENCE, "reductions": ["mean"]}},
    "store": {{"store": {store!r} + "/a.zarr"}},
    "reference_store": {{"store": {store!r} + "/b.zarr", "capture_mode": acs.CaptureMode.REFERENCE}},
    "store_cast": {{"store": {store!r} + "/c.zarr", "storage_dtype": torch.bfloat16, "reductions": ["mean"]}},
}}
for setup, kw in setups.items():
    m = model()
    try:
        with torch.no_grad(), acs.ActivationScope(**kw).track(m) as tracker:
            for x in xs:
                m(x)  # (refused at '1.output': the Linear after it never reads the freed tensor)
    except acs.CaptureError as e:
        msg = str(e)
        assert "hook point '1.output' is a tensor whose memory was freed in its call {freed_from}" in msg, msg
        assert "holds 0 bytes" in msg and "resize_(0)" in msg and "FSDP" in msg, msg
        assert "exclude=['1']" in msg, msg
    else:
        raise AssertionError(setup + ": no CaptureError")
    if {freed_from} == 2:  # the first forward's records or rows are whole
        with torch.no_grad():
            want = m[0](xs[0]) * 2
        if "store" in kw:
            got = acs.open_store(kw["store"])["1.output"][:]
            assert torch.equal(got, want.to(got.dtype)), setup
        elif setup == "snapshot":
            assert torch.equal(tracker.activations["1.output"][0], want), setup
print("ok")
"""


@pytest.mark.parametrize("freed_from", [1, 2], ids=["first-call", "later-call"])
def test_a_tensor_whose_storage_was_freed_is_refused_naming_the_hook_point(tmp_path, freed_from):
    """A tensor whose storage was resized to 0 bytes (``untyped_storage().resize_(0)``, as FSDP
    frees a parameter it reshards) keeps its shape over no memory: the copy of a SNAPSHOT record,
    a store's rows or a reduction read past the storage's end and the process died (SIGSEGV, as
    plain ``t.clone()`` does), and a REFERENCE record would read whatever the storage holds once
    it is given memory again. Now CaptureError naming the hook point, the bytes and the fix, in
    every mode, before anything of the call is kept; earlier forwards stay whole."""
    import subprocess
    import sys
    from pathlib import Path

    script = _FREED_SCRIPT.format(tests=str(Path(__file__).parent), store=str(tmp_path), freed_from=freed_from)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stdout, done.stderr[-2000:])
