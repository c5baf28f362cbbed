"""Hostile stores around the reduction files a resume keeps (``<key>.committed.tmp``,
FORMAT.md section 6): planted, oversized or non-regular kept files never make a reader
allocate by their size, never make a resume follow a link out of the store, and never stall
a resume at its close."""

from __future__ import annotations

import os
import sys
import tracemalloc
from pathlib import Path

import pytest

from activationscope import open_store
from activationscope.errors import StoreCorruptError, StoreError

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


@pytest.mark.parametrize("what", ["link to a file outside", "link to a folder outside", "link to /dev/zero"])
@pytest.mark.parametrize("kept", [KEPT, "mean%2Fzarr.json.committed.tmp", "..%2F..%2Fx.committed.tmp"])
def test_a_resume_removes_a_planted_link_named_as_a_kept_file_without_following_it(store, tmp_path, what, kept):
    """A kept file that is a symlink is no file of the store: the resume removes the link
    (never what it points to). It refused instead, telling to fix permissions (a link to a
    file), or failed at its close after the whole capture, the store left incomplete (a link
    to a folder, which verify did not list)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret")
    target = {"link to a file outside": outside / "secret.txt", "link to a folder outside": outside,
              "link to /dev/zero": Path("/dev/zero")}[what]
    link = store / "reductions" / "0.output" / kept
    os.symlink(target, link)
    # (a link to a folder by a name where no resume keeps a file is no concern of theirs: left)
    left = what == "link to a folder outside" and kept.startswith("..")
    assert any(kept in p for p in open_store(store).verify()) != left
    model, xs = _model(), _batches(4, rows=5)
    _run(model, store, xs[2:], ["mean", "var"], resume=True)
    s = open_store(store)
    assert s.status == "complete" and s.n_rows("0.output") == 20 and s.verify() == []
    assert os.path.lexists(link) == left and not [p for p in store.rglob("*.committed.tmp") if p != link]
    assert sorted(os.listdir(outside)) == ["secret.txt"] and (outside / "secret.txt").read_text() == "secret"
    import torch

    torch.testing.assert_close(s.reductions["0.output"]["mean"], _ref_rows(model, xs).mean(0))


def test_a_resume_refuses_a_folder_named_as_a_kept_file_before_it_captures(store):
    """A folder where a resume keeps a committed file failed the resume at its close (the
    rows captured, the store left incomplete, the message telling to free space); verify did
    not list it. Now verify names it and a resume refuses at its start, touching nothing."""
    folder = store / "reductions" / "0.output" / KEPT
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "f").write_text("x")
    assert any(KEPT in p and "folder" in p for p in open_store(store).verify())
    with pytest.raises(StoreError, match=r"mean%2Fc%2F0\.committed\.tmp.*folder.*remove it"):
        _run(_model(), store, _batches(4, rows=5)[2:], ["mean", "var"], resume=True)
    s = open_store(store)
    assert s.status == "complete" and s.n_rows("0.output") == 10 and (folder / "sub" / "f").read_text() == "x"


def test_a_reduction_named_like_a_kept_file_is_no_kept_file(tmp_path):
    """A reduction may be named ``m.committed.tmp`` (its arrays are folders by that name): they
    are neither refused by a resume nor listed by verify; only the names where a resume keeps
    a committed file are."""
    import torch

    path, model, xs = tmp_path / "s.zarr", _model(), _batches(4, rows=5)
    specs = [("m.committed.tmp", "mean")]
    _run(model, path, xs[:2], specs)
    assert (path / "reductions" / "0.output" / "m.committed.tmp").is_dir()
    assert open_store(path).verify() == []
    _run(model, path, xs[2:], specs, resume=True)
    s = open_store(path)
    assert s.status == "complete" and s.verify() == []
    torch.testing.assert_close(s.reductions["0.output"]["m.committed.tmp"], _ref_rows(model, xs).mean(0))
