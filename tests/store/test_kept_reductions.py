"""Hostile stores around the reduction files a resume keeps (``<key>.committed.tmp``,
FORMAT.md section 6): planted, oversized or non-regular kept files never make a reader
allocate by their size, never make a resume follow a link out of the store, and never stall
a resume at its close."""

from __future__ import annotations

import os
import re
import sys
import tracemalloc
from pathlib import Path

import pytest

from activationscope import open_store
from activationscope.errors import StoreCorruptError, StoreError
from activationscope.store import _format as F

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


# --------------------------------------------------------------------------- a damaged key's file
_DAMAGE = ["folder", "fifo", "link outside"]
_KIND = {"folder": "a directory", "fifo": "a FIFO", "link outside": "a symlink to "}


def _damage(key: Path, how: str, outside: Path) -> None:
    """Put a folder (holding a file), a FIFO or a symlink to ``outside`` in the place of ``key``."""
    key.unlink()
    if how == "folder":
        key.mkdir()
        (key / "f").write_bytes(b"not the chunk")
    elif how == "fifo":
        os.mkfifo(key)
    else:
        os.symlink(outside, key)


@pytest.mark.timeout(300)  # (a reader that opened the FIFO and waited for a writer fails here, never hangs)
@pytest.mark.parametrize("file", ["mean/c/0", "mean/zarr.json"])
@pytest.mark.parametrize("how", _DAMAGE)
def test_a_reduction_file_that_is_no_regular_file_is_read_from_its_good_kept_copy(store, tmp_path, how, file):
    """A key's file that is a folder, a FIFO or a symlink leaving the store, with a kept copy
    of the committed bytes (FORMAT.md section 6): the reader refused it instead of reading the
    kept copy, as it does for a key's file of other bytes. Now the kept copy is read (the
    FIFO never opened for reading, the link never followed), verify names the damaged file,
    a copy holds the committed bytes, and a resume puts the kept copy back (a folder: once
    removed, which it says)."""
    import torch

    node = store / "reductions" / "0.output"
    key, kept = node / file, node / F.kept_reduction_key(f"x/y/{file}").split("/", 2)[2]
    good = open_store(store).reductions["0.output"]
    good_mean, good_var = good["mean"].clone(), good["var"].clone()
    committed = key.read_bytes()
    kept.write_bytes(committed)
    outside = tmp_path / "outside"
    outside.write_bytes(committed)  # (what a reader that followed the link would take for the committed file)
    _damage(key, how, outside)
    rel = f"reductions/0.output/{file}"

    s = open_store(store)
    assert torch.equal(s.reductions["0.output"]["mean"], good_mean)
    assert torch.equal(s.reductions["0.output"]["var"], good_var)
    problems = s.verify()
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"hook point '0.output': reduction 'mean': file {rel!r} is {_KIND[how]}")
    assert f"kept as 'reductions/0.output/{kept.name}'" in problems[0]
    assert ("remove that folder" in problems[0]) == (how == "folder")
    assert (f"{str(outside)!r}, outside the store" in problems[0]) == (how == "link outside")

    s.save(tmp_path / "copy.zarr")  # (the copy holds the committed bytes at the key)
    copy = open_store(tmp_path / "copy.zarr")
    assert copy.verify() == [] and (tmp_path / "copy.zarr" / rel).read_bytes() == committed
    assert torch.equal(copy.reductions["0.output"]["mean"], good_mean)
    assert not (tmp_path / "copy.zarr" / rel / "f").exists()

    model, xs = _model(), _batches(4, rows=5)
    if how == "folder":
        with pytest.raises(StoreError, match=rf"{re.escape(repr(rel))} is a folder.*{re.escape(kept.name)}.*remove that "
                                             r"folder.*Nothing of the store was deleted or written"):
            _run(model, store, xs[2:], ["mean", "var"], resume=True)
        assert kept.read_bytes() == committed and (key / "f").read_bytes() == b"not the chunk"
        s = open_store(store)
        assert s.status == "complete" and s.n_rows("0.output") == 10
        assert torch.equal(s.reductions["0.output"]["mean"], good_mean)
        (key / "f").unlink()
        key.rmdir()
    _run(model, store, xs[2:], ["mean", "var"], resume=True)
    s = open_store(store)
    assert s.status == "complete" and s.n_rows("0.output") == 20 and s.verify() == []
    assert key.is_file() and not key.is_symlink() and not list(store.rglob("*.committed.tmp"))
    assert outside.read_bytes() == committed  # (replaced the link, never wrote through it)
    torch.testing.assert_close(s.reductions["0.output"]["mean"], _ref_rows(model, xs).mean(0))
    torch.testing.assert_close(s.reductions["0.output"]["var"], _ref_rows(model, xs).var(0, correction=0))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kept_copy", ["none", "other bytes"])
