"""A shard truncated or rewritten in place under a memory-mapped view (``cp`` over a store
being read) raises StoreCorruptError naming the file instead of killing the process with
SIGBUS (issue 12, item 1)."""

from __future__ import annotations

import pytest
import torch

from activationscope.store import open_store

from hostile import HP, make_store, run_python

_TRUNCATE = """
    import sys, torch
    from pathlib import Path
    from activationscope.errors import StoreCorruptError
    from activationscope.store import open_store
    from hostile import HP, shard
    path = Path(sys.argv[1])
    s = open_store(path)
    v = {view}
    total = float(v.sum())
    open(shard(path, 1), "wb").close()  # truncated to 0 bytes, as `cp` over it does
    try:
        print("sum", float(v.sum()), flush=True)
        print("no error", flush=True)
    except StoreCorruptError as e:
        print("StoreCorruptError:", e, flush=True)
    print("alive", flush=True)
"""


def _store(path, layout: str, n_rows: int) -> None:
    """``make_store``'s 64-row shards (a mapped segment each), or 16 KiB shards of 64-float rows
    mapped back to back as one view of all rows."""
    if layout == "64-row shards":
        make_store(path)
        return
    from activationscope.store import StoreWriter

    w = StoreWriter(path, chunk_rows=64, shard_bytes=64 * 64 * 4)
    a = w.open_array(HP, (64,), torch.float32, "sample")
    a.append(torch.randn(n_rows, 64))
    w.add_batch(n_rows)
    w.close()
    assert len(open_store(path).segments(HP)) == 2  # one view of all rows


@pytest.mark.parametrize("layout, view", [
    ("64-row shards", "s[HP, 64:128]"),                 # one mapped shard
    ("page-sized shards", "s[HP]"),                     # every shard mapped back to back as one view
])
def test_shard_truncated_under_a_view_raises_not_kills(tmp_path, layout, view):
    path = tmp_path / "s.zarr"
    _store(path, layout, 320)
    r = run_python(_TRUNCATE.replace("{view}", view), str(path))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "alive" in r.stdout and "StoreCorruptError:" in r.stdout, r.stdout + r.stderr[-2000:]
    assert "c/1/0" in r.stdout and "truncated or rewritten in place" in r.stdout




_THREAD_READ = """
    import sys, threading, time, torch
    from pathlib import Path
    from activationscope.data import ActivationDataset
    from activationscope.errors import StoreCorruptError
    from activationscope.store import open_store
    from hostile import HP, shard
    path = Path(sys.argv[1])
    torch.set_num_threads({threads})
    ds = ActivationDataset(open_store(path), hook_points=[HP])
    batch = [int(i) for i in torch.randperm(len(ds), generator=torch.Generator().manual_seed(1))[:{k}]]
    want = ds.get_batch(batch)[HP].clone()
    assert float(want.abs().sum()) > 0
    open(shard(path, {victim}), "wb").close()  # truncated to 0 bytes, as `cp` over it does
    got = []
    def read():
        try:
            got.append(ds.get_batch(batch)[HP])
        except StoreCorruptError as e:
            got.append(e)
    t = threading.Thread(target=read)
    t.start()
    t.join()
    r = got[0]
    if isinstance(r, Exception):
        print("thread: StoreCorruptError:", r, flush=True)
    else:
        print("thread: rows", "equal" if torch.equal(r, want) else "differ", flush=True)
    try:
        for _ in range(1000):  # bytecodes for a pending call of the main thread to run in
            time.sleep(0)
        print("main: no error", flush=True)
    except StoreCorruptError as e:
        print("main: StoreCorruptError:", e, flush=True)
"""


@pytest.mark.parametrize("layout, threads, k", [
    ("64-row shards", 1, 96),           # one segment per shard, copied on the calling thread
    ("page-sized shards", 2, 2048),     # one view of every shard, copied by index_select's threads
])
def test_shard_truncated_under_a_reader_thread_raises_in_that_thread(tmp_path, layout, threads, k):
    """A shuffled batch read in a thread other than the main one raised nothing there (its rows
    from the truncated shard were zeros) while the main thread got the error at some later,
    unrelated bytecode. The read now raises StoreCorruptError in its own thread, and the main
    thread does not raise it a second time."""
    path = tmp_path / "s.zarr"
    _store(path, layout, k)
    code = _THREAD_READ.replace("{threads}", str(threads)).replace("{k}", str(k)).replace("{victim}", "1")
    r = run_python(code, str(path))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "thread: StoreCorruptError:" in r.stdout, r.stdout + r.stderr[-2000:]
    assert "c/1/0" in r.stdout and "truncated or rewritten in place" in r.stdout
    assert "main: no error" in r.stdout, r.stdout
