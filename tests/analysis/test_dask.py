"""Readers that are not ours (xarray, TensorStore) and Dask analysis of a store.

References are plain numpy / torch over the rows read back by our own reader, which the
store tests check against the captured tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import activationscope as acs

dask = pytest.importorskip("dask")
da = pytest.importorskip("dask.array")
ml_dtypes = pytest.importorskip("ml_dtypes")

from activationscope.analysis.dask import moments, pca, row_table_dask, to_dask  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[2] / "store" / "golden" / "v1"


class Encoder(torch.nn.Module):
    """Token activations (batch, pos, d_model) at encoder.<i>, and a sample-level head."""

    def __init__(self, d_model: int = 12) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, d_model)
        self.encoder = torch.nn.ModuleList(torch.nn.Linear(d_model, d_model) for _ in range(2))
        self.head = torch.nn.Linear(d_model, 3)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.encoder:
            x = torch.relu(layer(x)) + 5.0  # a common offset: naive one-pass variances fail on it
        return self.head(x.mean(1))


def _capture(path, *, storage_dtype=None, compression=None, n_batches=5, shard_bytes=None):
    model = Encoder().eval()
    gen = torch.Generator().manual_seed(1)
    opts = {"compression": compression}
    if shard_bytes is not None:
        opts.update(shard_bytes=shard_bytes, chunk_rows=8)
    scope = acs.ActivationScope(store=str(path), storage_dtype=storage_dtype, reductions=["mean", "var"],
                                store_options=opts)
    with scope.track(model, include=["encoder.*", "head"]) as tracker, torch.no_grad():
        for b in range(n_batches):
            lengths = torch.randint(2, 9, (6,), generator=gen)
            mask = torch.arange(8)[None, :] < lengths[:, None]
            ids = torch.randint(1, 50, (6, 8), generator=gen) * mask
            tracker.set_batch(attention_mask=mask, sample_ids=torch.arange(6 * b, 6 * b + 6),
                              label=torch.arange(6) % 2, token_ids=ids)
            model(ids)
    return acs.open_store(str(path))


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


@pytest.mark.parametrize("storage_dtype", [None, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_to_dask_equals_store(tmp_path, storage_dtype, compression):
    store = _capture(tmp_path / "s.zarr", storage_dtype=storage_dtype, compression=compression, shard_bytes=1024)
    assert store.row_kind("encoder.0.output") == "token"
    for hp in store.hook_points:
        x = to_dask(str(tmp_path / "s.zarr"), hp)
        ref = _as_numpy(store[hp])
        meta = store.attrs["arrays"][hp]
        assert x.shape == ref.shape == (store.n_rows(hp), *store.feature_shape(hp))
        assert x.dtype == (np.dtype(ml_dtypes.bfloat16) if storage_dtype is torch.bfloat16 else np.float32)
        shard_rows = int(meta["shard_rows"])
        if store.row_kind(hp) == "token":
            assert shard_rows < x.shape[0]  # several shards, so block alignment is tested
        assert all(c == shard_rows for c in x.chunks[0][:-1]) and 0 < x.chunks[0][-1] <= shard_rows
        got = x.compute()
        assert got.dtype == ref.dtype
        np.testing.assert_array_equal(got.view(np.uint8), ref.view(np.uint8))  # bit-exact
    assert acs.to_dask(store, "head.output").shape == (30, 3)


def test_to_dask_reads_only_committed_rows(tmp_path):
    """The root's n_rows bounds the array, not the array's own (possibly ahead) shape."""
    path = tmp_path / "s.zarr"
    full = _capture(path, shard_bytes=1024)
    hp = "encoder.1.output"
    ref = full[hp].clone().numpy()
    root = json.loads((path / "zarr.json").read_text())
    root["attributes"]["activationscope"]["arrays"][hp]["n_rows"] = 7  # as a commit in progress leaves it
    (path / "zarr.json").write_text(json.dumps(root))
    x = to_dask(str(path), hp)
    assert json.loads((path / root["attributes"]["activationscope"]["arrays"][hp]["path"] / "zarr.json")
                      .read_text())["shape"][0] == len(ref) > 7
    assert x.shape == (7, 12)
    np.testing.assert_array_equal(x.compute(), ref[:7])


def test_to_dask_rejects_a_document_that_disagrees(tmp_path):
    path = tmp_path / "s.zarr"
    store = _capture(path, n_batches=1)
    hp = "head.output"
    doc_path = path / store.attrs["arrays"][hp]["path"] / "zarr.json"
    doc = json.loads(doc_path.read_text())
    doc["data_type"] = "float64"
    doc_path.write_text(json.dumps(doc))
    with pytest.raises(acs.StoreCorruptError, match="head.output.*data_type 'float64'"):
        to_dask(str(path), hp)


def test_row_table_dask(tmp_path):
    store = _capture(tmp_path / "s.zarr", n_batches=4)
    for kind in ("sample", "token"):
        ddf = row_table_dask(str(tmp_path / "s.zarr"), kind)
        ref = store.row_table(kind).to_pandas()
        got = ddf.compute().reset_index(drop=True)
        assert list(got.columns) == list(ref.columns)
        assert len(got) == store.attrs["row_tables"][kind]["n_rows"] == len(ref)
        for col in ref.columns:
            np.testing.assert_array_equal(got[col].to_numpy(), ref[col].to_numpy())
    # token rows line up with the token arrays' rows
    assert len(row_table_dask(store, "token")) == store.n_rows("encoder.0.output")


def test_row_table_dask_index_is_the_row_of_the_arrays(tmp_path):
    """A row table of several parts (one per capture: the store is resumed twice): its index
    is the row number of the store's arrays (not each part's own 0..), so rows selected by a
    column index the activations."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()
    for run in range(3):
        scope = acs.ActivationScope(store=str(tmp_path / "s.zarr"), store_options={"resume": run > 0})
        with scope.track(model) as tracker, torch.no_grad():
            for b in range(2):
                tracker.set_batch(label=(torch.arange(5) + b + run) % 3)
                model(torch.randn(5, 4))
    store = acs.open_store(str(tmp_path / "s.zarr"))
    assert len(store.attrs["row_tables"]["sample"]["parts"]) == 3
    ddf = row_table_dask(store, "sample")
    got = ddf.compute()
    np.testing.assert_array_equal(got.index.to_numpy(), np.arange(30))
    assert ddf.known_divisions and ddf.divisions == (0, 10, 20, 29)
    rows = ddf[ddf["label"] == 1].index.compute().to_numpy()
    labels = store.row_table("sample").column("label").to_numpy()
    np.testing.assert_array_equal(rows, np.flatnonzero(labels == 1))
    x = to_dask(store, "0.output")
    np.testing.assert_array_equal(x[rows].compute(), store["0.output"].numpy()[rows])
    assert ddf.loc[7:12].compute()["label"].tolist() == labels[7:13].tolist()


