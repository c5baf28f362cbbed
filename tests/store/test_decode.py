"""Local compressed arrays: parallel, read-ahead decoding straight from the shard files,
checked against zarr-python and against the written tensors; damaged chunks are errors."""

from __future__ import annotations

import numcodecs
import numpy as np
import pytest
import torch
import zarr
from hypothesis import given, settings, strategies as st

from activationscope.errors import StoreCorruptError
from activationscope.store import open_store
from activationscope.store import _decode
from acs_testing import write_batches as _write

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.uint8, torch.bool]




def _data(shape, dtype, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(0, 100, shape, generator=g).to(dtype)
    t = torch.randn(shape, generator=g).to(dtype)
    t[: shape[0] // 3] = 0  # compressible
    return t


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def _zarr_reference(path, dtype) -> torch.Tensor:
    raw = torch.from_numpy(np.ascontiguousarray(zarr.open_group(str(path), mode="r")["acts/x"][:]))
    return raw.view(torch.bfloat16) if dtype == torch.bfloat16 else raw


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 120),
    feature=st.lists(st.integers(1, 5), min_size=0, max_size=2),
    chunk_rows=st.integers(1, 13),
    shard_chunks=st.integers(1, 4),
    dtype=st.sampled_from(DTYPES),
    compression=st.sampled_from(["zstd", "zstd:1", "blosc-lz4"]),
    cuts=st.lists(st.integers(0, 120), min_size=2, max_size=8),
)
def test_decoded_reads_equal_written_rows_and_zarr(tmp_path_factory, n, feature, chunk_rows, shard_chunks, dtype,
                                                   compression, cuts):
    path = tmp_path_factory.mktemp("d") / "s.zarr"
    t = _data((n, *feature), dtype, seed=n)
    item = t.element_size() * int(np.prod(feature) if feature else 1)
    _write(path, t, compression=compression, chunk_rows=chunk_rows, shard_bytes=chunk_rows * shard_chunks * item)
    # a small cache: reads bigger than half of it decode straight into the result
    store = open_store(path, cache_bytes=4 * chunk_rows * item)
    assert store._decodes_locally(store._meta("x"))
    assert torch.equal(_bits(store["x"]), _bits(t))
    assert torch.equal(_bits(_zarr_reference(path, dtype)), _bits(t))
    bounds = sorted({min(c, n) for c in cuts} | {0, n})
    for a, b in zip(bounds, bounds[1:]):  # a sequential reader: read-ahead, cache hits
        assert torch.equal(_bits(store.rows("x", a, b)), _bits(t[a:b])), (a, b)
    for a, b in zip(bounds[::-1][1:], bounds[::-1]):  # backwards: no read-ahead
        assert torch.equal(_bits(store.rows("x", a, b)), _bits(t[a:b])), (a, b)


@pytest.mark.parametrize("compression", ["zstd", "blosc-lz4"])
def test_sequential_reader_gets_the_next_chunks_decoded_ahead(tmp_path, compression):
    t = _data((400, 16), torch.float32)
    _write(tmp_path / "s.zarr", t, batch=50, compression=compression, chunk_rows=10, shard_bytes=10 * 64 * 5)
    store = open_store(tmp_path / "s.zarr")
    assert torch.equal(store.rows("x", 0, 10), t[0:10])
    ahead = [key for key in list(store._cache) + list(store._inflight) if key[1] > 0]  # (hook point, chunk, ...)
    assert ahead, "a sequential read did not start decoding the next chunk"
    for a in range(10, 400, 10):
        assert torch.equal(store.rows("x", a, a + 10), t[a:a + 10])
    # a returned batch is the reader's own copy: writing into it leaves the cache intact
    got = store.rows("x", 390, 400)
    got.fill_(7)
    assert torch.equal(store.rows("x", 390, 400), t[390:400])


def test_dataloader_workers_read_compressed_rows(tmp_path):
    from activationscope.data import ActivationDataset, SequentialBatchSampler

    t = _data((300, 8), torch.float32)
    _write(tmp_path / "s.zarr", t, compression="zstd", chunk_rows=16)
    ds = ActivationDataset(tmp_path / "s.zarr")
    _ = ds[0:20]  # the parent decodes and starts read-ahead before the workers fork
    loader = torch.utils.data.DataLoader(ds, batch_sampler=SequentialBatchSampler(ds, batch_size=23), num_workers=2)
    got = torch.cat([b["x"] for b in loader])
    assert torch.equal(got, t)


