"""DataLoader with worker processes (fork and spawn), after the parent already read."""

from __future__ import annotations

import multiprocessing as mp
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch
from fake_store import open_fake, write_fake_store
from torch.utils.data import DataLoader

from activationscope.data import ActivationDataset, ShuffledBatchSampler
from activationscope.data._source import StoreSource

N = 64


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    acts = torch.arange(N * 4, dtype=torch.float32).reshape(N, 4)
    table = pa.table({"sample_id": pa.array(np.arange(N)), "label": pa.array(np.arange(N) % 3)})
    return write_fake_store(tmp_path_factory.mktemp("dl") / "s", {"x": acts}, tables={"sample": table}, shard_rows=24), acts


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_workers_read_every_row_once(store_path, method):
    path, acts = store_path
    ds = ActivationDataset(str(path), columns=["sample_id", "label"], open_options={"opener": open_fake})
    parent = ds[:]["x"]  # the parent maps the store before the workers start
    assert torch.equal(parent, acts)
    sampler = ShuffledBatchSampler(ds, 10, seed=0)
    loader = DataLoader(ds, batch_sampler=sampler, num_workers=2, multiprocessing_context=mp.get_context(method),
                        persistent_workers=False)
    seen = []
    for batch in loader:
        ids = batch["sample_id"]
        assert torch.equal(batch["x"], acts[ids])
        assert torch.equal(batch["label"], ids % 3)
        seen += ids.tolist()
    assert sorted(seen) == list(range(N))


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_default_batch_size_loader_in_workers(store_path, method):
    path, acts = store_path
    ds = ActivationDataset(str(path), open_options={"opener": open_fake})
    ds[0]
    loader = DataLoader(ds, batch_size=16, num_workers=2, multiprocessing_context=mp.get_context(method))
    out = torch.cat([b["x"] for b in loader])
    assert torch.equal(out, acts)


def test_fork_child_drops_and_reopens_store(store_path):
    path, acts = store_path
    src = StoreSource(str(path), {"opener": open_fake})
    src.read("x", 0, 4)
    assert src._store is not None and src._views
    ctx = mp.get_context("fork")
    q = ctx.Queue()

    def child():
        dropped = src._store is None and not src._views
        q.put((dropped, src.read("x", 30, 32).tolist()))

    p = ctx.Process(target=child)
    p.start()
    dropped, rows = q.get(timeout=60)
    p.join(60)
    assert dropped and rows == acts[30:32].tolist()
    assert src._store is not None  # the parent keeps its own


def _memory_store(name):
    import activationscope as acs

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    x = torch.randn(8, 4)
    with torch.no_grad(), acs.ActivationScope(store=f"memory://{name}").track(model):
        model(x)
    with torch.no_grad():
        return model(x)


def test_memory_store_in_spawn_workers_says_where_it_lives():
    from activationscope.errors import StoreError

    _memory_store("spawned")
    ds = ActivationDataset("memory://spawned")
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="spawn")
    with pytest.raises(StoreError, match=r"a memory:// store exists only inside the process that made it.*"
                                         r"multiprocessing_context='fork'.*num_workers=0.*local path"):
        next(iter(loader))


def test_memory_store_in_fork_workers_reads_every_row():
    want = _memory_store("forked")
    ds = ActivationDataset("memory://forked")
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="fork")
    got = torch.cat([b["0.output"] for b in loader])
    assert torch.equal(got, want)
    # in this process, pickling round trips keep working (the store is here)
    import pickle

    assert torch.equal(pickle.loads(pickle.dumps(ds))[:]["0.output"], want)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_workers_reopen_a_store_object_with_its_open_options(tmp_path, method):
    """A dataset of open_store(path, verify=True): the workers reopen the store from its path with
    verify=True too, so a damaged mapped chunk is an error there as in the main process (it was
    read as it is)."""
    from activationscope import open_store
    from activationscope.errors import StoreCorruptError
    from activationscope.store import StoreWriter

    path = tmp_path / "s.zarr"
    data = torch.randn(64, 1024, generator=torch.Generator().manual_seed(0))
    w = StoreWriter(path)
    w.open_array("x", (1024,), torch.float32, "sample").append(data)
    w.add_batch(64)
    w.close()
    (shard,) = [f for f in (path / "acts" / "x" / "c").rglob("*") if f.is_file()]
    raw = bytearray(shard.read_bytes())
    raw[100] ^= 0xFF
    shard.write_bytes(bytes(raw))
    store = open_store(path, verify=True, cache_bytes=1 << 20)
    assert store.open_options() == {"verify": True, "cache_bytes": 1 << 20}
    ds = ActivationDataset(store)
    with pytest.raises(StoreCorruptError, match="crc32c mismatch"):
        ds[0:4]
    loader = DataLoader(ds, batch_size=16, num_workers=1, multiprocessing_context=mp.get_context(method))
    with pytest.raises(StoreCorruptError, match="crc32c mismatch"):
        next(iter(loader))
    # given open_options win over the store's
    assert ActivationDataset(store, open_options={"verify": False}).source._options == {"verify": False, "cache_bytes": 1 << 20}