def test_moments_and_pca_equal_store_and_float64_reference(tmp_path):
    store = _capture(tmp_path / "s.zarr", n_batches=6, shard_bytes=1024)
    hp = "encoder.1.output"
    x = to_dask(store, hp)
    ref = store[hp].double()
    m = moments(x)
    red = store.reductions[hp]
    np.testing.assert_allclose(m["mean"], red["mean"].numpy(), rtol=1e-12, atol=0)
    np.testing.assert_allclose(m["var"], red["var"].numpy(), rtol=1e-10, atol=1e-14)
    assert m["count"] == int(red["var.count"]) == len(ref)
    p = pca(x, n_components=4)
    xc = ref - ref.mean(0)
    cov = (xc.T @ xc / len(ref)).numpy()
    np.testing.assert_allclose(p["cov"], cov, rtol=1e-10, atol=1e-13)
    ev, vecs = np.linalg.eigh(cov)
    np.testing.assert_allclose(p["explained_variance"], ev[::-1][:4], rtol=1e-9)
    for i in range(4):  # components up to sign
        assert abs(abs(float(p["components"][i] @ vecs[:, -1 - i])) - 1) < 1e-8
    with pytest.raises(ValueError, match="n_components must be an int in 1..12"):
        pca(x, n_components=13)



