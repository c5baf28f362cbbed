"""Reductions: every native path against a plain-PyTorch float64 offline reference."""

from __future__ import annotations

import ast
import math
import os
import re
import runpy
import types
import warnings
from pathlib import Path
from typing import Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import activationscope as acs
from activationscope.capture import reductions as R
from activationscope.errors import ActivationScopeError, CaptureError, ReductionError
from acs_testing import SumRows, log_sum, log_sum_eager, log_sum_in_place

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
]
HIST = {"bins": 12, "lo": -3.0, "hi": 3.0}
CASES = [  # (kind, options)
    ("mean", {}), ("var", {}), ("std", {}), ("var", {"ddof": 1}), ("min", {}), ("max", {}),
    ("absmax", {}), ("l2", {}), ("nonzero", {}), ("hist", HIST), ("cov", {}), ("topk", {"k": 3}),
]
ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------- reference


def reference(kind: str, rows: torch.Tensor, **opts) -> dict[str, torch.Tensor]:
    """Offline float64 result on all rows at once (what streaming must reproduce); min, max
    and topk of integer rows exact, in int64."""
    d = rows.to("cpu", exact_dtype(rows.dtype) if kind in ("min", "max", "topk") else torch.float64)
    per_feature = opts.get("per_feature", 1)
    if not per_feature:
        d = d.reshape(-1)
    n = d.shape[0]
    out: dict[str, torch.Tensor] = {"count": torch.tensor(n)}
    ddof = opts.get("ddof", 0)
    if kind == "mean":
        out["mean"] = d.mean(0)
    elif kind in ("var", "std"):
        out["mean"] = d.mean(0)
        with warnings.catch_warnings():  # ddof >= n: inf or NaN, torch warns
            warnings.simplefilter("ignore", UserWarning)
            var = d.var(0, correction=ddof)
        out[kind] = var if kind == "var" else var.sqrt()
    elif kind == "min":
        out["min"] = d.amin(0)
    elif kind == "max":
        out["max"] = d.amax(0)
    elif kind == "absmax":
        out["absmax"] = d.abs().amax(0)
    elif kind == "l2":
        out["l2"] = torch.linalg.vector_norm(d, dim=0)
    elif kind == "nonzero":
        out["nonzero"] = (d != 0).to(torch.float64).mean(0)
    elif kind == "hist":
        bins, lo, hi = int(opts["bins"]), opts["lo"], opts["hi"]
        cols = d.reshape(n, -1)
        counts = torch.stack([torch.histc(c[~c.isnan()], bins=bins, min=lo, max=hi) for c in cols.T]).long()
        feat = d.shape[1:]
        out["counts"] = counts.reshape(*feat, bins)
        out["underflow"] = (d < lo).sum(0)
        out["overflow"] = (d > hi).sum(0)
        out["nan"] = d.isnan().sum(0)
        out["edges"] = torch.linspace(lo, hi, bins + 1, dtype=torch.float64)
    elif kind == "cov":
        flat = d.reshape(n, -1)
        out["mean"] = d.mean(0)
        with warnings.catch_warnings():  # ddof >= n: inf or NaN, torch warns
            warnings.simplefilter("ignore", UserWarning)
            out["cov"] = torch.cov(flat.T, correction=ddof).reshape(flat.shape[1], flat.shape[1])
    elif kind == "topk":
        k = min(int(opts["k"]), n)
        out["values"] = d.topk(k, dim=0).values
    else:
        raise AssertionError(kind)
    return out


def assert_matches(kind: str, got: dict, rows: torch.Tensor, rtol: float = 1e-10, **opts) -> None:
    want = reference(kind, rows, **opts)
    if kind == "topk":
        assert_topk_ids(got, rows, **opts)
    assert int(got["count"]) == int(want["count"])
    for key, w in want.items():
        g = got[key].cpu()
        assert g.shape == w.shape, (key, g.shape, w.shape)
        assert g.dtype == w.dtype, (key, g.dtype, w.dtype)
        if key == kind and kind in ("var", "std", "cov") and opts.get("ddof", 0) >= int(want["count"]) > 0:
            assert_divided_by_zero(kind, g, rows, **opts)
            continue
        if g.dtype.is_floating_point:
            assert g.dtype == torch.float64, key
            torch.testing.assert_close(g, w.to(g.dtype), rtol=rtol, atol=1e-12, equal_nan=True, msg=key)
        else:
            assert torch.equal(g, w.to(g.dtype)), (key, g, w)


def assert_divided_by_zero(kind: str, got: torch.Tensor, rows: torch.Tensor, **opts) -> None:
    """var / std / cov with ddof >= n divide the sums of squared deviations (co-moments) M by
    0, as torch does: +-inf where M is away from 0, NaN where it is 0 (a constant column: its
    mean is its value, its M exactly 0). An off-diagonal co-moment that is 0 in exact
    arithmetic (uncorrelated columns) is a rounding residual of either sign in float64, in
    torch's reference as in a streaming result: there inf, -inf and NaN are all right (|M| at
    most 1e-9 of the Cauchy-Schwarz bound sqrt(M_ii M_jj))."""
    base = "var" if kind == "std" else kind
    m = reference(base, rows, **dict(opts, ddof=0))[base] * int(rows.shape[0] if opts.get("per_feature", 1)
                                                                  else rows.numel())
    want = torch.where(m > 0, torch.inf, torch.where(m < 0, -torch.inf, torch.nan))
    clear = torch.ones_like(m, dtype=torch.bool)
    if kind == "cov":
        diag = m.diagonal()
        bound = (diag[:, None] * diag[None, :]).sqrt()
        clear = m.isnan() | (m.abs() > 1e-9 * bound) | torch.eye(m.shape[0], dtype=torch.bool)
    same = (got == want) | (got.isnan() & want.isnan())
    assert bool(same[clear].all()), (kind, got, want)
    assert bool((got[~clear].isnan() | got[~clear].isinf()).all()), (kind, got)


def exact_dtype(dtype: torch.dtype) -> torch.dtype:
    """What min / max / topk keep rows of ``dtype`` in: int64 for integers (not bool or
    uint64), float64 for the rest."""
    integer = not dtype.is_floating_point and dtype not in (torch.bool, torch.uint64)
    return torch.int64 if integer else torch.float64


def assert_topk_ids(got: dict, rows: torch.Tensor, **opts) -> None:
    d = rows.cpu().to(exact_dtype(rows.dtype))
    n = d.shape[0]
    ids = got["row_ids"].cpu()
    assert ids.dtype == torch.int64
    offset = opts.get("row_offset", 0)
    assert bool(((ids >= offset) & (ids < offset + n)).all())
    local = ids - offset
    if opts.get("per_feature", 1):
        flat = d.reshape(n, -1)
        cols = torch.arange(flat.shape[1]).expand_as(local.reshape(local.shape[0], -1))
        picked = flat[local.reshape(local.shape[0], -1), cols].reshape(got["values"].shape)
    else:
        picked = d.reshape(n, -1)[local, got["feature_ids"].cpu()]
    values = got["values"].cpu()
    assert picked.dtype == values.dtype
    assert torch.equal(picked.isnan(), values.isnan()) and torch.equal(picked.nan_to_num(), values.nan_to_num())


def stream(kind: str, batches: list[torch.Tensor], row_offset: int = 0, **opts):
    r = R.make_reduction(kind, **opts)
    for b in batches:
        r.update(b, row_offset)
        row_offset += b.shape[0]
    return r


def data(n: int, feat: tuple, dtype: torch.dtype, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, *feat), generator=g, dtype=torch.float64) * 1.5
    x[torch.rand(x.shape, generator=g) < 0.2] = 0.0  # some dead values for nonzero
    return x.to(dtype).to(device)


# ---------------------------------------------------------------------------- built-ins


def test_builtin_names():
    assert set(R.BUILTIN_REDUCTIONS) == {"mean", "var", "std", "min", "max", "absmax", "l2", "nonzero",
                                         "hist", "cov", "topk"}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind,opts", CASES, ids=[f"{k}{o or ''}" for k, o in CASES])
def test_streaming_matches_offline_per_feature(kind, opts, dtype, device):
    x = data(53, (4, 3), dtype, seed=1, device=device)
    batches = [x[:7], x[7:8], x[8:40], x[40:40], x[40:]]  # unequal sizes and an empty batch
    r = stream(kind, batches, row_offset=100, **opts)
    got = r.result()
    assert assert_matches(kind, got, x, row_offset=100, **opts) is None
    if kind not in ("cov", "hist"):  # result shape = feature shape
        key = {"var": "var", "std": "std"}.get(kind, "values" if kind == "topk" else kind)
        assert got[key].shape[-2:] == (4, 3)
        assert got[key].device == x.device


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind,opts", CASES, ids=[f"{k}{o or ''}" for k, o in CASES])
def test_whole_tensor_mode(kind, opts, dtype):
    x = data(21, (5,), dtype, seed=2)
    opts = {**opts, "per_feature": 0}
    r = stream(kind, [x[:4], x[4:]], **opts)
    got = r.result()
    assert_matches(kind, got, x, **opts)
    assert int(got["count"]) == x.numel()
    if kind in ("mean", "var", "min", "l2"):
        assert got[kind].dim() == 0


def test_large_offset_keeps_variance():
    """1e6 + small noise in float32: a float32 one-pass variance would be garbage."""
    g = torch.Generator().manual_seed(3)
    x = (1e6 + torch.randn(4000, 8, generator=g, dtype=torch.float64) * 0.25).to(torch.float32)
    batches = list(x.split(333))
    r = stream("var", batches)
    want = x.double().var(0, correction=0)
    torch.testing.assert_close(r.result()["var"], want, rtol=1e-9, atol=0)
    # the trap this guards against: one-pass E[x^2] - E[x]^2 in float32 is far off
    naive = (x * x).mean(0) - x.mean(0) ** 2
    assert not torch.allclose(naive.double(), want, rtol=1e-2)
    c = stream("cov", batches).result()["cov"]
    torch.testing.assert_close(c, torch.cov(x.double().T, correction=0), rtol=1e-9, atol=1e-12)


def test_bfloat16_rows_accumulate_in_float64():
    x = torch.full((4096, 2), 1.0, dtype=torch.bfloat16)  # bf16 sum would stall at 256
    got = stream("mean", list(x.split(1000))).result()
    assert torch.equal(got["mean"], torch.ones(2, dtype=torch.float64))
    assert stream("l2", [x]).result()["l2"][0].item() == 64.0


def test_nan_handling():
    x = torch.tensor([[1.0, 0.0], [float("nan"), 2.0], [3.0, -1.0]])
    assert torch.isnan(stream("mean", [x]).result()["mean"][0])
    assert torch.isnan(stream("var", [x[:1], x[1:]]).result()["var"][0])
    for kind in ("min", "max"):  # like torch.amin / amax: NaN propagates
        got = stream(kind, [x[:1], x[1:]]).result()[kind]
        want = getattr(x.double(), "a" + kind)(0)
        torch.testing.assert_close(got, want, equal_nan=True)
    assert stream("nonzero", [x]).result()["nonzero"].tolist() == [1.0, 2 / 3]
    h = stream("hist", [x], bins=4, lo=-2, hi=2).result()
    assert h["nan"].tolist() == [1, 0] and h["overflow"].tolist() == [1, 0]
    assert (h["counts"].sum(-1) + h["nan"] + h["overflow"] + h["underflow"]).tolist() == [3, 3]


def _torch_dof(kind: str, d: torch.Tensor, ddof: int) -> torch.Tensor:
    with warnings.catch_warnings():  # torch warns that the degrees of freedom are <= 0
        warnings.simplefilter("ignore", UserWarning)
        if kind == "cov":
            return torch.cov(d.T, correction=ddof)
        return getattr(d, kind)(0, correction=ddof)


