"""ActivationDataset on real stores captured with ActivationScope: probe parity, token rows, docs."""

from __future__ import annotations

from pathlib import Path

import pyarrow.compute as pc
import pytest
import torch
from torch.utils.data import DataLoader

import activationscope as acs

try:
    from activationscope.store import open_store  # noqa: F401
except ImportError:  # the store is not there yet
    pytest.skip("activationscope.store.open_store is not available", allow_module_level=True)

from activationscope.data import ActivationDataset, SequentialBatchSampler, ShuffledBatchSampler

ROOT = Path(__file__).resolve().parents[2]


def _problem(n=600, d=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(d, generator=g)
    y = (x @ w > 0).long()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(d, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh()).eval()
    return x, y, model


def _train_probe(batches, d_in, epochs_batches):
    torch.manual_seed(0)
    probe = torch.nn.Linear(d_in, 2)
    opt = torch.optim.SGD(probe.parameters(), lr=0.5)
    for acts, labels in epochs_batches(batches):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(probe(acts.float()), labels).backward()
        opt.step()
    return probe


def _accuracy(probe, acts, labels):
    with torch.no_grad():
        return float((probe(acts.float()).argmax(1) == labels).float().mean())


def test_linear_probe_through_dataloader_matches_in_memory(tmp_path):
    x, y, model = _problem()
    hp = "3.output"
    # in-memory capture
    with acs.ActivationScope().track(model, include=["3"]) as tracker, torch.no_grad():
        for i in range(0, len(x), 100):
            model(x[i : i + 100])
    mem = torch.cat(tracker.activations[hp])
    # store capture of the same forwards, with labels
    with acs.ActivationScope(store=tmp_path / "p.zarr").track(model, include=["3"]) as tracker, torch.no_grad():
        for i in range(0, len(x), 100):
            tracker.set_batch(sample_ids=range(i, i + 100), label=y[i : i + 100].tolist())
            model(x[i : i + 100])
    train, test = slice(0, 480), slice(480, 600)
    ds = ActivationDataset(str(tmp_path / "p.zarr"), hook_points=[hp], columns=["label"], rows=train)
    sampler = ShuffledBatchSampler(ds, 32, seed=0)

    def store_batches(_):
        for epoch in range(5):
            sampler.set_epoch(epoch)
            for b in DataLoader(ds, batch_sampler=sampler):
                yield b[hp], b["label"]

    def memory_batches(_):
        for epoch in range(5):
            sampler.set_epoch(epoch)
            for idx in sampler:
                yield mem[train][idx], y[train][idx]

    p_store = _train_probe(None, 32, store_batches)
    p_mem = _train_probe(None, 32, memory_batches)
    test_ds = ActivationDataset(str(tmp_path / "p.zarr"), hook_points=[hp], columns=["label"], rows=test)
    held = test_ds[:]
    acc_store = _accuracy(p_store, held[hp], held["label"])
    acc_mem = _accuracy(p_mem, mem[test], y[test])
    assert torch.equal(held[hp], mem[test]) and torch.equal(held["label"], y[test])
    assert acc_store == acc_mem
    assert acc_store > 0.85, acc_store  # the probe learns the problem


def test_token_rows_filters_and_views(tmp_path, transformer):
    torch.manual_seed(0)
    x = torch.randn(4, 7, 16)
    mask = torch.ones(4, 7, dtype=torch.bool)
    mask[2:, 4:] = False
    with acs.ActivationScope(store=tmp_path / "t.zarr").track(transformer, include=["layers.0"]) as tracker, torch.no_grad():
        tracker.set_batch(attention_mask=mask, sample_ids=[10, 11, 12, 13], label=[0, 1, 0, 1])
        out = transformer(x, src_key_padding_mask=~mask)
    store = open_store(tmp_path / "t.zarr")
    hp = "layers.0.output"
    assert store.row_kind(hp) == "token" and store.n_rows(hp) == int(mask.sum())
    ds = ActivationDataset(store, hook_points=[hp], columns=["sample_id", "pos", "label"])
    full = ds[:]
    with acs.ActivationScope().track(transformer, include=["layers.0"]) as mem, torch.no_grad():
        transformer(x, src_key_padding_mask=~mask)
    ref = mem.activations[hp][0][mask]  # (n_tokens, d_model): real tokens, padding dropped
    assert torch.equal(full[hp], ref)
    assert full["pos"].tolist() == [p for b in range(4) for p in range(int(mask[b].sum()))]
    assert full["sample_id"].tolist() == [10] * 7 + [11] * 7 + [12] * 4 + [13] * 4
    no_bos = ActivationDataset(store, hook_points=[hp], columns=["pos"], filter=pc.field("pos") > 0)
    assert len(no_bos) == len(ds) - 4 and bool((no_bos[:]["pos"] > 0).all())
    ones = ActivationDataset(store, hook_points=[hp], columns=["label"], filter=pc.field("label") == 1)
    assert len(ones) == 11
    assert out.shape == (4, 7, 16)


def test_docs_examples_run(tmp_path):
    from acs_testing import run_doc_blocks

    run_doc_blocks(ROOT / "docs" / "usage" / "dataset.md", tmp_path, min_blocks=5)


def _capture(path, dtype=None, n=96, d=16, **store_options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, d), torch.nn.ReLU()).eval()
    x = torch.randn(n, 8)
    with acs.ActivationScope(store=path, storage_dtype=dtype, store_options=store_options).track(
        model, include=["0"]
    ) as tracker, torch.no_grad():
        for i in range(0, n, 16):
            tracker.set_batch(sample_ids=range(i, i + 16), label=[j % 3 for j in range(i, i + 16)])
            model(x[i : i + 16])
    ref = model[0](x)
    return ref if dtype is None else ref.to(dtype)