@pytest.mark.parametrize("value", [0.1, 0.7, 1 / 3])
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf: numpy says so
def test_moments_of_a_constant_column_are_its_value_and_zero(value):
    """sum / n rounds (three rows of 0.1 sum to 0.30000000000000004): a constant column's
    mean is still its value and its variance exactly 0, as torch.var and the built-in var
    reduction give; NaN and inf columns stay NaN and inf."""
    rows = np.full((7, 4), value)
    rows[:, 1] = np.arange(7)
    rows[3, 2] = np.nan
    rows[:, 3] = np.inf
    with pytest.warns(acs.NonFiniteRowsWarning, match=r"7 of the 7 rows \(rows 0, 1, 2, 3, 4, 5, 6\) hold NaN or inf"):
        m = moments(da.from_array(rows, chunks=(3, 4)))
    want = torch.from_numpy(rows).var(0, correction=0).numpy()
    assert m["mean"][0] == value and m["var"][0] == 0.0 == want[0]
    np.testing.assert_allclose(m["var"][1], want[1], rtol=1e-12)
    assert np.isnan(m["mean"][2]) and np.isnan(m["var"][2]) and np.isnan(want[2])
    assert m["mean"][3] == np.inf and np.isnan(m["var"][3]) and np.isnan(want[3])


def _overflowing_store(tmp_path):
    """tmp_path/h.zarr: a model whose output overflows float32 for one sample per forward: inf
    (and NaN) rows among finite ones (4 forwards of 6 samples)."""
    model = torch.nn.Linear(5, 5).eval()
    scope = acs.ActivationScope(store=str(tmp_path / "h.zarr"), store_options={"shard_rows": 8, "chunk_rows": 8})
    gen = torch.Generator().manual_seed(2)
    with scope.track(model, include=["*"]) as tracker, torch.no_grad():
        for b in range(4):
            tracker.set_batch(sample_ids=torch.arange(6 * b, 6 * b + 6))
            x = torch.randn(6, 5, generator=gen)
            x[b % 6] *= 1e38
            model(x * 1e3)


