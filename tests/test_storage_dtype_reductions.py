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


@pytest.mark.parametrize("reductions", [None, ["max"]])
def test_reference_records_of_integer_hook_points_are_the_model_tensors(reductions):
    # CaptureMode.REFERENCE with storage_dtype copied every hook point, also the integer ones
    # it does not cast: now only a cast hook point's record is a copy
    model = _Ids()
    ids = torch.tensor([[0, 255, 257, 69999]])
    scope = ActivationScope(capture="both", storage_dtype=torch.bfloat16, capture_mode="reference",
                            reductions=reductions)
    with torch.no_grad(), scope.track(model, include=["emb"]) as tr:
        out = model(ids)
    rec = tr.activations["emb.input.0"][0]
    assert rec.dtype == torch.int64 and torch.equal(rec, ids)
    assert rec.data_ptr() == ids.data_ptr()  # the model's tensor, not a copy
    cast = tr.activations["emb.output"][0]
    assert cast.dtype == torch.bfloat16 and torch.equal(cast, out.to(torch.bfloat16))
    assert cast.data_ptr() != out.data_ptr()


@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_integer_and_bool_hook_points_keep_their_dtype(tmp_path, store, dtype):
    # capture="both" with storage_dtype=bfloat16 cast the embedding's input token ids to
    # bfloat16 (257 as 256; later refused): now only floating-point hook points are cast
    model = _Ids()
    batches = [torch.tensor([[0, 255, 257, 69999]]), torch.tensor([[1, 4097, 65537, 3]])]
    ids_all = torch.cat(batches)
    kwargs = {"store": tmp_path / "s.zarr"} if store else {}
    scope = ActivationScope(capture="both", storage_dtype=dtype, reductions=["max"], **kwargs)
    with torch.no_grad(), scope.track(model, include=["emb", "mask"]) as tr:
        for ids in batches:
            model(ids)
    ids = torch.cat(batches)
    want = {"emb.input.0": ids, "mask.input.0": ids, "mask.output": ids != 0,
            "emb.output": model.emb(ids).detach().to(dtype)}
    if store:
        s = open_store(tmp_path / "s.zarr")
        assert s.attrs["storage_dtype"] == str(dtype).replace("torch.", "")
        got = {hp: torch.as_tensor(s[hp][:]) for hp in want}
        assert s.rows("emb.input.0", 1, 2).dtype == torch.int64
        assert {hp: a["dtype"] for hp, a in s.info()["arrays"].items()} == {  # (mask.input.0: an alias)
            "emb.input.0": "int64", "mask.output": "bool", "emb.output": str(dtype).replace("torch.", "")}
        import zarr  # a reader that is not ours: the array's own metadata says the stored dtype
        group = zarr.open_group(str(tmp_path / "s.zarr"), mode="r")
        assert str(group["acts/emb.input.0"].dtype) == "int64"
        from activationscope import ActivationDataset
        row = ActivationDataset(tmp_path / "s.zarr", hook_points=["emb.input.0", "mask.output"])[1]
        assert row["emb.input.0"].dtype == torch.int64 and row["emb.input.0"].tolist() == batches[1][0].tolist()
        assert row["mask.output"].dtype == torch.bool
        from activationscope.data import export_arrow, read_arrow
        table = read_arrow(export_arrow(tmp_path / "s.zarr", tmp_path / "e.arrow", ["emb.input.0", "emb.output"]))
        assert table["emb.input.0"].dtype == torch.int64 and torch.equal(table["emb.input.0"], ids_all)
        assert table["emb.output"].dtype == dtype
        red = s.reductions
    else:
        got = {hp: torch.cat(tr.activations[hp]) for hp in want}
        red = tr.reductions
    for hp, w in want.items():
        assert got[hp].dtype == w.dtype, hp
        assert torch.equal(got[hp], w), hp
    assert red["emb.input.0"]["max"].tolist() == ids.max(0).values.tolist()  # the uncast ids, exactly


class _Same(torch.nn.Module):
    def forward(self, x):
        return x.clone()


