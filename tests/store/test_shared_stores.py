"""Stores shared between people: a store of another user (folders not writable to this one,
files it may not read), read with read permission only. Every read works and writes nothing;
a writer that would change it (resume, copy_store over it, overwrite) is refused before
anything is changed, with a StoreError naming the folder and the fix.

Run as root, each check runs in a forked child that became user nobody (65534) on a store
root made; run as another user, in a forked child of that user on a store whose modes deny
it (the owner's permission bits apply to the owner too)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from acs_testing import run_as_other_user
from activationscope.store import StoreWriter, copy_store, open_store
from activationscope.store._backend import LOCK_KEY

ROOT_USER = hasattr(os, "geteuid") and os.geteuid() == 0


@pytest.fixture
def shared():
    """A folder other users may enter (pytest's own is closed to them); made writable again and
    removed after the test."""
    folder = Path(tempfile.mkdtemp(prefix="acs-shared-"))
    os.chmod(folder, 0o755)
    try:
        yield folder
    finally:
        for d, _dirs, files in os.walk(folder):
            os.chmod(d, 0o755)
            for name in files:
                os.chmod(os.path.join(d, name), 0o644)
        shutil.rmtree(folder)


def _store(path: Path) -> torch.Tensor:
    """A complete store of one array "x" (36 rows of 8 float32, three batches, 16-row shards)
    with a mean reduction; returns its rows."""
    from activationscope.reductions import make_reduction

    data = torch.randn(36, 8, generator=torch.Generator().manual_seed(0))
    w = StoreWriter(path, chunk_rows=8, shard_rows=16)
    a = w.open_array("x", (8,), torch.float32, "sample")
    for s in range(0, 36, 12):
        a.append(data[s:s + 12])
        w.add_batch(12)
    r = make_reduction("mean")
    r.update(data)
    w.add_reductions("x", "mean", r)
    w.close()
    return data


def _listing(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _warm(tmp: Path) -> None:
    """What a resume and a copy import, imported before a child drops root."""
    _store(tmp / "warm.zarr")
    StoreWriter(tmp / "warm.zarr", resume=True).close()
    copy_store(tmp / "warm.zarr", tmp / "warm-copy.zarr")
    shutil.rmtree(tmp / "warm.zarr")
    shutil.rmtree(tmp / "warm-copy.zarr")


def _folder_of_another_user(path: Path) -> None:
    """The store's own folder writable to everyone (a writer may make its lock there), every
    folder under it writable to its owner only and every file read-only: the store of a
    colleague in a shared folder, copied without its writer's lock file (a lock file of the
    colleague's is refused first, by the writer lock)."""
    (path / LOCK_KEY).unlink()
    for d, dirs, files in os.walk(path):
        for name in files:
            os.chmod(os.path.join(d, name), 0o444)
        os.chmod(d, 0o777 if Path(d) == path else 0o755 if ROOT_USER else 0o555)


def test_resume_of_a_store_with_a_folder_it_may_not_write_is_refused_before_any_write(shared):
    """Before: the resume wrote the store's root (status incomplete), then failed writing in
    ``acts/`` with a bare "Permission denied": a complete store of someone else was left marked
    incomplete. Now it is refused before anything is written, naming the folder and the fix."""
    _warm(shared)
    path = shared / "s.zarr"
    data = _store(path)
    _folder_of_another_user(path)
    before = _listing(path)
    name, msg = run_as_other_user(lambda: StoreWriter(path, resume=True))
    assert name == "StoreError", (name, msg)
    assert f"cannot resume '{path}': this process may not write in the folder '{path}/" in msg
    assert "Nothing of the store was deleted or written" in msg and "copy_store" in msg
    assert _listing(path) == before
    s = open_store(path)
    assert s.status == "complete" and torch.equal(s["x"], data) and s.verify() == []


def test_copy_store_over_a_store_with_a_folder_it_may_not_write_changes_nothing(shared):
    """Before: copy_store(..., overwrite=True) wrote its empty root over the old store's, then
    failed deleting in a folder it may not write in (a bare PermissionError naming a file name
    only): the old store read as an empty one. Now it is refused before anything changes."""
    _warm(shared)
    path, source = shared / "s.zarr", shared / "source.zarr"
    data = _store(path)
    _store(source)
    _folder_of_another_user(path)
    before = _listing(path)
    name, msg = run_as_other_user(lambda: copy_store(source, path, overwrite=True))
    assert name == "StoreError", (name, msg)
    assert f"copy_store cannot replace the store at '{path}': this process may not write in its folder" in msg
    assert "nothing was changed" in msg
    assert _listing(path) == before
    s = open_store(path)
    assert s.status == "complete" and torch.equal(s["x"], data) and s.verify() == []


def test_overwrite_of_a_store_whose_parent_it_may_not_write_is_a_store_error(shared):
    """overwrite=True moves the old store into a new folder next to it: where this process may
    write in the store's folder but not in its parent, that was a bare PermissionError; now a
    StoreError naming the folder and the ways out, the old store unchanged."""
    _warm(shared)
    parent = shared / "team"
    parent.mkdir()
    path = parent / "s.zarr"
    data = _store(path)
    os.chmod(path, 0o777)
    os.chmod(path / LOCK_KEY, 0o666)  # (a store of this user's: its lock file too)
    os.chmod(parent, 0o755 if ROOT_USER else 0o555)
    before = _listing(path)
    name, msg = run_as_other_user(lambda: StoreWriter(path, overwrite=True))
    assert name == "StoreError", (name, msg)
    assert f"overwrite: the old store '{path}' is moved aside into a new folder next to it" in msg
    assert "Permission denied; nothing was changed" in msg and "capture into another path" in msg
    assert _listing(path) == before and sorted(p.name for p in parent.iterdir()) == ["s.zarr"]
    assert torch.equal(open_store(path)["x"], data)


def test_overwrite_that_cannot_delete_the_old_store_says_so(shared):
    """overwrite=True of a store of another user whose top folders this process may move but
    whose deeper folders it may not write in: the new store commits, and the old store's files
    that could not be deleted were left in the folder next to it without a word; now a warning
    names that folder and says to delete it."""
    _warm(shared)
    parent = shared / "team"
    parent.mkdir()
    path = parent / "s.zarr"
    _store(path)
    _folder_of_another_user(path)
    for entry in path.iterdir():
        if entry.is_dir():
            os.chmod(entry, 0o777)
    os.chmod(parent, 0o777)
    rows = torch.arange(24.0).reshape(3, 8)

    def overwrite() -> None:
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            w = StoreWriter(path, overwrite=True)
            a = w.open_array("x", (8,), torch.float32, "sample")
            a.append(rows)
            w.add_batch(3)
            w.close()
        said = [str(c.message) for c in caught if "deleting the old one it replaced" in str(c.message)]
        if len(said) != 1:
            raise AssertionError(f"warnings: {[str(c.message) for c in caught]}")
        raise RuntimeError(said[0])

    name, msg = run_as_other_user(overwrite)
    (aside,) = [p for p in parent.iterdir() if ".replaced-" in p.name]
    assert name == "RuntimeError", (name, msg)
    assert f"store '{path}': the new store has committed" in msg and f"from '{aside}' failed (" in msg
    assert "Permission denied" in msg and "delete it" in msg
    assert not (aside / "zarr.json").exists()
    assert torch.equal(open_store(path)["x"], rows)


def test_a_file_it_may_not_read_is_named_with_the_fix_not_as_damage(shared):
    """A store unpacked with its maker's modes (one shard readable by its owner only): the
    read names the file, says the store is not damaged and what gives read permission."""
    path = shared / "s.zarr"
    _store(path)
    shard = path / "acts" / "x" / "c" / "1" / "0"
    assert shard.is_file()
    os.chmod(shard, 0o600 if ROOT_USER else 0o000)
    s = open_store(path) if not ROOT_USER else None  # (a non-root owner: opened before, read after)
    name, msg = run_as_other_user(lambda: (s or open_store(path))["x"])
    assert name == "StoreError", (name, msg)
    assert "cannot open 'acts/x/c/1/0': Permission denied" in msg
    assert "the store is not damaged" in msg and "read permission" in msg


def test_every_read_of_a_store_it_may_only_read(shared):
    """A store of another user, every folder and file read-only to this one: open_store, rows,
    reductions, row table, verify, info, a dataset read by fork DataLoader workers and Dask all
    read the stored values, and nothing is written in the store."""
    from torch.utils.data import DataLoader

    import activationscope as acs
    from activationscope.analysis.dask import to_dask
    from activationscope.data import SequentialBatchSampler

    path = shared / "s.zarr"
    data = _store(path)
    for d, _dirs, files in os.walk(path):
        for name in files:
            os.chmod(os.path.join(d, name), 0o444)
        os.chmod(d, 0o555)
    before = _listing(path)

    def read() -> None:
        s = open_store(path)
        assert torch.equal(s["x"], data) and torch.equal(s.rows("x", 5, 30), data[5:30])
        assert torch.allclose(s.reductions["x"]["mean"], data.double().mean(0))
        assert s.row_table("sample").num_rows == 36 and s.verify() == [] and s.info()["n_samples"] == 36
        assert torch.equal(open_store(path, verify=True)["x"], data)
        ds = acs.ActivationDataset(s, hook_points=["x"])
        loader = DataLoader(ds, batch_sampler=SequentialBatchSampler(ds, batch_size=12), num_workers=2,
                            multiprocessing_context="fork")
        assert torch.equal(torch.cat([b["x"] for b in loader]), data)
        # (Dask's default threaded scheduler does not work in a child forked after it ran)
        total = to_dask(s, "x").sum().compute(scheduler="synchronous")
        assert float(total) == pytest.approx(float(data.double().sum()))

    read()  # (here first: what it imports is imported before the child drops root)
    name, msg = run_as_other_user(read)
    assert (name, msg) == ("", "")
    assert _listing(path) == before


def test_info_sizes_a_shard_it_may_not_read_as_it_is(shared):
    """info()'s bytes on disk counted a shard this process may not open as 0 bytes (a smaller
    store than the one on disk, without a word); now it is sized as it is, as `ls` does."""
    path = shared / "s.zarr"
    _store(path)
    want = open_store(path).info()
    os.chmod(path / "acts" / "x" / "c" / "1" / "0", 0o600 if ROOT_USER else 0o000)

    def info() -> None:
        got = open_store(path).info()
        if (got["bytes_on_disk"], got["arrays"]["x"]["bytes_on_disk"]) != (want["bytes_on_disk"],
                                                                          want["arrays"]["x"]["bytes_on_disk"]):
            raise AssertionError(f"bytes on disk {got['bytes_on_disk']}, the files hold {want['bytes_on_disk']}")

    assert run_as_other_user(info) == ("", "")