def test_pca_leaves_out_rows_with_nan_or_inf(tmp_path):
    _overflowing_store(tmp_path)
    store = acs.open_store(str(tmp_path / "h.zarr"))
    rows = store[store.hook_points[0]].double()
    finite = torch.isfinite(rows).all(1)
    assert 0 < int((~finite).sum()) < len(rows)
    ref = rows[finite]
    xc = ref - ref.mean(0)
    cov = (xc.T @ xc / len(ref)).numpy()
    with pytest.warns(acs.NonFiniteRowsWarning, match="left out of the PCA"):
        p = pca(to_dask(store, store.hook_points[0]), n_components=3)
    assert p["count"] == len(ref) and p["n_dropped"] == int((~finite).sum())
    np.testing.assert_allclose(p["mean"], ref.mean(0).numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(p["cov"], cov, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(p["explained_variance"], np.linalg.eigvalsh(cov)[::-1][:3], rtol=1e-9)
    with pytest.raises(ValueError, match="at least 2 rows without NaN or inf, got 0 of 3"):
        pca(da.from_array(np.full((3, 2), np.inf)))

def test_xarray_opens_the_store_with_named_dimensions(tmp_path):
    xr = pytest.importorskip("xarray")
    path = tmp_path / "s.zarr"
    store = _capture(path, storage_dtype=torch.bfloat16)
    ds = xr.open_zarr(str(path), group="acts", consolidated=False)
    for hp in store.hook_points:
        var = ds[hp]
        kind = store.row_kind(hp)
        assert var.dims == (kind, f"{hp}.dim0")
        bits = store[hp].view(torch.uint16).numpy()  # bfloat16 is stored as uint16 bit patterns
        np.testing.assert_array_equal(var.values, bits)
    assert ds.sizes["token"] == store.attrs["row_tables"]["token"]["n_rows"]
    assert ds.sizes["sample"] == store.n_samples == 30
    red = xr.open_zarr(str(path), group="reductions/encoder.0.output", consolidated=False)
    assert red["mean"].dims == ("encoder.0.output.dim0",)  # lines up with the activation's features
    np.testing.assert_array_equal(red["mean"].values, store.reductions["encoder.0.output"]["mean"].numpy())


def test_tensorstore_reads_the_store(tmp_path):
    ts = pytest.importorskip("tensorstore")
    path = tmp_path / "s.zarr"
    store = _capture(path, compression="zstd", shard_bytes=1024)
    for hp in store.hook_points:
        arr = ts.open({"driver": "zarr3", "kvstore": f"file://{path}/{store.attrs['arrays'][hp]['path']}"},
                      read=True).result()
        n = store.n_rows(hp)
        got = arr[:n].read().result()
        np.testing.assert_array_equal(got, store[hp].numpy())
        assert arr.domain.labels[0] == store.row_kind(hp)


def test_old_stores_without_dimension_names_still_read(tmp_path):
    src = GOLDEN / "mlp_f32.zarr"
    docs = list(src.glob("acts/*/zarr.json"))
    assert docs and all("dimension_names" not in json.loads(p.read_text()) for p in docs)
    store = acs.open_store(src)
    expected = torch.load(GOLDEN / "expected.pt")
    for hp in store.hook_points:
        x = to_dask(store, hp).compute()
        np.testing.assert_array_equal(x, store[hp].numpy())
    assert store.verify() == []
    assert expected  # the golden expectations exist (test_golden compares them)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_distributed_pca_on_a_store_larger_than_a_worker(tmp_path):
    """LocalCluster with 2 workers whose memory limit is below the store's size, and whose
    room above their own imports is below half of it: moments and PCA must stream shards
    (a worker over 95 % of its limit is killed, and the computation fails with KilledWorker)."""
    distributed = pytest.importorskip("distributed")

    def _worker_rss() -> int:  # nested: pickled by value, so a worker never imports this module (torch)
        import dask.array  # noqa: F401 - what a worker imports to run the chunk functions
        import psutil  # distributed depends on it
        import zarr  # noqa: F401

        return psutil.Process().memory_info().rss

    limit = 288 << 20
    d, batch, n_batches = 256, 4096, 80  # 320 MiB of float32 rows
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, d)).eval()
    scope = acs.ActivationScope(store=str(tmp_path / "big.zarr"), reductions=["mean", "var", "cov"],
                                store_options={"shard_bytes": 4 << 20})
    gen = torch.Generator().manual_seed(0)
    with scope.track(model, include=["0"]) as tracker, torch.no_grad():
        for _ in range(n_batches):
            tracker.set_batch()
            model(torch.randn(batch, 16, generator=gen) * 3 + 10)
    store = acs.open_store(str(tmp_path / "big.zarr"))
    hp = "0.output"
    store_bytes = store.info()["arrays"][hp]["bytes_on_disk"]
    assert store_bytes > limit
    x = to_dask(str(tmp_path / "big.zarr"), hp)
    assert x.numblocks[0] >= 64
    # A worker paused at 80 % of its limit waits for memory forever: with pausing off, a worker
    # that does not stream is killed at 95 % and the computation fails (KilledWorker), never hangs.
    import dask

    with dask.config.set({"distributed.worker.memory.pause": False}), \
            distributed.LocalCluster(n_workers=2, threads_per_worker=1, memory_limit=limit, processes=True,
                                     dashboard_address=None) as cluster, \
            distributed.Client(cluster, timeout=120) as client:
        assert client.run(lambda dask_worker: dask_worker.memory_manager.memory_pause_fraction) == \
            dict.fromkeys(client.run(lambda: 0), False)
        rss = client.run(_worker_rss)
        assert len(rss) == 2
        assert store_bytes / 2 > limit - min(rss.values())  # each worker's half exceeds its room
        p = pca(x, n_components=8)  # two passes: the mean, then the covariance
        assert len(client.run(_worker_rss)) == 2
    red = store.reductions[hp]
    np.testing.assert_allclose(p["mean"], red["mean"].numpy(), rtol=1e-12)
    np.testing.assert_allclose(np.diag(p["cov"]), red["var"].numpy(), rtol=1e-10)
    np.testing.assert_allclose(p["cov"], red["cov"].numpy(), rtol=1e-9, atol=1e-12)
    # float64 reference, two passes over blocks of rows (plain torch)
    rows = store[hp]
    mean = sum(rows[i:i + 65536].double().sum(0) for i in range(0, len(rows), 65536)) / len(rows)
    cov = torch.zeros(d, d, dtype=torch.float64)
    for i in range(0, len(rows), 65536):
        xc = rows[i:i + 65536].double() - mean
        cov += xc.T @ xc
    cov = (cov / len(rows)).numpy()
    np.testing.assert_allclose(p["mean"], mean.numpy(), rtol=1e-12)
    np.testing.assert_allclose(p["cov"], cov, rtol=1e-10, atol=1e-13)
    ev = np.linalg.eigvalsh(cov)[::-1][:8]
    np.testing.assert_allclose(p["explained_variance"], ev, rtol=1e-9)


