"""Property tests of capture -> store -> read back (Hypothesis, the "ci" profile of conftest.py:
the same examples in every run).

For any batch sizes, number of forwards, row shape, dtype, row kind (sample rows, token rows
under random attention masks), chunk and shard sizes, ``storage_dtype``, reductions and a
resume at any forward: the store's arrays equal plain ``register_forward_hook`` clones, cast
as documented (capture.md, "storage_dtype"), in the documented row order (token rows: the
mask's true entries, sample then position); the row tables name the same samples and
positions; every reduction equals a float64 reference over exactly the stored rows
(reductions.md: moments to float64 round-off, ``assert_close`` at its float64 defaults;
min / max / absmax / hist / topk exactly); ``ActivationDataset`` in store order and
``store[hp][i:j]`` return the same rows. A stop is an exception leaving the ``with`` block, or
(``test_property_killed_then_resumed``) a child process that exits without closing the store.

And the reader against damaged shard files: every read returns the written values or raises
``StoreError``, never other values and never another exception.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import activationscope as acs
from activationscope.data import ActivationDataset, SequentialBatchSampler
from activationscope.errors import StoreError

from acs_testing import plain_hooks

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.bool, torch.int32,
          torch.uint8]
STORAGE_DTYPES = [None, torch.bfloat16, torch.float16, torch.float32, torch.float64]
HIST = {"bins": 4, "lo": -2.0, "hi": 2.0}
TOPK = 3
REDUCTIONS = {  # name -> spec given to the scope (hist and topk: each run may change their options)
    "mean": "mean", "var": "var", "min": "min", "max": "max", "absmax": "absmax",
    "hist": ("hist", "hist", HIST), "topk": ("topk", "topk", {"k": TOPK}), "cov": "cov",
}


def _spec(name, hist_lo, k, per_feature):
    if name == "hist":
        return ("hist", "hist", {**HIST, "lo": hist_lo, "per_feature": per_feature})
    if name == "topk":
        return ("topk", "topk", {"k": k, "per_feature": per_feature})
    return (name, name, {"per_feature": per_feature})
HOOK_POINTS = ["a.output", "b.output", "c.output"]
INPUTS = ["a.input.0", "b.input.0", "c.input.0"]  # capture="both": b's and c's are aliases of a's and b's outputs


def _hook_points(case):
    return sorted(HOOK_POINTS + (INPUTS if case["capture"] == "both" else []))
PROPS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                       HealthCheck.function_scoped_fixture])


class Cast(torch.nn.Module):
    """Turns float32 input into rows of ``dtype`` (a new tensor, never the input)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        if self.dtype == torch.bool:
            return x > 0
        if not self.dtype.is_floating_point:
            return (x * 10).round().clamp(0 if self.dtype == torch.uint8 else -100, 100).to(self.dtype)
        return x.to(self.dtype).clone()


class Next(torch.nn.Module):
    """A second hook point of the same dtype and shape, in a given memory layout."""

    def __init__(self, layout: str = "contiguous") -> None:
        super().__init__()
        self.layout = layout

    def forward(self, a):
        z = ~a if a.dtype == torch.bool else a // 2 + 1 if a.dtype == torch.uint8 else a * 2 + 1
        if self.layout == "transposed":  # the batch dimension not the outermost
            return z.transpose(0, -1).contiguous().transpose(0, -1)
        if self.layout == "strided":  # every other element of a wider tensor
            return torch.stack([z, z], dim=-1)[..., 0]
        if self.layout == "expanded" and len(z):  # stride 0: every row the first one
            return z[:1].expand_as(z)
        if self.layout == "offset":  # a view starting inside its storage
            return torch.cat([z[:1], z])[1:]
        return z


class Pool(torch.nn.Module):
    """Sums out the positions of token inputs: one row per sample (``token_rows`` False)."""

    def forward(self, b, token):
        return (b.sum(1) if token else b.clone()) if b.dtype != torch.bool else (b.any(1) if token else b.clone())


class Model(torch.nn.Module):
    def __init__(self, dtype: torch.dtype, token: bool, layout: str = "contiguous") -> None:
        super().__init__()
        self.a = Cast(dtype)
        self.b = Next(layout)
        self.c = Pool()
        self.token = token

    def forward(self, x):
        b = self.b(self.a(x))
        self.c(b, self.token)
        return b


