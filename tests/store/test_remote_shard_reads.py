"""Reads of a store on object storage (moto S3) or in fsspec memory, shard by shard: a
replaced store is never read as the opened run, whatever the reader cached before the
replacement."""

from __future__ import annotations

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
    st = open_store(url, storage_options=so)
    assert torch.equal(st.rows(HP, SHARD_ROWS, SHARD_ROWS + 4), old[SHARD_ROWS:SHARD_ROWS + 4])
    new = _write(url, so, seed=1, overwrite=True, n_rows=N_TAIL)
    tail = slice(SHARD_ROWS + CHUNK_ROWS, N_TAIL)
    with pytest.raises(StoreError, match=REPLACED) as e:
        got = st.rows(HP, tail.start, tail.stop)
        assert not torch.equal(got, new[tail]), "the new run's rows were returned as the opened run's"
    assert not isinstance(e.value, StoreCorruptError)
    st.refresh()
    assert torch.equal(st.rows(HP, tail.start, tail.stop), new[tail])