def test_a_relative_store_path_names_the_same_store_after_chdir(tmp_path, monkeypatch):
    # (the path was kept as given: a worker, or a pickled copy, reopened it relative to the
    # current folder, so after os.chdir it read another store of that name, or none at all)
    import pickle

    from activationscope.store import StoreWriter

    data = {}
    for name, sign in (("a", 1.0), ("b", -1.0)):
        (tmp_path / name / "runs").mkdir(parents=True)
        data[name] = sign * torch.arange(40 * 3, dtype=torch.float32).reshape(40, 3)
        w = StoreWriter(tmp_path / name / "runs" / "s.zarr", chunk_rows=8, shard_rows=16)
        w.open_array("x", (3,), torch.float32, "sample").append(data[name])
        w.add_batch(40)
        w.close()
    monkeypatch.chdir(tmp_path / "a")
    ds = ActivationDataset("runs/s.zarr")
    assert "runs/s.zarr" in repr(ds)  # (messages name the path as given)
    monkeypatch.chdir(tmp_path / "b")  # another store of the same relative name here
    assert torch.equal(pickle.loads(pickle.dumps(ds))[:]["x"], data["a"])
    loader = DataLoader(ds, batch_size=16, num_workers=1, multiprocessing_context=mp.get_context("fork"))
    assert torch.equal(torch.cat([b["x"] for b in loader]), data["a"])
    monkeypatch.chdir(tmp_path)  # nothing of that name here
    assert torch.equal(pickle.loads(pickle.dumps(ds))[[39, 0]]["x"], data["a"][[39, 0]])

    class BytesPath:  # an os.PathLike whose path is bytes
        def __fspath__(self):
            return b"a/runs/s.zarr"

    assert torch.equal(pickle.loads(pickle.dumps(ActivationDataset(BytesPath())))[:]["x"], data["a"])


def _as_is(batch):
    return batch


def test_worker_batches_never_carry_the_whole_store_map(store_path):
    # (a view of the store's map that reached the main process without our collate, with
    # batch_size=None or a collate_fn of the user's, was pickled with its whole storage: torch
    # moved the whole mapped store into shared memory, in each worker)
    from activationscope.data import SequentialBatchSampler, collate

    path, acts = store_path
    ds = ActivationDataset(str(path), columns=["label"], open_options={"opener": open_fake})
    assert ds[0]["x"].untyped_storage().nbytes() > acts[0].nbytes  # (in this process: a view of the map)
    fork = mp.get_context("fork")
    items = list(DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context=fork))
    assert all(it["x"].untyped_storage().nbytes() == acts[0].nbytes for it in items)
    assert torch.equal(torch.stack([it["x"] for it in items]), acts)
    assert [int(it["label"]) for it in items] == [i % 3 for i in range(N)]
    for sampler in (SequentialBatchSampler(ds, 10), ShuffledBatchSampler(ds, 10, seed=1)):
        order = [i for b in sampler for i in b]
        batches = list(DataLoader(ds, batch_sampler=sampler, num_workers=2, multiprocessing_context=fork,
                                  collate_fn=_as_is))
        for b in batches:
            assert all(t.untyped_storage().nbytes() == t.nbytes for t in b.data.values())
        assert torch.equal(torch.cat([collate(b)["x"] for b in batches]), acts[order])