@st.composite
def cases(draw, stop=False):
    rows = draw(st.sampled_from(["sample", "token"]))
    n_forwards = draw(st.integers(2 if stop else 1, 4))
    # batches of one row, a few, none (an empty batch), or more than a shard
    batches = draw(st.lists(st.integers(1, 4) | st.just(0) | st.integers(5, 24), min_size=n_forwards,
                            max_size=n_forwards))
    positions = draw(st.lists(st.integers(1, 4), min_size=n_forwards, max_size=n_forwards))
    trailing = tuple(draw(st.lists(st.sampled_from([1, 2, 3]), min_size=0, max_size=2)))
    masks = []
    for b, pos in zip(batches, positions):  # per forward: every position real, none, or random (rows all padding too)
        kind = draw(st.sampled_from(["all", "none", "random"]))
        if kind == "all":
            masks.append([[True] * pos for _ in range(b)])
        elif kind == "none":
            masks.append([[False] * pos for _ in range(b)])
        else:
            masks.append(draw(st.lists(st.lists(st.booleans(), min_size=pos, max_size=pos), min_size=b, max_size=b)))
    chunk_rows = draw(st.integers(1, 5))
    # shards of a few chunks by rows (one count, or one per row kind) or by bytes
    shards = draw(st.sampled_from(["rows", "per_kind", "bytes"]))
    if shards == "bytes":
        shard = {"shard_bytes": chunk_rows * draw(st.integers(1, 3)) * draw(st.sampled_from([8, 64, 512]))}
    elif shards == "per_kind":
        shard = {"shard_rows": {kind: chunk_rows * draw(st.integers(1, 3)) for kind in ("sample", "token")}}
    else:
        shard = {"shard_rows": chunk_rows * draw(st.integers(1, 3))}
    stops = sorted(set(draw(st.lists(st.integers(1, max(1, n_forwards - 1)), min_size=int(stop), max_size=2))))
    stops = [k for k in stops if k < n_forwards]
    # each run (the first and every resume) its own reductions: some continued, some added, some
    # dropped, hist / topk with other options
    runs = [{"reductions": draw(st.lists(st.sampled_from(sorted(REDUCTIONS)), unique=True, max_size=4)),
             "hist_lo": draw(st.sampled_from([-2.0, -1.0])), "k": draw(st.sampled_from([TOPK, 1])),
             "per_feature": draw(st.sampled_from([1, 0]))}
            for _ in range(len(stops) + 1)]
    return {
        "dtype": draw(st.sampled_from(DTYPES)), "storage_dtype": draw(st.sampled_from(STORAGE_DTYPES)),
        "rows": rows, "batches": batches, "positions": positions, "trailing": trailing, "masks": masks,
        "chunk_rows": chunk_rows, "shard": shard,
        "compression": draw(st.sampled_from([None, "zstd", "blosc-lz4"])),
        "runs": runs, "stops": stops,
        # each stop: an exception leaving the with block (False), or the with block left as usual
        "closes": draw(st.lists(st.booleans(), min_size=len(stops), max_size=len(stops))),
        "capture": draw(st.sampled_from(["output", "both"])),
        "ids": draw(st.sampled_from(["given", "default"])),
        "layout": draw(st.sampled_from(["contiguous", "transposed", "strided", "expanded", "offset"])),
        # values: any float, or multiples of 1/4 (ties for topk, values on the hist edges), or with NaN / inf
        "values": draw(st.sampled_from(["any", "quarters", "special"])), "seed": draw(st.integers(0, 2**16)),
    }


def _inputs(case):
    g = torch.Generator().manual_seed(case["seed"])
    xs = []
    for b, pos in zip(case["batches"], case["positions"]):
        shape = (b, pos, *case["trailing"]) if case["rows"] == "token" else (b, *case["trailing"])
        x = torch.randn(shape, generator=g) * 1.5
        if case["values"] != "any":
            x = (x * 4).round() / 4
        if case["values"] == "special" and case["dtype"].is_floating_point:
            pick = torch.randint(0, 8, shape, generator=g)
            x = torch.where(pick == 0, float("nan"), torch.where(pick == 1, float("inf"), x))
            x = torch.where(pick == 2, float("-inf"), torch.where(pick == 3, -0.0, x))
        xs.append(x)
    return xs


