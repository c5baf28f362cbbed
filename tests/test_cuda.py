"""The CUDA paths, each against plain PyTorch: SNAPSHOT through pinned host buffers and
asynchronous copies (later in-place changes, many forwards in flight, keep="last", a non-default
compute stream), GPU storage, REFERENCE, storage dtypes, a store written from CUDA (sample and
token rows, fp16 / bf16), reductions (built-in and TorchScript, resumed), read-back through a
DataLoader with pinned memory, and a model on a second device. Tests that take the ``device``
fixture also run on the CPU; their ``cuda`` cases, and the tests that need CUDA itself, are
marked ``gpu`` and skipped without CUDA (``bash benchmark/gpu_check.sh`` runs them on a CUDA
machine)."""

from __future__ import annotations

import warnings
from typing import Optional

import pytest
import torch

import activationscope as acs
from activationscope import CaptureMode, ReductionPolicy, StoragePolicy

from acs_testing import plain_hooks


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["float32", "float16", "bfloat16"]


def _deep(device, width: int = 256, depth: int = 8, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU(inplace=True)]
    return torch.nn.Sequential(*layers).to(device=device, dtype=dtype).eval()


def _reference(model: torch.nn.Module, x: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
    """``{<name>.output: host copy}`` of one forward through plain PyTorch hooks (cloned at the
    call, so later in-place changes of the model do not reach them)."""
    got, _ = plain_hooks(model, lambda: model(x), names, to="cpu")
    return {k: v[-1] for k, v in got.items()}


def _on_host(rec: torch.Tensor, device: torch.device) -> bool:
    """A record kept in host memory: pinned when it came from CUDA (an asynchronous copy)."""
    return rec.device.type == "cpu" and (device.type != "cuda" or rec.is_pinned())


LINEARS = [str(2 * i) for i in range(8)]


@torch.no_grad()
def test_snapshot_of_many_forwards_in_flight_equals_plain_hooks(device):
    # each Linear's output is changed in place by the ReLU right after it (on the compute
    # stream, while its copy to pinned host memory runs on a side stream), and every forward
    # queues 8 copies of 4 MiB: a buffer reused or read before its copy finished shows here
    model = _deep(device)
    xs = [torch.randn(4096, 256, device=device) for _ in range(6)]
    want = [_reference(model, x, LINEARS) for x in xs]
    with acs.ActivationScope().track(model, include=LINEARS) as tr:
        for x in xs:
            model(x)
    acts = tr.activations
    assert sorted(acts) == sorted(f"{n}.output" for n in LINEARS)
    for hp, recs in acts.items():
        assert len(recs) == len(xs)
        for i, rec in enumerate(recs):
            assert _on_host(rec, device)
            assert torch.equal(rec, want[i][hp]), (hp, i)
            assert (rec < 0).any()  # the value before the in-place ReLU


@torch.no_grad()
def test_snapshot_keep_last_is_the_last_forward(device):
    model = _deep(device, depth=2)
    xs = [torch.randn(2048, 256, device=device) for _ in range(5)]
    scope = acs.ActivationScope(reduction_policy=ReductionPolicy.FINAL_ONLY, reductions=["mean"])
    with scope.track(model, include=["0"]) as tr:
        for x in xs:
            model(x)
    (rec,) = tr.activations["0.output"]
    assert _on_host(rec, device)
    assert torch.equal(rec, _reference(model, xs[-1], ["0"])["0.output"])
    mean = torch.cat([model[0](x) for x in xs]).double().mean(0).cpu()
    assert torch.allclose(tr.reductions["0.output"]["mean"].cpu(), mean, rtol=1e-9, atol=1e-12)


@torch.no_grad()
def test_many_records_copied_from_the_device_stay_exact(device):
    # 200 forwards of 2 hook points kept without reading them (the last record, and every one):
    # past 64 copies in flight the done ones' events are let go; each record must still be its
    # call's value (before the in-place ReLU), the last one too
    model = _deep(device, width=64, depth=2)
    xs = [torch.randn(32, 64, device=device) for _ in range(200)]
    for keep in (ReductionPolicy.FINAL_ONLY, ReductionPolicy.STORE_ALL):
        scope = acs.ActivationScope(reduction_policy=keep, reductions=["max"])
        with scope.track(model, include=["0", "2"]) as tr:
            for x in xs:
                model(x)
        for hp in ("0.output", "2.output"):
            recs = tr.activations[hp]
            assert len(recs) == (1 if keep is ReductionPolicy.FINAL_ONLY else len(xs)), (keep, hp)
            for rec, x in zip(recs, xs[-len(recs):]):
                assert _on_host(rec, device)
                assert torch.equal(rec, _reference(model, x, [hp.split(".")[0]])[hp]), (keep, hp)


@pytest.mark.parametrize("side", [True, False], ids=["side_stream", "default_stream"])
@pytest.mark.parametrize("capture_mode", [CaptureMode.SNAPSHOT, CaptureMode.REFERENCE])
@pytest.mark.parametrize("storage", [StoragePolicy.AUTO, StoragePolicy.GPU])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_capture_on_a_compute_stream_of_its_own(side, capture_mode, storage):
    # the model runs on a stream of its own: each copy must wait for that stream's work, and
    # the records read afterwards are its values
    model = _deep("cuda", depth=3)
    x = torch.randn(4096, 256, device="cuda")
    names = ["0", "2", "4"]
    want = _reference(model, x, names)
    s = torch.cuda.Stream() if side else torch.cuda.current_stream()
    s.wait_stream(torch.cuda.current_stream())
    scope = acs.ActivationScope(capture_mode=capture_mode, storage=storage)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (REFERENCE: the in-place ReLU is warned about)
        with scope.track(model, include=names) as tr:
            with torch.cuda.stream(s):
                model(x)
            torch.cuda.current_stream().wait_stream(s)
            acts = tr.activations
    for hp, t in want.items():
        rec = acts[hp][0]
        if capture_mode is CaptureMode.REFERENCE:
            t = t.clamp_min(0)  # the kept tensor itself, changed by the ReLU after it
        assert torch.equal(rec.cpu(), t), hp


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("storage", [StoragePolicy.AUTO, StoragePolicy.CPU, StoragePolicy.GPU])
@torch.no_grad()
def test_storage_and_dtype(device, dtype, storage):
    model = _deep(device, depth=2, dtype=dtype)
    x = torch.randn(64, 256, device=device, dtype=dtype)
    want = _reference(model, x, ["0", "2"])
    with acs.ActivationScope(storage=storage).track(model, include=["0", "2"]) as tr:
        model(x)
    for hp, t in want.items():
        (rec,) = tr.activations[hp]
        assert rec.dtype == dtype
        if storage is StoragePolicy.GPU:
            assert rec.device == x.device
        else:
            assert _on_host(rec, device)
        assert torch.equal(rec.cpu(), t), hp


@pytest.mark.parametrize("storage", [StoragePolicy.AUTO, StoragePolicy.GPU])
@torch.no_grad()
def test_storage_dtype_cast(device, storage):
    model = _deep(device, depth=1)
    x = torch.randn(64, 256, device=device)
    want = _reference(model, x, ["0"])["0.output"].to(torch.bfloat16)
    with acs.ActivationScope(storage=storage, storage_dtype=torch.bfloat16).track(model, include=["0"]) as tr:
        model(x)
    (rec,) = tr.activations["0.output"]
    assert rec.dtype == torch.bfloat16 and torch.equal(rec.cpu(), want)


@torch.no_grad()
def test_reference_keeps_the_tensor_and_warns_on_in_place_change(device):
    model = _deep(device, depth=1)
    x = torch.randn(8, 256, device=device)
    before = model[0](x).clone()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with acs.ActivationScope(capture_mode=CaptureMode.REFERENCE).track(model, include=["0"]) as tr:
            model(x)
        (rec,) = tr.activations["0.output"]
    assert rec.device == x.device
    assert torch.equal(rec, before.clamp_min(0))  # the ReLU ran in place on the kept tensor
    assert any("0.output" in str(w.message) for w in seen)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@torch.no_grad()
def test_store_equals_plain_hooks(tmp_path, device, dtype):
    model = _deep(device, depth=2, dtype=dtype)
    xs = [torch.randn(512, 256, device=device, dtype=dtype) for _ in range(4)]
    want = [_reference(model, x, ["0", "2"]) for x in xs]
    path = str(tmp_path / "s.zarr")
    with acs.ActivationScope(store=path, reductions=["mean"]).track(model, include=["0", "2"]):
        for x in xs:
            model(x)
    st = acs.open_store(path)
    for hp in ("0.output", "2.output"):
        rows = torch.cat([w[hp] for w in want])
        assert st[hp].dtype == dtype and torch.equal(st[hp], rows), hp
        got_mean = st.reductions[hp]["mean"]
        assert torch.allclose(got_mean.double(), rows.double().mean(0), rtol=1e-9, atol=1e-12), hp


@pytest.mark.parametrize("mask_device", ["cpu", "same"])
@torch.no_grad()
def test_store_token_rows(tmp_path, device, mask_device):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)).to(device).eval()
    x = torch.randn(4, 10, 32, device=device)
    mask = torch.ones(4, 10, dtype=torch.bool)
    mask[1, 6:] = False
    mask[3, 2:] = False
    path = str(tmp_path / "t.zarr")
    with acs.ActivationScope(store=path).track(model, include=["0"]) as tr:
        tr.set_batch(attention_mask=mask if mask_device == "cpu" else mask.to(device))
        model(x)
    want = model[0](x).cpu()[mask]
    st = acs.open_store(path)
    assert tuple(st["0.output"].shape) == (int(mask.sum()), 32)
    assert torch.equal(st["0.output"], want)


