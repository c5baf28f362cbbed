"""The writer thread makes a shard's folder (``c/<shard>``) when it opens the shard, while
the model runs, not when it finishes it (at the close every array's last shard finishes at
once: making a folder is a new inode, the slow part of a close on some file systems). The
stored rows, the verification and a discard must not see the difference, and no folder the
writer writes a shard into is reached through a symbolic link."""

from __future__ import annotations

import os
import shutil
import time

import pytest
import torch

import activationscope as acs
from activationscope.cli import main as cli_main
from activationscope.errors import StoreCorruptError, StoreError
from activationscope.store.writer import StoreWriter


def _options():
    return {"chunk_rows": 4, "shard_bytes": 16 * 8 * 4}  # rows of 8 float32: 16-row shards of 4-row chunks


def test_the_folder_of_an_open_shard_exists_before_the_shard_is_finished(tmp_path):
    path = tmp_path / "deep" / "er" / "s.zarr"  # parents made too
    w = StoreWriter(path, **_options())
    a = w.open_array("0.output", (8,), torch.float32, "sample")
    rows = torch.randn(20, 8)
    a.append(rows)  # shard 0 finished (16 rows), shard 1 open with one 4-row chunk
    w.add_batch(20)
    w._core.drain()
    assert (path / "acts/0.output/c/0/0").is_file()
    assert (path / "acts/0.output/c/1").is_dir() and not (path / "acts/0.output/c/1/0").exists()
    w.close()
    assert (path / "acts/0.output/c/1/0").is_file()
    assert torch.equal(acs.open_store(path)["0.output"], rows)
    assert cli_main(["verify", str(path)]) == 0


def test_a_shard_whose_folder_went_while_it_was_open_is_still_stored(tmp_path):
    path = tmp_path / "s.zarr"
    w = StoreWriter(path, **_options())
    a = w.open_array("0.output", (8,), torch.float32, "sample")
    rows = torch.randn(20, 8)
    a.append(rows)
    w.add_batch(20)
    w._core.drain()
    shutil.rmtree(path / "acts/0.output/c/1")  # the open shard's folder (its temporary file lives elsewhere)
    w.close()
    assert torch.equal(acs.open_store(path)["0.output"], rows)
    assert cli_main(["verify", str(path)]) == 0


