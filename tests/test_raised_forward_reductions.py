"""Reductions of a store capture whose last forward raised partway (the hook points before the
error reduced its rows, those after it did not): the store ends at the whole forward before it,
and its reductions cover exactly the rows it commits, for every built-in kind and a TorchScript
custom reduction, in a store of rows and in one of reductions only. Tests that take ``device``
also run the model on CUDA (marked ``gpu``, skipped without it; ``cuda:1`` with the current
device left at ``cuda:0`` where there are two), against a float64 reference on the CPU."""

from __future__ import annotations

import warnings
from typing import Any, List, Optional

import pytest
import torch

import activationscope as acs
from activationscope.reductions import make_reduction
from activationscope.store import open_store

from acs_testing import InterruptAt, log_sum, log_sum_eager, log_sum_in_place, toy_mlp

STREAMING = acs.ReductionPolicy.STREAMING

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
    pytest.param("cuda:1", marks=[pytest.mark.gpu,
                                  pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]),
]


def _sum_of_squares(acc: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    s = x.double().pow(2).sum(0)
    return s if acc is None else acc + s


REDUCTIONS = ["mean", "var", "min", "max", "absmax", "l2", "nonzero", "cov", ("top", "topk", {"k": 3}),
              ("h", "hist", {"bins": 8, "lo": -2.0, "hi": 2.0}), ("ss", _sum_of_squares)]


class _RaisesAfterTwo(torch.nn.Module):
    """``a.output`` and ``b.output`` run before the point where a forward may raise, ``c.output`` after it."""

    def __init__(self, error: type[BaseException] | None = None) -> None:
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)
        self.error = error

    def forward(self, x):
        h = self.b(self.a(x))
        if self.error is not None:
            raise self.error("cut short")
        return self.c(h)


