"""``Store.take``: rows at store positions, in that order (a shuffled batch). Of an array read
by decoding chunks (compressed, or on object storage) each row is copied once out of its
decoded chunk, never a chunk whole; every result equals plain PyTorch indexing of the written
rows (``t[idx]``), whatever the dtype, chunking, cache size or evictions meanwhile."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
import torch

import activationscope as acs
from activationscope.errors import ArgumentTypeError, ArgumentValueError, RowIndexError, StoreCorruptError
from activationscope.store import StoreWriter, open_store
from activationscope.store import reader as R
from acs_testing import write_batches as _write

N = 61




def _data(shape, dtype, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype == torch.uint16:  # (values past int16's range: rows are copied by their bits)
        return torch.randint(0, 2**16, shape, generator=g, dtype=torch.int64).to(dtype)
    if not dtype.is_floating_point:
        return torch.randint(-2**40, 2**40, shape, generator=g, dtype=torch.int64).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t.to(torch.int64)


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.dtype == want.dtype and got.shape == want.shape and torch.equal(_bits(got), _bits(want))


def _pick(t: torch.Tensor, idx) -> torch.Tensor:
    """``t[idx]`` (of uint16 rows by their bits: torch indexes no uint16 tensor)."""
    return t.view(torch.int16)[idx].view(torch.uint16) if t.dtype == torch.uint16 else t[idx]


def _batches(n: int, seed: int = 0) -> list[list[int]]:
    g = np.random.default_rng(seed)
    out = [g.permutation(n)[:k].tolist() for k in (1, 7, n)]
    out.append([n - 1, 0, n - 1, 0, 3, 3])  # repeats, the first and last rows
    out.append(list(range(n - 1, -1, -1)))  # every row, backwards
    out.append([9, 10, 11, 12])  # consecutive rows
    return out


def _target(tmp_path, where: str) -> str:
    return f"memory://acs-take/{uuid.uuid4().hex}.zarr" if where == "memory" else str(tmp_path / "s.zarr")


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint16, torch.bool])
@pytest.mark.parametrize("where,compression", [("local", "zstd"), ("local", "blosc-lz4"), ("local", None),
                                               ("memory", None), ("memory", "zstd")])
def test_take_equals_torch_indexing(tmp_path, monkeypatch, native, dtype, where, compression):
    if not native:  # the rows copied by torch (no native extension)
        monkeypatch.setattr(R, "_GATHER", [None])
    t = _data((N, 3, 2), dtype)
    target = _target(tmp_path, where)
    _write(target, t, compression=compression, chunk_rows=5, shard_rows=20)
    st = open_store(target)
    for idx in _batches(N):
        assert _same(st.take("x", idx), _pick(t, idx)), idx
        assert _same(st.take("x", torch.tensor(idx)), _pick(t, idx)), idx
    assert _same(st.take("x", np.array([4, 60, 2], dtype=np.uint32)), _pick(t, [4, 60, 2]))
    assert _same(st.take("x", range(50, 61)), t[50:61])


@pytest.mark.parametrize("compression", ["zstd", None])
def test_one_row_chunks_and_scalar_rows(tmp_path, compression):
    t = _data((N,), torch.float32)
    _write(tmp_path / "s.zarr", t, compression=compression, chunk_rows=1, shard_rows=4)
    st = open_store(tmp_path / "s.zarr")
    for idx in _batches(N):
        assert _same(st.take("x", idx), t[idx]), idx


def test_the_result_is_new_memory_never_the_cached_chunks(tmp_path):
    t = _data((N, 4), torch.float32)
    _write(tmp_path / "s.zarr", t, compression="zstd", chunk_rows=8, shard_rows=16)
    st = open_store(tmp_path / "s.zarr")
    got = st.take("x", [8, 9, 10])  # consecutive rows of one chunk: still a copy
    got.fill_(7)
    assert _same(st.take("x", [8, 9, 10]), t[8:11]) and _same(st.rows("x", 8, 16), t[8:16])


def test_rows_are_copied_straight_out_of_the_cached_chunks(tmp_path, monkeypatch):
    """One native gather per batch, from the cache's own decoded chunks (no copy of a chunk)
    straight into the result."""
    native = R._native_gather()
    if native is None:
        pytest.skip("no native extension")
    t = _data((200, 8), torch.float32)
    _write(tmp_path / "s.zarr", t, batch=40, compression="zstd", chunk_rows=8, shard_rows=32)
    st = open_store(tmp_path / "s.zarr")
    calls = []

    def counting(idx, n, start, bounds, segments, want_ids, out, hint):
        calls.append(([s for s in segments if s is not None], out))
        return native(idx, n, start, bounds, segments, want_ids, out, hint)

    monkeypatch.setattr(R, "_GATHER", [counting])
    idx = [3, 150, 60, 199, 9, 100, 61]  # chunks 0, 1, 7, 12, 18, 24
    got = st.take("x", idx)
    assert _same(got, t[idx])
    [(segments, out)] = calls
    assert out is got
    cached = {c.data_ptr() for c in st._cache.values()}
    assert len(segments) == 6 and all(s.data_ptr() in cached for s in segments)


def test_rows_of_more_chunks_than_the_cache_holds(tmp_path, monkeypatch):
    """A batch whose chunks are more than half the cache is read in groups of chunks that fit
    (each group's rows gathered, then put in place): the same rows, and the cache stays within
    its bytes."""
    t = _data((400, 16), torch.bfloat16)
    _write(tmp_path / "s.zarr", t, batch=50, compression="zstd", chunk_rows=10, shard_rows=40)
    chunk_bytes = 10 * 16 * 2
    st = open_store(tmp_path / "s.zarr", cache_bytes=5 * chunk_bytes)  # groups of 2 chunks, of 40 in all
    groups = []
    real = R._gather_into
    monkeypatch.setattr(R, "_gather_into", lambda out, idx, units: groups.append(len(units)) or real(out, idx, units))
    g = torch.Generator().manual_seed(3)
    idx = torch.cat([torch.randperm(400, generator=g), torch.tensor([399, 0, 399])])
    assert _same(st.take("x", idx), t[idx])
    assert groups == [2] * 20 + [20] and st._cached <= 5 * chunk_bytes  # (then the batch put in its order)
    st0 = open_store(tmp_path / "s.zarr", cache_bytes=0)  # (one chunk at a time)
    assert _same(st0.take("x", idx[:50]), t[idx[:50]])


def test_a_chunk_evicted_while_the_batch_is_read(tmp_path, monkeypatch):
    """Every decode of the batch empties the chunk cache: the chunks the batch took from it
    before (cached by an earlier read) or decoded for it are evicted while it still reads; it
    holds them until its rows are copied."""
    t = _data((200, 8), torch.float32)
    _write(tmp_path / "s.zarr", t, batch=40, compression="zstd", chunk_rows=8, shard_rows=32)
    st = open_store(tmp_path / "s.zarr")
    assert _same(st.rows("x", 0, 64), t[:64])  # chunks 0-7 cached
    real = R.Store._decode_chunk
    evicted = []

    def evicting(self, hook_point, meta, c, *rest, **kw):
        got = real(self, hook_point, meta, c, *rest, **kw)
        with self._lock:
            evicted.extend(k[1] for k in self._cache)
            self._cache.clear()
            self._cached = 0
        return got

    monkeypatch.setattr(R.Store, "_decode_chunk", evicting)
    idx = [3, 150, 60, 199, 9, 100, 61, 0, 120]
    assert _same(st.take("x", idx), t[idx])
    assert {0, 1, 7} & set(evicted)  # (chunks of the batch taken from the cache, then evicted)


def test_positions_are_checked(tmp_path):
    t = _data((N, 2), torch.float32)
    _write(tmp_path / "s.zarr", t, compression="zstd", chunk_rows=8)
    st = open_store(tmp_path / "s.zarr")
    for bad, first in (([0, N], N), ([-1, 2], -1), (torch.tensor([5, N + 3]), N + 3),
                       (np.array([3, 2**64 - 1], dtype=np.uint64), 2**64 - 1), ([2**70], 2**70)):
        with pytest.raises(RowIndexError, match=rf"take\('x', rows\): row {first} out of range for hook point 'x' "
                                                rf"with {N} rows; rows must be store positions in \[0, {N}\)"):
            st.take("x", bad)
    for bad in ([1.0], [True, 2], torch.tensor([0.0]), torch.tensor([True]), torch.zeros(2, 2, dtype=torch.int64),
                "0:3", 3, np.array([1.5]), {1, 2}):
        with pytest.raises(ArgumentTypeError, match=r"take\('x', rows\): rows must (be|hold ints)"):
            st.take("x", bad)
    with pytest.raises(ArgumentValueError, match="meta device"):
        st.take("x", torch.tensor([1], device="meta"))
    with pytest.raises(acs.HookPointNotFoundError):
        st.take("nope", [0])
    assert _same(st.take("x", []), t[:0]) and _same(st.take("x", torch.empty(0, dtype=torch.int64)), t[:0])


def test_rows_of_a_zero_size_feature_shape(tmp_path):
    t = torch.zeros(20, 3, 0)
    _write(tmp_path / "s.zarr", t, chunk_rows=4, shard_rows=8, compression="zstd")
    assert open_store(tmp_path / "s.zarr").take("x", [3, 19, 3]).shape == (3, 3, 0)


def test_a_damaged_chunk_is_an_error(tmp_path):
    t = _data((64, 8), torch.float32)
    _write(tmp_path / "s.zarr", t, compression="zstd", chunk_rows=8, shard_rows=64)
    shard = tmp_path / "s.zarr" / "acts" / "x" / "c" / "0" / "0"
    data = bytearray(shard.read_bytes())
    index = np.frombuffer(bytes(data), "<u8", count=16, offset=len(data) - 16 * 8 - 4).reshape(-1, 2)
    off, nb = int(index[2, 0]), int(index[2, 1])
    data[off + nb // 2] ^= 0x10  # a bit of chunk 2 flipped: its crc32c no longer matches
    shard.write_bytes(bytes(data))
    st = open_store(tmp_path / "s.zarr")
    assert _same(st.take("x", [0, 40, 9]), t[[0, 40, 9]])  # other chunks read
    with pytest.raises(StoreCorruptError, match=r"chunk 2 .*crc32c"):
        st.take("x", [0, 17, 40])


def test_rows_of_an_uncommitted_multi_rank_store(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6))
    path = tmp_path / "r.zarr"
    for r in range(2):
        options = {"process_group": acs.RankStore(r, 2), "chunk_rows": 4, "shard_rows": 8, "compression": "zstd"}
        with acs.ActivationScope(store=path, store_options=options).track(model) as tracker, torch.no_grad():
            for i in range(3):
                tracker.set_batch(sample_ids=range(10 * r + 5 * i, 10 * r + 5 * i + 5))
                model(torch.randn(5, 4))
    st = open_store(path)
    assert st.status == "incomplete" and st.ranks == [0, 1]
    rows = st["0.output"]
    assert rows.shape == (30, 6)
    for idx in _batches(30):
        assert _same(st.take("0.output", idx), rows[idx]), idx


def test_threads_taking_batches_at_once(tmp_path):
    """Threads reading shuffled batches of one store at once, with a cache of a few chunks
    (each decode evicts chunks other threads hold): every batch equals torch indexing."""
    import threading

    t = _data((300, 16), torch.bfloat16)
    _write(tmp_path / "s.zarr", t, batch=50, compression="zstd", chunk_rows=8, shard_rows=32)
    st = open_store(tmp_path / "s.zarr", cache_bytes=6 * 8 * 16 * 2)  # (6 chunks; groups of 3)
    wrong, failed = [], []

    def read(seed):
        try:
            g = np.random.default_rng(seed)
            for _ in range(30):
                idx = g.integers(0, 300, size=int(g.integers(1, 40))).tolist()
                if not _same(st.take("x", idx), t[idx]):
                    wrong.append(idx)
        except BaseException as e:  # (raised in a thread: reported by the test)
            failed.append(e)

    threads = [threading.Thread(target=read, args=(s,)) for s in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not failed and not wrong


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_refresh_of_a_replaced_store_between_the_check_and_the_read(tmp_path, monkeypatch, compression):
    """Another thread's ``refresh()`` may show a new run of fewer rows after ``take`` checked
    the positions against the old count: a row past the new count is an out-of-range row of
    it (before: an IndexError of a list, or of a compressed store a missing shard blamed on
    damage), a row within it the new run's."""
    old, new = _data((100, 4), torch.float32, seed=1), _data((40, 4), torch.float32, seed=2)
    path = tmp_path / "s.zarr"
    _write(path, old, compression=compression, chunk_rows=8, shard_rows=32)
    st = open_store(path)
    assert _same(st.take("x", [1, 90]), old[[1, 90]])
    real, fired = R._take_positions, []

    def then_replaced(hook_point, rows, n):
        idx = real(hook_point, rows, n)
        if not fired:  # (once a take: a run that replaced the store during each read is refused)
            fired.append(1)
            _write(path, new, compression=compression, chunk_rows=8, shard_rows=32, overwrite=True)
            st.refresh()  # (in another thread)
        return idx

    monkeypatch.setattr(R, "_take_positions", then_replaced)
    with pytest.raises(RowIndexError, match=r"take\('x', rows\): row 90 out of range for hook point 'x' with 40 rows"):
        st.take("x", [90, 1])
    fired.clear()
    assert _same(st.take("x", [39, 1]), new[[39, 1]])
    assert fired


def test_a_wrong_index_is_told_the_fix_for_its_kind(tmp_path):
    """A 0-D or 2-D tensor, a bool mask, a float tensor and a 2-D array are each told what
    makes positions of them (before: ``rows.long()`` for all, which an int64 0-D tensor already
    is, and nothing for an array)."""
    t = _data((N, 2), torch.float32)
    _write(tmp_path / "s.zarr", t, compression="zstd", chunk_rows=8)
    st = open_store(tmp_path / "s.zarr")
    for bad, fix in ((torch.tensor(3), r"rows\.reshape\(-1\)"), (torch.zeros(2, 2, dtype=torch.int64), r"rows\.reshape\(-1\)"),
                     (torch.tensor([True, False]), r"rows\.nonzero\(\)\.squeeze\(1\)"),
                     (torch.tensor([1.0]), r"rows\.long\(\)"), (np.zeros((2, 2), dtype=np.int64), r"rows\.reshape\(-1\)"),
                     (np.array([True]), r"rows\.nonzero\(\)\[0\]"), (np.array([1.0]), r"rows\.astype\(np\.int64\)")):
        with pytest.raises(ArgumentTypeError, match=fix):
            st.take("x", bad)
    assert _same(st.take("x", torch.tensor(3).reshape(-1)), t[[3]])


@pytest.mark.parametrize("where", ["local", "memory"])
@pytest.mark.parametrize("compression", ["zstd", None])
def test_takes_of_a_store_being_written_and_refreshed(tmp_path, where, compression):
    """A store being written (incomplete): takes between commits show the rows of the commit
    read (also of a tail chunk the writer rewrites with more rows since, cached by the reader),
    a refresh() the rows committed since; all equal torch indexing."""
    t = _data((120, 3), torch.float32, seed=4)
    target = _target(tmp_path, where)
    w = StoreWriter(target, compression=compression, chunk_rows=4, shard_rows=8)
    arr = w.open_array("x", (3,), torch.float32, "sample")
    done, ends = 0, [0]
    for k in (10, 10, 9, 30, 3, 50):
        arr.append(t[done:done + k])
        w.add_batch(k, list(range(done, done + k)), None, {})
        done += k
        ends.append(done)
        # (a commit lists the batches whose rows lie in shards the writer thread made durable:
        # after each batch 0, 10, 20, 29, 29 and 112 rows; waited for, not to depend on its pace)
        want = max(e for e in ends if e <= done // 8 * 8)
        for _ in range(500):
            w.commit()
            if open_store(target).n_rows("x") >= want:
                break
            time.sleep(0.01)
        if done == 20:
            st = open_store(target, cache_bytes=2 * 4 * 3 * 4)  # (two chunks)
            assert st.status == "incomplete"
        elif done > 20:
            n = st.n_rows("x")
            idx = list(range(n - 1, -1, -1)) + [n - 1, 0, n // 2, n - 1]
            assert _same(st.take("x", idx), t[idx]), n  # the commit read, whatever was written since
            st.refresh()
            assert st.n_rows("x") >= n
            n = st.n_rows("x")
            idx = [n - 1, 0, n - 2, n - 1, n // 3] + list(range(n))
            assert _same(st.take("x", idx), t[idx]), n
    w.close()
    st.refresh()
    assert st.status == "complete" and _same(st.take("x", list(range(done - 1, -1, -1))), t[:done].flip(0))


@pytest.mark.parametrize("compression", ["zstd", None])
def test_takes_around_a_resume_on_one_open_store(tmp_path, compression):
    """A resume appends rows (rewriting the last, partial chunk) between two takes of one open
    store: the second take still shows the rows it had, a refresh() the appended ones too."""
    t = _data((40, 3), torch.float32, seed=5)
    path = tmp_path / "s.zarr"
    _write(path, t[:10], compression=compression, chunk_rows=4, shard_rows=16)
    for cache_bytes in (0, 64 << 20):
        st = open_store(path, cache_bytes=cache_bytes)
        n = st.n_rows("x")
        assert _same(st.take("x", [n - 1, 8, 0]), t[[n - 1, 8, 0]])
        w = StoreWriter(path, compression=compression, chunk_rows=4, shard_rows=16, resume=True)
        arr = w.open_array("x", (3,), torch.float32, "sample")
        arr.append(t[n:n + 15])
        w.add_batch(15, list(range(n, n + 15)), None, {})
        w.close()
        assert _same(st.take("x", [n - 1, 8, 0, n - 2]), t[[n - 1, 8, 0, n - 2]])
        st.refresh()
        idx = list(range(n + 14, -1, -1)) + [n, n - 1]
        assert _same(st.take("x", idx), t[idx])


def test_a_hook_point_stored_as_an_alias(tmp_path):
    t = _data((50, 4), torch.float32, seed=6)
    path = tmp_path / "s.zarr"
    w = StoreWriter(path, compression="zstd", chunk_rows=4, shard_rows=8)
    arr = w.open_array("x", (4,), torch.float32, "sample")
    w.add_alias("y", "x")
    for s in range(0, 50, 10):
        arr.append(t[s:s + 10])
        w.add_batch(10, list(range(s, s + 10)), None, {})
        w.commit()
    w.close()
    st = open_store(path, cache_bytes=100)
    assert st.aliases == {"y": "x"}
    idx = [49, 0, 3, 3, 17, 48]
    assert _same(st.take("y", idx), t[idx]) and _same(st.take("x", idx), t[idx])
    assert _same(st.take("y", range(49, -1, -1)), t.flip(0))


@pytest.mark.parametrize("compression", ["zstd", "blosc-lz4"])
def test_a_damaged_chunk_in_the_cache_or_not(tmp_path, compression):
    """A chunk decoded (and cached) before it was damaged is read from the cache; one not
    cached raises StoreCorruptError on every take, in each of several threads waiting on its
    one decode, and leaves no decode behind."""
    import threading

    t = _data((64, 8), torch.float32, seed=7)
    _write(tmp_path / "s.zarr", t, compression=compression, chunk_rows=8, shard_rows=64)
    st = open_store(tmp_path / "s.zarr")
    assert _same(st.take("x", [17, 18]), t[[17, 18]])  # chunk 2 cached
    shard = tmp_path / "s.zarr" / "acts" / "x" / "c" / "0" / "0"
    data = bytearray(shard.read_bytes())
    index = np.frombuffer(bytes(data), "<u8", count=16, offset=len(data) - 16 * 8 - 4).reshape(-1, 2)
    for c in (2, 3):
        data[int(index[c, 0]) + int(index[c, 1]) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    assert _same(st.take("x", [17, 16, 0]), t[[17, 16, 0]])
    for _ in range(2):
        with pytest.raises(StoreCorruptError, match=r"chunk 3 .*crc32c"):
            st.take("x", [17, 25, 0])
    errors = []

    def take():
        try:
            st.take("x", [26, 27, 40])
        except StoreCorruptError as e:
            errors.append(e)

    threads = [threading.Thread(target=take) for _ in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert len(errors) == 6 and not st._inflight
    with pytest.raises(StoreCorruptError, match=r"chunk 2 .*crc32c"):
        open_store(tmp_path / "s.zarr", cache_bytes=0).take("x", list(range(63, -1, -1)))


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_takes_of_an_s3_store(s3, compression):
    """Of object storage (moto S3), with no cache, a cache smaller than one chunk and the
    default one: shuffled batches with repeats, and every row backwards."""
    t = _data((200, 6), torch.float32, seed=8)
    url = f"s3://acs-bucket/take-{uuid.uuid4().hex}.zarr"
    _write(url, t, batch=50, compression=compression, chunk_rows=8, shard_rows=32, storage_options=s3)
    g = np.random.default_rng(0)
    for cache_bytes in (0, 50, 64 << 20):
        st = open_store(url, storage_options=s3, cache_bytes=cache_bytes)
        for k in (1, 7, 100):
            idx = g.integers(0, 200, k).tolist()
            assert _same(st.take("x", idx), t[idx]), (cache_bytes, idx)
        assert _same(st.take("x", torch.arange(199, -1, -1, dtype=torch.int32)), t.flip(0))


def test_an_alias_and_its_hook_point_share_their_decoded_chunks(tmp_path, monkeypatch):
    """A hook point stored as another's alias reads the same array: its chunks are decoded and
    cached once for both names (before: once per name, each chunk twice, twice the cache)."""
    t = _data((40, 4), torch.float32, seed=9)
    path = tmp_path / "s.zarr"
    w = StoreWriter(path, compression="zstd", chunk_rows=4, shard_rows=8)
    arr = w.open_array("x", (4,), torch.float32, "sample")
    w.add_alias("y", "x")
    arr.append(t)
    w.add_batch(40, list(range(40)), None, {})
    w.close()
    st = open_store(path)
    decoded = []
    real = R.Store._decode_chunk
    monkeypatch.setattr(R.Store, "_decode_chunk",
                        lambda self, hp, meta, c, *a, **k: decoded.append(c) or real(self, hp, meta, c, *a, **k))
    assert _same(st.take("x", range(39, -1, -1)), t.flip(0))
    assert _same(st.take("y", range(40)), t) and _same(st.rows("y", 0, 40), t) and _same(st["y"], t)
    assert sorted(decoded) == list(range(10)) and len(st._cache) == 10


@pytest.mark.parametrize("idx", [[1, 30], [1, 70]])
def test_a_refresh_to_another_run_while_the_rows_are_read(tmp_path, monkeypatch, idx):
    """Another thread's ``refresh()`` shows a new run of fewer rows while ``take`` reads (after
    it took the row boundaries of the old one): the take reads the new run's rows, or says a
    row is past them (before: a missing shard blamed on damage, or rows [0, 100) out of range
    for rows that are there)."""
    old, new = _data((100, 4), torch.float32, seed=1), _data((40, 4), torch.float32, seed=2)
    path = tmp_path / "s.zarr"
    _write(path, old, chunk_rows=8, shard_rows=32)
    st = open_store(path)
    assert _same(st.take("x", idx), old[idx])
    real, done = R.Store.segments, []

    def then_replaced(self, hook_point):
        bounds = real(self, hook_point)
        if not done:
            done.append(1)
            _write(path, new, chunk_rows=8, shard_rows=32, overwrite=True)
            self.refresh()  # (in another thread)
        return bounds

    monkeypatch.setattr(R.Store, "segments", then_replaced)
    if max(idx) < 40:
        assert _same(st.take("x", idx), new[idx])
    else:
        with pytest.raises(RowIndexError, match=r"take\('x', rows\): row 70 out of range for hook point 'x' with 40 rows"):
            st.take("x", idx)


def test_a_take_spanning_shards_is_never_of_two_runs(tmp_path, monkeypatch):
    """A refresh() of another thread shows a replacing run after ``take`` read the rows of its
    first shard, of the old run: the take reads again, all of the new run (before: the first
    shard's rows of the old run, the next shard's of the new, with no error)."""
    small, big = _data((40, 4), torch.float32, seed=2), _data((100, 4), torch.float32, seed=1)
    path = tmp_path / "s.zarr"
    _write(path, small, chunk_rows=8, shard_rows=32)
    st = open_store(path)
    assert _same(st.take("x", [23, 37]), small[[23, 37]])
    real, calls = R.Store._read_rows, []

    def then_replaced(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 1:
            _write(path, big, chunk_rows=8, shard_rows=32, overwrite=True)
            self.refresh()  # (in another thread)
        return out

    monkeypatch.setattr(R.Store, "_read_rows", then_replaced)
    assert _same(st.take("x", [23, 37]), big[[23, 37]])
