"""A shard index read in one thread while the process forks (a DataLoader starting its
workers while the parent reads): the forked child reads that shard without waiting on the
parent's reader, which does not exist in the child."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from activationscope.store import open_store

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
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child waited forever on the shard index its parent's thread was reading")
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        release.set()
        reader.join(30)
    assert torch.equal(st.rows(HP, 0, 2), want[0:2])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_child_forked_while_a_thread_holds_the_stores_lock_reads(tmp_path, compression):
    # (a decode thread of the parent caching a chunk, say: the child's first read waited forever
    # on the lock, which no thread of the child holds or releases)
    want = make_store(tmp_path / "s.zarr", compression=compression)
    st = open_store(tmp_path / "s.zarr", cache_bytes=0)
    assert torch.equal(st.rows(HP, 0, 2), want[0:2])
    held, release = threading.Event(), threading.Event()

    def hold():
        with st._lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(30)
    try:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = 0 if torch.equal(st.rows(HP, 70, 90), want[70:90]) else 2
            finally:
                os._exit(code)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child waited forever on the lock a thread of its parent held at the fork")
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        release.set()
        holder.join(30)
    assert torch.equal(st.rows(HP, 70, 90), want[70:90])
