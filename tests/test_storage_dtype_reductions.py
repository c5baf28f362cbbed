"""``storage_dtype``: reductions describe the stored (cast) values, a cast that overflows is an
error, and a resume keeps the store's dtype (issue 11: a float16 store held inf while its
``max`` was finite; a bfloat16 resume mixed cast and uncast values). Reference: float64
statistics of the stored array itself, and plain PyTorch casts."""

from __future__ import annotations

import hashlib
import pathlib
import re

import pytest
import torch

from activationscope import ActivationScope, CaptureError, StoragePolicy, StoreError, open_store


def _model(scale=1.0):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with torch.no_grad():
        m[2].weight.mul_(scale)
    return m


def _batches(n, rows=32):
    g = torch.Generator().manual_seed(2)
    return [torch.randn(rows, 6, generator=g) * 3 for _ in range(n)]


def _files(path):
    root = pathlib.Path(path)
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(root.rglob("*")) if f.is_file() and f.name != ".lock"}


NAMES = ["mean", "var", "min", "max", "absmax", "l2"]


def _check_against(red, rows):
    """Every reduction equals the float64 statistic of ``rows`` (the stored values)."""
    x = rows.double()
    torch.testing.assert_close(red["mean"], x.mean(0))
    torch.testing.assert_close(red["var"], x.var(0, correction=0))
    torch.testing.assert_close(red["min"].double(), x.min(0).values)
    torch.testing.assert_close(red["max"].double(), x.max(0).values)
    torch.testing.assert_close(red["absmax"].double(), x.abs().max(0).values)
    torch.testing.assert_close(red["l2"].double(), x.pow(2).sum(0).sqrt())
    assert int(red["mean.count"]) == x.shape[0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_store_reductions_equal_float64_statistics_of_the_stored_array(tmp_path, dtype):
    model, xs = _model(scale=37.0), _batches(4)
    path = tmp_path / "s.zarr"
    with torch.no_grad(), ActivationScope(store=path, reductions=NAMES, storage_dtype=dtype).track(model):
        for x in xs:
            model(x)
    s = open_store(path)
    with torch.no_grad():
        pre = torch.cat([model(x) for x in xs]).double()
    for hp in ("0.output", "2.output"):
        stored = torch.as_tensor(s[hp][:])
        assert stored.dtype == dtype
        _check_against(s.reductions[hp], stored)
    # the reference differs from the pre-cast statistic: the test tells the two apart
    assert not torch.equal(s.reductions["2.output"]["max"].double(), pre.max(0).values)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_in_memory_reductions_equal_float64_statistics_of_the_records(dtype):
    model, xs = _model(scale=37.0), _batches(3)
    with torch.no_grad(), ActivationScope(reductions=NAMES, storage_dtype=dtype).track(model) as tr:
        for x in xs:
            model(x)
    for hp in ("0.output", "1.output", "2.output"):
        records = torch.cat(tr.activations[hp])
        assert records.dtype == dtype
        _check_against(tr.reductions[hp], records)
        with torch.no_grad():
            want = torch.cat([model[: int(hp[0]) + 1](x) for x in xs]).to(dtype)
        torch.testing.assert_close(records, want, rtol=0, atol=0)


@pytest.mark.parametrize("reductions", [NAMES, None])
def test_reference_records_are_the_cast_values_too(reductions):
    # CaptureMode.REFERENCE keeps the model's tensor, which is not of storage_dtype: the
    # record is then a cast copy, as the reductions are of the cast values
    model, xs = _model(scale=37.0), _batches(3)
    scope = ActivationScope(reductions=reductions, storage_dtype=torch.bfloat16, capture_mode="reference")
    with torch.no_grad(), scope.track(model) as tr:
        for x in xs:
            model(x)
    for hp in ("0.output", "2.output"):
        records = torch.cat(tr.activations[hp])
        with torch.no_grad():
            want = torch.cat([model[: int(hp[0]) + 1](x) for x in xs]).to(torch.bfloat16)
        assert records.dtype == torch.bfloat16
        torch.testing.assert_close(records, want, rtol=0, atol=0)
        if reductions:
            _check_against(tr.reductions[hp], records)


def test_an_alias_reduces_the_stored_values_too(tmp_path):
    inner = _model(scale=37.0)
    model = torch.nn.Sequential(inner)  # "0.output" is "0.2.output", stored once
    xs = _batches(2)
    path = tmp_path / "s.zarr"
    with torch.no_grad(), ActivationScope(store=path, reductions=["mean", "max"], storage_dtype=torch.float16).track(model):
        for x in xs:
            model(x)
    s = open_store(path)
    stored = torch.as_tensor(s["0.2.output"][:]).double()
    for hp in ("0.output", "0.2.output"):
        torch.testing.assert_close(s.reductions[hp]["mean"], stored.mean(0))
        torch.testing.assert_close(s.reductions[hp]["max"].double(), stored.max(0).values)


def test_a_bfloat16_resume_reduces_every_stored_row(tmp_path):
    model, xs = _model(scale=37.0), _batches(4)
    path = tmp_path / "s.zarr"
    for i, part in enumerate((xs[:2], xs[2:])):
        scope = ActivationScope(store=path, reductions=NAMES, storage_dtype=torch.bfloat16,
                                store_options={"resume": True} if i else {})
        with torch.no_grad(), scope.track(model):
            for x in part:
                model(x)
    s = open_store(path)
    for hp in ("0.output", "2.output"):
        assert s.n_rows(hp) == 128
        _check_against(s.reductions[hp], torch.as_tensor(s[hp][:]))


@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize("reductions", [["max"], None])
def test_a_float16_cast_that_overflows_is_an_error_naming_the_hook_point(tmp_path, store, reductions):
    model, xs = _model(scale=1e5), _batches(2)
    with torch.no_grad():
        biggest = max(model(x).abs().max().item() for x in xs[1:])
    assert biggest > 65504  # the case: finite float32 values past float16's largest
    kwargs = {"store": tmp_path / "s.zarr"} if store else {}
    scope = ActivationScope(reductions=reductions, storage_dtype=torch.float16, **kwargs)
    with pytest.raises(CaptureError) as err, torch.no_grad(), scope.track(model, include=["2"]) as tr:
        for x in xs[1:]:
            model(x)
    msg = str(err.value)
    assert "hook point '2.output'" in msg and "torch.float16 turns finite values into inf" in msg
    assert "the largest torch.float16 is 65504" in msg and "wider storage_dtype" in msg
    assert f"max |value| {biggest:.9g}" in msg
    if not store:
        assert tr.activations.get("2.output", []) == []  # nothing of that call was kept
    else:  # the refused forward is the first: no row committed, the new store is removed
        assert not (tmp_path / "s.zarr").exists()


def test_a_float64_to_float32_overflow_is_an_error_and_genuine_inf_is_not(tmp_path):
    lin = torch.nn.Linear(2, 2).double()
    with torch.no_grad():
        lin.weight.copy_(torch.eye(2, dtype=torch.float64))
        lin.bias.zero_()
    with pytest.raises(CaptureError, match="hook point 'output': storage_dtype=torch.float32 turns finite"):
        with torch.no_grad(), ActivationScope(store=tmp_path / "a.zarr", storage_dtype=torch.float32).track(
                lin, include=[""]):
            lin(torch.tensor([[1e39, 1.0]], dtype=torch.float64))
    # a value just past float32's largest (cast to inf) is told apart from that largest
    past = 3.4028235677973366e+38
    assert torch.tensor(past, dtype=torch.float64).float().isinf()
    with pytest.raises(CaptureError, match=re.escape("(max |value| 3.40282357e+38, the largest torch.float32 is "
                                                     "3.40282347e+38)")):
        with torch.no_grad(), ActivationScope(store=tmp_path / "c.zarr", storage_dtype=torch.float32).track(
                lin, include=[""]):
            lin(torch.tensor([[past, 1.0]], dtype=torch.float64))
    # values that are already inf (or NaN) stay so: no error, stored as they are
    x = torch.tensor([[float("inf"), 1.0], [float("nan"), -2.0]], dtype=torch.float64)
    with torch.no_grad(), ActivationScope(store=tmp_path / "b.zarr", storage_dtype=torch.float16,
                                          reductions=["max"]).track(lin, include=[""]):
        lin(x)
    stored = torch.as_tensor(open_store(tmp_path / "b.zarr")["output"][:])
    with torch.no_grad():
        want = lin(x)
    assert not torch.isfinite(want).all()
    torch.testing.assert_close(stored, want.to(torch.float16), equal_nan=True)


@pytest.mark.parametrize("first, second", [(None, torch.bfloat16), (torch.bfloat16, None),
                                           (torch.float16, torch.bfloat16)])
def test_a_resume_with_another_storage_dtype_is_refused_and_the_store_untouched(tmp_path, first, second):
    model, xs = _model(), _batches(2)
    path = tmp_path / "s.zarr"
    with torch.no_grad(), ActivationScope(store=path, reductions=["mean"], storage_dtype=first).track(model):
        model(xs[0])
    before = _files(path)
    scope = ActivationScope(store=path, reductions=["mean"], storage_dtype=second, store_options={"resume": True})
    with pytest.raises(CaptureError) as err:
        with torch.no_grad(), scope.track(model):
            model(xs[1])
    msg = str(err.value)
    name = lambda d: "None" if d is None else str(d)  # noqa: E731
    assert "'0.output'" in msg and f"storage_dtype={name(second)}" in msg
    assert f"Resume with storage_dtype={name(first)}" in msg and "nothing was changed" in msg
    cli = "no --dtype" if first is None else f"--dtype {str(first).removeprefix('torch.')}"
    assert f"(CLI: {cli})" in msg and "overwrite=True (CLI: --overwrite)" in msg
    assert _files(path) == before
    assert open_store(path).status == "complete"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_a_resume_with_the_model_in_another_dtype_is_refused_saying_so(tmp_path, dtype):
    # model.to(torch.bfloat16) between two runs: the refusal named two state-dict hashes only
    model, xs = _model(), _batches(2)
    path = tmp_path / "s.zarr"
    with torch.no_grad(), ActivationScope(store=path, reductions=["mean"]).track(model):
        model(xs[0])
    before = _files(path)
    model = model.to(dtype)
    with pytest.raises(StoreError) as err:
        with torch.no_grad(), ActivationScope(store=path, store_options={"resume": True}).track(model):
            model(xs[1].to(dtype))
    msg = str(err.value)
    assert "cannot resume" in msg and "nothing was changed" in msg
    assert "the same weights in another dtype, as after model.to(torch.bfloat16)" in msg
    assert _files(path) == before
    # another model altogether gets no such guess
    other = torch.nn.Sequential(torch.nn.Linear(6, 3))
    with pytest.raises(StoreError) as err:
        with torch.no_grad(), ActivationScope(store=path, store_options={"resume": True}).track(other):
            other(xs[1])
    assert "cannot resume" in str(err.value) and "another dtype" not in str(err.value)


@pytest.mark.parametrize("store, reductions", [(False, ["mean"]), (True, None), (True, ["mean"])])
def test_a_record_whose_padding_overflows_is_an_error_as_without_a_mask(tmp_path, store, reductions):
    """A record keeps the whole activation, padding positions too: a float16 cast that turns a
    finite padding value into inf is refused, as it is where no mask is given (token rows leave
    the padding out of the stored rows and reductions, not out of the record)."""
    layer = torch.nn.Sequential(torch.nn.Identity(), torch.nn.Identity())
    x = torch.ones(2, 3, 4)
    x[0, 2] = 1e6                                     # a padding position past float16's largest
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    kwargs = {"store": tmp_path / "s.zarr", "storage": StoragePolicy.CPU} if store else {}
    scope = ActivationScope(storage_dtype=torch.float16, reductions=reductions, **kwargs)
    with pytest.raises(CaptureError, match=r"hook point '0.output': storage_dtype=torch.float16 turns finite"):
        with torch.no_grad(), scope.track(layer, include=["0"]) as tr:
            tr.set_batch(attention_mask=mask)
            layer(x)
    assert tr.activations.get("0.output", []) == []   # nothing of that call kept
    if reductions:
        assert "mean" not in tr.reductions.get("0.output", {})
    # the real tokens alone fit float16: kept, stored and reduced as cast
    x[0, 2] = 1.0
    with torch.no_grad(), ActivationScope(storage_dtype=torch.float16, reductions=reductions, **{
            **kwargs, **({"store_options": {"overwrite": True}} if store else {})}).track(layer, include=["0"]) as tr:
        tr.set_batch(attention_mask=mask)
        layer(x)
    assert torch.equal(tr.activations["0.output"][0], x.half())
    if store:
        assert torch.equal(open_store(tmp_path / "s.zarr")["0.output"], x[mask.bool()].half())


class _Ids(torch.nn.Module):
    """Token ids in, an embedding's rows and a mask of the ids out."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(70000, 3)
        self.mask = _Nonzero()

    def forward(self, ids):
        rows = self.emb(ids)
        self.mask(ids)
        return rows


class _Nonzero(torch.nn.Module):
    def forward(self, ids):
        return ids != 0


@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize("dtype, ok_ids, bad_id, shown", [
    (torch.bfloat16, [0, 255, 256, 4096], 257, "257 would be stored as 256; torch.bfloat16 holds every integer only up to 256"),
    (torch.float16, [0, 2047, 2048, 4096], 4097, "4097 would be stored as 4096; torch.float16 holds every integer only up to 2048"),
])
def test_integer_activations_a_storage_dtype_would_change_are_an_error(tmp_path, store, dtype, ok_ids, bad_id, shown):
    # token ids captured as an input: cast to bfloat16, id 257 became 256 without a word
    model = _Ids()
    first = torch.tensor([ok_ids])
    kwargs = {"store": tmp_path / "s.zarr"} if store else {}
    scope = ActivationScope(capture="both", storage_dtype=dtype, reductions=["max"], **kwargs)
    with pytest.raises(CaptureError) as err, torch.no_grad(), scope.track(model, include=["emb", "mask"]) as tr:
        model(first)                                  # integers the dtype holds: kept
        model(torch.tensor([[1, bad_id, 2, 3]]))      # one it does not: refused
    msg = str(err.value)
    assert "hook point 'emb.input.0' is torch.int64 and storage_dtype=" + str(dtype) in msg
    assert shown in msg and '(exclude= its module, or capture="output": it is an input of its module)' in msg
    assert "pass a storage_dtype that holds them (torch.float32" in msg
    if store:  # the store keeps the forward before, its ids exact
        s = open_store(tmp_path / "s.zarr")
        assert s.n_rows("emb.input.0") == 1
        assert s["emb.input.0"][:].double().tolist() == [[float(i) for i in ok_ids]]
        assert s["mask.output"][:].tolist() == [[i != 0 for i in ok_ids]]  # bools are exact in any float
    else:
        assert [r.double().tolist() for r in tr.activations["emb.input.0"]] == [[[float(i) for i in ok_ids]]]
    # the fix the message names: a storage_dtype that holds them
    ids = torch.tensor([[1, bad_id, 69999, 3]])
    with torch.no_grad(), ActivationScope(capture="both", storage_dtype=torch.float32, **{
            k: tmp_path / "f.zarr" for k in kwargs}).track(model, include=["emb"]) as tr:
        model(ids)
    got = open_store(tmp_path / "f.zarr")["emb.input.0"][:] if store else tr.activations["emb.input.0"][0]
    assert got.dtype == torch.float32 and got.long().tolist() == ids.tolist()
