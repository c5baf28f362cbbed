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


@pytest.mark.parametrize("layout, view", [
    ("64-row shards", "s[HP, 64:128]"),                 # one mapped shard
    ("page-sized shards", "s[HP]"),                     # every shard mapped back to back as one view
])
def test_shard_truncated_under_a_view_raises_not_kills(tmp_path, layout, view):
    path = tmp_path / "s.zarr"
    if layout == "64-row shards":
        make_store(path)
    else:
        from activationscope.store import StoreWriter

        w = StoreWriter(path, chunk_rows=64, shard_bytes=64 * 64 * 4)  # 16 KiB shards of 64-float rows
        a = w.open_array(HP, (64,), torch.float32, "sample")
        a.append(torch.randn(320, 64))
        w.add_batch(320)
        w.close()
        assert len(open_store(path).segments(HP)) == 2  # one view of all rows
    r = run_python(_TRUNCATE.replace("{view}", view), str(path))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "alive" in r.stdout and "StoreCorruptError:" in r.stdout, r.stdout + r.stderr[-2000:]
    assert "c/1/0" in r.stdout and "truncated or rewritten in place" in r.stdout