@pytest.mark.parametrize("how", _DAMAGE)
def test_a_reduction_file_that_is_no_regular_file_without_a_good_kept_copy_is_refused_naming_it(store, tmp_path, how,
                                                                                               kept_copy):
    """Without a kept copy of the committed bytes, a key's file that is a folder, a FIFO or a
    symlink leaving the store is refused by name (never waited on, never followed: the file
    outside holds the committed bytes, and is not read), and verify lists it."""
    node = store / "reductions" / "0.output"
    key, kept = node / "mean" / "c" / "0", node / KEPT
    committed = key.read_bytes()
    if kept_copy == "other bytes":
        kept.write_bytes(b"\0" * len(committed))
    outside = tmp_path / "outside"
    outside.write_bytes(committed)
    _damage(key, how, outside)
    s = open_store(store)
    said = {"folder": "must be a regular file, got a directory", "fifo": "must be a regular file, got a FIFO",
            "link outside": f"resolves to {str(outside)!r}, outside the store"}[how]
    with pytest.raises(StoreCorruptError, match=re.escape(f"'reductions/0.output/mean/c/0' {said}") +
                       r".*restore the store from an intact copy or capture it again"):
        s.reductions["0.output"]["mean"]
    problems = s.verify()
    assert len(problems) == 1 and f"'reductions/0.output/mean/c/0' {said}" in problems[0], problems
    assert outside.read_bytes() == committed


def test_a_resume_refuses_a_folder_at_a_committed_reduction_key_without_a_kept_copy_before_it_captures(store):
    """A folder where the root lists a reduction result (no kept copy of it) failed the resume
    at its close, after the whole capture, leaving the store incomplete. Now the resume refuses
    at its start, touching nothing; with the folder moved away it resumes, and the reduction
    continues from its committed state (equal to a reference over every row)."""
    key = store / "reductions" / "0.output" / "mean" / "c" / "0"
    key.unlink()
    key.mkdir()
    (key / "f").write_text("x")
    with pytest.raises(StoreError, match=r"'reductions/0.output/mean/c/0' is a folder, where the root lists a committed "
                                         r"reduction file .* move that folder away, then resume again\. Nothing of the "
                                         r"store was deleted or written"):
        _run(_model(), store, _batches(4, rows=5)[2:], ["mean", "var"], resume=True)
    s = open_store(store)
    assert s.status == "complete" and s.n_rows("0.output") == 10 and (key / "f").read_text() == "x"
    (key / "f").unlink()
    key.rmdir()
    _run(_model(), store, _batches(4, rows=5)[2:], ["mean", "var"], resume=True)
    s = open_store(store)
    ref = _ref_rows(_model(), _batches(4, rows=5)).double()
    assert s.status == "complete" and s.n_rows("0.output") == 20
    assert abs(s.reductions["0.output"]["mean"] - ref.mean(0)).max() < 1e-12
    assert s.verify() == []


