"""Records the user holds are exact and own their bytes: staging slabs are not pinned by
tiny records, a dtype change never silently downcasts stored rows, REFERENCE works under
torch.inference_mode. References: the modules called in plain PyTorch."""

from __future__ import annotations

import io
import warnings

import pytest
import torch

from activationscope import ActivationScope, CaptureError, CaptureMode, open_store



@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_issue_input_record_owns_exactly_its_bytes(dtype):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).to(dtype)
    xs = [torch.randn(8, 16, dtype=dtype) for _ in range(3)]
    with torch.no_grad(), ActivationScope().track(m) as t:
        for x in xs:
            m(x)
    recs = t.activations["2.output"]
    with torch.no_grad():
        for x, r in zip(xs, recs):
            torch.testing.assert_close(r, m(x), rtol=0, atol=0)
    for name, rs in t.activations.items():
        for r in rs:
            assert r.untyped_storage().nbytes() == r.nbytes, name
            assert r.storage_offset() == 0
    buf = io.BytesIO()
    torch.save(recs, buf)
    data = sum(r.nbytes for r in recs)  # 3 * 8 * 4 elements
    assert buf.tell() < data + 2048, (buf.tell(), data)
    # still pooled: every snapshot of the capture came out of one staging slab
    assert t._arena.reserved_bytes == 64 << 20


def test_records_keep_their_slab_alive_and_stay_exact_after_the_tracker_is_gone():
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3)
    xs = [torch.randn(2, 4) for _ in range(50)]
    with torch.no_grad(), ActivationScope().track(m, include=[""]) as t:
        for x in xs:
            m(x)
    recs = t.activations["output"]
    del t
    import gc

    gc.collect()
    junk = [torch.randn(1000) for _ in range(100)]  # reuse of freed memory would show
    with torch.no_grad():
        for x, r in zip(xs, recs):
            torch.testing.assert_close(r, m(x), rtol=0, atol=0)
    del junk


def test_records_are_the_same_tensors_on_every_read_and_exact_after_clear_and_recapture():
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]).eval()
    xs = [torch.randn(16, 64) for _ in range(20)]
    scope = ActivationScope(capture="both")
    with torch.no_grad():
        refs = []
        for x in xs:  # plain PyTorch reference: every layer's input and output
            h, outs = x, []
            for layer in m:
                outs.append(h.clone())
                h = layer(h)
                outs.append(h.clone())
            refs.append(outs)
        for _round in range(2):
            with scope.track(m) as t:
                for x in xs:
                    m(x)
            first = t.activations["3.output"]
            again = t.activations["3.output"]
            assert all(a.data_ptr() == b.data_ptr() for a, b in zip(first, again))
            for f, outs in enumerate(refs):
                for k in range(4):
                    torch.testing.assert_close(t.activations[f"{k}.input.0"][f], outs[2 * k], rtol=0, atol=0)
                    torch.testing.assert_close(t.activations[f"{k}.output"][f], outs[2 * k + 1], rtol=0, atol=0)
            t.clear()
            assert all(len(v) == 0 for v in t.activations.values())


@pytest.mark.skipif(not hasattr(__import__("resource"), "getrusage"), reason="needs resource.getrusage")
def test_a_repeated_in_memory_capture_reuses_memory_instead_of_faulting_fresh_pages():
    # Kept records used to be a tensor object each, made during the forward: small
    # long-lived heap objects between the model's transient outputs, so the heap grew by the
    # size of the capture and every repeat faulted in fresh pages (about 75,000 minor faults
    # for this workload, 300 MiB). Records are now made when first read.
    import gc
    import resource

    torch.set_grad_enabled(False)
    try:
        torch.manual_seed(0)
        m = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(48)]).eval()
        xs = [torch.randn(32, 256) for _ in range(8)]
        scope = ActivationScope(capture="both")
        faults = []
        for _rep in range(3):
            gc.collect()
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            with scope.track(m) as t:
                for f in range(100):
                    m(xs[f % 8])
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
            assert sum(r.nbytes for v in t.activations.values() for r in v) == 100 * 96 * 32 * 256 * 4
            t.clear()  # the tracker stays referenced, as in a loop that rebinds it later
        # 150 MiB captured per repeat (38,400 pages); the last repeat reuses the staging pool
        # and the heap
        assert faults[-1] < 3000, faults
    finally:
        torch.set_grad_enabled(True)


