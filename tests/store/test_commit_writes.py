"""A commit writes its array documents and manifests in the committing thread on a fast
local folder, through a small thread pool where writes are slow (a network file system):
either way every document lands, and a failed write is the commit's error."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import activationscope as acs
from activationscope.errors import StoreError
from activationscope.store import writer as W
from activationscope.store._backend import LocalBackend


class _Model(torch.nn.Module):
    def __init__(self, n: int = 10) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _capture(path, xs):
    model = _Model()
    with torch.no_grad(), acs.ActivationScope(store=str(path)).track(model):
        for x in xs:
            model(x)
    return model


def _threads_of_sets(monkeypatch, delay_s: float) -> set[str]:
    names: set[str] = set()
    real = LocalBackend.set

    def set_(self, key, data):
        names.add(threading.current_thread().name)
        if delay_s:
            time.sleep(delay_s)
        return real(self, key, data)

    monkeypatch.setattr(LocalBackend, "set", set_)
    return names


@pytest.mark.parametrize("delay_s", [0.0, 0.002], ids=["fast", "slow"])
def test_every_document_of_a_commit_lands_whether_written_in_one_thread_or_a_pool(tmp_path, monkeypatch, delay_s):
    names = _threads_of_sets(monkeypatch, delay_s)
    if not delay_s:  # fast writes, whatever else runs on the machine: a write of 60 s counts as slow
        monkeypatch.setattr(W, "_SERIAL_WRITE_S", 60.0)
    xs = [torch.randn(3, 4) for _ in range(4)]
    model = _capture(tmp_path / "s.zarr", xs)
    pooled = {n for n in names if n.startswith("activationscope-commit")}
    assert bool(pooled) == (delay_s > W._SERIAL_WRITE_S)  # the pool only where writes are slow
    store = acs.open_store(tmp_path / "s.zarr")
    assert store.status == "complete" and len(store.hook_points) == 10
    outs = list(xs)  # each layer's outputs, forward by forward as captured (a matmul's last bits depend on the batch)
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            outs = [layer(x) for x in outs]
            assert torch.equal(store[f"layers.{i}.output"], torch.cat(outs))


@pytest.mark.parametrize("delay_s", [0.0, 0.002], ids=["fast", "slow"])
def test_a_failed_document_write_is_the_commits_error(tmp_path, monkeypatch, delay_s):
    real = LocalBackend.set

    def set_(self, key, data):
        if delay_s:
            time.sleep(delay_s)
        if key.endswith("layers.7.output/zarr.json"):
            raise StoreError(f"cannot write {key}: disk full (simulated)")
        return real(self, key, data)

    monkeypatch.setattr(LocalBackend, "set", set_)
    with pytest.raises(StoreError, match=r"layers\.7\.output/zarr\.json: disk full"):
        _capture(tmp_path / "s.zarr", [torch.randn(3, 4)])


@pytest.mark.parametrize("delay_s", [0.0, 0.002], ids=["fast", "slow"])
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_resume_whose_commit_fails_midway_leaves_the_committed_rows_readable(tmp_path, monkeypatch, delay_s,
                                                                                compression):
    # the resume rewrites each array's partial last shard: the failed commit renamed every
    # rewrite over its key and wrote the manifests of some arrays (not the root) before the
    # failure; what the failed close leaves must read as the committed store
    from activationscope.cli import main as cli_main

    path = tmp_path / "s.zarr"
    options = {"compression": compression}
    xs = [torch.randn(3, 4) for _ in range(4)]
    model = _Model()
    with torch.no_grad(), acs.ActivationScope(store=str(path), store_options=options).track(model):
        for x in xs:
            model(x)
    first = acs.open_store(path)
    committed = {hp: first[hp].clone() for hp in first.hook_points}
    real = LocalBackend.set
    written = []

    def set_(self, key, data):
        if delay_s:
            time.sleep(delay_s)
        if key == "acts/layers.5.output/manifest.json":
            raise StoreError(f"cannot write {key}: disk full (simulated)")
        real(self, key, data)
        written.append(key)

    monkeypatch.setattr(LocalBackend, "set", set_)
    with pytest.raises(StoreError, match=r"layers\.5\.output/manifest\.json: disk full"):
        with torch.no_grad(), acs.ActivationScope(store=str(path), store_options={**options, "resume": True}) \
                .track(model):
            for x in xs:
                model(x)
    monkeypatch.setattr(LocalBackend, "set", real)
    assert "acts/layers.0.output/manifest.json" in written  # (other arrays' manifests were written)
    for verified in (False, True):
        store = acs.open_store(path, verify=verified)
        assert store.status == "incomplete" and sorted(store.hook_points) == sorted(committed)
        for hp, rows in committed.items():
            assert torch.equal(store[hp], rows), hp
    assert cli_main(["verify", str(path)]) == 0
    with torch.no_grad(), acs.ActivationScope(store=str(path), store_options={**options, "resume": True}) \
            .track(model):
        for x in xs:
            model(x)
    store = acs.open_store(path, verify=True)
    assert store.status == "complete"
    for hp, rows in committed.items():
        assert torch.equal(store[hp], torch.cat([rows, rows])), hp
    assert cli_main(["verify", str(path)]) == 0


def test_an_object_store_s_commit_goes_through_the_pool_however_fast_its_writes(tmp_path, monkeypatch):
    import uuid

    from activationscope.store._backend import ZarrBackend

    names: list[tuple[str, str]] = []
    real = ZarrBackend.set

    def set_(self, key, data):
        names.append((key, threading.current_thread().name))
        return real(self, key, data)

    monkeypatch.setattr(ZarrBackend, "set", set_)
    url = f"memory://acs-commit-writes/{uuid.uuid4().hex}.zarr"
    xs = [torch.randn(3, 4) for _ in range(2)]
    model = _capture(url, xs)
    pooled = [key for key, name in names if name.startswith("activationscope-commit")]
    assert len(pooled) >= 8 and all(k.startswith("acts/layers.") for k in pooled)
    assert names[-1] == ("zarr.json", threading.current_thread().name)  # the root last, by the committing thread
    store = acs.open_store(url)
    with torch.no_grad():
        assert torch.equal(store["layers.9.output"], torch.cat([model(x) for x in xs]))


@pytest.mark.parametrize("serial_s", [1.0, 0.0], ids=["serial", "pooled"])
def test_a_folder_where_a_commit_writes_a_document_is_named_with_the_fix(tmp_path, monkeypatch, serial_s):
    from activationscope.cli import main as cli_main
    from activationscope.errors import StoreCorruptError
    from activationscope.store.writer import StoreWriter

    monkeypatch.setattr(W, "_SERIAL_WRITE_S", serial_s)  # every commit in one thread, or through the pool
    path = tmp_path / "s.zarr"
    data = {f"h{i}": torch.randn(20, 8) for i in range(10)}  # 10 arrays: 20 documents a commit
    w = StoreWriter(path, chunk_rows=4, shard_rows=16)
    for hp, rows in data.items():
        w.open_array(hp, (8,), torch.float32, "sample").append(rows)
    w.add_batch(20)
    w.close()
    (path / "acts/new/zarr.json").mkdir(parents=True)
    w = StoreWriter(path, resume=True, chunk_rows=4, shard_rows=16)
    for hp, rows in data.items():
        w.open_array(hp, (8,), torch.float32, "sample").append(rows)
    w.open_array("new", (8,), torch.float32, "sample").append(torch.randn(20, 8))
    w.add_batch(20)
    # (it said: writing '.../acts/new/zarr.json' failed: Is a directory)
    with pytest.raises(StoreCorruptError, match=r"'acts/new/zarr\.json' must be a regular file, got a directory; "
                                                r"move the folder at .*acts/new/zarr\.json' away"):
        w.close()
    store = acs.open_store(path, verify=True)
    assert sorted(store.hook_points) == sorted(data)
    for hp, rows in data.items():
        assert torch.equal(store[hp], rows), hp
    assert cli_main(["verify", str(path)]) == 0


@pytest.mark.parametrize("fails", ["sample", "token"])
def test_a_commit_whose_row_table_part_fails_keeps_its_forwards_for_the_next_commit(tmp_path, monkeypatch, fails):
    """A row-table part that cannot be written (a transient I/O error; here the token part,
    after the sample part was written, or the sample part) fails the commit, and the writer
    keeps its forwards and its tables as they were: a caller who catches the error and goes on
    gets every forward committed by a later commit, each array row with its row-table row
    (the forward was dropped from the tables but not from the arrays, so every later row of
    the arrays sat next to another sample's row)."""
    path = tmp_path / "s.zarr"
    w = W.StoreWriter(path, chunk_rows=1, shard_bytes=8, commit_interval=0)
    sample = w.open_array("x", (2,), torch.float32, "sample")
    token = w.open_array("t", (2,), torch.float32, "token")
    mask = torch.tensor([[True, True], [True, False]])

    def forward(i):
        sample.append(torch.full((2, 2), float(i)))
        token.append(torch.full((3, 2), float(i)))
        w.add_batch(2, [2 * i, 2 * i + 1], mask)
        w._core.drain()

    forward(0)
    w.commit()
    forward(1)
    set_ = LocalBackend.set

    def failing(self, key, data):
        if key.startswith(f"rows/{fails}/"):
            raise StoreError(f"writing {key!r} failed: Input/output error")
        return set_(self, key, data)

    monkeypatch.setattr(LocalBackend, "set", failing)
    with pytest.raises(StoreError, match="Input/output error"):
        w.commit()
    monkeypatch.setattr(LocalBackend, "set", set_)
    forward(2)
    w.commit()
    w.close()
    s = acs.open_store(path)
    assert s.verify() == [] and s.n_samples == 6
    assert s["x"][:, 0].tolist() == [0, 0, 1, 1, 2, 2]
    assert s.row_table("sample").column("sample_id").to_pylist() == [0, 1, 2, 3, 4, 5]
    assert s["t"][:, 0].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert s.row_table("token").column("sample_id").to_pylist() == [0, 0, 1, 2, 2, 3, 4, 4, 5]


@pytest.mark.parametrize("failing", [1, 2, 3])
def test_a_commit_whose_shard_upload_fails_uploads_those_shards_with_the_next_commit(monkeypatch, failing):
    """An object store's commit uploads the shards the writer thread finished: one whose upload
    fails (a transient network error) failed the commit, and the shards taken for it were
    dropped, so a caller who caught the error and went on got a root listing rows whose shards
    no manifest lists (the store unreadable). The next commit uploads them."""
    from activationscope.store._backend import ZarrBackend

    url = f"memory://acs-upload-fails-{failing}/run.zarr"
    w = W.StoreWriter(url, chunk_rows=1, shard_bytes=8, commit_interval=0)  # one row a shard
    a = w.open_array("x", (2,), torch.float32, "sample")

    def forward(i):
        a.append(torch.full((3, 2), float(i)))
        w.add_batch(3, [3 * i, 3 * i + 1, 3 * i + 2])
        w._core.drain()

    forward(0)
    w.commit()
    put = ZarrBackend.put_file
    calls = []

    def flaky(self, key, local):
        calls.append(key)
        if len(calls) == failing:
            raise StoreError(f"uploading {key!r} failed: connection reset")
        return put(self, key, local)

    monkeypatch.setattr(ZarrBackend, "put_file", flaky)
    forward(1)
    with pytest.raises(StoreError, match="connection reset"):
        w.commit()
    monkeypatch.setattr(ZarrBackend, "put_file", put)
    forward(2)
    w.commit()
    w.close()
    s = acs.open_store(url)
    assert s.verify() == [] and s.n_samples == 9
    assert s["x"][:, 0].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert s.row_table("sample").column("sample_id").to_pylist() == list(range(9))


def test_a_commit_encodes_only_the_shard_records_it_adds_to_a_manifest(tmp_path, monkeypatch):
    """A manifest lists every shard of its array and is written whole by each commit that lists
    a new shard. Before, each commit encoded every record again: over a capture of S shards an
    array's records were encoded about S*S/2 times (quadratic in the commits; with hundreds of
    hook points most of a commit's time). Now each record is encoded once, and the manifest
    written is the same document, byte for byte, as one encoding of the whole."""
    import json

    encoded: list[str] = []
    real = json.dumps

    def dumps(obj, *args, **kwargs):
        if isinstance(obj, dict) and "rows_end" in obj and "chunks" in obj:
            encoded.append(obj["key"])  # a shard's record
        elif isinstance(obj, dict) and "shards" in obj:
            encoded.extend(rec["key"] for rec in obj["shards"])  # a manifest, its records in it
        return real(obj, *args, **kwargs)

    monkeypatch.setattr(json, "dumps", dumps)
    model = _Model(3)
    xs = [torch.randn(2, 4) for _ in range(60)]  # 8-row shards: one each 4 forwards, 30 in all
    path = tmp_path / "s.zarr"
    with torch.no_grad(), acs.ActivationScope(store=str(path), store_options={
            "chunk_rows": 4, "shard_rows": 8, "commit_interval": 0}).track(model) as tracker:
        for x in xs:
            model(x)
            tracker.writer._core.drain()
            tracker.writer.commit()
    monkeypatch.setattr(json, "dumps", real)
    st = acs.open_store(path, verify=True)
    assert st.n_samples == 120
    # every shard record encoded once (a shard listed by the commit that found it)
    assert sorted(encoded) == sorted(set(encoded)) and len(encoded) == 3 * 15, (len(encoded), len(set(encoded)))
    for i in range(3):
        data = (path / f"acts/layers.{i}.output/manifest.json").read_bytes()
        doc = json.loads(data)
        assert [s["shard"] for s in doc["shards"]] == list(range(15))
        assert data == json.dumps(doc).encode()
    with torch.no_grad():
        h = torch.cat(xs)
        for i, layer in enumerate(model.layers):
            h = layer(h)
            assert torch.equal(st.rows(f"layers.{i}.output", 0, 120), h)
