"""Batches at arbitrary positions (shuffled and chunk-shuffled batch samplers) go through the
native gather (``_C.gather_rows``) over the mapped shards: every batch must equal plain
PyTorch indexing of the stored rows, for every kind of index and dataset, and an index the
native path does not take must get the general path's answer or error."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

import activationscope as acs
from activationscope import ActivationDataset
from activationscope.capture import _native
from activationscope.data import _source
from activationscope.data.dataset import collate
from activationscope.errors import ArgumentTypeError, RowIndexError

from fake_store import open_fake, write_fake_store

N = 61


@pytest.fixture
def data(tmp_path):
    torch.manual_seed(0)
    a = torch.randn(N, 3, 2)
    b = torch.arange(N * 5, dtype=torch.float16).reshape(N, 5)
    labels = pa.table({"label": pa.array([i % 4 for i in range(N)]), "text": pa.array([f"t{i}" for i in range(N)])})
    path = write_fake_store(tmp_path / "s", {"a": a, "b": b}, tables={"sample": labels}, shard_rows=7)
    return path, {"a": a, "b": b}


def _calls(monkeypatch):
    """Count the native gathers (and keep them native)."""
    native = _native.load().gather_rows
    calls = []

    def counting(*args):
        got = native(*args)
        calls.append(got)
        return got

    monkeypatch.setattr(_source, "_GATHER", [counting])
    return calls


def _random_batches(n, seed=0):
    g = np.random.default_rng(seed)
    out = [g.permutation(n)[:k].tolist() for k in (1, 5, 16, n)]
    out.append([3, 3, 3, 60, 0, 60])  # repeats, first and last rows
    out.append([5, 6, 7, 8])  # consecutive, across a shard boundary (shards of 7)
    out.append([7, 8, 9])  # consecutive, inside one shard
    out.append([-1, -N, 10, -30])  # negative positions count from the end
    return out


@pytest.mark.parametrize("kind", [list, tuple, "tensor"])
def test_gathered_batches_equal_torch_indexing(data, monkeypatch, kind):
    path, ref = data
    calls = _calls(monkeypatch)
    ds = ActivationDataset(path, columns=["label", "text"], open_options={"opener": open_fake})
    for idx in _random_batches(N):
        index = torch.tensor(idx, dtype=torch.int64) if kind == "tensor" else kind(idx)
        got = collate(ds.__getitems__(index))
        pos = torch.tensor(idx) % N
        for hp in ("a", "b"):
            assert got[hp].dtype == ref[hp].dtype and torch.equal(got[hp], ref[hp][pos]), (idx, hp)
        assert got["label"].tolist() == [i % 4 for i in pos.tolist()]
        assert got["text"] == [f"t{i}" for i in pos.tolist()]
    assert len(calls) >= len(_random_batches(N)) and all(c is not None for c in calls if type(c) is not int)


def test_rows_of_a_sub_range_and_positions_relative_to_it(data, monkeypatch):
    path, ref = data
    calls = _calls(monkeypatch)
    ds = ActivationDataset(path, hook_points=["a"], rows=range(10, 50), open_options={"opener": open_fake})
    for idx in ([0, 39, 5, 5], [-1, -40, 20], [3, 4, 5]):
        want = ref["a"][10:50][torch.tensor(idx) % 40]
        assert torch.equal(ds[idx]["a"], want), idx
    assert calls and all(type(c) is int or c is not None for c in calls)
    with pytest.raises(RowIndexError):
        ds[[0, 40]]
    with pytest.raises(RowIndexError):
        ds[[-41]]


def test_positions_always_give_a_new_tensor_a_slice_inside_one_shard_a_view(data):
    path, ref = data
    ds = ActivationDataset(path, hook_points=["a"], columns=["label"], open_options={"opener": open_fake})
    shard = ds.source.store._shard("a", 1)  # rows [7, 14)
    view = ds[8:11]["a"]
    assert view.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr()
    assert torch.equal(view, ref["a"][8:11])
    for idx in ([8, 9, 10], (8, 9, 10), torch.tensor([8, 9, 10]), [10, 8, 9], [np.int64(8), np.int64(9)]):
        got = ds[idx]
        assert got["a"].untyped_storage().data_ptr() != shard.untyped_storage().data_ptr(), idx
        assert torch.equal(got["a"], ref["a"][torch.tensor([int(i) for i in idx])])
        got["a"].add_(1)  # a batch given as positions is the caller's own tensor
        got["label"].add_(100)
    assert torch.equal(ds[8:11]["a"], ref["a"][8:11]) and ds[[8, 9, 10]]["label"].tolist() == [0, 1, 2]


def test_in_place_changes_to_shuffled_batches_never_reach_later_epochs(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    path = str(tmp_path / "s.zarr")
    with acs.ActivationScope(store=path).track(model), torch.no_grad():
        for _ in range(10):
            model(torch.randn(10, 4))
    from activationscope.data import ShuffledBatchSampler

    ds = ActivationDataset(path)
    ref = ds[0:len(ds)]["output"].clone()
    for batch_size in (1, 2):  # batch size 1: every batch is one consecutive run
        sampler = ShuffledBatchSampler(ds, batch_size=batch_size, seed=0)
        for epoch in range(3):
            sampler.set_epoch(epoch)
            for batch in torch.utils.data.DataLoader(ds, batch_sampler=sampler):
                batch["output"].mul_(2)
    assert torch.equal(ds[0:len(ds)]["output"], ref)


def test_indexes_the_native_path_does_not_take_get_the_general_answer(data, monkeypatch):
    path, ref = data
    calls = _calls(monkeypatch)
    ds = ActivationDataset(path, hook_points=["b"], open_options={"opener": open_fake})
    assert torch.equal(ds[[np.int64(4), np.int64(2)]]["b"], ref["b"][[4, 2]])  # numpy ints
    assert torch.equal(ds[torch.tensor([4, 2], dtype=torch.int32)]["b"], ref["b"][[4, 2]])
    assert ds[[]]["b"].shape == (0, 5)
    with pytest.raises(ArgumentTypeError):
        ds[[True, 1]]  # a bool among ints
    mask = [False] * len(ds)
    mask[4] = mask[2] = True
    assert torch.equal(ds[mask]["b"], ref["b"][[2, 4]])  # a mask over the dataset's rows
    with pytest.raises(ArgumentTypeError):
        ds[[1.5, 2.0]]
    with pytest.raises(RowIndexError):
        ds[[0, N]]
    with pytest.raises(RowIndexError):
        ds[torch.tensor([0, 2**40])]
    assert calls and all(c is None for c in calls)  # each was handed to the general path


def test_without_the_native_extension_the_batches_are_the_same(data, monkeypatch):
    path, ref = data
    native = [collate(ActivationDataset(path, open_options={"opener": open_fake}).__getitems__(i))
              for i in _random_batches(N)]
    monkeypatch.setattr(_source, "_GATHER", [None])
    ds = ActivationDataset(path, open_options={"opener": open_fake})
    for idx, want in zip(_random_batches(N), native):
        got = collate(ds.__getitems__(idx))
        assert all(torch.equal(got[hp], want[hp]) for hp in ("a", "b")), idx


def test_gather_rows_maps_segments_on_demand_and_refuses_what_it_cannot_take():
    gather = _native.load().gather_rows
    segs = [torch.arange(0, 12.0).reshape(4, 3), None, torch.arange(24, 33.0).reshape(3, 3)]
    bounds = [0, 4, 8, 11]
    assert gather([5], 11, 0, bounds, segs, False) == 1  # segment 1 is needed
    segs[1] = torch.arange(12, 24.0).reshape(4, 3)
    rows, a, b, ids = gather([10, 0, 5, -1], 11, 0, bounds, segs, True)
    full = torch.arange(33.0).reshape(11, 3)
    assert torch.equal(rows, full[[10, 0, 5, 10]]) and (a, b) == (-1, -1) and ids.tolist() == [10, 0, 5, 10]
    view, a, b, ids = gather([1, 2, 3], 11, 0, bounds, segs, False)
    assert (a, b) == (1, 4) and ids is None and view.data_ptr() == segs[0][1].data_ptr()
    rows, a, b, _ = gather([0, 1], 5, 6, bounds, segs, False)  # positions of a dataset starting at row 6
    assert torch.equal(rows, full[6:8])
    assert gather([0, 11], 11, 0, bounds, segs, False) is None  # out of range
    assert gather([True], 11, 0, bounds, segs, False) is None
    assert gather(["1"], 11, 0, bounds, segs, False) is None
    assert gather([], 11, 0, bounds, segs, False) is None
    assert gather([0], 11, 0, bounds, segs[:2], False) is None  # segments do not match the bounds
    assert gather([0, 5], 11, 0, bounds, [segs[0].t(), segs[1], segs[2]], False) is None  # not contiguous
    bad = [segs[0], segs[1].to(torch.float64), segs[2]]
    assert gather([0, 5], 11, 0, bounds, bad, False) is None  # segments of different dtypes
    # out=: the rows copied into the caller's tensor, consecutive ones too (never a view)
    for idx in ([10, 0, 5, -1], [1, 2, 3], [9, 10]):
        out = torch.full((len(idx), 3), -1.0)
        rows, a, b, _ = gather(idx, 11, 0, bounds, segs, False, out)
        assert rows.data_ptr() == out.data_ptr() and (a, b) == (-1, -1) and torch.equal(out, full[idx]), idx
    for wrong in (torch.empty(3, 3), torch.empty(4, 2), torch.empty(4, 3, dtype=torch.float64),
                  torch.empty(3, 4).t(), torch.empty(4, 3, device="meta"), "x"):
        assert gather([10, 0, 5, 1], 11, 0, bounds, segs, False, wrong) is None, wrong


def test_real_store_gathers_across_shards_and_compressed_falls_back(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16)).eval()
    x = torch.randn(96, 8)
    for name, opts in (("raw", {"chunk_rows": 16, "shard_bytes": 2 * 16 * 16 * 4}), ("zstd", {"compression": "zstd", "chunk_rows": 16})):
        path = str(tmp_path / f"{name}.zarr")
        with acs.ActivationScope(store=path, store_options=opts).track(model) as tr, torch.no_grad():
            for i in range(0, 96, 16):
                tr.set_batch(sample_ids=range(i, i + 16))
                model(x[i : i + 16])
        ref = model[0](x).detach()
        calls = _calls(monkeypatch)
        ds = ActivationDataset(path, hook_points=["0.output"])
        idx = np.random.default_rng(1).permutation(96).tolist()
        for k in range(0, 96, 20):
            assert torch.allclose(ds[idx[k : k + 20]]["0.output"], ref[idx[k : k + 20]], rtol=0, atol=1e-6)
        if name == "raw":
            assert calls and all(c is not None for c in calls)
        else:
            assert not calls  # decoded chunk by chunk through the store's cache


def test_shuffled_batches_take_the_plan_one_native_gather_each(data, monkeypatch):
    """After the first batch of positions, the next ones go straight to the native gather
    (one call each) with the source's plan; the plan is not pickled, and after the source
    reopens (a fork, an unpickle) the batch is planned again over the new mapped segments."""
    import pickle

    path, ref = data
    calls = _calls(monkeypatch)
    ds = ActivationDataset(path, hook_points=["a"], open_options={"opener": open_fake})
    batches = [[12, 3, 40], [60, 0, 8, 9], [8, 10, 9], [-1, 5, 6]]  # [8, 10, 9]: within one shard
    for idx in batches:
        got = collate(ds.__getitems__(idx))
        assert torch.equal(got["a"], ref["a"][torch.tensor(idx) % N]), idx
    assert ds._plan is not None
    before = len(calls)
    for idx in batches:
        assert torch.equal(ds.__getitems__(idx).data["a"], ref["a"][torch.tensor(idx) % N]), idx
    assert len(calls) == before + len(batches)  # one native gather per batch, nothing else
    assert pickle.loads(pickle.dumps(ds))._plan is None
    old = ds._plan
    ds.source._drop_handles()
    assert torch.equal(ds.__getitems__([30, 2]).data["a"], ref["a"][[30, 2]])
    assert ds._plan is not old and ds._plan[2] is ds.source._seg_lists["a"]
    # consecutive positions are a view inside the store: the plan's answer is not used for them,
    # the general path clones it (a batch of positions is always the caller's own tensor)
    shard = ds.source.store._shard("a", 1)
    got = ds.__getitems__([8, 9, 10]).data["a"]
    assert got.untyped_storage().data_ptr() != shard.untyped_storage().data_ptr()
    assert torch.equal(got, ref["a"][8:11])


@pytest.mark.parametrize("threads", [1, 2])
def test_a_batch_within_one_mapped_segment_is_a_new_tensor_equal_to_index_select(tmp_path, threads):
    """Rows of one segment (a whole mapped array) are copied by the native loop on the
    calling thread, with one intra-op thread or two: the batch equals plain indexing, is a
    new tensor, and writing into it changes nothing stored."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _one_segment_batches(tmp_path)
    finally:
        torch.set_num_threads(before)


