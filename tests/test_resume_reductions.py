"""Reductions of a resumed store cover every stored row (issue: resume reductions merged with
the stored state). Reference: the same statistic in plain PyTorch over all rows at once."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from activationscope import ActivationScope, open_store
from acs_testing import SumRows, set_reduction_state


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU())


def _batches(n, rows=8):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(rows, 6, generator=g) * 3 - 1 for _ in range(n)]


def _run(model, path, xs, reductions, *, resume=False, kill=False, include=None, rows="auto"):
    opts = {"resume": True} if resume else {}
    try:
        with ActivationScope(store=path, reductions=reductions, store_options=opts, rows=rows).track(
                model, include=include):
            for x in xs:
                model(x)
            if kill:
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass


def _ref_rows(model, xs):
    with torch.no_grad():
        return torch.cat([model[0](x) for x in xs]).double()


def _check(store, ref, names):
    r = store.reductions["0.output"]
    n = ref.shape[0]
    assert store.n_rows("0.output") == n
    if "mean" in names:
        torch.testing.assert_close(r["mean"], ref.mean(0))
        assert int(r["mean.count"]) == n
    if "var" in names:
        torch.testing.assert_close(r["var"], ref.var(0, correction=0))
    if "min" in names:
        torch.testing.assert_close(r["min"].double(), ref.min(0).values)
    if "max" in names:
        torch.testing.assert_close(r["max"].double(), ref.max(0).values)
    if "nonzero" in names:
        torch.testing.assert_close(r["nonzero"].double(), (ref != 0).double().mean(0))
    if "topk" in names:
        k = r["topk.values"].shape[0]
        want = ref.topk(k, dim=0)
        torch.testing.assert_close(r["topk.values"].double(), want.values)
        torch.testing.assert_close(r["topk.row_ids"].long(), want.indices)


NAMES = ["mean", "var", "min", "max", "nonzero", "topk"]


def test_issue_input_32_plus_32_rows(tmp_path):
    model, xs = _model(), _batches(8, rows=4)
    path = tmp_path / "s.zarr"
    _run(model, path, xs[:4], ["mean"])
    _run(model, path, xs[4:], ["mean"], resume=True)
    _check(open_store(path), _ref_rows(model, xs), ["mean"])


@pytest.mark.parametrize("n_resumes", [1, 3])
def test_several_clean_resumes(tmp_path, n_resumes):
    model, xs = _model(), _batches(2 * (n_resumes + 1))
    path = tmp_path / "s.zarr"
    parts = [xs[i:i + 2] for i in range(0, len(xs), 2)]
    _run(model, path, parts[0], NAMES)
    for p in parts[1:]:
        _run(model, path, p, NAMES, resume=True)
    s = open_store(path)
    _check(s, _ref_rows(model, xs), NAMES)
    assert s.partial_reductions == {}


def test_killed_runs_are_rebuilt_from_the_stored_rows(tmp_path):
    # a run that is killed never writes its reductions: the resume folds the stored rows past
    # the last stored state in, so the result is still over every stored row
    model, xs = _model(), _batches(6)
    path = tmp_path / "s.zarr"
    _run(model, path, xs[:2], NAMES)
    _run(model, path, xs[2:4], NAMES, resume=True, kill=True)
    _run(model, path, xs[4:], NAMES, resume=True)
    _check(open_store(path), _ref_rows(model, xs), NAMES)


def test_killed_first_run_and_reduction_added_on_resume(tmp_path):
    model, xs = _model(), _batches(4)
    path = tmp_path / "s.zarr"
    _run(model, path, xs[:2], None, kill=True)          # no reductions at all
    _run(model, path, xs[2:], ["mean", "var"], resume=True)
    _check(open_store(path), _ref_rows(model, xs), ["mean", "var"])


def test_custom_reduction_continues_from_its_state(tmp_path):
    def running_sum(acc: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        s = x.double().sum(0)
        return s if acc is None else acc + s

    model, xs = _model(), _batches(4)
    path = tmp_path / "s.zarr"
    _run(model, path, xs[:2], [running_sum])
    _run(model, path, xs[2:], [running_sum], resume=True)
    s = open_store(path)
    name = next(k for k in s.reductions["0.output"] if "." not in k)
    torch.testing.assert_close(s.reductions["0.output"][name], _ref_rows(model, xs).sum(0))


def test_reduction_not_continued_is_shown_as_partial(tmp_path):
    model, xs = _model(), _batches(4)
    path = tmp_path / "s.zarr"
    _run(model, path, xs[:2], ["mean"])
    _run(model, path, xs[2:], None, resume=True)   # the resume does not continue "mean"
    s = open_store(path)
    assert "0.output" not in s.reductions            # never shown as if it covered every row
    assert s.partial_reductions["0.output"]["mean"] == (16, 32)
    info = s.info()
    assert info["partial_reductions"]["0.output"]["mean"] == {"n_rows": 16, "of_rows": 32}
    from activationscope.cli import format_info

    assert "mean (partial: 16 of 32 rows)" in format_info(info, str(path))


def test_report_does_not_use_a_partial_reduction(tmp_path):
    from activationscope.analysis.report import hook_point_stats

    model, xs = _model(), _batches(4)
    path = tmp_path / "s.zarr"
    _run(model, path, xs[:2], ["var", "nonzero"])
    _run(model, path, xs[2:], None, resume=True)
    stats = hook_point_stats(open_store(path), "0.output")
    assert stats.source.startswith("rows")
    torch.testing.assert_close(stats.mean, _ref_rows(model, xs).mean(0))


EMPTY_SPECS = ["mean", "var", "std", "min", "max", "absmax", "l2", "nonzero", "cov", "topk"]


def test_a_reduction_that_saw_no_rows_has_only_its_count(tmp_path):
    """No value is made up for a reduction over no rows: live, stored and read back, only
    ``<name>.count`` (0) is there, and asking for the value says why it is missing."""
    import activationscope as acs

    model, path = _model(), tmp_path / "s.zarr"
    with ActivationScope(store=path, reductions=EMPTY_SPECS).track(model) as tr, torch.no_grad():
        model(torch.randn(0, 6))  # an empty batch: no rows
        live = tr.reductions["0.output"]
    store = open_store(path)
    for got in (live, store.reductions["0.output"]):
        assert dict(got).keys() == {f"{n}.count" for n in EMPTY_SPECS}
        assert all(int(v) == 0 and v.dtype == torch.int64 for v in got.values())
        with pytest.raises(acs.ReductionNotFoundError, match=r"'mean' of hook point '0.output' saw no rows"):
            got["mean"]
    # resuming adds rows: the reductions then cover exactly those rows
    xs = _batches(3)
    _run(model, path, xs, ["mean", "var", "min", "max", "nonzero", "topk"], resume=True)
    _check(open_store(path), _ref_rows(model, xs), NAMES)


def _hist_ref(ref, lo, hi, bins):
    """Counts per feature, (d, bins): values in [lo, hi], the last bin closed (torch.histc)."""
    cols = []
    for j in range(ref.shape[1]):
        col = ref[:, j]
        cols.append(torch.histc(col[(col >= lo) & (col <= hi)], bins, lo, hi).long())
    return torch.stack(cols)


@pytest.mark.parametrize("kill", [False, True])
def test_a_resume_with_other_hist_options_recomputes_over_every_row(tmp_path, kill):
    """The stored state of another range / bin count is not merged into: the reduction is
    computed again, with the new options, over every stored row."""
    model, xs = _model(), _batches(6)
    path = tmp_path / "s.zarr"
    _run(model, path, xs[:4], [("h", "hist", {"lo": -1, "hi": 1, "bins": 4})])
    _run(model, path, xs[4:5], [("h", "hist", {"lo": -2, "hi": 2, "bins": 4})], resume=True, kill=kill)
    _run(model, path, xs[5:], [("h", "hist", {"lo": -3, "hi": 3, "bins": 6})], resume=True)
    s = open_store(path)
    r = s.reductions["0.output"]
    torch.testing.assert_close(r["h.edges"].double(), torch.linspace(-3, 3, 7, dtype=torch.float64))
    assert r["h.counts"].shape == (5, 6)
    torch.testing.assert_close(r["h.counts"].long(), _hist_ref(_ref_rows(model, xs), -3, 3, 6))
    assert s.attrs["reductions"]["0.output"]["h.counts"]["n_rows"] == 48
    assert s.partial_reductions == {}


def test_a_resume_with_another_topk_k_recomputes_over_every_row(tmp_path):
    model, xs = _model(), _batches(4)
    path = tmp_path / "s.zarr"
    _run(model, path, xs[:3], [("t", "topk", {"k": 2})])
    _run(model, path, xs[3:], [("t", "topk", {"k": 5})], resume=True)
    r = open_store(path).reductions["0.output"]
    want = _ref_rows(model, xs).topk(5, dim=0)
    torch.testing.assert_close(r["t.values"].double(), want.values)
    torch.testing.assert_close(r["t.row_ids"].long(), want.indices)


def test_a_resume_with_another_kind_under_the_same_name_keeps_none_of_the_old_keys(tmp_path):
    model, xs = _model(), _batches(4)
    path = tmp_path / "s.zarr"
    _run(model, path, xs[:2], [("s", "hist", {"lo": -1, "hi": 1, "bins": 4})])
    _run(model, path, xs[2:], [("s", "max")], resume=True)
    s = open_store(path)
    r = s.reductions["0.output"]
    assert sorted(r) == ["s", "s.count"]
    torch.testing.assert_close(r["s"].double(), _ref_rows(model, xs).max(0).values)
    assert s.verify() == []


def _files(path):
    return {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("more", [True, False])
def test_a_resume_with_a_reductions_pattern_that_selects_nothing_leaves_the_store_as_it_was(tmp_path, more):
    """Refused (HookPointNotFoundError) whether the resume captures more rows or none."""
    import activationscope as acs

    model, xs = _model(), _batches(3)
    path = tmp_path / "s.zarr"
    _run(model, path, xs[:2], {"0.output": ["mean"]})
    before = _files(path)
    with pytest.raises(acs.HookPointNotFoundError, match=r"'1\.nothing' selects no hook point.*'0\.output'"):
        _run(model, path, xs[2:] if more else [], {"0.output": ["max"], "1.nothing": ["mean"]}, resume=True)
    assert _files(path) == before
    s = open_store(path)
    assert s.status == "complete" and s.n_samples == 16
    torch.testing.assert_close(s.reductions["0.output"]["mean"], _ref_rows(model, xs[:2]).mean(0))


@pytest.mark.parametrize("more_rows", [False, True])
def test_a_resume_that_changes_a_reductions_shape_or_kind_leaves_no_old_array(tmp_path, more_rows):
    """A resumed reduction whose results have another shape (``per_feature=0``: another
    chunk layout) or another kind under the same name: the old arrays are removed, the new
    ones written, the store complete and verified, the values those of every stored row."""
    import zarr

    model, path = _model(), tmp_path / "s.zarr"
    xs = _batches(4)
    _run(model, path, xs[:2], [("m", "mean"), ("h", "hist", {"lo": -1, "hi": 1, "bins": 4}), ("c", "cov")])
    node = path / "reductions" / "0.output"
    assert (node / "h.counts").is_dir() and (node / "m" / "c" / "0").is_file()
    _run(model, path, xs[2:] if more_rows else [],
         [("m", "mean", {"per_feature": False}), ("h", "mean"), ("c", "cov", {"ddof": 1})], resume=True)
    store = open_store(path)
    assert store.status == "complete" and store.verify() == []
    x = store["0.output"].double()
    assert x.shape[0] == 8 * (4 if more_rows else 2)
    r = store.reductions["0.output"]
    torch.testing.assert_close(r["m"], x.mean(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(r["h"], x.mean(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(r["c"], torch.cov(x.T, correction=1), rtol=1e-10, atol=1e-12)
    on_disk = {p.name for p in node.iterdir() if p.is_dir()}
    assert not any(n.startswith("h.") and n != "h.count" and not n.startswith("h.state.") for n in on_disk), on_disk
    assert {"h.counts", "h.edges", "h.underflow", "h.overflow", "h.nan"}.isdisjoint(on_disk)
    assert (node / "m" / "c").is_file()  # a 0-d result: chunk "c" where the 1-d one had "c/0"
    group = zarr.open_group(str(path / "reductions" / "0.output"), mode="r")
    assert set(group.array_keys()) == on_disk


def _calls_and_sum(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """[number of batches seen, sum of every value]: tells a loaded state from a recomputation."""
    s = torch.stack([torch.ones((), dtype=torch.float64), x.double().sum()])
    return s if acc is None else acc + s


def _calls_and_max(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    s = torch.stack([torch.ones((), dtype=torch.float64), x.double().max()])
    return s if acc is None else torch.stack([acc[0] + 1, torch.maximum(acc[1], s[1])])


def test_a_custom_reduction_resumed_as_another_function_is_recomputed_over_every_row(tmp_path):
    """Every custom reduction has kind 'script': the state of another function stored under
    the same name was loaded and continued (a max folded onto a sum of the first rows)."""
    from activationscope.reductions import script_reduction

    model, xs = _model(), _batches(4)
    path = tmp_path / "s.zarr"
    first = script_reduction(_calls_and_sum, tmp_path / "a" / "first.pt")
    again = script_reduction(_calls_and_sum, tmp_path / "b" / "again.pt")  # the same program, saved anew
    other = script_reduction(_calls_and_max, tmp_path / "c" / "other.pt")
    _run(model, path, xs[:2], [("agg", first)])
    _run(model, path, xs[2:3], [("agg", again)], resume=True)
    ref = _ref_rows(model, xs)
    got = open_store(path).reductions["0.output"]["agg"]
    torch.testing.assert_close(got, torch.stack([torch.tensor(3.0, dtype=torch.float64), ref[:24].sum()]))  # continued
    _run(model, path, xs[3:], [("agg", other)], resume=True)
    got = open_store(path).reductions["0.output"]["agg"]
    assert got[1] == ref.max()                 # over every row, not max(sum of 24 rows, the last batch)
    assert got[0] == 4                         # the stored rows read back forward by forward, then the last batch


def _batch_max_of_means(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """[batches seen, largest batch mean of unit 0]: depends on how the rows were cut."""
    s = torch.stack([torch.ones((), dtype=torch.float64), x[:, 0].double().mean()])
    return s if acc is None else torch.stack([acc[0] + 1, torch.maximum(acc[1], s[1])])


@pytest.mark.parametrize("token_rows", [False, True])
def test_a_custom_reduction_rebuilt_on_resume_sees_the_captured_batches(tmp_path, token_rows):
    """A killed run leaves no reduction state: the resume read the stored rows back in blocks of
    up to 65536 rows and fed each block as one batch, so a custom reduction that depends on its
    batches (a count of batches, a maximum of batch means) silently differed from the
    uninterrupted run. It is fed the stored rows forward by forward, as the capture fed them."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU())
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    sizes = [3, 5, 2, 4, 6]
    xs = [torch.randn(n, 4, 6, generator=g) if token_rows else torch.randn(n, 6, generator=g) for n in sizes]
    masks = [torch.arange(4).expand(n, 4) < torch.randint(1, 5, (n, 1), generator=g) for n in sizes]
    reds = [("agg", _batch_max_of_means), "mean"]

    def run(path, batches, *, resume=False, kill=False):
        try:
            scope = ActivationScope(store=path, reductions=reds, store_options={"resume": resume} if resume else {})
            with scope.track(model, include=["0"]) as tr, torch.no_grad():
                for i in batches:
                    if token_rows:
                        tr.set_batch(attention_mask=masks[i])
                    model(xs[i])
                if kill:
                    raise KeyboardInterrupt
        except KeyboardInterrupt:
            pass

    run(tmp_path / "whole.zarr", range(5))
    run(tmp_path / "s.zarr", range(3), kill=True)          # its reductions are never written
    run(tmp_path / "s.zarr", range(3, 5), resume=True)
    whole, resumed = open_store(tmp_path / "whole.zarr"), open_store(tmp_path / "s.zarr")
    rows = resumed["0.output"].double()
    torch.testing.assert_close(rows, whole["0.output"].double(), rtol=0, atol=0)
    assert resumed.reductions["0.output"]["agg"].tolist() == whole.reductions["0.output"]["agg"].tolist()
    assert whole.reductions["0.output"]["agg"][0] == 5
    batch = torch.as_tensor(resumed.row_table("token" if token_rows else "sample").column("batch").to_numpy())
    ref = max(rows[batch == b, 0].mean() for b in batch.unique())
    assert resumed.reductions["0.output"]["agg"][1] == ref


