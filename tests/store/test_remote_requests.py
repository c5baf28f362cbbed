"""Requests of a sequential read of a store on object storage (moto S3): each one costs a
round trip there, so a shard's index is read once however many chunks of it decode side by
side, and a ranged read asks for no size first. Rows read equal the captured ones."""

from __future__ import annotations

import collections
import uuid

import pytest
import torch

import activationscope as acs


def test_a_sequential_read_of_an_s3_store_makes_few_requests_per_shard(s3, monkeypatch):
    requests = _counted_requests(monkeypatch)
    _read_in_order(s3, requests, n_batches=6, shard_rows=8, compression=None)
    shards = {key for _, key in requests if key.startswith("acts/0.output/c/")}
    assert len(shards) == 6
    for key in shards:
        # the shard's size (one HEAD), its index and its 2 chunks (3 ranged GETs); before: 16
        # HEADs (two per size, a size before every ranged read, the index read by each chunk)
        # and 5 GETs
        assert requests[("HEAD", key)] <= 1, (key, requests)
        assert requests[("GET", key)] <= 3, (key, requests)


def _read_in_order(s3, requests, n_batches: int, shard_rows: int, compression) -> None:
    """Capture ``n_batches`` of 8 rows (chunks of 4 rows) into a new S3 store, then read it in
    batches of 8 through ActivationDataset with ``requests`` counting only the read's; the
    rows read equal the model's."""
    url = f"s3://acs-bucket/requests-{uuid.uuid4().hex}.zarr"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    batches = [torch.randn(8, 16) for _ in range(n_batches)]
    options = {"storage_options": s3, "chunk_rows": 4, "shard_rows": shard_rows, "compression": compression}
    with acs.ActivationScope(store=url, store_options=options).track(model, include=["0"]), torch.no_grad():
        for x in batches:
            model(x)
    with torch.no_grad():
        want = torch.cat([model(x) for x in batches])
    ds = acs.ActivationDataset(url, open_options={"storage_options": s3})
    requests.clear()
    got = torch.cat([ds[i:i + 8]["0.output"] for i in range(0, len(ds), 8)])
    assert torch.equal(got, want)


