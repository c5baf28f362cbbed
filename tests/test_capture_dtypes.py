"""Dtypes a capture cannot silently lose: complex activations are stored exactly, a dtype a
store cannot hold is refused before its first row, a storage_dtype never drops an imaginary
part. Reference: the modules' outputs computed in plain PyTorch."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from activationscope import ActivationScope, CaptureError, CaptureMode, ReductionPolicy, open_store


class Spectrum(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 6).to(dtype)
        self.fft = _FFT()
        self.relu = torch.nn.ReLU()

    def forward(self, x):
        return self.relu(self.fft(self.lin(x)).real)


class _FFT(torch.nn.Module):
    def forward(self, x):
        return torch.fft.fft(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["complex64", "complex128"])
@pytest.mark.parametrize("compression", [None, "zstd", "blosc-lz4"])
def test_complex_outputs_are_stored_exactly(tmp_path, dtype, compression):
    import zarr

    m = Spectrum(dtype)
    xs = [torch.randn(5, 4, dtype=dtype) for _ in range(3)]
    path = tmp_path / "s.zarr"
    opts = {"compression": compression} if compression else None
    with ActivationScope(store=path, store_options=opts).track(m):
        for x in xs:
            m(x)
    with torch.no_grad():
        ref = torch.cat([torch.fft.fft(m.lin(x)) for x in xs])
    s = open_store(path)
    assert s.status == "complete" and s.verify() == []
    got = s["fft.output"][:]
    assert got.dtype == ref.dtype and torch.equal(got, ref)
    # plain zarr-python reads the same values
    assert np.array_equal(zarr.open_array(str(path / "acts" / "fft.output"), mode="r")[:], ref.numpy())


def test_complex_with_a_real_storage_dtype_is_refused(tmp_path):
    m = Spectrum(torch.float32)
    with pytest.raises(CaptureError, match=r"hook point 'fft.output' is complex.*storage_dtype=torch.float16.*exclude="):
        with ActivationScope(storage_dtype=torch.float16).track(m):
            m(torch.randn(2, 4))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_dtype_a_store_cannot_hold_is_refused_before_its_first_row(tmp_path, dtype):
    class Cast(torch.nn.Module):
        def forward(self, x):
            return x.to(dtype)

    m = torch.nn.Sequential(torch.nn.Linear(4, 4), Cast())
    with pytest.raises(CaptureError, match=rf"hook point '1.output' has dtype {str(dtype)[6:]}.*storage_dtype="):
        with ActivationScope(store=tmp_path / "s.zarr").track(m):
            m(torch.randn(2, 4))
    assert not (tmp_path / "s.zarr").exists()  # refused before its first row: the new store is removed
    # the fix named in the message works
    with ActivationScope(store=tmp_path / "t.zarr", storage_dtype=torch.float32).track(m):
        x = torch.randn(2, 4)
        m(x)
    torch.testing.assert_close(open_store(tmp_path / "t.zarr")["1.output"][:], m(x).float())


@pytest.mark.parametrize("in_store", [False, True], ids=["memory", "store"])
def test_reductions_refusing_a_complex_hook_point_name_the_fix_that_works(tmp_path, in_store):
    """reductions= for every hook point reaching a complex one: the refusal names the hook point,
    its dtype and the fix (reductions as a dict that leaves it out), which keeps its rows exact
    and reduces the others (it named the reduction only: 'needs real-valued rows, got dtype
    ComplexFloat'); the dtype is spelled as Python spells it."""
    m = Spectrum(torch.float32)
    xs = [torch.randn(5, 4) for _ in range(2)]
    store = (lambda name: tmp_path / name) if in_store else (lambda name: None)
    with pytest.raises(CaptureError, match=r"hook point 'fft.output': reduction 'mean' needs real-valued rows, got "
                                           r"dtype torch\.complex64; built-in reductions take real rows: give "
                                           r"reductions= as a dict of patterns that leaves "
                                           r"'fft.output' out.*exclude= its module"):
        with ActivationScope(store=store("s.zarr"), reductions=["mean"]).track(m):
            m(xs[0])
    with ActivationScope(store=store("t.zarr"), reductions={"lin.output": ["mean"]}).track(m) as tr:
        for x in xs:
            m(x)
    with torch.no_grad():
        lin = torch.cat([m.lin(x) for x in xs])
    got, mean = (open_store(tmp_path / "t.zarr")["fft.output"][:], open_store(tmp_path / "t.zarr").reductions["lin.output"]["mean"]) \
        if in_store else (torch.cat(tr.activations["fft.output"]), tr.reductions["lin.output"]["mean"])
    assert got.dtype == torch.complex64 and torch.equal(got, torch.fft.fft(lin))
    torch.testing.assert_close(mean, lin.double().mean(0), rtol=1e-12, atol=1e-12)


# dtypes torch keeps as bits, without arithmetic or conversion to float64
_BITS = [getattr(torch, name) for name in ("bits8", "uint4", "float4_e2m1fn_x2") if hasattr(torch, name)]


class _AsDtype(torch.nn.Module):
    """x * 1 on its first ``dense_calls`` calls, then ``x.to(dtype)`` (``bits``: its bytes, as
    uint8, viewed as ``dtype``)."""

    def __init__(self, dtype, dense_calls: int = 0, bits: bool = False):
        super().__init__()
        self.dtype, self.dense_calls, self.bits, self.calls = dtype, dense_calls, bits, 0

    def forward(self, x):
        self.calls += 1
        if self.calls <= self.dense_calls:
            return x * 1
        return (x.abs() * 7).to(torch.uint8).view(self.dtype) if self.bits else x.to(self.dtype)


@pytest.mark.parametrize("dense_calls", [0, 1], ids=["first-call", "later-call"])
@pytest.mark.parametrize("dtype", _BITS, ids=str)
def test_reductions_refuse_bits_dtypes_naming_the_hook_point_and_fix(tmp_path, dtype, dense_calls):
    """Built-in reductions of an activation torch keeps as bits (bits8, uint4, float4_e2m1fn_x2)
    raised torch's NotImplementedError ('"copy_" not implemented for 'Bits8''), naming neither
    the hook point nor the fix. Now a CaptureError names both; the refused forward keeps
    nothing, and the fix (reductions= that leaves it out) keeps its bits exactly."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), _AsDtype(dtype, dense_calls, bits=True))
    xs = [torch.randn(3, 4) for _ in range(2)]
    with pytest.raises(CaptureError, match=rf"hook point '1\.output': reduction 'mean' needs rows of numbers "
                                           rf"torch converts to float64, got dtype {re.escape(str(dtype))}, "
                                           r"which torch keeps as bits.*reductions= as a dict of patterns that "
                                           r"leaves '1\.output' out.*"
                                           r"exclude= its module"):
        with torch.no_grad(), ActivationScope(reductions=["mean"]).track(m) as tracker:
            for x in xs:
                m(x)
    with torch.no_grad():
        first = m[0](xs[0])
    assert len(tracker.activations["1.output"]) == dense_calls  # the refused call kept nothing
    if dense_calls:
        assert torch.equal(tracker.activations["1.output"][0], first)
        torch.testing.assert_close(tracker.reductions["1.output"]["mean"], first.double().mean(0), rtol=1e-12, atol=1e-12)
    m[1].calls = dense_calls
    with torch.no_grad(), ActivationScope(reductions={"0.output": ["mean"]}).track(m) as tracker:
        for x in xs:
            m(x)
    with torch.no_grad():
        m[1].calls = dense_calls
        want = [m(x) for x in xs]
    got = tracker.activations["1.output"]
    assert got[-1].dtype == dtype and torch.equal(got[-1].view(torch.uint8), want[-1].view(torch.uint8))


@pytest.mark.parametrize("dense_calls", [0, 1], ids=["first-call", "later-call"])
@pytest.mark.parametrize("in_store", [False, True], ids=["memory", "store"])
@pytest.mark.parametrize("dtype", _BITS, ids=str)
def test_storage_dtype_refuses_bits_it_cannot_cast(tmp_path, dtype, in_store, dense_calls):
    """storage_dtype= given bits (float4_e2m1fn_x2 is a floating-point dtype to torch, and so is
    cast; bits8 or uint4 after a floating-point first call) raised torch's NotImplementedError
    from the cast; now a CaptureError names the hook point, the dtype and the fix."""
    if dense_calls == 0 and not dtype.is_floating_point:
        pytest.skip("a first call of bits is not floating-point: storage_dtype leaves it as it is")
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), _AsDtype(dtype, dense_calls, bits=True))
    x = torch.randn(3, 4)
    path = tmp_path / "s.zarr"
    with pytest.raises(CaptureError, match=rf"hook point '1\.output' is torch\.\w+ in its call {dense_calls + 1}, "
                                           r"which storage_dtype=torch\.bfloat16 cannot cast.*drop storage_dtype or "
                                           r"exclude= the module of '1\.output'"):
        with torch.no_grad(), ActivationScope(store=path if in_store else None,
                                              storage_dtype=torch.bfloat16).track(m) as tracker:
            for _ in range(2):
                m(x)
    if dense_calls:  # the forward before it is whole
        with torch.no_grad():
            first = m[0](x).to(torch.bfloat16)
        got = open_store(path)["1.output"][:] if in_store else tracker.activations["1.output"][0]
        assert torch.equal(got, first)


@pytest.mark.parametrize("case", ["float8-in-a-store", "complex32-reduced"])
def test_native_messages_spell_dtypes_as_python_does(tmp_path, case):
    """The native refusals wrote dtypes outside the common ones by c10's names
    ('torch.Float8_e4m3fn', 'torch.ComplexHalf'), which are no attributes of torch, and the
    built-in reductions' every dtype so ('got dtype ComplexHalf (torch.complex32)'); they now
    write what a user types (torch.float8_e4m3fn, torch.complex32)."""
    dtype = torch.float8_e4m3fn if case.startswith("float8") else torch.complex32
    assert getattr(torch, str(dtype)[len("torch."):]) is dtype
    torch.manual_seed(0)
    if case.startswith("float8"):
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), _AsDtype(dtype, dense_calls=1))
        scope = ActivationScope(store=tmp_path / "s.zarr")
        said = r"hook point '1\.output' changed its dtype from torch\.float32 to torch\.float8_e4m3fn"
    else:
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), _AsDtype(dtype))
        scope = ActivationScope(reductions=["mean"])
        said = r"hook point '1\.output': reduction 'mean' needs real-valued rows, got dtype torch\.complex32; "
    with pytest.raises(CaptureError, match=said):
        with torch.no_grad(), scope.track(m):
            for _ in range(2):
                m(torch.randn(3, 4))


@pytest.mark.parametrize("setup", ["snapshot", "keep-last", "snapshot-under-inference-mode",
                                   "reference-under-inference-mode"])
@pytest.mark.parametrize("dtype", [*_BITS, *(getattr(torch, n) for n in ("int2", "bits16") if hasattr(torch, n))],
                         ids=str)
def test_strided_bits_are_copied_as_their_bytes(dtype, setup):
    """A copy of a strided (here transposed) activation of bits made torch raise its bare
    NotImplementedError ('"copy_kernel" not implemented for 'UInt4''), naming no hook point: torch
    has no strided copy of uint1 ... uint7, int1 ... int7, nor a clone, so plain forward hooks
    cannot keep one either; so did the bytes check of an alias (the Identity after it) under
    torch.inference_mode(). The records now hold their bytes, read as the model's output."""
    integers = torch.uint8 if torch.empty(0, dtype=dtype).element_size() == 1 else torch.int16

    class Transposed(torch.nn.Module):
        def forward(self, x):
            return (x.abs() * 7).to(integers).view(dtype).t()

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), Transposed(), torch.nn.Identity())
    kw = {"keep-last": {"reduction_policy": ReductionPolicy.FINAL_ONLY},
          "reference-under-inference-mode": {"capture_mode": CaptureMode.REFERENCE}}.get(setup, {})
    grad = torch.inference_mode() if setup.endswith("inference-mode") else torch.no_grad()
    xs = [torch.randn(3, 4), torch.randn(5, 4)]
    with grad, ActivationScope(**kw).track(m) as tracker:
        outs = [m(x) for x in xs]
    want = outs[-1:] if setup == "keep-last" else outs
    for hook_point in ("1.output", "2.output"):
        got = tracker.activations[hook_point]
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.dtype == dtype and g.shape == w.shape and torch.equal(g.view(integers), w.view(integers))