def test_an_eager_custom_reduction_is_recomputed_on_resume(tmp_path):
    """An eager reduction has no program to compare: its stored state is never continued."""
    import warnings

    from activationscope.reductions import EagerFallbackWarning

    factor = 1.0  # a closed-over Python float: runs eagerly

    def eager_sum(acc, x):
        s = x.double().sum(0) * factor
        return s if acc is None else acc + s

    model, xs = _model(), _batches(4)
    path = tmp_path / "s.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EagerFallbackWarning)
        _run(model, path, xs[:2], [("agg", eager_sum)])
        factor = 2.0
        _run(model, path, xs[2:], [("agg", eager_sum)], resume=True)
    torch.testing.assert_close(open_store(path).reductions["0.output"]["agg"], 2 * _ref_rows(model, xs).sum(0))


ALL_BUILTINS = [("mean", {}), ("var", {"ddof": 1}), ("std", {}), ("min", {}), ("max", {}), ("absmax", {}), ("l2", {}),
                ("nonzero", {}), ("hist", {"lo": -2, "hi": 2, "bins": 5}), ("cov", {}), ("topk", {"k": 3}),
                ("topk", {"k": 40})]


@pytest.mark.parametrize("per_feature", [1, 0])
@pytest.mark.parametrize("storage_dtype", [None, torch.bfloat16])
def test_a_stored_builtin_state_is_continued_without_reading_rows_back(tmp_path, monkeypatch, per_feature,
                                                                      storage_dtype):
    """The check of a stored state against the rows it claims never refuses a state the
    reduction wrote itself: every built-in continues from it."""
    from activationscope.store.writer import StoreWriter

    specs = [(f"r{i}", kind, {**opts, "per_feature": per_feature}) for i, (kind, opts) in enumerate(ALL_BUILTINS)]
    model, xs = _model(), _batches(4)
    path = tmp_path / "s.zarr"
    with ActivationScope(store=path, reductions=specs, storage_dtype=storage_dtype).track(model), torch.no_grad():
        for x in xs[:2]:
            model(x)
    read_back = []
    monkeypatch.setattr(StoreWriter, "read_committed_rows", lambda self, *a: read_back.append(a))
    with ActivationScope(store=path, reductions=specs, storage_dtype=storage_dtype,
                         store_options={"resume": True}).track(model), torch.no_grad():
        for x in xs[2:]:
            model(x)
    assert read_back == []
    s = open_store(path)
    rows = s["0.output"].double()
    r = s.reductions["0.output"]
    flat = rows if per_feature else rows.reshape(-1)
    torch.testing.assert_close(r["r0"], flat.mean(0))
    torch.testing.assert_close(r["r1"], flat.var(0, correction=1))
    assert int(r["r0.count"]) == flat.shape[0]
    torch.testing.assert_close(r["r10.values"].double(), flat.topk(3, 0).values)