def _one_segment_batches(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32)).eval()
    x = torch.randn(4096, 8)
    path = str(tmp_path / "s.zarr")
    with acs.ActivationScope(store=path).track(model), torch.no_grad():
        for i in range(0, 4096, 512):
            model(x[i : i + 512])
    ds = ActivationDataset(path, hook_points=["0.output"])
    ref = ds[0 : len(ds)]["0.output"].clone()
    assert len(ds.source.boundaries("0.output")) == 2  # one segment: the whole mapped array
    g = np.random.default_rng(0)
    for k in (2, 100, 1000, 4096):
        idx = g.integers(0, 4096, k).tolist()
        got = collate(ds.__getitems__(idx))["0.output"]
        assert torch.equal(got, ref.index_select(0, torch.tensor(idx))), k
        got.add_(1)
    assert torch.equal(ds[0 : len(ds)]["0.output"], ref)


def test_every_hook_point_of_a_batch_of_positions_is_the_callers_own_copy(tmp_path):
    """Positions that are consecutive rows within one shard of another hook point (whose
    shards hold more rows than the first's) are a view of that shard: the batch gets a copy,
    so writing into it never reaches later reads."""
    from activationscope.store import StoreWriter

    path = str(tmp_path / "s.zarr")
    a, big = torch.randn(64, 3), torch.randn(64, 1024)
    w = StoreWriter(path, chunk_rows=8, shard_rows=16)
    for hp, t in (("a", a), ("big", big)):
        w.open_array(hp, tuple(t.shape[1:]), t.dtype, "sample").append(t)
    w.add_batch(64)
    w.close()
    ds = ActivationDataset(path)
    assert ds.source.boundaries("a").tolist() == [0, 16, 32, 48, 64] and ds.source.boundaries("big").tolist() == [0, 64]
    for idx in (list(range(20)), [0, 1, 2, 3, 4, 5], [30, 31, 32, 33]):
        for got in (ds[idx], collate(ds.__getitems__(idx))):
            assert torch.equal(got["a"], a[idx]) and torch.equal(got["big"], big[idx]), idx
            got["a"].zero_()
            got["big"].zero_()
    assert torch.equal(ds[0:64]["big"], big) and torch.equal(ds[0:64]["a"], a)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_unsigned_rows_from_several_shards(tmp_path, compression):
    """uint16 / uint32 / uint64 rows gathered from several shards (a compressed store, or a
    bool mask) are scattered into the batch by their bits: torch has no index_put for them."""
    from activationscope.store import StoreWriter

    path = str(tmp_path / "u.zarr")
    w = StoreWriter(path, chunk_rows=8, shard_rows=16, compression=compression)
    ref = {}
    for dt in (torch.uint16, torch.uint32, torch.uint64):
        t = torch.randint(0, 60000, (64, 3), dtype=torch.int64).to(dt)
        t[5, 0] = 2**16 - 1 if dt == torch.uint16 else 2**31 + 7  # beyond the signed range
        ref[str(dt).split(".")[1]] = t
        w.open_array(str(dt).split(".")[1], (3,), dt, "sample").append(t)
    w.add_batch(64)
    w.close()
    for hp, t in ref.items():
        ds = ActivationDataset(path, hook_points=[hp])
        idx = [5, 40, 3, 63, 17]
        assert torch.equal(collate(ds.__getitems__(idx))[hp].to(torch.int64), t[idx].to(torch.int64)), hp
        mask = [False] * 64
        mask[5] = mask[40] = True
        got = ds[mask][hp]
        assert got.dtype == t.dtype and torch.equal(got.to(torch.int64), t[[5, 40]].to(torch.int64)), hp