def _one_shard(tmp_path, compression="zstd"):
    t = _data((64, 8), torch.float32)
    _write(tmp_path / "s.zarr", t, compression=compression, chunk_rows=8, shard_bytes=1 << 20)
    return t, tmp_path / "s.zarr" / "acts" / "x" / "c" / "0" / "0"


def _index(shard_bytes: bytes, n_chunks: int) -> np.ndarray:
    return np.frombuffer(shard_bytes, "<u8", count=2 * n_chunks, offset=len(shard_bytes) - 16 * n_chunks - 4).reshape(-1, 2)


def _rewrite_index(data: bytearray, n_chunks: int, index: np.ndarray) -> bytes:
    from activationscope.capture import _native

    ib = 16 * n_chunks + 4
    raw = index.astype("<u8").tobytes()
    data[len(data) - ib:len(data) - 4] = raw
    data[len(data) - 4:] = int(_native.load().crc32c(raw)).to_bytes(4, "little")
    return bytes(data)


def _record_in_manifest(path, slot: int, off: int, chunk: bytes) -> None:
    """Make the manifest agree with a rewritten chunk of shard 0 (a hostile store whose
    every checksum is consistent: the checks after the crc32c must still catch it)."""
    import json

    from activationscope.capture import _native

    man = path / "acts" / "x" / "manifest.json"
    doc = json.loads(man.read_text())
    rec = doc["shards"][0]
    rec["chunks"] = [c for c in rec["chunks"] if c[0] != slot] + [[slot, off, len(chunk), int(_native.load().crc32c(chunk))]]
    man.write_text(json.dumps(doc))


def _n_chunks(path) -> int:
    meta = open_store(path).attrs["arrays"]["x"]
    return meta["shard_rows"] // meta["chunk_rows"]


def test_truncated_shard_is_an_error_not_zeros(tmp_path):
    _t, shard = _one_shard(tmp_path)
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(StoreCorruptError, match="truncated"):
        open_store(tmp_path / "s.zarr")["x"]


def test_index_entry_past_the_end_is_an_error(tmp_path):
    _t, shard = _one_shard(tmp_path)
    n_chunks = _n_chunks(tmp_path / "s.zarr")
    data = bytearray(shard.read_bytes())
    index = _index(bytes(data), n_chunks).copy()
    index[2, 1] = len(data) * 4
    shard.write_bytes(_rewrite_index(data, n_chunks, index))
    with pytest.raises(StoreCorruptError, match="past the end"):
        open_store(tmp_path / "s.zarr").rows("x", 16, 24)


def test_damaged_index_crc_is_an_error(tmp_path):
    _t, shard = _one_shard(tmp_path)
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(StoreCorruptError, match="crc32c"):
        open_store(tmp_path / "s.zarr")["x"]


def test_missing_committed_chunk_is_an_error_not_fill_values(tmp_path):
    _t, shard = _one_shard(tmp_path)
    n_chunks = _n_chunks(tmp_path / "s.zarr")
    data = bytearray(shard.read_bytes())
    index = _index(bytes(data), n_chunks).copy()
    index[3] = [2**64 - 1, 2**64 - 1]
    shard.write_bytes(_rewrite_index(data, n_chunks, index))
    store = open_store(tmp_path / "s.zarr")
    assert store.rows("x", 0, 8).shape == (8, 8)  # other chunks still read
    with pytest.raises(StoreCorruptError, match="chunk 3 .* missing"):
        store.rows("x", 24, 32)


