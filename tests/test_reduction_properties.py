"""A randomized check of a custom reduction's accumulator over batches some of which its function
refuses (raises on, after writing into acc in whatever way it does): the statistic equals plain
PyTorch's over the batches it took, init= stays as it was (a tensor, or an array it was made over
by torch.from_numpy), and a store holds that statistic, also
after a resume of a capture that ended on such a batch. TorchScript and eager functions, writing
into acc in place, through acc.data, into a view of it, into a temporary only or into nothing,
and one returning another dtype (refused at every batch given an accumulator); a reduction used
directly, a capture in memory, into a store of rows or of reductions only (committing after every
forward or at the close), and a store of reductions only resumed."""

from __future__ import annotations

import contextlib
import warnings
from typing import Optional

import numpy as np
import pytest
import torch

import activationscope as acs
from activationscope.errors import CaptureError, StoreError
from activationscope.reductions import make_reduction
from activationscope.store import open_store

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

REFUSED = 2  # a batch of this many rows is one the function raises on (after its write)
_EAGER = 1.0  # a global Python float: TorchScript refuses it, so a function using it runs eagerly


def pure(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    s = x.double().sum(0)
    if x.shape[0] == 2:
        raise RuntimeError("refused batch")
    return s if acc is None else acc + s


def in_place(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    s = x.double().sum(0)
    if acc is None:
        if x.shape[0] == 2:
            raise RuntimeError("refused batch")
        return s
    acc += s
    if x.shape[0] == 2:
        raise RuntimeError("refused batch")
    return acc


def add_(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    s = x.double().sum(0)
    if acc is None:
        if x.shape[0] == 2:
            raise RuntimeError("refused batch")
        return s
    acc.add_(s)
    if x.shape[0] == 2:
        raise RuntimeError("refused batch")
    return acc


def view(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    s = x.double().sum(0)
    if acc is None:
        if x.shape[0] == 2:
            raise RuntimeError("refused batch")
        return s
    acc[:] += s
    if x.shape[0] == 2:
        raise RuntimeError("refused batch")
    return acc[:]


def temporary(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    s = x.double().sum(0).clone()
    s.mul_(1.0)
    if x.shape[0] == 2:
        raise RuntimeError("refused batch")
    return s if acc is None else acc + s


def through_data(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    s = x.double().sum(0)
    if acc is None:
        if x.shape[0] == 2:
            raise RuntimeError("refused batch")
        return s
    acc.data.add_(s)
    if x.shape[0] == 2:
        raise RuntimeError("refused batch")
    return acc * 1.0


def other_dtype(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    s = x.double().sum(0)
    if acc is None:
        if x.shape[0] == 2:
            raise RuntimeError("refused batch")
        return s
    acc += s
    return acc.float()


def pure_eager(acc, x):
    s = x.double().sum(0) * _EAGER
    if x.shape[0] == 2:
        raise RuntimeError("refused batch")
    return s if acc is None else acc + s


def in_place_eager(acc, x):
    s = x.double().sum(0) * _EAGER
    if acc is None:
        if x.shape[0] == 2:
            raise RuntimeError("refused batch")
        return s
    acc += s
    if x.shape[0] == 2:
        raise RuntimeError("refused batch")
    return acc


def view_eager(acc, x):
    s = x.double().sum(0) * _EAGER
    if acc is None:
        if x.shape[0] == 2:
            raise RuntimeError("refused batch")
        return s
    acc[:] += s
    if x.shape[0] == 2:
        raise RuntimeError("refused batch")
    return acc[:]


def through_data_eager(acc, x):
    s = x.double().sum(0) * _EAGER
    if acc is None:
        if x.shape[0] == 2:
            raise RuntimeError("refused batch")
        return s
    acc.data.add_(s)
    if x.shape[0] == 2:
        raise RuntimeError("refused batch")
    return acc * 1.0


def other_dtype_eager(acc, x):
    s = x.double().sum(0) * _EAGER
    if acc is None:
        if x.shape[0] == 2:
            raise RuntimeError("refused batch")
        return s
    acc += s
    return acc.float()


PROGRAMS = [pure, in_place, add_, view, temporary, through_data, other_dtype,
            pure_eager, in_place_eager, view_eager, through_data_eager, other_dtype_eager]
D = 4


def _expected(fn, outputs: list[torch.Tensor], init: torch.Tensor | None):
    """Which batches the function refuses, and the statistic over the others (plain PyTorch)."""
    acc = None if init is None else init.clone()
    refused = []
    for out in outputs:
        no = out.shape[0] == REFUSED or (fn.__name__.startswith("other_dtype") and acc is not None)
        refused.append(no)
        if not no:
            s = out.double().sum(0)
            acc = s if acc is None else acc + s
    return refused, acc


def _feed(model, xs, refused, start: int = 0):
    for x, no in zip(xs[start:], refused[start:]):
        if no:
            with pytest.raises(CaptureError, match="refused batch|keep its shape and dtype"):
                model(x)
        else:
            model(x)


def _track(mode, scope, model, xs, refused, new: bool = True) -> None:
    """Capture the forwards of ``xs`` into the store of ``scope``: a new store that takes no
    batch captures no whole forward, an error at the close."""
    took = not new or not all(refused)
    with contextlib.nullcontext() if took else pytest.raises(CaptureError, match="captured no"):
        with mode(), scope.track(model, include=["0"]):
            _feed(model, xs, refused)


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(fn=st.sampled_from(PROGRAMS), with_init=st.sampled_from([None, "tensor", "array"]),
       sizes=st.lists(st.sampled_from([1, 2, 3, 5]), min_size=1, max_size=6),
       where=st.sampled_from(["direct", "memory", "store", "rows store", "resume"]), inference=st.booleans(),
       commit=st.sampled_from([0, 3600]))
def test_a_custom_reduction_is_plain_pytorch_over_the_batches_it_took(tmp_path_factory, fn, with_init, sizes, where,
                                                                       inference, commit):
    """A function that raised on a batch (after writing into acc, seen by a version counter or
    not) or returned another dtype left nothing of that batch in the accumulator: the result is
    plain PyTorch's over the batches it took, in every way of running it, each result or state
    handed out stays as it was, and init= is unchanged."""
    torch.manual_seed(len(sizes))
    model = torch.nn.Sequential(torch.nn.Linear(3, D)).eval()
    xs = [torch.randn(n, 3) for n in sizes]
    # (init= as a tensor the caller holds, or over an array it holds: torch.from_numpy, the tensor dropped)
    array = np.full(D, 100.0)
    init = None if with_init is None else torch.from_numpy(array).clone() if with_init == "tensor" else None
    with torch.no_grad():
        outputs = [model(x) for x in xs]
    refused, want = _expected(fn, outputs, None if with_init is None else torch.from_numpy(array))
    options = {} if with_init is None else {"init": init if init is not None else torch.from_numpy(array)}
    mode = torch.inference_mode if inference else torch.no_grad
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (TorchScript deprecation, eager fallback, the caught forwards)
        if where == "direct":
            r = make_reduction(fn, **options)
            options.clear()  # (no tensor over the array is held here any more)
            held = []  # (each result handed out, with its value then: later updates leave it as it is)
            with mode():
                for out, no in zip(outputs, refused):
                    if no:
                        with pytest.raises(CaptureError, match="refused batch|keep its shape and dtype"):
                            r.update(out.clone(), 0)
                    else:
                        r.update(out.clone(), 0)
                    value = r.result().get("value") if len(held) % 2 else r.state().get("acc")
                    if value is not None and with_init != "array":  # (held, it is no memory a batch may reuse)
                        held.append((value, value.clone()))
            got = r.result().get("value")
            for value, then in held:
                assert torch.equal(value, then)
        elif where == "memory":
            scope = acs.ActivationScope(reductions={"0.output": [("s", fn, options)]})
            with mode(), scope.track(model, include=["0"]) as tracker:
                _feed(model, xs, refused)
            got = tracker.reductions.get("0.output", {}).get("s")
        else:
            path = tmp_path_factory.mktemp("s") / "s.zarr"
            streaming = acs.ReductionPolicy.STREAMING
            policy = {} if where == "rows store" else {"reduction_policy": streaming}  # (rows kept, or reductions only)
            scope = acs.ActivationScope(store=str(path), reductions={"0.output": [("s", fn, options)]},
                                        store_options={"commit_interval": commit, "shard_rows": 4}, **policy)
            cut = refused.index(True) if where == "resume" and True in refused else None
            if cut is None:
                _track(mode, scope, model, xs, refused)
            else:
                with pytest.raises(CaptureError), mode(), scope.track(model, include=["0"]):
                    for x in xs[:cut + 1]:
                        model(x)  # (the last one raises out of the block)
                assert path.exists() == (not all(refused[:cut]))
                resume = path.exists()
                if resume:
                    scope = acs.ActivationScope(store=str(path), reductions={"0.output": [("s", fn, options)]},
                                                reduction_policy=streaming, store_options={"resume": True})
                if resume and fn.__name__.endswith("_eager"):
                    # (an eager reduction's stored state is never continued: the resume is
                    # refused, the store left as it was, at the forwards before the cut)
                    with pytest.raises(StoreError, match="runs as eager Python"):
                        _track(mode, scope, model, xs[cut + 1:], refused[cut + 1:], new=False)
                    refused = refused[:cut + 1]
                    _, want = _expected(fn, outputs[:cut + 1], None if with_init is None else torch.from_numpy(array))
                else:
                    _track(mode, scope, model, xs[cut + 1:], refused[cut + 1:], new=not resume)
            if all(refused):  # (no whole forward: the store was removed)
                assert not path.exists()
                want = None
            got = open_store(path).reductions["0.output"]["s"] if path.exists() else None
    if want is None:
        assert got is None
    else:
        assert got is not None
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-9, check_dtype=False)
    if init is not None:
        assert init.tolist() == [100.0] * D
    assert array.tolist() == [100.0] * D
