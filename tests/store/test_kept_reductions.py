"""Hostile stores around the reduction files a resume keeps (``<key>.committed.tmp``,
FORMAT.md section 6): planted, oversized or non-regular kept files never make a reader
allocate by their size, never make a resume follow a link out of the store, and never stall
a resume at its close."""

from __future__ import annotations

import sys
import tracemalloc
from pathlib import Path

import pytest

from activationscope import open_store
from activationscope.errors import StoreCorruptError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_resume_reductions import _batches, _model, _ref_rows, _run  # noqa: E402

KEPT = "mean%2Fc%2F0.committed.tmp"


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "s.zarr"
    _run(_model(), path, _batches(2, rows=5), ["mean", "var"])
    return path


def _peak_bytes(fn):
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("big", ["kept", "key"])
def test_an_oversized_reduction_file_is_never_read_whole(store, big):
    """A damaged chunk (40 bytes) with a kept file of 512 MiB, or a 512 MiB chunk with any kept
    file: choosing the file read both whole (up to 4 GiB) to compare their crc32c."""
    node = store / "reductions" / "0.output"
    key, kept = node / "mean" / "c" / "0", node / KEPT
    if big == "kept":
        key.write_bytes(b"x" * 40)
        with open(kept, "wb") as f:
            f.truncate(512 << 20)
    else:
        kept.write_bytes(b"x")
        with open(key, "r+b") as f:
            f.truncate(512 << 20)
    s = open_store(store)

    def read():
        with pytest.raises(StoreCorruptError, match="mean/c/0"):
            s.reductions["0.output"]["mean"]

    assert _peak_bytes(read) < 64 << 20
    problems = []
    assert _peak_bytes(lambda: problems.extend(s.verify())) < 64 << 20
    assert any("mean/c/0" in p for p in problems)