def test_a_capture_into_a_store_is_unchanged_by_early_folders(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    path = tmp_path / "s.zarr"
    xs = [torch.randn(7, 8) for _ in range(9)]  # 63 rows: 3 full shards and a partial one
    with torch.no_grad(), acs.ActivationScope(store=str(path), store_options=_options()).track(model):
        for x in xs:
            model(x)
    store = acs.open_store(path)
    with torch.no_grad():  # forward by forward, as captured (a matmul's last bits depend on the batch)
        assert torch.equal(store["0.output"], torch.cat([model[0](x) for x in xs]))
        assert torch.equal(store["2.output"], torch.cat([model(x) for x in xs]))
    shard_dirs = sorted(os.listdir(path / "acts/0.output/c"))
    assert shard_dirs == ["0", "1", "2", "3"]  # no folder of a shard that holds no row
    assert cli_main(["verify", str(path)]) == 0


def test_an_empty_shard_folder_left_by_a_killed_writer_is_ignored_by_readers_and_verify(tmp_path):
    path = tmp_path / "s.zarr"
    w = StoreWriter(path, **_options())
    rows = torch.randn(20, 8)
    w.open_array("0.output", (8,), torch.float32, "sample").append(rows)
    w.add_batch(20)
    w.close()
    (path / "acts/0.output/c/7").mkdir()  # as a writer killed right after opening shard 7 leaves it
    (path / "acts/0.output/c/8/0").mkdir(parents=True)  # (a shard key's folders of a 3-d array)
    store = acs.open_store(path)
    assert store.status == "complete" and torch.equal(store["0.output"], rows)
    assert cli_main(["verify", str(path)]) == 0


def _store_of_20_rows(path):
    w = StoreWriter(path, **_options())
    rows = torch.randn(20, 8)
    w.open_array("0.output", (8,), torch.float32, "sample").append(rows)
    w.add_batch(20)
    w.close()
    return rows


def _files_under(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_a_link_where_a_resume_would_make_a_shard_folder_is_refused_before_anything_is_written(tmp_path):
    path, outside = tmp_path / "s.zarr", tmp_path / "outside"
    outside.mkdir()
    rows = _store_of_20_rows(path)  # shards 0 (full) and 1 (4 rows): the resume writes shard 2 next
    os.symlink(outside, path / "acts/0.output/c/2")
    os.symlink(outside, path / "acts/0.output/c/\u00b2")  # (no shard's name: str.isdigit() says it is a digit)
    before = {p: p.read_bytes() for p in path.rglob("*") if p.is_file()}
    with pytest.raises(StoreError, match=r"'acts/0\.output/c/2' is a symbolic link.*remove it \(the link"):
        StoreWriter(path, resume=True, **_options())
    assert {p: p.read_bytes() for p in path.rglob("*") if p.is_file()} == before
    assert _files_under(outside) == []
    assert torch.equal(acs.open_store(path)["0.output"], rows)


def test_a_link_where_a_new_hook_point_s_folder_goes_is_refused(tmp_path):
    path, outside = tmp_path / "s.zarr", tmp_path / "outside"
    outside.mkdir()
    rows = _store_of_20_rows(path)
    os.symlink(outside, path / "acts/1.output")
    w = StoreWriter(path, resume=True, **_options())
    with pytest.raises(StoreError, match=r"'acts/1\.output' is a symbolic link"):
        w.open_array("1.output", (8,), torch.float32, "sample")
    w.discard()
    assert _files_under(outside) == []
    store = acs.open_store(path)
    assert store.hook_points == ["0.output"] and torch.equal(store["0.output"], rows)


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_an_open_shard_s_folder_swapped_for_a_link_is_never_written_through(tmp_path, where):
    path = tmp_path / "s.zarr"
    w = StoreWriter(path, **_options())
    a = w.open_array("0.output", (8,), torch.float32, "sample")
    rows = torch.randn(20, 8)
    a.append(rows[:16])
    w.add_batch(16)
    w._core.drain()
    w.commit()  # shard 0 committed
    a.append(rows[16:])
    w.add_batch(4)
    w._core.drain()  # shard 1 open, its folder made
    target = tmp_path / "outside" if where == "outside" else path / "elsewhere"
    target.mkdir()
    shard_dir = path / "acts/0.output/c/1"
    shard_dir.rmdir()
    os.symlink(target, shard_dir)
    with pytest.raises(StoreError, match=r"acts/0\.output/c/1' is a symbolic link where the store writer writes"):
        w.close()
    assert _files_under(target) == []
    assert not list(path.rglob("shard-*.tmp"))
    store = acs.open_store(path)
    assert store.status == "incomplete" and torch.equal(store["0.output"], rows[:16])


def test_a_resume_of_a_store_whose_partial_last_shard_s_folder_is_missing_names_the_missing_shard(tmp_path):
    path = tmp_path / "s.zarr"
    rows = _store_of_20_rows(path)  # shard 1 (c/1/0) holds the committed rows 16-19
    shutil.rmtree(path / "acts/0.output/c/1")
    before = {p: p.read_bytes() for p in path.rglob("*") if p.is_file()}
    # (it said the shard "cannot be kept": free space or fix permissions; then it was refused
    # when the array opened, after the resume had begun: now at the resume's start)
    with pytest.raises(StoreCorruptError, match=r"shard 'acts/0\.output/c/1/0' is missing.*restore the store"):
        StoreWriter(path, resume=True, **_options())
    assert {p: p.read_bytes() for p in path.rglob("*") if p.is_file()} == before
    store = acs.open_store(path)
    assert store.status == "complete" and store.n_samples == len(rows)


def test_committing_rank_stores_links_no_shard_through_a_link_leaving_the_store(tmp_path):
    from activationscope.store.ranks import commit_ranks

    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    path, outside = tmp_path / "m.zarr", tmp_path / "outside"
    outside.mkdir()
    xs = [torch.randn(2, 3) for _ in range(10)]
    for task in range(2):  # 10 rows a rank: 2 full 4-row shards each, linked as shards 0-3 of the store
        opts = {"process_group": acs.RankStore(task, 2), "chunk_rows": 2, "shard_rows": 4}
        with acs.ActivationScope(store=str(path), store_options=opts).track(model), torch.no_grad():
            for x in xs[task * 5:(task + 1) * 5]:
                model(x)
    (path / "acts/0.output/c").mkdir(parents=True)
    os.symlink(outside, path / "acts/0.output/c/2")
    with pytest.raises(StoreCorruptError, match=r"'acts/0\.output/c/2/0' resolves to .*outside the store"):
        commit_ranks(path)
    assert _files_under(outside) == []
    os.unlink(path / "acts/0.output/c/2")
    commit_ranks(path)
    store = acs.open_store(path)
    with torch.no_grad():
        y0, y1 = (torch.cat([model(x) for x in part]) for part in (xs[:5], xs[5:]))  # forward by forward, as captured
    # the ranks' full shards, linked in rank order, then their tails re-chunked
    assert torch.equal(store["0.output"], torch.cat([y0[:8], y1[:8], y0[8:], y1[8:]]))
    assert store.verify() == []


def test_a_link_to_the_folder_of_committed_rows_is_refused_with_the_advice_to_copy_it(tmp_path):
    path = tmp_path / "s.zarr"
    rows = _store_of_20_rows(path)  # shard 1 holds committed rows 16-19: the resume rewrites it
    (path / "acts/0.output/c/1").rename(path / "moved")
    os.symlink(path / "moved", path / "acts/0.output/c/1")  # inside the store: readers read through it
    assert torch.equal(acs.open_store(path)["0.output"], rows)
    with pytest.raises(StoreError, match=r"'acts/0\.output/c/1' is a symbolic link.*replace it with a copy of the "
                                         r"folder it points to \(committed rows are in it\)"):
        StoreWriter(path, resume=True, **_options())
    assert torch.equal(acs.open_store(path)["0.output"], rows)


def test_a_folder_where_a_resume_writes_a_shard_of_an_array_without_features_is_refused_up_front(tmp_path):
    path = tmp_path / "s.zarr"
    w = StoreWriter(path, **_options())
    rows = torch.randn(20)
    w.open_array("y", (), torch.float32, "sample").append(rows)  # shards are the files c/0, c/1
    w.add_batch(20)
    w.close()
    (path / "acts/y/c/2").mkdir()  # (the writer thread failed renaming shard 2 onto it, mid-capture)
    with pytest.raises(StoreError, match=r"'acts/y/c/2' is a folder, where the writer writes the array's shards; "
                                         r"a shard of an array without features is a file: move it away"):
        StoreWriter(path, resume=True, **_options())
    (path / "acts/y/c/2").rmdir()
    w = StoreWriter(path, resume=True, **_options())
    w.open_array("y", (), torch.float32, "sample").append(rows)
    w.add_batch(20)
    w.close()
    assert torch.equal(acs.open_store(path)["y"], torch.cat([rows, rows]))


def test_a_resume_deletes_the_shards_past_the_committed_rows_and_no_other_file_in_their_folders(tmp_path):
    path = tmp_path / "s.zarr"
    rows = _store_of_20_rows(path)  # shards 0 and 1 committed
    (path / "acts/0.output/c/2").mkdir()
    (path / "acts/0.output/c/2/0").write_bytes(b"a shard a killed writer finished")
    (path / "acts/0.output/c/5").mkdir()
    (path / "acts/0.output/c/5/notes.txt").write_text("a file of the user's")  # (it was deleted)
    w = StoreWriter(path, resume=True, **_options())
    w.discard()
    assert not (path / "acts/0.output/c/2/0").exists()
    assert (path / "acts/0.output/c/5/notes.txt").read_text() == "a file of the user's"
    store = acs.open_store(path)
    assert store.status == "complete" and torch.equal(store["0.output"], rows)
    assert cli_main(["verify", str(path)]) == 0


def test_a_file_where_a_resume_makes_a_shard_folder_is_refused_up_front(tmp_path):
    path = tmp_path / "s.zarr"
    rows = _store_of_20_rows(path)
    (path / "acts/0.output/c/3").write_bytes(b"no shard of an array with features")
    before = {p: p.read_bytes() for p in path.rglob("*") if p.is_file()}
    with pytest.raises(StoreError, match=r"'acts/0\.output/c/3' is not a folder, where the writer writes the array's "
                                         r"shards; the writer makes a folder there: move it away"):
        StoreWriter(path, resume=True, **_options())
    assert {p: p.read_bytes() for p in path.rglob("*") if p.is_file()} == before
    assert torch.equal(acs.open_store(path)["0.output"], rows)


def _swap_for_a_link(path, where, outside):
    """Swap ``acts/`` (or the array's folder ``acts/0.output``) for a link to ``outside``,
    keeping the real folder next to the store; returns a function that puts it back."""
    folder = path / ("acts" if where == "acts" else "acts/0.output")
    kept = path.parent / f"{folder.name}.kept"
    os.rename(folder, kept)
    os.symlink(outside, folder)

    def put_back():
        os.unlink(folder)
        os.rename(kept, folder)

    return put_back


@pytest.mark.parametrize("where", ["acts", "array"])
@pytest.mark.parametrize("when", ["between_shards", "shard_open"])
def test_a_parent_folder_swapped_for_a_link_during_a_capture_is_never_written_through(tmp_path, where, when):
    """acts/ or acts/<hook point> swapped for a link leaving the store while the capture runs:
    the writer thread refuses it, naming the link and the fix, writes nothing where it leads,
    and every committed row is intact once the folder is back."""
    path, outside = tmp_path / "s.zarr", tmp_path / "outside"
    outside.mkdir()
    (outside / "0.output").mkdir()  # (what a link at acts/ would reach the array's folder as)
    w = StoreWriter(path, **_options())
    a = w.open_array("0.output", (8,), torch.float32, "sample")
    rows = torch.randn(36, 8)
    a.append(rows[:16])  # shard 0, whole
    w.add_batch(16)
    w._core.drain()
    w.commit()
    # (the spare files of the next commit made first: the writer's background thread makes the
    # folders they go in, and would race the swap below)
    spares = {"zarr.json", "acts/0.output/zarr.json", "acts/0.output/manifest.json"}
    deadline = time.monotonic() + 10
    while not spares <= set(w._backend._spare) and time.monotonic() < deadline:
        time.sleep(0.005)
    if when == "shard_open":
        a.append(rows[16:20])  # shard 1 open: its temporary file is in the real folder
        w.add_batch(4)
        w._core.drain()
    put_back = _swap_for_a_link(path, where, outside)
    link = "acts" if where == "acts" else "acts/0.output"
    with pytest.raises(StoreError, match=rf"{os.sep}s\.zarr/{link}' is a symbolic link where the store writer "
                                         r"writes.*remove the link"):
        if when == "between_shards":
            a.append(rows[16:36])  # shard 1 whole: opened and finished by the writer thread
            w.add_batch(20)
            w._core.drain()
            w._core.check()
        w.close()
    w.abort()
    assert _files_under(outside) == ["0.output"]  # nothing written where the link leads
    put_back()
    store = acs.open_store(path)
    assert store.status == "incomplete" and torch.equal(store["0.output"], rows[:16])
    assert store.verify() == []