# ---------------------------------------------------------------- dtype changes


def test_issue_input_dtype_change_into_a_store_is_an_error(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4))
    x32 = torch.randn(3, 4)
    path = tmp_path / "s.zarr"
    with pytest.raises(CaptureError, match=r"hook point '0.output' changed its dtype from torch.float32 to "
                                           r"torch.float64.*Pass storage_dtype="):
        with ActivationScope(store=path).track(m):
            m(x32)
            m.double()
            m(torch.randn(3, 4, dtype=torch.float64))
    s = open_store(path)
    assert s.status == "incomplete"
    m.float()
    with torch.no_grad():
        torch.testing.assert_close(s["0.output"][:], m(x32), rtol=0, atol=0)  # the float32 rows, intact


@pytest.mark.parametrize("first,then", [(torch.float32, torch.bfloat16), (torch.float16, torch.float32),
                                        (torch.float64, torch.float32)])
def test_any_dtype_change_into_a_store_is_an_error(tmp_path, first, then):
    m = torch.nn.Sequential(torch.nn.Linear(4, 4)).to(first)
    with pytest.raises(CaptureError, match=rf"from {first} to {then}"):
        with ActivationScope(store=tmp_path / "s.zarr").track(m):
            m(torch.randn(3, 4, dtype=first))
            m.to(then)
            m(torch.randn(3, 4, dtype=then))


def test_explicit_storage_dtype_takes_every_dtype(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4))
    x = torch.randn(3, 4)
    with torch.no_grad(), ActivationScope(store=tmp_path / "s.zarr", storage_dtype=torch.float64).track(m):
        r32 = m(x)
        m.double()
        r64 = m(x.double())
    got = open_store(tmp_path / "s.zarr")["0.output"][:]
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.cat([r32.double(), r64]), rtol=0, atol=0)


def test_in_memory_records_keep_each_dtype():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4))
    x = torch.randn(3, 4)
    with torch.no_grad(), ActivationScope().track(m) as t:
        r32 = m(x)
        m.double()
        r64 = m(x.double())
    a, b = t.activations["0.output"]
    assert a.dtype == torch.float32 and b.dtype == torch.float64
    torch.testing.assert_close(a, r32, rtol=0, atol=0)
    torch.testing.assert_close(b, r64, rtol=0, atol=0)


# ---------------------------------------------------------------- REFERENCE under inference_mode


def test_issue_input_reference_under_inference_mode():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    xs = [torch.randn(3, 4) for _ in range(3)]
    with torch.inference_mode(), ActivationScope(capture_mode=CaptureMode.REFERENCE).track(m) as t:
        for x in xs:
            m(x)
        acts = t.activations
    with torch.no_grad():
        for i, x in enumerate(xs):
            h = m[0](x)
            torch.testing.assert_close(acts["0.output"][i], h, rtol=0, atol=0)
            torch.testing.assert_close(acts["2.output"][i], m[2](m[1](h)), rtol=0, atol=0)


def test_reference_under_inference_mode_with_in_place_ops_stays_exact(recwarn):
    # no version counter to tell an in-place change: the record is a copy, so it is exact
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(inplace=True), torch.nn.Linear(8, 2))
    x = torch.randn(5, 4)
    for keep in ("store_all", "final_only"):
        with torch.inference_mode(), ActivationScope(capture_mode="reference", reduction_policy=keep).track(m) as t:
            m(x)
        with torch.no_grad():
            torch.testing.assert_close(t.activations["0.output"][-1], m[0](x), rtol=0, atol=0)
    assert not [w for w in recwarn if "changed in place" in str(w.message)]