@pytest.mark.timeout(300)
def test_distributed_doc_runs(tmp_path):
    from acs_testing import run_doc_blocks

    run_doc_blocks(Path(__file__).resolve().parents[2] / "docs" / "usage" / "distributed.md", tmp_path, min_blocks=5)


@pytest.mark.parametrize("ranks", [False, True])
def test_xarray_names_only_per_feature_reduction_outputs_by_the_features(tmp_path, ranks):
    """A reduction output whose shape happened to be the feature shape was named by the
    feature dimension: with 4 features, the 4 edges of a 3-bin hist and the top-4 values of a
    topk over all values (per_feature 0) lined up with the features in xarray (selecting
    feature 2 picked an edge). Only per-feature outputs carry the feature names, in a store
    of one process and in one committed from rank stores alike."""
    xr = pytest.importorskip("xarray")
    from activationscope.store.ranks import commit_ranks

    path = tmp_path / "s.zarr"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    xs = [torch.randn(6, 8), torch.randn(5, 8)]
    reductions = ["mean", ("h", "hist", {"lo": -1, "hi": 1, "bins": 3}), ("top", "topk", {"k": 4, "per_feature": 0})]
    for task in (0, 1) if ranks else (None,):
        opts = {"process_group": acs.RankStore(task, 2)} if ranks else {}
        with acs.ActivationScope(store=str(path), reductions=reductions, store_options=opts).track(model), \
                torch.no_grad():
            for x in xs if not ranks else xs[task:task + 1]:
                model(x)
    if ranks:
        commit_ranks(path)
    red = xr.open_zarr(str(path), group="reductions/0.output", consolidated=False)
    store = acs.open_store(path)
    assert red["mean"].dims == ("0.output.dim0",) and red["h.underflow"].dims == ("0.output.dim0",)
    assert red["h.counts"].dims == ("0.output.h.counts.dim0", "0.output.h.counts.dim1")
    assert red["h.edges"].dims == ("0.output.h.edges.dim0",)
    for name in ("top.values", "top.row_ids", "top.feature_ids"):
        assert red[name].dims == (f"0.output.{name}.dim0",) and red[name].shape == (4,)
    np.testing.assert_array_equal(red["h.edges"].values, store.reductions["0.output"]["h.edges"].numpy())
    np.testing.assert_allclose(red["h.edges"].values, np.linspace(-1, 1, 4), rtol=0, atol=1e-15)
    with torch.no_grad():
        ref = torch.cat([model(x) for x in xs]).double()
    np.testing.assert_allclose(red["mean"].values, ref.mean(0).numpy(), rtol=1e-12)
    np.testing.assert_allclose(red["top.values"].values, ref.flatten().topk(4).values.numpy(), rtol=1e-7)