@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize("dtype, values", [
    (torch.float64, [2**63, 2**64 - 2048, 5]),  # (2**64 - 2048: float64's largest value below 2**64)
    (torch.float32, [2**63, 2**64 - 2**40, 7]),
])
def test_uint64_values_from_2_63_that_the_cast_keeps_are_stored(tmp_path, store, dtype, values):
    # a uint64 hook point cast to storage_dtype (its first call was floating-point) was refused
    # for every value from 2**63 on, exact or not (compared as int64, where they wrap)
    model = torch.nn.Sequential(_Same())
    big = torch.tensor(values, dtype=torch.uint64)
    kwargs = {"store": tmp_path / "s.zarr"} if store else {}
    with torch.no_grad(), ActivationScope(storage_dtype=dtype, **kwargs).track(model) as tr:
        model(torch.tensor([1.5, 2.0, 3.0]))
        model(big)
    got = open_store(tmp_path / "s.zarr")["0.output"][3:] if store else tr.activations["0.output"][1]
    assert got.dtype == dtype and [int(v) for v in got.double().tolist()] == values


@pytest.mark.parametrize("dtype, value", [(torch.float64, 2**63 + 1), (torch.float32, 2**64 - 1)])
def test_uint64_values_from_2_63_that_the_cast_changes_are_refused(tmp_path, dtype, value):
    model = torch.nn.Sequential(_Same())
    with pytest.raises(CaptureError) as err:
        with torch.no_grad(), ActivationScope(storage_dtype=dtype, store=tmp_path / "s.zarr").track(model):
            model(torch.tensor([1.5, 2.0]))
            model(torch.tensor([2**63, value], dtype=torch.uint64))
    assert (f"hook point '0.output' is torch.uint64 and storage_dtype={dtype} changes its integers ({value} would "
            "be stored as ") in str(err.value)
    assert open_store(tmp_path / "s.zarr")["0.output"][:].tolist() == [1.5, 2.0]


def test_a_resumed_store_that_holds_an_integer_hook_point_cast_keeps_casting_it(tmp_path, monkeypatch):
    # a store written when storage_dtype cast every hook point holds the ids as bfloat16: a
    # resume casts them again (one dtype per array), and an id bfloat16 would change is refused
    from activationscope.capture.scope import Tracker

    model, path = _Ids(), tmp_path / "s.zarr"

    def capture(ids, resume, **options):
        scope = ActivationScope(capture="both", storage_dtype=torch.bfloat16, reductions=["max"],
                                store=path, store_options={"resume": resume, **options})
        with torch.no_grad(), scope.track(model, include=["emb"]):
            for x in ids:
                model(x)

    with monkeypatch.context() as m:  # the earlier version: every hook point cast
        m.setattr(Tracker, "_cast_dtype", lambda self, name, tensor: self.scope.storage_dtype)
        capture([torch.tensor([[0, 255, 256, 4096]])], False)
    assert open_store(path).info()["arrays"]["emb.input.0"]["dtype"] == "bfloat16"
    capture([torch.tensor([[1, 2, 3, 4]])], True)
    s = open_store(path)
    assert s.info()["arrays"]["emb.input.0"]["dtype"] == "bfloat16"
    assert s["emb.input.0"][:].double().tolist() == [[0.0, 255.0, 256.0, 4096.0], [1.0, 2.0, 3.0, 4.0]]
    with pytest.raises(CaptureError) as err:
        capture([torch.tensor([[1, 257, 2, 3]])], True)
    msg = str(err.value)
    assert "hook point 'emb.input.0' is torch.int64 and storage_dtype=torch.bfloat16 changes its integers" in msg
    assert "257 would be stored as 256; torch.bfloat16 holds every integer only up to 256" in msg
    assert "its store array holds torch.bfloat16 (a store written by an earlier version" in msg
    assert "capture into a new store (or overwrite=True), where it keeps its own dtype" in msg
    assert open_store(path).n_rows("emb.input.0") == 2  # the stored rows kept, the refused forward not added
    assert open_store(path)["emb.input.0"][:].double().tolist() == [[0.0, 255.0, 256.0, 4096.0], [1.0, 2.0, 3.0, 4.0]]
    # the fix the message names: a new store, where the ids keep their dtype
    capture([torch.tensor([[1, 257, 2, 3]])], False, overwrite=True)
    got = open_store(path)["emb.input.0"][:]
    assert got.dtype == torch.int64 and got.tolist() == [[1, 257, 2, 3]]


class _Echo(torch.nn.Module):
    def forward(self, x):
        return x


def test_a_hook_point_first_floating_point_then_integer_is_cast_and_checked():
    # its rows have one dtype (the first call's, cast): an integer that cast would change is refused
    model = torch.nn.Sequential(_Echo())
    with pytest.raises(CaptureError) as err, torch.no_grad(), \
            ActivationScope(storage_dtype=torch.bfloat16).track(model) as tr:
        model(torch.tensor([[1.5, 2.0]]))
        model(torch.tensor([[3, 256]]))
        assert [r.dtype for r in tr.activations["0.output"]] == [torch.bfloat16] * 2
        model(torch.tensor([[3, 257]]))
    msg = str(err.value)
    assert "257 would be stored as 256" in msg
    assert "this one is cast because its first call was torch.float32" in msg and "(exclude= its module)" in msg