def test_a_worker_gathers_shuffled_batches_straight_into_shared_memory(tmp_path, monkeypatch):
    """Inside a DataLoader worker the planned gather writes the rows into shared memory of
    the batch's own, which then crosses to the main process as it is (no second copy); the
    batches equal plain indexing, through a real DataLoader with two workers too."""
    from activationscope.data import ShuffledBatchSampler
    from activationscope.data import dataset as dsm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32)).eval()
    path = str(tmp_path / "s.zarr")
    with acs.ActivationScope(store=path, store_options={"chunk_rows": 64}).track(model), torch.no_grad():
        for _ in range(8):
            model(torch.randn(128, 8))
    ref = ActivationDataset(path)[0:1024]["0.output"].clone()
    ds = ActivationDataset(path)
    monkeypatch.setattr(dsm, "get_worker_info", lambda: object())  # as inside a worker
    for k, idx in enumerate(([5, 700, 3], [900, 1, 2, 3], [10, 11, 12])):  # the first batch plans
        batch = ds.__getitems__(idx)
        rows = batch.data["0.output"]
        assert torch.equal(rows, ref[idx]), idx
        assert ds._plan is not None and ds._plan[-1] is True
        # planned (k > 0): gathered into shared memory (consecutive rows too); the first batch
        # is copied there by __getitems__; either way collate makes no second copy
        assert rows.is_shared() and collate(batch)["0.output"] is rows, idx
    monkeypatch.undo()
    sampler = ShuffledBatchSampler(ds, batch_size=100, seed=3)
    want = [ref[torch.tensor(list(b))] for b in sampler]
    got = [b["0.output"] for b in torch.utils.data.DataLoader(ActivationDataset(path), batch_sampler=sampler,
                                                             num_workers=2)]
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64, torch.complex128,
           torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32,
           torch.uint64, torch.bool]