def test_xarray_lines_up_the_reductions_of_an_alias_with_its_targets_features(tmp_path):
    """A hook point stored as an alias (an nn.Identity after a conv: the very tensor of the
    conv's output) has no array of its own; readers read its target's. Its per-feature
    reductions were named by dimensions of its own (``1.output.mean.dim0``), which no array
    has: in xarray they did not line up with the rows read for it (a difference broadcast to
    an outer product). They carry the target's feature names now."""
    xr = pytest.importorskip("xarray")
    path = tmp_path / "s.zarr"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Identity()).eval()
    scope = acs.ActivationScope(store=str(path), reductions=["mean", ("top", "topk", {"k": 2})])
    with torch.no_grad(), scope.track(model):
        for x in torch.randn(7, 3, 5, 5).split(4):
            model(x)
    store = acs.open_store(path)
    assert store.aliases == {"1.output": "0.output"}
    acts = xr.open_zarr(str(path), group="acts", consolidated=False)
    red = xr.open_zarr(str(path), group="reductions/1.output", consolidated=False)
    features = ("0.output.dim0", "0.output.dim1", "0.output.dim2")
    assert acts["0.output"].dims == ("sample", *features)
    assert red["mean"].dims == features
    centred = acts[store.aliases["1.output"]] - red["mean"]
    assert centred.shape == (7, 4, 5, 5)
    np.testing.assert_allclose(centred.values, (store["1.output"].double() - store.reductions["1.output"]["mean"]).numpy(),
                               rtol=1e-6, atol=1e-6)
    assert red["top.values"].dims == ("1.output.top.values.dim0", "1.output.top.values.dim1",
                                      "1.output.top.values.dim2", "1.output.top.values.dim3")


def test_pca_of_conv_maps_says_how_to_flatten_them(tmp_path):
    """to_dask of a conv hook point is (rows, C, H, W); pca refused it with "reshape it
    first", leaving the reshape to guess. The message gives the call, and that call gives the
    store's cov of the flattened rows."""
    path = tmp_path / "s.zarr"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 2, 3, padding=1)).eval()
    with acs.ActivationScope(store=str(path), reductions=["cov"]).track(model), torch.no_grad():
        for x in torch.randn(9, 3, 4, 4).split(4):
            model(x)
    x = to_dask(str(path), "0.output")
    assert x.shape == (9, 2, 4, 4)
    with pytest.raises(ValueError, match=r"flatten each row first, pca\(x.reshape\(x.shape\[0\], -1\)\)"):
        pca(x)
    p = pca(x.reshape(x.shape[0], -1), n_components=3)
    store = acs.open_store(path)
    np.testing.assert_allclose(p["cov"], store.reductions["0.output"]["cov"].numpy(), rtol=1e-9, atol=1e-12)


