"""A store on object storage opened (and read) in a process that then forks: the child reads
the store object it inherited (a Dataset of one's own holding it, in DataLoader workers
started with fork; a ``multiprocessing`` pool) through a file system of its own. The parent's
held client sessions of the parent's event loop, and every read of the child failed with
"attached to a different loop"."""
from __future__ import annotations

import os

import pytest
import torch

from activationscope.store import open_store

from acs_testing import store_target, wait_for_child
from hostile import HP, SHARD_ROWS
from test_remote_overwrite_race import _write


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_reads_the_s3_store_its_parent_opened(request, tmp_path):
    url, so = store_target(request, "s3", "fork")
    want = _write(url, so, seed=0, n_rows=3 * SHARD_ROWS)
    st = open_store(url, storage_options=so, cache_bytes=0)  # (no cache: the child's rows are read again)
    assert torch.equal(st.rows(HP, 0, 4), want[0:4])
    err = tmp_path / "child-stderr.txt"
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fd = os.open(err, os.O_WRONLY | os.O_CREAT)
            os.dup2(fd, 2)
            rows = st.rows(HP, SHARD_ROWS, 2 * SHARD_ROWS + 3)  # (other shards than the parent read)
            mean = st.reductions[HP]["mean"]
            code = 0 if torch.equal(rows, want[SHARD_ROWS:2 * SHARD_ROWS + 3]) and torch.equal(
                mean, want.double().mean(0)) else 2
        except BaseException as e:  # noqa: BLE001 - said to the parent through the file
            print(f"{type(e).__name__}: {e}", file=open(err, "a"))
        finally:
            os._exit(code)
    code = wait_for_child(pid, 60, "the forked child did not finish reading")
    said = err.read_text() if err.exists() else ""
    assert code == 0, said
    assert "Unclosed" not in said and "different loop" not in said, said
    assert torch.equal(st.rows(HP, 2 * SHARD_ROWS, 3 * SHARD_ROWS), want[2 * SHARD_ROWS:])  # (the parent still reads)
