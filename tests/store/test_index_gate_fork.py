"""A shard index read in one thread while the process forks (a DataLoader starting its
workers while the parent reads): the forked child reads that shard without waiting on the
parent's reader, which does not exist in the child."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from activationscope.store import open_store

from acs_testing import wait_for_child
from hostile import HP, make_store


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_a_shard_index_is_read_reads_that_shard(tmp_path):
    want = make_store(tmp_path / "s.zarr")
    st = open_store(tmp_path / "s.zarr")
    inside, release = threading.Event(), threading.Event()
    tail = st._backend.tail

    def slow_tail(key, n):  # the parent's index read, held open while the process forks
        if threading.current_thread().name == "index-reader":
            inside.set()
            release.wait(30)
        return tail(key, n)

    st._backend.tail = slow_tail
    reader = threading.Thread(target=lambda: st.rows(HP, 0, 1), name="index-reader")
    reader.start()
    assert inside.wait(30)
    pid = os.fork()
    if pid == 0:  # the child: its own read of shard 0
        code = 1
        try:
            code = 0 if torch.equal(st.rows(HP, 0, 2), want[0:2]) else 2
        finally:
            os._exit(code)
    try:
        assert wait_for_child(pid, 20, "the forked child waited forever on the shard index its parent's thread "
                                       "was reading") == 0
    finally:
        release.set()
        reader.join(30)
    assert torch.equal(st.rows(HP, 0, 2), want[0:2])