@pytest.mark.parametrize("compression", ["zstd", "blosc-lz4"])
def test_chunk_of_the_wrong_decoded_size_is_an_error(tmp_path, compression):
    t, shard = _one_shard(tmp_path, compression)
    n_chunks = _n_chunks(tmp_path / "s.zarr")
    data = bytearray(shard.read_bytes())
    index = _index(bytes(data), n_chunks).copy()
    enc = (numcodecs.Zstd() if compression == "zstd" else numcodecs.Blosc(cname="lz4")).encode(
        t[:4].numpy().tobytes())  # half a chunk's bytes
    off = len(data) - 16 * n_chunks - 4  # the end of the chunk data
    body = bytes(data[:off]) + enc
    index[1] = [off, len(enc)]
    shard.write_bytes(_rewrite_index(bytearray(body + bytes(data[off:])), n_chunks, index))
    _record_in_manifest(tmp_path / "s.zarr", 1, off, enc)
    store = open_store(tmp_path / "s.zarr")
    assert torch.equal(store.rows("x", 0, 8), t[0:8])
    with pytest.raises(StoreCorruptError, match="decodes to 128 bytes, expected 256"):
        store.rows("x", 8, 16)


@pytest.mark.parametrize("compression", ["zstd", "blosc-lz4", None])
def test_rows_of_a_zero_size_feature_shape_verify_and_read(tmp_path, compression):
    """Rows of shape (3, 0) hold no bytes: each compressed chunk is an encoding of nothing, which
    decodes to nothing (verify() said every chunk did not decode)."""
    t = torch.zeros(20, 3, 0)
    _write(tmp_path / "s.zarr", t, chunk_rows=4, shard_rows=8, compression=compression)
    store = open_store(tmp_path / "s.zarr")
    assert store.verify() == []
    assert store["x"].shape == (20, 3, 0) and store["x", ::-3].shape == (7, 3, 0)
    assert store.rows("x", 3, 9).shape == (6, 3, 0)


def test_garbage_chunk_is_an_error(tmp_path):
    _t, shard = _one_shard(tmp_path)
    n_chunks = _n_chunks(tmp_path / "s.zarr")
    data = bytearray(shard.read_bytes())
    index = _index(bytes(data), n_chunks)
    off = int(index[5, 0])
    data[off:off + 4] = b"\x00\x01\x02\x03"  # no zstd magic number
    shard.write_bytes(bytes(data))
    _record_in_manifest(tmp_path / "s.zarr", 5, off, bytes(data[off:off + int(index[5, 1])]))
    with pytest.raises(StoreCorruptError, match="chunk 5 .*does not decode"):
        open_store(tmp_path / "s.zarr").rows("x", 40, 48)