def test_reference_records_do_not_keep_the_models_python_tensors_alive():
    """REFERENCE keeps the model's tensor data (same storage, no copy) without keeping its
    Python object: once the model drops an output it is freed at once (no object left for the
    garbage collector per record), and an in-place change of a kept tensor is still seen."""
    import gc
    import weakref

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)).eval()
    scope = ActivationScope(capture="output", capture_mode=CaptureMode.REFERENCE)
    gc.disable()
    try:
        with pytest.warns(RuntimeWarning, match=r"'1.output'.*changed in place"):
            with torch.no_grad(), scope.track(model) as tr:
                out = model(torch.randn(2, 3))
                ptr, want, ref = out.data_ptr(), out.clone(), weakref.ref(out)
                del out
                assert ref() is None  # freed by its reference count, not kept for the collector
                rec = tr.activations["1.output"][0]
                assert rec.data_ptr() == ptr and torch.equal(rec, want)
                del rec
                model(torch.randn(2, 3)).mul_(2)  # the model's tensor changed after its capture
    finally:
        gc.enable()


def test_reference_records_under_autograd_are_the_models_data_without_its_graph():
    """With autograd on, a REFERENCE record is the model's tensor data (same storage, offset,
    strides, conjugate bit) detached from its graph: no grad_fn, requires_grad False, the model's
    backward unaffected, and an in-place change made after the capture is still seen."""

    class Views(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 6)
            self.t = torch.nn.Identity()
            self.c = torch.nn.Identity()

        def forward(self, x):
            y = self.lin(x)
            z = self.t(y.t()[1:])  # a strided view at an offset
            w = self.c(torch.complex(y, -y).conj())  # a lazily conjugated view
            return y, z, w

    m = Views()
    x = torch.randn(5, 4)
    with ActivationScope(capture="output", capture_mode=CaptureMode.REFERENCE).track(m) as tr:
        y, z, w = m(x)
    acts = tr.activations
    rec_y, rec_z, rec_w = acts["lin.output"][0], acts["t.output"][0], acts["c.output"][0]
    for rec, model_t in ((rec_y, y), (rec_z, z), (rec_w, w)):
        assert rec.grad_fn is None and not rec.requires_grad
        assert rec.untyped_storage().data_ptr() == model_t.untyped_storage().data_ptr()
        assert rec.storage_offset() == model_t.storage_offset() and rec.stride() == model_t.stride()
        assert torch.equal(rec, model_t.detach())
    assert rec_w.is_conj() and torch.equal(rec_w.imag, y.detach())
    y.sum().backward()  # the model's graph is its own
    assert m.lin.weight.grad is not None
    with torch.no_grad():
        y.mul_(3)  # after the capture: the record sees it, and the capture says so
    assert torch.equal(rec_y, y.detach()) and rec_y._version == y._version
    with pytest.warns(RuntimeWarning, match=r"'lin.output'.*changed in place"):
        tr.activations


def test_a_reference_record_whose_storage_was_freed_is_an_error_not_a_read_past_its_end():
    """Sharded training frees memory by shrinking storages (untyped_storage().resize_(0)): a
    REFERENCE record made into a tensor over such a storage would read past its end. Reading the
    records names the hook point and the fix."""
    from activationscope.errors import CaptureError

    class Two(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 2)

        def forward(self, x):
            h = self.a(x)
            return h, self.b(h)

    m = Two()
    with torch.no_grad(), ActivationScope(capture="output", capture_mode=CaptureMode.REFERENCE).track(
            m, include=["a", "b"]) as tr:
        h, y = m(torch.randn(2, 3))
    h.untyped_storage().resize_(0)
    with pytest.raises(CaptureError, match=r"hook point 'a\.output'.*lost its memory.*holds 0 bytes.*needs 24.*SNAPSHOT"):
        tr.activations


def test_reference_records_first_read_under_inference_mode_are_the_models_data():
    """REFERENCE records of normal tensors (a pass-through input, a parameter) read for the first
    time inside torch.inference_mode() are made there: they are ordinary tensors sharing the
    model tensor's storage and version counter, as read anywhere else (it raised 'Cannot set
    version_counter for inference tensor')."""
    x = torch.randn(3, 4)
    m = torch.nn.Sequential(torch.nn.Identity())
    with torch.inference_mode():
        with ActivationScope(capture="input", capture_mode=CaptureMode.REFERENCE).track(m) as tr:
            m(x)
            rec = tr.activations["0.input.0"][0]
        assert not rec.is_inference() and rec.data_ptr() == x.data_ptr() and torch.equal(rec, x)
    x.add_(1)  # after the capture: seen through the shared version counter
    with pytest.warns(RuntimeWarning, match=r"'0\.input\.0'.*changed in place"):
        tr.activations