def _reference(case, xs):
    """Rows of plain register_forward_hook clones, cast and ordered as documented."""
    model = Model(case["dtype"], case["rows"] == "token", case["layout"]).eval()
    recs, _ = plain_hooks(model, lambda: [model(x) for x in xs], list("abc"),
                          side="both" if case["capture"] == "both" else "output")
    got = {hp: recs[hp] for hp in _hook_points(case)}
    out, counts = {}, {}
    for hp, outs in got.items():
        rows = []
        for o, mask in zip(outs, case["masks"]):
            if case["storage_dtype"] is not None and o.is_floating_point():
                o = o.to(case["storage_dtype"])
            token = case["rows"] == "token" and hp != "c.output"
            rows.append(o[torch.tensor(mask, dtype=torch.bool).reshape(o.shape[:2])] if token else o)
        out[hp] = torch.cat(rows)
        counts[hp] = np.cumsum([0] + [len(r) for r in rows]).tolist()  # rows before each forward
    sample_ids, positions, first = {"sample": [], "token": []}, [], 100 if case["ids"] == "given" else 0
    for b, mask in zip(case["batches"], case["masks"]):
        for s in range(b):
            sample_ids["sample"].append(first + s)
            for p, real in enumerate(mask[s]):
                if real:
                    sample_ids["token"].append(first + s)
                    positions.append(p)
        first += b
    return out, sample_ids, positions, counts