def _mapping_of(ptr):
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(v, 16) for v in parts[0].split("-"))
            if lo <= ptr < hi:
                return parts[5] if len(parts) > 5 else None
    return None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_real_store_views_gathers_and_dtypes(tmp_path, dtype):
    # 16 rows of 16 values per chunk, 2 chunks per shard: shards of 32 rows
    ref = _capture(tmp_path / "s.zarr", dtype, chunk_rows=16, shard_bytes=2 * 16 * 16 * ref_size(dtype))
    ds = ActivationDataset(str(tmp_path / "s.zarr"), hook_points=["0.output"], columns=["sample_id", "label"])
    assert ds.block_boundaries().tolist() == [0, 32, 64, 96]
    view = ds[34:60]["0.output"]
    assert view.dtype == dtype and torch.equal(view, ref[34:60])
    backing = _mapping_of(view.data_ptr())
    assert backing is not None and backing.startswith(str(tmp_path / "s.zarr")), backing
    across = ds[20:40]["0.output"]
    assert torch.equal(across, ref[20:40]) and _mapping_of(across.data_ptr()) != backing
    idx = [95, 0, 33, 64, 3]
    assert torch.equal(ds[idx]["0.output"], ref[idx]) and ds[idx]["label"].tolist() == [i % 3 for i in idx]
    # writing into a returned batch (default collate) never reaches the store on disk
    batch = next(iter(DataLoader(ds, batch_size=8)))["0.output"]
    batch.add_(1)
    assert torch.equal(ActivationDataset(str(tmp_path / "s.zarr"), hook_points=["0.output"])[:8]["0.output"], ref[:8])


def ref_size(dtype):
    return torch.empty((), dtype=dtype).element_size()