@pytest.mark.parametrize("which", ["shuffled", "sequential"])
def test_a_batch_sampler_given_as_sampler_says_to_pass_it_as_batch_sampler(store_path, which):
    # (with batch_size= the DataLoader groups the sampler's batches into lists of batches; the
    # error named only "[3, 1, ...] (list) at element 0", not the DataLoader argument to change)
    from activationscope.data import SequentialBatchSampler
    from activationscope.errors import ArgumentTypeError

    path, acts = store_path
    ds = ActivationDataset(str(path), open_options={"opener": open_fake})
    sampler = ShuffledBatchSampler(ds, 4, seed=0) if which == "shuffled" else SequentialBatchSampler(ds, 4)
    with pytest.raises(ArgumentTypeError, match=r"at element 0 of .*; this is a list of batches, as "
                       r"DataLoader\(ds, sampler=batch_sampler, batch_size=n\) makes .*: pass it as "
                       r"DataLoader\(ds, batch_sampler=batch_sampler\)$"):
        next(iter(DataLoader(ds, sampler=sampler, batch_size=8)))
    with pytest.raises(ArgumentTypeError, match=r"got \[2\] \(list\) at element 1 of \[1, \[2\]\]$"):
        ds[[1, [2]]]  # (one stray list among positions is no list of batches)
    order = [i for b in sampler for i in b]
    batches = list(DataLoader(ds, batch_sampler=sampler))
    assert torch.equal(torch.cat([b["x"] for b in batches]), acts[order])


_FORKED_S3_CHILD = """
import json, sys
import torch
import activationscope as acs
from torch.utils.data import DataLoader
from activationscope.data import ActivationDataset, ShuffledBatchSampler

url, so = sys.argv[1], json.loads(sys.argv[2])
want = torch.load(sys.argv[3])
ds = ActivationDataset(url, hook_points="0.output", columns=["sample_id"], open_options={"storage_options": so})
assert torch.equal(ds[:]["0.output"], want)  # (the dataset's store holds a client session now)
loader = DataLoader(ds, batch_sampler=ShuffledBatchSampler(ds, batch_size=8, seed=0), num_workers=2,
                    multiprocessing_context="fork")
seen = []
for batch in loader:
    assert torch.equal(batch["0.output"], want[batch["sample_id"]])
    seen += batch["sample_id"].tolist()
assert sorted(seen) == list(range(40))
print("read", len(seen))
"""


def test_forked_workers_of_an_s3_dataset_print_nothing_about_the_parents_client_sessions(s3, tmp_path):
    """A forked worker drops the store object the dataset opened in the parent and reopens the
    store; the dropped object's S3 client session, finalised in the child, made every worker
    print "Unclosed client session" (aiohttp) on stderr. The rows read are the stored ones."""
    import json
    import os
    import subprocess
    import sys

    import activationscope as acs

    url = "s3://acs-bucket/forked-workers.zarr"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8)).eval()
    xs = torch.randn(40, 4)
    scope = acs.ActivationScope(store=url, store_options={"storage_options": s3, "overwrite": True})
    with scope.track(model) as tr, torch.no_grad():
        for i in range(0, 40, 10):
            tr.set_batch(sample_ids=range(i, i + 10))
            model(xs[i:i + 10])
    with torch.no_grad():
        torch.save(torch.cat([model(x) for x in xs.split(10)]), tmp_path / "want.pt")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", _FORKED_S3_CHILD, url, json.dumps(s3), str(tmp_path / "want.pt")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "read 40", out.stderr
    assert "Unclosed client session" not in out.stderr


def test_columns_are_read_when_made_and_fork_workers_share_them(store_path, monkeypatch):
    # (each DataLoader worker read the whole row table and made its own column tensors before
    # its first batch: 45 s and 3 GB per worker for a store of 50 million token rows)
    path, acts = store_path
    ds = ActivationDataset(str(path), columns=["sample_id", "label"], open_options={"opener": open_fake})

    def refused(self, kind):
        raise AssertionError(f"row table {kind!r} read again")

    monkeypatch.setattr(StoreSource, "row_table", refused)
    assert torch.equal(ds[:]["label"], torch.arange(N) % 3)
    loader = DataLoader(ds, batch_sampler=ShuffledBatchSampler(ds, 10, seed=0), num_workers=2,
                        multiprocessing_context=mp.get_context("fork"))
    batches = list(loader)
    ids = torch.cat([b["sample_id"] for b in batches])
    assert sorted(ids.tolist()) == list(range(N))
    assert torch.equal(torch.cat([b["label"] for b in batches]), ids % 3)
    assert torch.equal(torch.cat([b["x"] for b in batches]), acts[ids])


def _token_store_with_columns(path):
    """Token rows of 6 samples (3 forwards of 2, some tokens masked) with a per-sample int and
    str column and a per-token float16 column: {hook point "h": rows}."""
    from activationscope.store import StoreWriter

    w = StoreWriter(path, shard_rows=8)
    h = w.open_array("h", (2,), torch.float32, "token")
    rows = []
    for f in range(3):
        mask = torch.tensor([[True, True, True, f != 1], [True, f != 2, False, False]])
        n = int(mask.sum())
        x = torch.arange(len(rows) * 2, (len(rows) + n) * 2, dtype=torch.float32).reshape(n, 2)
        h.append(x)
        rows += list(x)
        w.add_batch(2, [2 * f, 2 * f + 1], mask, columns={
            "label": torch.tensor([f, 10 + f]), "name": [f"s{2 * f}", f"s{2 * f + 1}"],
            "weight": (torch.arange(8, dtype=torch.float16).reshape(2, 4) + f)})
    w.close()
    return torch.stack(rows)