@torch.no_grad()
def test_builtin_reductions_equal_torch(device):
    model = _deep(device, depth=1)
    xs = [torch.randn(1000, 256, device=device) for _ in range(3)]
    scope = acs.ActivationScope(reduction_policy=ReductionPolicy.STREAMING, reductions=["mean", "var", "min", "max"])
    with scope.track(model, include=["0"]) as tr:
        for x in xs:
            model(x)
    rows = torch.cat([model[0](x) for x in xs]).double().cpu()
    red = {k: v.cpu() for k, v in tr.reductions["0.output"].items()}
    assert torch.allclose(red["mean"], rows.mean(0), rtol=1e-9, atol=1e-12)
    assert torch.allclose(red["var"], rows.var(0, correction=0), rtol=1e-9, atol=1e-12)
    assert torch.equal(red["min"].double(), rows.min(0).values)
    assert torch.equal(red["max"].double(), rows.max(0).values)


def _sum_rows(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    s = x.double().sum(0)
    if acc is None:
        return s
    return acc + s


@torch.no_grad()
def test_custom_reduction_seeded_on_the_cpu(device):
    # init= is one tensor for every hook point, made on the CPU: the accumulator follows the
    # rows to their device (not "Expected all tensors to be on the same device")
    model = _deep(device, depth=1)
    x = torch.randn(64, 256, device=device)
    init = torch.zeros(256, dtype=torch.float64)
    scope = acs.ActivationScope(reduction_policy=ReductionPolicy.STREAMING, reductions=[("s", _sum_rows, {"init": init})])
    with scope.track(model, include=["0"]) as tr:
        model(x)
        model(x)
    got = tr.reductions["0.output"]["s"]
    want = 2 * model[0](x).double().sum(0)
    assert got.device == x.device and torch.allclose(got, want, rtol=1e-12, atol=1e-9)


@torch.no_grad()
def test_resumed_capture_continues_a_custom_reduction(tmp_path, device):
    # the stored state (or the committed rows read back) is on the CPU, the new rows on the
    # model's device
    model = _deep(device, depth=1)
    xs = [torch.randn(32, 256, device=device) for _ in range(4)]
    path = str(tmp_path / "r.zarr")
    with acs.ActivationScope(store=path, reductions=[("s", _sum_rows)]).track(model, include=["0"]):
        for x in xs[:2]:
            model(x)
    with acs.ActivationScope(store=path, store_options={"resume": True}, reductions=[("s", _sum_rows)]).track(
            model, include=["0"]):
        for x in xs[2:]:
            model(x)
    st = acs.open_store(path)
    rows = torch.cat([model[0](x) for x in xs]).cpu()
    assert torch.equal(st["0.output"], rows)
    assert torch.allclose(st.reductions["0.output"]["s"], rows.double().sum(0), rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("num_workers", [0, 2])
@torch.no_grad()
def test_read_back_through_a_dataloader(tmp_path, device, num_workers):
    model = _deep(device, depth=1)
    x = torch.randn(100, 256, device=device)
    path = str(tmp_path / "d.zarr")
    with acs.ActivationScope(store=path).track(model, include=["0"]):
        model(x)
    want = model[0](x)
    ds = acs.ActivationDataset(path, hook_points=["0.output"])
    cuda = device.type == "cuda"
    loader = torch.utils.data.DataLoader(ds, batch_size=16, pin_memory=cuda, num_workers=num_workers,
                                         multiprocessing_context="fork" if num_workers else None)
    got = []
    for batch in loader:
        t = batch["0.output"]
        assert t.is_pinned() == cuda
        got.append(t.to(device, non_blocking=True))
    assert torch.equal(torch.cat(got), want)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("storage", [StoragePolicy.AUTO, StoragePolicy.GPU])
@torch.no_grad()
def test_model_on_the_second_device(tmp_path, storage):
    # the current device stays cuda:0: streams, events and copies must follow the tensor's device
    model = _deep("cuda:1", depth=2)
    x = torch.randn(256, 256, device="cuda:1")
    want = _reference(model, x, ["0", "2"])
    with acs.ActivationScope(storage=storage, reductions=["mean"]).track(model, include=["0", "2"]) as tr:
        model(x)
    for hp, t in want.items():
        (rec,) = tr.activations[hp]
        assert rec.device == (torch.device("cuda:1") if storage is StoragePolicy.GPU else torch.device("cpu"))
        assert torch.equal(rec.cpu(), t), hp
        assert torch.allclose(tr.reductions[hp]["mean"].cpu(), t.double().mean(0), rtol=1e-9, atol=1e-12)
    path = str(tmp_path / "d1.zarr")
    with acs.ActivationScope(store=path).track(model, include=["0"]):
        model(x)
    assert torch.equal(acs.open_store(path)["0.output"], want["0.output"])


_EAGER_SCALE = 1.0  # a global Python float: TorchScript refuses it, so the function runs eagerly


def _sum_rows_eager(acc, x):
    s = x.double().sum(0) * _EAGER_SCALE
    return s if acc is None else acc + s


@pytest.mark.parametrize("eager", [False, True], ids=["script", "eager"])
def test_custom_accumulator_follows_the_rows_to_their_device(eager):
    # A CPU stand-in for an init= (or a stored state) on the CPU with rows on a GPU: rows on the
    # meta device. The accumulator moves to the rows' device once; one the function made from
    # rows of a device stays where it put it.
    from activationscope.capture.reductions import make_reduction

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the eager function: "could not be compiled")
        r = make_reduction(_sum_rows_eager if eager else _sum_rows, init=torch.ones(3, dtype=torch.float64))
    assert (type(r).__name__ == "EagerReduction") == eager
    r.update(torch.ones(2, 3, device="meta"))
    acc = r.result()["value"]
    assert acc.device.type == "meta" and acc.shape == (3,)
    r.load_state({"acc": torch.full((3,), 5.0, dtype=torch.float64)})
    r.update(torch.ones(2, 3))  # rows on the state's device: nothing moves
    assert r.result()["value"].tolist() == [7.0, 7.0, 7.0]


@torch.no_grad()
def test_a_float16_cast_of_padding_kept_in_a_record_is_an_error_with_reductions(device):
    # as on the CPU: a record kept in memory holds the padding positions too; one beyond float16
    # would be inf there (it was, with no error, when reductions took the rows by the mask), so the
    # cast is refused as without a mask, before any record or reduction of the call is kept
    model = torch.nn.Linear(8, 8).to(device).eval()
    model.weight.copy_(torch.eye(8))
    model.bias.zero_()
    x = torch.ones(2, 3, 8, device=device)
    x[1, 2] = 1e5  # padding: left out of the rows by the mask, kept in the record
    mask = torch.tensor([[True, True, True], [True, True, False]])
    scope = acs.ActivationScope(storage_dtype=torch.float16, reductions=["mean"])
    with pytest.raises(acs.CaptureError, match="hook point 'output': storage_dtype=torch.float16 turns finite values "
                                               "into inf"):
        with scope.track(model, include=[""]) as tr:
            tr.set_batch(attention_mask=mask)
            model(x)
    assert tr.activations.get("output", []) == []
    assert "mean" not in tr.reductions["output"] and int(tr.reductions["output"]["mean.count"]) == 0  # no row reduced


@pytest.mark.parametrize("storage", [StoragePolicy.AUTO, StoragePolicy.CPU, StoragePolicy.GPU])
@torch.no_grad()
def test_a_float16_cast_that_overflows_is_an_error_in_memory(device, storage):
    # as on the CPU: a record copied to the host asynchronously is checked too (on the device)
    model = torch.nn.Linear(8, 8).to(device).eval()
    model.weight.copy_(torch.eye(8))
    model.bias.zero_()
    x = torch.full((4, 8), 1e5, device=device)  # 1e5 > 65504, float16's largest
    scope = acs.ActivationScope(storage=storage, storage_dtype=torch.float16)
    with pytest.raises(acs.CaptureError, match="hook point 'output': storage_dtype=torch.float16 turns finite values "
                                               "into inf"):
        with scope.track(model, include=[""]) as tr:
            model(x)
    assert tr.activations.get("output", []) == []  # nothing of that call was kept
    with scope.track(model, include=[""]) as tr:  # values that fit: kept, cast
        model(x / 1e5)
    (rec,) = tr.activations["output"]
    assert rec.dtype == torch.float16 and torch.equal(rec.cpu(), model(x / 1e5).half().cpu())


@torch.no_grad()
def test_store_of_many_forwards_in_flight_equals_plain_hooks(tmp_path, device):
    # Rows copied from a device are taken into chunks once their copies are done (later
    # appends, or the flush), not waited for at each hook point: many forwards of uneven
    # batches with an in-place ReLU after every tracked layer, small chunks and shards (every
    # forward crosses chunk boundaries), must store exactly what plain hooks saw, in order.
    model = _deep(device, width=64, depth=3)
    torch.manual_seed(2)
    xs = [torch.randn(int(n), 64, device=device) for n in torch.randint(1, 40, (60,))]
    want = [_reference(model, x, ["0", "4"]) for x in xs]
    path = str(tmp_path / "many.zarr")
    opts = {"chunk_rows": 8, "shard_bytes": 8 * 64 * 4 * 4}
    with acs.ActivationScope(store=path, reductions=["mean", "max"], store_options=opts).track(
            model, include=["0", "4"]):
        for x in xs:
            model(x)
    st = acs.open_store(path)
    assert st.status == "complete"
    for hp in ("0.output", "4.output"):
        rows = torch.cat([w[hp] for w in want])
        assert torch.equal(st[hp], rows), hp
        assert torch.equal(st.reductions[hp]["max"], rows.max(0).values), hp
        assert torch.allclose(st.reductions[hp]["mean"], rows.double().mean(0), rtol=1e-12, atol=1e-12), hp
    assert st.verify() == []


class _EverySecond(torch.nn.Module):
    def forward(self, x):
        return x[..., ::2]  # a strided view of its input


class _Transpose(torch.nn.Module):
    def forward(self, x):
        return x.transpose(1, 2)  # a transposed view (not contiguous)


class _NegInPlace(torch.nn.Module):
    def forward(self, x):
        return x.neg_()  # writes through the views into the Linear's output


@pytest.mark.parametrize("storage", [StoragePolicy.AUTO, StoragePolicy.GPU, "store"])
@torch.no_grad()
def test_non_contiguous_activations_are_copied_by_value(tmp_path, device, storage):
    # views that are not contiguous (a strided slice, a transpose of it) are copied to the host
    # (or within the device) element by element, before the in-place change after them
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), _EverySecond(), _Transpose(), _NegInPlace()).to(device).eval()
    xs = [torch.randn(16, 8, 64, device=device) for _ in range(3)]
    names = ["1", "2"]
    want = [_reference(model, x, names) for x in xs]
    path = str(tmp_path / "nc.zarr")
    scope = acs.ActivationScope(store=path) if storage == "store" else acs.ActivationScope(storage=storage)
    with scope.track(model, include=names) as tr:
        for x in xs:
            out = model(x)
            assert not out.is_contiguous()
    if storage == "store":
        st = acs.open_store(path)
        for hp in ("1.output", "2.output"):
            assert torch.equal(st[hp], torch.cat([w[hp] for w in want])), hp
        return
    for hp in ("1.output", "2.output"):
        recs = tr.activations[hp]
        assert len(recs) == len(xs)
        for rec, w in zip(recs, want):
            assert torch.equal(rec.cpu(), w[hp]), hp


