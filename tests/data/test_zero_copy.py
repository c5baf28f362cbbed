"""Zero-copy reads: views lie in a file mapping of the store, RSS stays flat, opening is fast."""

from __future__ import annotations

import os
import time

import numpy as np
import pyarrow as pa
import pytest
import torch
from fake_store import FakeStore, write_fake_store

from activationscope.data import ActivationDataset


def mapping_of(ptr: int) -> str | None:
    """The file backing the address ``ptr`` in this process (from /proc/self/maps), or None."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= ptr < hi:
                return parts[5] if len(parts) > 5 else None
    return None


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")

ROWS, D = 4096, 2048  # 32 MiB of float32


@pytest.fixture(scope="module")
def big_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("big") / "s"
    acts = torch.arange(ROWS, dtype=torch.float32)[:, None].expand(ROWS, D).contiguous()
    table = pa.table({"sample_id": pa.array(np.arange(ROWS))})
    write_fake_store(path, {"x": acts}, tables={"sample": table}, shard_rows=ROWS // 2)
    return path


def test_views_lie_in_the_store_files_and_rss_stays_flat(big_store):
    before = rss_bytes()
    t0 = time.perf_counter()
    ds = ActivationDataset(FakeStore(big_store), hook_points=["x"])
    batch = ds[0 : ROWS // 2]["x"]
    open_s = time.perf_counter() - t0
    backing = mapping_of(batch.data_ptr())
    assert backing is not None and backing.startswith(str(big_store)), backing
    assert mapping_of(batch[-1].data_ptr()) == backing
    grown = rss_bytes() - before
    layer_bytes = ROWS * D * 4
    assert grown < layer_bytes // 4, f"RSS grew by {grown} bytes for a {layer_bytes}-byte layer"
    assert open_s < 1.0
    # touching a few rows reads only those pages
    assert float(batch[5, 0]) == 5.0 and float(ds[ROWS - 1]["x"][7]) == ROWS - 1
    # a batch across the two shard files is one copy, on the heap
    across = ds[ROWS // 2 - 2 : ROWS // 2 + 2]["x"]
    assert mapping_of(across.data_ptr()) != backing
    assert across[:, 0].tolist() == [ROWS // 2 - 2, ROWS // 2 - 1, ROWS // 2, ROWS // 2 + 1]