def _reference(rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every value of REDUCTIONS over ``rows`` (rows, d), in float64, with plain torch."""
    x = rows.double()
    values, ids = x.sort(dim=0, descending=True, stable=True)  # (of equal values the lower row first)
    inside = (x >= -2.0) & (x <= 2.0)
    bins = ((x + 2.0) / 0.5).floor().clamp(0, 7).long()
    counts = torch.stack([torch.bincount(bins[inside[:, j], j], minlength=8) for j in range(x.shape[1])])
    return {
        "mean": x.mean(0), "var": x.var(0, correction=0), "min": x.amin(0), "max": x.amax(0),
        "absmax": x.abs().amax(0), "l2": x.pow(2).sum(0).sqrt(), "nonzero": (x != 0).double().mean(0),
        "cov": torch.cov(x.T, correction=0), "top.values": values[:3], "top.row_ids": ids[:3], "h.counts": counts,
        "ss": x.pow(2).sum(0), "mean.count": torch.tensor(x.shape[0]),
    }


def _check(reductions, hook_point: str, rows: torch.Tensor) -> None:
    got = reductions[hook_point]
    for key, want in _reference(rows).items():
        torch.testing.assert_close(got[key], want, rtol=1e-10, atol=1e-12, check_dtype=False,
                                   msg=lambda m, key=key: f"{hook_point} {key}: {m}")


def _scope(path, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (TorchScript deprecation)
        return acs.ActivationScope(store=str(path), reductions=REDUCTIONS, **options)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("kind", ["rows", "reductions only"])
def test_a_caught_last_forward_that_raised_is_in_no_reduction(tmp_path, kind, error, device):
    """The last forward raised after a.output and b.output reduced its rows, and the caller caught
    the error: the store ends at the forward before it, but a.output's and b.output's reductions
    kept its rows (counts past the store's rows, a mean over a batch the store does not hold),
    reported partial (and in a store of reductions only lost for good: a resume refuses them)."""
    torch.manual_seed(0)
    model = _RaisesAfterTwo().eval().to(device)
    xs = [torch.randn(n, 3, device=device) for n in (4, 5, 6)]
    policy = {"reduction_policy": STREAMING} if kind == "reductions only" else {}
    with pytest.warns(acs.CaptureWarning, match="raised"), torch.no_grad():
        with _scope(tmp_path / "s.zarr", **policy).track(model):
            model(xs[0])
            model(xs[1])
            model.error = error
            with pytest.raises(error, match="cut short"):
                model(xs[2])
            model.error = None
    store = open_store(tmp_path / "s.zarr")
    assert store.n_samples == 9 and store.partial_reductions == {}
    with torch.no_grad():  # (per forward, as captured: one batch of both may round otherwise on a GPU)
        a = [model.a(x) for x in xs[:2]]
        h = [model.b(t) for t in a]
        rows = {"a.output": torch.cat(a).cpu(), "b.output": torch.cat(h).cpu(),
                "c.output": torch.cat([model.c(t) for t in h]).cpu()}
    for hook_point, want in rows.items():
        if kind == "rows":
            assert torch.equal(store[hook_point], want)
        else:
            assert store.reduced[hook_point]["n_rows"] == 9
        _check(store.reductions, hook_point, want)


def _interrupted_in_the_third_forward(path, **options):
    """The model, its four inputs and the store at ``path`` after two whole forwards and a
    KeyboardInterrupt raised mid-way through the third, out of the ``with`` block."""
    torch.manual_seed(0)
    model = _RaisesAfterTwo().eval()
    xs = [torch.randn(n, 3) for n in (4, 5, 6, 2)]
    with pytest.raises(KeyboardInterrupt), torch.no_grad(), _scope(path, **options).track(model):
        model(xs[0])
        model(xs[1])
        model.error = KeyboardInterrupt
        model(xs[2])
    model.error = None
    return model, xs, open_store(path)


def test_a_forward_raising_out_of_the_block_keeps_the_forwards_before_it_in_a_store_of_reductions_only(tmp_path):
    """An error leaving the block mid-forward: the close commits every whole forward before it,
    with reductions over exactly those; the store of reductions only ended at its last commit
    instead (here none, so the store was removed), losing every forward since. A resume then
    ends with the reductions of an uninterrupted run."""
    path = tmp_path / "s.zarr"
    model, xs, store = _interrupted_in_the_third_forward(
        path, reduction_policy=STREAMING, store_options={"commit_interval": 3600})
    assert store.status == "incomplete" and store.n_samples == 9 and store.partial_reductions == {}
    with torch.no_grad():
        _check(store.reductions, "a.output", model.a(torch.cat(xs[:2])))
        _check(store.reductions, "c.output", model(torch.cat(xs[:2])))
    with torch.no_grad(), _scope(path, reduction_policy=STREAMING, store_options={"resume": True}).track(model) as t:
        assert t.resume_from == 9
        for x in xs[2:]:
            model(x)
    store = open_store(path)
    assert store.status == "complete" and store.n_samples == 17
    with torch.no_grad():
        _check(store.reductions, "b.output", model.b(model.a(torch.cat(xs))))


def test_a_forward_raising_out_of_the_block_leaves_a_store_of_rows_with_no_reduction(tmp_path):
    """A store of rows whose block raised mid-forward commits the whole forwards before it, rows
    only: no reduction is written at the close (docs/usage/capture.md); a resume computes every
    reduction over the stored rows, ending with those of an uninterrupted run."""
    path = tmp_path / "s.zarr"
    model, xs, store = _interrupted_in_the_third_forward(path)
    assert store.status == "incomplete" and store.n_samples == 9
    assert dict(store.reductions) == {} and store.partial_reductions == {}
    with torch.no_grad():
        assert torch.equal(store["a.output"], model.a(torch.cat(xs[:2])))
    with torch.no_grad(), _scope(path, store_options={"resume": True}).track(model) as t:
        assert t.resume_from == 9
        for x in xs[2:]:
            model(x)
    store = open_store(path)
    assert store.status == "complete" and store.n_samples == 17
    with torch.no_grad():
        h = model.b(model.a(torch.cat(xs)))
        for hook_point, want in {"a.output": model.a(torch.cat(xs)), "b.output": h, "c.output": model.c(h)}.items():
            _check(store.reductions, hook_point, want)


@pytest.mark.parametrize("kind", ["rows", "reductions only"])
def test_info_gives_the_bytes_of_the_reductions(tmp_path, kind, capsys):
    """info() and `activationscope info` gave the bytes of the activations only: a store of
    reductions only showed no size at all."""
    from activationscope import cli

    model = _RaisesAfterTwo().eval()
    policy = {"reduction_policy": STREAMING} if kind == "reductions only" else {}
    with torch.no_grad(), acs.ActivationScope(store=str(tmp_path / "s.zarr"), reductions=["mean", "var"],
                                              **policy).track(model):
        model(torch.randn(5, 3))
    info = open_store(tmp_path / "s.zarr").info()

    def reduced(d: int) -> int:  # float64 / int64 values of one hook point of d features
        mean = d + 1 + (1 + d)  # mean, mean.count; its state: count, mean
        var = d + d + 1 + (1 + d + d)  # var, var.mean, var.count; its state: count, mean, m2
        return 8 * (mean + var)

    assert info["hook_point_reduction_bytes"] == {"a.output": reduced(4), "b.output": reduced(4),
                                                  "c.output": reduced(2)}
    assert info["reduction_bytes"] == 2 * reduced(4) + reduced(2) == 576
    assert cli.main(["info", str(tmp_path / "s.zarr")]) in (0, None)
    assert "576 B of reductions (results and states)" in capsys.readouterr().out


def test_two_ranks_one_of_whose_last_forward_raised_commit_reductions_of_the_whole_forwards(tmp_path):
    """Two rank tasks (RankStore, no process group); rank 1's last forward raised after a.output
    and b.output reduced it, the error caught: its rank store ends at the forward before, and
    the committed store's reductions, merged over both ranks, cover exactly the committed rows."""
    from activationscope.store.ranks import commit_ranks

    torch.manual_seed(0)
    model = _RaisesAfterTwo().eval()
    xs = [[torch.randn(n, 3) for n in (4, 5)], [torch.randn(n, 3) for n in (3, 6)]]
    path = str(tmp_path / "s.zarr")
    for rank in range(2):
        scope = acs.ActivationScope(store=path, reductions=["mean", "var", "max", ("top", "topk", {"k": 3})],
                                    store_options={"process_group": acs.RankStore(rank, 2)})
        with warnings.catch_warnings(), torch.no_grad(), scope.track(model):
            warnings.simplefilter("ignore", acs.CaptureWarning)
            model(xs[rank][0])
            model.error = RuntimeError if rank == 1 else None
            try:
                model(xs[rank][1])
            except RuntimeError:
                pass
            model.error = None
    commit_ranks(path)
    store = open_store(path)
    assert store.n_samples == 9 + 3 and store.partial_reductions == {}
    with torch.no_grad():
        rows = model.a(torch.cat([*xs[0], xs[1][0]])).double()
    assert torch.equal(store["a.output"].double(), rows)
    got = store.reductions["a.output"]
    torch.testing.assert_close(got["mean"], rows.mean(0), rtol=1e-12, atol=0)
    torch.testing.assert_close(got["var"], rows.var(0, correction=0), rtol=1e-10, atol=1e-14)
    assert torch.equal(got["max"], rows.amax(0)) and int(got["mean.count"]) == 12
    values, ids = rows.sort(dim=0, descending=True, stable=True)
    assert torch.equal(got["top.values"], values[:3]) and torch.equal(got["top.row_ids"], ids[:3])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", [log_sum, log_sum_in_place, log_sum_eager], ids=["script", "in_place", "eager"])
def test_nan_or_inf_a_custom_reduction_made_in_a_taken_out_forward_gives_no_warning(tmp_path, fn, device):
    """The caught last forward that raised fed a 0 to a custom reduction's log (inf) before the
    error: that forward is taken out of the reductions, and so is what it made: the result is
    finite and the close says nothing of NaN or inf (it did, naming a value the store does not hold),
    and the reduction's made_nonfinite is False again (the eager reduction's stayed True: its
    rollback put back its accumulator only)."""
    torch.manual_seed(0)
    model = _RaisesAfterTwo().eval()
    xs = [torch.rand(n, 3) + 0.5 for n in (4, 5, 6)]
    with torch.no_grad():
        model.a.weight.copy_(torch.eye(4, 3))
        model.a.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 1.0]))  # a.output = (x, 1): finite logs
        model.c.weight.abs_()
        model.c.bias.abs_()  # c.output of b.output >= 0: positive
    xs[2][1, 0] = 0.0  # b.output of that row is 0 in its first column: log 0 = -inf
    model.to(device)  # (on CUDA the flags are kept on the device, made_nonfinite reads them)
    xs = [x.to(device) for x in xs]
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        with acs.ActivationScope(store=str(tmp_path / "s.zarr"), reductions=[fn]).track(model) as tracker:
            model(xs[0])
            model(xs[1])
            model.error = RuntimeError
            with pytest.raises(RuntimeError, match="cut short"):
                model(xs[2])
            model.error = None
            red = tracker._reduction_objects["b.output"][0]
            assert red.kind == ("eager" if fn is log_sum_eager else "script")
            assert red.made_nonfinite is True  # (the forward that raised made -inf, until the close takes it out)
    assert red.made_nonfinite is False
    messages = [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)]
    assert not [m for m in messages if m.startswith("custom reduction(s) whose result holds NaN or inf")], messages
    got = open_store(tmp_path / "s.zarr").reductions["b.output"][fn.__name__]
    with torch.no_grad():
        want = torch.cat([model.b(model.a(x)) for x in xs[:2]]).double().cpu()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want.log().sum(0))


