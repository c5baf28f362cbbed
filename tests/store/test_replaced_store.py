"""A store replaced under an open reader (``overwrite=True`` by another writer, a copy, a
delete and a new capture) is reported as replaced when the reader next opens one of its
files, never read as the new run's rows or blamed on damage (FORMAT.md §2 ``run_id``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from activationscope.errors import StoreCorruptError, StoreError
from activationscope.store import StoreWriter, open_store

from hostile import CHUNK_ROWS, FEATURE, HP, SHARD_ROWS, edit_root, make_store

REPLACED = r"store at .*s\.zarr' was replaced since it was opened .*reopen it"


def _write(path: Path, data: torch.Tensor, *, compression=None, overwrite: bool = True, resume: bool = False) -> None:
    """The same layout as make_store (so the new run's files sit where the old ones were)."""
    w = StoreWriter(path, overwrite=overwrite, resume=resume, compression=compression, chunk_rows=CHUNK_ROWS,
                    shard_bytes=SHARD_ROWS * FEATURE * 4)
    a = w.open_array(HP, (FEATURE,), torch.float32, "sample")
    for s in range(0, len(data), 32):
        a.append(data[s:s + 32])
        w.add_batch(len(data[s:s + 32]))
        w.commit()
    w.close()


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_overwrite_under_an_open_reader_is_reported_as_replaced(tmp_path, compression):
    path = tmp_path / "s.zarr"
    old = make_store(path, compression=compression)
    s = open_store(path)
    assert s.attrs["run_id"]
    first = s.rows(HP, 0, 10).clone()  # shard 0 only
    new = torch.randn(320, FEATURE, generator=torch.Generator().manual_seed(7))
    _write(path, new, compression=compression)
    assert open_store(path).attrs["run_id"] != s.attrs["run_id"]
    assert torch.equal(first, old[:10])
    for read in (lambda: s.rows(HP, 200, 210), lambda: s[HP], lambda: s.row_table("sample"),
                 lambda: s.reductions[HP]["mean"] if HP in s.reductions else s.rows(HP, 300, 301)):
        with pytest.raises(StoreError, match=REPLACED) as e:
            read()
        assert not isinstance(e.value, StoreCorruptError)
    s.refresh()  # reopened: the new run's rows
    assert torch.equal(s[HP], new)


def test_replaced_while_the_old_one_was_moved_aside(tmp_path):
    path = tmp_path / "s.zarr"
    make_store(path)
    s = open_store(path)
    s.rows(HP, 0, 10)
    (path / "zarr.json").unlink()  # what a reader sees while an overwrite moves the old store away
    with pytest.raises(StoreError, match=r"store at .*s\.zarr' was removed or moved since it was opened \(its root "
                                         r"document zarr.json is gone\); if another store was put in its place, "
                                         r"reopen it"):
        s.rows(HP, 200, 210)


def test_resume_under_an_open_reader_is_the_same_store(tmp_path):
    """A resumed (continued) run keeps its run_id: the reader keeps reading its snapshot and
    sees the new rows after refresh()."""
    path = tmp_path / "s.zarr"
    data = torch.randn(96, FEATURE, generator=torch.Generator().manual_seed(1))
    more = torch.randn(64, FEATURE, generator=torch.Generator().manual_seed(2))
    _write(path, data, overwrite=False)
    edit_root(path, lambda a: a.update(status="incomplete"))
    s = open_store(path)
    run = s.attrs["run_id"]
    assert torch.equal(s.rows(HP, 0, 10), data[:10])
    _write(path, more, overwrite=False, resume=True)
    assert open_store(path).attrs["run_id"] == run
    assert torch.equal(s.rows(HP, 64, 96), data[64:96]) and s.n_rows(HP) == 96
    s.refresh()
    assert torch.equal(s[HP], torch.cat([data, more]))


def test_reductions_rewritten_by_a_resume_under_an_open_reader(tmp_path):
    """A resume rewrites the reduction files a reader opened before it lists (their new
    crc32c is in the new root only): reading them was a StoreCorruptError telling to restore
    the store from an intact copy. It is a StoreError telling to refresh; after refresh() the
    reductions are those of every row."""
    import activationscope as acs

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    xs = [torch.randn(5, 4) for _ in range(4)]
    path = tmp_path / "s.zarr"
    for part, opts in ((xs[:2], {}), (xs[2:], {"resume": True})):
        if opts:
            s = open_store(path)
            first = s.reductions["0.output"]["mean"].clone()
        with acs.ActivationScope(store=str(path), reductions=["mean"], store_options=opts).track(model), \
                torch.no_grad():
            for x in part:
                model(x)
    with torch.no_grad():
        rows = torch.cat([model(x) for x in xs]).double()
    torch.testing.assert_close(first, rows[:10].mean(0))
    with pytest.raises(StoreError, match=r"committed again since it was opened.*refresh\(\)") as e:
        s.reductions["0.output"]["mean"]
    assert not isinstance(e.value, StoreCorruptError)
    s.refresh()
    torch.testing.assert_close(s.reductions["0.output"]["mean"], rows.mean(0))

def test_stores_without_a_run_id_open_and_are_told_apart_by_created(tmp_path):
    path = tmp_path / "s.zarr"
    old = make_store(path)
    edit_root(path, lambda a: a.pop("run_id"))
    s = open_store(path)
    assert "run_id" not in s.attrs and torch.equal(s[HP, :64], old[:64])
    # replaced by another store without a run id, created at another time
    other = tmp_path / "other.zarr"
    new = torch.randn(320, FEATURE, generator=torch.Generator().manual_seed(3))
    _write(other, new, overwrite=False)
    edit_root(other, lambda a: (a.pop("run_id"), a.update(created="2030-01-01T00:00:00Z")))
    shutil.rmtree(path)
    shutil.copytree(other, path)
    with pytest.raises(StoreError, match=REPLACED):
        s.rows(HP, 200, 210)
    assert json.loads((path / "zarr.json").read_text())["attributes"]["activationscope"]["created"] == "2030-01-01T00:00:00Z"


@pytest.mark.parametrize("bad", [0, "", "x" * 129, ["a"]])
def test_run_id_is_validated(tmp_path, bad):
    path = tmp_path / "s.zarr"
    make_store(path, n_rows=32)
    edit_root(path, lambda a: a.update(run_id=bad))
    with pytest.raises(StoreCorruptError, match="run_id must be a str of 1..128 characters"):
        open_store(path)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_store_pickles_as_its_path_and_is_reopened_as_that_run_only(tmp_path, compression):
    # (pickling a Store, as a Dataset of the user's holding one does for a 'spawn' DataLoader
    # worker, raised Python's "cannot pickle '_thread.lock' object")
    import copy
    import pickle

    path = tmp_path / "s.zarr"
    old = make_store(path, compression=compression)
    s = open_store(path, cache_bytes=4096, verify=True)
    s.rows(HP, 0, 10)
    raw = pickle.dumps(s)
    assert len(raw) < 1000  # its path and options, none of its rows
    for again in (pickle.loads(raw), copy.deepcopy(s)):
        assert again is not s and again.open_options() == s.open_options()
        assert torch.equal(again[HP], old) and again.row_table("sample").equals(s.row_table("sample"))
    _write(path, torch.randn(320, FEATURE, generator=torch.Generator().manual_seed(7)), compression=compression)
    with pytest.raises(StoreError, match=r"holds another run than when it was pickled .* open it again"):
        pickle.loads(raw)


def test_a_pickled_memory_store_in_another_process_says_where_it_lives():
    from activationscope.store.reader import _reopen_pickled

    with pytest.raises(StoreError, match=r"a memory:// store exists only inside the process that made it \(pid 1\)"):
        _reopen_pickled("memory://nowhere/s.zarr", {"cache_bytes": 1024, "verify": False}, None, 1)


def test_a_multi_rank_store_has_a_run_id_that_a_resume_and_the_commit_keep(tmp_path):
    """FORMAT.md section 2: a new multi-rank store (its root, written before the ranks) has a
    run_id of its own, an overwrite gets another, and a resume (a torchrun restart) and the
    commit keep the run (run_id and created) that readers opened before them are reading."""
    from activationscope.store.ranks import commit_ranks, prepare_root

    import activationscope as acs

    path = tmp_path / "m.zarr"
    prepare_root(str(path), world_size=2)
    first = json.loads((path / "zarr.json").read_text())["attributes"]["activationscope"]
    assert isinstance(first.get("run_id"), str) and 1 <= len(first["run_id"]) <= 128
    # an earlier run's root (its created second long past): a resume keeps it as it is
    edit_root(path, lambda a: a.update(created="2020-01-01T00:00:00Z"))
    prepare_root(str(path), world_size=2, resume=True)
    resumed = json.loads((path / "zarr.json").read_text())["attributes"]["activationscope"]
    assert (resumed["run_id"], resumed["created"]) == (first["run_id"], "2020-01-01T00:00:00Z")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    for task in range(2):
        scope = acs.ActivationScope(store=str(path), store_options={"shard_rows": 8, "process_group": acs.RankStore(task, 2)})
        with scope.track(model):
            model(torch.randn(4, 4))
    reader = open_store(path)                    # the ranks, before the commit
    commit_ranks(str(path))
    committed = open_store(path).attrs
    assert (committed["run_id"], committed["created"]) == (first["run_id"], "2020-01-01T00:00:00Z")
    reader.refresh()                             # the same run, committed: no "replaced"
    assert reader.status == "complete" and reader.n_samples == 8
    prepare_root(str(path), world_size=2, overwrite=True)
    again = json.loads((path / "zarr.json").read_text())["attributes"]["activationscope"]
    assert isinstance(again.get("run_id"), str) and again["run_id"] != first["run_id"]
