"""``overwrite=True`` replaces a store only once the new one has committed: a capture that
fails before its first commit leaves the old store in place, byte for byte (FORMAT.md §7)."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch

import activationscope as acs
from activationscope.store import StoreWriter, open_store

from hostile import HP, FailsAt, make_store, overwrite_capture

LOCK = ".activationscope-writer.lock"


def _files(p: Path) -> dict[str, bytes]:
    return {str(q.relative_to(p)): q.read_bytes() for q in sorted(p.rglob("*")) if q.is_file() and q.name != LOCK}


def test_overwrite_that_fails_on_its_first_batch_keeps_the_old_store(tmp_path):
    path = tmp_path / "s.zarr"
    data = make_store(path, n_rows=96)
    before = _files(path)
    with pytest.raises(RuntimeError, match="forward 0 fails"):
        overwrite_capture(path, FailsAt(0), 3)
    assert _files(path) == before  # byte-identical, nothing of the new capture left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.zarr"]  # no folder left aside
    s = open_store(path)
    assert torch.equal(s[HP], data) and s.hook_points == [HP] and s.verify() == []


def test_overwrite_that_fails_after_a_whole_forward_commits_it(tmp_path):
    """Forward 0 captured, forward 1 raises: the capture commits forward 0 (status
    incomplete, resumable), so the new store has committed and the old one is gone."""
    path = tmp_path / "s.zarr"
    make_store(path, n_rows=96)
    with pytest.raises(RuntimeError, match="forward 1 fails"):
        overwrite_capture(path, FailsAt(1), 3)
    s = open_store(path)
    assert s.hook_points == ["lin.output"] and s.n_samples == 8 and s.status == "incomplete"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.zarr"]


def test_overwrite_that_commits_replaces_the_old_store(tmp_path):
    path = tmp_path / "s.zarr"
    make_store(path, n_rows=96)
    model = FailsAt(-1)
    overwrite_capture(path, model, 2)
    s = open_store(path)
    assert s.hook_points == ["lin.output"] and s.n_samples == 16 and s.status == "complete"
    assert not (path / "acts" / HP).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.zarr"]


def test_writer_abort_before_and_after_the_first_commit(tmp_path):
    path = tmp_path / "s.zarr"
    make_store(path, n_rows=96)
    before = _files(path)
    rows = torch.randn(8, 3)
    w = StoreWriter(path, overwrite=True)
    assert not (path / "zarr.json").read_bytes() == before["zarr.json"]  # the new store's root meanwhile
    a = w.open_array("x", (3,), torch.float32, "sample")
    a.append(rows)
    w.add_batch(8)
    w.abort(RuntimeError("stop"))  # nothing committed: the old store comes back
    assert _files(path) == before
    # committed once (close), then a second overwrite that fails: the first overwrite's store stays
    w = StoreWriter(path, overwrite=True)
    a = w.open_array("x", (3,), torch.float32, "sample")
    a.append(rows)
    w.add_batch(8)
    w.close()
    mid = _files(path)
    assert torch.equal(open_store(path)["x"], rows)
    w = StoreWriter(path, overwrite=True)
    w.abort(RuntimeError("stop"))
    assert _files(path) == mid
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.zarr"]


def test_writer_abort_puts_the_old_store_back_while_its_spare_files_are_being_made(tmp_path, monkeypatch):
    # the writer's background thread making the spare files of its next commit's documents went on
    # as the abort of an overwrite=True that committed no forward removed the new store's files to
    # put the old store back: a spare file made in a folder being removed made that removal fail
    # (directory not empty), and the old store stayed in the folder aside, to be moved back by hand
    import os
    import threading

    from activationscope.store import _backend as B

    path = tmp_path / "s.zarr"
    make_store(path, n_rows=96)
    before = _files(path)
    go, made = threading.Event(), []
    temp_name, release, rmdir = B.LocalBackend._temp_name, B.LocalBackend.release, os.rmdir

    def held_name(p):  # (the spare file of a document of the new array x: made once go is set)
        tmp = temp_name(p)
        if threading.current_thread().name == "activationscope-reserve" and p.parent.name == "x":
            go.wait(30)
            made.append(tmp)
        return tmp

    def releasing(self):  # (spare files given up: the held one goes on, to be removed by it)
        go.set()
        release(self)

    def removing(name, *args, **kwargs):  # (the folder of x removed: its spare file is made first)
        if os.path.basename(name) == "x" and not go.is_set():
            go.set()
            for _ in range(500):
                if made and os.path.exists(made[0]):
                    break
                threading.Event().wait(0.01)
        return rmdir(name, *args, **kwargs)

    monkeypatch.setattr(B.LocalBackend, "_temp_name", staticmethod(held_name))
    monkeypatch.setattr(B.LocalBackend, "release", releasing)
    monkeypatch.setattr(os, "rmdir", removing)
    w = StoreWriter(path, overwrite=True, commit_interval=0)
    w.open_array("x", (3,), torch.float32, "sample").append(torch.randn(8, 3))
    w.add_batch(8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # (no "putting the old store back ... failed")
        w.abort(RuntimeError("stop"))
    assert w.put_back
    assert _files(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.zarr"]


def test_writer_that_fails_while_opening_puts_the_old_store_back(tmp_path, monkeypatch):
    path = tmp_path / "s.zarr"
    make_store(path, n_rows=96)
    before = _files(path)

    def boom(self, *a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(StoreWriter, "_setup", boom)
    with pytest.raises(OSError, match="disk full"):
        StoreWriter(path, overwrite=True)
    assert _files(path) == before


@pytest.mark.parametrize("foreign", ["NOTES.txt", "index.html", "mine/f.txt"])
def test_overwrite_of_a_store_holding_other_files_is_refused_and_nothing_changes(tmp_path, foreign):
    """Files that are not the store's at its root (notes, a report written there, a folder of
    one's own) were deleted with the old store: overwrite now refuses, naming them."""
    path = tmp_path / "s.zarr"
    data = make_store(path, n_rows=96)
    (path / foreign).parent.mkdir(parents=True, exist_ok=True)
    (path / foreign).write_text("mine")
    before = _files(path)
    with pytest.raises(acs.errors.StoreExistsError) as e:
        overwrite_capture(path, FailsAt(99), 2)
    msg = str(e.value)
    assert foreign.split("/")[0] in msg and "not the store's" in msg and "move them" in msg
    assert isinstance(e.value, FileExistsError)
    assert _files(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.zarr"]
    assert torch.equal(open_store(path)[HP], data)
    top = path / foreign.split("/")[0]
    top.unlink() if top.is_file() else shutil.rmtree(top)
    overwrite_capture(path, FailsAt(99), 2)  # the store alone: replaced
    assert open_store(path).hook_points == ["lin.output"]


def test_overwrite_replaces_a_store_whose_folder_holds_only_file_manager_clutter(tmp_path):
    path = tmp_path / "s.zarr"
    make_store(path, n_rows=96)
    for name in (".DS_Store", "._zarr.json", "Thumbs.db"):
        (path / name).write_bytes(b"\0")
    overwrite_capture(path, FailsAt(99), 2)
    assert open_store(path).hook_points == ["lin.output"]
    assert not (path / ".DS_Store").exists()


def test_copy_store_with_overwrite_replaces_only_a_store(tmp_path):
    """copy_store(..., overwrite=True) cleared any folder that was not empty: a folder of one's
    own files (a project, a home directory) was deleted; it now replaces stores only, as
    StoreWriter(overwrite=True) does, and a store holding other entries is refused too."""
    from activationscope.errors import StoreExistsError
    from activationscope.store import copy_store

    src = tmp_path / "src.zarr"
    data = make_store(src, n_rows=96)
    mine = tmp_path / "project"
    mine.mkdir()
    (mine / "thesis.tex").write_text("important")
    with pytest.raises(StoreExistsError, match=r"holds no Zarr store.*overwrite=True only replaces stores"):
        copy_store(open_store(src), mine, overwrite=True)
    assert sorted(p.name for p in mine.iterdir()) == ["thesis.tex"]

    old = tmp_path / "old.zarr"
    make_store(old, n_rows=32)
    (old / "NOTES.txt").write_text("mine")
    before = _files(old)
    with pytest.raises(StoreExistsError, match=r"not the store's \('NOTES.txt'\)"):
        copy_store(open_store(src), old, overwrite=True)
    assert _files(old) == before

    (old / "NOTES.txt").unlink()
    copy_store(open_store(src), old, overwrite=True)  # a store alone: replaced
    assert torch.equal(open_store(old)[HP], data)


def test_copy_store_with_overwrite_into_memory_replaces_only_a_store(tmp_path):
    import fsspec

    from activationscope.errors import StoreExistsError
    from activationscope.store import copy_store

    src = tmp_path / "src.zarr"
    data = make_store(src, n_rows=96)
    fs = fsspec.filesystem("memory")
    fs.pipe("/mine-copy/keep.txt", b"x")
    with pytest.raises(StoreExistsError, match="holds no Zarr store"):
        copy_store(open_store(src), "memory://mine-copy", overwrite=True)
    assert fs.cat("/mine-copy/keep.txt") == b"x"
    copy_store(open_store(src), "memory://copied", overwrite=False)
    copy_store(open_store(src), "memory://copied", overwrite=True)
    assert torch.equal(open_store("memory://copied")[HP], data)


def test_overwrite_of_a_memory_store_holding_other_objects_is_refused(tmp_path):
    import fsspec

    from activationscope.errors import StoreExistsError
    from activationscope.store import copy_store

    src = tmp_path / "src.zarr"
    data = make_store(src, n_rows=96)
    copy_store(open_store(src), "memory://with-notes")
    fs = fsspec.filesystem("memory")
    fs.pipe("/with-notes/notes/today.txt", b"mine")
    for replace in (lambda: copy_store(open_store(src), "memory://with-notes", overwrite=True),
                    lambda: overwrite_capture("memory://with-notes", FailsAt(99), 1)):
        with pytest.raises(StoreExistsError, match=r"not the store's \('notes'\)"):
            replace()
        assert fs.cat("/with-notes/notes/today.txt") == b"mine"
        assert torch.equal(open_store("memory://with-notes")[HP], data)


@pytest.mark.parametrize("overwrite", ["False", "no", 1, None])
def test_copy_store_overwrite_must_be_a_bool(tmp_path, overwrite):
    """copy_store(..., overwrite="False") (a value read from a config file) was a true string
    and replaced the store there; it is refused, naming overwrite, and nothing changes."""
    from activationscope.errors import ArgumentTypeError
    from activationscope.store import copy_store

    src = tmp_path / "src.zarr"
    make_store(src, n_rows=96)
    old = tmp_path / "old.zarr"
    make_store(old, n_rows=32)
    before = _files(old)
    with pytest.raises(ArgumentTypeError, match=rf"overwrite must be True or False, got {overwrite!r}"):
        copy_store(open_store(src), old, overwrite=overwrite)
    with pytest.raises(ArgumentTypeError, match=r"overwrite must be True or False"):
        open_store(src).save(old, overwrite=overwrite)
    assert _files(old) == before and open_store(old).n_rows(HP) == 32


def test_copy_store_of_a_source_that_is_no_store_changes_nothing(tmp_path):
    """copy_store of a mistyped source path (nothing there), an empty folder, an empty
    memory:// prefix or a store whose overwrite was killed after it moved the root document
    aside wrote an empty incomplete store at the target, deleting the store there with
    overwrite=True; it is refused naming the source, and the target is left as it was."""
    import os

    from activationscope.errors import StoreError
    from activationscope.store import copy_store

    old = tmp_path / "old.zarr"
    data = make_store(old, n_rows=32)
    before = _files(old)
    (tmp_path / "empty").mkdir()
    split = tmp_path / "s.zarr"
    make_store(split, n_rows=16)
    aside = tmp_path / ".s.zarr.replaced-0123abcd"  # an overwrite killed after its first rename
    aside.mkdir()
    os.rename(split / "zarr.json", aside / "zarr.json")
    for source, says in ((tmp_path / "typo.zarr", "check the path"), (tmp_path / "empty", "check the path"),
                         ("memory://nothing-here", "check the path"),
                         (split, f"moved the store's root document (zarr.json) into {str(aside)!r}")):
        for target in (old, tmp_path / "new.zarr"):
            with pytest.raises(StoreError, match="of copy_store must be a store, got a path with no root document") as e:
                copy_store(source, target, overwrite=True)
            msg = str(e.value)
            assert says in msg and f"the target {str(target)!r} was not changed" in msg, msg
        assert _files(old) == before and not (tmp_path / "new.zarr").exists()
    assert torch.equal(open_store(old)[HP], data)
