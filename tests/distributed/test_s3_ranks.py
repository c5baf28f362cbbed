"""Rank stores and their commit on S3 (a moto server on 127.0.0.1): server-side copies, the
root written last with a conditional put; of two racing committers exactly one wins."""

from __future__ import annotations

import errno
import sys
import tempfile
import threading
import uuid
from pathlib import Path

import pytest
import torch

import activationscope as acs

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import torchrun_capture as job  # noqa: E402

WORLD = 2


def test_rank_stores_commit_on_s3_equal_local(s3, tmp_path):
    from activationscope.store.ranks import commit_ranks

    url = "s3://acs-ranks/run.zarr"
    job.capture_rank_stores(url, ["mean", "var"], WORLD, storage_options=s3)
    job.capture_rank_stores(str(tmp_path / "local.zarr"), ["mean", "var"], WORLD)
    assert acs.open_store(url, storage_options=s3).status == "incomplete"
    results, errors = [], []
    gate = threading.Barrier(2)

    def commit():
        gate.wait()
        try:
            results.append(commit_ranks(url, storage_options=s3))
        except acs.StoreError as e:
            errors.append(e)

    threads = [threading.Thread(target=commit) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 1 and len(errors) == 1, (results, errors)  # exactly one committer wins
    assert "lock" in str(errors[0]).lower() or "another committer" in str(errors[0])
    commit_ranks(str(tmp_path / "local.zarr"))
    remote, local = acs.open_store(url, storage_options=s3), acs.open_store(tmp_path / "local.zarr")
    assert remote.status == "complete" and remote.attrs["format"]["version"] == 2
    for hp in local.hook_points:
        assert torch.equal(remote[hp].view(torch.int32), local[hp].view(torch.int32))
        torch.testing.assert_close(remote.reductions[hp]["mean"], local.reductions[hp]["mean"], rtol=0, atol=0)
    assert remote.row_table("sample").equals(local.row_table("sample"))
    assert remote.verify() == []
    from activationscope.store._backend import resolve

    assert not list(resolve(url, storage_options=s3).list("ranks/"))


def test_root_put_is_conditional_on_s3(s3):
    """The commit point is a conditional put: a root replaced since the commit read it wins."""
    from activationscope.store import ranks as R
    from activationscope.store._backend import resolve

    b = resolve("s3://acs-ranks/cond.zarr", storage_options=s3)
    b.set("zarr.json", b"{}")
    etag = R._root_etag(b)
    assert etag
    b.set("zarr.json", b'{"other": 1}')  # another committer got there first
    with pytest.raises(acs.StoreError, match="another committer replaced the root"):
        R._put_root(b, b'{"mine": 1}', etag)
    assert b.get("zarr.json") == b'{"other": 1}'
    R._put_root(b, b'{"mine": 2}', R._root_etag(b))
    assert b.get("zarr.json") == b'{"mine": 2}'
    b2 = resolve("s3://acs-ranks/fresh.zarr", storage_options=s3)
    R._put_root(b2, b"{}", None)  # If-None-Match: * on a new store
    with pytest.raises(acs.StoreError, match="another committer"):
        R._put_root(b2, b"{}", None)


def test_consolidate_on_s3_checks_every_full_shard_before_committing(s3):
    """A full rank shard damaged in place (same size, one byte changed): the commit with
    ``verify=True`` (``activationscope consolidate``) reads every shard and refuses, naming the
    rank and the shard; nothing is committed and the rank stores stay."""
    import s3fs

    from activationscope.errors import StoreCorruptError
    from activationscope.store.ranks import commit_ranks

    url = "s3://acs-ranks/damaged.zarr"
    job.capture_rank_stores(url, ["mean"], WORLD, storage_options=s3)
    fs = s3fs.S3FileSystem(**s3)
    rank = acs.open_store(f"{url}/ranks/00001", storage_options=s3)
    hp = rank.hook_points[0]
    meta = rank.attrs["arrays"][hp]
    assert rank.n_rows(hp) >= int(meta["shard_rows"])  # a full shard: copied server-side, never read otherwise
    shard = sorted(k for k in fs.find(f"acs-ranks/damaged.zarr/ranks/00001/{meta['path']}/c/0"))[0]
    raw = bytearray(fs.cat_file(shard))
    raw[10] ^= 0xFF
    fs.pipe_file(shard, bytes(raw))
    with pytest.raises(StoreCorruptError, match=r"ranks/00001.: chunk 0 .*crc32c mismatch.*nothing was committed\. Rerun rank 1"):
        commit_ranks(url, storage_options=s3)
    assert acs.open_store(url, storage_options=s3).status == "incomplete"
    assert fs.exists(shard)


def test_consolidate_on_s3_reads_each_full_shard_once(s3, monkeypatch):
    """The crc32c check of the full rank shards on object storage reads each shard's chunk data
    in one request, not one ranged request (and a size look-up) per chunk: a default 64 MiB
    shard of 256 KiB chunks was 768 requests. The committed rows are those captured."""
    from activationscope.store import _backend as B
    from activationscope.store.ranks import commit_ranks

    url = "s3://acs-ranks/reads.zarr"
    job.capture_rank_stores(url, ["mean"], WORLD, storage_options=s3)
    full = {}  # shard key (inside the store) -> rows check; only the full shards of each rank
    for r in range(WORLD):
        rank = acs.open_store(f"{url}/ranks/{r:05d}", storage_options=s3)
        for hp in rank.hook_points:
            meta = rank.attrs["arrays"][hp]
            assert int(meta["shard_rows"]) // int(meta["chunk_rows"]) >= 2  # several chunks per shard
            for k in range(rank.n_rows(hp) // int(meta["shard_rows"])):
                full[f"ranks/{r:05d}/{rank._shard_key(meta, k)}"] = 0
    assert full
    reads = []
    get_range = B.ZarrBackend.get_range

    def counted(self, key, start, length):
        reads.append(f"{self}/{key}")
        return get_range(self, key, start, length)

    monkeypatch.setattr(B.ZarrBackend, "get_range", counted)
    commit_ranks(url, storage_options=s3, verify=True)
    for read in reads:
        for k in full:
            if read.endswith(f"/{k}"):
                full[k] += 1
    assert all(n == 2 for n in full.values()), full  # its index, then its chunks in one read
    monkeypatch.undo()
    st = acs.open_store(url, storage_options=s3)
    assert st.status == "complete"


def test_a_failed_commit_of_remote_rank_stores_removes_its_staging_folder(tmp_path, monkeypatch):
    """The commit of remote rank stores writes each array's re-chunked tails into a local
    staging folder, then uploads them: a write that fails there leaves no staging folder
    behind, and the store uncommitted."""
    from activationscope.store import ranks

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    url = f"memory://acs-ranks/{uuid.uuid4().hex}.zarr"
    job.capture_rank_stores(url, ["mean"], WORLD)
    write = ranks._TailWriter.write

    def disk_full(self, tail):
        recs = write(self, tail)
        assert recs and list(tmp_path.glob("acs-commit-*/acts/*/c/*"))  # the tails are in the staging folder
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ranks._TailWriter, "write", disk_full)
    with pytest.raises(OSError, match="No space left"):
        ranks.commit_ranks(url)
    assert list(tmp_path.glob("acs-commit-*")) == []
    assert acs.open_store(url).status == "incomplete"