def test_real_compressed_store_reads_through_the_chunk_cache(tmp_path):
    # Captured in a fresh process: in the store writer at this commit, a compressed capture
    # after an uncompressed one in the same process kills its encoder thread and hangs close().
    import subprocess
    import sys

    code = (
        "import sys, torch; sys.path.insert(0, sys.argv[1]); from test_real_store import _capture; "
        "torch.save(_capture(sys.argv[2], compression='zstd', chunk_rows=16), sys.argv[3])"
    )
    subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), str(tmp_path / "c.zarr"),
                    str(tmp_path / "ref.pt")], check=True, timeout=300)
    ref = torch.load(tmp_path / "ref.pt")
    ds = ActivationDataset(str(tmp_path / "c.zarr"), hook_points=["0.output"], open_options={"cache_bytes": 4096})
    assert ds.block_boundaries().tolist() == [0, 16, 32, 48, 64, 80, 96]
    assert torch.equal(ds[:]["0.output"], ref)
    assert torch.equal(ds[[90, 1, 50]]["0.output"], ref[[90, 1, 50]])


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_real_store_dataloader_workers(tmp_path, method):
    import multiprocessing as mp

    ref = _capture(tmp_path / "w.zarr", chunk_rows=16, shard_bytes=2 * 16 * 16 * 4)
    ds = ActivationDataset(str(tmp_path / "w.zarr"), columns=["sample_id"])
    assert torch.equal(ds[:]["0.output"], ref)  # the parent reads (and maps) first
    sampler = ShuffledBatchSampler(ds, 10, seed=1)
    loader = DataLoader(ds, batch_sampler=sampler, num_workers=2, multiprocessing_context=mp.get_context(method))
    seen = []
    for b in loader:
        assert torch.equal(b["0.output"], ref[b["sample_id"]])
        seen += b["sample_id"].tolist()
    assert sorted(seen) == list(range(96))
    seq = DataLoader(ds, batch_sampler=SequentialBatchSampler(ds, 32), num_workers=2,
                     multiprocessing_context=mp.get_context(method))
    assert torch.equal(torch.cat([b["0.output"] for b in seq]), ref)


def test_hook_point_named_like_a_pattern_reads_itself(tmp_path):
    """A hook point whose name is also an fnmatch pattern (``d.a[1].output`` matches
    ``d.a1.output``) selects itself in ActivationDataset, export_parquet and the CLI."""
    import pyarrow.parquet as pq

    from activationscope import cli
    from activationscope.data import export_parquet

    from acs_testing import BracketNames

    torch.manual_seed(0)
    model, x = BracketNames(), torch.randn(5, 2)
    with acs.ActivationScope(store=tmp_path / "b.zarr").track(model) as tracker, torch.no_grad():
        tracker.set_batch(sample_ids=list(range(5)))
        model(x)
    want = model.d["a[1]"](x).detach()
    ds = ActivationDataset(tmp_path / "b.zarr", hook_points="d.a[1].output")
    assert ds.hook_points == ["d.a[1].output"]
    assert torch.equal(ds[:]["d.a[1].output"], want)
    export_parquet(tmp_path / "b.zarr", tmp_path / "b.parquet", hook_points="d.a[1].output")
    assert pq.read_schema(tmp_path / "b.parquet").names.count("d.a[1].output") == 1
    assert "d.a1.output" not in pq.read_schema(tmp_path / "b.parquet").names
    store = acs.open_store(tmp_path / "b.zarr")
    assert cli._check_hook_points(store, ["d.a[1].output"]) == ["d.a[1].output"]
    assert cli._check_hook_points(store, ["d.a?.output"]) == ["d.a1.output"]