class _Scribble(torch.nn.Module):
    """Allocates tensors of its input's size and fills them with NaN: the caching allocator
    hands out memory just freed, so a snapshot whose memory was given back before its copy
    to the host finished would be read as NaN."""

    def forward(self, x):
        for _ in range(4):
            torch.empty_like(x).fill_(float("nan"))
        return x


@torch.no_grad()
def test_snapshot_memory_is_not_reused_before_its_copy_finished(tmp_path, device):
    width = 1024
    layers: list[torch.nn.Module] = []
    for _ in range(6):
        layers += [torch.nn.Linear(width, width), _Scribble()]
    model = torch.nn.Sequential(*layers).to(device).eval()
    n = 2048 if device.type == "cuda" else 128  # on CUDA 8 MiB per hook point and call (the CPU: no copy stream)
    xs = [torch.randn(n, width, device=device) for _ in range(4)]
    names = [str(2 * i) for i in range(6)]
    want = [_reference(model, x, names) for x in xs]
    path = str(tmp_path / "reuse.zarr")
    with acs.ActivationScope().track(model, include=names) as tr:
        for x in xs:
            model(x)
    with acs.ActivationScope(store=path).track(model, include=names):
        for x in xs:
            model(x)
    st = acs.open_store(path)
    for hp in (f"{n}.output" for n in names):
        for rec, w in zip(tr.activations[hp], want):
            assert not rec.isnan().any() and torch.equal(rec.cpu(), w[hp]), hp
        assert torch.equal(st[hp], torch.cat([w[hp] for w in want])), hp