@pytest.fixture(scope="module")
def every_dtype(tmp_path_factory):
    """A store of 1024 rows of (128,) per dtype, each array one mapped segment."""
    from activationscope.store import StoreWriter

    path = str(tmp_path_factory.mktemp("dtypes") / "d.zarr")
    g = torch.Generator().manual_seed(0)
    ref = {}
    w = StoreWriter(path, chunk_rows=64)
    for dt in _DTYPES:
        if dt == torch.bool:
            t = torch.rand(1024, 128, generator=g) > 0.5
        elif dt.is_floating_point or dt.is_complex:
            t = torch.randn(1024, 128, generator=g, dtype=torch.complex128 if dt.is_complex else torch.float64).to(dt)
        else:  # every bit pattern, unsigned values past the signed range too
            t = torch.randint(-2**62, 2**62, (1024, 128), generator=g, dtype=torch.int64).view(torch.uint8)[:, :128 * dt.itemsize]
            t = t.contiguous().view(dt)
        hp = str(dt).split(".")[1]
        ref[hp] = t
        w.open_array(hp, (128,), dt, "sample").append(t)
    w.add_batch(1024)
    w.close()
    return path, ref


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_of_one_segment_equal_indexing_for_every_dtype(every_dtype, threads):
    """Rows of one mapped segment (a whole uncompressed layer), every dtype, batches from 3
    rows to 1024 (128 KiB and more of bool rows): byte for byte the rows of plain indexing,
    through the dataset and through the native gather into a caller's tensor, on one intra-op
    thread and on two."""
    path, ref = every_dtype
    gather = _native.load().gather_rows
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ds = ActivationDataset(path)
        g = np.random.default_rng(threads)
        batches = [g.integers(0, 1024, k).tolist() for k in (3, 300, 1024, 1024)]
        batches.append(g.permutation(1024).tolist())
        for hp, t in ref.items():
            assert len(ds.source.boundaries(hp)) == 2, hp  # one segment
            want_bytes = t.view(torch.uint8)
            for idx in batches:
                for got in (ds[idx][hp], collate(ds.__getitems__(idx))[hp]):
                    assert got.dtype == t.dtype and got.shape == (len(idx), 128), hp
                    assert torch.equal(got.view(torch.uint8), want_bytes[idx]), (hp, len(idx))
                segs = ds.source._seg_lists[hp]
                out = torch.empty(len(idx), 128, dtype=t.dtype)
                rows, a, b, _ = gather(idx, 1024, 0, [0, 1024], segs, False, out)
                assert rows is out and (a, b) == (-1, -1) and torch.equal(out.view(torch.uint8), want_bytes[idx]), hp
    finally:
        torch.set_num_threads(before)