def _two_forwards_of_the_same_ids(path, ids, labels):
    """Two forwards of two 3-token samples with sample ids ``ids[f]`` and labels ``labels[f]``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 4), torch.nn.Linear(4, 4))
    tokens = torch.randint(1, 50, (2, 3))
    with acs.ActivationScope(store=path).track(model, include=["1"]) as tracker, torch.no_grad():
        for f in range(2):
            tracker.set_batch(attention_mask=torch.ones(2, 3, dtype=torch.bool), sample_ids=ids[f], label=labels[f])
            model(tokens)


def test_token_rows_get_the_columns_of_their_own_sample_when_ids_repeat_across_forwards(tmp_path):
    # the same two samples captured twice (two epochs, other labels): ids repeat, samples do not
    _two_forwards_of_the_same_ids(tmp_path / "t.zarr", ids=[[0, 1], [0, 1]], labels=[[0, 1], [1, 0]])
    ds = ActivationDataset(str(tmp_path / "t.zarr"), columns=["sample_id", "batch", "label"])
    samples = open_store(tmp_path / "t.zarr").row_table("sample").to_pylist()
    want = [s["label"] for s in samples for _ in range(3)]  # each sample's label on its 3 token rows
    assert want == [0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0]
    assert ds[:]["label"].tolist() == want
    assert [int(ds[i]["label"]) for i in range(len(ds))] == want
    ones = ActivationDataset(str(tmp_path / "t.zarr"), columns=["batch"], filter=pc.field("label") == 1)
    assert ones[:]["batch"].tolist() == [0, 0, 0, 1, 1, 1]


def test_one_id_twice_in_a_forward_with_other_columns_is_refused_not_paired_with_one(tmp_path):
    from activationscope.errors import ActivationScopeError

    _two_forwards_of_the_same_ids(tmp_path / "a.zarr", ids=[[5, 5], [6, 7]], labels=[[0, 1], [0, 1]])
    with pytest.raises(ActivationScopeError, match=r"batch 0, sample_id 5 .*column 'label' differs \(0, 1\)"):
        ActivationDataset(str(tmp_path / "a.zarr"), columns=["label"])
    # token rows that do not read the label: other columns, sample_ids= and rows= select them
    path = str(tmp_path / "a.zarr")
    assert ActivationDataset(path, columns=["pos", "sample_id"])[:]["sample_id"].tolist() == [5] * 6 + [6] * 3 + [7] * 3
    assert ActivationDataset(path, columns=["pos"], sample_ids=[6])[:]["pos"].tolist() == [0, 1, 2]
    assert len(ActivationDataset(path, rows=[0, 7])) == 2
    # a filter reads the columns it names: one on pos selects, one on the label is refused
    assert ActivationDataset(path, columns=["pos"], filter=pc.field("pos") > 0)[:]["pos"].tolist() == [1, 2] * 4
    with pytest.raises(ActivationScopeError, match=r"column 'label' differs \(0, 1\).* without 'label' in columns= "
                       r"and in filter="):
        ActivationDataset(path, filter=pc.field("label") == 0)
    with pytest.raises(ActivationScopeError, match=r"column 'label' differs \(0, 1\)"):  # (a callable sees it all)
        ActivationDataset(path, filter=lambda t: pc.greater(t["pos"], 0))
    # an export writes the columns it is given; every one (the label too) when none is given
    from activationscope.data.export import export_parquet
    import pyarrow.parquet as pq

    export_parquet(path, tmp_path / "pos.parquet", columns=["pos"])
    assert pq.read_table(tmp_path / "pos.parquet").column("pos").to_pylist() == [0, 1, 2] * 4
    for source in (path, ActivationDataset(path)):
        with pytest.raises(ActivationScopeError, match=r"column 'label' differs"):
            export_parquet(source, tmp_path / "all.parquet", overwrite=True)
    # the same id twice with the same columns pairs as it is
    _two_forwards_of_the_same_ids(tmp_path / "b.zarr", ids=[[5, 5], [6, 7]], labels=[[1, 1], [0, 1]])
    assert ActivationDataset(str(tmp_path / "b.zarr"), columns=["label"])[:]["label"].tolist() == [1] * 6 + [0] * 3 + [1] * 3


def test_row_tables_whose_sample_ids_have_two_types_are_damage_not_a_pyarrow_error(tmp_path):
    """A token row table whose sample_id column is of another type than the sample table's
    (an edited part, its crc32c recomputed) raised pyarrow's ArrowTypeError from the dataset,
    and verify returned []. One writer writes both from the same ids: the dataset raises
    StoreCorruptError naming the column and both types, and verify names it."""
    import io
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from activationscope.errors import StoreCorruptError
    from activationscope.store import _format as F

    path = tmp_path / "t.zarr"
    _two_forwards_of_the_same_ids(path, ids=[[0, 1], [2, 3]], labels=[[0, 1], [1, 0]])
    assert ActivationDataset(str(path), columns=["label"])[:]["label"].tolist() == [0] * 3 + [1] * 6 + [0] * 3
    (part,) = (path / "rows" / "token").glob("*.parquet")
    table = pq.read_table(part)
    table = table.set_column(0, "sample_id", pa.array([str(v) for v in table.column("sample_id").to_pylist()]))
    buf = io.BytesIO()
    pq.write_table(table, buf)
    part.write_bytes(buf.getvalue())
    doc = json.loads((path / "zarr.json").read_text())
    doc["attributes"]["activationscope"]["row_tables"]["token"]["crc32c"][f"rows/token/{part.name}"] = \
        F.crc32c(buf.getvalue())
    (path / "zarr.json").write_text(json.dumps(doc))
    assert open_store(path).verify() == ["row tables: column 'sample_id' is string in the token row table and int64 "
                                         "in the sample row table (one writer writes both from the same values)"]
    with pytest.raises(StoreCorruptError, match=r"column 'sample_id' is string in the token row table and int64 in "
                                                r"the sample row table"):
        ActivationDataset(str(path), columns=["label"])[:]

def _token_rank_stores(tmp_path, n_forwards, columns):
    """Two rank stores (RankStore(r, 2), not committed) of token rows of an Embedding + Linear:
    ``n_forwards`` forwards of 2 samples x 3 tokens each, ``columns(r)`` given to set_batch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 4), torch.nn.Linear(4, 4))
    path = tmp_path / "r.zarr"
    for r in range(2):
        options = {"process_group": acs.RankStore(r, 2), "chunk_rows": 2, "shard_rows": 4}
        with acs.ActivationScope(store=path, store_options=options).track(model, include=["1"]) as tracker, torch.no_grad():
            for _ in range(n_forwards):
                tracker.set_batch(attention_mask=torch.ones(2, 3, dtype=torch.bool), **columns(r))
                model(torch.randint(1, 50, (2, 3)))
    return path


