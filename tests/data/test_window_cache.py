"""A shuffled or chunk-shuffled sampler built on an ActivationDataset of compressed (or remote)
rows: the store's cache of decoded chunks is raised to hold one window, so that an epoch decodes
each chunk once (ActivationDataset.fit_cache_to_window); where it may not be raised (a size
given, a store opened by the caller, more than the bound) a RuntimeWarning names the bytes
needed and the fix. Before, a window larger than the default cache (64 MiB: 65,536 rows of
1 KiB) decoded chunks again batch after batch: 768 float32 features read at about 2,000 rows/s
instead of 130,000."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
from torch.utils.data import DataLoader

import activationscope as acs
from activationscope.data import ActivationDataset, ChunkShuffleBatchSampler, ShuffledBatchSampler
from activationscope.data import dataset as D
from activationscope.data.dataset import collate
from activationscope.store import StoreWriter
from activationscope.store import reader as R

N, WIDTH, CHUNK = 2048, 32, 16  # 128 B rows, 2 KiB chunks: 256 KiB of rows, 128 chunks
ROW = WIDTH * 4
SMALL = 32 << 10  # the default cache in these tests (open_store's default, lowered): 16 chunks


@pytest.fixture
def small_default(monkeypatch):
    """open_store's default cache_bytes lowered to SMALL, so a few hundred KiB of rows exceed it."""
    monkeypatch.setitem(R.open_store.__kwdefaults__, "cache_bytes", SMALL)


def _write(path, compression="zstd"):
    t = torch.randn(N, WIDTH, generator=torch.Generator().manual_seed(0))
    w = StoreWriter(path, compression=compression, chunk_rows=CHUNK, shard_rows=8 * CHUNK)
    arr = w.open_array("x", (WIDTH,), torch.float32, "sample")
    for s in range(0, N, 256):
        arr.append(t[s:s + 256])
        w.add_batch(256, list(range(s, s + 256)), None, {})
        w.commit()
    w.close()
    return str(path), t


def _count_decodes(monkeypatch) -> list:
    seen = []
    real = R.Store._decode_chunk

    def counting(self, hook_point, meta, c, *args, **kwargs):
        seen.append(c)
        return real(self, hook_point, meta, c, *args, **kwargs)

    monkeypatch.setattr(R.Store, "_decode_chunk", counting)
    return seen


def _epoch(ds, sampler, t) -> None:
    for batch in sampler:
        got = collate(ds.__getitems__(batch))["x"]
        assert torch.equal(got, t[batch])