def test_moments_and_pca_say_which_rows_hold_nan_or_inf_and_agree_when_asked(tmp_path):
    """pca left out rows holding NaN or inf, and moments counted them (NaN columns) with
    nothing said; now both name those rows, and moments(drop_nonfinite=True) is over pca's
    rows, against a numpy float64 reference of the same rows."""
    _overflowing_store(tmp_path)
    store = acs.open_store(str(tmp_path / "h.zarr"))
    hp = store.hook_points[0]
    rows = store[hp].double().numpy()
    finite = np.isfinite(rows).all(1)
    bad = np.flatnonzero(~finite)
    assert 0 < len(bad) < len(rows)
    x = to_dask(store, hp)
    with pytest.warns(acs.NonFiniteRowsWarning) as caught:
        m = moments(x)
    shown = ", ".join(map(str, bad))
    assert str(caught[0].message).startswith(f"{len(bad)} of the 24 rows (rows {shown}) hold NaN or inf, counted")
    assert "drop_nonfinite=True" in str(caught[0].message)
    assert m["count"] == 24 and m["n_nonfinite"] == len(bad) and m["n_dropped"] == 0
    np.testing.assert_array_equal(m["nonfinite_rows"], bad)
    with np.errstate(invalid="ignore", over="ignore"):
        want_mean, want_var = rows.mean(0), rows.var(0)
    np.testing.assert_array_equal(np.isfinite(m["mean"]), np.isfinite(want_mean))  # the columns they touch
    assert not np.isfinite(m["var"]).any() and not np.isfinite(want_var).any()
    with pytest.warns(acs.NonFiniteRowsWarning) as caught:
        kept = moments(x, drop_nonfinite=True)
    assert str(caught[0].message).startswith(f"{len(bad)} of the 24 rows (rows {shown}) hold NaN or inf, left out")
    ref = rows[finite]
    assert kept["count"] == len(ref) and kept["n_dropped"] == len(bad) == kept["n_nonfinite"]
    np.testing.assert_allclose(kept["mean"], ref.mean(0), rtol=1e-12, atol=0)
    np.testing.assert_allclose(kept["var"], ref.var(0), rtol=1e-10, atol=0)
    with pytest.warns(acs.NonFiniteRowsWarning) as caught:
        p = pca(x, n_components=2)
    assert str(caught[0].message).startswith(f"{len(bad)} of the 24 rows (rows {shown}) hold NaN or inf, left out")
    np.testing.assert_array_equal(p["dropped_rows"], bad)
    np.testing.assert_allclose(p["mean"], kept["mean"], rtol=1e-12, atol=0)  # the same rows
    np.testing.assert_allclose(np.diag(p["cov"]), kept["var"], rtol=1e-10, atol=0)
    # rows of several dimensions (a conv map): a row with one NaN value is the row left out
    maps = np.random.default_rng(0).normal(size=(7, 2, 3))
    maps[4, 1, 2] = np.nan
    with pytest.warns(acs.NonFiniteRowsWarning, match=r"1 of the 7 rows \(row 4\)"):
        got = moments(da.from_array(maps, chunks=(3, 2, 3)), drop_nonfinite=True)
    keep = np.delete(maps, 4, axis=0)
    np.testing.assert_allclose(got["mean"], keep.mean(0), rtol=1e-12, atol=0)
    np.testing.assert_allclose(got["var"], keep.var(0), rtol=1e-10, atol=0)
    import warnings

    with warnings.catch_warnings():  # finite rows: nothing to say, the same numbers either way
        warnings.simplefilter("error", acs.NonFiniteRowsWarning)
        a, b = moments(da.from_array(keep, chunks=(3, 2, 3))), moments(da.from_array(keep, chunks=(3, 2, 3)),
                                                                        drop_nonfinite=True)
    assert a["n_nonfinite"] == 0 and np.array_equal(a["mean"], b["mean"]) and np.array_equal(a["var"], b["var"])
    with pytest.raises(ValueError, match="drop_nonfinite must be a bool, got 1"):
        moments(x, drop_nonfinite=1)


@pytest.mark.parametrize("fn", [moments, pca])
def test_complex_arrays_are_refused_not_reduced_to_their_real_part(fn):
    # x.astype(float64) of a complex array kept the real parts (a numpy ComplexWarning the only sign)
    from activationscope.errors import ArgumentTypeError

    x = da.from_array(np.array([[1 + 1j, 2], [3, 4 - 2j], [0, 1j]], dtype=np.complex64), chunks=(2, 2))
    with pytest.raises(ArgumentTypeError, match=rf"{fn.__name__} needs real values, got a complex64 array.*x.real"):
        fn(x)
    both = da.concatenate([x.real, x.imag], axis=1)  # the fix the message names
    ref = np.concatenate([x.compute().real, x.compute().imag], axis=1).astype(np.float64)
    np.testing.assert_allclose(moments(both)["mean"], ref.mean(0))


@pytest.mark.parametrize("fn", [moments, pca])
def test_rows_selected_by_a_dask_mask_are_refused_naming_the_fixes(fn):
    # x[mask] with a dask mask (a column of row_table_dask) has nan rows until computed:
    # moments and pca failed with "cannot convert float NaN to integer"
    from activationscope.errors import ArgumentValueError

    values = np.random.default_rng(0).normal(size=(9, 3))
    x = da.from_array(values, chunks=(4, 3))
    keep = np.arange(9) % 3 != 1
    mask = da.from_array(keep, chunks=4)
    with pytest.raises(ArgumentValueError, match=rf"{fn.__name__} needs an array of known shape, got shape "
                                                 r"\(nan, 3\).*x\[mask.compute\(\)\].*compute_chunk_sizes"):
        fn(x[mask])
    for known in (x[mask.compute()], x[mask].compute_chunk_sizes()):  # the fixes the message names
        np.testing.assert_allclose(fn(known)["mean"], values[keep].mean(0), rtol=1e-12)
