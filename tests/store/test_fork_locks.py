"""A fork while another thread of the parent holds a lock of the read path (a read-ahead, a
refresh in a background thread, a prefetch thread as a DataLoader starts its workers): the
child starts with the lock free and reads the stored rows. Before, the child could start with
a lock held by a thread it does not have, and its first read hung.

Each child runs under a bounded wait: a lock left held fails the test instead of hanging it.
"""

from __future__ import annotations

import multiprocessing
import os
import threading

import pytest
import torch

from activationscope import _safeio
from activationscope.capture import _native
from activationscope.store import StoreWriter, open_store

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")

WAIT_S = 60


def _write(path, t: torch.Tensor, **options) -> None:
    w = StoreWriter(path, capture_config={}, model=None, storage_dtype=None, **options)
    arr = w.open_array("x", tuple(t.shape[1:]), t.dtype, "sample")
    for s in range(0, t.shape[0], 8):
        arr.append(t[s:s + 8])
        w.add_batch(min(8, t.shape[0] - s), list(range(s, min(s + 8, t.shape[0]))), None, {})
        w.commit()
    w.close()


def _in_forked_child(lock, fn):
    """``fn()`` in a forked child while another thread of the parent holds ``lock`` (from
    before the fork until the child is started); what it returned, or its exception's repr.
    Fails when the child does not answer within WAIT_S seconds (killed then)."""
    held, go = threading.Event(), threading.Event()

    def hold():
        with lock:
            held.set()
            go.wait(timeout=WAIT_S)

    t = threading.Thread(target=hold)
    t.start()
    assert held.wait(timeout=WAIT_S)
    try:
        return _forked(fn, started=go.set)
    finally:
        go.set()
        t.join(timeout=WAIT_S)


def _forked(fn, started=None):
    """``fn()`` in a forked child (``started()`` called once it is started); what it returned,
    or its exception's repr. Fails when the child does not answer within WAIT_S seconds."""
    import queue as q

    def child(queue):
        try:
            queue.put(fn())
        except BaseException as e:  # (said to the test, not lost in the child)
            queue.put(repr(e))

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=child, args=(queue,))
    try:
        proc.start()
    finally:
        if started is not None:
            started()
    try:
        try:
            return queue.get(timeout=WAIT_S)
        except q.Empty:
            pytest.fail(f"the forked child did not read within {WAIT_S} s: a lock held at the fork stayed held")
    finally:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=WAIT_S)


@pytest.mark.parametrize("compression", [None, "zstd"], ids=["mapped", "decoded"])
def test_a_fork_while_another_thread_holds_a_store_lock_leaves_it_free_in_the_child(tmp_path, compression):
    t = torch.randn(64, 16)
    _write(tmp_path / "s.zarr", t, compression=compression, chunk_rows=8)
    st = open_store(tmp_path / "s.zarr")
    assert torch.equal(st.rows("x", 0, 8), t[:8])  # (caches filled in the parent)

    def read():
        st.refresh()
        return [torch.equal(st.rows("x", 0, 64), t), torch.equal(st.rows("x", 40, 48), t[40:48])]

    assert _in_forked_child(st._lock, read) == [True, True]
    assert torch.equal(st.rows("x", 8, 16), t[8:16])  # (the parent's store reads on)
    st.close()


def test_a_fork_while_another_thread_holds_a_dataset_source_lock_leaves_it_free_in_the_child(tmp_path):
    from activationscope.data import ActivationDataset

    t = torch.randn(64, 16)
    _write(tmp_path / "s.zarr", t)
    ds = ActivationDataset(open_store(tmp_path / "s.zarr"))
    assert torch.equal(ds[0:8]["x"], t[:8])

    def read():
        return torch.equal(ds[8:24]["x"], t[8:24])

    assert _in_forked_child(ds.source._lock, read) is True


def test_a_fork_while_another_thread_holds_the_zarr_executor_lock_leaves_it_free_in_the_child():
    def take():
        got = _safeio._zarr_lock.acquire(timeout=WAIT_S)
        if got:
            _safeio._zarr_lock.release()
        _safeio.exit_safe_zarr()  # (takes it)
        return got

    assert _in_forked_child(_safeio._zarr_lock, take) is True


_ARMED: list[int] = []  # pipe ends written to just before a fork (the native test below)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=lambda: [os.write(fd, b"\x01") for fd in _ARMED])


@pytest.mark.skipif(_native.optional() is None, reason="needs the native extension (its mappings)")
def test_a_fork_while_another_thread_holds_the_native_mapping_registry_waits_for_it(tmp_path):
    """The native registry of mappings (each mapped shard is registered there, for the
    SIGBUS guard) has a lock that a thread mapping or letting go of a shard holds: a fork
    meanwhile waits for it, and the child maps shards. Before, the child could start with it
    held by a thread it does not have, and its first mapping hung."""
    import select

    C = _native.optional()
    t = torch.randn(64, 16)
    _write(tmp_path / "s.zarr", t)
    st = open_store(tmp_path / "s.zarr")  # (nothing mapped yet: the child maps)
    ready_r, ready_w = os.pipe()
    release_r, release_w = os.pipe()
    # holds the lock until a byte comes (written by the fork, just before it), then 0.2 s more
    holder = threading.Thread(target=C._hold_map_guard, args=(ready_w, release_r, 0.2))
    holder.start()
    try:
        assert select.select([ready_r], [], [], WAIT_S)[0], "the lock was never taken"
        _ARMED.append(release_w)
        try:
            got = _forked(lambda: [torch.equal(st.rows("x", 0, 64), t), torch.equal(st.rows("x", 40, 48), t[40:48])])
        finally:
            _ARMED.remove(release_w)
    finally:
        os.write(release_w, b"\x01")  # (a second byte: never read)
        holder.join(timeout=WAIT_S)
        for fd in (ready_r, ready_w, release_r, release_w):
            os.close(fd)
    assert got == [True, True]
    assert torch.equal(st.rows("x", 8, 16), t[8:16])
    st.close()