def _counted_requests(monkeypatch):
    endpoint = pytest.importorskip("aiobotocore.endpoint")
    requests: collections.Counter = collections.Counter()
    send = endpoint.AioEndpoint._send

    async def counted(self, request):
        key = request.url.split("?")[0].split(".zarr/")[-1]
        requests[(request.method, key)] += 1
        return await send(self, request)

    monkeypatch.setattr(endpoint.AioEndpoint, "_send", counted)
    return requests


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_sequential_read_reads_neighbouring_chunks_of_a_shard_in_one_request(s3, monkeypatch, compression):
    """8 chunks a shard: a sequential read asks for runs of neighbouring chunks, not for each
    chunk (before: the shard's index and 8 ranged GETs per shard)."""
    requests = _counted_requests(monkeypatch)
    _read_in_order(s3, requests, n_batches=12, shard_rows=32, compression=compression)
    shards = sorted({key for _, key in requests if key.startswith("acts/0.output/c/")})
    assert len(shards) == 3
    gets = [requests[("GET", key)] for key in shards]
    # its index and two runs: the chunks of the read that gets to the shard, and the rest of
    # the shard read ahead (not into the next shard: its index is read when a read gets there)
    assert all(g <= 3 for g in gets), (gets, requests)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_damaged_chunk_read_with_its_neighbours_is_refused_by_its_checksum(compression, monkeypatch):
    """A chunk read in a run is checked as one read alone: a flipped byte in chunk 5 of the
    shard fails the read of its rows, naming the chunk; the rows before it read as written."""
    import fsspec

    url = f"memory://runs-{uuid.uuid4().hex}.zarr"
    torch.manual_seed(0)
    x = torch.randn(64, 16)
    from activationscope.store import StoreWriter

    w = StoreWriter(url, capture_config={}, model=None, storage_dtype=None, chunk_rows=4, shard_rows=32,
                    compression=compression)
    w.open_array("h", (16,), torch.float32, "sample").append(x)
    w.add_batch(64, list(range(64)), None, {})
    w.close()
    fs = fsspec.filesystem("memory")
    store = acs.open_store(url)
    idx = store._shard_index(store._checked_meta("h"), 0)
    off, nb = idx.entries[5]
    path = url[len("memory:/"):] + "/" + idx.key
    raw = bytearray(fs.cat_file(path))
    raw[off + nb // 2] ^= 0xFF
    fs.pipe_file(path, bytes(raw))
    from activationscope.store.reader import Store

    runs = []
    read_run = Store._read_run
    monkeypatch.setattr(Store, "_read_run", lambda self, meta, shard, slots: runs.append(slots) or
                        read_run(self, meta, shard, slots))
    store = acs.open_store(url)
    assert torch.equal(store.rows("h", 0, 20), x[:20])
    assert runs[0] == list(range(8))  # (read together: the rows asked for and the rest of the shard ahead)
    with pytest.raises(acs.StoreCorruptError, match=r"chunk 5 \(rows 20-23"):
        store.rows("h", 0, 32)


@pytest.mark.parametrize("cache_bytes", [64 << 20, 0], ids=["cached", "large_read"])
def test_a_run_is_asked_for_just_before_its_chunks_decode(monkeypatch, cache_bytes):
    """The decode pool takes work in order: each run's read is queued right before its own
    chunks' decodes, not every run first (a large read would hold every run's bytes at once,
    as much again as the rows read)."""
    from activationscope.store import StoreWriter, _decode
    from activationscope.store.reader import _Run

    url = f"memory://runs-{uuid.uuid4().hex}.zarr"
    x = torch.randn(128, 16, generator=torch.Generator().manual_seed(0))
    w = StoreWriter(url, capture_config={}, model=None, storage_dtype=None, chunk_rows=4, shard_rows=32,
                    compression="zstd")
    w.open_array("h", (16,), torch.float32, "sample").append(x)
    w.add_batch(128, list(range(128)), None, {})
    w.close()
    kinds: list[str] = []
    submit = _decode.submit

    def recorded(fn, *args):
        kinds.append("run" if getattr(fn, "func", None) is not None and fn.func.__name__ == "_read_run" else "chunk")
        return submit(fn, *args)

    monkeypatch.setattr(_decode, "submit", recorded)
    store = acs.open_store(url, cache_bytes=cache_bytes)
    assert torch.equal(store.rows("h", 0, 128), x)
    assert kinds == (["run"] + ["chunk"] * 8) * 4
    assert _Run.future({}, 0) is None


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_opening_an_s3_store_and_its_dataset_makes_few_requests(s3, monkeypatch, compression, tmp_path):
    """Each request to object storage costs its latency. Opening a store asked for the root
    document's stamp, then its size twice (ours, then s3fs's before a whole read), then read
    it: 3 HEAD + 1 GET; now its stamp and one read bounded by the document size limit. Each
    array document and manifest likewise (3 requests each, now 1), and the first read of an
    array opened it through zarr as well (its document again, and a HEAD and a listing each for
    two zarr format 2 documents): now nothing of it. Rows read equal a local copy's."""
    requests = _counted_requests(monkeypatch)
    url = f"s3://acs-bucket/open-{uuid.uuid4().hex}.zarr"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    options = {"storage_options": s3, "chunk_rows": 4, "shard_rows": 16, "compression": compression}
    with acs.ActivationScope(store=url, store_options=options).track(model, include=["0"]), torch.no_grad():
        for _ in range(4):
            model(torch.randn(8, 16))
    requests.clear()
    acs.open_store(url, storage_options=s3)
    assert dict(requests) == {("HEAD", "zarr.json"): 1, ("GET", "zarr.json"): 1}
    requests.clear()
    ds = acs.ActivationDataset(url, open_options={"storage_options": s3})
    got = ds[0:8]["0.output"]
    # the root (stamp, read), the array's document and manifest, the size of the shard of its
    # last row (it exists), the root's stamp after them (the store not replaced meanwhile); the
    # read: the shard's index and its chunks in one run
    assert dict(requests) == {("HEAD", "zarr.json"): 2, ("GET", "zarr.json"): 1,
                              ("GET", "acts/0.output/zarr.json"): 1, ("GET", "acts/0.output/manifest.json"): 1,
                              ("HEAD", "acts/0.output/c/1/0"): 1, ("GET", "acts/0.output/c/0/0"): 2}, requests
    from activationscope.store import copy_store

    local = str(tmp_path / "local.zarr")
    copy_store(url, local, storage_options=s3)
    assert torch.equal(got, acs.open_store(local)["0.output", 0:8])
    assert torch.equal(acs.open_store(url, storage_options=s3)["0.output"], acs.open_store(local)["0.output"])


def _s3_store_of_4_shards(s3, url: str, n_batches: int = 64) -> torch.Tensor:
    """Capture ``n_batches`` batches of 64 rows of 16 float32 into ``url`` (chunks of 64 rows,
    4 KiB; shards of 16 chunks): 4 shards for 64 batches. Returns the rows captured."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    batches = [torch.randn(64, 16) for _ in range(n_batches)]
    options = {"storage_options": s3, "chunk_rows": 64, "shard_rows": 1024, "compression": None}
    with acs.ActivationScope(store=url, store_options=options).track(model, include=["0"]), torch.no_grad():
        for x in batches:
            model(x)
    with torch.no_grad():
        return torch.cat([model(x) for x in batches])


def _shard_gets(requests) -> dict[str, int]:
    return {key: n for (method, key), n in requests.items() if method == "GET" and key.startswith("acts/0.output/c/")}


def test_a_shuffled_read_of_an_s3_store_asks_for_each_shard_once_not_each_chunk(s3, monkeypatch, tmp_path):
    """Rows read one by one in a shuffled order (``ds[i]``) from an array that fits in the
    chunk cache: each chunk missed was one ranged GET (64 chunks, 68 requests with the 4 shard
    indexes); now a missed chunk brings its shard's other chunks in the same request, cached
    for the rows after it: 2 requests per shard (its index, its chunks). Rows equal a local
    copy's."""
    from activationscope.store import copy_store

    requests = _counted_requests(monkeypatch)
    url = f"s3://acs-bucket/shuffled-{uuid.uuid4().hex}.zarr"
    want = _s3_store_of_4_shards(s3, url)
    local = str(tmp_path / "local.zarr")
    copy_store(url, local, storage_options=s3)
    ds = acs.ActivationDataset(url, open_options={"storage_options": s3})
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(1)).tolist()
    requests.clear()
    got = torch.stack([ds[i]["0.output"] for i in order])
    assert _shard_gets(requests) == {f"acts/0.output/c/{k}/0": 2 for k in range(4)}, requests
    assert torch.equal(got, want[order])
    assert torch.equal(got, acs.open_store(local)["0.output"][order])