@pytest.mark.parametrize("cut", ["header only", "half", "8 bytes more"])
def test_blosc_chunk_shorter_or_longer_than_its_header_says_is_an_error(tmp_path, cut):
    """A blosc chunk whose header says more (or fewer) compressed bytes than the chunk holds,
    recorded with its own crc32c, is refused before it is decoded: c-blosc is not given the
    buffer's length and would read past its end. Before, a chunk cut to half decoded without
    an error into rows of whatever memory followed it."""
    t, shard = _one_shard(tmp_path, "blosc-lz4")
    n_chunks = _n_chunks(tmp_path / "s.zarr")
    data = bytearray(shard.read_bytes())
    index = _index(bytes(data), n_chunks).copy()
    off, nb = int(index[1, 0]), int(index[1, 1])
    enc = bytes(data[off:off + nb])
    enc = {"header only": enc[:16], "half": enc[:nb // 2], "8 bytes more": enc + bytes(8)}[cut]
    end = len(data) - 16 * n_chunks - 4
    index[1] = [end, len(enc)]
    shard.write_bytes(_rewrite_index(bytearray(bytes(data[:end]) + enc + bytes(data[end:])), n_chunks, index))
    _record_in_manifest(tmp_path / "s.zarr", 1, end, enc)
    store = open_store(tmp_path / "s.zarr")
    assert torch.equal(store.rows("x", 0, 8), t[0:8])
    with pytest.raises(StoreCorruptError, match=rf"does not decode: blosc header says {nb} compressed bytes, the chunk "
                                                rf"holds {len(enc)}"):
        store.rows("x", 8, 16)


@pytest.mark.parametrize("n", [0, 1, 255, 256, 65535, 65536 + 256, 1 << 20])
def test_zstd_frame_content_size_is_read_from_the_header(n):
    # frames of the header size classes (1, 2 and 4-byte content size fields)
    enc = numcodecs.Zstd(level=1).encode(np.zeros(n, np.uint8))
    assert _decode.decoded_size({"name": "zstd"}, enc) == n


@pytest.mark.parametrize("shutdown", ["pool", "interpreter"])
def test_reads_after_the_interpreter_began_its_exit_decode_in_the_reading_thread(tmp_path, monkeypatch, shutdown):
    """Once the main thread returns, concurrent.futures refuses new work (its exit hook runs
    before the threads still running are joined): a thread that went on reading a compressed
    store failed at its next chunk with RuntimeError ("cannot schedule new futures after
    [interpreter] shutdown"). Its chunks are now decoded in the reading thread, the same rows;
    a chunk asked for ahead is decoded only once it is read."""
    import concurrent.futures.thread as cf_thread
    import os
    from concurrent.futures import ThreadPoolExecutor

    t = _data((96, 3), torch.float32)
    _write(tmp_path / "s.zarr", t, compression="zstd", chunk_rows=8, shard_rows=32)
    st = open_store(tmp_path / "s.zarr")
    assert torch.equal(st.rows("x", 40, 48), t[40:48])  # (the array document opened; chunks 6.. decoded ahead)
    if shutdown == "pool":  # the state concurrent.futures' exit hook leaves the decode pool in
        ended = ThreadPoolExecutor(1)
        ended.shutdown(wait=True)
        monkeypatch.setattr(_decode, "_pool", ended)
        monkeypatch.setattr(_decode, "_pool_pid", os.getpid())
    else:  # concurrent.futures' own flag, set at exit for every pool
        monkeypatch.setattr(cf_thread, "_shutdown", True)
    ran = []
    real = type(st)._decode_chunk

    def counting(self, hook_point, meta, c, *rest, **kw):
        ran.append(c)
        return real(self, hook_point, meta, c, *rest, **kw)

    monkeypatch.setattr(type(st), "_decode_chunk", counting)
    assert torch.equal(st.rows("x", 8, 16), t[8:16]) and ran == [1]
    assert torch.equal(st.rows("x", 16, 24), t[16:24])  # sequential: the chunks after it are asked for ahead
    assert ran == [1, 2]  # ... and not decoded until read
    assert torch.equal(st.rows("x", 24, 28), t[24:28]) and ran == [1, 2, 3]
    assert torch.equal(st.rows("x", 40, 70), t[40:70])
    assert torch.equal(st.rows("x", 0, 96), t)


def test_a_shuffled_batch_of_a_local_compressed_array_decodes_its_chunks_only(tmp_path, monkeypatch):
    """A batch of positions (a shuffled or chunk-shuffled sampler's) is read chunk after chunk
    in store order: each chunk's read started where the last one stopped, so the store took
    the batch for a sequential reader and decoded the chunks after each one ahead. In a
    chunk-shuffled epoch of 1 KiB rows those evicted the window's own chunks from the cache
    (64 MiB, the window's 64 chunks of 1 MiB): every batch decoded its chunks again, about
    2,000 rows/s. Now the batch's chunks are asked for at once (``prefetch``, as on object
    storage: decoded side by side), and those are all it decodes."""
    from activationscope.data import ActivationDataset

    t = _data((640, 4), torch.float32)
    _write(tmp_path / "s.zarr", t, batch=64, compression="zstd", chunk_rows=8, shard_rows=64)
    ds = ActivationDataset(tmp_path / "s.zarr")
    decoded = []
    real = type(ds.store)._decode_chunk

    def counting(self, hook_point, meta, c, *rest, **kw):
        decoded.append(c)
        return real(self, hook_point, meta, c, *rest, **kw)

    monkeypatch.setattr(type(ds.store), "_decode_chunk", counting)
    g = torch.Generator().manual_seed(0)
    for window in (range(0, 64), range(160, 240)):  # (chunks 0-7, then 20-29: two shards each)
        rows = torch.tensor(window)[torch.randperm(len(window), generator=g)]
        for b in range(0, len(rows), 16):
            batch = rows[b:b + 16].tolist()
            assert torch.equal(ds.get_batch(batch)[ds.hook_points[0]], t[batch])
    assert sorted(decoded) == list(range(0, 8)) + list(range(20, 30))  # (each chunk once: the cache holds them)