def _same(a, b):
    """Bit for bit (-0.0 and 0.0 differ), NaN where NaN: torch's own casts give a NaN other
    bits depending on the tensor's length (float64 -> bfloat16: 0x7fc0, or 0xffff from 16 values)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        nan = torch.isnan(a)
        if not torch.equal(nan, torch.isnan(b)):
            return False
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.contiguous().view(bits), b.contiguous().view(bits)
        return torch.equal(a[~nan], b[~nan])
    return torch.equal(a, b)


class _Stop(Exception):
    pass


def _capture(case, path, xs, forwards, resume, kill=False, run=0, close=False):
    model = Model(case["dtype"], case["rows"] == "token", case["layout"]).eval()
    scope = acs.ActivationScope(
        store=str(path), rows="token" if case["rows"] == "token" else "auto", capture=case["capture"],
        token_rows={"c.output": False, "*": case["rows"] == "token"}, storage_dtype=case["storage_dtype"],
        reductions=[_spec(n, case["runs"][run]["hist_lo"], case["runs"][run]["k"], case["runs"][run]["per_feature"])
                    for n in case["runs"][run]["reductions"]],
        store_options={"chunk_rows": case["chunk_rows"], **case["shard"], "resume": resume,
                       "compression": case["compression"],
                       "commit_interval": 0})
    tracker = scope.track(model).attach()
    committed = tracker.writer.n_samples_committed
    starts = np.cumsum([0, *case["batches"]]).tolist()
    assert committed in starts, (committed, starts)
    first = starts.index(committed)
    with tracker, torch.no_grad():
        for i in range(first, len(xs)):
            if i == forwards:
                if kill:
                    os._exit(0)  # no close, no commit: what a kill -9 leaves
                if close:
                    break
                raise _Stop  # a stop between two forwards: the store keeps the forwards before it
            # sample ids given, or the default counter (it runs on from the committed samples)
            ids = {"sample_ids": list(range(100 + starts[i], 100 + starts[i + 1]))} if case["ids"] == "given" else {}
            if case["rows"] == "token":
                tracker.set_batch(attention_mask=torch.tensor(case["masks"][i], dtype=torch.bool).reshape(
                    case["batches"][i], case["positions"][i]), **ids)
            elif ids:
                tracker.set_batch(**ids)
            model(xs[i])
    return first


def _hist_reference(rows, lo):
    hi, bins = HIST["hi"], HIST["bins"]
    edges = np.linspace(lo, hi, bins + 1)
    idx = np.searchsorted(edges, rows, side="right") - 1
    idx = np.where(rows == hi, bins - 1, idx)
    inside = (rows >= lo) & (rows <= hi)
    counts = np.stack([((idx == k) & inside).sum(0) for k in range(bins)], axis=-1)
    return counts, (rows < lo).sum(0), (rows > hi).sum(0)


def _topk_reference(rows, k):
    """Top-k per feature, ties to the lower row (reductions.md, "Ties")."""
    n = rows.shape[0]
    flat = rows.reshape(n, -1)
    k = min(k, n)
    values = np.empty((k, flat.shape[1]), dtype=flat.dtype)
    ids = np.empty((k, flat.shape[1]), dtype=np.int64)
    for f in range(flat.shape[1]):
        order = sorted(range(n), key=lambda r: (not np.isnan(flat[r, f]), -np.nan_to_num(flat[r, f], nan=0.0), r))[:k]
        values[:, f] = flat[order, f]
        ids[:, f] = order
    return values.reshape(k, *rows.shape[1:]), ids.reshape(k, *rows.shape[1:])


def _check_reductions(store, hp, stored, run, kept, partial):
    """The last run's reductions, over every stored row. Those of a run stopped by an exception
    were never written; those of a closed run that the last one does not continue are kept,
    reported partial when rows came after it (reductions.md, "Merging, saving and resuming")."""
    names = run["reductions"]
    reported = {key.split(".")[0] for key in store.partial_reductions.get(hp, {})}
    assert reported == partial, (hp, store.partial_reductions, partial)
    if not names and not kept:
        assert hp not in store.reductions
        return
    assert {key.split(".")[0] for key in store.reductions[hp]} == set(names) | kept, (hp, list(store.reductions[hp]))
    if not names:
        return
    red = store.reductions[hp]
    n_features = stored[0].numel() if len(stored) else 1
    if not run["per_feature"]:  # every value one observation: as rows of one value each
        stored = stored.reshape(-1)
    n = stored.shape[0]
    if n == 0:
        for name in names:
            assert int(red[f"{name}.count"]) == 0
        return
    integer = not stored.is_floating_point() and stored.dtype != torch.bool
    x = stored.double().numpy()
    close = dict(rtol=1e-7, atol=1e-12, equal_nan=True)  # reductions.md: float64 defaults of assert_close
    exact = dict(rtol=0, atol=0, equal_nan=True)
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf in the references: NaN, as expected
        _check_values(red, stored, x, n, names, run, integer, close, exact, n_features)


def _check_values(red, stored, x, n, names, run, integer, close, exact, n_features):
    for name in names:
        if name == "mean":
            torch.testing.assert_close(red["mean"], torch.from_numpy(np.asarray(x.mean(0))), **close)
        elif name == "var":
            torch.testing.assert_close(red["var"], torch.from_numpy(np.asarray(x.var(0))), **close)
        elif name in ("min", "max"):
            want = stored.amin(0) if name == "min" else stored.amax(0)
            want = want.long() if integer else want.double()
            torch.testing.assert_close(red[name], want, **exact)
        elif name == "absmax":
            torch.testing.assert_close(red["absmax"], torch.from_numpy(np.asarray(np.abs(x).max(0))), **exact)
        elif name == "hist":
            counts, under, over = _hist_reference(x, run["hist_lo"])
            assert torch.equal(red["hist.counts"], torch.from_numpy(counts).long())
            assert torch.equal(red["hist.underflow"], torch.from_numpy(np.asarray(under)).long())
            assert torch.equal(red["hist.overflow"], torch.from_numpy(np.asarray(over)).long())
            assert torch.equal(red["hist.nan"], torch.from_numpy(np.asarray(np.isnan(x).sum(0))).long())
        elif name == "topk":
            values, ids = _topk_reference(stored.long().numpy() if integer else x, run["k"])
            if not run["per_feature"]:  # flat indices: ties to the lower row, then the lower feature
                assert torch.equal(red["topk.feature_ids"], torch.from_numpy(ids % n_features))
                ids = ids // n_features
            assert torch.equal(red["topk.row_ids"], torch.from_numpy(ids))
            torch.testing.assert_close(red["topk.values"], torch.from_numpy(values), **exact)
        elif name == "cov":
            flat = x.reshape(n, -1)
            torch.testing.assert_close(red["cov"], torch.from_numpy(np.atleast_2d(np.cov(flat.T, ddof=0))),
                                       **close)
        assert int(red[f"{name}.count"]) == n, name


def _killed_capture(case, path, k, run):
    """Capture in a child process that exits without closing the store before forward k."""
    src = ("import pickle, sys, warnings; sys.path.insert(0, sys.argv[1]); import test_properties_roundtrip as T; "
           "warnings.simplefilter('ignore'); case = pickle.loads(bytes.fromhex(sys.argv[3])); "
           "T._capture(case, sys.argv[2], T._inputs(case), int(sys.argv[4]), "
           "resume=T.os.path.exists(T.os.path.join(sys.argv[2], 'zarr.json')), kill=True, run=int(sys.argv[5]))")
    env = dict(os.environ,
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    args = [str(Path(__file__).parent), str(path), pickle.dumps(case).hex(), str(k), str(run)]
    r = subprocess.run([sys.executable, "-c", src, *args],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def check_roundtrip(case, path, kill=False):
    xs = _inputs(case)
    want, sample_ids, positions, counts = _reference(case, xs)
    path = Path(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CaptureWarning of (batch, pos) outputs taken as token rows
        done, written = 0, {}  # written: reduction name -> the forward its closed run stopped before
        for run, (k, close) in enumerate(zip(case["stops"], case["closes"])):  # stop before forward k, resume
            if kill:
                _killed_capture(case, path, k, run)
                if not (path / "zarr.json").exists():
                    continue
            elif close:
                _capture(case, path, xs, k, resume=(path / "zarr.json").exists(), run=run, close=True)
                written.update((name, k) for name in case["runs"][run]["reductions"])
                done = k
                continue
            else:
                with pytest.raises(_Stop):
                    _capture(case, path, xs, k, resume=(path / "zarr.json").exists(), run=run)
                if not (path / "zarr.json").exists():  # no row committed: the new store is removed
                    assert counts["a.output"][k] == 0
                    continue
            assert acs.open_store(path).status == "incomplete"
            done = k
        first = _capture(case, path, xs, len(xs), resume=(path / "zarr.json").exists(), run=len(case["stops"]))
        # resumed at the first forward not committed (empty forwards hold no sample: any of them);
        # a kill keeps the forwards committed before it
        starts = np.cumsum([0, *case["batches"]]).tolist()
        assert starts[first] <= starts[done] if kill else starts[first] == starts[done], (first, done)
    store = acs.open_store(path)
    assert store.status == "complete"
    assert store.row_table("sample").column("sample_id").to_pylist() == sample_ids["sample"]
    if case["rows"] == "token":
        table = store.row_table("token")
        assert table.column("sample_id").to_pylist() == sample_ids["token"]
        assert table.column("pos").to_pylist() == positions
    assert sorted(store.hook_points) == _hook_points(case)
    for hp in _hook_points(case):
        got = store[hp]
        assert got.dtype == want[hp].dtype and got.shape == want[hp].shape, (hp, got.dtype, got.shape)
        assert _same(got, want[hp]), hp
        left = {name: k for name, k in written.items() if name not in case["runs"][-1]["reductions"]}
        partial = {name for name, k in left.items() if counts[hp][k] != counts[hp][-1]}
        _check_reductions(store, hp, got, case["runs"][-1], set(left) - partial, partial)
    g = np.random.default_rng(case["seed"])
    groups = [[hp for hp in _hook_points(case) if hp != "c.output"], ["c.output"]]  # one row kind each
    for group in groups:
        ids = sample_ids["token"] if case["rows"] == "token" and group[0] != "c.output" else sample_ids["sample"]
        n = want[group[0]].shape[0]
        for hp in group:  # the units of zero-copy reads cover the rows in order
            segments = store.segments(hp)
            assert segments[0] == 0 and segments[-1] == n and segments == sorted(set(segments)), (hp, segments)
            assert _same(torch.cat([store[hp, a:b] for a, b in zip(segments[:-1], segments[1:])]
                                   + [want[hp][:0]]), want[hp]), hp
        for _ in range(3):
            i, j = sorted(g.integers(0, n + 1, size=2).tolist())
            for hp in group:
                assert _same(store[hp][i:j], want[hp][i:j]), (hp, i, j)
                assert _same(store[hp, i:j], want[hp][i:j]), (hp, i, j)
        if not n:
            continue
        ds = ActivationDataset(store, hook_points=group, columns=["sample_id"])
        assert len(ds) == n
        loader = DataLoader(ds, batch_sampler=SequentialBatchSampler(ds, batch_size=case["chunk_rows"] + 1))
        batches = list(loader)
        for hp in group:
            assert _same(torch.cat([b[hp] for b in batches]), want[hp]), hp
        assert torch.cat([b["sample_id"] for b in batches]).tolist() == ids
        i = int(g.integers(0, n))
        for hp in group:
            assert _same(ds[i][hp], want[hp][i]), (hp, i)
        picked = g.integers(0, n, size=int(g.integers(1, 2 * n + 1))).tolist()  # a shuffled batch: one gather
        batch = ds[picked]
        for hp in group:
            assert _same(batch[hp], want[hp][picked]), (hp, picked)
        assert batch["sample_id"].tolist() == [ids[q] for q in picked]
    assert store.verify() == []


# found by the property: a resume whose first forward is an empty batch was refused for a
# store holding aliases (b.input.0 is a.output)
EMPTY_FIRST_RESUMED = {
    "dtype": torch.float32, "storage_dtype": None, "rows": "sample", "batches": [1, 0, 0], "positions": [1, 1, 1],
    "trailing": (), "masks": [[[True]], [], []], "chunk_rows": 1, "shard": {"shard_rows": 1}, "compression": None,
    "runs": [{"reductions": [], "hist_lo": -2.0, "k": 3, "per_feature": 1},
             {"reductions": ["mean"], "hist_lo": -2.0, "k": 3, "per_feature": 1}],
    "stops": [1], "closes": [False], "capture": "both", "ids": "given", "layout": "contiguous", "values": "any",
    "seed": 0,
}


@PROPS
@given(case=cases())
@example(case=EMPTY_FIRST_RESUMED)
def test_property_capture_store_read_back(tmp_path_factory, case):
    check_roundtrip(case, tmp_path_factory.mktemp("p") / "s.zarr")


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(case=cases(stop=True))
def test_property_killed_then_resumed(tmp_path_factory, case):
    """As above, stopped by an exit without any close (what kill -9 leaves) at each stop."""
    check_roundtrip(case, tmp_path_factory.mktemp("k") / "s.zarr", kill=True)


# --- the reader against damaged files ---------------------------------------------------

def _read_all(store):
    """Every value of the store: arrays (whole and sliced), reductions, the row table; a value
    whose read raises StoreError is left out."""
    out = {}
    for hp in store.hook_points:
        for rows in (slice(None), slice(1, 7), slice(5, 12)):
            for how, read in (("view", lambda: store[hp][rows]), ("rows", lambda: store[hp, rows])):
                try:
                    out[hp, how, rows.start, rows.stop] = read().clone()
                except StoreError:
                    pass
        try:
            out.update({(hp, name): value.clone() for name, value in store.reductions[hp].items()})
        except StoreError:
            pass
    try:
        out["rows"] = store.row_table("sample").to_pydict()
    except StoreError:
        pass
    return out


@pytest.fixture(scope="module")
def small_stores(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz")
    model = Model(torch.float32, False).eval()
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(3, 5, generator=g) for _ in range(4)]
    out = {}
    for compression in (None, "zstd"):
        path = base / f"{compression}.zarr"
        scope = acs.ActivationScope(store=str(path), reductions=["mean", ("hist", "hist", HIST), "topk"],
                                    store_options={"chunk_rows": 2, "shard_rows": 4, "compression": compression})
        with scope.track(model) as tracker, torch.no_grad():
            for i, x in enumerate(xs):
                tracker.set_batch(sample_ids=range(3 * i, 3 * i + 3), label=[i] * 3)
                model(x)
        store = acs.open_store(path)
        out[compression] = (path, _read_all(store))
        store.close()
    return out


@PROPS
@given(compression=st.sampled_from([None, "zstd"]), where=st.sampled_from(["acts", "."]),
       which=st.integers(0, 10**6), at=st.integers(0, 10**6), flip=st.integers(1, 255), truncate=st.booleans())
def test_property_damaged_store_reads_right_values_or_store_error(small_stores, tmp_path_factory, compression,
                                                                   where, which, at, flip, truncate):
    """A byte of a shard file (or of any file of the store) flipped, or the file cut short."""
    src, want = small_stores[compression]
    path = tmp_path_factory.mktemp("d") / "s.zarr"
    shutil.copytree(src, path)
    files = sorted(p for p in (path / where).rglob("*") if p.is_file() and p.stat().st_size
                   and (where == "." or p.name != "zarr.json"))
    victim = files[which % len(files)]
    data = bytearray(victim.read_bytes())
    at %= len(data)
    if truncate:
        del data[at:]
    else:
        data[at] ^= flip
    victim.write_bytes(bytes(data))
    try:
        # mapped views are checksummed once per shard with verify=True (store.md, "Zero-copy reads")
        store = acs.open_store(path, verify=True)
        got = _read_all(store)
    except StoreError:
        return
    assert set(got) <= set(want), (victim.relative_to(path), set(got) - set(want))
    for key, value in got.items():
        same = value == want[key] if key == "rows" else _same(value, want[key])
        assert same, (victim.relative_to(path), at, truncate, key)