def test_the_in_place_warning_of_a_reference_capture_is_given_again_after_clear():
    """clear() drops the records; records kept after it are checked again: a change in place of
    one of them is warned about (after a first warning the hook point was never checked again)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    x = torch.randn(3, 8)
    with ActivationScope(capture_mode=CaptureMode.REFERENCE).track(model) as tr:
        for k in range(2):
            out = model(x)
            with torch.no_grad():
                out.mul_(2)
            with pytest.warns(RuntimeWarning, match=r"'0\.output'.*changed in place"):
                tr.activations
            tr.clear()
        out = model(x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # unchanged: no warning
            assert torch.equal(tr.activations["0.output"][0], out.detach())


def test_a_jagged_nested_tensor_is_kept_by_reference_and_refused_by_a_copy_with_the_fix():
    """A jagged nested tensor has no fixed sizes (size() raises): REFERENCE keeps it as it is,
    SNAPSHOT refuses it naming the hook point and the fix, and a model whose first input is one
    is tracked (its dense outputs captured) instead of failing with torch's own error."""
    from activationscope.errors import CaptureError

    class ToJagged(torch.nn.Module):
        def forward(self, x):
            return torch.nested.nested_tensor([x[:2], x[2:5]], layout=torch.jagged)

    class Total(torch.nn.Module):
        def forward(self, nt):
            return nt.values().sum(0)

    x = torch.randn(5, 8)
    model = torch.nn.Sequential(ToJagged())
    with torch.no_grad(), ActivationScope(capture_mode=CaptureMode.REFERENCE).track(model) as tr:
        out = model(x)
    rec = tr.activations["0.output"][0]
    assert rec is out or (rec.is_nested and torch.equal(rec.values(), out.values()))
    with pytest.raises(CaptureError, match=r"'0\.output'.*nested"):
        with torch.no_grad(), ActivationScope().track(model):
            model(x)
    nt = torch.nested.nested_tensor([x[:2], x[2:5]], layout=torch.jagged)
    total = torch.nn.Sequential(Total())
    with torch.no_grad(), ActivationScope(capture="output").track(total) as tr:
        got = total(nt)
    assert torch.equal(tr.activations["0.output"][0], got)


def test_snapshot_records_first_read_under_inference_mode_are_ordinary_tensors():
    """SNAPSHOT records read for the first time inside torch.inference_mode() are ordinary
    tensors, as read anywhere else: a probe trained on them with autograd afterwards works (as
    inference tensors, made where they were first read, they raised 'Inference tensors cannot be
    saved for backward')."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3))
    x = torch.randn(5, 4)
    with torch.inference_mode():
        with ActivationScope().track(m) as tr:
            m(x)
        rec = tr.activations["0.output"][0]
        assert not rec.is_inference()
        torch.testing.assert_close(rec, m(x), rtol=0, atol=0)
    w = torch.zeros(3, requires_grad=True)
    (rec @ w).square().sum().backward()  # saves rec for backward
    torch.testing.assert_close(w.grad, torch.zeros(3))
    assert tr.activations["0.output"][0] is rec  # the same tensor on every read


def test_saved_activations_load_with_torch_load_weights_only(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
    x = torch.randn(5, 3)
    with torch.no_grad(), ActivationScope().track(m) as t:
        m(x)
    torch.save(t.activations, tmp_path / "acts.pt")
    acts = torch.load(tmp_path / "acts.pt", weights_only=True)
    assert list(acts) == ["0.output", "1.output"]
    with torch.no_grad():
        torch.testing.assert_close(acts["0.output"][0], m[0](x), rtol=0, atol=0)
        torch.testing.assert_close(acts["1.output"][0], m(x), rtol=0, atol=0)