def test_a_floating_point_hook_point_turning_integer_in_a_store_advises_the_storage_dtype_that_stores_it(tmp_path):
    # its first call was float32, so storage_dtype casts its integer rows too: the refusal said
    # "storage_dtype casts floating-point hook points only", as if it could not help
    model = torch.nn.Sequential(_Echo())
    first, then = torch.tensor([[1.5, 2.0]]), torch.tensor([[3, 256]])
    with pytest.raises(CaptureError) as err, torch.no_grad(), \
            ActivationScope(store=tmp_path / "s.zarr").track(model):
        model(first)
        model(then)
    msg = str(err.value)
    assert "hook point '0.output' changed its dtype from torch.float32 to torch.int64 during the capture" in msg
    assert "Pass storage_dtype= to cast every row to one dtype (its first call was floating-point" in msg
    assert "storage_dtype casts floating-point hook points only" not in msg
    assert open_store(tmp_path / "s.zarr")["0.output"][:].tolist() == [[1.5, 2.0]]  # the whole forward before it
    # the fix it names stores both, cast
    with torch.no_grad(), ActivationScope(store=tmp_path / "t.zarr", storage_dtype=torch.bfloat16).track(model):
        model(first)
        model(then)
    got = open_store(tmp_path / "t.zarr")["0.output"][:]
    assert got.dtype == torch.bfloat16 and torch.equal(got, torch.cat([first, then.float()]).bfloat16())


def test_an_integer_hook_point_turning_floating_point_is_refused_without_advising_storage_dtype(tmp_path):
    # its store array is int64 (not cast): the refusal advised "pass storage_dtype=", which
    # casts floating-point hook points only
    model, path = torch.nn.Sequential(_Echo()), tmp_path / "s.zarr"
    with pytest.raises(CaptureError) as err, torch.no_grad(), \
            ActivationScope(store=path, storage_dtype=torch.bfloat16).track(model):
        model(torch.tensor([[1, 257]]))
        model(torch.tensor([[1.5, 2.0]]))
    msg = str(err.value)
    assert "hook point '0.output' changed its dtype from torch.int64 to torch.float32 during the capture" in msg
    assert msg.endswith("storage_dtype casts floating-point hook points only: capture each dtype into its own "
                        "store, or exclude= its module.")
    assert "ass storage_dtype=" not in msg
    got = open_store(path)["0.output"][:]
    assert got.dtype == torch.int64 and got.tolist() == [[1, 257]]