class _ForwardEnds(InterruptAt):
    """:class:`InterruptAt` counting the lines only, noting for each forward's end (the
    tracker's ``_on_forward_end``) the line numbers it ran, those of what it calls included."""

    def __init__(self) -> None:
        super().__init__(None)
        self.ends: list[list[int]] = []
        self.commits: list[int] = []  # the lines run in the writer's commits and reductions writing

    def _call(self, frame, event, arg):
        if frame.f_code.co_name == "_on_forward_end":
            self.ends.append([])
        return super()._call(frame, event, arg)

    def _line(self, frame, event, arg):
        out = super()._line(frame, event, arg)
        if self.ends and frame.f_code.co_name == "_on_forward_end":
            self.ends[-1].append(self.n)
        if frame.f_code.co_name in ("_commit_now", "_write_commit_reductions", "_add_reductions"):
            self.commits.append(self.n)
        return out


@pytest.mark.parametrize("kind", ["rows", "reductions only", "memory"])
def test_ctrl_c_at_any_line_of_a_forward_end_leaves_reductions_of_the_rows_kept(tmp_path, kind):
    """A Ctrl-C at each line of the second forward's end (and at one line in 50 elsewhere) of a
    capture of three forwards: the reductions equal those of the rows kept, in float64. A
    Ctrl-C after the tracker marked the forward ended but before the store recorded it left
    that forward in the reductions of a store that ends before it (the close took it out only
    of a forward still open): its reductions were stored as partial and left out (rows; the
    cell catches the Ctrl-C and ends the block)."""
    model = toy_mlp(depth=1)
    xs = [torch.randn(n, 16) for n in (3, 4, 5)]
    with torch.no_grad():
        full = {"0.output": torch.cat([model[0](x) for x in xs]), "1.output": torch.cat([model(x) for x in xs])}
    trackers = []

    def cell(path):
        if kind == "memory":
            scope = acs.ActivationScope(reductions={"*": ["mean", "var"]})
        else:
            policy = {"reduction_policy": STREAMING} if kind == "reductions only" else {}
            scope = acs.ActivationScope(store=str(path), reductions={"*": ["mean", "var"]},
                                        store_options={"commit_interval": 0}, **policy)
        with torch.no_grad(), scope.track(model) as tracker:
            trackers.append(tracker)
            for x in xs:
                if kind != "rows":
                    model(x)
                    continue
                try:
                    model(x)
                except KeyboardInterrupt:
                    break  # (the block ends as usual: the close stores the reductions)

    def check(path, where):
        if kind == "memory":
            got = trackers[-1].reductions if trackers else {}
            rows = {hp: torch.cat(r) for hp, r in trackers[-1].activations.items() if r} if trackers else {}
        elif (path / "zarr.json").exists():
            store = open_store(path)
            assert store.partial_reductions == {}, where
            got = store.reductions
            rows = {hp: store[hp] if kind == "rows" else full[hp][:store.reduced[hp]["n_rows"]] for hp in got}
        else:
            return
        for hp, values in got.items():
            x = rows.get(hp, torch.zeros(0, 16)).double()
            if kind == "rows":
                assert torch.equal(rows[hp], full[hp][:x.shape[0]]), (where, hp)
            # (a Ctrl-C in the close as it stored them may leave some out: the store is incomplete)
            for name, want in (("mean", x.mean(0)), ("var", x.var(0, correction=0))):
                if f"{name}.count" in values:
                    assert int(values[f"{name}.count"]) == x.shape[0], (where, hp, name)
                if name in values and x.shape[0]:
                    torch.testing.assert_close(values[name], want, rtol=1e-10, atol=1e-12, msg=f"{where} {hp} {name}")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cell(tmp_path / "first.zarr")  # (first use: lazy imports)
        with _ForwardEnds() as counted:
            cell(tmp_path / "counted.zarr")
        assert len(counted.ends) == 3
        second = range(counted.ends[1][0], counted.ends[1][-1] + 1)
        # (one line in 50 elsewhere; in a store of reductions only, one in 200, and every line of
        # its first commit and of the close's commit and reductions writing: a Ctrl-C between the
        # row table's update and the root's n_samples left a store that did not open)
        elsewhere = range(1, counted.n + 1, 50 if kind != "reductions only" else 200)
        commits = [n for n in counted.commits if n < counted.ends[0][-1] or n > counted.ends[2][-1]] \
            if kind == "reductions only" else ()
        ks = sorted(set(second) | set(elsewhere) | set(commits))
        for k in ks:
            path = tmp_path / f"{k}.zarr"
            trackers.clear()
            try:
                with InterruptAt(k) as where:
                    cell(path)
            except KeyboardInterrupt:
                pass
            except acs.CaptureError:  # (no whole forward: the new store is removed)
                assert not (path / "zarr.json").exists(), where.where
            check(path, where.where)