@pytest.mark.parametrize("cache_bytes", [64 << 20, 512 << 10], ids=["fits", "larger_than_the_cache"])
def test_a_shuffled_batch_of_an_s3_store_asks_for_its_chunks_together(s3, monkeypatch, tmp_path, cache_bytes):
    """A DataLoader's shuffled batches of 32 rows: the chunks a batch touches were read one
    after the other, each in its own request (34 requests for an epoch of 4 shards of 16
    chunks). Now they are asked for at once, those of a shard in one ranged request (with the
    chunks between them, cached for the batches that follow; the whole shard of an array that
    fits in the cache). Rows equal a local copy's."""
    from activationscope.store import copy_store

    requests = _counted_requests(monkeypatch)
    url = f"s3://acs-bucket/batches-{uuid.uuid4().hex}.zarr"
    want = _s3_store_of_4_shards(s3, url)
    local = str(tmp_path / "local.zarr")
    copy_store(url, local, storage_options=s3)
    ds = acs.ActivationDataset(url, open_options={"storage_options": s3, "cache_bytes": cache_bytes})
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(ds, batch_size=32, sampler=order.tolist())
    requests.clear()
    per_batch = []
    got = []
    batches = iter(loader)
    for _ in range(len(loader)):
        before = sum(_shard_gets(requests).values())
        got.append(next(batches)["0.output"])  # (read in this thread: no workers)
        per_batch.append(sum(_shard_gets(requests).values()) - before)
    got = torch.cat(got)
    assert torch.equal(got, want[order]) and torch.equal(got, acs.open_store(local)["0.output"][order])
    assert per_batch[0] == 8, per_batch  # (each shard's index and one run of its chunks)
    if cache_bytes == 64 << 20:
        assert sum(per_batch) == 8, per_batch  # the whole array, read by the first batch
    else:
        assert sum(per_batch) == 18, per_batch  # (4 indexes, 14 runs: each chunk read once, in 7 batches)


def test_a_store_appended_by_a_resume_reads_its_new_rows_after_a_refresh(s3, tmp_path):
    """Chunks asked for together and cached (a shuffled batch's, with their shard) are those
    of the commit the reader shows: after a resume appended rows (the last chunk, partial,
    rewritten with more), the store not refreshed reads its rows as before, and once refreshed
    it reads the new rows, the rewritten chunk included, as a local copy has them."""
    from activationscope.store import copy_store

    url = f"s3://acs-bucket/appended-{uuid.uuid4().hex}.zarr"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    batches = [torch.randn(50, 16) for _ in range(40)]
    with torch.no_grad():
        want = torch.cat([model(x) for x in batches])

    def capture(part, **extra):
        options = {"storage_options": s3, "chunk_rows": 64, "shard_rows": 1024, "compression": None, **extra}
        with acs.ActivationScope(store=url, store_options=options).track(model, include=["0"]), torch.no_grad():
            for x in part:
                model(x)

    capture(batches[:20])  # 1000 rows: chunk 15 holds rows 960-999 of its 64
    store = acs.open_store(url, storage_options=s3)
    ds = acs.ActivationDataset(store)
    order = torch.randperm(1000, generator=torch.Generator().manual_seed(1))
    assert torch.equal(ds.get_batch(order[:32])["0.output"], want[:1000][order[:32]])
    capture(batches[20:], resume=True)  # 2000 rows: chunk 15 rewritten whole, shard 1 begun
    assert store.n_rows("0.output") == 1000
    assert torch.equal(ds.get_batch(order)["0.output"], want[:1000][order])  # (as before: not refreshed)
    store.refresh()
    assert store.n_rows("0.output") == 2000
    order = torch.randperm(2000, generator=torch.Generator().manual_seed(2))
    ds = acs.ActivationDataset(url, open_options={"storage_options": s3})
    got = torch.cat([ds.get_batch(order[i:i + 100])["0.output"] for i in range(0, 2000, 100)])
    local = str(tmp_path / "local.zarr")
    copy_store(url, local, storage_options=s3)
    assert torch.equal(got, want[order]) and torch.equal(got, acs.open_store(local)["0.output"][order])
    assert torch.equal(acs.ActivationDataset(store).get_batch(order)["0.output"], want[order])