@pytest.mark.parametrize("first", [torch.int64, torch.bool])
@pytest.mark.parametrize("then", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("mode", ["snapshot", "reference"])
@pytest.mark.parametrize("reductions", [None, ["mean"]])
def test_an_integer_hook_point_turning_floating_point_in_memory_is_refused_not_kept_uncast(first, then, mode,
                                                                                          reductions):
    # storage_dtype casts floating-point hook points only, decided at the first call: in memory
    # the later floating-point records of an integer or bool hook point were kept (and reduced)
    # uncast, float32 under storage_dtype=torch.float16, with no word said
    from activationscope import CaptureMode

    model = torch.nn.Sequential(_Echo())
    ints = torch.tensor([[1, 0, 3]]).to(first)
    scope = ActivationScope(storage_dtype=torch.float16, reductions=reductions,
                            capture_mode=CaptureMode.SNAPSHOT if mode == "snapshot" else CaptureMode.REFERENCE)
    with pytest.raises(CaptureError) as err, torch.no_grad(), scope.track(model) as tr:
        model(ints)
        model(ints)  # (the same dtype again: kept as it is)
        model(torch.tensor([[1.5, 2.25, 3.0]], dtype=then))
    msg = str(err.value)
    assert (f"hook point '0.output' is {then} in its call 3 but its first call was {first}: "
            "storage_dtype=torch.float16 casts floating-point hook points only") in msg, msg
    assert "cast in the model" in msg and "drop storage_dtype" in msg and "exclude= its module" in msg
    # the records before it are intact
    recs = tr.activations["0.output"]
    assert len(recs) == 2 and all(r.dtype == first and torch.equal(r, ints) for r in recs)
    if reductions:
        assert tr.reductions["0.output"]["mean"].tolist() == ints.double()[0].tolist()


class _Floats(torch.nn.Module):
    def forward(self, x):
        return x.float() * 2


@pytest.mark.parametrize("where", ["memory", "store"])
def test_an_integer_hook_point_turning_floating_point_that_keeps_nothing_is_not_refused(tmp_path, where):
    # a hook point whose calls are kept nowhere (reduction_policy=STREAMING keeps no record, in
    # memory or in a store of reductions only, and no reduction applies to it) was refused at its
    # first floating-point call after integer ones, as if its record and reductions kept the
    # values uncast: the capture of the hook points that are reduced failed for it
    from activationscope import ReductionPolicy

    model = torch.nn.Sequential(_Echo(), _Floats())
    store = {"store": tmp_path / "s.zarr"} if where == "store" else {}
    scope = ActivationScope(storage_dtype=torch.float16, reduction_policy=ReductionPolicy.STREAMING,
                            reductions={"1.output": ["mean"]}, **store)
    ints, floats = torch.tensor([[1, 0, 3]]), torch.tensor([[1.5, 2.25, 3.0]])
    with torch.no_grad(), scope.track(model) as tr:
        model(ints)
        model(floats)
    means = open_store(store["store"]).reductions if store else tr.reductions
    want = (torch.cat([ints, floats]).float() * 2).half().double().mean(0)
    assert means["1.output"]["mean"].tolist() == want.tolist()


def test_an_integer_hook_point_stays_as_it_is_in_memory_without_storage_dtype_or_with_integer_calls_only():
    # what the refusal above leaves alone: no storage_dtype (each record its own dtype), and an
    # integer hook point whose every call is integer under storage_dtype
    model = torch.nn.Sequential(_Echo())
    with torch.no_grad(), ActivationScope(reductions=["mean"]).track(model) as tr:
        model(torch.tensor([[1, 3]]))
        model(torch.tensor([[1.5, 2.5]]))
    assert [r.dtype for r in tr.activations["0.output"]] == [torch.int64, torch.float32]
    assert tr.reductions["0.output"]["mean"].tolist() == [1.25, 2.75]
    with torch.no_grad(), ActivationScope(storage_dtype=torch.float16).track(model) as tr:
        model(torch.tensor([[1, 3]]))
        model(torch.tensor([[5000, 3]], dtype=torch.int32))
    assert [r.tolist() for r in tr.activations["0.output"]] == [[[1, 3]], [[5000, 3]]]


def test_an_integer_hook_point_refused_in_a_store_keeps_its_rows_and_the_store_resumes(tmp_path):
    # the store refusal of the same change (covered above by its message) leaves the rows
    # committed before it, and a resume with integer calls goes on
    model, path = torch.nn.Sequential(_Echo()), tmp_path / "s.zarr"
    with pytest.raises(CaptureError, match=r"'0.output' changed its dtype from torch.int64 to torch.float32"), \
            torch.no_grad(), ActivationScope(store=path, storage_dtype=torch.float16).track(model):
        model(torch.tensor([[1, 257]]))
        model(torch.tensor([[1.5, 2.0]]))
    assert open_store(path)["0.output"][:].tolist() == [[1, 257]]
    with torch.no_grad(), ActivationScope(store=path, storage_dtype=torch.float16,
                                          store_options={"resume": True}).track(model):
        model(torch.tensor([[2, 258]]))
    s = open_store(path)
    assert s.status == "complete" and s["0.output"][:].tolist() == [[1, 257], [2, 258]]


@pytest.mark.parametrize("store", [True, False])
def test_integer_rows_after_a_floating_point_empty_first_batch_name_that_first_call(tmp_path, store):
    # an empty float32 first call made the hook point floating-point (cast to storage_dtype): the
    # refusal of an integer the cast would change said that a store written by an earlier version
    # held it cast, in a new store and in memory too
    model = torch.nn.Sequential(_Echo())
    kwargs = {"store": tmp_path / "s.zarr"} if store else {}
    with pytest.raises(CaptureError) as err, torch.no_grad(), \
            ActivationScope(storage_dtype=torch.bfloat16, **kwargs).track(model):
        model(torch.empty(0, 2))
        model(torch.tensor([[3, 256]]))
        model(torch.tensor([[3, 257]]))
    msg = str(err.value)
    assert "257 would be stored as 256" in msg
    assert "this one is cast because its first call was torch.float32 and a hook point's rows have one dtype" in msg
    assert "earlier version" not in msg, msg