@torch.no_grad()
def test_inference_mode_capture_of_inputs_and_outputs(tmp_path, device):
    # inference tensors have no version counter: whether an input is the previous module's
    # output is told by its bytes on the CPU; on a device it is kept on its own. Either way the
    # records and the stored rows are the values plain hooks see.
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)]).to(device).eval()
    xs = [torch.randn(8, 32, device=device) for _ in range(3)]
    names = [n for n, _ in model.named_children()]
    want = [{k: v[-1] for k, v in plain_hooks(model, lambda: model(x), names, side="both", to="cpu")[0].items()}
            for x in xs]
    path = str(tmp_path / "inf.zarr")
    with torch.inference_mode():
        with acs.ActivationScope(capture="both").track(model) as tr:
            for x in xs:
                model(x)
        with acs.ActivationScope(capture="both", store=path).track(model):
            for x in xs:
                model(x)
    st = acs.open_store(path)
    for hp in want[0]:
        for rec, w in zip(tr.activations[hp], want):
            assert torch.equal(rec.cpu(), w[hp]), hp
        assert torch.equal(st[hp], torch.cat([w[hp] for w in want])), hp


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_store_of_a_model_on_a_compute_stream_of_its_own(tmp_path):
    # the rows' copies to pinned host memory wait for the model's own stream (the current one
    # inside torch.cuda.stream), not the default stream: rows read before the model wrote them,
    # or after the in-place ReLU, would differ
    model = _deep("cuda", width=256, depth=3)
    xs = [torch.randn(2048, 256, device="cuda") for _ in range(8)]
    names = ["0", "4"]
    want = [_reference(model, x, names) for x in xs]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    path = str(tmp_path / "stream.zarr")
    with acs.ActivationScope(store=path, reductions=["mean"]).track(model, include=names):
        with torch.cuda.stream(s):
            for x in xs:
                x.record_stream(s)
                model(x)
        torch.cuda.current_stream().wait_stream(s)
    st = acs.open_store(path)
    for hp in ("0.output", "4.output"):
        rows = torch.cat([w[hp] for w in want])
        assert torch.equal(st[hp], rows), hp
        assert torch.allclose(st.reductions[hp]["mean"], rows.double().mean(0), rtol=1e-12, atol=1e-12), hp