@pytest.mark.parametrize("kind", ["chunk", "global"])
def test_a_shuffled_epoch_of_compressed_rows_decodes_each_chunk_once(tmp_path, small_default, monkeypatch, kind):
    path, t = _write(tmp_path / "s.zarr")
    ds = ActivationDataset(path)
    assert ds.source.store._cache_bytes == SMALL
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sampler = (ChunkShuffleBatchSampler(ds, 32, buffer_rows=1024, seed=3) if kind == "chunk"
                   else ShuffledBatchSampler(ds, 32, seed=3))
    window = min(N, 1024 - 1 + CHUNK) if kind == "chunk" else N  # (blocks of a compressed array: its chunks)
    if kind == "chunk":
        assert sampler.window_rows == window
    want = min(window + 2 * CHUNK, N) * ROW
    store = ds.source.store
    assert store._cache_bytes == want and store.open_options()["cache_bytes"] == want
    decodes = _count_decodes(monkeypatch)
    _epoch(ds, sampler, t)
    assert sorted(decodes) == list(range(N // CHUNK))  # each chunk once
    # a DataLoader worker reopens the store with the raised cache
    assert pickle.loads(pickle.dumps(ds)).source.store._cache_bytes == want


def test_without_the_raised_cache_batches_decode_chunks_again(tmp_path, small_default, monkeypatch):
    """What the raise prevents, measured the same way: the default cache, a window four times it."""
    path, t = _write(tmp_path / "s.zarr")
    ds = ActivationDataset(path)
    monkeypatch.setattr(D, "WINDOW_CACHE_MAX_BYTES", SMALL)
    with pytest.warns(RuntimeWarning, match="is the most a dataset raises it to by itself") as w:
        sampler = ChunkShuffleBatchSampler(ds, 32, buffer_rows=1024, seed=3)
    assert w[0].filename == __file__  # (at the line that built the sampler)
    assert ds.source.store._cache_bytes == SMALL
    decodes = _count_decodes(monkeypatch)
    _epoch(ds, sampler, t)
    assert len(decodes) > 2 * (N // CHUNK)


def test_a_cache_size_given_is_kept_and_a_warning_names_the_size_a_window_needs(tmp_path, monkeypatch):
    path, t = _write(tmp_path / "s.zarr")
    need = (1024 - 1 + CHUNK + 2 * CHUNK) * ROW
    for how in ("open_options", "store"):
        ds = (ActivationDataset(path, open_options={"cache_bytes": SMALL}) if how == "open_options"
              else ActivationDataset(acs.open_store(path, cache_bytes=SMALL)))
        with pytest.warns(RuntimeWarning) as w:
            ChunkShuffleBatchSampler(ds, 32, buffer_rows=1024)
        message = str(w[0].message)
        assert message.startswith("ChunkShuffleBatchSampler: a window of 1,039 rows of ['x']") and "(the size given)" in message
        assert f"open_options={{'cache_bytes': {need}}}" in message and f"open_store(..., cache_bytes={need})" in message
        assert ds.source.store._cache_bytes == SMALL
    # the fix it names: no warning, each chunk decoded once
    ds = ActivationDataset(path, open_options={"cache_bytes": need})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sampler = ChunkShuffleBatchSampler(ds, 32, buffer_rows=1024, seed=4)
    decodes = _count_decodes(monkeypatch)
    _epoch(ds, sampler, t)
    assert sorted(decodes) == list(range(N // CHUNK))


def test_rows_of_a_remote_store_are_read_through_the_raised_cache(small_default):
    """Uncompressed, but not mapped (memory://, as object storage): read by decoding chunks too."""
    import uuid

    path, t = _write(f"memory://window-cache/{uuid.uuid4().hex}.zarr", compression=None)
    ds = ActivationDataset(path)
    sampler = ChunkShuffleBatchSampler(ds, 32, buffer_rows=1024, seed=6)
    assert ds.source.store._cache_bytes == (1024 - 1 + CHUNK + 2 * CHUNK) * ROW
    _epoch(ds, sampler, t)


def test_uncompressed_rows_and_small_windows_change_nothing(tmp_path, small_default):
    path, _ = _write(tmp_path / "raw.zarr", compression=None)
    ds = ActivationDataset(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ShuffledBatchSampler(ds, 32)  # (views of the mapped shards: no cache of decoded chunks)
        assert ds.source.store._cache_bytes == SMALL
        zpath, _ = _write(tmp_path / "z.zarr")
        ds = ActivationDataset(zpath)
        ChunkShuffleBatchSampler(ds, 32, buffer_rows=64)  # (its window fits the cache)
        assert ds.source.store._cache_bytes == SMALL


def test_a_selection_of_rows_counts_the_store_rows_it_spans(tmp_path, small_default):
    path, t = _write(tmp_path / "s.zarr")
    ds = ActivationDataset(path, rows=range(0, N, 4))  # every 4th row: a window of k rows spans 4k
    ChunkShuffleBatchSampler(ds, 32, buffer_rows=200)
    window = 200 - 1 + int(torch.diff(ds.block_boundaries()).max())
    span = 4 * window  # (its blocks of 4 dataset rows, each in a chunk of 16 store rows)
    assert ds.source.store._cache_bytes == (span + 2 * CHUNK) * ROW


@pytest.mark.parametrize("how", ["unsorted", "clustered"])
def test_a_selection_counts_the_chunks_its_windows_read(tmp_path, small_default, monkeypatch, how):
    """An unsorted selection's window reads a chunk for about every row; a selection of a few
    runs far apart spans most of the store but reads the chunks of its rows only. Each chunk
    decoded once an epoch, with no more cache than the chunks its rows lie in."""
    path, t = _write(tmp_path / "s.zarr")
    if how == "unsorted":
        rows = torch.randperm(N, generator=torch.Generator().manual_seed(1))[: N // 2]
    else:
        rows = torch.cat([torch.arange(0, 256), torch.arange(N - 256, N)])
    ds = ActivationDataset(path, rows=rows)
    if how == "clustered":  # (its window fits this bound; counted as the store rows it spans, not)
        monkeypatch.setattr(D, "WINDOW_CACHE_MAX_BYTES", 64 << 10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sampler = ChunkShuffleBatchSampler(ds, 32, buffer_rows=300, seed=2)
    touched = torch.unique(rows // CHUNK).numel() * CHUNK
    if how == "clustered":  # (a window of 300 rows + one chunk of them, in either run: no more)
        assert ds.source.store._cache_bytes == (300 - 1 + CHUNK + 2 * CHUNK) * ROW
    else:
        assert ds.source.store._cache_bytes == min(N, touched + 2 * CHUNK) * ROW
    decodes = _count_decodes(monkeypatch)
    for batch in sampler:
        assert torch.equal(collate(ds.__getitems__(batch))["x"], t[rows[batch]])
    assert sorted(decodes) == sorted(torch.unique(rows // CHUNK).tolist())


def test_dataloader_workers_read_with_the_raised_cache(tmp_path, small_default):
    path, t = _write(tmp_path / "s.zarr")
    ds = ActivationDataset(path)
    sampler = ShuffledBatchSampler(ds, 64, seed=5)
    want = N * ROW
    seen = []
    loader = DataLoader(ds, batch_sampler=sampler, num_workers=2, multiprocessing_context="fork")
    for batch, order in zip(loader, sampler):
        assert torch.equal(batch["x"], t[order])
        seen.append(1)
    assert len(seen) == N // 64
    info = DataLoader(ds, batch_size=None, sampler=[0], num_workers=1, multiprocessing_context="fork",
                      collate_fn=lambda _: torch.utils.data.get_worker_info().dataset.source.store._cache_bytes)
    assert list(info) == [want]


def test_hook_points_of_other_chunk_sizes_are_each_decoded_once_a_window(tmp_path, small_default, monkeypatch):
    """A window is made of blocks of the first hook point (its chunks, when compressed): a
    narrower hook point has larger chunks, each block reads one of them, and a window reads many
    more of its rows than the window's. Counted per hook point, each chunk is decoded once a
    window (the first hook point's once an epoch); counted as the window's rows, the cache held
    a fraction of them and the first hook point's chunks were decoded again too."""
    from activationscope.store import _format as F

    monkeypatch.setattr(F, "COMPRESSED_CHUNK_BYTES", 2048)  # x: 16 rows a chunk, y: 128
    n = 4096
    g = torch.Generator().manual_seed(0)
    tx, ty = torch.randn(n, 32, generator=g), torch.randn(n, 4, generator=g)
    w = StoreWriter(tmp_path / "two.zarr", compression="zstd")
    ax, ay = w.open_array("x", (32,), torch.float32, "sample"), w.open_array("y", (4,), torch.float32, "sample")
    for s in range(0, n, 512):
        ax.append(tx[s:s + 512])
        ay.append(ty[s:s + 512])
        w.add_batch(512, list(range(s, s + 512)), None, {})
        w.commit()
    w.close()
    ds = ActivationDataset(str(tmp_path / "two.zarr"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sampler = ChunkShuffleBatchSampler(ds, 32, buffer_rows=1024, seed=3)
    windows = [set((rows // 128).tolist()) for _, rows in sampler._windows(0, n)]
    decodes = []
    real = R.Store._decode_chunk

    def counting(self, hook_point, meta, c, *args, **kwargs):
        decodes.append((meta["path"], c))
        return real(self, hook_point, meta, c, *args, **kwargs)

    monkeypatch.setattr(R.Store, "_decode_chunk", counting)
    for batch in sampler:
        got = collate(ds.__getitems__(batch))
        assert torch.equal(got["x"], tx[batch]) and torch.equal(got["y"], ty[batch])
    assert sorted(c for p, c in decodes if p == "acts/x") == list(range(n // 16))  # each chunk once
    y = [c for p, c in decodes if p == "acts/y"]
    assert len(y) <= sum(len(win) for win in windows)  # each chunk once a window that reads it


def _open_default(spec):
    """An opener= that takes no options (open_options={"opener": _open_default})."""
    return acs.open_store(spec)


def test_a_store_opened_by_an_opener_keeps_its_cache_and_reopens_in_workers(tmp_path, small_default):
    """An opener is called as opener(spec, **options): a raised cache_bytes added to the options
    made a DataLoader worker's reopen fail (TypeError) with an opener that takes none."""
    path, t = _write(tmp_path / "s.zarr")
    ds = ActivationDataset(path, open_options={"opener": _open_default})
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        sampler = ChunkShuffleBatchSampler(ds, 32, buffer_rows=1024, seed=1)
    copy = pickle.loads(pickle.dumps(ds))  # (as a DataLoader worker gets it)
    assert copy.source.store._cache_bytes == SMALL
    assert ds.source.store._cache_bytes == SMALL
    assert len(w) == 1 and w[0].category is RuntimeWarning and "(the size given)" in str(w[0].message)
    batch = next(iter(sampler))
    assert torch.equal(collate(copy.__getitems__(batch))["x"], t[batch])


def test_a_remote_store_decodes_no_cached_chunk_again(small_default, monkeypatch):
    """A read of object storage reads the chunks between a batch's rows with them (one request
    per run) and decoded them all, the ones already cached too: with the cache raised to the
    whole array (a ShuffledBatchSampler's window), about one chunk in ten was decoded twice."""
    import uuid

    path, t = _write(f"memory://window-cache/{uuid.uuid4().hex}.zarr", compression=None)
    ds = ActivationDataset(path)
    sampler = ShuffledBatchSampler(ds, 32, seed=1)
    assert ds.source.store._cache_bytes == N * ROW
    decodes = _count_decodes(monkeypatch)
    _epoch(ds, sampler, t)
    assert sorted(decodes) == list(range(N // CHUNK))


@pytest.mark.parametrize("how", ["sorted", "unsorted", "range"])
@pytest.mark.parametrize("chunk_rows", [16, 48, 128])
def test_the_chunks_counted_for_a_window_are_at_least_each_window_reads(tmp_path, how, chunk_rows):
    """What fit_cache_to_window counts for a window, for chunks of any size (other hook
    points'), is at least what each window of the sampler reads."""
    path, _ = _write(tmp_path / "s.zarr")
    g = torch.Generator().manual_seed(7)
    rows = {"sorted": torch.sort(torch.randperm(N, generator=g)[:700]).values,
            "unsorted": torch.randperm(N, generator=g)[:700], "range": range(37, N - 5)}[how]
    ds = ActivationDataset(path, rows=rows)
    store_rows = torch.as_tensor(ds.store_rows() if how != "range" else list(ds.store_rows()))
    for buffer_rows in (1, 50, 300):
        sampler = ChunkShuffleBatchSampler(ds, 8, buffer_rows=buffer_rows, seed=1)
        window = min(len(ds), buffer_rows - 1 + int(sampler.block_sizes.max()))
        counted = ds._window_chunk_rows(window, chunk_rows)
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for _, pos in sampler._windows(0, len(ds)):
                read = torch.unique(store_rows[torch.from_numpy(pos)] // chunk_rows).numel() * chunk_rows
                assert read <= counted
    assert ds._window_chunk_rows(len(ds), chunk_rows) == torch.unique(store_rows // chunk_rows).numel() * chunk_rows