def _refuse_row_table_reads(worker_id):
    # (in a worker: every column must have come with the dataset, none read again)
    def refused(self, kind, columns=None):
        raise AssertionError(f"worker {worker_id} read the {kind} row table {columns} again")

    StoreSource.row_table = refused


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_spawned_workers_get_the_columns_with_the_dataset_in_shared_memory(tmp_path, method):
    # (each spawn / forkserver worker read the row table and made the columns= tensors again
    # before its first batch: 29-57 s and about 3 GB per worker of 50 million token rows)
    rows = _token_store_with_columns(tmp_path / "t.zarr")
    ds = ActivationDataset(str(tmp_path / "t.zarr"), columns=["sample_id", "pos", "label", "name", "weight"],
                           filter=pc.field("pos") < 3)
    sampler = ShuffledBatchSampler(ds, 3, seed=0)
    want = list(DataLoader(ds, batch_sampler=sampler, num_workers=0))
    assert not ds._column_values()["label"].is_shared()
    loader = DataLoader(ds, batch_sampler=sampler, num_workers=2, multiprocessing_context=mp.get_context(method),
                        worker_init_fn=_refuse_row_table_reads)
    got = list(loader)
    assert len(got) == len(want) == 5
    for g, w in zip(got, want):
        assert list(g) == list(w) == ["h", "sample_id", "pos", "label", "name", "weight"]
        for k in g:
            assert g[k] == w[k] if k == "name" else (torch.equal(g[k], w[k]) and g[k].dtype == w[k].dtype), k
    seen = torch.cat([g["sample_id"] for g in got])
    assert sorted(seen.tolist()) == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 4, 4, 4, 5]
    assert torch.equal(torch.cat([g["h"] for g in got]), rows[ds.store_rows()][torch.cat(
        [torch.tensor(b) for b in sampler])])
    # the workers map the parent's column tensors (moved into shared memory once), not copies of their own
    cols = ds._column_values()
    assert all(cols[c].is_shared() for c in ("sample_id", "pos", "label", "weight"))
    assert torch.equal(ds[:]["label"], torch.tensor([0, 0, 0, 10, 10, 1, 1, 1, 11, 11, 2, 2, 2, 12]))


def test_columns_too_big_for_shared_memory_are_read_again_by_each_worker(tmp_path, monkeypatch):
    # shared memory is a tmpfs of its own size (64 MB in a default Docker container): moving
    # columns that do not fit into it would kill the process with SIGBUS; they are left out
    # (each spawned worker reads them again, as before) with a warning saying so and the fix
    from multiprocessing.reduction import ForkingPickler

    from activationscope.data import dataset as dataset_mod

    _token_store_with_columns(tmp_path / "t.zarr")
    ds = ActivationDataset(str(tmp_path / "t.zarr"), columns=["sample_id", "label", "name"])
    need = sum(ds._column_values()[c].untyped_storage().nbytes() for c in ("sample_id", "label"))
    monkeypatch.setattr(dataset_mod, "_shared_memory_free_bytes", lambda: 2 * need - 1)
    with pytest.warns(RuntimeWarning, match=rf"columns= tensors \({need:,} bytes\) do not fit in half of the free "
                                            rf"shared memory \(/dev/shm has {2 * need - 1:,} bytes free\), so each "
                                            r"spawn .*--shm-size=.*multiprocessing_context='fork'"):
        sent = ForkingPickler.loads(ForkingPickler.dumps(ds))
    assert sent._col_cache is None and not ds._column_values()["label"].is_shared()
    assert torch.equal(sent[:]["label"], ds[:]["label"]) and sent[:]["name"] == ds[:]["name"]
    with warnings.catch_warnings():  # (said once per dataset)
        warnings.simplefilter("error")
        ForkingPickler.dumps(ds)
    monkeypatch.setattr(dataset_mod, "_shared_memory_free_bytes", lambda: 2 * need)
    sent = ForkingPickler.loads(ForkingPickler.dumps(ds))
    assert sent._col_cache is not None and ds._column_values()["label"].is_shared()