def _store_files(path: Path) -> dict[str, bytes]:
    """Every file of the store (links not followed, the writer lock left out) with its bytes."""
    out = {}
    for dirpath, _, files in os.walk(path):
        for name in files:
            p = Path(dirpath) / name
            if name != ".activationscope-writer.lock":
                out[str(p.relative_to(path))] = os.readlink(p) if p.is_symlink() else p.read_bytes()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("file, kept_copy", [
    ("mean/c/0", "none"), ("mean/c/0", "other bytes"), ("mean.state.mean/c/0", "none"),
    ("mean.state.mean/c/0", "other bytes"),
    ("mean/zarr.json", "none"),  # (a kept document, which has no crc32c, goes back over the link)
])
def test_a_resume_refuses_a_link_leaving_the_store_at_a_committed_reduction_key_before_it_captures(store, tmp_path,
                                                                                                 file, kept_copy):
    """A symlink leaving the store where the root lists a committed reduction file, with no
    kept copy of it that a resume puts back, failed the resume at its close (which keeps and
    writes every reduction file again), after the whole capture, leaving the store incomplete.
    Now the resume refuses at its start, naming the key and the fix, every file of the store as
    found and the file outside untouched; with the link replaced by a copy of its file it
    resumes, and the reduction continues from its committed state."""
    import torch

    node = store / "reductions" / "0.output"
    key = node / file
    rel = f"reductions/0.output/{file}"
    committed = key.read_bytes()
    if kept_copy == "other bytes":
        (node / F.kept_reduction_key(rel).split("/", 2)[2]).write_bytes(b"\0" * len(committed))
    outside = tmp_path / "outside"
    outside.write_bytes(committed)
    key.unlink()
    os.symlink(outside, key)
    before = _store_files(store)
    model, xs = _model(), _batches(4, rows=5)
    with pytest.raises(StoreError, match=rf"{re.escape(repr(rel))} is a symbolic link to {re.escape(repr(str(outside)))}, "
                                         r"outside the store, where the root lists a committed reduction file .*"
                                         r"replace the link with a copy of the file it points to .*then resume again\. "
                                         r"Nothing of the store was deleted or written"):
        _run(model, store, xs[2:], ["mean", "var"], resume=True)
    assert _store_files(store) == before and outside.read_bytes() == committed
    s = open_store(store)
    assert s.status == "complete" and s.n_rows("0.output") == 10
    key.unlink()
    key.write_bytes(outside.read_bytes())
    _run(model, store, xs[2:], ["mean", "var"], resume=True)
    s = open_store(store)
    assert s.status == "complete" and s.n_rows("0.output") == 20 and s.verify() == []
    torch.testing.assert_close(s.reductions["0.output"]["mean"], _ref_rows(model, xs).mean(0))
    torch.testing.assert_close(s.reductions["0.output"]["var"], _ref_rows(model, xs).var(0, correction=0))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kept_copy", ["none", "committed bytes"])
@pytest.mark.parametrize("linked", ["reductions/0.output/mean/c", "reductions/0.output", "reductions"])
def test_a_resume_refuses_a_committed_reduction_key_reached_through_a_linked_folder_leaving_the_store(store, tmp_path,
                                                                                                   linked, kept_copy):
    """A folder on the way to a committed reduction file that is a symlink leaving the store:
    verify named it, but a resume failed at its close (no kept copy: after the whole capture)
    or, with a kept copy to put back, with a general "settling the kept reduction file ...
    failed". Now the resume refuses at its start naming the key, the linked folder and the fix,
    every file as found; with the link replaced by a copy of its folder it resumes."""
    import shutil

    import torch

    rel = "reductions/0.output/mean/c/0"
    committed = (store / rel).read_bytes()
    if kept_copy == "committed bytes":  # (the key's file then differs: the kept one would go back)
        (store / F.kept_reduction_key(rel)).write_bytes(committed)
        (store / rel).write_bytes(b"\0" * len(committed))
    outside = tmp_path / "outside"
    shutil.copytree(store / linked, outside)
    shutil.rmtree(store / linked)
    os.symlink(outside, store / linked)
    assert any(str(outside) in p for p in open_store(store).verify())
    before, outside_before = _store_files(store), _store_files(outside)
    model, xs = _model(), _batches(4, rows=5)
    with pytest.raises(StoreError, match=rf"'reductions/0\.output/[^']+' is reached through {re.escape(repr(linked))}, a "
                                         rf"symbolic link to {re.escape(repr(str(outside)))}, outside the store; .*"
                                         r"replace the link with a copy of the folder it points to .*then resume again\. "
                                         r"Nothing of the store was deleted or written"):
        _run(model, store, xs[2:], ["mean", "var"], resume=True)
    assert _store_files(store) == before and _store_files(outside) == outside_before
    (store / linked).unlink()
    shutil.copytree(outside, store / linked)
    _run(model, store, xs[2:], ["mean", "var"], resume=True)
    s = open_store(store)
    assert s.status == "complete" and s.n_rows("0.output") == 20 and s.verify() == []
    torch.testing.assert_close(s.reductions["0.output"]["mean"], _ref_rows(model, xs).mean(0))
