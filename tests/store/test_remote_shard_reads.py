"""Reads of a store on object storage (moto S3) or in fsspec memory, shard by shard: a
replaced store is never read as the opened run, whatever the reader cached before the
replacement, and a full read asks for the root document a number of times that does not grow
with the shards read (every chunk is checked against the opened run's manifest instead)."""

from __future__ import annotations

import collections
import uuid

import pytest
import torch

from activationscope.errors import StoreCorruptError, StoreError
from activationscope.store import open_store

from acs_testing import store_target
from hostile import CHUNK_ROWS, HP, SHARD_ROWS
from test_remote_overwrite_race import REPLACED, _write

# a last shard of one full chunk and a partial one: rows 64..79 and 80..87
N_TAIL = SHARD_ROWS + CHUNK_ROWS + CHUNK_ROWS // 2


@pytest.fixture(params=["s3", "memory"])
def remote(request):
    return store_target(request, request.param, "shards")


def test_the_partial_last_chunk_of_another_run_is_refused_after_its_shard_index_was_read(remote):
    """The reader read the last shard's index (and its first chunk) before another run was
    written in the store's place: the partial last chunk, read then, is of the new run. It fails
    the opened run's crc32c, and the manifest read to tell a resume's rewrite from damage is the
    new run's, which it matches: that is another run, not a resume (before: its rows returned)."""
    url, so = remote
    old = _write(url, so, seed=0, n_rows=N_TAIL)
    # (a cache of less than 4 times the array's 2816 bytes: a read elsewhere than the last one
    # ended reads only its own chunks, not its whole shard, as a larger array's read does)
    st = open_store(url, storage_options=so, cache_bytes=4096)
    assert torch.equal(st.rows(HP, SHARD_ROWS, SHARD_ROWS + 4), old[SHARD_ROWS:SHARD_ROWS + 4])
    new = _write(url, so, seed=1, overwrite=True, n_rows=N_TAIL)
    tail = slice(SHARD_ROWS + CHUNK_ROWS, N_TAIL)
    with pytest.raises(StoreError, match=REPLACED) as e:
        got = st.rows(HP, tail.start, tail.stop)
        assert not torch.equal(got, new[tail]), "the new run's rows were returned as the opened run's"
    assert not isinstance(e.value, StoreCorruptError)
    st.refresh()
    assert torch.equal(st.rows(HP, tail.start, tail.stop), new[tail])


def _requests_of_a_full_read(url: str, so, monkeypatch) -> collections.Counter:
    """(method, key) of every S3 request of opening the store at ``url`` and reading all its rows."""
    endpoint = pytest.importorskip("aiobotocore.endpoint")
    requests: collections.Counter = collections.Counter()
    send = endpoint.AioEndpoint._send

    async def counted(self, request):
        requests[(request.method, request.url.split("?")[0].split(".zarr/")[-1])] += 1
        return await send(self, request)

    monkeypatch.setattr(endpoint.AioEndpoint, "_send", counted)
    st = open_store(url, storage_options=so)
    requests["rows"] = st.n_rows(HP)
    got = torch.cat([st.rows(HP, s, min(s + 40, st.n_rows(HP))) for s in range(0, st.n_rows(HP), 40)])
    monkeypatch.undo()
    requests["values"] = got
    return requests


@pytest.mark.parametrize("n_shards", [2, 10])
def test_a_full_read_of_an_s3_store_asks_for_metadata_once_per_array_not_per_shard(s3, monkeypatch, n_shards):
    """Opening a store and reading every row of an array of ``n_shards`` shards: the root
    document is asked for as many times whatever the number of shards, and a shard's size is
    never asked for (its index is read at the size its manifest records, which the read
    confirms); before, one HEAD of the root and one of the shard per shard. Rows as written."""
    url = f"s3://acs-bucket/shards-{uuid.uuid4().hex}.zarr"
    want = _write(url, s3, seed=0, n_rows=n_shards * SHARD_ROWS)
    requests = _requests_of_a_full_read(url, s3, monkeypatch)
    assert torch.equal(requests.pop("values"), want)
    assert requests.pop("rows") == n_shards * SHARD_ROWS
    shards = {key for _, key in requests if key.startswith(f"acts/{HP}/c/")}
    assert len(shards) == n_shards
    root = sum(v for (m, key), v in requests.items() if key.endswith(".zarr") or key == "zarr.json")
    assert root <= 5, requests  # opening (its stamp, size, bytes), the array's first read; before: + n_shards
    heads = {key: requests[("HEAD", key)] for key in shards if requests[("HEAD", key)]}
    # the last shard's size, checked once when the array is first read (n_rows against its files)
    assert heads == {f"acts/{HP}/c/{n_shards - 1}/0": 1}, requests
    for key in shards:  # its index and its 4 chunks
        assert requests[("GET", key)] <= 5, (key, requests)


def test_a_shard_of_another_size_than_its_manifest_records_is_read_at_its_size(remote):
    """A shard file longer than the manifest's ``file_bytes`` (a resume's rewrite of the last
    shard since the reader opened the store): its index is read at its real end, and the rows
    committed when the reader opened it read as they were."""
    url, so = remote
    old = _write(url, so, seed=0, n_rows=N_TAIL)
    st = open_store(url, storage_options=so)
    assert torch.equal(st.rows(HP, 0, 4), old[:4])  # (the manifest read: the shard sizes it records)
    _write(url, so, seed=2, resume=True, n_rows=CHUNK_ROWS)  # the last shard rewritten with 16 more rows
    assert open_store(url, storage_options=so).n_rows(HP) == N_TAIL + CHUNK_ROWS
    assert torch.equal(st.rows(HP, 0, N_TAIL), old)


@pytest.mark.parametrize("cut", [7, SHARD_ROWS * 8])
def test_a_shard_cut_short_on_object_storage_is_named_as_such(remote, cut):
    """A shard object truncated after its commit (an interrupted copy, a tool that rewrote it)
    was refused as "shard index crc32c mismatch" alone: the error now says it holds fewer bytes
    than its manifest records. The other shards still read."""
    from activationscope.store._backend import resolve

    url, so = remote
    old = _write(url, so, seed=0, n_rows=2 * SHARD_ROWS)
    b = resolve(url, storage_options=so)
    key = f"acts/{HP}/c/1/0"
    data = b.get(key, max_bytes=None)
    b.set(key, data[:-cut])
    st = open_store(url, storage_options=so)
    with pytest.raises(StoreCorruptError, match=rf"shard '{key}': shard index crc32c mismatch .*: it holds "
                       rf"{len(data) - cut} bytes, its manifest acts/{HP}/manifest.json records {len(data)} "
                       r"\(file_bytes\), so it was cut short after its commit"):
        st.rows(HP, SHARD_ROWS, SHARD_ROWS + 1)
    assert torch.equal(st.rows(HP, 0, SHARD_ROWS), old[:SHARD_ROWS])