@pytest.mark.parametrize("name, key, value", [
    ("mean", "count", torch.tensor(10 ** 15)),
    ("mean", "count", torch.tensor(0)),
    ("topk", "row_ids", torch.full((10, 5), 999)),
    ("var", "m2", torch.full((5,), -1.0, dtype=torch.float64)),
    ("hist", "counts", torch.full((5, 4), -3)),
    ("hist", "counts", torch.full((5, 4), 10 ** 12)),
    ("cov", "comoment", -torch.eye(5, dtype=torch.float64)),
    ("absmax", "value", torch.full((5,), -1.0, dtype=torch.float64)),
])
def test_a_stored_state_that_does_not_fit_its_rows_is_recomputed(tmp_path, name, key, value):
    """A state whose count is not the rows it claims, whose row ids point past the stored
    rows, or with a negative count, sum of squares, co-moment diagonal or absmax was continued
    (a mean over 10**15 rows, row ids 999 of a 32-row store, a negative variance, a cov whose
    diagonal is short of the variance, an absmax of the resumed rows only); it is now computed
    again."""
    model, xs = _model(), _batches(4, rows=5)
    path = tmp_path / "s.zarr"
    specs = ["mean", "var", "topk", ("hist", "hist", {"lo": -1, "hi": 1, "bins": 4}), "cov", "absmax"]
    _run(model, path, xs[:2], specs)
    set_reduction_state(path, name, key, value)
    assert open_store(path).verify() == []
    _run(model, path, xs[2:], specs, resume=True)
    ref = _ref_rows(model, xs)
    s = open_store(path)
    _check(s, ref, ["mean", "var", "topk"])
    torch.testing.assert_close(s.reductions["0.output"]["hist.counts"].long(), _hist_ref(ref, -1, 1, 4))
    torch.testing.assert_close(s.reductions["0.output"]["cov"], torch.cov(ref.T, correction=0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s.reductions["0.output"]["absmax"], ref.abs().amax(0), rtol=0, atol=0)


def test_reductions_of_an_incomplete_store_say_they_come_at_close(tmp_path):
    import activationscope as acs

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    path = tmp_path / "inc.zarr"
    tracker = acs.ActivationScope(store=str(path), reductions=["mean"]).track(model)
    tracker.__enter__()
    with torch.no_grad():
        x = torch.randn(3, 2)
        model(x)
    tracker.writer.commit()
    opened = acs.open_store(path)
    with pytest.raises(KeyError, match=r"'0.output' has no reductions in this store \(yet: the store is 'incomplete' "
                                       r"as this handle last read it, and a capture writes its reductions when it "
                                       r"closes; store.refresh\(\) sees them once it has\)"):
        opened.reductions["0.output"]
    tracker.__exit__(None, None, None)
    with torch.no_grad():
        torch.testing.assert_close(acs.open_store(path).reductions["0.output"]["mean"], model(x).double().mean(0))
        # the handle opened while the capture ran: the refresh its message names shows them
        opened.refresh()
        assert opened.status == "complete"
        torch.testing.assert_close(opened.reductions["0.output"]["mean"], model(x).double().mean(0))


def test_reductions_of_a_killed_capture_say_to_resume_it(tmp_path):
    """A capture killed before its close (SIGKILL, os._exit) wrote no reductions and never
    will: the message names that and the resume that computes them, not a refresh() that would
    wait for a close no process is going to make."""
    import subprocess
    import sys
    import textwrap

    import activationscope as acs

    path = tmp_path / "killed.zarr"
    script = textwrap.dedent(f"""
        import os, torch
        import activationscope as acs
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(2, 2))
        tracker = acs.ActivationScope(store={str(path)!r}, reductions=["mean"]).track(model)
        tracker.__enter__()
        with torch.no_grad():
            model(torch.randn(3, 2))
        tracker.writer.commit()
        os._exit(0)                                     # killed: no close
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    opened = acs.open_store(path)
    assert opened.status == "incomplete"
    with pytest.raises(KeyError) as e:
        opened.reductions["0.output"]
    message = str(e.value)
    assert "no capture is writing it: its capture stopped before it closed" in message
    assert "resume=True with the reductions= it was captured with" in message
    assert "store.refresh() sees them" not in message
    # the Python spelling (ActivationScope itself has no resume=, and store_options needs store=: the
    # call without it was refused, "store_options={'resume': True} needs store=") and the command line's
    assert f"ActivationScope(store={opened.path!r}, store_options={{'resume': True}}, reductions=...)" in message, \
        message
    assert opened.path == str(path)
    assert "capture --resume --reduce" in message, message
    # ... and following it gives the reductions over every stored row
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with torch.no_grad(), acs.ActivationScope(store=path, store_options={"resume": True},
                                              reductions=["mean"]).track(model):
        model(torch.randn(4, 2))
    resumed = acs.open_store(path)
    assert resumed.status == "complete"
    rows = torch.as_tensor(resumed["0.output"][:])
    torch.testing.assert_close(resumed.reductions["0.output"]["mean"].to(rows.dtype), rows.double().mean(0).to(rows.dtype))


def test_a_resume_whose_close_fails_on_a_full_disk_is_resumed_again(tmp_path, monkeypatch):
    """A close writes the reductions (results and states) before the manifests and the root:
    a full disk after them (a manifest too large to write) left state
    files the root did not list (crc32c mismatch), and the next resume refused them
    (StoreCorruptError) although every committed row was intact. That resume now computes each
    reduction again from the committed rows and ends with reductions over every row."""
    import errno

    from activationscope.errors import StoreError
    from activationscope.store._backend import LocalBackend

    model, xs = _model(), _batches(6, rows=5)
    path = tmp_path / "s.zarr"
    _run(model, path, xs[:2], ["mean", "var"])
    real_set = LocalBackend.set
    failing = {"on": False}

    def set_or_fail(self, key, data):
        if failing["on"] and key.endswith("manifest.json"):
            raise StoreError(f"writing {key!r} failed: {errno.errorcode[errno.EFBIG]} (File too large)")
        return real_set(self, key, data)

    monkeypatch.setattr(LocalBackend, "set", set_or_fail)
    with pytest.raises(StoreError, match="File too large"):
        with ActivationScope(store=path, reductions=["mean", "var"], store_options={"resume": True}).track(model) as tr:
            for x in xs[2:4]:
                model(x)
            failing["on"] = True  # the forwards are captured; the close's writes hit the full disk
    failing["on"] = False
    s = open_store(path)
    assert s.status == "incomplete" and s.n_rows("0.output") == 10  # the committed rows, intact
    torch.testing.assert_close(s["0.output"].double(), _ref_rows(model, xs[:2]), rtol=0, atol=0)
    # the reductions the root lists are those over the committed rows, as they were
    assert s.verify() == []
    _check(s, _ref_rows(model, xs[:2]), ["mean", "var"])
    assert not list(path.rglob("*.committed.tmp"))

    _run(model, path, xs[2:], ["mean", "var"], resume=True)  # from the committed samples on
    s = open_store(path)
    assert s.status == "complete" and s.verify() == []
    _check(s, _ref_rows(model, xs), ["mean", "var"])


_KILL_IN_CLOSE = r"""
import os, sys, torch
from activationscope import ActivationScope
from activationscope.store.writer import StoreWriter

sys.path.insert(0, sys.argv[3])
from test_resume_reductions import _batches, _model

path, where, k = sys.argv[1], sys.argv[2], int(sys.argv[4])
model, xs = _model(), _batches(6, rows=5)
real_add, real_root = StoreWriter.add_reductions, StoreWriter._root_attrs
state = {"added": 0}

def add(self, *a, **k):
    real_add(self, *a, **k)
    state["added"] += 1
    if where == "between" and state["added"] == 2:
        os._exit(9)  # killed between the reductions' writes

def root(self, status):
    if where == "before_root" and state["added"]:
        os._exit(9)  # killed after the reductions, before the root lists them
    return real_root(self, status)

real_drop = StoreWriter._drop_kept_reductions

def drop(self, restore):
    if where == "after_root" and state["added"] and not restore:
        os._exit(9)  # killed after the root lists the rewrite, before the kept files go
    return real_drop(self, restore)

StoreWriter.add_reductions, StoreWriter._root_attrs, StoreWriter._drop_kept_reductions = add, root, drop
with ActivationScope(store=path, reductions=["mean", "var", ("topk", "topk", {"k": k})],
                     store_options={"resume": True}).track(model):
    for x in xs[2:4]:
        model(x)
"""


@pytest.mark.parametrize("where", ["between", "before_root", "after_root"])
def test_a_resume_killed_while_it_writes_its_reductions_keeps_the_committed_ones(tmp_path, where):
    """A resume's close rewrites the reductions in place, then writes the root that lists
    them: a kill in between left reduction files that failed their crc32c (reading them and
    verify() said the store was damaged) until another resume recomputed them. The committed
    files are now kept until the root lists the rewrite: readers read them meanwhile, and the
    next resume puts them back."""
    import subprocess
    import sys
    from pathlib import Path

    model, xs = _model(), _batches(6, rows=5)
    path = tmp_path / "s.zarr"
    _run(model, path, xs[:2], ["mean", "var", "topk"])  # (topk: k=10 by default)
    out = subprocess.run([sys.executable, "-c", _KILL_IN_CLOSE, str(path), where, str(Path(__file__).parent), "10"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 9, out.stderr[-2000:]
    assert list(path.rglob("*.committed.tmp"))  # (the kill left the kept files)
    s = open_store(path)
    done = 4 if where == "after_root" else 2  # (the root listing the resumed batches was written)
    assert s.status == ("complete" if where == "after_root" else "incomplete")
    assert s.n_rows("0.output") == 5 * done and s.verify() == []
    _check(s, _ref_rows(model, xs[:done]), ["mean", "var", "topk"])
    s.save(tmp_path / "copy.zarr")  # a copy holds the files a reader reads
    copy = open_store(tmp_path / "copy.zarr")
    assert copy.verify() == [] and not list((tmp_path / "copy.zarr").rglob("*.tmp"))
    _check(copy, _ref_rows(model, xs[:done]), ["mean", "var", "topk"])
    _run(model, path, xs[done:], ["mean", "var", "topk"], resume=True)  # from the committed samples on
    s = open_store(path)
    assert s.status == "complete" and s.verify() == []
    _check(s, _ref_rows(model, xs), ["mean", "var", "topk"])
    assert not list(path.rglob("*.committed.tmp"))


def test_a_resume_killed_after_it_removed_a_reduction_of_another_shape_keeps_the_committed_one(tmp_path):
    """A resumed ``topk`` with another ``k`` removes the committed arrays (another shape)
    before writing its own: killed before the root, the committed ones are read meanwhile
    and put back by the next resume, which then continues with the k it asks for."""
    import subprocess
    import sys
    from pathlib import Path

    model, xs = _model(), _batches(6, rows=5)
    path = tmp_path / "s.zarr"
    _run(model, path, xs[:2], ["mean", "var", ("topk", "topk", {"k": 3})])
    out = subprocess.run([sys.executable, "-c", _KILL_IN_CLOSE, str(path), "before_root", str(Path(__file__).parent),
                          "5"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 9, out.stderr[-2000:]
    s = open_store(path)
    assert s.status == "incomplete" and s.verify() == []
    assert s.reductions["0.output"]["topk.values"].shape == (3, 5)
    _check(s, _ref_rows(model, xs[:2]), ["mean", "var", "topk"])
    _run(model, path, xs[2:], ["mean", "var", ("topk", "topk", {"k": 5})], resume=True)
    s = open_store(path)
    assert s.status == "complete" and s.verify() == []
    assert s.reductions["0.output"]["topk.values"].shape == (5, 5)
    _check(s, _ref_rows(model, xs), ["mean", "var", "topk"])
    assert not list(path.rglob("*.committed.tmp"))


def test_a_resume_never_reads_a_stored_script_far_larger_than_its_own_whole(tmp_path, monkeypatch):
    """A stored ``.pt`` far larger than the resumed script cannot be the same program: it is
    not read (a planted file of up to 4 GiB was read whole into memory to compare them), and
    the reduction is computed again over every row."""
    import json

    from activationscope.reductions import script_reduction
    from activationscope.store import _format as F

    model, xs = _model(), _batches(3)
    path = tmp_path / "s.zarr"
    first = script_reduction(_calls_and_sum, tmp_path / "a" / "first.pt")
    _run(model, path, xs[:2], [("agg", first)])
    root = json.loads((path / "zarr.json").read_text())
    entry = root["attributes"]["activationscope"]["reductions"]["0.output"]["agg"]
    key = entry["script"]
    with open(path / key, "r+b") as f:
        f.truncate(64 << 20)  # (sparse: no disk used)
    crc = 0
    with open(path / key, "rb") as f:
        while piece := f.read(16 << 20):
            crc = F.crc32c(piece, crc)
    entry["crc32c"][key] = crc  # the planted file's: its checksum is no defence
    (path / "zarr.json").write_text(json.dumps(root))
    from acs_testing import record_biggest_pread

    biggest = record_biggest_pread(monkeypatch)
    _run(model, path, xs[2:], [("agg", first)], resume=True)
    monkeypatch.undo()
    assert biggest[0] <= 16 << 20
    got = open_store(path).reductions["0.output"]["agg"]
    assert got[0] == 3  # recomputed: the stored rows read back forward by forward, then the last batch
    torch.testing.assert_close(got[1], _ref_rows(model, xs).sum())


def test_a_custom_reduction_file_replaced_during_the_capture_stores_the_program_that_ran(tmp_path):
    """The ``.pt`` given as a reduction was read again at the close to be kept in the store: a
    file replaced meanwhile by another program (the reduction edited and saved again to the
    same path while a capture ran) was stored as the program of a state the first one made, and
    a resume with the new file took it as the same program and continued that state (a max
    folded onto a sum). The store keeps the bytes of the program that ran."""
    from activationscope.reductions import script_reduction

    model, xs = _model(), _batches(4)
    path = tmp_path / "s.zarr"
    pt = tmp_path / "agg.pt"
    script_reduction(_calls_and_sum, pt)
    ran = pt.read_bytes()
    with ActivationScope(store=path, reductions=[("agg", str(pt))]).track(model):
        model(xs[0])
        script_reduction(_calls_and_max, pt)  # edited and saved again while the capture runs
        model(xs[1])
    store = open_store(path)
    assert store.reduction_script("0.output", "agg") == ran
    ref = _ref_rows(model, xs)
    torch.testing.assert_close(store.reductions["0.output"]["agg"],
                               torch.stack([torch.tensor(2.0, dtype=torch.float64), ref[:16].sum()]))
    _run(model, path, xs[2:], [("agg", str(pt))], resume=True)
    got = open_store(path).reductions["0.output"]["agg"]
    assert got[1] == ref.max() and got[0] == 4  # recomputed over the stored rows (two forwards), then two batches


def test_a_fifo_at_a_stored_reduction_script_is_recomputed_over_every_row_on_resume(tmp_path):
    """A FIFO where the root lists a custom reduction's ``.pt`` (no regular file: no program to
    compare, never read) is taken as a missing script: the resume computes the reduction again
    over every stored row and writes the script anew (it raised StoreCorruptError at the
    resume's first forward, telling to restore the store)."""
    import os

    from activationscope.reductions import script_reduction

    model, xs = _model(), _batches(4)
    path = tmp_path / "s.zarr"
    pt = script_reduction(_calls_and_sum, tmp_path / "agg.pt")
    _run(model, path, xs[:2], [("agg", str(pt))])
    key = path / "reductions" / "0.output" / "agg.pt"
    key.unlink()
    os.mkfifo(key)
    _run(model, path, xs[2:], [("agg", str(pt))], resume=True)
    store = open_store(path)
    ref = _ref_rows(model, xs)
    assert store.status == "complete" and store.verify() == []
    got = store.reductions["0.output"]["agg"]
    assert got[0] == 4 and torch.allclose(got[1], ref.sum())  # the stored rows read back forward by forward, then two
    assert store.reduction_script("0.output", "agg") == pt.read_bytes()


class _Plus0(torch.nn.Module):
    def forward(self, x):
        return x + 0


def _int_batches(dtype=torch.int64):
    g = torch.Generator().manual_seed(5)
    hi = 2 ** 62 if dtype == torch.int64 else 2 ** 30
    xs = [torch.randint(-hi, hi, (5, 3), generator=g, dtype=dtype) for _ in range(4)]
    if dtype == torch.int64:  # values float64 cannot tell apart: 2**60 + 1 and 2**60 + 3 round to 2**60
        xs[0][0] = torch.tensor([2 ** 60 + 1, -(2 ** 60) - 1, 2 ** 60 + 1])
        xs[3][1] = torch.tensor([2 ** 60 + 3, -(2 ** 60) - 3, 2 ** 60 + 2])
    return xs


INT_SPECS = ["min", "max", ("topk", "topk", {"k": 3}), ("top_all", "topk", {"k": 2, "per_feature": 0}), "mean"]


def _check_int(r, ref):
    assert r["min"].dtype == r["max"].dtype == r["topk.values"].dtype == torch.int64
    assert torch.equal(r["min"], ref.amin(0).long()) and torch.equal(r["max"], ref.amax(0).long())
    assert torch.equal(r["topk.values"], ref.topk(3, 0).values.long())
    assert torch.equal(r["topk.row_ids"], ref.topk(3, 0).indices)
    assert torch.equal(r["top_all.values"], ref.reshape(-1).topk(2).values.long())
    torch.testing.assert_close(r["mean"], ref.double().mean(0))  # mean of integers: float64


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=str)
def test_integer_rows_keep_exact_int64_min_max_topk_across_a_resume(tmp_path, monkeypatch, dtype):
    """min / max / topk of integer rows are int64, exact beyond 2**53 (float64 would make
    2**60 + 1 and 2**60 + 3 equal), in the stored results and states, and a resume continues
    the int64 state without reading rows back."""
    from activationscope.store.writer import StoreWriter

    model, xs = torch.nn.Sequential(_Plus0()), _int_batches(dtype)
    path = tmp_path / "s.zarr"
    _run(model, path, xs[:2], INT_SPECS)
    read_back = []
    monkeypatch.setattr(StoreWriter, "read_committed_rows", lambda self, *a: read_back.append(a))
    _run(model, path, xs[2:], INT_SPECS, resume=True)
    assert read_back == []
    s = open_store(path)
    assert s["0.output"].dtype == dtype
    _check_int(s.reductions["0.output"], torch.cat(xs))


def test_a_float64_state_of_integer_rows_from_an_older_store_is_recomputed_exactly(tmp_path):
    """A store written when min / max / topk of integer rows were float64 states: still read
    (its results as they were), and a resume computes those reductions again from the
    stored rows, in int64."""
    model, xs = torch.nn.Sequential(_Plus0()), _int_batches()
    path = tmp_path / "s.zarr"
    _run(model, path, xs[:2], INT_SPECS)
    for name, key in (("min", "value"), ("max", "value"), ("topk", "values"), ("top_all", "values")):
        _as_float64_state(path, name, key)
    old = open_store(path)
    assert old.verify() == []
    assert old.reductions["0.output"]["max"].dtype == torch.float64
    assert torch.equal(old.reductions["0.output"]["max"], torch.cat(xs[:2]).amax(0).double())
    _run(model, path, xs[2:], INT_SPECS, resume=True)
    _check_int(open_store(path).reductions["0.output"], torch.cat(xs))


def _as_float64_state(path, name, key, hook_point="0.output"):
    """Rewrite the int64 result and state ``key`` of reduction ``name`` as float64 arrays,
    checksums and all: what a store written before integer states were kept holds."""
    import json

    from activationscope.store import _format as F

    root_file = path / "zarr.json"
    root = json.loads(root_file.read_text())
    entries = root["attributes"]["activationscope"]["reductions"][hook_point]
    owner = next(e for e in entries.values() if e.get("reduction") == name and "state" in e)
    result = owner if owner["path"].endswith(f"/{name}") else entries[f"{name}.{key}"]
    for entry in (result, owner["state"][key]):
        doc_file = path / entry["path"] / "zarr.json"
        doc = json.loads(doc_file.read_text())
        assert doc["data_type"] == "int64"
        doc["data_type"] = entry["dtype"] = doc["attributes"]["activationscope"]["dtype"] = "float64"
        doc_file.write_text(json.dumps(doc))
        (chunk,) = entry["crc32c"]
        value = torch.frombuffer(bytearray((path / chunk).read_bytes()), dtype=torch.int64)
        data = value.double().numpy().tobytes()
        (path / chunk).write_bytes(data)
        entry["crc32c"] = {chunk: F.crc32c(data)}
    root_file.write_text(json.dumps(root))


def test_rank_stores_of_integer_rows_merge_exact_int64_min_max_topk(tmp_path):
    import activationscope as acs
    from activationscope.store.ranks import commit_ranks

    model, xs = torch.nn.Sequential(_Plus0()), _int_batches()
    for t in (0, 1):
        with ActivationScope(store=str(tmp_path / "r.zarr"), reductions=INT_SPECS,
                             store_options={"process_group": acs.RankStore(t, 2)}).track(model):
            for x in xs[2 * t:2 * t + 2]:
                model(x)
    commit_ranks(str(tmp_path / "r.zarr"))
    _check_int(open_store(tmp_path / "r.zarr").reductions["0.output"], torch.cat(xs))


def test_rank_stores_of_a_custom_reduction_say_how_to_commit_them(tmp_path):
    """A commit of rank stores holding a custom reduction said only that its states "can only be
    merged by the capture that defined it": it now names commit_ranks(make_reduction=), which
    commits them with the user's mergeable reduction, and equals the sum over every row."""
    import warnings

    import activationscope as acs
    from activationscope.errors import StoreError
    from activationscope.reductions import make_reduction
    from activationscope.store.ranks import commit_ranks

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(SumRows())
    model, xs = _model(), _batches(4)
    path = str(tmp_path / "r.zarr")
    for t in (0, 1):
        with ActivationScope(store=path, reductions=[("total", scripted), "mean"],
                             store_options={"process_group": acs.RankStore(t, 2)}).track(model):
            for x in xs[2 * t:2 * t + 2]:
                model(x)
    with pytest.raises(StoreError, match=r"commit_ranks\(.*make_reduction=.*'total'.*None for the others"):
        commit_ranks(path)
    commit_ranks(path, make_reduction=lambda hp, name, entry: make_reduction(scripted) if name == "total" else None)
    red = open_store(path).reductions["0.output"]
    torch.testing.assert_close(red["total"], _ref_rows(model, xs).sum(0))
    torch.testing.assert_close(red["mean"], _ref_rows(model, xs).mean(0))


def _plain_total(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    s = x.double().sum(0)
    return s if acc is None else acc + s


def _eager_total(acc, x):  # TorchScript refuses the global it reads: the eager fallback
    s = x.double().sum(0) * _SCALE
    return s if acc is None else acc + s


_SCALE = 1.0


@pytest.mark.parametrize("spec", ["plain", "scripted function", "module without merge", "eager"])
def test_a_multi_rank_capture_refuses_a_custom_reduction_without_merge_before_writing(tmp_path, spec):
    """A custom reduction with no merge rule was captured into rank stores that no commit could
    ever merge (consolidate and commit_ranks refused them after the whole capture). The capture
    now refuses it before it writes anything, naming the reduction and the fix; a mergeable
    one, and the same function with a store per process, capture as before."""
    import warnings

    import activationscope as acs
    from activationscope.errors import ReductionError

    class _NoMerge(torch.nn.Module):
        def forward(self, acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            s = x.double().sum(0)
            return s if acc is None else acc + s

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fn = {"plain": _plain_total, "eager": _eager_total,
              "scripted function": torch.jit.script(_plain_total),
              "module without merge": torch.jit.script(_NoMerge())}[spec]
        mergeable = torch.jit.script(SumRows())
    model, xs = _model(), _batches(2)
    path = tmp_path / "r.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scope = ActivationScope(store=str(path), reductions={"0.*": ["mean", ("total", fn)]},
                                store_options={"process_group": acs.RankStore(0, 2)})
        with pytest.raises(ReductionError, match=r"'total' has no merge rule.*merge\(a, b\).*process_group.*False"):
            with scope.track(model):
                model(xs[0])
    assert not path.exists()  # nothing written
    with ActivationScope(store=str(path), reductions=[("total", mergeable)],
                         store_options={"process_group": acs.RankStore(0, 2)}).track(model):
        model(xs[0])
    assert open_store(path).status == "incomplete"  # rank 0's rows, rank 1 to come
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ActivationScope(store=str(tmp_path / "one.zarr"), reductions=[("total", fn)]).track(model):
            model(xs[0])
    torch.testing.assert_close(open_store(tmp_path / "one.zarr").reductions["0.output"]["total"],
                               _ref_rows(model, xs[:1]).sum(0))


def test_unmergeable_reductions_names_the_custom_reductions_without_merge():
    import warnings

    from activationscope.capture.reductions import unmergeable_reductions

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mergeable = torch.jit.script(SumRows())
        assert unmergeable_reductions(None) == [] and unmergeable_reductions(["mean", "max"]) == []
        assert unmergeable_reductions({"a.*": ["mean", _plain_total], "b": [("m", mergeable), _plain_total]}) == \
            ["_plain_total"]
        assert unmergeable_reductions([("m", mergeable), ("x", _plain_total), ("y", _eager_total)]) == ["x", "y"]


@pytest.mark.parametrize("token_rows", [False, True])
def test_builtin_reductions_rebuilt_on_resume_equal_an_uninterrupted_run_bit_for_bit(tmp_path, token_rows):
    """A run that raised wrote no reductions: the resume reads the committed rows back. Fed
    forward by forward, as the capture fed them, every built-in gives the very bits of an
    uninterrupted run (read back in other cuts, mean, var, cov and l2 differed in the last
    float64 places)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 16))
    g = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, 50, (5 + i % 3, 7), generator=g) for i in range(9)]
    names = ["mean", "var", "std", "cov", "l2", "min", "max", "absmax", "nonzero", "topk"]

    def run(path, xs, resume=False, kill=False):
        _run(model, path, xs, names, resume=resume, kill=kill, include=["1"], rows="token" if token_rows else "auto")

    run(tmp_path / "whole.zarr", batches)
    run(tmp_path / "resumed.zarr", batches[:5], kill=True)
    run(tmp_path / "resumed.zarr", batches[5:], resume=True)
    whole, resumed = open_store(tmp_path / "whole.zarr"), open_store(tmp_path / "resumed.zarr")
    assert torch.equal(whole["1.output"], resumed["1.output"])
    a, b = whole.reductions["1.output"], resumed.reductions["1.output"]
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _stack(n):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(6, 6) for _ in range(n)])


@pytest.mark.parametrize("killed", [False, True], ids=["states", "rows-read-back"])
def test_a_resume_opens_the_store_a_fixed_number_of_times_whatever_the_hook_points(tmp_path, monkeypatch, killed):
    """A resume continued each hook point's reductions through a store opened anew for that
    hook point (for its stored states, and again for the rows it reads back), each a read and
    check of the whole root, which lists every hook point: quadratic in the hook points (300
    hook points: 15 s before the first forward's end; 1500: minutes). Now one store is opened
    for all of them, and every reduction still covers every row."""
    from activationscope.store import reader as R

    opened: list[int] = []
    init = R.Store.__init__

    def counting(self, *a, **k):
        opened.append(1)
        return init(self, *a, **k)

    xs = _batches(6)
    counts = {}
    for n in (2, 8):
        model, path = _stack(n), tmp_path / f"s{n}.zarr"
        # a killed first run stores no reduction state: the resume reads every row back
        _run(model, path, xs[:3], ["mean", "var"], kill=killed)
        monkeypatch.setattr(R.Store, "__init__", counting)
        opened.clear()
        _run(model, path, xs[3:], ["mean", "var"], resume=True)
        monkeypatch.setattr(R.Store, "__init__", init)
        counts[n] = len(opened)
        st = open_store(path)
        with torch.no_grad():
            h = torch.cat(xs)
            for i, layer in enumerate(model):
                h = layer(h)
                r = st.reductions[f"{i}.output"]
                assert st.n_rows(f"{i}.output") == 48
                torch.testing.assert_close(r["mean"], h.double().mean(0))
                torch.testing.assert_close(r["var"], h.double().var(0, correction=0))
    assert counts[8] == counts[2], counts