class _Raise(Exception):
    pass


@pytest.mark.parametrize("case", ["close", "raised", "next_on_default"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_reductions_of_a_model_on_a_stream_of_its_own_are_read_after_its_kernels(tmp_path, case):
    # The model runs on its own stream s, held back after its first forward by a kernel that spins
    # for about half a second, so the reductions of the later forwards on s are still to run when
    # the host goes on. The close (on the default stream, the block left without waiting for s)
    # read the accumulators before s wrote them ("close"; "raised": the last forward raised after
    # 0.output reduced it, so the close puts back the state s made in the forward before), and a
    # forward on the default stream updated them from accumulators s had not written yet
    # ("next_on_default")
    model = _deep("cuda", depth=1)
    xs = [torch.randn(512, 256, device="cuda") for _ in range(3)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    path = str(tmp_path / "stream.zarr")

    def cut_short(module, args, out):
        raise _Raise("cut short")

    scope = acs.ActivationScope(store=path, reductions=["mean", "max", ("s", _sum_rows)])
    with warnings.catch_warnings(), scope.track(model, include=["0"]):
        warnings.simplefilter("ignore", acs.CaptureWarning)  # ("raised": the forward cut short)
        with torch.cuda.stream(s):
            for x in xs:
                x.record_stream(s)
            model(xs[0])
            torch.cuda._sleep(1_000_000_000)
            model(xs[1])
            if case == "close":
                model(xs[2])
            elif case == "raised":
                handle = model[1].register_forward_hook(cut_short)
                with pytest.raises(_Raise):
                    model(xs[2])
                handle.remove()
        if case == "next_on_default":
            model(xs[2])
    torch.cuda.synchronize()
    rows = torch.cat([model[0](x) for x in (xs[:2] if case == "raised" else xs)]).double().cpu()
    red = acs.open_store(path).reductions["0.output"]
    assert int(red["mean.count"]) == rows.shape[0]
    torch.testing.assert_close(red["mean"], rows.mean(0), rtol=1e-12, atol=1e-12)
    assert torch.equal(red["max"].double(), rows.amax(0))
    torch.testing.assert_close(red["s"], rows.sum(0), rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("in_store", [False, True], ids=["memory", "store"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_close_after_the_external_stream_of_the_forwards_was_destroyed(tmp_path, in_store):
    # The forwards run on a torch.cuda.ExternalStream of a stream made outside torch (as another
    # library's), which its owner destroys before the close. The sinks kept that stream to wait
    # for the reductions' kernels: the close, and a read of tracker.reductions, recorded an event
    # on the destroyed stream and failed (a CUDA error). They now wait for an event recorded at
    # the end of each update, while the stream ran the forward.
    import ctypes

    cudart = torch.cuda.cudart()
    handle = ctypes.c_void_p(0)
    assert int(cudart.cudaStreamCreate(ctypes.addressof(handle))) == 0 and handle.value
    model = _deep("cuda", depth=1)
    xs = [torch.randn(64, 256, device="cuda") for _ in range(3)]
    path = str(tmp_path / "ext.zarr") if in_store else None
    scope = acs.ActivationScope(store=path, reductions=["mean", ("s", _sum_rows)])
    with scope.track(model, include=["0"]) as tr:
        ext = torch.cuda.ExternalStream(handle.value)
        ext.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(ext):
            for x in xs:
                model(x)
        ext.synchronize()
        del ext
        assert int(cudart.cudaStreamDestroy(handle.value)) == 0
    rows = torch.cat([model[0](x) for x in xs]).double().cpu()
    red = acs.open_store(path).reductions["0.output"] if in_store else tr.reductions["0.output"]
    torch.testing.assert_close(red["mean"].cpu(), rows.mean(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(red["s"].cpu(), rows.sum(0), rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("store", [False, True], ids=["memory", "store"])
@torch.no_grad()
def test_a_forward_during_cuda_graph_capture_is_refused(tmp_path, monkeypatch, store):
    # A CPU stand-in for torch.cuda.graph: the current stream says it is capturing. The
    # captured kernels and copies run only at a replay, which runs no hook: the records, rows
    # and reductions of such a forward would hold no values. Refused before anything is kept;
    # the forwards before and after are captured.
    model = _deep("cpu", width=16, depth=1)
    xs = [torch.randn(4, 16) for _ in range(3)]
    path = str(tmp_path / "g.zarr")
    scope = acs.ActivationScope(store=path, reductions=["mean"]) if store else acs.ActivationScope(reductions=["mean"])
    with scope.track(model, include=["0"]) as tr:
        model(xs[0])
        with monkeypatch.context() as m:
            m.setattr(torch.cuda, "is_initialized", lambda: True)
            m.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
            with pytest.raises(acs.CaptureError, match="while a CUDA graph is being captured .* nothing of this "
                                                       "forward was kept"):
                model(xs[1])
        model(xs[2])
    rows = torch.cat([model[0](x) for x in (xs[0], xs[2])])
    got = acs.open_store(path)["0.output"] if store else torch.cat(tr.activations["0.output"])
    assert torch.equal(got, rows)
    mean = acs.open_store(path).reductions["0.output"]["mean"] if store else tr.reductions["0.output"]["mean"]
    assert torch.allclose(mean, rows.double().mean(0), rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_a_forward_under_torch_cuda_graph_is_refused():
    model = _deep("cuda", depth=1)
    x = torch.randn(64, 256, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with acs.ActivationScope().track(model, include=["0"]) as tr:
        with torch.cuda.stream(s):
            model(x)  # a warm-up forward, captured as any other
        torch.cuda.current_stream().wait_stream(s)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ("The CUDA Graph is empty": nothing ran in it)
            with pytest.raises(acs.CaptureError, match="while a CUDA graph is being captured"):
                with torch.cuda.graph(g):
                    model(x)
    (rec,) = tr.activations["0.output"]
    assert torch.equal(rec, model[0](x).cpu())


@pytest.mark.parametrize("kind", ["mean", "var", "max", "cov"])
def test_builtin_state_loaded_on_the_cpu_follows_the_rows_to_their_device(kind):
    # A CPU stand-in for a resumed store's state (on the CPU) continued with rows of a CUDA
    # model: rows on the meta device. The accumulators move to the rows' device once, as a
    # custom reduction's do; they were left on the CPU, and every later batch was copied to the
    # host to be reduced there (rows of the meta device cannot be: an error).
    from activationscope.capture.reductions import make_reduction

    first = make_reduction(kind)
    first.update(torch.randn(5, 3, dtype=torch.float64), 0)
    r = make_reduction(kind, init=first.state())
    r.update(torch.ones(2, 3, device="meta"), 5)
    result = {k: v for k, v in r.result().items() if k != "count"}  # (the count: a CPU scalar)
    assert result and all(v.device.type == "meta" for v in result.values()), {k: v.device for k, v in result.items()}
    r.update(torch.ones(2, 3, device="meta"), 7)  # later rows of that device: nothing moves
    assert all(v.device.type == "meta" for k, v in r.result().items() if k != "count")


@torch.no_grad()
def test_resumed_capture_continues_builtin_reductions_on_the_rows_device(tmp_path, device):
    model = _deep(device, depth=1)
    xs = [torch.randn(32, 256, device=device) for _ in range(4)]
    path = str(tmp_path / "rb.zarr")
    reds = ["mean", "var", "max"]
    with acs.ActivationScope(store=path, reductions=reds).track(model, include=["0"]):
        for x in xs[:2]:
            model(x)
    with acs.ActivationScope(store=path, store_options={"resume": True}, reductions=reds).track(
            model, include=["0"]) as tr:
        for x in xs[2:]:
            model(x)
        assert tr.reductions["0.output"]["mean"].device == x.device  # (on the CPU: the stored state's)
    st = acs.open_store(path)
    rows = torch.cat([model[0](x) for x in xs]).cpu().double()
    got = st.reductions["0.output"]
    assert torch.allclose(got["mean"], rows.mean(0), rtol=1e-12, atol=1e-12)
    assert torch.allclose(got["var"], rows.var(0, correction=0), rtol=1e-10, atol=1e-12)
    assert torch.equal(got["max"].double(), rows.max(0).values)