@pytest.mark.parametrize("committed", [False, True])
def test_token_rows_of_each_rank_get_their_own_sample_columns_with_default_ids(tmp_path, committed):
    # default sample ids count per rank: ids 0, 1 on both ranks, told apart by the rank column
    from activationscope.store.ranks import commit_ranks

    path = _token_rank_stores(tmp_path, 1, lambda r: {"label": [10 * r, 10 * r + 1]})
    if committed:
        commit_ranks(path)
    got = ActivationDataset(str(path), columns=["rank", "sample_id", "label"])[:]
    assert got["label"].tolist() == [10 * r + s for r, s in zip(got["rank"].tolist(), got["sample_id"].tolist())]
    assert sorted(got["label"].tolist()) == [0, 0, 0, 1, 1, 1, 10, 10, 10, 11, 11, 11]


def test_segments_of_an_uncommitted_multi_rank_store(tmp_path):
    # (store.segments raised "ValueError: too many values to unpack" on a store whose ranks
    # have not been committed yet: it was read as (bounds, views) of each rank store)
    path = _token_rank_stores(tmp_path, 2, lambda r: {})
    store = open_store(path)
    assert store.status == "incomplete" and store.ranks == [0, 1] and store.n_rows("1.output") == 24
    segments = store.segments("1.output")
    assert segments == store.row_blocks("1.output")[0] and segments[0] == 0 and segments[-1] == 24
    assert 12 in segments and all(a < b for a, b in zip(segments, segments[1:]))  # (rank 1 starts a segment)
    rows = store["1.output"]
    for a, b in zip(segments, segments[1:]):
        assert torch.equal(store.rows("1.output", a, b), rows[a:b])
    # a read hint over both ranks is taken as its docstring says: (lo, hi) covering the range
    assert store.will_read("1.output", 10, 14) == (10, 14)
    assert torch.equal(store.rows("1.output", 10, 14), rows[10:14])