D_WIDE = 1237  # (a width no other tensor of these forwards has the bytes of: d float64)


def _wide_sum(acc: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """Sum of the rows per feature, float64, returning a new accumulator."""
    s = x.sum(0)
    return s.double() if acc is None else acc + s


def _wide_sum_in_place(acc: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """:func:`_wide_sum` updating its accumulator in place."""
    s = x.sum(0)
    if acc is None:
        return s.double()
    acc += s
    return acc


def _cut_short(module, args):
    raise RuntimeError("cut short")


@pytest.mark.parametrize("fn", [_wide_sum, _wide_sum_in_place], ids=["new-accumulator", "in-place"])
def test_a_custom_reduction_allocates_no_copy_of_its_accumulator_per_forward(tmp_path, fn):
    """A capture into a store remembers each reduction's state before each forward, so that a
    forward that raised can be taken out; a TorchScript reduction's accumulator was then cloned
    at every forward (the remembered handle made it look shared): a state-sized allocation per
    forward, three accumulators at the peak. Now a function that never writes into acc is given
    the accumulator itself, and one that updates it in place copies it into the memory of the
    accumulator the forward before replaced. Counted with the profiler (allocations made by
    aten::clone of the accumulator's bytes), and the reductions still equal plain PyTorch's, the
    last forward, which raised, taken out."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(D_WIDE, D_WIDE), torch.nn.ReLU()).eval()
    xs = [torch.randn(8, D_WIDE) for _ in range(10)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (TorchScript deprecation; the warning of the raised forward)
        scope = acs.ActivationScope(store=str(tmp_path / "s.zarr"), reduction_policy=STREAMING,
                                    reductions={"0.output": [("s", fn)]})
        with torch.no_grad(), scope.track(model, include=["0"]):
            for x in xs[:4]:  # (the function seen with an accumulator: in place or not)
                model(x)
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                for x in xs[4:9]:
                    model(x)
            model[1].register_forward_pre_hook(_cut_short)
            with pytest.raises(RuntimeError, match="cut short"):
                model(xs[9])  # (after 0.output reduced its rows)
    clones = [e for e in prof.events() if e.name == "aten::clone" and e.cpu_memory_usage == D_WIDE * 8]
    assert clones == []
    with torch.no_grad():  # plain PyTorch, in the order the function folds the batches in
        want = model[0](xs[0]).sum(0).double()
        for x in xs[1:9]:
            want = want + model[0](x).sum(0)
    store = open_store(tmp_path / "s.zarr")
    torch.testing.assert_close(store.reductions["0.output"]["s"], want, rtol=0, atol=0)


def _wide_sum_through_data(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """:func:`_wide_sum` adding into acc through acc.data (no version counter moves) and
    returning a new accumulator."""
    s = x.sum(0)
    if acc is None:
        return s.double()
    acc.data.add_(s)
    return acc * 1.0


@pytest.mark.parametrize("fn", [_wide_sum_in_place, _wide_sum_through_data], ids=["in-place", "through-data"])
@pytest.mark.parametrize("where", ["memory", "direct"])
def test_a_custom_reduction_that_may_write_into_acc_allocates_no_copy_per_batch_without_a_store(fn, where):
    """A TorchScript reduction whose program may write into acc works on a copy at every batch
    (a batch it raises on is then left out, whatever the write was seen by), in a capture
    without a store and called directly too, where no state before the forward is kept: the
    copy goes into the memory of an accumulator no longer in use. Without that memory an
    in-place function's accumulator was cloned at every forward in memory. Counted with the
    profiler (allocations made by aten::clone of the accumulator's bytes); the values still
    equal plain PyTorch's."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(D_WIDE, D_WIDE)).eval()
    xs = [torch.randn(8, D_WIDE) for _ in range(9)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (TorchScript deprecation)
        if where == "memory":
            scope = acs.ActivationScope(reduction_policy=STREAMING, reductions={"0.output": [("s", fn)]})
            tracker = scope.track(model, include=["0"])
            tracker.__enter__()
            step = model
        else:
            r = make_reduction(fn)
            assert r.kind == "script"

            def step(x):
                r.update(model(x))
        try:
            with torch.no_grad():
                for x in xs[:4]:
                    step(x)
                with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                    for x in xs[4:]:
                        step(x)
        finally:
            if where == "memory":
                tracker.__exit__(None, None, None)
    clones = [e for e in prof.events() if e.name == "aten::clone" and e.cpu_memory_usage == D_WIDE * 8]
    assert clones == []
    got = tracker.reductions["0.output"]["s"] if where == "memory" else r.result()["value"]
    with torch.no_grad():  # plain PyTorch, in the order the function folds the batches in
        want = model[0](xs[0]).sum(0).double()
        for x in xs[1:]:
            want = want + model[0](x).sum(0)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _sum_through_a_loop(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Sum of the rows per feature, float64, added into acc in place by a loop that carries acc
    to the next iteration's write (TorchScript's alias analysis does not see that write)."""
    s = x.double().sum(0)
    if acc is None:
        return s
    target = s
    for i in range(2):
        if i == 1:
            target.add_(s)
        target = acc
    return acc.clone()


def _sum_through_a_list_of_any(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """:func:`_sum_through_a_loop` writing into acc taken out of a List[Any] (unseen as well)."""
    s = x.double().sum(0)
    if acc is None:
        return s
    held: List[Any] = [acc, 0]
    a = held[0]
    if isinstance(a, torch.Tensor):
        a.add_(s)
    return acc.clone()


@pytest.mark.parametrize("fn", [_sum_through_a_loop, _sum_through_a_list_of_any], ids=["loop", "list-of-any"])
def test_a_custom_reduction_writing_into_acc_unseen_by_alias_analysis_leaves_out_a_raised_forward(tmp_path, fn):
    """A TorchScript reduction whose program was said never to write into acc is given the
    accumulator itself, which the capture's state before each forward shares. TorchScript's alias
    analysis misses some writes into acc (a loop carrying it to the next iteration, a List[Any]
    holding it): the last forward, which raised after the function updated acc in place, stayed
    in the store's reduction and the caller's init= changed. Now only a program that writes into
    nothing at all is given the accumulator itself."""
    torch.manual_seed(0)
    model = _RaisesAfterTwo().eval()
    xs = [torch.randn(n, 3) for n in (4, 5, 6, 7)]
    init = torch.full((4,), 100.0, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (TorchScript deprecation; the warning of the raised forward)
        scope = acs.ActivationScope(store=str(tmp_path / "s.zarr"), reduction_policy=STREAMING,
                                    reductions={"a.output": [("s", fn, {"init": init})]})
        with torch.inference_mode(), scope.track(model):  # (no version counter to see the write by)
            for x in xs[:3]:
                model(x)
            model.error = RuntimeError
            with pytest.raises(RuntimeError, match="cut short"):
                model(xs[3])  # (after a.output reduced its rows)
            model.error = None
    with torch.no_grad():
        want = 100.0 + torch.cat([model.a(x) for x in xs[:3]]).double().sum(0)
    torch.testing.assert_close(open_store(tmp_path / "s.zarr").reductions["a.output"]["s"], want)
    assert init.tolist() == [100.0] * 4
