"""``overwrite=True`` on a local store moves the old store's entries into
``.<name>.replaced-<hex>`` one rename at a time (root document first) and moves them back
(root document last) when the new store commits nothing. A process killed between two of
those renames leaves the store split between the two folders; running the capture again with
``overwrite=True`` finishes the move and settles that folder as its own: deleted once the new
store commits, else the old store back whole at the path (FORMAT.md section 7). Readers, a
resume and ``copy_store`` name the folder and the ways out; anything ambiguous is refused,
changing nothing."""

from __future__ import annotations

import os
import shlex
import shutil
import threading
import warnings
from pathlib import Path

import pytest
import torch

from activationscope.errors import StoreError, StoreExistsError
from activationscope.store import StoreWriter, copy_store, open_store

from acs_testing import hold_aside_delete
from hostile import FEATURE, HP, FailsAt, make_store, overwrite_capture, run_python

LOCK = ".activationscope-writer.lock"
ENTRIES = ["acts", "reductions", "rows", "zarr.json"]  # what make_store's folder holds (the lock aside)

# Kills the process (os._exit: no finally, no atexit) at the rename number argv[3] (0-based) of
# the old store's entries: into the aside folder ("aside": StoreWriter(overwrite=True) moving the
# old store), or out of it ("restore": the new store aborted before committing, the old one put
# back). "aside-done": killed right after the whole move, before the new store's first root.
# "clear": killed while the new store's entries are removed to put the old one back.
# "first-root": killed once the new store is open (its first root written), before its first commit.
_CHILD = r"""
import os, shutil, sys
from activationscope.store import StoreWriter
from activationscope.store import _backend as B

path, phase, k = sys.argv[1], sys.argv[2], int(sys.argv[3])
rename, n = os.rename, [0]

def dying_rename(src, dst, *args, **kwargs):
    s, d = os.path.basename(os.path.dirname(os.fspath(src))), os.path.basename(os.path.dirname(os.fspath(dst)))
    if ".replaced-" in (d if phase == "aside" else s if phase == "restore" else ""):
        if n[0] == k:
            os._exit(9)
        n[0] += 1
    return rename(src, dst, *args, **kwargs)

os.rename = dying_rename
if phase == "aside-done":
    move = B.LocalBackend.move_aside
    def move_then_die(self):
        move(self)
        os._exit(9)
    B.LocalBackend.move_aside = move_then_die
if phase == "clear":
    B.shutil.rmtree = lambda *a, **k: os._exit(9)
w = StoreWriter(path, overwrite=True)
if phase == "first-root":  # the new store's first root written, no forward committed
    os._exit(9)
w.abort(RuntimeError("stop"))  # (restore, clear: the new store committed nothing: the old one goes back)
os._exit(0)
"""


def _files(p: Path) -> dict[str, bytes]:
    return {str(q.relative_to(p)): q.read_bytes() for q in sorted(p.rglob("*")) if q.is_file() and q.name != LOCK}


def _everything(top: Path) -> dict[str, bytes | None]:
    """Every entry under ``top`` (folders and the writer lock as None): 'nothing changed'."""
    return {str(q.relative_to(top)): (q.read_bytes() if q.is_file() and q.name != LOCK else None)
            for q in sorted(top.rglob("*"))}


def _asides(top: Path) -> list[Path]:
    return sorted(p for p in top.iterdir() if p.name.startswith(".s.zarr.replaced-"))


def _assert_split(path: Path, aside: Path, n_aside: int, root_aside: bool) -> None:
    here = {p.name for p in path.iterdir() if p.name != LOCK}
    there = {p.name for p in aside.iterdir()}
    assert sorted(here | there) == ENTRIES and not here & there and len(there) == n_aside
    assert ("zarr.json" in there) == root_aside


def _kill(path: Path, phase: str, k: int) -> None:
    done = run_python(_CHILD, str(path), phase, str(k))
    assert done.returncode == 9, done.stderr