@pytest.mark.parametrize("kind", ["var", "std", "cov"])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("ddof", [0, 1, 2, 3, 5])
@pytest.mark.parametrize("split", ["one", "rows", "merged"])
@pytest.mark.parametrize("device", DEVICES)
def test_ddof_at_or_above_the_row_count_gives_what_torch_gives(kind, n, ddof, split, device):
    """torch divides by max(0, n - ddof): a spread column gives inf, a constant one (or a
    single row) 0 / 0 = NaN, and a negative co-moment -inf; whatever the batches or merges."""
    d = torch.tensor([[0.0, 1.0, 3.0], [2.0, 1.0, -1.0], [5.0, 1.0, -2.0], [-1.0, 1.0, 4.0]], dtype=torch.float64)[:n]
    d = d.to(device)
    if split == "one":
        r = stream(kind, [d], ddof=ddof)
    elif split == "rows":
        r = stream(kind, list(d.split(1)), ddof=ddof)
    else:
        r = stream(kind, [d[: n // 2]], ddof=ddof)
        r.merge(stream(kind, [d[n // 2:]], ddof=ddof))
    got, want = r.result()[kind].cpu(), _torch_dof(kind, d.cpu(), ddof)
    assert got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan()), (got, want)
    assert torch.equal(got.nan_to_num(), want.nan_to_num()) if n <= ddof else torch.allclose(
        got, want, rtol=1e-12, atol=0, equal_nan=True), (got, want)
    if n <= ddof and n >= 2:  # the spread columns are inf, the constant one NaN
        diag = got.diagonal() if kind == "cov" else got
        assert diag[0].item() == math.inf and math.isnan(diag[1].item()) and diag[2].item() == math.inf
    if kind == "cov" and n <= ddof and n >= 2:
        assert got[0, 2].item() == -math.inf  # a negative co-moment over 0


@pytest.mark.parametrize("value", [0.1, 0.7, 1 / 3, 1e10 + 0.1, -2.5e-300])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("path", ["fast", "aten", "fused", "whole"])
def test_a_constant_column_has_its_value_as_mean_and_zero_variance(value, dtype, path):
    """sum / n rounds (three rows of 0.1 sum to 0.30000000000000004): a constant column's
    mean must still be its value and its variance exactly 0, as torch.var gives, so that
    ddof >= n gives NaN there, not inf (a sum of squares of round-off over 0)."""
    from activationscope.capture import _native

    x = torch.full((10, 3), value, dtype=dtype)
    x[:, 2] = torch.arange(10, dtype=dtype)  # one column that varies
    c = x[0, 0].double().item()  # the value as the rows hold it
    opts = {"per_feature": 0} if path == "whole" else {}
    rows = x[:, :1].contiguous() if path == "whole" else x
    for n in (3, 7, 10):
        batches = list(rows[:n].split(4))
        if path == "aten":
            batches = [_non_contiguous(b) for b in batches]
        reds = {kind: R.make_reduction(kind, ddof=n, **opts) for kind in ("var", "std", "cov")}
        reds["mean"] = R.make_reduction("mean", **opts)
        reds["min"] = R.make_reduction("min", **opts)
        reds["var0"] = R.make_reduction("var", **opts)
        for b in batches:
            if path == "fused":
                _native.load().update_reductions(list(reds.values()), b, 0)
            else:
                for r in reds.values():
                    r.update(b)
        mean, var0 = reds["mean"].result()["mean"], reds["var0"].result()["var"]
        assert mean.reshape(-1)[0].item() == c and reds["var0"].result()["mean"].reshape(-1)[0].item() == c
        assert var0.reshape(-1)[0].item() == 0.0
        assert math.isnan(reds["var"].result()["var"].reshape(-1)[0].item())
        assert math.isnan(reds["std"].result()["std"].reshape(-1)[0].item())
        assert math.isnan(reds["cov"].result()["cov"][0, 0].item())
        if path != "whole":
            assert reds["var"].result()["var"][2].item() == math.inf
            want = rows[:n].double().var(0, correction=0)
            assert torch.equal(var0[:2], want[:2]) and torch.allclose(var0, want, rtol=1e-12)


@pytest.mark.parametrize("path", ["fast", "aten", "fused"])
def test_a_batch_mean_whose_sum_overflows_stays_infinite_as_torch_mean(path):
    """Keeping batch means within [min, max] must not turn a sum that overflowed (inf, as
    torch.mean gives) into the column's max: only finite means are kept within it."""
    from activationscope.capture import _native

    x = torch.tensor([[1e308, -1e308, 1.0], [1.5e308, -1.5e308, 2.0]], dtype=torch.float64)
    rows = _non_contiguous(x) if path == "aten" else x
    reds = [R.make_reduction("mean"), R.make_reduction("var"), R.make_reduction("max")]
    if path == "fused":
        _native.load().update_reductions(reds, rows, 0)
    else:
        for r in reds:
            r.update(rows)
    want = x.mean(0)
    assert want.tolist() == [math.inf, -math.inf, 1.5]
    assert reds[0].result()["mean"].tolist() == want.tolist()
    assert reds[1].result()["mean"].tolist() == want.tolist()


def _int_rows(n: int, feat: tuple, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Integers over the dtype's range (int64: far past 2**53, where float64 rounds), with
    repeats (ties) and zeros."""
    g = torch.Generator().manual_seed(seed)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(2 ** 62)), min(info.max, 2 ** 62)
    x = torch.randint(lo, hi, (n, *feat), generator=g, dtype=torch.int64)
    x[torch.rand(x.shape, generator=g) < 0.2] = 0
    x[torch.rand(x.shape, generator=g) < 0.2] = hi - 1
    if dtype == torch.int64 and n >= 2:
        x.view(n, -1)[:2] = torch.tensor([2 ** 60 + 1, 2 ** 60 + 3]).view(2, 1)  # one float64 value
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8], ids=str)
@pytest.mark.parametrize("per_feature", [1, 0])
@pytest.mark.parametrize("k", [3, 70])  # 70: past the one-pass top-k (k <= 64)
def test_integer_rows_keep_min_max_topk_exact_in_int64(dtype, per_feature, k):
    x = _int_rows(90, (2, 3), dtype, seed=4)
    exact = x.long() if per_feature else x.long().reshape(-1)
    opts = {"per_feature": per_feature}
    bounds = [0, 1, 2, 40, 41, 90]
    for kind, key, want in (("min", "min", exact.amin(0)), ("max", "max", exact.amax(0)),
                            ("topk", "values", exact.topk(min(k, exact.shape[0]), 0).values)):
        o = {**opts, "k": k} if kind == "topk" else opts
        streamed = stream(kind, _pieces(x, bounds), **o)
        slow = stream(kind, [_non_contiguous(p) for p in _pieces(x, bounds) if p.shape[0]], **o)
        parts = [stream(kind, [p], row_offset=a, **o) for p, a in zip(_pieces(x, bounds), bounds)]
        merged = parts.pop()
        for p in parts:  # in reverse row order
            merged.merge(p)
        resumed = R.make_reduction(kind, **o)
        resumed.load_state(stream(kind, [x[:40]], **o).state())
        resumed.update(x[40:], 40)
        for r in (streamed, slow, merged, resumed):
            got = r.result()
            assert got[key].dtype == torch.int64 and r.state()["value" if kind != "topk" else "values"].dtype == torch.int64
            assert torch.equal(got[key], want), (kind, got[key], want)
            if kind == "topk":
                assert_topk_ids(got, x, **opts)
                assert torch.equal(got["row_ids"], streamed.result()["row_ids"])  # ties: the lower row, any split
    if dtype == torch.int64:  # float64 would make these equal
        assert int(stream("max", [x[:2]]).result()["max"][0, 0]) == 2 ** 60 + 3
        assert int(stream("min", [x[:2]]).result()["min"][0, 0]) == 2 ** 60 + 1


def test_integer_and_float_rows_in_one_reduction_give_float64():
    """As torch promotes int64 with float64: integer batches then float ones, float then
    integer, and a merge of the two, give float64; bool and uint64 rows are float64."""
    ints, floats = torch.tensor([[3, -7]]), torch.tensor([[0.5, -7.5]])
    for kind, key in (("min", "min"), ("max", "max"), ("topk", "values")):
        want = getattr(torch.cat([ints.double(), floats.double()]), {"topk": "topk"}.get(kind, "a" + kind))(
            *((2, 0) if kind == "topk" else (0,)))
        want = want.values if kind == "topk" else want
        for first, second in ((ints, floats), (floats, ints), (ints.int(), floats.half())):
            got = stream(kind, [first, second], k=2) if kind == "topk" else stream(kind, [first, second])
            assert got.result()[key].dtype == torch.float64 and torch.equal(got.result()[key], want)
            a = stream(kind, [first], **({"k": 2} if kind == "topk" else {}))
            a.merge(stream(kind, [second], 1, **({"k": 2} if kind == "topk" else {})))
            assert a.result()[key].dtype == torch.float64 and torch.equal(a.result()[key], want)
    assert stream("max", [torch.tensor([[True, False]])]).result()["max"].tolist() == [1.0, 0.0]
    big = torch.tensor([[2 ** 64 - 1], [2 ** 63 + 5]], dtype=torch.uint64)  # int64 cannot hold them
    got = stream("max", [big]).result()["max"]
    assert got.dtype == torch.float64 and got.item() == float(2 ** 64)
    assert stream("absmax", [torch.tensor([[-(2 ** 63)]])]).result()["absmax"].item() == 2.0 ** 63


def test_hist_edges_and_bins():
    x = torch.tensor([-5.0, -2.0, -1.5, 0.0, 0.49, 2.0, 7.0, float("inf"), float("-inf")])
    h = stream("hist", [x.reshape(-1, 1)], bins=4, lo=-2, hi=2).result()
    assert h["counts"].tolist() == [[2, 0, 2, 1]]  # -2, -1.5 | - | 0, 0.49 | 2 (x == hi: last bin)
    assert h["underflow"].tolist() == [2] and h["overflow"].tolist() == [2]
    assert torch.equal(h["edges"], torch.tensor([-2.0, -1.0, 0.0, 1.0, 2.0], dtype=torch.float64))


def test_topk_row_ids_are_global():
    x = torch.tensor([[1.0, 9.0], [5.0, 2.0], [3.0, 8.0], [7.0, 0.0]])
    r = R.make_reduction("topk", k=2)
    r.update(x[:2], 1000)
    r.update(x[2:], 1002)
    got = r.result()
    assert got["values"].tolist() == [[7.0, 9.0], [5.0, 8.0]]
    assert got["row_ids"].tolist() == [[1003, 1000], [1001, 1002]]
    w = R.make_reduction("topk", k=1, per_feature=0)
    w.update(x[:2], 10)
    w.update(x[2:], 12)
    got = w.result()
    assert got["values"].tolist() == [9.0]
    assert got["row_ids"].tolist() == [10] and got["feature_ids"].tolist() == [1]


def test_topk_with_fewer_rows_than_k():
    got = stream("topk", [torch.tensor([[2.0], [1.0]])], k=5).result()
    assert got["values"].tolist() == [[2.0], [1.0]]


def test_empty_batches_are_noops():
    r = R.make_reduction("var")
    r.update(torch.empty(0, 3))
    assert list(r.state()) == ["count"] and int(r.state()["count"]) == 0
    r.update(torch.ones(2, 5))  # the empty batch did not fix a feature shape
    r.update(torch.empty(0, 5))
    assert int(r.result()["count"]) == 2


def test_feature_shape_change_is_an_error():
    r = R.make_reduction("mean")
    r.update(torch.ones(2, 3))
    with pytest.raises(CaptureError, match=r"feature shape \(4,\) after \(3,\)"):
        r.update(torch.ones(2, 4))
    w = R.make_reduction("mean", per_feature=0)
    w.update(torch.ones(2, 3))
    w.update(torch.zeros(1, 4))
    assert w.result()["mean"].item() == pytest.approx(6 / 10)


@pytest.mark.parametrize("make", [
    lambda: R.make_reduction("mean", dim=(0, 2, 3)),
    lambda: R.resolve_reductions([("channel_mean", "mean", {"dim": (0, 2, 3)})], "conv.output"),
    lambda: acs.ActivationScope(reductions=[("channel_mean", "mean", {"dim": (0, 2, 3)})]),
])
def test_an_axis_option_for_conv_channels_is_named_as_an_unknown_option(make):
    """A vision user asking for per-channel statistics (``dim=(0, 2, 3)``, as torch.mean takes)
    was told "reduction option 'dim' must be a number", as if 'dim' were an option with a
    value of the wrong type; the unknown name is said first, with the options there are and
    where the docs show per-channel statistics."""
    with pytest.raises(ReductionError, match=r"reduction 'mean' has no option 'dim'; its options are \[per_feature\] "
                                             r"\(there is no per-channel or axis option: see section 'Per channel "
                                             r"of conv feature maps' of docs/usage/reductions.md \(in activationscope's "
                                             r"source distribution\)\)"):
        make()


def test_builtin_option_names_are_those_the_store_validates():
    from activationscope.store import _validate as V

    assert R.BUILTIN_OPTION_NAMES == V.BUILTIN_OPTIONS
    assert set(R.BUILTIN_OPTION_NAMES) == set(R.BUILTIN_REDUCTIONS)

def test_a_hist_without_its_range_names_the_options_given_and_how_to_give_lo_and_hi():
    """The error listed per_feature: 1, an option the user never gave, in a C++ map's spelling;
    it now shows the options given and the spellings of lo and hi in Python and on the command line."""
    with pytest.raises(ReductionError, match=r"got bins=8: in Python \('hist', 'hist', \{'lo'.*hist\[lo=-4,hi=4\]") as e:
        R.make_reduction("hist", bins=8)
    assert "per_feature" not in str(e.value)
    with pytest.raises(ReductionError, match=r"'lo' and 'hi' .*got lo=1:"):
        R.make_reduction("hist", lo=1.0)
    with pytest.raises(ReductionError, match=r"got none:"):
        acs.ActivationScope(reductions=[("h", "hist", {})])
    h = R.make_reduction("hist", lo=-4.0, hi=4.0)  # the spellings the message gives work
    h.update(torch.tensor([[0.5], [9.0]]))
    assert h.result()["counts"].sum() == 1 and h.result()["overflow"].sum() == 1
    acs.ActivationScope(reductions=[("hist", "hist", {"lo": -4.0, "hi": 4.0})])


def test_rejects_complex_and_bad_options():
    with pytest.raises(CaptureError, match="real-valued"):
        R.make_reduction("mean").update(torch.ones(2, 2, dtype=torch.complex64))
    with pytest.raises(ReductionError, match="needs options 'lo' and 'hi'"):
        R.make_reduction("hist")
    with pytest.raises(ReductionError, match=r"has no option 'k'; its options are \[bins, lo, hi"):
        R.make_reduction("hist", lo=0, hi=1, k=3)
    with pytest.raises(ReductionError, match="must be a number"):
        R.make_reduction("topk", k="3")
    with pytest.raises(ReductionError, match="per_feature"):
        R.make_reduction("mean", per_feature=2)


@pytest.mark.parametrize("kind, options, message", [
    ("topk", {"k": 2**24 + 1}, r"option 'k' of reduction 'topk' must be an integer in \[1, 2\*\*24\], got 16777217$"),
    ("topk", {"k": 0}, r"option 'k' of reduction 'topk' must be an integer in \[1, 2\*\*24\], got 0$"),
    ("hist", {"lo": 0, "hi": 1, "bins": 2**24 + 1}, r"must be an integer in \[1, 2\*\*24\], got 16777217$"),
    ("var", {"ddof": -3}, r"option 'ddof' of reduction 'var' must be a non-negative integer, got -3$"),
])
def test_an_option_out_of_range_is_refused_with_its_range_and_value(kind, options, message):
    """The refusal states the range the option must be in (topk's k: 1..2**24, as FORMAT.md
    section 9 rule 10) and the value given in full, never rounded to 6 digits."""
    with pytest.raises(ReductionError, match=message):
        R.make_reduction(kind, **options)


class _Pass(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


@pytest.mark.parametrize("names", [["mean"], ["mean", "var"]], ids=["one", "fused"])
@pytest.mark.parametrize("in_store", [False, True], ids=["memory", "store"])
@pytest.mark.parametrize("case", ["shape_change", "complex"])
def test_capture_reduction_errors_name_the_hook_point(case, in_store, names, tmp_path):
    # rows a reduction refuses during a capture: the error names the hook point, with the
    # reduction and the shapes / dtype when the reduction is what refused them
    model = _Pass()
    store = str(tmp_path / "r.zarr") if in_store else None
    second = torch.ones(2, 4) if case == "shape_change" else torch.ones(2, 3, dtype=torch.complex64)
    with pytest.raises(CaptureError) as info:
        with acs.ActivationScope(store=store, reductions=names).track(model, include=["inner"]):
            model(torch.ones(2, 3))
            model(second)
    msg = str(info.value)
    assert "'inner.output'" in msg
    if not in_store:
        assert "reduction 'mean'" in msg
        assert ("(4,) after (3,)" if case == "shape_change" else "real-valued rows, got dtype torch.complex64") in msg


@pytest.mark.parametrize("in_store", [False, True], ids=["memory", "store"])
def test_capture_complex_first_rows_name_the_hook_point(in_store, tmp_path):
    model = _Pass()
    store = str(tmp_path / "r.zarr") if in_store else None
    with pytest.raises(CaptureError, match=r"hook point 'inner.output': reduction 'mean' needs real-valued rows"):
        with acs.ActivationScope(store=store, reductions=["mean"]).track(model, include=["inner"]):
            model(torch.ones(2, 3, dtype=torch.complex64))


def test_unknown_builtin_lists_names():
    with pytest.raises(ReductionError, match=r"one of \['mean', 'var'.*'topk'\].*did you mean 'mean'"):
        R.make_reduction("means")
    with pytest.raises(ReductionError):
        R.make_reduction(42)


@pytest.mark.parametrize("spec,kind,options", [
    ("hist[lo=-4,hi=4,bins=16]", "hist", {"lo": -4, "hi": 4, "bins": 16}),
    ("topk[k=3]", "topk", {"k": 3}),
    ("var[ddof=1]", "var", {"ddof": 1}),
])
def test_command_line_bracket_options_in_python_give_the_python_spelling(spec, kind, options):
    # --reduce's "hist[lo=-4,hi=4]" given to the Python API: the error spells the same reduction
    # in Python, and what it spells is that reduction
    with pytest.raises(ReductionError, match=r"options in brackets are the command line's spelling") as e:
        acs.ActivationScope(reductions=[spec])
    message = str(e.value)
    assert message.startswith("reduction must be one of ['mean', 'var'")
    suggested = re.search(r"as a \(name, kind, options\) tuple, (\(.*\))$", message).group(1)
    assert ast.literal_eval(suggested) == (kind, kind, options)
    assert f"make_reduction({kind!r}, " in message
    model = torch.nn.Sequential(torch.nn.Identity())
    x = torch.linspace(-5, 5, 12).reshape(6, 2)
    with acs.ActivationScope(reductions=[ast.literal_eval(suggested)]).track(model, include=["0"]) as tracker:
        model(x)
    got = tracker.reductions["0.output"]
    reference = R.make_reduction(kind, **options)
    reference.update(x)
    expected = {f"{kind}.{k}" if k != kind else kind: v for k, v in reference.result().items()}
    assert set(expected) <= set(got)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


def test_bracket_options_that_are_not_numbers_get_a_generic_python_spelling():
    with pytest.raises(ReductionError, match=r"make_reduction\('hist', <option>=<value>\)"):
        R.make_reduction("hist[lo=a]")
    # a name that is no built-in keeps the list of names
    with pytest.raises(ReductionError, match=r"got 'foo\[x=1\]'$"):
        R.make_reduction("foo[x=1]")


# ---------------------------------------------------------------------------- merge / state


@pytest.mark.parametrize("kind,opts", CASES, ids=[f"{k}{o or ''}" for k, o in CASES])
def test_merge_any_order_equals_one_shot(kind, opts):
    x = data(40, (3,), torch.float32, seed=4)
    parts = [(0, 3), (3, 20), (20, 21), (21, 40)]
    reds = [stream(kind, [x[a:b]], row_offset=a, **opts) for a, b in parts]
    for order in ([0, 1, 2, 3], [3, 1, 0, 2], [2, 3, 1, 0]):
        total = reds[0].fresh()
        for i in order:
            total.merge(reds[i])
        assert_matches(kind, total.result(), x, rtol=1e-9, **opts)


def test_merge_into_itself_doubles_counts():
    r = stream("var", [torch.arange(6.0).reshape(3, 2)])
    r.merge(r)
    assert int(r.result()["count"]) == 6
    torch.testing.assert_close(r.result()["var"], torch.arange(6.0).reshape(3, 2).double().var(0, correction=0))


def test_merge_checks_kind_and_options():
    with pytest.raises(CaptureError, match="cannot merge a 'var' reduction into a 'mean'.*same kind"):
        R.make_reduction("mean").merge(R.make_reduction("var"))
    with pytest.raises(CaptureError, match="different options"):
        R.make_reduction("topk", k=2).merge(R.make_reduction("topk", k=3))
    a = stream("mean", [torch.ones(2, 3)])
    with pytest.raises(CaptureError, match="feature shape"):
        a.merge(stream("mean", [torch.ones(2, 4)]))


@pytest.mark.parametrize("kind,opts", CASES, ids=[f"{k}{o or ''}" for k, o in CASES])
def test_state_roundtrip_and_resume(kind, opts):
    x = data(30, (2, 2), torch.float32, seed=5)
    r = stream(kind, [x[:10]], **opts)
    resumed = r.fresh()
    assert resumed.options == r.options and resumed.kind == kind
    assert int(resumed.result()["count"]) == 0
    resumed.load_state(r.state())
    resumed.update(x[10:], 10)
    assert_matches(kind, resumed.result(), x, **opts)
    empty = r.fresh()
    empty.load_state(r.fresh().state())
    assert int(empty.state()["count"]) == 0


def test_state_is_not_mutated_by_later_updates():
    r = stream("mean", [torch.ones(2, 2)])
    s = r.state()
    r.update(torch.zeros(2, 2))
    assert s["mean"].tolist() == [1.0, 1.0]


def test_load_state_validates():
    r = R.make_reduction("var")
    with pytest.raises(CaptureError, match="lacks 'm2'"):
        r.load_state({"count": torch.tensor(3), "mean": torch.zeros(2)})
    with pytest.raises(CaptureError, match="count"):
        r.load_state({"mean": torch.zeros(2)})


def test_merge_states_helper():
    x = data(25, (3,), torch.float16, seed=6)
    states = [stream("cov", [x[a:b]]).state() for a, b in [(0, 9), (9, 10), (10, 25)]]
    merged = R.merge_states("cov", states)
    assert_matches("cov", merged.result(), x, rtol=1e-9)


# ---------------------------------------------------------------------------- properties


SWEEP_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool]


def sweep_rows(n: int, feat: tuple, dtype: torch.dtype, seed: int, special: bool) -> torch.Tensor:
    """Rows of ``dtype``: floats as :func:`data` (with NaN, +-inf and -0.0 when ``special``),
    integers over the dtype's range (int64 past 2**53) with ties, bools."""
    if dtype == torch.bool:
        return torch.rand((n, *feat), generator=torch.Generator().manual_seed(seed)) < 0.5
    if not dtype.is_floating_point:
        return _int_rows(n, feat, dtype, seed)
    if not special:
        return data(n, feat, dtype, seed=seed)
    x = data(n, feat, torch.float64, seed=seed)
    flat = x.view(-1)
    pick = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(seed + 1))
    for i, v in zip(pick[: max(1, flat.numel() // 4)].tolist(), [math.nan, math.inf, -math.inf, -0.0] * flat.numel()):
        flat[i] = v
    return x.to(dtype)


@st.composite
def split_case(draw):
    """Rows (1-D, 2-D or scalar features) of every accepted dtype, NaN / inf / -0.0 or not,
    cut into batches anywhere (single rows, empty batches); every built-in with its options
    (``ddof`` up to past the row count) in per-feature and whole-tensor mode."""
    n = draw(st.integers(1, 40))
    f = draw(st.integers(1, 4))
    feat = draw(st.sampled_from([(f,), (2, f), ()]))
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=6)))
    seed = draw(st.integers(0, 2**31 - 1))
    dtype = draw(st.sampled_from(SWEEP_DTYPES))
    special = dtype.is_floating_point and draw(st.booleans())
    kind, opts = draw(st.sampled_from(CASES))
    if kind in ("var", "std", "cov"):
        opts = {**opts, "ddof": draw(st.sampled_from([0, 1, 2, 3, 41]))}
    per_feature = draw(st.sampled_from([0, 1]))
    return n, feat, [0, *cuts, n], seed, dtype, special, kind, {**opts, "per_feature": per_feature}


def _pieces(x, bounds):
    return [x[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(split_case())
def test_property_streaming_equals_offline(case):
    n, feat, bounds, seed, dtype, special, kind, opts = case
    x = sweep_rows(n, feat, dtype, seed, special)
    r = stream(kind, _pieces(x, bounds), **opts)
    assert_matches(kind, r.result(), x, rtol=1e-9, **opts)
    resumed = R.make_reduction(kind, **opts)  # load_state(state()) is the identity
    resumed.load_state(r.state())
    assert_matches(kind, resumed.result(), x, rtol=1e-9, **opts)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(split_case(), st.randoms(use_true_random=False))
def test_property_merge_associative_any_order(case, rnd):
    n, feat, bounds, seed, dtype, special, kind, opts = case
    x = sweep_rows(n, feat, dtype, seed, special)
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        parts.append(stream(kind, [x[a:b]], row_offset=a, **opts))
    rnd.shuffle(parts)
    # random binary tree of merges
    while len(parts) > 1:
        i = rnd.randrange(len(parts) - 1)
        left, right = parts[i], parts.pop(i + 1)
        left.merge(right)
    assert_matches(kind, parts[0].result(), x, rtol=1e-9, **opts)


class _Clone(torch.nn.Module):
    def forward(self, x):
        return x.clone()  # (x + 0 would turn -0.0 into 0.0, x * 1 bool into int64)


CAPTURE_SPECS = [(f"r{i}", kind, opts) for i, (kind, opts) in enumerate(
    CASES + [("var", {"ddof": 13}), ("std", {"ddof": 20}), ("cov", {"ddof": 13}), ("topk", {"k": 4, "per_feature": 0}),
             ("mean", {"per_feature": 0}), ("max", {"per_feature": 0}), ("topk", {"k": 20})])]


@pytest.mark.parametrize("dtype", SWEEP_DTYPES, ids=str)
@pytest.mark.parametrize("special", [False, True], ids=["finite", "nan_inf"])
@pytest.mark.parametrize("policy", ["store_all", "final_only", "streaming"])
@pytest.mark.parametrize("in_store", [False, True], ids=["memory", "store"])
def test_every_builtin_in_a_capture_equals_torch_over_the_rows(dtype, special, policy, in_store, tmp_path):
    """Every built-in (ddof at and past the 13 rows, whole-tensor mode, k past the rows)
    captured from a model whose output is its input, in memory or into a store (chunks of 4
    rows: batches of 3, 1, 5 and 4 rows cross them) under each ReductionPolicy, read back,
    against torch over the rows: the same values and dtypes as reductions fed the rows
    directly (assert_matches)."""
    if special and not dtype.is_floating_point:
        pytest.skip("NaN, inf and -0.0 are float values")
    import activationscope as acs

    x = sweep_rows(13, (2, 3), dtype, seed=31, special=special)
    xs = list(x.split([3, 1, 5, 4]))
    model = torch.nn.Sequential(_Clone())
    store = tmp_path / "s.zarr" if in_store else None
    # (a store keeps every row: another policy than store_all decides only the records in memory)
    scope = acs.ActivationScope(store=store, reductions=CAPTURE_SPECS, reduction_policy=policy,
                                storage="cpu" if in_store and policy != "store_all" else "auto",
                                store_options={"chunk_rows": 4} if in_store else None)
    with scope.track(model) as tracker:
        for b in xs:
            model(b)
    if in_store:
        s = acs.open_store(store)
        got = s.reductions["0.output"]
        if policy == "store_all":
            assert s["0.output"].dtype == dtype and torch.equal(s["0.output"].nan_to_num(), x.nan_to_num())
    else:
        got = tracker.reductions["0.output"]
    for name, kind, opts in CAPTURE_SPECS:
        fed = stream(kind, xs, **opts).result()
        main = kind if kind in fed else None
        result = {k: got[name if k == main else f"{name}.{k}"] for k in fed}
        assert_matches(kind, result, x, rtol=1e-9, **opts)


# ---------------------------------------------------------------------------- PCA


def test_pca_from_cov():
    g = torch.Generator().manual_seed(7)
    z = torch.randn(5000, 3, generator=g, dtype=torch.float64) * torch.tensor([5.0, 2.0, 0.5], dtype=torch.float64)
    q, _ = torch.linalg.qr(torch.randn(3, 3, generator=g, dtype=torch.float64))
    x = (z @ q.T).float()
    cov = stream("cov", list(x.split(700))).result()
    ratio, comps = R.pca(cov)
    evals = torch.linalg.eigvalsh(torch.cov(x.double().T, correction=0)).flip(0)
    torch.testing.assert_close(ratio, evals / evals.sum(), rtol=1e-9, atol=1e-12)
    assert bool((ratio[:-1] >= ratio[1:]).all())
    torch.testing.assert_close(comps @ comps.T, torch.eye(3, dtype=torch.float64), rtol=0, atol=1e-10)
    # first component is the direction of largest variance (q's first column, up to sign)
    assert abs(float(comps[0] @ q[:, 0])) > 0.999
    r2, c2 = R.pca(cov["cov"], n_components=2)
    assert r2.shape == (2,) and c2.shape == (2, 3)
    with pytest.raises(ReductionError, match="square"):
        R.pca(torch.zeros(2, 3))


def test_pca_of_a_cov_reduction_without_rows_names_the_hook_point():
    from activationscope.capture.results import ReductionResults
    from activationscope.errors import ReductionNotFoundError

    empty = R.make_reduction("cov").result()
    assert "cov" not in empty and int(empty["count"]) == 0
    with pytest.raises(ReductionError, match=r"reduction 'cov' saw no rows \(count is 0\)"):
        R.pca(empty)
    with pytest.raises(ReductionError, match="reduction 'cov' of hook point 'enc.0.output' saw no rows"):
        R.pca(empty, hook_point="enc.0.output")
    stored = ReductionResults("enc.1.output", {"mean": torch.zeros(3), "cov.count": torch.tensor(0)})
    with pytest.raises(ReductionError, match="reduction 'cov' of hook point 'enc.1.output' saw no rows"):
        R.pca(stored)
    with pytest.raises(ReductionNotFoundError, match="hook point 'enc.2.output' has no reduction 'cov'"):
        R.pca(ReductionResults("enc.2.output", {"mean": torch.zeros(3), "mean.count": torch.tensor(5)}))
    with pytest.raises(ReductionError, match=r"got a mapping with keys \['mean'\]"):
        R.pca({"mean": torch.zeros(3)})


def test_pca_of_a_cov_with_nan_or_inf_is_a_reduction_error():
    """Rows with inf (masked attention scores) or NaN, or one row with ddof=1, make the
    covariance non-finite: the library's error naming the hook point and the cause, not
    torch's "ill-conditioned" LinAlgError."""
    from activationscope.capture.results import ReductionResults

    x = torch.randn(20, 3, generator=torch.Generator().manual_seed(0))
    x[4, 1] = -float("inf")
    with_inf = stream("cov", [x]).result()
    with pytest.raises(ReductionError, match=r"cov holds NaN or inf \(5 of 9 values\) \(count 20\)"):
        R.pca(with_inf)
    one_row = stream("cov", [x[:1]], ddof=1).result()
    with pytest.raises(ReductionError, match=r"\(count 1\).*no more rows than its ddof"):
        R.pca(one_row)
    stored = ReductionResults("blocks.0.attn.hook_attn_scores", {"cov": with_inf["cov"], "cov.count": torch.tensor(20)})
    with pytest.raises(ReductionError, match=r"cov of hook point 'blocks.0.attn.hook_attn_scores' holds NaN or inf"):
        R.pca(stored)
    x[4, 1] = 0.0
    ratio, _ = R.pca(stream("cov", [x]).result())
    assert bool(torch.isfinite(ratio).all())


@pytest.mark.parametrize("n_components", [0, -1, 4, 2.0, True])
def test_pca_n_components_out_of_range(n_components):
    from activationscope.errors import ArgumentValueError

    cov = stream("cov", [torch.randn(50, 3, generator=torch.Generator().manual_seed(0))]).result()
    with pytest.raises(ArgumentValueError, match=re.escape(f"n_components must be an int in 1..3, got {n_components!r}")):
        R.pca(cov, n_components=n_components)
    ratio, comps = R.pca(cov, n_components=3)
    assert ratio.shape == (3,) and comps.shape == (3, 3)


# ---------------------------------------------------------------------------- custom reductions


def running_max(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    m = x.amax(0)
    if acc is None:
        return m
    return torch.maximum(acc, m)


def sum_rows(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    s = x.sum(0)
    if acc is None:
        return s
    return acc + s


class SumWithMerge(torch.nn.Module):
    def forward(self, acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        s = x.double().sum(0)
        if acc is None:
            return s
        return acc + s

    @torch.jit.export
    def merge(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b


def _quiet_script(obj):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.script(obj)


def test_script_reduction_from_function_runs_natively():
    r = R.make_reduction(running_max)
    assert isinstance(r, R.Reduction) and r.kind == "script"
    x = torch.randn(30, 4)
    for b in x.split(7):
        r.update(b)
    assert torch.equal(r.result()["value"], x.amax(0))
    assert torch.equal(r.state()["acc"], x.amax(0))
    assert r.fresh().result() == {}


def test_script_reduction_from_scriptfunction_and_pt(tmp_path):
    x = torch.randn(12, 3)
    sf = _quiet_script(sum_rows)
    r = R.make_reduction(sf)
    r.update(x)
    torch.testing.assert_close(r.result()["value"], x.sum(0))

    path = R.script_reduction(sum_rows, tmp_path / "ship" / "sum_rows.pt")
    assert path.is_file()
    for spec in (path, str(path)):
        r = R.make_reduction(spec)
        r.update(x[:5])
        r.update(x[5:])
        torch.testing.assert_close(r.result()["value"], x.sum(0))
    (name, factory), = R.resolve_reductions([str(path)], "h")
    assert name == "sum_rows" and factory.script_path() == path


def test_script_reduction_preseeded_accumulator():
    init = torch.full((3,), 100.0)
    r = R.make_reduction(sum_rows, init=init)
    r.update(torch.ones(4, 3))
    assert r.result()["value"].tolist() == [104.0] * 3
    (name, f), = R.resolve_reductions([("total", sum_rows, {"init": init})], "layer.output")
    r = f()
    r.update(torch.ones(2, 3))
    assert name == "total" and r.result()["value"].tolist() == [102.0] * 3
    assert init.tolist() == [100.0] * 3  # the caller's tensor is untouched


def add_in_place(acc: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    acc += x.double().sum(0)
    return acc


_IN_PLACE_SCALE = 1.0  # a global Python float: TorchScript refuses it, so this one runs eagerly


def add_in_place_eager(acc, x):
    acc += x.double().sum(0) * _IN_PLACE_SCALE
    return acc


class AddInPlaceWithMerge(torch.nn.Module):
    def forward(self, acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if acc is None:
            return x.double().sum(0)
        acc += x.double().sum(0)
        return acc

    @torch.jit.export
    def merge(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a += b
        return a


@pytest.mark.parametrize("fn", [add_in_place, add_in_place_eager], ids=["script", "eager"])
def test_in_place_accumulator_is_each_reductions_own(fn):
    """A reduction that updates acc in place (`acc += ...`) with init=: each hook point's
    reduction has its own accumulator (init= is one tensor for all of them), the caller's init
    stays as it was, and results handed out earlier do not change."""
    init = torch.zeros(3, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", R.EagerFallbackWarning)
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
        x = torch.randn(4, 3)
        with torch.no_grad(), acs.ActivationScope(reductions=[("total", fn, {"init": init})]).track(model) as tracker:
            model(x)
            first = tracker.reductions["0.output"]["total"].clone()
            seen = tracker.reductions["0.output"]["total"]
            model(x)
    with torch.no_grad():
        h0 = model[0](x)
        h1 = model[1](h0)
    torch.testing.assert_close(tracker.reductions["0.output"]["total"], 2 * h0.double().sum(0))
    torch.testing.assert_close(tracker.reductions["1.output"]["total"], 2 * h1.double().sum(0))
    assert init.tolist() == [0.0, 0.0, 0.0]
    assert torch.equal(seen, first)  # the result read after the first forward stayed as it was


@pytest.mark.parametrize("fn", [add_in_place, add_in_place_eager], ids=["script", "eager"])
@pytest.mark.parametrize("given", ["init", "load_state"])
def test_an_in_place_accumulator_leaves_init_over_memory_the_caller_keeps_otherwise(fn, given):
    """init= (or a loaded state) over memory the caller keeps by other means than a tensor
    (torch.from_numpy of an array it holds, the tensor itself dropped): a TorchScript function
    updating its copy in place and returning it had the next batch's copy written into that
    memory (taken for an accumulator no longer in use), so the caller's array changed at the
    second batch. Now an accumulator that came from outside is never such memory."""
    import numpy as np

    array = np.full(3, 100.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", R.EagerFallbackWarning)
        if given == "init":
            r = R.make_reduction(fn, init=torch.from_numpy(array))
        else:
            r = R.make_reduction(fn, init=torch.zeros(3, dtype=torch.float64))
            r.load_state({"acc": torch.from_numpy(array)})
    batches = [torch.randn(n, 3) for n in (3, 4, 5, 1)]
    for x in batches:
        r.update(x)
    assert array.tolist() == [100.0] * 3
    torch.testing.assert_close(r.result()["value"], 100.0 + torch.cat(batches).double().sum(0))


def test_a_merge_in_place_leaves_a_loaded_state_over_memory_the_caller_keeps_otherwise():
    """A loaded state over memory the caller keeps by other means than a tensor (torch.from_numpy
    of an array it holds, the tensor itself dropped), merged by a rule that adds in place: the
    merge wrote into the caller's array (no use count showed it shared). Now it works on a copy."""
    import numpy as np

    array = np.full(3, 100.0)
    r = R.make_reduction(torch.jit.script(AddInPlaceWithMerge()))
    r.load_state({"acc": torch.from_numpy(array)})
    other = r.fresh()
    x = torch.randn(4, 3)
    other.update(x)
    r.merge(other)
    assert array.tolist() == [100.0] * 3
    torch.testing.assert_close(r.result()["value"], 100.0 + x.double().sum(0))


@pytest.mark.parametrize("fn", [add_in_place, add_in_place_eager], ids=["script", "eager"])
def test_in_place_accumulator_in_a_capture_mixing_inference_mode_and_not(fn):
    """The accumulator copied (or made) under torch.inference_mode is an inference tensor; the
    next batch outside it updates it in place, which torch refuses: it is a normal copy."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3))
    x = torch.randn(2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", R.EagerFallbackWarning)
        scope = acs.ActivationScope(reductions=[("total", fn, {"init": torch.zeros(3, dtype=torch.float64)})])
    with scope.track(model) as tracker:
        with torch.inference_mode():
            model(x)
        with torch.no_grad():
            model(x)
        with torch.inference_mode():
            model(x)
    with torch.no_grad():
        want = 3 * model(x).double().sum(0)
    torch.testing.assert_close(tracker.reductions["0.output"]["total"], want)


def test_a_custom_merge_that_fails_is_the_librarys_error_naming_the_reduction():
    """A scripted merge(a, b) that raises (accumulators of other shapes) gave torch's bare
    RuntimeError, naming no reduction; merge_states let it through as well."""
    sm = _quiet_script(SumWithMerge())
    a, b = R.make_reduction(sm), R.make_reduction(sm)
    a.update(torch.ones(2, 3))
    b.update(torch.ones(2, 4))
    with pytest.raises(CaptureError, match=r"merge of custom reduction 'SumWithMerge' failed on accumulators of "
                                           r"shapes \(3,\) and \(4,\)"):
        a.merge(b)
    assert a.result()["value"].tolist() == [2.0, 2.0, 2.0]  # left as it was
    with pytest.raises(ReductionError, match=r"merge of custom reduction 'SumWithMerge' failed"):
        R.merge_states(sm, [a.state(), b.state()])


def test_in_place_accumulator_state_and_merge_stay_apart():
    sm = _quiet_script(AddInPlaceWithMerge())
    a, b = R.make_reduction(sm), R.make_reduction(sm)
    a.update(torch.ones(2, 2))
    state = a.state()["acc"]
    a.update(torch.ones(3, 2))
    assert state.tolist() == [2.0, 2.0]  # state() taken earlier keeps its value
    b.update(torch.ones(1, 2))
    b_before = b.state()["acc"].clone()
    c = R.make_reduction(sm)
    c.merge(b)  # c adopts b's accumulator
    c.update(torch.ones(4, 2))
    assert torch.equal(b.state()["acc"], b_before)
    a.merge(b)
    assert a.result()["value"].tolist() == [6.0, 6.0] and torch.equal(b.state()["acc"], b_before)
    assert c.result()["value"].tolist() == [5.0, 5.0]


def test_unannotated_acc_needs_optional_or_init():
    def plain(acc, x):
        return x.sum(0) if acc is None else acc + x.sum(0)

    with pytest.raises(ReductionError, match="Optional"):
        R.make_reduction(plain)
    r = R.make_reduction(plain, init=torch.zeros(2))
    r.update(torch.ones(3, 2))
    assert r.result()["value"].tolist() == [3.0, 3.0]


def test_script_module_with_merge_and_plain_function_without():
    x = torch.randn(20, 2)
    sm = _quiet_script(SumWithMerge())
    a, b = R.make_reduction(sm), R.make_reduction(sm)
    a.update(x[:8])
    b.update(x[8:])
    a.merge(b)
    torch.testing.assert_close(a.result()["value"], x.double().sum(0))
    p, q = R.make_reduction(sum_rows), R.make_reduction(sum_rows)
    p.update(x)
    with pytest.raises(CaptureError, match="cannot merge.*merge\\(a: Tensor, b: Tensor\\)"):
        p.merge(q)
    with pytest.raises(CaptureError, match="cannot merge a 'mean'"):
        p.merge(R.make_reduction("mean"))


def test_script_reduction_error_names_the_function_or_the_file(tmp_path):
    """A function compiled here is named by its name (not the scratch .pt it was saved to); a
    .pt file the user gave, by its path."""
    def bad_shape(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return x.reshape(7, -1)

    r = R.make_reduction(bad_shape)
    with pytest.raises(CaptureError, match=r"custom reduction 'bad_shape' failed on rows of shape \(3, 2\) "
                                           r"\(torch\.float32\)"):
        r.update(torch.ones(3, 2))
    with pytest.raises(CaptureError, match=r"custom reduction 'bad_shape' failed"):
        r.fresh().update(torch.ones(3, 2))
    path = R.script_reduction(bad_shape, tmp_path / "mine.pt")
    with pytest.raises(CaptureError, match=r"custom reduction '.*mine\.pt' failed on rows of shape \(3, 2\)"):
        R.make_reduction(path).update(torch.ones(3, 2))


@pytest.mark.parametrize("fn", [lambda acc: acc, lambda acc, x, y: x, lambda *a: a[1]], ids=["one", "three", "varargs"])
def test_wrong_signature_is_reported(fn):
    with pytest.raises(ReductionError, match=r"'<lambda>' must have the signature \(acc: Optional\[Tensor\], x: Tensor\) -> Tensor"):
        R.make_reduction(fn)


def test_wrong_signature_of_named_function():
    def three(acc, x, extra):
        return x

    with pytest.raises(ReductionError, match="'three'.*three\\(acc, x, extra\\)"):
        R.resolve_reductions([three], "h")


def test_resolve_patterns_names_and_duplicates():
    specs = {"enc.*": ["mean", ("h", "hist", {"lo": -1, "hi": 1})], "*.output": [running_max], "dec.*": ["var"]}
    got = R.resolve_reductions(specs, "enc.0.output")
    assert [n for n, _ in got] == ["mean", "h", "running_max"]
    r = got[1][1]()
    r.update(torch.zeros(2, 2))
    assert r.result()["counts"].shape == (2, 64)
    assert R.resolve_reductions(specs, "other") == []
    assert [n for n, _ in R.resolve_reductions(["var", {"name": "v1", "spec": "var", "options": {"ddof": 1}}], "x")] == [
        "var", "v1"]
    with pytest.raises(ReductionError, match="two reductions named 'mean'"):
        R.resolve_reductions({"*": ["mean"], "enc.*": ["mean"]}, "enc.0")
    with pytest.raises(ReductionError, match="no usable name"):
        R.resolve_reductions([lambda acc, x: x], "h")
    with pytest.raises(ReductionError, match="lo < hi"):
        R.resolve_reductions([("h", "hist", {"lo": 1, "hi": 0})], "h")


def test_eager_fallback_warns_once_and_works():
    scale = 2  # a closed-over Python int: TorchScript cannot compile this

    def scaled_sum(acc, x):
        s = x.sum(0) * scale
        return s if acc is None else acc + s

    with pytest.warns(R.EagerFallbackWarning, match="'scaled_sum'.*eager Python") as rec:
        r = R.make_reduction(scaled_sum)
    assert len([w for w in rec if issubclass(w.category, R.EagerFallbackWarning)]) == 1
    assert isinstance(r, R.EagerReduction) and r.kind == "eager"
    x = torch.randn(9, 3)
    r.update(x[:4])
    r.update(x[4:4])
    r.update(x[4:], 4)
    torch.testing.assert_close(r.result()["value"], x.sum(0) * 2)
    resumed = r.fresh()
    resumed.load_state(r.state())
    torch.testing.assert_close(resumed.result()["value"], x.sum(0) * 2)
    with pytest.raises(ReductionError, match="cannot merge"):
        r.merge(resumed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second reduction of the same function: no new warning
        R.make_reduction(scaled_sum)


def test_eager_fallback_when_torchscript_is_unavailable(monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("TorchScript is not available in this build")

    monkeypatch.setattr(torch.jit, "script", boom)

    def count_rows(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        n = torch.tensor(float(x.shape[0]))
        return n if acc is None else acc + n

    with pytest.warns(R.EagerFallbackWarning, match="not available"):
        r = R.make_reduction(count_rows)
    r.update(torch.ones(3, 2))
    r.update(torch.ones(4, 2))
    assert r.result()["value"].item() == 7.0
    with pytest.raises(ReductionError, match="cannot be compiled"):
        R.script_reduction(count_rows, "unused.pt")


def test_eager_reduction_must_return_tensor():
    def not_tensor(acc, x):
        return [x for _ in range(2)]  # a comprehension over range: fine in Python, returns a list

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", R.EagerFallbackWarning)
        r = R.EagerReduction(not_tensor)
    with pytest.raises(ReductionError, match="must return a Tensor"):
        r.update(torch.ones(1, 1))


def test_no_deprecation_warning_escapes(tmp_path):
    def fresh_fn(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return x.sum(0) if acc is None else acc + x.sum(0)

    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")  # overrides pytest's filterwarnings for torch.jit
        r = R.make_reduction(fresh_fn)
        r.update(torch.ones(2, 2))
        path = R.script_reduction(fresh_fn, tmp_path / "f.pt")
        R.make_reduction(path).update(torch.ones(1, 2))
        R.resolve_reductions([("again", fresh_fn)], "h")
    leaked = [str(w.message) for w in rec if issubclass(w.category, DeprecationWarning)]
    assert leaked == []
    # and the check can fail: torch itself does warn when called directly (if this torch warns)
    with warnings.catch_warnings(record=True) as raw:
        warnings.simplefilter("always")
        torch.jit.script(fresh_fn)
    if not any(issubclass(w.category, DeprecationWarning) for w in raw):
        pytest.skip("this torch does not deprecate torch.jit; nothing to suppress")


def test_errors_are_activationscope_errors():
    assert issubclass(ReductionError, ActivationScopeError) and issubclass(ReductionError, ValueError)
    with pytest.raises(ReductionError, match="does not exist"):
        R.make_reduction("missing/dir/red.pt")


def test_a_name_and_options_tuple_says_where_the_options_go():
    # ("hist", {...}) was refused as "reduction must be a built-in name ..., got dict": the tuple is
    # (name, spec) and the options are its third entry
    for make in (lambda r: acs.ActivationScope(reductions=[r]), lambda r: acs.ActivationScope(reductions={"*": [r]})):
        with pytest.raises(ReductionError, match=re.escape(
                "a reduction tuple must be (name, spec) or (name, spec, {options}), got ('hist', {'lo': 0, 'hi': 1}): "
                "its second entry is the spec, not the options; write ('hist', 'hist', {'lo': 0, 'hi': 1}) for the "
                "built-in 'hist' with these options")):
            make(("hist", {"lo": 0, "hi": 1}))
        with pytest.raises(ReductionError, match=re.escape(
                "got ('mine', {'k': 3}): its second entry is the spec (a built-in name, a function or a .pt path), "
                "not the options; write (name, spec, {'k': 3})")):
            make(("mine", {"k": 3}))
    r = R.resolve_reductions([("hist", "hist", {"lo": 0, "hi": 1, "bins": 4})], "0.output")
    assert [name for name, _ in r] == ["hist"] and r[0][1]().options["bins"] == 4


@pytest.mark.parametrize("content, what", [
    ("state dict", r"It holds no TorchScript code: a file of torch\.save \(a tensor, a state dict, a pickled module\), "
                   r"not of torch\.jit\.save"),
    (b"not a program", r"It is no TorchScript file \(not a zip archive\)"),
    (b"", r"It is no TorchScript file \(not a zip archive\)"),
])
def test_a_pt_file_that_is_no_torchscript_is_named_without_torchs_stack(tmp_path, content, what):
    # the message held torch's C++ stack ("Exception raised from ... frame #0: c10::Error::Error") and
    # its advice about checkpoints, and no way to make a file that loads
    path = tmp_path / "red.pt"
    if content == "state dict":
        torch.save({"acc": torch.zeros(3)}, path)
    else:
        path.write_bytes(content)
    for make in (lambda: R.make_reduction(str(path)), lambda: acs.ActivationScope(reductions=[str(path)])):
        with pytest.raises(ReductionError) as e:
            make()
        text = str(e.value)
        assert re.search(rf"^custom reduction 'red': custom reduction file '{re.escape(str(path))}' could not be loaded "
                         rf"as TorchScript: PytorchStreamReader failed .*?\. {what}; save the reduction with "
                         r"script_reduction\(fn, path\) \(activationscope\.reductions\) or "
                         r"torch\.jit\.save\(torch\.jit\.script\(fn\), path\), or pass the function itself in "
                         r"reductions=$", text), text
        assert "Exception raised from" not in text and "c10::" not in text and "miniz" not in text


# ---------------------------------------------------------------------------- docs


def _doc_blocks() -> list[str]:
    text = (ROOT / "docs" / "usage" / "reductions.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_docs_examples_run(tmp_path, monkeypatch):
    """Run the doc's python blocks in order, from a real file (TorchScript reads the source)."""
    blocks = _doc_blocks()
    assert len(blocks) >= 4
    script = tmp_path / "reductions_doc.py"
    script.write_text("\n".join(f"# --- block {i}\n{b}" for i, b in enumerate(blocks)))
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        runpy.run_path(str(script), run_name="__docs__")


def test_validate_reductions_and_reductions_for():
    R.validate_reductions(None)
    R.validate_reductions(["mean", ("h", "hist", {"lo": 0, "hi": 1}), running_max])
    R.validate_reductions({"enc.*": ["var"], "*": ["mean"]})
    with pytest.raises(ReductionError, match="two reductions named 'var'"):
        R.validate_reductions(["var", "var"])
    with pytest.raises(ReductionError, match="list of specs"):
        R.validate_reductions("mean")
    with pytest.raises(ReductionError, match="patterns must be str"):
        R.validate_reductions({3: ["mean"]})
    with pytest.raises(ReductionError, match="did you mean 'topk'"):
        R.validate_reductions({"*": ["top_k"]})
    got = R.reductions_for({"enc.*": ["var", running_max]}, "enc.1")
    assert [n for n, _ in got] == ["var", "running_max"]
    assert all(isinstance(r, R.Reduction) for _, r in got)
    a, b = R.reductions_for(["mean"], "x")[0][1], R.reductions_for(["mean"], "x")[0][1]
    a.update(torch.ones(1, 2))
    assert int(b.result()["count"]) == 0  # fresh objects per call


# ---------------------------------------------------------------------------- native fast path
# Per-feature updates of contiguous CPU rows (float32/64, float16, bfloat16) of these kinds run
# plain C++ loops that fold into the state in place; everything else takes the ATen path. A
# non-contiguous view of the same values takes the ATen path, so the two can be compared.

FAST_KINDS = [("mean", {}), ("var", {}), ("std", {}), ("var", {"ddof": 1}), ("min", {}), ("max", {}),
              ("absmax", {}), ("l2", {}), ("nonzero", {})]


def _non_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The same values every other element of a buffer (not contiguous: the ATen path)."""
    y = torch.zeros(*x.shape, 2, dtype=x.dtype)[..., 0]
    y.copy_(x)
    assert not y.is_contiguous() and torch.equal(y.isnan(), x.isnan())
    assert torch.equal(y.nan_to_num(), x.nan_to_num())
    return y


def _special_data(n: int, feat: tuple, dtype: torch.dtype, seed: int) -> torch.Tensor:
    x = data(n, feat, torch.float64, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    flat = x.view(-1)
    pick = torch.randperm(flat.numel(), generator=g)
    flat[pick[:3]] = float("nan")
    flat[pick[3:5]] = float("inf")
    flat[pick[5:7]] = float("-inf")
    flat[pick[7:9]] = -0.0
    return x.to(dtype)


def _assert_same_results(a: dict, b: dict, exact: bool) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if exact or not a[k].dtype.is_floating_point:
            assert torch.equal(a[k].nan_to_num(), b[k].nan_to_num()), k
            assert torch.equal(a[k].isnan(), b[k].isnan()), k
        else:
            torch.testing.assert_close(a[k], b[k], rtol=1e-12, atol=1e-12, equal_nan=True, msg=k)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("feat", [(4, 3), (37,), (2, 40)], ids=str)
@pytest.mark.parametrize("kind,opts", FAST_KINDS, ids=[f"{k}{o or ''}" for k, o in FAST_KINDS])
@pytest.mark.parametrize("special", [False, True], ids=["finite", "nan_inf"])
def test_fast_path_equals_aten_path(kind, opts, feat, dtype, special):
    n = 45
    x = _special_data(n, feat, dtype, seed=11) if special else data(n, feat, dtype, seed=11)
    bounds = [0, 7, 8, 30, 30, n]
    fast = stream(kind, _pieces(x, bounds), **opts)
    slow = stream(kind, [_non_contiguous(p) for p in _pieces(x, bounds) if p.shape[0] > 0], **opts)
    _assert_same_results(fast.result(), slow.result(), exact=kind in ("min", "max", "absmax", "nonzero"))
    _assert_same_results(fast.state(), slow.state(), exact=kind in ("min", "max", "absmax", "nonzero"))
    if not special:
        assert_matches(kind, fast.result(), x, **opts)


@pytest.mark.parametrize("kind,opts", FAST_KINDS, ids=[f"{k}{o or ''}" for k, o in FAST_KINDS])
def test_fast_and_aten_updates_interleave(kind, opts):
    x = data(60, (20,), torch.float32, seed=12)
    r = R.make_reduction(kind, **opts)
    for i, p in enumerate(x.split(9)):
        r.update(p if i % 2 else _non_contiguous(p))
    assert_matches(kind, r.result(), x, **opts)
    other = stream(kind, [x[:25]], **opts)
    other.merge(stream(kind, [x[25:]], **opts))  # merged (ATen) state, then fast updates
    other.update(x[:10])
    assert_matches(kind, other.result(), torch.cat([x, x[:10]]), **opts)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fast_path_widens_every_half_value_exactly(dtype):
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    x = bits.view(dtype).reshape(1, -1)  # every bit pattern: subnormals, inf, NaN, -0
    want = x.to(torch.float64)
    for kind in ("max", "min"):
        got = stream(kind, [x]).result()[kind]
        assert torch.equal(got.isnan(), want.isnan()[0])
        assert torch.equal(got.nan_to_num(), want[0].nan_to_num())
        assert torch.equal(got.signbit(), want[0].signbit())
    mean = stream("mean", [torch.cat([x, x])]).result()["mean"]  # chunked conversion, 2 rows
    assert torch.equal(mean.nan_to_num(), want[0].nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fast_path_converts_in_chunks(dtype):
    x = data(3001, (7,), dtype, seed=13)  # more values than one conversion chunk, ragged end
    for kind, opts in FAST_KINDS:
        assert_matches(kind, stream(kind, list(x.split(1500)), **opts).result(), x, **opts)


def test_fast_path_large_offset_keeps_variance():
    g = torch.Generator().manual_seed(14)
    x = (1e6 + torch.randn(4000, 40, generator=g, dtype=torch.float64) * 0.25).to(torch.float32)
    got = stream("var", list(x.split(32))).result()["var"]
    torch.testing.assert_close(got, x.double().var(0, correction=0), rtol=1e-9, atol=0)


def test_fast_path_never_changes_handed_out_tensors():
    x = data(20, (5,), torch.float32, seed=15)
    for kind, opts in FAST_KINDS:
        r = stream(kind, [x[:10]], **opts)
        state, result = r.state(), r.result()
        keep_s = {k: v.clone() for k, v in state.items()}
        keep_r = {k: v.clone() for k, v in result.items()}
        r.update(x[10:])
        r.update(x[10:])
        for k in state:
            assert torch.equal(state[k].nan_to_num(), keep_s[k].nan_to_num()), (kind, k)
        for k in result:
            assert torch.equal(result[k].nan_to_num(), keep_r[k].nan_to_num()), (kind, k)
        assert_matches(kind, r.result(), torch.cat([x, x[10:]]), **opts)
        # a state given to load_state and a state adopted by a merge stay the caller's
        given = {k: v.clone() for k, v in stream(kind, [x[:10]], **opts).state().items()}
        before = {k: v.clone() for k, v in given.items()}
        loaded = R.make_reduction(kind, **opts)
        loaded.load_state(given)
        loaded.update(x[10:])
        assert all(torch.equal(given[k], before[k]) for k in given), kind
        src = stream(kind, [x[:10]], **opts)
        src_state = {k: v.clone() for k, v in src.state().items()}
        dst = R.make_reduction(kind, **opts)
        dst.merge(src)
        dst.update(x[10:])
        assert all(torch.equal(src.state()[k], src_state[k]) for k in src_state), kind
        assert_matches(kind, dst.result(), x, **opts)


# ---------------------------------------------------------------------------- fused updates
# A capture sink updates all reductions of a hook point together (_C.update_reductions):
# built-in moments and extrema then share their passes over the rows. The results must be
# those of separate updates, bit for bit (same summation order; extrema are exact).

FUSED_GROUPS = [
    ["mean", "var", "min", "max"],
    ["mean", "var", "std", "min", "max", "absmax", "l2", "nonzero"],
    ["max", "absmax"],
    ["var", ("hist", HIST), ("topk", {"k": 3}), "min", ("var", {"ddof": 1}), ("mean", {"per_feature": 0})],
]


def _make_group(group):
    out = []
    for g in group:
        kind, opts = (g, {}) if isinstance(g, str) else g
        out.append(R.make_reduction(kind, **opts))
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("special", [False, True], ids=["finite", "nan_inf"])
@pytest.mark.parametrize("group", FUSED_GROUPS, ids=["4", "8", "2", "mixed"])
def test_fused_update_equals_separate_updates(group, dtype, special):
    from activationscope.capture import _native

    C = _native.load()
    x = _special_data(45, (4, 9), dtype, seed=21) if special else data(45, (4, 9), dtype, seed=21)
    bounds = [0, 7, 8, 30, 30, 45]
    fused, separate = _make_group(group), _make_group(group)
    offset = 0
    for i, p in enumerate(_pieces(x, bounds)):
        p = _non_contiguous(p) if i == 2 and p.shape[0] else p  # one batch off the fast path
        C.update_reductions(fused, p, offset)
        for r in separate:
            r.update(p, offset)
        offset += p.shape[0]
    for a, b in zip(fused, separate):
        _assert_same_results(a.result(), b.result(), exact=True)
        _assert_same_results(a.state(), b.state(), exact=True)
    if not special:
        for g, r in zip(group, fused):
            kind, opts = (g, {}) if isinstance(g, str) else g
            assert_matches(kind, r.result(), x, **opts)


def test_fused_update_checks_feature_shape_and_keeps_handed_out_state():
    from activationscope.capture import _native

    C = _native.load()
    x = data(20, (5,), torch.float32, seed=22)
    group = _make_group(["mean", "var", "min", "max"])
    C.update_reductions(group, x[:10])
    before = [{k: v.clone() for k, v in r.state().items()} for r in group]
    handed = [r.state() for r in group]
    C.update_reductions(group, x[10:])
    for h, b in zip(handed, before):  # copy on write: earlier states unchanged
        assert all(torch.equal(h[k], b[k]) for k in b)
    with pytest.raises(ActivationScopeError, match=r"feature shape \(6,\) after \(5,\)"):
        C.update_reductions(group, torch.zeros(3, 6))
    for g, r in zip(["mean", "var", "min", "max"], group):
        assert_matches(g, r.result(), x)


@pytest.mark.parametrize("width", [8, 31, 32, 33, 48, 64, 95, 256])
@pytest.mark.parametrize("special", ["finite", "nan", "inf_minus_inf", "nan_state"])
def test_avx512_kernels_equal_the_avx2_kernels_bit_for_bit(width, special):
    """Where the CPU has AVX-512, the float32 sums, extrema and centred squares take 32 columns
    a block with it; switched off, the AVX2 kernels run. Both give the same states, bit for
    bit (no fused multiply-add in either), over blocks of 32, 16 and 8 columns and the last
    columns, with NaN, inf - inf and NaN states. (On a CPU without AVX-512 both runs take the
    AVX2 kernels.)"""
    from activationscope.capture import _native

    C = _native.load()
    g = torch.Generator().manual_seed(43)
    x = torch.randn(37, width, generator=g) * 3 + 1
    if special in ("nan", "nan_state"):
        x[30 if special == "nan" else 2, width - 1] = float("nan")
        x[11, 0] = float("nan")
    if special == "inf_minus_inf":
        x[3, 1], x[20, 1] = float("inf"), -float("inf")
        x[5, width // 2] = float("inf")
    split = [5, 32] if special == "nan_state" else [20, 17]
    kinds = ["mean", "var", "min", "max"]
    states = []
    try:
        for on in (True, False):
            C._set_avx512_kernels(on)
            group = _make_group(kinds)
            offset = 0
            for p in x.split(split):
                C.update_reductions(group, p.contiguous(), offset)
                offset += p.shape[0]
            states.append([r.state() for r in group])
    finally:
        C._set_avx512_kernels(True)
    for a, b in zip(*states):
        for k, v in a.items():
            assert torch.equal(v.view(torch.int64), b[k].view(torch.int64)), (k, special, width)
    if special == "finite":
        got = _make_group(kinds)
        C.update_reductions(got, x)
        for kind, r in zip(kinds, got):
            assert_matches(kind, r.result(), x)


def test_streaming_fold_of_means_equals_the_merge_bit_for_bit():
    """The fast path folds each batch's column means and centred squares into the state in
    place (Chan et al.: delta * nb / n where both means are finite, the weighted sum where one
    is +-inf or NaN); merging the same batches' states (the ATen path) gives the same bits,
    over 4-column blocks and the columns after them."""
    from activationscope.capture import _native

    C = _native.load()
    g = torch.Generator().manual_seed(44)
    a = torch.randn(5, 37, generator=g, dtype=torch.float64) * 1e3
    b = torch.randn(7, 37, generator=g, dtype=torch.float64) + 2
    a[0, 1] = float("inf")  # an infinite mean on one side
    a[1, 2], b[3, 2] = float("inf"), -float("inf")  # +inf with -inf: NaN
    b[2, 3] = float("nan")
    a[2, 36] = float("inf")  # in the last column (after the 4-column blocks)
    for kinds in (["mean", "var"], ["var", "min"]):
        streamed = _make_group(kinds)
        C.update_reductions(streamed, a)
        C.update_reductions(streamed, b)
        merged, other = _make_group(kinds), _make_group(kinds)
        C.update_reductions(merged, a)
        C.update_reductions(other, b)
        for m, o in zip(merged, other):
            m.merge(o)
        for kind, s_, m in zip(kinds, streamed, merged):
            for k, v in s_.state().items():
                if kind == "min":  # (which NaN's payload a minimum keeps is IEEE's open choice)
                    torch.testing.assert_close(v, m.state()[k], rtol=0, atol=0, equal_nan=True)
                else:
                    assert torch.equal(v.view(torch.int64), m.state()[k].view(torch.int64)), (kinds, k)
        mean = streamed[kinds.index("var")].state()["mean"]
        assert mean[1] == float("inf") and mean[2].isnan() and mean[3].isnan() and mean[36] == float("inf")


def test_missing_reduction_name_is_a_clear_error(tmp_path):
    """tracker.reductions[hp][name] and store.reductions[hp][name] with a name that is not
    there: ReductionNotFoundError (a KeyError) naming the hook point and the names there are."""
    import pickle

    import activationscope as acs
    from activationscope.errors import ReductionNotFoundError

    model = torch.nn.Sequential(torch.nn.Linear(3, 4)).eval()
    with acs.ActivationScope(reductions=["mean", "max"], store=str(tmp_path / "s.zarr")).track(model) as tr:
        with torch.no_grad():
            model(torch.randn(5, 3))
        live = tr.reductions["0.output"]
    stored = acs.open_store(tmp_path / "s.zarr").reductions["0.output"]
    for got in (live, stored):
        assert torch.allclose(got["mean"].float(), live["mean"].float())
        with pytest.raises(ReductionNotFoundError, match=r"hook point '0.output' has no reduction 'var'; its reductions: \[.*'max'.*'mean'"):
            got["var"]
        with pytest.raises(KeyError):
            got["var"]
        assert got.get("var") is None and "var" not in got
        again = pickle.loads(pickle.dumps(got))  # (an OrderedDict of the same items: torch.load reads it)
        assert list(again) == list(got) and all(torch.equal(again[k], got[k]) for k in got)
    from activationscope.errors import HookPointNotFoundError

    for reds in (tr.reductions, acs.open_store(tmp_path / "s.zarr").reductions):
        with pytest.raises(HookPointNotFoundError, match=r"hook point 'nope.output' has no reductions( in this store)?; hook points with reductions: \['0.output'\]"):
            reds["nope.output"]


def test_saved_reductions_load_with_torch_load_weights_only(tmp_path):
    """torch.save(tracker.reductions) and torch.save(store.reductions) write OrderedDicts of
    OrderedDicts of tensors, which torch.load reads back with its default weights_only=True."""
    import activationscope as acs

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU()).eval()
    x = torch.randn(5, 3)
    with acs.ActivationScope(reductions=["mean", "max"], store=str(tmp_path / "s.zarr")).track(model) as tr:
        with torch.no_grad():
            model(x)
        live = tr.reductions
    store = acs.open_store(tmp_path / "s.zarr")
    with torch.no_grad():
        want = {"0.output": model[0](x), "1.output": model(x)}
    for i, reds in enumerate((live, store.reductions)):
        torch.save(reds, tmp_path / f"r{i}.pt")
        got = torch.load(tmp_path / f"r{i}.pt", weights_only=True)
        assert list(got) == ["0.output", "1.output"]
        for hp, acts in want.items():
            assert sorted(got[hp]) == ["max", "max.count", "mean", "mean.count"]
            torch.testing.assert_close(got[hp]["mean"], acts.double().mean(0))
            torch.testing.assert_close(got[hp]["max"], acts.double().amax(0), rtol=0, atol=0)
            assert int(got[hp]["mean.count"]) == 5
    store.close()


@pytest.mark.parametrize("kind", ["mean", "var", "std", "cov"])
def test_infinite_values_stay_infinite_across_batches(kind):
    """A column whose only non-finite value is -inf (or +inf) has mean -inf (+inf), as
    torch.mean over all values, whichever batch holds it and whichever path (fast, ATen,
    fused, merge) folds it in; +inf with -inf, or NaN, gives NaN."""
    from activationscope.capture import _native

    C = _native.load()
    inf = float("inf")
    cols = torch.tensor([[1.0, inf, 1.0, 1.0], [-inf, 2.0, inf, float("nan")], [2.0, 3.0, -inf, 4.0]])
    want = cols.double().mean(0)
    for split in ([1, 2], [2, 1], [1, 1, 1]):
        for r in _every_update_path(C, kind, list(cols.split(split))):
            got = r.result()["mean"]
            assert torch.equal(got.isnan(), want.isnan()), (split, got)
            assert torch.equal(got.nan_to_num(), want.nan_to_num()), (split, got)


def _every_update_path(C, kind, parts):
    """A ``kind`` reduction fed ``parts`` on each update path: the fast one (contiguous
    batches), the ATen one (non-contiguous), fused with another reduction, and merged."""
    fast = stream(kind, parts)
    slow = stream(kind, [_non_contiguous(p) for p in parts])
    fused = [R.make_reduction(kind), R.make_reduction("max")]
    for p in parts:
        C.update_reductions(fused, p)
    merged = stream(kind, parts[:1])
    merged.merge(stream(kind, parts[1:]))
    return fast, slow, fused[0], merged


@pytest.mark.parametrize("kind", ["mean", "var", "std", "cov"])
def test_finite_means_whose_difference_overflows_merge_to_a_finite_mean(kind):
    """float64 batch means of opposite signs near the float64 limit (+-1e308): their difference
    overflows, so Chan's update mean_a + (mean_b - mean_a) * w gave -inf; the mean of the rows
    is finite (as torch.mean over them says), on every path (fast, ATen, fused, merge)."""
    from activationscope.capture import _native

    C = _native.load()
    cols = torch.tensor([[1e308, 1.5e308, -1e308, 2.0, 1e308], [-1e308, -1.6e308, 1e308, 4.0, -1e308]],
                        dtype=torch.float64)  # 5 columns: the 4-wide kernel and its scalar tail
    want = cols.mean(0)
    assert bool(torch.isfinite(want).all())
    for r in _every_update_path(C, kind, list(cols.split(1))):
        torch.testing.assert_close(r.result()["mean"], want, rtol=1e-15, atol=1e292)


# ---------------------------------------------------------------------------- patterns


class _Named(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.d = torch.nn.ModuleDict({"a[1]": torch.nn.Linear(3, 2), "b": torch.nn.Linear(3, 2)})

    def forward(self, x):
        return self.d["a[1]"](x) + self.d["b"](x)


@pytest.mark.parametrize("pattern", ["d.a[1]", "d.nothing.output", "*.input.0"])
def test_a_reductions_pattern_that_selects_no_hook_point_raises(pattern):
    """As include= with a pattern that matches no module: HookPointNotFoundError naming the
    pattern and the hook points there are, at the end of the first captured forward."""
    torch.manual_seed(0)
    model = _Named()
    tr = acs.ActivationScope(reductions={"d.*": ["max"], pattern: ["mean"]}).track(model)
    with pytest.raises(acs.HookPointNotFoundError) as e, tr:
        model(torch.randn(4, 3))
    msg = str(e.value)
    assert f"reductions= pattern {pattern!r} selects no hook point" in msg
    assert "['d.a[1].output', 'd.b.output']" in msg and isinstance(e.value, KeyError)


def test_a_reductions_pattern_for_a_hook_point_reached_in_a_later_forward_is_accepted():
    """A branch first reached in the second forward: its pattern is not refused at the end of
    the first, and its reduction covers the rows it got."""
    from acs_testing import LateBranch

    model, xs = LateBranch(), [torch.randn(3, 4) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # b.output does not follow the row table: warned elsewhere
        with torch.no_grad(), acs.ActivationScope(reductions={"b.output": ["mean"]}).track(model) as tr:
            model(xs[0], extra=False)
            model(xs[1])
            model(xs[2])
    with torch.no_grad():
        ref = torch.cat([model.b(model.a(x)) for x in xs[1:]]).double().mean(0)
    torch.testing.assert_close(tr.reductions["b.output"]["mean"], ref)


def test_reductions_patterns_that_each_select_a_hook_point_are_accepted():
    torch.manual_seed(0)
    model, x = _Named(), torch.randn(4, 3)
    with acs.ActivationScope(reductions={"d.a[1].output": ["mean"], "*.b.*": ["max"]}).track(model) as tr:
        model(x)
    with torch.no_grad():
        torch.testing.assert_close(tr.reductions["d.a[1].output"]["mean"], model.d["a[1]"](x).double().mean(0))
        torch.testing.assert_close(tr.reductions["d.b.output"]["max"], model.d["b"](x).double().max(0).values)


def test_a_reductions_pattern_that_selects_nothing_stores_nothing(tmp_path):
    torch.manual_seed(0)
    model, path = _Named(), tmp_path / "s.zarr"
    with pytest.raises(acs.HookPointNotFoundError, match="'d.a\\[1\\]' selects no hook point.*no row of this run"):
        with acs.ActivationScope(store=path, reductions={"d.a[1]": ["mean"]}).track(model):
            model(torch.randn(4, 3))
            model(torch.randn(4, 3))
    store = acs.open_store(path)
    assert store.status == "incomplete" and store.n_samples == 0 and store.reductions == {}
    assert all(store.n_rows(hp) == 0 for hp in store.hook_points)


def test_a_batch_one_reduction_refuses_updates_none_of_the_group(tmp_path):
    """Every reduction of a hook point checks a batch before any is updated: a custom one
    listed first keeps its state when a per-feature one after it refuses the rows."""
    from activationscope.capture import _native

    C = _native.load()
    path = R.script_reduction(sum_rows, tmp_path / "sum_rows.pt")
    group = [R.make_reduction(path), *_make_group(["mean", ("hist", {"lo": -1, "hi": 1}), "max"])]
    x = torch.randn(8, 3)
    C.update_reductions(group, x)
    before = [{k: v.clone() for k, v in r.state().items()} for r in group]
    with pytest.raises(ActivationScopeError, match=r"feature shape \(4,\) after \(3,\)"):
        C.update_reductions(group, torch.ones(2, 4))
    for r, b in zip(group, before):
        st = r.state()
        assert st.keys() == b.keys() and all(torch.equal(st[k], b[k]) for k in b)
    torch.testing.assert_close(group[0].result()["value"], x.sum(0))


@pytest.mark.parametrize("mode", ["SNAPSHOT", "REFERENCE"])
def test_a_forward_its_reductions_refuse_keeps_no_record_in_memory(mode):
    """A hook point whose reduction refuses a forward's rows keeps no record of that forward
    (the error is raised before anything of the call is kept), so records and reductions
    still cover the same forwards when the caller catches the error and goes on."""
    import activationscope as acs

    model = torch.nn.Sequential(torch.nn.Identity()).eval()
    scope = acs.ActivationScope(capture="output", capture_mode=getattr(acs.CaptureMode, mode),
                                reductions=["mean", "max"])
    a, b, c = torch.randn(4, 3), torch.randn(2, 3), torch.ones(2, 5)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="raised and the exception was caught"):
        with scope.track(model) as tr:
            model(a)
            with pytest.raises(ActivationScopeError, match=r"feature shape \(5,\) after \(3,\)"):
                model(c)
            model(b)
    recs = tr.activations["0.output"]
    assert len(recs) == 2 and torch.equal(recs[0], a) and torch.equal(recs[1], b)
    both = torch.cat([a, b]).double()
    torch.testing.assert_close(tr.reductions["0.output"]["mean"], both.mean(0))
    torch.testing.assert_close(tr.reductions["0.output"]["max"], both.amax(0))


def test_the_same_rows_handed_to_two_groups_give_each_its_own_exact_statistics():
    """The batch statistics of the last rows are used again for the very same rows (same
    storage, unchanged version): an in-place change, or new rows at the freed address, are
    computed afresh."""
    from activationscope.capture import _native

    C = _native.load()
    kinds = ["mean", "var", "min", "max", "absmax"]
    g1, g2, g3 = _make_group(kinds), _make_group(kinds), _make_group(kinds)
    x = data(20, (6,), torch.float32, seed=3)
    C.update_reductions(g1, x)
    C.update_reductions(g2, x)  # the same rows: reused
    for g in (g1, g2):
        for k, r in zip(kinds, g):
            assert_matches(k, r.result(), x)
    first = x.clone()
    x.mul_(-2)  # changed in place: its version moved
    C.update_reductions(g1, x)
    for k, r in zip(kinds, g1):
        assert_matches(k, r.result(), torch.cat([first, x]))
    del x
    y = data(20, (6,), torch.float32, seed=4)  # often at the freed address, with version 0
    C.update_reductions(g3, y)
    for k, r in zip(kinds, g3):
        assert_matches(k, r.result(), y)


def test_hook_points_sharing_a_tensor_reduce_exactly_with_an_in_place_change_between():
    """capture="both" on a chain hands each layer's output to the next layer's input hook
    point (the same tensor); an in-place ReLU changes it between two hook points. Every hook
    point's reductions equal a float64 reference over its own values."""
    import activationscope as acs

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.ReLU(inplace=True),
                                torch.nn.Linear(8, 8)).eval()
    xs = [torch.randn(5, 8) for _ in range(3)]
    kinds = ["mean", "var", "min", "max", "absmax"]
    for policy in (acs.ReductionPolicy.STREAMING, acs.ReductionPolicy.STORE_ALL):
        scope = acs.ActivationScope(capture="both", reductions=kinds, reduction_policy=policy)
        with torch.no_grad(), scope.track(model) as tr:
            for x in xs:
                model(x)
        want: dict[str, list[torch.Tensor]] = {}
        with torch.no_grad():
            for x in xs:
                h = x
                for i, layer in enumerate(model):
                    want.setdefault(f"{i}.input.0", []).append(h.clone())
                    h = layer(h)
                    want.setdefault(f"{i}.output", []).append(h.clone())
        assert set(tr.reductions) == set(want)
        for hp, parts in want.items():
            a = torch.cat(parts).double()
            ref = {"mean": a.mean(0), "var": a.var(0, unbiased=False), "min": a.amin(0), "max": a.amax(0),
                   "absmax": a.abs().amax(0)}
            for k in kinds:
                torch.testing.assert_close(tr.reductions[hp][k], ref[k], rtol=1e-10, atol=1e-12, msg=f"{hp} {k}")


def test_a_write_that_bypasses_the_version_counter_is_still_reduced_exactly():
    """A module that changes its input through numpy (no version bump) hands the next hook
    point other values than the last: each hook point's statistics are of its own values."""
    import activationscope as acs

    class Negate(torch.nn.Module):
        def forward(self, x):
            x.numpy()[:] *= -3
            return x

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Negate()).eval()
    x = torch.randn(8, 4)
    scope = acs.ActivationScope(capture="both", reductions=["max", "min"],
                                reduction_policy=acs.ReductionPolicy.STREAMING)
    with torch.no_grad():
        before = model[0](x)
    with torch.no_grad(), scope.track(model) as tr:
        out = model(x)
    torch.testing.assert_close(tr.reductions["1.output"]["max"], out.double().amax(0))
    torch.testing.assert_close(tr.reductions["1.output"]["min"], out.double().amin(0))
    torch.testing.assert_close(tr.reductions["0.output"]["max"], before.double().amax(0))


def test_fused_min_max_keep_a_nan_seen_in_any_row_of_a_block():
    """The fused sums / extrema pass over float32 rows (blocks of 8 columns in registers, and the
    columns after the last block): a NaN in a column's first, middle or last row, in any batch,
    makes that column's min and max NaN; the other columns keep their exact extrema and sums."""
    from activationscope.capture import _native

    C = _native.load()
    g = torch.Generator().manual_seed(31)
    x = torch.randn(40, 27, generator=g)
    x[0, 3] = x[17, 10] = x[39, 26] = x[21, 8] = float("nan")  # first / middle / last row, block and tail columns
    x[5, 4], x[6, 12] = float("inf"), -float("inf")
    x[7, 0], x[8, 1] = -0.0, 0.0
    want_min = torch.where(x.isnan().any(0), float("nan"), x.double().nan_to_num(nan=float("inf")).amin(0))
    want_max = torch.where(x.isnan().any(0), float("nan"), x.double().nan_to_num(nan=-float("inf")).amax(0))
    want_sum = x.double().sum(0)
    for split in ([40], [1, 39], [20, 20], [17, 5, 18]):
        group = _make_group(["mean", "min", "max"])
        offset = 0
        for p in x.split(split):
            C.update_reductions(group, p, offset)
            offset += p.shape[0]
        mn, mx = group[1].result()["min"], group[2].result()["max"]
        assert torch.equal(mn.isnan(), want_min.isnan()) and torch.equal(mx.isnan(), want_max.isnan()), split
        assert torch.equal(mn.nan_to_num(), want_min.nan_to_num()), split
        assert torch.equal(mx.nan_to_num(), want_max.nan_to_num()), split
        mean = group[0].result()["mean"]
        finite = ~x.isnan().any(0) & ~x.isinf().any(0)
        torch.testing.assert_close(mean[finite], (want_sum / 40)[finite], rtol=1e-15, atol=1e-15)
        assert mean[~finite & ~x.isnan().any(0)].isinf().all(), split


@pytest.mark.parametrize("width", [3, 8, 27])
def test_fused_min_max_keep_the_last_nan_bit_for_bit(width):
    """A column that saw NaNs ends as the last one it saw, sign and payload, in the fused pass
    (8-column blocks and the columns after them) as in the separate updates."""
    import struct

    from activationscope.capture import _native

    C = _native.load()
    nan = lambda bits: struct.unpack("f", struct.pack("I", bits))[0]  # noqa: E731
    x = torch.randn(9, width, generator=torch.Generator().manual_seed(32))
    x[2, 0], x[6, 0] = nan(0xFFC00000), nan(0x7FC00123)  # -NaN then a NaN with a payload: the last stays
    x[4, width - 1] = nan(0xFFC00001)
    for split in ([9], [3, 6], [7, 2]):
        fused, separate = _make_group(["mean", "min", "max"]), _make_group(["mean", "min", "max"])
        offset = 0
        for p in x.split(split):
            C.update_reductions(fused, p, offset)
            for r in separate:
                r.update(p, offset)
            offset += p.shape[0]
        for a, b in zip(fused[1:], separate[1:]):
            for k in a.result():
                got, want = a.result()[k], b.result()[k]
                assert torch.equal(got.view(torch.int64), want.view(torch.int64)), (split, k)
        assert fused[1].result()["min"][0].view(torch.int64) == torch.tensor(nan(0x7FC00123), dtype=torch.float64).view(torch.int64)


@pytest.mark.parametrize("width", [16, 17, 40, 256])
@pytest.mark.parametrize("special", ["finite", "nan_late_block", "inf_minus_inf", "nan_state"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_float32_rows_reduce_as_the_same_rows_in_float64_bit_for_bit(width, special, dtype):
    """The float32 kernels (blocks of 16 columns without NaN bookkeeping, redone exactly when
    a block's sums end NaN; centred squares 16 columns at a time) widen each value to double
    and add in row order: their states equal, bit for bit, those of the same rows given as
    float64 (the generic loops), whatever NaN, inf - inf or NaN state a block holds; so do
    float16 / bfloat16 rows, widened to float32 a chunk of rows at a time (300 rows: several
    chunks) and then reduced by the float32 kernels. (With
    several NaNs in one column, which NaN's payload a sum keeps is left open by IEEE 754 and
    may differ between the two; the columns here hold one NaN each.)"""
    from activationscope.capture import _native

    C = _native.load()
    g = torch.Generator().manual_seed(41)
    x = torch.randn(300, width, generator=g) * 3
    if special == "nan_late_block" or special == "nan_state":
        x[30 if special == "nan_late_block" else 2, width - 1] = float("nan")  # the last block only
    if special == "inf_minus_inf":
        x[3, 1], x[20, 1] = float("inf"), -float("inf")  # sum NaN without a NaN value
        x[5, width // 2] = float("inf")
    kinds = ["mean", "var", "min", "max"]
    x = x.to(dtype)
    split = [5, 295] if special == "nan_state" else [300]  # nan_state: the second batch starts from NaN min / max
    got, want = _make_group(kinds), _make_group(kinds)
    offset = 0
    for p in x.split(split):
        C.update_reductions(got, p, offset)
        C.update_reductions(want, p.double(), offset)
        offset += p.shape[0]
    for a, b in zip(got, want):
        for k, v in a.state().items():
            assert torch.equal(v.view(torch.int64), b.state()[k].view(torch.int64)), (k, special)
    if special == "finite":
        assert_matches("var", got[1].result(), x)


@pytest.mark.parametrize("name", ["../../escape", "a/b", "a\\b", "..", ".", "zarr.json", "Zarr.JSON"])
def test_a_reduction_name_that_is_not_one_store_node_is_refused_before_any_capture(name, tmp_path):
    """A name names the arrays reductions/<hook point>/<name>: one that is not a node name is
    refused when the scope is made, not at the end of the capture (where it failed, with the
    rows of the capture lost and the store still locked)."""
    with pytest.raises(ReductionError, match=r"reduction name must be a non-empty str.*got " + re.escape(repr(name))):
        acs.ActivationScope(reductions=[(name, "mean")], store=str(tmp_path / "s.zarr"))
    assert not (tmp_path / "escape").exists() and not (tmp_path / "s.zarr").exists()


@pytest.mark.parametrize("specs, match", [
    ([("Mean", "mean"), ("mean", "max")], r"reductions named 'Mean' and 'mean', which differ only in case"),
    ([("e\u0301", "mean"), ("\u00e9", "max")], r"\(written 'e\\u0301' and '\\xe9'\), which differ only in case"),
    (["var", ("VAR.mean", "max")], r"reductions named 'var' and 'VAR.mean'.*on a file system that does not tell"),
])
def test_reductions_whose_names_differ_only_in_case_are_refused(specs, match, tmp_path):
    """'Mean' and 'mean' are two files on Linux but one on macOS or Windows (a store copied
    there read one reduction as the other's): refused when the scope is made, naming both."""
    with pytest.raises(ReductionError, match=match):
        acs.ActivationScope(reductions=specs, store=str(tmp_path / "s.zarr"))
    assert not (tmp_path / "s.zarr").exists()


@pytest.mark.parametrize("specs", [["var", ("var.mean", "max")], [("topk.values", "mean"), ("topk", "topk")],
                                   ["mean", ("mean.state.m2", "max")], {"*": ["std"], "0.*": [("std.count", "min")]}])
def test_reductions_whose_arrays_overlap_are_refused(specs, tmp_path):
    """'var' stores 'var.mean' and 'var.count': a reduction named 'var.mean' silently replaced
    var's mean in the store (and in tracker.reductions) with its own result."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4)).eval()
    with pytest.raises(ActivationScopeError, match=r"has reductions named '(var|topk|mean|std)' and '\1\.[a-z.0-9]+'.*rename one"):
        scope = acs.ActivationScope(reductions=specs, store=str(tmp_path / "s.zarr"))
        with torch.no_grad(), scope.track(model):
            model(torch.randn(5, 3))
    # names that merely contain a dot, without overlap, are fine
    x = torch.randn(6, 3)
    scope = acs.ActivationScope(reductions=["var", ("var2.max", "max")], store=str(tmp_path / "ok.zarr"))
    with torch.no_grad(), scope.track(model):
        y = model(x)
    got = acs.open_store(tmp_path / "ok.zarr").reductions["0.output"]
    torch.testing.assert_close(got["var.mean"], y.double().mean(0))
    torch.testing.assert_close(got["var2.max"], y.double().amax(0))


def to_sparse(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return x.sum(0).to_sparse()  # (of one shape for every batch: an accumulator keeps its shape)


def on_meta(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape[1:], device="meta")


@pytest.mark.parametrize("fn, what", [(to_sparse, "a sparse_coo tensor"), (on_meta, "on the meta device")])
def test_a_result_a_store_cannot_hold_is_an_error_that_keeps_the_rows_and_frees_the_store(fn, what, tmp_path):
    """A custom reduction's result that a store cannot hold (sparse, meta) raised torch's own
    error at the close, with nothing committed and the writer still holding the store's lock
    (a new capture into it in this process was refused with StoreLockedError)."""
    path = str(tmp_path / "s.zarr")
    model = torch.nn.Sequential(torch.nn.Linear(3, 4)).eval()
    xs = [torch.randn(n, 3) for n in (5, 2, 4)]
    with pytest.raises(acs.StoreError, match=rf"reduction '{fn.__name__}' of hook point '0.output': result 'value' is {what}"):
        with torch.no_grad(), acs.ActivationScope(reductions=["mean", fn], store=path).track(model):
            ys = [model(x) for x in xs]
    y = torch.cat(ys)
    stored = acs.open_store(path)
    assert stored.attrs["status"] == "incomplete"
    torch.testing.assert_close(stored["0.output"], y)
    # the store is free: a resume computes the reductions over the stored rows
    with torch.no_grad(), acs.ActivationScope(reductions=["mean", ("max", "max")], store=path,
                                              store_options={"resume": True}).track(model) as tr:
        assert tr.resume_from == 11
    got = acs.open_store(path)
    assert got.attrs["status"] == "complete"
    torch.testing.assert_close(got.reductions["0.output"]["mean"], y.double().mean(0))
    torch.testing.assert_close(got.reductions["0.output"]["max"], y.double().amax(0))


class _ReturnsInt(torch.nn.Module):
    def forward(self, acc: Optional[torch.Tensor], x: torch.Tensor) -> int:
        return 3


class _ReturnsOptional(torch.nn.Module):
    def forward(self, acc: Optional[torch.Tensor], x: torch.Tensor) -> Optional[torch.Tensor]:
        return None


class _AccNotOptional(torch.nn.Module):
    def forward(self, acc: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return acc + x.sum(0)


class _MergeOneArgument(torch.nn.Module):
    def forward(self, acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return x.sum(0)

    @torch.jit.export
    def merge(self, a: torch.Tensor) -> torch.Tensor:
        return a


@pytest.mark.parametrize("module, match", [
    (_ReturnsInt, r"'bad' must have the signature \(acc: Optional\[Tensor\], x: Tensor\) -> Tensor, got forward\(.*\) -> int"),
    (_ReturnsOptional, r"'bad' must have the signature .* -> Tensor\?"),
    (_AccNotOptional, r"'bad' must annotate its first parameter as Optional\[torch.Tensor\]"),
    (_MergeOneArgument, r"'bad' must have the signature merge\(a: Tensor, b: Tensor\) -> Tensor, got merge\("),
])
def test_a_pt_file_with_another_signature_is_refused_when_the_reduction_is_made(module, match, tmp_path):
    """The native load checked the number of arguments only: a .pt returning no Tensor, or
    whose acc cannot be None, or with a merge of another signature, was accepted and failed
    at the first captured batch (CaptureError, also for a bare update) or the first merge
    (torch's RuntimeError); a function or scripted object is checked up front."""
    path = tmp_path / "bad.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(module())
        torch.jit.save(scripted, str(path))
    with pytest.raises(ReductionError, match=match):
        R.make_reduction(path)
    with pytest.raises(ReductionError, match=match.replace("'bad'", "'[A-Za-z_]+'")):
        R.make_reduction(scripted)
    with pytest.raises(ReductionError, match=match):
        acs.ActivationScope(reductions=[str(path)])
    if module is _AccNotOptional:  # an initial accumulator makes it valid
        r = R.make_reduction(path, init=torch.zeros(2))
        r.update(torch.ones(3, 2))
        torch.testing.assert_close(r.result()["value"], torch.full((2,), 3.0))


def raises_on_two_rows(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    if x.shape[0] == 2:
        raise RuntimeError("refused")
    s = x.double().sum(0)
    return s if acc is None else acc + s


_SUM_SCALE = 1.0  # a global Python float: TorchScript refuses it, so this one runs eagerly


def eager_sum_in_place(acc, x):
    s = x.double().sum(0) * _SUM_SCALE
    if acc is None:
        return s
    acc += s
    return acc


class _TimesHundredOnTwoRows(torch.nn.Module):
    def forward(self, x):
        return x * (100.0 if x.shape[0] == 2 else 1.0)


def add_then_refuse(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    s = x.double().sum(0)
    if acc is None:
        return s
    acc += s
    if x.shape[0] == 2:
        raise RuntimeError("refused after the update")
    return acc


def add_then_refuse_eager(acc, x):
    s = x.double().sum(0) * _SUM_SCALE
    if acc is None:
        return s
    acc += s
    if x.shape[0] == 2:
        raise RuntimeError("refused after the update")
    return acc


def _update_refusing_size_2(r, sizes):
    """``r.update`` with a random (n, 3) batch of each size, the function refusing (raising
    after its update) each batch of 2 rows; the float64 sum of the batches it kept, (3,)."""
    batches = [torch.randn(n, 3) for n in sizes]
    for x in batches:
        if x.shape[0] == 2:
            with pytest.raises(CaptureError, match="refused after the update"):
                r.update(x)
        else:
            r.update(x)
    return torch.cat([x for x in batches if x.shape[0] != 2]).double().sum(0)


@pytest.mark.parametrize("fn", [add_then_refuse, add_then_refuse_eager], ids=["script", "eager"])
@pytest.mark.parametrize("sizes", [(3, 5, 2, 4), (3, 2, 5, 4)], ids=["later", "first-in-place"])
def test_a_custom_reduction_that_updates_in_place_then_raises_keeps_its_accumulator(fn, sizes):
    """A function that adds the batch to acc in place and then raises: its accumulator held
    the refused batch (the capture going on gave sums over rows it never kept); the batch it
    fails on now leaves the accumulator as it was, also when it is the first in-place one."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", R.EagerFallbackWarning)
        r = R.make_reduction(fn)
    want = _update_refusing_size_2(r, sizes)
    torch.testing.assert_close(r.result()["value"], want)


def add_through_data_then_refuse(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    s = x.double().sum(0)
    if acc is None:
        return s
    acc.data.add_(s)  # (a write that moves no version counter)
    if x.shape[0] == 2:
        raise RuntimeError("refused after the update")
    return acc.clone()


def add_through_data_then_refuse_eager(acc, x):
    s = x.double().sum(0) * _SUM_SCALE
    if acc is None:
        return s
    acc.data.add_(s)
    if x.shape[0] == 2:
        raise RuntimeError("refused after the update")
    return acc.clone()


@pytest.mark.parametrize("fn", [add_through_data_then_refuse, add_through_data_then_refuse_eager],
                         ids=["script", "eager"])
@pytest.mark.parametrize("sizes", [(3, 5, 4, 2, 6), (3, 2, 5, 4)], ids=["later", "first-update"])
def test_a_custom_reduction_that_writes_through_acc_data_then_raises_keeps_its_accumulator(fn, sizes):
    """A function that adds the batch to acc through acc.data (no version counter moves), returns
    a new tensor, and raises on a later batch after its write: only the first batch given an
    accumulator worked on a copy (the function was never seen updating acc in place), so the
    refused batch stayed in the accumulator. Now each batch works on a copy."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", R.EagerFallbackWarning)
        r = R.make_reduction(fn)
    assert r.kind == ("eager" if fn is add_through_data_then_refuse_eager else "script")
    want = _update_refusing_size_2(r, sizes)
    torch.testing.assert_close(r.result()["value"], want)


@pytest.mark.parametrize("fn", [add_through_data_then_refuse, add_through_data_then_refuse_eager],
                         ids=["script", "eager"])
@pytest.mark.parametrize("in_store", [False, True])
def test_a_batch_a_custom_reduction_refuses_after_writing_through_acc_data_is_in_no_reduction(fn, in_store,
                                                                                              tmp_path):
    """The capture going on after a custom reduction wrote a batch into acc through acc.data and
    then raised (the caller skips the batch): a capture into a store left it out (the state
    before each forward it keeps made the accumulator shared, so the function worked on a copy),
    one in memory kept it in the sum."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6)).eval()
    batches = [torch.randn(n, 4) for n in (3, 5, 4, 2, 6)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", R.EagerFallbackWarning)
        scope = acs.ActivationScope(reductions=[("s", fn)], store=str(tmp_path / "s.zarr") if in_store else None)
    with pytest.warns(acs.CaptureWarning, match="raised and the exception was caught"):
        with torch.no_grad(), scope.track(model, include=["0"]) as tracker:
            for x in batches:
                if x.shape[0] != 2:
                    model(x)
                    continue
                with pytest.raises(CaptureError, match="refused after the update"):
                    model(x)
    got = acs.open_store(tmp_path / "s.zarr").reductions if in_store else tracker.reductions
    with torch.no_grad():
        want = torch.cat([model(x) for x in batches if x.shape[0] != 2]).double().sum(0)
    torch.testing.assert_close(got["0.output"]["s"], want)


@pytest.mark.parametrize("in_store", [False, True])
def test_a_batch_a_custom_reduction_refuses_is_in_no_reduction(in_store, tmp_path):
    """A custom reduction raising on one batch, and the capture going on (the caller skips the
    batch): the batch is not kept (no record, no stored row), and none of the hook point's
    reductions may keep it either. Those updated before the failing one (the built-ins, a
    custom one listed earlier) kept it: counts past the rows, a mean over rows not stored,
    and top-k values of the refused batch whose row ids pointed at other stored rows."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), _TimesHundredOnTwoRows()).eval()
    batches = [torch.randn(n, 4) for n in (3, 5, 2, 4)]
    specs = [("t", "topk", {"k": 2}), "mean", eager_sum_in_place, raises_on_two_rows, "max"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", R.EagerFallbackWarning)
        scope = acs.ActivationScope(reductions=specs, store=str(tmp_path / "s.zarr") if in_store else None)
    refused = 0
    with pytest.warns(acs.CaptureWarning, match="raised and the exception was caught"):
        with torch.no_grad(), scope.track(model, include=["1"]) as tracker:
            for x in batches:
                try:
                    model(x)
                except CaptureError as e:
                    assert "raises_on_two_rows" in str(e) and "hook point '1.output'" in str(e)
                    refused += 1
    assert refused == 1
    if in_store:
        store = acs.open_store(tmp_path / "s.zarr")
        rows, red = store["1.output"], store.reductions["1.output"]
    else:
        rows, red = torch.cat(tracker.activations["1.output"]), tracker.reductions["1.output"]
    with torch.no_grad():
        want = torch.cat([model(x) for x in batches if x.shape[0] != 2])
    assert torch.equal(rows, want)
    for name in ("t", "mean", "eager_sum_in_place", "raises_on_two_rows", "max"):
        if f"{name}.count" in red:
            assert int(red[f"{name}.count"]) == 12, name
    torch.testing.assert_close(red["mean"], want.double().mean(0), rtol=1e-12, atol=0)
    assert torch.equal(red["max"], want.double().amax(0))
    torch.testing.assert_close(red["eager_sum_in_place"], want.double().sum(0))
    torch.testing.assert_close(red["raises_on_two_rows"], want.double().sum(0))
    ids = red["t.row_ids"]
    assert torch.equal(rows.double().gather(0, ids), red["t.values"])
    assert torch.equal(red["t.values"], want.double().topk(2, 0).values)


@pytest.mark.parametrize("in_store", [False, True])
def test_an_eager_reduction_that_raises_names_the_hook_point_and_itself(in_store, tmp_path):
    """A script reduction's failure names the hook point and the reduction; an eager one's
    was the function's own exception (a bare ValueError) naming neither."""
    factor = 1  # a closed-over Python int: runs eagerly

    def eager_fails(acc, x):
        if acc is not None:
            raise ValueError(f"bad batch {factor}")
        return x.sum(0)

    def eager_not_tensor(acc, x):
        return float(x.sum()) * factor

    model = torch.nn.Sequential(torch.nn.Linear(3, 4)).eval()
    cases = [(eager_fails, CaptureError,
              r"hook point '0.output': custom reduction 'eager_fails' \(eager\) failed on rows of shape \(2, 4\) "
              r"\(torch.float32\): ValueError: bad batch 1"),
             (eager_not_tensor, ReductionError,
              r"hook point '0.output': custom reduction 'eager_not_tensor' must return a Tensor, got float")]
    for fn, error, match in cases:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", R.EagerFallbackWarning)
            store = str(tmp_path / f"{fn.__name__}.zarr") if in_store else None
            scope = acs.ActivationScope(reductions=[fn], store=store)
        with pytest.raises(error, match=match) as info:
            with torch.no_grad(), scope.track(model):
                model(torch.randn(2, 3))
                model(torch.randn(2, 3))
        if fn is eager_fails:
            assert isinstance(info.value.__cause__, ValueError)
        if in_store:  # the whole forwards; a new store with none is removed
            if fn is eager_fails:
                assert acs.open_store(store).n_rows("0.output") == 2
            else:
                assert not os.path.exists(store)


def test_hist_counts_each_value_in_the_bin_of_the_edges_it_reports():
    """A value on a reported edge (or one ulp either side) is counted where those edges put it,
    as torch.histogram over the same edges counts it: (x - lo) / w alone missed by one bin
    (lo=0.1, hi=0.7, bins=6: x = edges[2] = 0.3 went to bin 1)."""
    cases = [(0.1, 0.7, 6), (0.0, 1.0, 10), (-3.3, 2.9, 31), (1e-3, 7e-3, 3), (-1.0, 1.0, 1)]
    for lo, hi, bins in cases:
        edges = torch.linspace(lo, hi, bins + 1, dtype=torch.float64)
        near = torch.cat([edges, torch.nextafter(edges, edges + 1), torch.nextafter(edges, edges - 1)])
        x = torch.cat([near, torch.empty(500, dtype=torch.float64).uniform_(lo, hi)]).clamp(lo, hi)
        for dtype in (torch.float64, torch.float32):
            xs = x.to(dtype)
            got = stream("hist", [xs.reshape(-1, 1)], bins=bins, lo=lo, hi=hi).result()
            assert torch.equal(got["edges"], edges)
            inside = xs.double()[(xs.double() >= lo) & (xs.double() <= hi)]
            want = torch.histogram(inside, bins=edges).hist.to(torch.int64)
            assert got["counts"][0].tolist() == want.tolist(), (lo, hi, bins, dtype)
    got = stream("hist", [torch.tensor([[0.3]], dtype=torch.float64)], bins=6, lo=0.1, hi=0.7).result()
    assert torch.linspace(0.1, 0.7, 7, dtype=torch.float64)[2].item() == 0.3
    assert got["counts"][0].tolist() == [0, 0, 1, 0, 0, 0]


@pytest.mark.parametrize("lo, hi, bins", [(-1e308, 1e308, 4), (1e15, 1e15 + 1, 1000), (0.0, 4e-323, 8),
                                           (5e-310, 5.00000000000413e-310, 3)])
def test_hist_refuses_a_range_whose_bins_float64_cannot_hold(lo, hi, bins):
    """hi - lo overflowing (edges NaN and inf), bins narrower than float64 tells apart (repeated
    edges: values were counted up to 62 bins away from where the reported edges put them) and
    bins / (hi - lo) overflowing (x == lo: IndexError from the native update) are refused
    when the reduction is made, naming the options."""
    with pytest.raises(ReductionError, match=r"options of reduction 'hist' give bins float64 cannot hold: "
                       rf"lo={re.escape(repr(float(lo)))}, hi={re.escape(repr(float(hi)))}, bins={bins} .*"
                       r"use fewer bins or a wider range"):
        R.make_reduction("hist", lo=lo, hi=hi, bins=bins)
    # just wide enough: every value is counted where the reported edges put it
    lo, bins = 1e15, 7
    hi = lo + 16 * 0.125 * bins
    got = stream("hist", [], bins=bins, lo=lo, hi=hi)
    edges = torch.linspace(lo, hi, bins + 1, dtype=torch.float64)
    x = torch.cat([edges, torch.nextafter(edges, edges + 1), torch.nextafter(edges, edges - 1)]).clamp(lo, hi)
    got.update(x.reshape(-1, 1))
    want = torch.histogram(x, bins=edges).hist.to(torch.int64)
    assert got.result()["counts"][0].tolist() == want.tolist()


def _custom(kind: str, eager: bool):
    """The reduction ``kind`` as a TorchScript-compilable function, or one that runs eagerly
    (it closes over a Python object TorchScript cannot type)."""
    marker = object() if eager else None

    if kind == "clamps":
        def clamps(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            x.clamp_(min=0.0)
            return x.sum(0) if acc is None else acc + x.sum(0)
        fn = clamps
    else:
        def first(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            if acc is None:
                return x
            return acc
        fn = first
    if not eager:
        return fn

    def eager_fn(acc, x):
        assert marker is not None
        return fn(acc, x)
    eager_fn.__name__ = fn.__name__
    return eager_fn


@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("in_store", [False, True])
def test_a_custom_reduction_that_writes_into_its_rows_is_an_error(eager, in_store, tmp_path):
    """x is the model's activation: a reduction that changed it in place changed the model's
    forward (and the stored rows) silently; now the capture stops with CaptureError."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", R.EagerFallbackWarning)
        scope = acs.ActivationScope(include=["0"], reductions=[("clamps", _custom("clamps", eager))],
                                    store=str(tmp_path / "s.zarr") if in_store else None)
    assert R.make_reduction(_custom("clamps", eager)).kind == ("eager" if eager else "script")
    with pytest.raises(CaptureError, match=r"custom reduction .*clamps.* changed its input x in place .*out-of-place"):
        with torch.no_grad(), scope.track(model):
            model(torch.randn(5, 3))


@pytest.mark.parametrize("eager", [False, True])
def test_an_accumulator_that_is_its_rows_is_kept_as_a_copy(eager):
    """`return x` for the first batch made the accumulator the model's own tensor: an in-place
    op after the hook (ReLU(inplace=True)) then changed the reduction's value."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(inplace=True)).eval()
    x = torch.randn(6, 3)
    want = model[0](x).detach()
    assert (want < 0).any()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", R.EagerFallbackWarning)
        fn = _custom("first", eager)
        assert R.make_reduction(fn).kind == ("eager" if eager else "script")
        scope = acs.ActivationScope(include=["0"], reductions=[("first", fn)],
                                    reduction_policy=acs.ReductionPolicy.STREAMING)
    with torch.no_grad(), scope.track(model) as tracker:
        model(x)
        model(torch.randn(6, 3))
    torch.testing.assert_close(tracker.reductions["0.output"]["first"], want, rtol=0, atol=0)


def test_a_reduction_name_longer_than_a_file_name_allows_is_refused_before_any_capture(tmp_path):
    """reductions/<hook point>/<name>.state.<key> must fit a file name (255 bytes): a name of
    101+ UTF-8 bytes is refused when the scope is made, naming its length."""
    for name in ("r" * 101, "é" * 51):
        with pytest.raises(ReductionError, match=r"at most 100 UTF-8 bytes .*got \d+ bytes"):
            acs.ActivationScope(reductions=[(name, "mean")], store=str(tmp_path / "s.zarr"))
    scope = acs.ActivationScope(reductions=[("r" * 100, "var")], store=str(tmp_path / "ok.zarr"))
    model = torch.nn.Sequential(torch.nn.Linear(3, 4)).eval()
    x = torch.randn(5, 3)
    with torch.no_grad(), scope.track(model):
        y = model(x)
    torch.testing.assert_close(acs.open_store(tmp_path / "ok.zarr").reductions["0.output"]["r" * 100], y.double().var(0, correction=0))


def test_an_eager_custom_reduction_runs_under_inference_mode():
    """Rows of a model run under torch.inference_mode are inference tensors, which have no
    version counter: the in-place check made every eager custom reduction fail there with a
    raw RuntimeError ("Inference tensors do not track version counter"). It runs, exactly,
    and an accumulator that is x is still kept as a copy."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(inplace=True)).eval()
    xs = [torch.randn(6, 3), torch.randn(4, 3)]
    with torch.no_grad():
        want = torch.cat([model[0](x) for x in xs]).sum(0)
        first = model[0](xs[0]).clone()
    marker = object()

    def total(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        assert marker is not None
        return x.sum(0) if acc is None else acc + x.sum(0)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", R.EagerFallbackWarning)
        assert R.make_reduction(total).kind == "eager"
        scope = acs.ActivationScope(include=["0"], reductions=[("total", total), ("first", _custom("first", True))],
                                    reduction_policy=acs.ReductionPolicy.STREAMING)
    with torch.inference_mode(), scope.track(model) as tracker:
        for x in xs:
            model(x)
    torch.testing.assert_close(tracker.reductions["0.output"]["total"], want)
    torch.testing.assert_close(tracker.reductions["0.output"]["first"], first, rtol=0, atol=0)


def test_a_scripted_custom_reduction_runs_under_inference_mode():
    """The native in-place check read the rows' version counter, which inference tensors do not
    have: every TorchScript custom reduction failed under torch.inference_mode with a raw
    RuntimeError. It runs there, in a capture and in a direct update, with the same values."""
    fn = _custom("first", False)
    r = R.make_reduction(fn)
    assert r.kind == "script"
    with torch.inference_mode():
        t = torch.randn(3, 4)
    r.update(t)
    torch.testing.assert_close(r.result()["value"], t, rtol=0, atol=0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(inplace=True)).eval()
    x = torch.randn(6, 3)
    with torch.no_grad():
        want = model[0](x).clone()
    scope = acs.ActivationScope(include=["0"], reductions=[("first", fn)], reduction_policy=acs.ReductionPolicy.STREAMING)
    with torch.inference_mode(), scope.track(model) as tracker:
        model(x)
    torch.testing.assert_close(tracker.reductions["0.output"]["first"], want, rtol=0, atol=0)


@pytest.mark.parametrize("spec, need", [
    (("h", "hist", {"lo": 0.0, "hi": 1.0, "bins": 4096}), 8 + 8 * (4096 + 3) * 64),
    (("c", "cov", {}), 8 + 8 * (64 * 64 + 64)),
    (("t", "topk", {"k": 2000}), 8 + 16 * 2000 * 64),
    (("t0", "topk", {"k": 2000, "per_feature": 0}), 8 + 24 * 2000),
])
def test_a_reduction_state_larger_than_memory_is_refused_before_it_is_allocated(monkeypatch, spec, need):
    """A built-in reduction whose float64 state would be larger than the machine's memory
    (here: memory set to 16 KiB) is refused as ReductionError naming it, its hook point and
    the bytes, before anything is allocated; a state that fits is made as usual."""
    from activationscope.capture import scope as scope_module
    from activationscope.capture.reductions import state_bytes

    assert state_bytes(spec[1], {"per_feature": 1.0, **spec[2]}, 64) == need
    model = torch.nn.Sequential(torch.nn.Linear(4, 64))
    monkeypatch.setattr(scope_module, "_memory_bytes", lambda: 1 << 14)
    with pytest.raises(ReductionError, match=rf"reduction '{spec[0]}' \({spec[1]}, .*\) of hook point '0.output' "
                       rf"needs a state of {need / 1e9:.1f} GB over its 64 values per row, more than this machine's "
                       r"memory \(0.0 GB\); nothing was allocated"):
        with acs.ActivationScope(reductions=[spec]).track(model), torch.no_grad():
            model(torch.randn(3, 4))
    monkeypatch.setattr(scope_module, "_memory_bytes", lambda: need)
    with acs.ActivationScope(reductions=[spec]).track(model) as tr, torch.no_grad():
        model(torch.randn(3, 4))
    assert any(k == spec[0] or k.startswith(spec[0] + ".") for k in tr.reductions["0.output"])


@pytest.mark.parametrize("kind, options", [(k, {"lo": -1.0, "hi": 1.0, "bins": 7} if k == "hist" else
                                            {"k": 5} if k == "topk" else {}) for k in R.BUILTIN_REDUCTIONS])
@pytest.mark.parametrize("per_feature", [1, 0])
@pytest.mark.parametrize("feature_shape", [(1,), (6,), (3, 4)])
def test_state_bytes_is_the_size_of_the_state_a_reduction_holds(kind, options, per_feature, feature_shape):
    """state_bytes (what a capture refuses states larger than memory by) is exactly the bytes
    of the reduction's state tensors once it holds its most, per_feature=0 included: a cov or
    topk over every value was estimated as per feature (a (D, D) co-moment; k values without
    their feature ids), so per_feature=0, the fix the refusal names, was refused as well."""
    from activationscope.capture.reductions import state_bytes

    r = R.make_reduction(kind, per_feature=per_feature, **options)
    r.update(torch.randn(8, *feature_shape, dtype=torch.float64))  # 8 rows >= k: topk is full
    state = r.state()
    actual = sum(t.numel() * t.element_size() for t in state.values())
    assert state_bytes(kind, {**options, "per_feature": float(per_feature)}, math.prod(feature_shape)) == actual
    assert state_bytes(kind, dict(r.options), math.prod(feature_shape)) == actual


def test_a_cov_over_every_value_of_a_wide_hook_point_is_not_refused(monkeypatch):
    """cov with per_feature=0 holds a (1, 1) co-moment however wide the rows: a capture on a
    machine whose memory holds that (and not a (D, D) one) makes it and gives the variance."""
    from activationscope.capture import scope as scope_module

    model = torch.nn.Sequential(torch.nn.Linear(4, 512))
    monkeypatch.setattr(scope_module, "_memory_bytes", lambda: 1 << 12)
    x = torch.randn(3, 4)
    with acs.ActivationScope(reductions=[("c", "cov", {"per_feature": 0})]).track(model) as tr, torch.no_grad():
        model(x)
    with torch.no_grad():
        values = model(x).double().reshape(-1)
    torch.testing.assert_close(tr.reductions["0.output"]["c"], values.var(unbiased=False).reshape(1, 1))
    with pytest.raises(ReductionError, match=r"reduction 'c' \(cov, .*\) of hook point '0.output' needs a state of"):
        with acs.ActivationScope(reductions=[("c", "cov", {})]).track(model), torch.no_grad():
            model(x)


def _accumulate_in_place(eager: bool):
    """A custom sum whose accumulator is updated in place from the second batch on
    (TorchScript-compilable, or eager when ``eager``)."""
    marker = object() if eager else None

    def in_place_sum(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if acc is None:
            return x.sum(0)
        acc.add_(x.sum(0))
        return acc
    if not eager:
        return in_place_sum

    def eager_fn(acc, x):
        assert marker is not None
        return in_place_sum(acc, x)
    eager_fn.__name__ = "in_place_sum"
    return eager_fn


@pytest.mark.parametrize("eager", [False, True])
def test_reductions_read_during_a_capture_are_copies_that_later_batches_leave_alone(eager):
    """`tracker.reductions` gives copies: a value read after one batch stays that batch's
    sum while a custom reduction goes on updating its accumulator in place."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4)).eval()
    xs = [torch.randn(2, 3), torch.randn(5, 3), torch.randn(4, 3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", R.EagerFallbackWarning)
        scope = acs.ActivationScope(include=["0"], reductions=[("s", _accumulate_in_place(eager))])
    with torch.no_grad(), scope.track(model) as tracker:
        model(xs[0])
        first = tracker.reductions["0.output"]["s"]
        for x in xs[1:]:
            model(x)
        last = tracker.reductions["0.output"]["s"]
    with torch.no_grad():
        torch.testing.assert_close(first, model(xs[0]).sum(0))
        torch.testing.assert_close(last, sum(model(x).sum(0) for x in xs))


def _topk_reference(x: torch.Tensor, k: int):
    """Per column, the k rows of x in the order (value descending, NaN above every number,
    then the lower row first): a plain-Python reference for ties."""
    vals, ids = [], []
    for c in range(x.shape[1]):
        col = x[:, c].tolist()
        key = lambda i: (0, i) if col[i] != col[i] else (1, -col[i], i)  # noqa: E731
        order = sorted(range(len(col)), key=key)[:k]
        vals.append([col[i] for i in order])
        ids.append(order)
    return torch.tensor(vals, dtype=torch.float64).T, torch.tensor(ids).T


@pytest.mark.parametrize("split", [[15], [4, 4, 4, 3], [1] * 15, [7, 8], [2, 13]])
def test_topk_ties_go_to_the_lower_row_whatever_the_batches(split):
    # ties are common (a ReLU feature that is mostly zero): the rows kept must not depend on
    # how the rows were cut into batches (a resumed or multi-rank run equals one pass)
    nan = float("nan")
    x = torch.tensor([[1.0, 0.0, nan, 3.0], [2.0, 0.0, 1.0, 3.0], [2.0, 0.0, nan, -0.0],
                      [2.0, 0.0, 2.0, 0.0], [0.0, 0.0, nan, 3.0]] * 3)
    for k in (1, 2, 4, 7):
        r = R.make_reduction("topk", k=k)
        for rows, off in zip(x.split(split), [sum(split[:i]) for i in range(len(split))]):
            r.update(rows, off)
        got = r.result()
        want_v, want_ids = _topk_reference(x, k)
        assert got["row_ids"].tolist() == want_ids.tolist(), (k, split)
        torch.testing.assert_close(got["values"], want_v, equal_nan=True)


def test_topk_ties_merge_the_same_in_any_order():
    x = torch.zeros(40, 3)
    x[::7, 1] = 5.0
    parts = [R.make_reduction("topk", k=3) for _ in range(4)]
    for i, p in enumerate(parts):
        p.update(x[10 * i:10 * (i + 1)], 10 * i)
    for order in ([0, 1, 2, 3], [3, 1, 0, 2], [2, 3, 1, 0]):
        m = R.make_reduction("topk", k=3)
        for i in order:
            m.merge(parts[i])
        assert m.result()["row_ids"].tolist() == [[0, 0, 0], [1, 7, 1], [2, 14, 2]]


def test_topk_whole_tensor_ties_go_to_the_lower_row_then_feature():
    x = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    for split in ([3], [1, 1, 1], [2, 1]):
        r = R.make_reduction("topk", k=4, per_feature=0)
        for rows, off in zip(x.split(split), [sum(split[:i]) for i in range(len(split))]):
            r.update(rows, off)
        got = r.result()
        assert got["row_ids"].tolist() == [0, 0, 1, 1] and got["feature_ids"].tolist() == [1, 2, 0, 2], split


def test_topk_ties_with_a_large_k_go_to_the_lower_row():
    # k above the one-pass kernel's limit: the tensor-op path keeps the same order
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 4, (300, 5), generator=g).double()
    x[::11, 2] = float("nan")
    for split in ([300], [120, 97, 83]):
        r = R.make_reduction("topk", k=100)
        for rows, off in zip(x.split(split), [sum(split[:i]) for i in range(len(split))]):
            r.update(rows, off)
        want_v, want_ids = _topk_reference(x, 100)
        got = r.result()
        assert got["row_ids"].tolist() == want_ids.tolist(), split
        torch.testing.assert_close(got["values"], want_v, equal_nan=True)


# ---------------------------------------------------------------------------- accumulator shape and dtype


def total_first_then_per_feature(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    # a slip: the first batch's total over every value, then per-feature sums, which broadcast
    if acc is None:
        return x.double().sum()
    return acc + x.double().sum(0)


_ONE = types.SimpleNamespace(v=1.0)  # a Python object: TorchScript refuses it, so the eager twins below run as Python


def total_first_then_per_feature_eager(acc, x):
    if acc is None:
        return x.double().sum()
    return acc + x.double().sum(0) * _ONE.v


def sum_half_first(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    # a slip: the first accumulator float16, so later batches promote it to float32
    s = x.sum(0)
    return s.half() if acc is None else acc + s


def sum_half_first_eager(acc, x):
    s = x.sum(0) * _ONE.v
    return s.half() if acc is None else acc + s


def sum_rows_f64(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    s = x.double().sum(0)
    return s if acc is None else acc + s


def sum_rows_f64_eager(acc, x):
    s = x.double().sum(0) * _ONE.v
    return s if acc is None else acc + s


def _capture_with(spec, model, batches, store=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", R.EagerFallbackWarning)
        scope = acs.ActivationScope(reductions=[spec], store=store)
    with torch.no_grad(), scope.track(model) as tracker:
        for x in batches:
            model(x)
    return tracker


@pytest.mark.parametrize("eager", [False, True], ids=["script", "eager"])
@pytest.mark.parametrize("in_store", [False, True])
def test_an_accumulator_that_changes_shape_is_refused_before_it_is_kept(eager, in_store, tmp_path):
    """A custom reduction whose accumulator changed shape from one batch to the next (a ()
    total, then (d,) sums, which broadcast: every feature held the first batch's total) gave a
    (d,) result without an error, stored as the reduction's value. The batch that changes it
    is refused, naming the hook point, the reduction, both shapes and the fix; the reduction
    and the rows keep the batches before it."""
    fn = total_first_then_per_feature_eager if eager else total_first_then_per_feature
    model = torch.nn.Sequential(torch.nn.Linear(3, 4)).eval()
    xs = [torch.randn(2, 3), torch.randn(5, 3)]
    store = str(tmp_path / "s.zarr") if in_store else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", R.EagerFallbackWarning)
        scope = acs.ActivationScope(reductions=[fn], store=store)
    name = fn.__name__
    with pytest.raises(CaptureError, match=(
            rf"hook point '0.output': custom reduction '{name}' (\(eager\) )?was given an accumulator of shape \(\) "
            rf"\(torch\.float64\) and returned one of shape \(4,\) .*on rows of shape \(5, 4\).*keep its shape "
            rf"and dtype from batch to batch.*make the function return a tensor of its accumulator's shape")):
        with torch.no_grad(), scope.track(model) as tracker:
            for x in xs:
                model(x)
    with torch.no_grad():
        first = model(xs[0]).double().sum()
    if in_store:  # the first forward's rows; a capture that raised writes no reductions
        stored = acs.open_store(store)
        assert stored.n_rows("0.output") == 2 and stored.status == "incomplete"
        assert "0.output" not in stored.reductions
    else:
        assert len(tracker.activations["0.output"]) == 1
        torch.testing.assert_close(tracker.reductions["0.output"][name], first)


@pytest.mark.parametrize("eager", [False, True], ids=["script", "eager"])
def test_an_init_of_another_shape_or_dtype_is_refused_on_the_first_batch(eager):
    """An init= of another shape than the function's accumulator (a () init for per-feature
    sums) was broadcast to the accumulator's, and one of another dtype promoted, without an
    error. The first batch is refused, naming the shapes and dtypes and saying to give init=
    the accumulator's."""
    fn = sum_rows_f64_eager if eager else sum_rows_f64
    name = fn.__name__
    model = torch.nn.Sequential(torch.nn.Linear(3, 1)).eval()
    for init, what in [(torch.tensor(100.0, dtype=torch.float64), r"shape \(\) .* returned one of shape \(1,\)"),
                       (torch.zeros(1, dtype=torch.float32), r"shape \(1,\) \(torch\.float32\) and returned one "
                                                             r"of shape \(1,\) \(torch\.float64\)")]:
        with pytest.raises(CaptureError, match=rf"hook point '0.output': custom reduction '{name}'.* was given an "
                                               rf"accumulator of {what}.*give init= \(or the stored state\) the shape "
                                               rf"and dtype the function returns"):
            _capture_with((name, fn, {"init": init}), model, [torch.randn(2, 3)])
    r = R.make_reduction(fn, init=torch.zeros(1, dtype=torch.float64))  # the right one works
    x = torch.randn(6, 1)
    r.update(x[:2])
    r.update(x[2:])
    torch.testing.assert_close(r.result()["value"], x.double().sum(0))


@pytest.mark.parametrize("eager", [False, True], ids=["script", "eager"])
def test_an_accumulator_that_changes_dtype_is_refused(eager):
    """A float16 first accumulator, promoted to float32 by the next batch, rounded the first
    batch's sums to float16 without an error; the second batch is refused and the
    accumulator stays the first batch's."""
    fn = sum_half_first_eager if eager else sum_half_first
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", R.EagerFallbackWarning)
        r = R.make_reduction(fn)
    assert isinstance(r, R.EagerReduction) == eager
    x = torch.randn(7, 3)
    r.update(x[:3])
    with pytest.raises(CaptureError, match=r"given an accumulator of shape \(3,\) \(torch\.float16\) and returned "
                                           r"one of shape \(3,\) \(torch\.float32\)"):
        r.update(x[3:])
    assert torch.equal(r.result()["value"], x[:3].sum(0).half())


class MergeReturnsTotal(SumRows):
    @torch.jit.export
    def merge(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a + b).sum()  # a slip: the merged accumulator is a scalar


def test_a_merge_of_accumulators_of_other_shapes_is_refused():
    """merge(a, b) of a () accumulator (a whole-tensor sum) and a (3,) one broadcast to a (3,)
    result, each value the scalar plus one feature, without an error; a merge that returned
    another shape replaced the accumulator with it. Both are refused, the accumulator left as
    it was."""
    sm = _quiet_script(SumRows())  # (a + b: broadcasts a () accumulator)
    a, b = R.make_reduction(sm), R.make_reduction(sm)
    a.update(torch.ones(2, 3))
    b.load_state({"acc": torch.tensor(5.0, dtype=torch.float64)})
    with pytest.raises(CaptureError, match=r"merge of custom reduction 'SumRows' failed on "
                                           r"accumulators of shapes \(3,\) and \(\) .*same shape and dtype"):
        a.merge(b)
    assert a.result()["value"].tolist() == [2.0, 2.0, 2.0]
    bad = _quiet_script(MergeReturnsTotal())
    a, b = R.make_reduction(bad), R.make_reduction(bad)
    a.update(torch.ones(2, 3))
    b.update(torch.ones(1, 3))
    with pytest.raises(CaptureError, match=r"merge of custom reduction 'MergeReturnsTotal' was given accumulators of "
                                           r"shape \(3,\) \(torch\.float64\) and returned one of shape \(\)"):
        a.merge(b)
    assert a.result()["value"].tolist() == [2.0, 2.0, 2.0]


def test_options_given_to_a_custom_reduction_are_refused(tmp_path):
    """Options given to a custom reduction (("s", fn, {"scale": 2}), make_reduction(fn,
    per_feature=0)) were kept and never reached the function: its values were those without
    them, with no error. They are refused when the reduction is made, naming it and the fix;
    init= is still its first accumulator."""
    path = R.script_reduction(sum_rows_f64, tmp_path / "sum_rows_f64.pt")
    for spec, name in [(sum_rows_f64, "sum_rows_f64"), (path, "sum_rows_f64"), (str(path), "sum_rows_f64"),
                       (_quiet_script(SumWithMerge()), "SumWithMerge")]:
        for options, shown in [({"per_feature": 0}, "per_feature=0"), ({"scale": 2}, "scale=2")]:
            with pytest.raises(ReductionError, match=rf"custom reduction '{name}' takes no options, got {shown}: .*"
                                                     r"write the value into the function"):
                R.make_reduction(spec, **options)
    with pytest.raises(ReductionError, match=r"custom reduction 'sum_rows_f64' takes no options, got scale=2"):
        acs.ActivationScope(reductions=[("s", sum_rows_f64, {"scale": 2})])
    (name, factory), = R.resolve_reductions([("s", sum_rows_f64, {"init": torch.ones(2, dtype=torch.float64)})], "h")
    r = factory()
    r.update(torch.ones(3, 2))
    assert name == "s" and r.result()["value"].tolist() == [4.0, 4.0]


_HALF = types.SimpleNamespace(v=0.5)  # a Python object: TorchScript refuses it


def _eager_for_the_warning_line(acc, x):
    s = x.double().sum(0) * _HALF.v
    return s if acc is None else acc + s


def _eager_for_the_warning_line_2(acc, x):
    s = x.double().sum(0) * _HALF.v
    return s if acc is None else acc + s


def test_the_eager_fallback_warning_names_the_users_line():
    """EagerFallbackWarning for a function given to ActivationScope(reductions=[...]) or
    resolve_reductions was attributed to a line inside activationscope/capture/reductions.py
    (a fixed stacklevel counted for make_reduction called directly): it names the caller's."""
    cases = [lambda: acs.ActivationScope(reductions=[_eager_for_the_warning_line]),
             lambda: R.resolve_reductions([_eager_for_the_warning_line_2], "h")]
    for make in cases:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make()
        got = [w for w in caught if issubclass(w.category, R.EagerFallbackWarning)]
        assert len(got) == 1 and got[0].filename == __file__, [(w.filename, w.lineno) for w in got]


def two_sums(acc: Optional[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s, q = x.double().sum(0), x.double().pow(2).sum(0)
    return (s, q) if acc is None else (acc[0] + s, acc[1] + q)


def two_sums_eager(acc, x):
    s, q = x.double().sum(0) * _HALF.v, x.double().pow(2).sum(0)
    return {"s": s, "q": q}


def test_a_state_of_several_tensors_is_refused_with_the_way_to_keep_it():
    """A function keeping two statistics as a tuple (or an eager one returning a dict) was
    refused naming only the contract; the error says how to keep several statistics: in one
    tensor."""
    with pytest.raises(ReductionError, match=r"custom reduction 'two_sums' must have the signature .*; to keep several "
                                             r"statistics, hold them in one tensor \(torch.stack"):
        R.make_reduction(two_sums)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", R.EagerFallbackWarning)
        r = R.make_reduction(two_sums_eager)
    with pytest.raises(ReductionError, match=r"custom reduction 'two_sums_eager' must return a Tensor, got dict; to "
                                             r"keep several statistics, hold them in one tensor"):
        r.update(torch.ones(2, 3))


def test_a_lone_tensor_as_init_of_a_built_in_names_what_init_is_there():
    """make_reduction("mean", init=torch.zeros(3)) said "state of reduction 'mean' must have a
    one-element 'count' tensor", not that a built-in's init= is a state() dict."""
    for kind in ("mean", "max", "topk"):
        with pytest.raises(ReductionError, match=rf"init= of the built-in reduction '{kind}' must be its state dict "
                                                 r"\(the state\(\) of .*got Tensor; a lone tensor is the first "
                                                 r"accumulator of a custom reduction only"):
            R.make_reduction(kind, init=torch.zeros(3))
    src = R.make_reduction("mean")
    src.update(torch.ones(2, 3))
    r = R.make_reduction("mean", init=src.state())  # a state dict still seeds it
    r.update(torch.zeros(2, 3))
    assert r.result()["mean"].tolist() == [0.5] * 3 and int(r.result()["count"]) == 4


def _sum_as_captured(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    s = x.sum(0)
    return s if acc is None else acc + s


def _sum_in_float64(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    s = x.double().sum(0)
    return s if acc is None else acc + s


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("in_store", [False, True], ids=["memory", "store"])
def test_a_custom_sum_kept_in_half_precision_warns_naming_it_and_its_hook_point(dtype, in_store, tmp_path):
    """A custom reduction runs in the captured dtype: a running sum kept in bfloat16 that is at
    512 stays there when batches of two rows of ones follow (512 + 2 rounds back to 512; in
    float16 4096 + 2 is 4096), with no word. The capture warns once, naming the reduction, the
    hook point, the dtype and the fix; the fix (x.double() inside) gives the float64 reference
    exactly and no warning."""
    model = torch.nn.Sequential(_Clone())
    big = 512.0 if dtype == torch.bfloat16 else 4096.0
    xs = [torch.full((1, 3), big, dtype=dtype)] + [torch.ones(2, 3, dtype=dtype) for _ in range(300)]
    want = torch.cat(xs).double().sum(0)
    store = tmp_path / "s.zarr" if in_store else None
    scope = acs.ActivationScope(store=store, reductions=[_sum_as_captured, _sum_in_float64])
    with pytest.warns(acs.CaptureWarning) as caught:
        with scope.track(model) as tracker:
            for x in xs:
                model(x)
    half = [str(w.message) for w in caught if "half-precision accumulator" in str(w.message)]
    assert len(half) == 1
    assert f"'_sum_as_captured' of hook point '0.output' ({str(dtype).replace('torch.', '')})" in half[0]
    assert "_sum_in_float64" not in half[0] and "x.double()" in half[0]
    got = acs.open_store(store).reductions["0.output"] if in_store else tracker.reductions["0.output"]
    assert got["_sum_as_captured"].dtype == dtype
    assert float(got["_sum_as_captured"][0]) < 0.9 * float(want[0])  # what the warning is about
    assert got["_sum_in_float64"].dtype == torch.float64
    torch.testing.assert_close(got["_sum_in_float64"], want, rtol=0, atol=0)


def test_a_custom_reduction_of_float32_rows_gives_no_half_precision_warning():
    """The warning is about float16 / bfloat16 accumulators only: a float32 running sum of
    float32 rows stays quiet (and equals the float64 reference to float32 round-off)."""
    model = torch.nn.Sequential(_Clone())
    xs = [torch.randn(4, 3, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", acs.CaptureWarning)
        with acs.ActivationScope(reductions=[_sum_as_captured]).track(model) as tracker:
            for x in xs:
                model(x)
    torch.testing.assert_close(tracker.reductions["0.output"]["_sum_as_captured"].double(),
                               torch.cat(xs).double().sum(0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("policy", [{"capture_policy": "sample_n", "sample_every": 3},
                                    {"capture_policy": "max_k", "max_k": 2}], ids=["sample_n", "max_k"])
@pytest.mark.parametrize("in_store", [False, True], ids=["memory", "store"])
def test_reductions_of_a_sampling_capture_policy_cover_the_kept_forwards_only(policy, in_store, tmp_path):
    """Under SAMPLE_N / MAX_K a skipped forward reaches no reduction (capture.md): every
    built-in equals the float64 reference over the rows of the kept forwards (rtol 1e-12),
    and its count is their number of rows, in memory and from a store."""
    model = torch.nn.Sequential(_Clone())
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(3 + i, 4, generator=g, dtype=torch.float32) * 2 + 1e4 for i in range(7)]
    kept = xs[::3] if policy["capture_policy"] == "sample_n" else xs[:2]
    store = tmp_path / "s.zarr" if in_store else None
    with acs.ActivationScope(store=store, reductions=["mean", "var", "max"], **policy).track(model) as tracker:
        for x in xs:
            model(x)
    got = acs.open_store(store).reductions["0.output"] if in_store else tracker.reductions["0.output"]
    rows = torch.cat(kept).double()
    assert int(got["mean.count"]) == int(got["var.count"]) == rows.shape[0]
    torch.testing.assert_close(got["mean"], rows.mean(0), rtol=1e-12, atol=0)
    torch.testing.assert_close(got["var"], rows.var(0, correction=0), rtol=1e-9, atol=0)
    torch.testing.assert_close(got["max"], rows.amax(0), rtol=0, atol=0)


@pytest.mark.parametrize("with_reductions", [True, False])
def test_reference_mode_reductions_are_of_the_value_at_capture_time_and_the_warning_says_so(with_reductions):
    """Under CaptureMode.REFERENCE an in-place ReLU after the tracked Linear changes the record,
    not the reductions (computed during the call): the mean equals the float64 mean of the
    Linear's output (rtol 1e-12) and differs from the record's; the warning says the
    reductions no longer match the record (only where the hook point has reductions)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(inplace=True))
    x = torch.randn(6, 4)
    with torch.no_grad():
        before = model[0](x).double()
    scope = acs.ActivationScope(capture_mode="reference", include=["0"],
                                reductions=["mean"] if with_reductions else None)
    with pytest.warns(acs.CaptureWarning, match="changed in place") as caught:
        with torch.no_grad(), scope.track(model) as tracker:
            model(x)
    said = [str(w.message) for w in caught if "changed in place" in str(w.message)]
    assert len(said) == 1
    assert ("its reductions are of the value at capture time" in said[0]) == with_reductions
    if with_reductions:
        mean = tracker.reductions["0.output"]["mean"]
        torch.testing.assert_close(mean, before.mean(0), rtol=1e-12, atol=1e-12)
        assert not torch.allclose(mean, tracker.activations["0.output"][0].double().mean(0))


def test_sequences_of_varying_length_name_token_rows_as_the_fix_and_token_rows_reduce_exactly():
    """(batch, pos, d) activations of batches of another pos, captured in memory with per-feature
    reductions and no mask, are refused naming the hook point; the message named only
    per_feature=0 (a scalar over every value) as the way out, not token rows. It names
    rows="token" / attention_mask= too, and with rows="token" the mean and var over every token
    equal the float64 reference (rtol 1e-12)."""
    model = torch.nn.Sequential(_Clone())
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(2, 5, 4, generator=g), torch.randn(2, 6, 4, generator=g)]
    with pytest.raises(CaptureError, match=r"hook point '0.output': .*feature shape \(6, 4\) after \(5, 4\).*"
                                           r"attention_mask= to tracker.set_batch\(\), or rows=\"token\""):
        with acs.ActivationScope(reductions=["mean"]).track(model):
            for x in xs:
                model(x)
    with acs.ActivationScope(reductions=["mean", "var"], rows="token").track(model) as tracker:
        for x in xs:
            model(x)
    tokens = torch.cat([x.reshape(-1, 4) for x in xs]).double()
    got = tracker.reductions["0.output"]
    assert int(got["mean.count"]) == 22
    torch.testing.assert_close(got["mean"], tokens.mean(0), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(got["var"], tokens.var(0, correction=0), rtol=1e-12, atol=1e-15)


def test_a_function_compiled_for_each_capture_leaves_no_file_behind(tmp_path):
    """Each function object a custom reduction is given is compiled to a ``.pt`` file in a
    scratch folder; the file stayed there until the process exited, so a loop defining its
    reduction anew for each capture (a closure, a lambda) left one file per capture in the
    temporary folder. A file now goes once its function is freed, and each store still keeps
    the script with the right values."""
    import gc

    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    x = torch.randn(5, 4)
    R._scratch_dir()
    before = sorted(os.listdir(R._cache_dir))
    for i in range(4):
        def row_sum(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            s = x.double().sum(0)
            return s if acc is None else acc + s

        with acs.ActivationScope(store=str(tmp_path / f"s{i}.zarr"), reductions=[row_sum]).track(model):
            model(x)
        del row_sum
        gc.collect()
        assert sorted(os.listdir(R._cache_dir)) == before
        s = acs.open_store(tmp_path / f"s{i}.zarr")
        torch.testing.assert_close(s.reductions["0.output"]["row_sum"], model(x).detach().double().sum(0))
        assert any(p.suffix == ".pt" for p in (tmp_path / f"s{i}.zarr" / "reductions" / "0.output").iterdir())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", [log_sum, log_sum_in_place, log_sum_eager], ids=["script", "in_place", "eager"])
@pytest.mark.parametrize("in_store", [False, True], ids=["memory", "store"])
def test_a_custom_reduction_that_makes_nan_or_inf_of_finite_rows_warns_at_the_close(fn, in_store, device, tmp_path):
    """A custom reduction whose function makes inf of finite rows (the log of a 0 in the second
    batch) used to be kept without a word; now the close warns, naming the reduction, the hook
    point and how many values are NaN or inf, and keeps (and stores) the value as the function
    returned it. A function that updates its accumulator in place is caught too (the accumulator
    it was given looks no longer finite afterwards)."""
    model = torch.nn.Sequential(_Clone())
    xs = [torch.rand(4, 3, generator=torch.Generator().manual_seed(i)) + 0.5 for i in range(3)]
    xs[1][2, 1] = 0.0
    want = torch.cat(xs).double().log().sum(0)
    assert want.isinf().tolist() == [False, True, False]
    store = tmp_path / "s.zarr" if in_store else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with acs.ActivationScope(store=store, reductions=[fn, "mean"]).track(model) as tracker:
            for x in xs:
                model(x.to(device))
            assert not [w for w in caught if issubclass(w.category, acs.CaptureWarning)]  # (said at the close)
    messages = [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)]
    assert len(messages) == 1, messages
    assert messages[0].startswith(f"custom reduction(s) whose result holds NaN or inf made of finite rows: "
                                  f"'{fn.__name__}' of hook point '0.output' (1 of 3 values NaN or inf). ")
    got = acs.open_store(store).reductions["0.output"] if in_store else tracker.reductions["0.output"]
    torch.testing.assert_close(got[fn.__name__].cpu(), want)
    assert torch.isfinite(got["mean"]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", [log_sum, log_sum_in_place, log_sum_eager], ids=["script", "in_place", "eager"])
def test_nan_or_inf_of_the_rows_carried_by_a_custom_reduction_gives_no_warning(fn, device):
    """Rows holding inf (or NaN) give a custom reduction's result inf (NaN) as they give the
    built-in mean's: carried along, like torch, with no warning; an accumulator seeded with
    NaN (init=) is carried along too."""
    model = torch.nn.Sequential(_Clone())
    xs = [torch.rand(4, 3, generator=torch.Generator().manual_seed(i)) + 0.5 for i in range(3)]
    xs[1][2, 1], xs[2][0, 2] = float("inf"), float("nan")
    init = torch.tensor([float("nan"), 0.0, 0.0], dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with acs.ActivationScope(reductions=[fn, ("seeded", fn, {"init": init}), "mean"]).track(model) as tracker:
            for x in xs:
                model(x.to(device))
    assert not [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)]
    got = tracker.reductions["0.output"]
    assert torch.isfinite(got[fn.__name__]).tolist() == torch.isfinite(got["mean"]).tolist() == [True, False, False]
    assert torch.isfinite(got["seeded"]).tolist() == [False, False, False]


@pytest.mark.parametrize("fn", [log_sum, log_sum_in_place, log_sum_eager], ids=["script", "in_place", "eager"])
def test_made_nonfinite_tells_nan_or_inf_the_function_made_from_what_the_rows_or_state_held(fn):
    """``made_nonfinite`` of a custom reduction: False while its accumulator is finite, True once
    a batch of finite rows turned a finite accumulator into inf (in place too); False where the
    rows held inf, or the state it was loaded with held NaN, before; always False for a
    built-in."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", R.EagerFallbackWarning)
        made, carried, loaded = R.make_reduction(fn), R.make_reduction(fn), R.make_reduction(fn)
    zero = torch.tensor([[1.0, 0.0, 2.0]])
    made.update(torch.ones(2, 3))
    assert made.made_nonfinite is False
    made.update(zero)
    assert made.made_nonfinite is True and made.result()["value"].isinf().tolist() == [False, True, False]
    made.update(torch.ones(2, 3))
    assert made.made_nonfinite is True
    carried.update(torch.tensor([[1.0, float("inf"), 1.0]]))
    carried.update(zero)
    assert carried.made_nonfinite is False and not torch.isfinite(carried.result()["value"][1])
    loaded.load_state({"acc": torch.tensor([float("nan"), 0.0, 0.0], dtype=torch.float64)})
    loaded.update(zero)
    assert loaded.made_nonfinite is False
    mean = R.make_reduction("mean")
    mean.update(zero.log())
    assert mean.made_nonfinite is False


def log_sum_in_place_eager(acc, x):
    s = x.double().log().sum(0) * _IN_PLACE_SCALE
    if acc is None:
        return s
    acc += s
    return acc


@pytest.mark.parametrize("fn", [log_sum_eager, log_sum_in_place_eager], ids=["eager", "eager_in_place"])
def test_made_nonfinite_of_an_eager_reduction_is_put_back_with_its_checkpoint(fn):
    """``restore_checkpoint()`` of the eager reduction (what a capture calls to take a forward
    out) put back its accumulator only: ``made_nonfinite`` stayed True for inf made by the
    batch taken out. It puts back both now, as the TorchScript reduction does, and the
    remembered accumulator is not changed by the batches after the checkpoint."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", R.EagerFallbackWarning)
        red = R.make_reduction(fn)
    assert isinstance(red, R.EagerReduction)
    ones = torch.ones(2, 3)
    red.update(ones)
    red.update(ones)
    red.checkpoint()
    before = red.result()["value"].clone()
    red.update(torch.tensor([[1.0, 0.0, 2.0]]))  # log 0: -inf of finite rows
    assert red.made_nonfinite is True
    red.restore_checkpoint()
    assert red.made_nonfinite is False
    assert torch.equal(red.result()["value"], before)
    red.update(ones)
    assert red.made_nonfinite is False and torch.equal(red.result()["value"], before)  # (log 1 = 0)


def _refuses_zeros(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    if bool((x == 0).any()):
        raise ValueError("a zero among the rows")
    s = x.double().sum(0)
    return s if acc is None else acc + s


@pytest.mark.parametrize("fn", [log_sum, log_sum_in_place, log_sum_eager], ids=["script", "in_place", "eager"])
def test_made_nonfinite_of_a_batch_a_later_custom_reduction_refused_is_put_back(fn):
    """A batch that a later custom reduction of the hook point raised on is taken out of those
    updated before it (their states put back: the capture keeps no row of it), but only their
    accumulators were: ``made_nonfinite`` stayed True for the inf that batch made (and the close
    would have blamed the function for NaN or inf the rows carried later). The flags are put back
    with the accumulator now."""
    from activationscope.capture import _native

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", R.EagerFallbackWarning)
        reds = [R.make_reduction(fn), R.make_reduction(_refuses_zeros)]
    update = _native.load().update_reductions
    ones = torch.ones(2, 3)
    update(reds, ones, 0)
    with pytest.raises(ActivationScopeError, match="a zero among the rows"):
        update(reds, torch.tensor([[1.0, 0.0, 2.0]]), 2)  # log 0: -inf of finite rows, then refused
    assert reds[0].made_nonfinite is False
    assert torch.equal(reds[0].result()["value"], torch.zeros(3, dtype=torch.float64))  # (log 1 = 0)
    update(reds, ones, 2)
    assert reds[0].made_nonfinite is False and torch.equal(reds[0].result()["value"], torch.zeros(3, dtype=torch.float64))


def test_the_nonfinite_custom_reduction_warning_as_an_error_comes_after_the_store_is_complete(tmp_path):
    """Under an error filter the warning raises, once the store is committed whole: status
    complete, every row and the reduction's value (inf as the function made it) stored."""
    model = torch.nn.Sequential(_Clone())
    xs = [torch.ones(2, 3), torch.tensor([[1.0, 0.0, 2.0]])]
    with warnings.catch_warnings():
        warnings.simplefilter("error", acs.CaptureWarning)
        with pytest.raises(acs.CaptureWarning, match=r"'log_sum' of hook point '0.output' \(1 of 3 values NaN or inf\)"):
            with acs.ActivationScope(store=tmp_path / "s.zarr", reductions=[log_sum]).track(model):
                for x in xs:
                    model(x)
    st = acs.open_store(tmp_path / "s.zarr")
    assert st.status == "complete" and torch.equal(st["0.output"], torch.cat(xs))
    assert st.reductions["0.output"]["log_sum"].isinf().tolist() == [False, True, False]


def test_a_reduction_of_several_results_read_by_its_name_lists_its_keys(tmp_path):
    """topk and hist keep no value under their own name: reading it (r["top"], as r["mean"]
    reads) names the keys to read, and a misspelt name the one meant, live and stored."""
    import activationscope as acs
    from activationscope.errors import ReductionNotFoundError

    model = torch.nn.Sequential(torch.nn.Linear(3, 4)).eval()
    specs = ["mean", ("top", "topk", {"k": 2}), ("h", "hist", {"lo": -1, "hi": 1, "bins": 4})]
    with acs.ActivationScope(reductions=specs, store=str(tmp_path / "s.zarr")).track(model) as tr:
        with torch.no_grad():
            model(torch.randn(5, 3))
        live = tr.reductions["0.output"]
    stored = acs.open_store(tmp_path / "s.zarr").reductions["0.output"]
    for got in (live, stored):
        with pytest.raises(ReductionNotFoundError, match=r"has no reduction 'top'; 'top' holds several results, read "
                                                         r"each by its key: \['top.row_ids', 'top.values'\]"):
            got["top"]
        with pytest.raises(ReductionNotFoundError, match=r"'h' holds several results, read each by its key: "
                                                         r"\['h.counts', 'h.edges', 'h.nan', 'h.overflow', 'h.underflow'\]"):
            got["h"]
        with pytest.raises(ReductionNotFoundError, match=r"has no reduction 'maen'; did you mean \['mean'"):
            got["maen"]