def _rerun(path: Path, outcome: str, before: dict[str, bytes], data: torch.Tensor) -> None:
    """Run the capture again with overwrite=True: it commits (the new store, the old one gone)
    or fails in its first forward (the old store back, byte for byte); no folder left aside."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (the folder it finishes is its own: no warning about it)
        if outcome == "commits":
            overwrite_capture(path, FailsAt(-1), 2)
        else:
            with pytest.raises(RuntimeError, match="forward 0 fails"):
                overwrite_capture(path, FailsAt(0), 3)
    assert sorted(p.name for p in path.parent.iterdir()) == ["s.zarr"]  # no folder aside
    s = open_store(path)
    assert s.verify() == []
    if outcome == "commits":
        assert s.hook_points == ["lin.output"] and s.n_samples == 16 and s.status == "complete"
        assert s["lin.output"].shape == (16, 4) and not (path / "acts" / HP).exists()
    else:
        assert _files(path) == before
        assert torch.equal(s[HP], data) and s.hook_points == [HP]


def _killed_moving_aside(tmp_path, k):
    """A 96-row store at ``tmp_path / "s.zarr"`` whose overwrite was killed after moving ``k``
    entries aside: ``(path, its rows, its files before, the folder aside)``."""
    path = tmp_path / "s.zarr"
    data = make_store(path, n_rows=96)
    before = _files(path)
    _kill(path, "aside", k)
    (aside,) = _asides(tmp_path)
    return path, data, before, aside


@pytest.mark.parametrize("outcome", ["commits", "fails"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_overwrite_killed_while_moving_the_old_store_aside_is_finished_by_a_rerun(tmp_path, k, outcome):
    path, data, before, aside = _killed_moving_aside(tmp_path, k)
    # the interrupted state: the root and k - 1 more entries aside (in directory order), the rest at the path
    _assert_split(path, aside, n_aside=k, root_aside=True)
    _rerun(path, outcome, before, data)


@pytest.mark.parametrize("outcome", ["commits", "fails"])
@pytest.mark.parametrize("phase, k", [("aside", 0), ("aside-done", 0)])
def test_overwrite_killed_before_or_after_every_rename_is_settled_by_a_rerun(tmp_path, phase, k, outcome):
    """Killed before the first rename (an empty folder aside, the store whole at the path) or
    after the last one (the path empty but for the lock, the whole store aside)."""
    path = tmp_path / "s.zarr"
    data = make_store(path, n_rows=96)
    before = _files(path)
    _kill(path, phase, k)
    (aside,) = _asides(tmp_path)
    assert sorted(p.name for p in aside.iterdir()) == ([] if phase == "aside" else ENTRIES)
    _rerun(path, outcome, before, data)


@pytest.mark.parametrize("outcome", ["commits", "fails"])
@pytest.mark.parametrize("k", [0, 1, 3])
def test_overwrite_killed_while_putting_the_old_store_back_is_finished_by_a_rerun(tmp_path, k, outcome):
    path = tmp_path / "s.zarr"
    data = make_store(path, n_rows=96)
    before = _files(path)
    _kill(path, "restore", k)
    (aside,) = _asides(tmp_path)
    # moved back root last: the new store gone, k old entries back
    _assert_split(path, aside, n_aside=len(ENTRIES) - k, root_aside=True)
    _rerun(path, outcome, before, data)


@pytest.mark.parametrize("k", [1, 3])
def test_a_reader_a_resume_and_a_copy_name_the_folder_of_an_interrupted_overwrite(tmp_path, k):
    path, data, before, aside = _killed_moving_aside(tmp_path, k)
    found = _everything(tmp_path)
    fix = rf"moved the store's root document \(zarr\.json\) into '{aside}'.*overwrite=True.*zarr\.json last"
    with pytest.raises(StoreError, match=rf"no store at '{path}': it holds no root document.*{fix}"):
        open_store(path)
    with pytest.raises(StoreError, match=rf"resume=True needs a store to continue.*{fix}.*nothing was changed"):
        StoreWriter(path, resume=True)
    # a new capture without either flag: not "remove it" (the path holds part of the old store)
    with pytest.raises(StoreExistsError, match=rf"'{path}' .*holds no root document \(zarr\.json\): an overwrite=True {fix}.*nothing was "
                                               "changed") as e:
        StoreWriter(path)
    assert "remove it" not in str(e.value)
    with pytest.raises(StoreError, match=rf"source '{path}' of copy_store must be a store.*{fix}"):
        copy_store(path, tmp_path.parent / f"{tmp_path.name}-copy.zarr")
    assert not (tmp_path.parent / f"{tmp_path.name}-copy.zarr").exists()
    src = tmp_path.parent / f"{tmp_path.name}-src.zarr"
    make_store(src, n_rows=32)
    with pytest.raises(StoreExistsError, match=rf"{fix}.*then copy again; nothing was changed"):
        copy_store(open_store(src), path, overwrite=True)
    from activationscope.store.ranks import prepare_root

    for opts in ({"overwrite": True}, {"resume": True}):  # a multi-rank capture's root
        with pytest.raises(StoreExistsError, match=rf"{fix}.*then run this capture again; nothing was changed"):
            prepare_root(str(path), world_size=2, **opts)
    assert _everything(tmp_path) == found
    # following the second way out: the entries moved back by hand, zarr.json last
    for p in sorted(aside.iterdir(), key=lambda p: p.name == "zarr.json"):
        os.rename(p, path / p.name)
    aside.rmdir()
    assert _files(path) == before and torch.equal(open_store(path)[HP], data)


def _split(path: Path, aside: Path, moved: list[str]) -> None:
    """The state of an overwrite killed after moving ``moved`` (root first) into ``aside``."""
    aside.mkdir()
    for name in moved:
        os.rename(path / name, aside / name)


def test_two_folders_holding_a_moved_root_are_refused_naming_both(tmp_path):
    path = tmp_path / "s.zarr"
    make_store(path, n_rows=96)
    other = tmp_path / "t.zarr"
    make_store(other, n_rows=32)
    _split(path, tmp_path / ".s.zarr.replaced-0000aaaa", ["zarr.json", "acts"])
    shutil.move(other, tmp_path / ".s.zarr.replaced-0000bbbb")
    found = _everything(tmp_path)
    with pytest.raises(StoreExistsError, match=r"holds no root document.*'reductions', 'rows'.*2 folders.*"
                                               r"\.s\.zarr\.replaced-0000aaaa.*\.s\.zarr\.replaced-0000bbbb.*"
                                               r"cannot be told; nothing was changed") as e:
        overwrite_capture(path, FailsAt(-1), 1)
    assert isinstance(e.value, FileExistsError)
    assert _everything(tmp_path) == found


def test_an_entry_that_is_not_a_store_s_is_refused(tmp_path):
    path = tmp_path / "s.zarr"
    make_store(path, n_rows=96)
    (path / "NOTES.txt").write_text("mine")
    _split(path, tmp_path / ".s.zarr.replaced-0000aaaa", ["zarr.json", "acts"])
    found = _everything(tmp_path)
    with pytest.raises(StoreExistsError, match=r"replaced-0000aaaa.*not a store's \('NOTES\.txt'\).*nothing was "
                                               r"changed\. Move them out"):
        overwrite_capture(path, FailsAt(-1), 1)
    assert _everything(tmp_path) == found


def test_a_name_at_the_path_and_in_the_folder_is_refused_and_the_advice_works(tmp_path):
    """Killed while it removed the new store (no root at the path, its 'acts' left there) to
    put the old one back: not the two halves of one move. Refused, naming both; following its
    advice (the old store verifies whole in the folder: remove the path's entries) a rerun
    settles it."""
    path = tmp_path / "s.zarr"
    data = make_store(path, n_rows=96)
    before = _files(path)
    _kill(path, "clear", 0)
    (aside,) = _asides(tmp_path)
    assert sorted(p.name for p in path.iterdir() if p.name != LOCK) == ["acts"]
    assert _files(aside) == before  # the whole old store
    found = _everything(tmp_path)
    with pytest.raises(StoreExistsError, match=rf"moved it into '{aside}', but both hold 'acts'.*nothing was changed\."
                                               rf" If open_store\('{aside}'\)\.verify\(\) reports no problem"):
        overwrite_capture(path, FailsAt(-1), 1)
    assert _everything(tmp_path) == found
    assert open_store(aside).verify() == []
    shutil.rmtree(path / "acts")
    _rerun(path, "fails", before, data)


def test_a_folder_aside_that_is_a_link_is_never_taken(tmp_path):
    path = tmp_path / "s.zarr"
    make_store(path, n_rows=96)
    elsewhere = tmp_path / "elsewhere"
    _split(path, elsewhere, ["zarr.json"])
    (tmp_path / ".s.zarr.replaced-0000aaaa").symlink_to(elsewhere, target_is_directory=True)
    found = _everything(tmp_path)
    with pytest.raises(StoreExistsError, match="holds no Zarr store"):
        overwrite_capture(path, FailsAt(-1), 1)
    assert _everything(tmp_path) == found


def test_an_empty_path_with_two_folders_aside_makes_a_new_store_and_keeps_both(tmp_path):
    """Nothing at the path to tell them apart, and nothing there to lose: a new store, both
    folders kept and named in a warning."""
    path = tmp_path / "s.zarr"
    make_store(path, n_rows=96)
    a, b = tmp_path / ".s.zarr.replaced-0000aaaa", tmp_path / ".s.zarr.replaced-0000bbbb"
    _split(path, a, ENTRIES)
    shutil.copytree(a, b)
    held = _files(a)
    with pytest.warns(RuntimeWarning, match=r"replaced-0000aaaa.*\(and 1 more\).*never settled"):
        overwrite_capture(path, FailsAt(-1), 2)
    assert open_store(path).n_samples == 16
    assert _files(a) == held and _files(b) == held


def test_a_failed_rename_while_finishing_the_move_changes_nothing(tmp_path, monkeypatch):
    from activationscope.store import _backend as B

    path = tmp_path / "s.zarr"
    data = make_store(path, n_rows=96)
    before = _files(path)
    aside = tmp_path / ".s.zarr.replaced-0000aaaa"
    _split(path, aside, ["zarr.json"])
    found = _everything(tmp_path)
    rename, n = os.rename, [0]

    def failing(src, dst):
        n[0] += 1
        if n[0] == 2:
            raise OSError(28, "No space left on device")
        rename(src, dst)

    monkeypatch.setattr(B.os, "rename", failing)
    with pytest.raises(StoreError, match=rf"finishing the move of the old store '{path}' into '{aside}' failed: "
                                         r"No space left on device; nothing was changed"):
        overwrite_capture(path, FailsAt(-1), 1)
    monkeypatch.undo()
    assert n[0] == 3 and _everything(tmp_path) == found  # (one moved, one failed, the first moved back)
    _rerun(path, "fails", before, data)


def test_the_old_store_is_deleted_root_first_and_its_remains_are_named(tmp_path, monkeypatch):
    """Once the new store commits, the folder aside goes, its root document first: a deletion
    cut short (the process killed) leaves no store there. Two such folders (which cannot be told
    apart): the next overwrite or resume warns that what is left may be deleted (not that it
    holds a store to move back), and keeps them."""
    from activationscope.store import writer as W

    path = tmp_path / "s.zarr"
    make_store(path, n_rows=96)
    seen = []
    rmtree = shutil.rmtree

    def recording(p, *args, **kwargs):
        if ".replaced-" in Path(p).name:
            seen.append(sorted(q.name for q in Path(p).iterdir()))
        return rmtree(p, *args, **kwargs)

    monkeypatch.setattr(W.shutil, "rmtree", recording)
    overwrite_capture(path, FailsAt(-1), 1)
    monkeypatch.undo()
    assert seen == [["acts", "reductions", "rows"]] and _asides(tmp_path) == []
    left, other = tmp_path / ".s.zarr.replaced-0000aaaa", tmp_path / ".s.zarr.replaced-0000bbbb"
    for p in (left, other):  # as a deletion cut short leaves it
        (p / "acts").mkdir(parents=True)
        (p / "acts" / "zarr.json").write_text("{}")
    for opts in ({"resume": True}, {"overwrite": True}):
        with pytest.warns(RuntimeWarning, match=rf"'{left}' \(and 1 more\) holds what is left of a store.*root "
                                                r"document is gone.*delete it") as w:
            StoreWriter(path, **opts).close()
        assert not any("never settled" in str(x.message) for x in w)
    for p in (left, other):
        assert sorted(q.name for q in p.iterdir()) == ["acts"]  # (a warning only)


@pytest.mark.parametrize("fail_at", [1, 2, 3])
def test_a_failed_rename_while_moving_the_old_store_aside_keeps_every_entry(tmp_path, monkeypatch, fail_at):
    """The rename number ``fail_at`` (0-based, root document first) of the old store's entries
    into the folder aside fails: the entries moved go back, and the ones still at the path, the
    old store's, stay (none is removed as if it were the new store's)."""
    from activationscope.store import _backend as B

    path = tmp_path / "s.zarr"
    data = make_store(path, n_rows=96)
    before = _files(path)
    rename, n = os.rename, [0]

    def failing(src, dst):
        if ".replaced-" in Path(dst).parent.name:
            if n[0] == fail_at:
                raise OSError(13, "Permission denied")
            n[0] += 1
        rename(src, dst)

    monkeypatch.setattr(B.os, "rename", failing)
    with pytest.raises(StoreError, match=rf"moving the old store '{path}' aside to '.*' failed: Permission denied; "
                                         r"nothing was changed"):
        StoreWriter(path, overwrite=True)
    monkeypatch.undo()
    assert _asides(tmp_path) == [] and _files(path) == before
    s = open_store(path)
    assert s.verify() == [] and torch.equal(s[HP], data)


@pytest.mark.parametrize("k", [1, 3])
def test_a_new_store_on_the_path_of_an_interrupted_overwrite_names_the_folder(tmp_path, k):
    """``StoreWriter(path)`` (neither overwrite nor resume) on the half of a store a killed
    overwrite left at the path names the folder aside and both ways out; before, it called the
    path a folder that holds no store, to choose another path or remove (half the old store)."""
    path, data, before, aside = _killed_moving_aside(tmp_path, k)
    found = _everything(tmp_path)
    with pytest.raises(StoreExistsError, match=rf"'{path}' exists and is not empty but holds no root document "
                                               rf"\(zarr\.json\): an overwrite=True moved the store's root document "
                                               rf"\(zarr\.json\) into '{aside}'.*zarr\.json last.*nothing was changed"):
        StoreWriter(path)
    assert _everything(tmp_path) == found
    _rerun(path, "fails", before, data)


@pytest.mark.parametrize("phase, k", [("aside", 1), ("aside-done", 0)])
def test_the_capture_command_with_overwrite_finishes_an_interrupted_overwrite(tmp_path, monkeypatch, capsys, phase, k):
    """``activationscope capture --overwrite`` run again on a store a killed overwrite left split
    (or wholly aside) completes it, as docs/usage/cli.md says; without ``--overwrite`` it names
    the folder aside. Before, the command refused the path as a folder that is not a store."""
    import numpy as np

    from activationscope import cli

    (tmp_path / "kill_aside_models.py").write_text(
        "import torch\n"
        "def mlp():\n"
        "    torch.manual_seed(0)\n"
        f"    return torch.nn.Sequential(torch.nn.Linear({FEATURE}, 4))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    x = tmp_path / "x.npy"
    np.save(x, np.random.default_rng(0).standard_normal((12, FEATURE)).astype(np.float32))
    path = tmp_path / "s.zarr"
    make_store(path, n_rows=96)
    _kill(path, phase, k)
    (aside,) = _asides(tmp_path)
    found = _everything(tmp_path)
    command = ["capture", "--model", "kill_aside_models:mlp", "--data", str(x), "--out", str(path)]
    assert cli.main(command) == 1
    err = capsys.readouterr().err
    assert f"holds no root document (zarr.json): an --overwrite moved the store's root document (zarr.json) " \
           f"into '{aside}'" in err and "nothing was changed" in err, err
    assert "run the capture again with --overwrite (StoreWriter(..., overwrite=True) finishes the move" in err, err
    assert _everything(tmp_path) == found
    assert cli.main([*command, "--overwrite"]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".s.zarr")) == []  # no folder aside
    s = open_store(path)
    assert s.verify() == [] and s.status == "complete" and s.n_samples == 12
    assert s.hook_points == ["0.output"] and tuple(s["0.output"].shape) == (12, 4)  # (the old one: 96 x 8)


@pytest.mark.parametrize("outcome", ["commits", "fails"])
@pytest.mark.parametrize("cut", [None, "entries", "all"])
def test_overwrite_killed_before_the_new_store_s_first_commit_is_settled_by_a_rerun(tmp_path, outcome, cut):
    """Killed after the new store's first root, before its first commit: the old store is whole
    aside and a store of no row is at the path. A rerun removes that unstarted store and takes
    the old one back as its own: deleted once the new store commits, put back byte for byte if
    it commits nothing (before, the old store stayed aside, a warning at every later overwrite).
    ``cut``: the rerun that removes the unstarted store was itself killed, after its entries
    (its root still there) or after all of it (only the lock left)."""
    path = tmp_path / "s.zarr"
    data = make_store(path, n_rows=96)
    before = _files(path)
    _kill(path, "first-root", 0)
    (aside,) = _asides(tmp_path)
    assert sorted(p.name for p in aside.iterdir()) == ENTRIES
    unstarted = open_store(path)
    assert unstarted.status == "incomplete" and unstarted.n_samples == 0
    if cut is not None:  # (what a rerun killed while removing it leaves: its root goes last)
        for p in path.iterdir():
            if p.name not in (LOCK, "zarr.json"):
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        if cut == "all":
            (path / "zarr.json").unlink()
    _rerun(path, outcome, before, data)


def test_a_new_store_on_an_unstarted_store_names_the_old_store_aside_and_its_put_back_works(tmp_path):
    """Killed after the new store's first root, before its first commit, then a capture with
    neither flag: refused as any existing store ("pass overwrite=True ... or resume=True"),
    without a word of the old store whole in the folder aside (a resume then continued the
    unstarted store, the old one left aside). Now the refusal names that folder, changing
    nothing, and the put-back it gives leaves the old store at the path byte for byte."""
    path = tmp_path / "s.zarr"
    data = make_store(path, n_rows=96)
    before = _files(path)
    _kill(path, "first-root", 0)
    (aside,) = _asides(tmp_path)
    found = _everything(tmp_path)
    with pytest.raises(StoreExistsError, match=rf"'{path}' \(status 'incomplete'\), but it is the new store of an "
                                               rf"overwrite=True killed before its first commit .* still whole in "
                                               rf"'{aside}'; nothing was changed\. To put that store back.*"
                                               rf"StoreWriter\('{path}', overwrite=True\)\.abort\(\).*zarr\.json last.*"
                                               rf"To drop the old store, delete '{aside}'"):
        StoreWriter(path)
    assert _everything(tmp_path) == found
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        StoreWriter(path, overwrite=True).abort()  # (the put-back the message gives)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.zarr"] and _files(path) == before
    assert torch.equal(open_store(path)[HP], data)


def test_the_command_line_keeps_the_python_call_of_the_put_back_of_an_unstarted_store(tmp_path):
    # the command line spells the library's overwrite=True as --overwrite: in the refusal above
    # (`activationscope capture` with neither flag) the put-back it gives read
    # "StoreWriter('.../s.zarr', --overwrite).abort()", which is no Python
    from activationscope.cli import _cli_spelling

    path = tmp_path / "s.zarr"
    make_store(path, n_rows=96)
    _kill(path, "first-root", 0)
    with pytest.raises(StoreExistsError) as err:
        StoreWriter(path)
    line = _cli_spelling(str(err.value), "capture")
    assert f"StoreWriter({str(path)!r}, overwrite=True).abort()" in line, line
    assert "(or capture with --overwrite: it deletes that store" in line, line


def test_an_unstarted_store_is_not_removed_when_two_folders_aside_hold_a_store(tmp_path):
    """Which old store the unstarted one replaced cannot be told: it is moved aside as any store
    (nothing removed), and the folders are named in the warning as before."""
    path = tmp_path / "s.zarr"
    make_store(path, n_rows=96)
    _kill(path, "first-root", 0)
    (aside,) = _asides(tmp_path)
    shutil.copytree(aside, tmp_path / ".s.zarr.replaced-0000aaaa")
    with pytest.warns(RuntimeWarning, match=r"never settled"):
        overwrite_capture(path, FailsAt(-1), 2)
    assert len(_asides(tmp_path)) == 2 and open_store(path).n_samples == 16


def test_a_new_store_or_copy_on_the_empty_path_of_an_interrupted_overwrite_names_the_folder(tmp_path):
    """Killed after its last rename: the whole old store is in the folder aside and the path
    holds only the lock. A new store (neither flag), a copy onto the path (with or without
    overwrite) and a multi-rank capture's root name that folder, as FORMAT.md section 7 says;
    before, they made a new store there without a word, leaving the old one aside."""
    from activationscope.store.ranks import prepare_root

    path = tmp_path / "s.zarr"
    data = make_store(path, n_rows=96)
    before = _files(path)
    _kill(path, "aside-done", 0)
    (aside,) = _asides(tmp_path)
    assert [p.name for p in path.iterdir()] == [LOCK]
    found = _everything(tmp_path)
    fix = rf"moved the store's root document \(zarr\.json\) into '{aside}'.*holds none of its entries.*zarr\.json last"
    with pytest.raises(StoreExistsError, match=rf"'{path}' .*holds no root document \(zarr\.json\): an overwrite=True "
                                               rf"{fix}.*nothing was changed"):
        StoreWriter(path)
    src = tmp_path.parent / f"{tmp_path.name}-src.zarr"
    make_store(src, n_rows=32)
    for overwrite in (False, True):
        with pytest.raises(StoreExistsError, match=rf"{fix}.*then copy again; nothing was changed"):
            copy_store(open_store(src), path, overwrite=overwrite)
    for opts in ({}, {"overwrite": True}):
        with pytest.raises(StoreExistsError, match=rf"{fix}.*then run this capture again; nothing was changed"):
            prepare_root(str(path), world_size=2, **opts)
    assert _everything(tmp_path) == found
    _rerun(path, "fails", before, data)


def test_a_failed_rename_back_after_a_failed_move_aside_leaves_a_split_a_rerun_finishes(tmp_path, monkeypatch):
    """Moving the old store aside fails at its third entry, and moving its second entry back
    fails too: the root document stays in the folder with it (a split the next overwrite=True
    finishes, as the error says), not back at the path over a store missing that entry (read
    as damaged, its folder aside named as remains to delete, and not finished by a rerun)."""
    from activationscope.store import _backend as B

    path = tmp_path / "s.zarr"
    data = make_store(path, n_rows=96)
    before = _files(path)
    rename, n = os.rename, [0]

    def failing(src, dst):
        into, out = ".replaced-" in Path(dst).parent.name, ".replaced-" in Path(src).parent.name
        if into:
            if n[0] == 2:
                raise OSError(28, "No space left on device")
            n[0] += 1
        if out and Path(src).name != "zarr.json":
            raise OSError(13, "Permission denied")
        rename(src, dst)

    monkeypatch.setattr(B.os, "rename", failing)
    with pytest.raises(StoreError, match=r"failed: No space left on device; some of its entries could not be moved "
                                         r"back and are in that folder, with its root document: .*run again with "
                                         r"overwrite=True \(it finishes the move\)"):
        StoreWriter(path, overwrite=True)
    monkeypatch.undo()
    (aside,) = _asides(tmp_path)
    _assert_split(path, aside, n_aside=2, root_aside=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(StoreError, match="holds no root document"):
            open_store(path)
    _rerun(path, "fails", before, data)


def _overwrite_writer(path: Path) -> tuple[StoreWriter, torch.Tensor]:
    """``StoreWriter(path, overwrite=True)`` with one forward of 32 rows recorded (not committed)."""
    rows = torch.arange(32 * FEATURE, dtype=torch.float32).reshape(32, FEATURE)
    w = StoreWriter(path, overwrite=True, chunk_rows=16, shard_bytes=16 * FEATURE * 4)
    w.open_array("new.output", (FEATURE,), torch.float32, "sample").append(rows)
    w.add_batch(32)
    w._core.drain()  # (the writer thread is asynchronous: its shards durable, the forward is committable)
    return w, rows


def _old_store_not_deletable(path, monkeypatch) -> None:
    """A store of 96 rows at ``path``, and a writer module whose rmtree cannot delete the folder
    an overwrite moves it into (PermissionError; nothing with ignore_errors)."""
    from activationscope.store import writer as W

    make_store(path, n_rows=96)
    rmtree = shutil.rmtree

    def refused(p, *args, ignore_errors=False, **kwargs):
        if ".replaced-" not in Path(p).name:
            return rmtree(p, *args, ignore_errors=ignore_errors, **kwargs)
        if not ignore_errors:
            raise PermissionError(13, "Permission denied", str(Path(p) / "acts"))

    monkeypatch.setattr(W.shutil, "rmtree", refused)


def test_the_first_commit_does_not_wait_for_the_old_store_to_be_deleted(tmp_path, monkeypatch):
    """The old store is deleted off the committing thread: the first commit returns while that
    delete is held back (its root document already gone), the new store reads back meanwhile,
    and the close waits for the delete, leaving no folder aside. (Before, the commit deleted it
    itself: seconds of a capture's forwards over a store of thousands of shard files.)"""
    from activationscope.store import writer as W

    path = tmp_path / "s.zarr"
    make_store(path, n_rows=96)
    committed, closing, seen = threading.Event(), threading.Event(), []
    rmtree = shutil.rmtree

    def held(p, *args, **kwargs):
        if ".replaced-" in Path(p).name and not seen:  # (bounded waits: a commit that deletes it itself sees False)
            seen.append(committed.wait(10))
            seen.append(closing.wait(10))
        return rmtree(p, *args, **kwargs)

    monkeypatch.setattr(W.shutil, "rmtree", held)
    w, rows = _overwrite_writer(path)
    (aside,) = _asides(tmp_path)
    assert w.commit()
    committed.set()
    assert aside.is_dir() and not (aside / "zarr.json").exists()  # (root document first: no store there)
    s = open_store(path)
    assert s.hook_points == ["new.output"] and torch.equal(s["new.output"], rows) and s.status == "incomplete"
    stop_threads = w._stop_threads

    def stopping() -> None:  # (the close has begun: the delete may go on)
        closing.set()
        stop_threads()

    monkeypatch.setattr(w, "_stop_threads", stopping)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w.close()
    assert seen == [True, True] and _asides(tmp_path) == []
    s = open_store(path)
    assert s.status == "complete" and torch.equal(s["new.output"], rows) and s.verify() == []


def test_the_old_store_a_running_writer_deletes_is_not_said_to_be_left_by_a_killed_one(tmp_path, monkeypatch, capsys):
    """The overwrite has committed and deletes the old store in the background (held here), its
    writer open: ``Store.leftovers()`` and ``activationscope verify`` name the folder as being
    deleted by the running writer (its pid), nothing to do; opening the store says nothing. (Before,
    they said its writer was killed and gave an rm -rf of the folder the writer was deleting.)"""
    from activationscope import cli

    path = tmp_path / "s.zarr"
    make_store(path, n_rows=96)
    go, started = hold_aside_delete(monkeypatch)
    w, rows = _overwrite_writer(path)
    (aside,) = _asides(tmp_path)
    try:
        assert w.commit() and started.wait(10)
        assert aside.is_dir() and not (aside / "zarr.json").exists() and any(aside.iterdir())
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (nothing to say on opening: the folder holds no row of this store)
            s = open_store(path)
        assert torch.equal(s["new.output"], rows) and s.verify() == []
        (line,) = s.leftovers()
        assert line.startswith(f"folder '{aside}': what is left of the store an overwrite=True replaced here"), line
        assert f"a writer of this store is running (pid {os.getpid()} on host" in line and "nothing to do" in line
        assert "killed" not in line and "rm -rf" not in line, line
        assert cli.main(["verify", str(path)]) == 0
        assert f"note: {path}: {line}" in capsys.readouterr().err
    finally:
        go.set()
    w.close()
    assert _asides(tmp_path) == [] and open_store(path).leftovers() == []


def test_a_delete_of_the_old_store_that_fails_warns_at_the_close_not_in_a_commit(tmp_path, monkeypatch):
    """Part of the old store cannot be deleted: the commit that settles it raises nothing (not
    even with warnings as errors: it runs in a forward), and the close warns, naming the folder
    and the fix; the new store is whole."""
    path = tmp_path / "s.zarr"
    _old_store_not_deletable(path, monkeypatch)
    w, rows = _overwrite_writer(path)
    (aside,) = _asides(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert w.commit()
    with pytest.warns(RuntimeWarning, match=rf"the new store has committed, but deleting the old one it replaced "
                                            rf"from '{aside}' failed \(.*Permission denied.*\).*rm -rf '{aside}'"):
        w.close()
    assert not (aside / "zarr.json").exists() and sorted(q.name for q in aside.iterdir()) == ["acts", "reductions",
                                                                                             "rows"]
    s = open_store(path)
    assert s.status == "complete" and torch.equal(s["new.output"], rows)


# Killed (SIGKILL) while the old store is deleted in the background, that delete cut short:
# argv[2] "close": while the close waits for it (the new store's last commit, status complete,
# written); "commit": right after the first commit (the new store incomplete, with its rows).
_KILLED_DELETING = r"""
import os, shutil, signal, sys, threading
from pathlib import Path
import torch
from activationscope.store import StoreWriter
from activationscope.store import writer as W

path, when = sys.argv[1], sys.argv[2]
rmtree, halfway = shutil.rmtree, threading.Event()

def cut_short(p, *args, **kwargs):
    if ".replaced-" in Path(p).name:
        rmtree(Path(p) / "acts")
        halfway.set()
        threading.Event().wait()  # (the process is killed meanwhile)
    return rmtree(p, *args, **kwargs)

def finish(self, store):
    halfway.wait(60)
    os.kill(os.getpid(), signal.SIGKILL)

W.shutil.rmtree, W._AsideDelete.finish = cut_short, finish
w = StoreWriter(path, overwrite=True, chunk_rows=16, shard_bytes=16 * 8 * 4)
w.open_array("new.output", (8,), torch.float32, "sample").append(torch.ones(32, 8))
w.add_batch(32)
w._core.drain()
assert w.commit()
if when == "commit":
    finish(None, None)
w.close()
os._exit(0)
"""


def _killed_deleting(tmp_path: Path, when: str) -> tuple[Path, Path]:
    """A store whose overwrite was killed while it deleted the old store (``when``: see
    _KILLED_DELETING): ``(path, the folder left aside)``."""
    path = tmp_path / "s.zarr"
    make_store(path, n_rows=96)
    done = run_python(_KILLED_DELETING, str(path), when)
    assert done.returncode == -9, done.stderr
    (left,) = _asides(tmp_path)
    assert sorted(q.name for q in left.iterdir()) == ["reductions", "rows"]  # (no root document: no store)
    return path, left


@pytest.mark.parametrize("when", ["close", "commit"])
@pytest.mark.parametrize("then", ["resume", "discard", "overwrite"])
def test_what_a_killed_delete_of_the_old_store_left_is_named_and_deleted_by_the_next_writer(tmp_path, capsys,
                                                                                           monkeypatch, when, then):
    """SIGKILL while the old store is deleted in the background, after the new store committed:
    the new store opens with its rows, and names what is left aside as a harmless leftover with
    the command that removes it (``Store.leftovers()``, ``activationscope verify`` exits 0 with a
    note); the next resume (closed, or discarded: the store left as found) or overwrite deletes
    that folder, without a warning, and the close waits for it. Before, that folder stayed for good, a warning at each resume or overwrite."""
    from activationscope import cli
    from activationscope.store import writer as W

    path, left = _killed_deleting(tmp_path, when)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a store with rows: nothing to say on opening)
        s = open_store(path)
    assert s.status == ("complete" if when == "close" else "incomplete") and s.verify() == []
    assert s.hook_points == ["new.output"] and torch.equal(s["new.output"], torch.ones(32, FEATURE))
    (line,) = s.leftovers()
    assert line.startswith(f"folder '{left}': what is left of the store an overwrite=True replaced here") \
        and "harmless" in line and line.endswith(f"rm -rf {shlex.quote(str(left))}"), line
    assert cli.main(["verify", str(path)]) == 0
    assert f"note: {path}: {line}" in capsys.readouterr().err
    delete = W._delete_aside

    def slow(p):  # (a large folder: a close that does not wait for the delete returns before it is done)
        threading.Event().wait(1.0)
        return delete(p)

    monkeypatch.setattr(W, "_delete_aside", slow)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w = StoreWriter(path, **{"overwrite" if then == "overwrite" else "resume": True})
        if then == "overwrite":  # (the store with rows goes aside, deleted once the new one commits)
            w.open_array("new.output", (FEATURE,), torch.float32, "sample").append(torch.zeros(8, FEATURE))
            w.add_batch(8)
        w.discard() if then == "discard" else w.close()
    assert _asides(tmp_path) == [] and not left.exists()
    s = open_store(path)
    status = "incomplete" if then == "discard" and when == "commit" else "complete"
    assert s.status == status and s.verify() == [] and s.leftovers() == []
    rows = torch.zeros(8, FEATURE) if then == "overwrite" else torch.ones(32, FEATURE)
    assert torch.equal(s["new.output"], rows)


def test_a_failed_delete_of_what_was_left_aside_still_waits_for_the_old_store_s_delete(tmp_path, monkeypatch):
    """An overwrite of a store with a folder left aside runs two deletes: that folder's, which
    fails here (its warning raised: warnings are errors), and the replaced store's, slow. The
    close raises the first warning only after the second delete is done, and releases the lock
    (before, it raised at once, the other delete still running with the lock gone)."""
    from activationscope.store import writer as W

    path, left = _killed_deleting(tmp_path, "close")
    rmtree = shutil.rmtree

    def refused_or_slow(p, *args, ignore_errors=False, **kwargs):
        if Path(p) == left:
            if not ignore_errors:
                raise PermissionError(13, "Permission denied", str(left / "rows"))
            return None
        if ".replaced-" in Path(p).name:  # (the store this overwrite replaces: a large one)
            threading.Event().wait(1.0)
        return rmtree(p, *args, ignore_errors=ignore_errors, **kwargs)

    monkeypatch.setattr(W.shutil, "rmtree", refused_or_slow)
    w = StoreWriter(path, overwrite=True)
    (replaced,) = [p for p in _asides(tmp_path) if p != left]
    w.open_array("new.output", (FEATURE,), torch.float32, "sample").append(torch.zeros(8, FEATURE))
    w.add_batch(8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeWarning, match=rf"deleting what is left in '{left}' of a store an earlier "
                                                 rf"overwrite=True replaced failed \(.*Permission denied.*\)"):
            w.close()
    assert not replaced.exists() and not w._writer_lock._held
    assert sorted(q.name for q in left.iterdir()) == ["reductions", "rows"]
    assert torch.equal(open_store(path)["new.output"], torch.zeros(8, FEATURE))


def test_what_is_left_aside_beside_another_folder_or_entry_is_only_named(tmp_path):
    """What cannot be told apart keeps the warning and deletes nothing: a second folder aside,
    an entry of another name in the folder, or a store at the path that has committed no
    forward (an unstarted store, as a killed overwrite leaves it)."""
    path, left = _killed_deleting(tmp_path, "close")
    held = _everything(left)
    other = tmp_path / ".s.zarr.replaced-0000bbbb"
    (other / "acts").mkdir(parents=True)
    note = left / "NOTES.txt"
    for case in ("two folders", "an entry", "unstarted"):
        if case == "an entry":
            shutil.rmtree(other)
            note.write_text("mine")
        if case == "unstarted":
            note.unlink()
            shutil.rmtree(path)
            StoreWriter(path).abort()  # (its root of no forward; the writer's remove of it left out)
        assert open_store(path).leftovers() == []
        with pytest.warns(RuntimeWarning, match=r"holds what is left of a store.*root document is gone.*delete it"):
            StoreWriter(path, resume=True).close()
        assert _everything(left) == held | ({"NOTES.txt": b"mine"} if case == "an entry" else {})


def test_an_abort_after_a_failed_delete_of_the_old_store_still_releases_the_lock(tmp_path, monkeypatch):
    """The capture fails after the first commit, warnings are errors, and part of the old store
    cannot be deleted: the abort waits for the delete, and the warning it makes (swallowed, so
    that the capture's error stays the one raised) does not keep the writer lock."""
    path = tmp_path / "s.zarr"
    _old_store_not_deletable(path, monkeypatch)
    w, rows = _overwrite_writer(path)
    assert w.commit()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w.abort(RuntimeError("stop"))
    assert not w._writer_lock._held  # (released: the next writer is not refused)
    (aside,) = _asides(tmp_path)
    assert sorted(q.name for q in aside.iterdir()) == ["acts", "reductions", "rows"]
    s = open_store(path)
    assert s.status == "incomplete" and torch.equal(s["new.output"], rows)


# SIGKILL right after the first root document of the new store that lists a hook point (its
# array with 0 rows: the forward is recorded, its shard not yet durable), before its first commit;
# argv[2] "reduced": a capture that keeps reductions only, killed at its first root.
_KILLED_LISTING = r"""
import json, os, signal, sys
import torch
import activationscope as acs
from activationscope.store import _backend as B

path, kind = sys.argv[1], sys.argv[2]
set_root = B.LocalBackend.set

def set_then_die(self, key, data):
    set_root(self, key, data)
    if key == "zarr.json" and (kind == "reduced" or json.loads(data)["attributes"]["activationscope"]["arrays"]):
        os.kill(os.getpid(), signal.SIGKILL)

B.LocalBackend.set = set_then_die
model = torch.nn.Sequential(torch.nn.Linear(8, 4))
policy = {"reduction_policy": acs.ReductionPolicy.STREAMING, "reductions": ["mean"]} if kind == "reduced" else {}
scope = acs.ActivationScope(store=path, store_options={"overwrite": True, "commit_interval": 0}, **policy)
with scope.track(model), torch.no_grad():
    model(torch.randn(8, 8))
    model(torch.randn(8, 8))
os._exit(0)
"""


@pytest.mark.parametrize("kind", ["rows", "reduced"])
def test_a_store_killed_before_its_first_commit_names_the_old_store_aside_though_it_lists_hook_points(tmp_path,
                                                                                                     kind):
    """Killed after a root that lists the new store's hook points (0 rows each, no forward
    committed): opening it warns, naming the folder that holds the old store, as for a root that
    lists none (before, a root listing a hook point silenced the warning). A store that keeps
    reductions only and lists reduced hook points, committing none, likewise."""
    import json

    path = tmp_path / "s.zarr"
    data = make_store(path, n_rows=96)
    done = run_python(_KILLED_LISTING, str(path), kind)
    assert done.returncode == -9, done.stderr
    (aside,) = _asides(tmp_path)
    if kind == "reduced":  # (its hook point listed, with 0 rows reduced: as a commit that waits for the states)
        doc = json.loads((path / "zarr.json").read_text())
        attrs = doc["attributes"]["activationscope"]
        assert attrs["rows_stored"] is False and attrs["n_batches"] == 0
        attrs["reduced"] = {"0.output": {"row_kind": "sample", "feature_shape": [4], "dtype": "float32", "n_rows": 0}}
        (path / "zarr.json").write_text(json.dumps(doc))
    with pytest.warns(UserWarning, match=rf"holds no rows yet: an overwrite=True .* the store it replaces is in "
                                         rf"'{aside}' until then"):
        s = open_store(path)
    assert s.hook_points == ["0.output"] and s.status == "incomplete" and s.n_samples == 0
    assert torch.equal(open_store(aside)[HP], data)  # (whole, there)


@pytest.mark.parametrize("still_aside", ["acts", "rows"])
def test_a_root_moved_back_by_hand_with_its_arrays_still_aside_is_not_called_garbage(tmp_path, still_aside):
    """The folder of an overwrite killed before its new store committed holds the old store;
    moved back by hand root first (``mv`` puts the root document over the new one and fails on
    the folders the new store also has), the store at the path lists a committed forward and
    the folder holds its arrays without a root document: the reader called that folder harmless,
    to delete with rm -rf, and a resume deleted it; now it is named in a warning only, and kept."""
    from activationscope.store._backend import resolve

    path = tmp_path / "s.zarr"
    make_store(path, n_rows=96)
    aside = resolve(path).move_aside()  # (as an overwrite killed before its first commit leaves it)
    (path / still_aside).mkdir()  # (the new store's)
    shutil.move(aside / "zarr.json", path / "zarr.json")
    for p in aside.iterdir():
        if not (path / p.name).exists():
            shutil.move(p, path / p.name)
    held = _files(aside)
    assert sorted(p.name for p in aside.iterdir()) == [still_aside] and held
    assert open_store(path).leftovers() == []
    with pytest.warns(RuntimeWarning, match="holds what is left of a store.*moving back by hand"):
        try:
            StoreWriter(path, resume=True).close()
        except StoreError:  # (its arrays are not at the path)
            pass
    assert _files(aside) == held


def test_remains_next_to_a_store_held_by_a_writer_that_does_not_delete_them_are_not_said_to_be_deleted(tmp_path):
    """What a cut-short delete left next to a store, while a writer that does not delete it
    holds the store's lock (``consolidate`` of rank tasks capturing the store again; a resume
    that warned about the folder): ``Store.leftovers()`` said that writer deletes it before its
    close returns, and the folder was still there once it had ended. The line now says only an
    overwrite's writer deletes it, and that the next resume or overwrite does once it has ended."""
    from activationscope.store import _backend as B
    from activationscope.store._lock import WriterLock

    path = tmp_path / "s.zarr"
    make_store(path)
    remains = tmp_path / ".s.zarr.replaced-0123abcd"
    (remains / "acts").mkdir(parents=True)
    (remains / "acts" / "x").write_bytes(b"old")
    lock = WriterLock(B.resolve(str(path))).acquire()  # (as consolidate holds it: no delete of that folder)
    try:
        (line,) = open_store(path).leftovers()
    finally:
        lock.release()
    assert f"a writer of this store is running (pid {os.getpid()} on host" in line and "nothing to do" in line, line
    assert ") and deletes it before its close returns" not in line and "killed" not in line, line
    assert "The writer of an overwrite=True deletes it" in line and "once that writer has ended" in line, line
    assert remains.is_dir()
