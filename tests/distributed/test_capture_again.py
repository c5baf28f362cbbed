"""Rank tasks (``RankStore``, no process group) capturing again a store that is already there
(store/FORMAT.md section 10, "Capturing a store again"): a committed store, a store of one
process, or an uncommitted one of another world size. With ``overwrite=True`` each task writes
its rank store as a new run, the store reads as it was until ``consolidate`` replaces it with
that run (its root first); without it, every task refuses before its first forward."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

import activationscope as acs
from activationscope.store import _backend as B
from activationscope.store.ranks import capture_again_run_id, commit_ranks
from acs_testing import store_target

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import torchrun_capture as job  # noqa: E402


WORLD = 2


def _where(request, where: str) -> tuple[str, dict | None]:
    return store_target(request, where, "again", bucket="acs-ranks")


def _model(seed: int) -> torch.nn.Module:
    model = job.toy_mlp(job.WIDTH, 3).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    return model


class _Counted(torch.nn.Module):
    """A model that counts its forwards (a refused task must run none)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.n = inner, 0

    def forward(self, x):
        self.n += 1
        return self.inner(x)


def _task(url: str, so, task: int, world: int, model: torch.nn.Module, **opts) -> int:
    """Task ``task`` of ``world`` (the batches rank ``task`` captures under torchrun); returns
    the tracker's ``resume_from``."""
    extra = {"storage_options": so} if so else {}
    scope = acs.ActivationScope(store=url, reductions=["mean"], store_options={
        **job.STORE_OPTIONS, **extra, **opts, "process_group": acs.RankStore(task, world)})
    with scope.track(model) as tracker, torch.no_grad():
        start = tracker.resume_from
        for i, b in enumerate(job.batches_of(task, world)):
            if i < start // job.BATCH:
                continue
            tracker.set_batch(sample_ids=torch.arange(b * job.BATCH, (b + 1) * job.BATCH))
            model(job.batch(b))
    return start


def _committed(url: str, so, world: int, model: torch.nn.Module) -> acs.Store:
    for task in range(world):
        _task(url, so, task, world, model)
    commit_ranks(url, storage_options=so)
    return acs.open_store(url, storage_options=so)


def _files(url: str, so) -> dict[str, bytes]:
    """Every object of the store but the writer lock (what a reader can see)."""
    b = B.resolve(url, storage_options=so)
    return {k: b.get(k) for k in sorted(b.list("")) if not k.startswith(".activationscope-writer.lock")}


def _rows(st: acs.Store) -> dict[str, torch.Tensor]:
    return {hp: st[hp].clone() for hp in st.hook_points}


@pytest.mark.parametrize("where", ["local", "memory", "s3"])
def test_tasks_with_overwrite_capture_a_committed_store_again_and_consolidate_replaces_it(request, where, tmp_path):
    """The defect: a task with overwrite=True on a committed store was refused as a store inside
    another store (telling to finish a commit that was done), and consolidate, had the rank
    stores been written, said 'already committed'. Now each task writes its rank store as a new
    run, the store reads as the old one until consolidate replaces it, and the result equals a
    capture of the new model into a new store."""
    url, so = _where(request, where)
    old = _committed(url, so, WORLD, _model(0))
    old_rows, old_attrs = _rows(old), dict(old.attrs)
    before = _files(url, so)
    new_model = _model(1)
    for task in range(WORLD):
        assert _task(url, so, task, WORLD, new_model, overwrite=True) == 0
        # until the commit the store is the old one, byte for byte: only ranks/ was written
        st = acs.open_store(url, storage_options=so)
        assert st.status == "complete" and st.attrs["run_id"] == old_attrs["run_id"]
        assert all(torch.equal(st[hp], old_rows[hp]) for hp in old_rows)
        now = _files(url, so)
        assert {k: v for k, v in now.items() if not k.startswith("ranks/")} == before
    run = capture_again_run_id(old_attrs, before["zarr.json"])
    b = B.resolve(url, storage_options=so)
    for task in range(WORLD):
        rec = json.loads(b.get(f"ranks/{task:05d}/zarr.json"))["attributes"]["activationscope"]["rank_store"]
        assert rec == {"rank": task, "world_size": WORLD, "run_id": run}
    summary = commit_ranks(url, storage_options=so)
    assert summary["replaced"] is True and summary["n_ranks"] == WORLD
    ref = _committed(str(tmp_path / "ref.zarr"), None, WORLD, _model(1))
    st = acs.open_store(url, storage_options=so)
    assert st.status == "complete" and st.verify() == []
    assert st.attrs["run_id"] == run != old_attrs["run_id"]
    assert st.attrs["model"] == ref.attrs["model"] != old_attrs["model"]
    assert st.hook_points == ref.hook_points
    for hp in ref.hook_points:
        assert torch.equal(st[hp], ref[hp]) and not torch.equal(st[hp], old_rows[hp])
        torch.testing.assert_close(st.reductions[hp]["mean"], ref.reductions[hp]["mean"], rtol=0, atol=0)
    assert st.row_table("sample").to_pylist() == ref.row_table("sample").to_pylist()
    assert not [k for k in b.list("") if k.startswith("ranks/")]
    # the next capture again of the new store is another run
    assert capture_again_run_id(dict(st.attrs), b.get("zarr.json")) not in (run, old_attrs["run_id"])


@pytest.mark.parametrize("kind", ["committed", "one-process"])
def test_a_task_without_overwrite_on_a_complete_store_is_refused_before_its_first_forward(tmp_path, kind):
    url = str(tmp_path / "s.zarr")
    if kind == "committed":
        _committed(url, None, WORLD, _model(0))
        what = f"committed from {WORLD} rank stores"
    else:
        model = _model(0)
        with acs.ActivationScope(store=url).track(model), torch.no_grad():
            model(job.batch(0))
        what = "written by one process"
    before = _files(url, None)
    model = _Counted(_model(1))
    for world in (WORLD, 3):  # also a task of another world size
        with pytest.raises(acs.StoreExistsError) as e:
            _task(url, None, 0, world, model)
        msg = str(e.value)
        assert f"a complete store ({what}) is at {url!r}; nothing was written" in msg, msg
        assert "pass overwrite=True on every task" in msg and f"`activationscope consolidate {url}`" in msg
        assert model.n == 0 and _files(url, None) == before
    # the rank store path stays refused to a capture that is not a rank task capturing it again
    with pytest.raises(acs.StoreError, match="lies inside the store"):
        with acs.ActivationScope(store=f"{url}/ranks/00000").track(model), torch.no_grad():
            model(job.batch(0))
    assert model.n == 0 and _files(url, None) == before


def test_resume_continues_a_capture_again_and_refuses_when_there_is_none(tmp_path):
    url = str(tmp_path / "s.zarr")
    _committed(url, None, WORLD, _model(0))
    before = _files(url, None)
    model = _Counted(_model(1))
    with pytest.raises(acs.StoreError, match=r"and no task has captured it again .*: there is nothing to resume; "
                                             r"nothing was written. To capture it again, pass overwrite=True"):
        _task(url, None, 1, WORLD, model, resume=True)
    assert model.n == 0 and _files(url, None) == before
    model = _model(1)
    # task 0 captures it again, its first batch only (as a task killed after its first commit)
    first = job.batches_of(0, WORLD)[0]
    scope = acs.ActivationScope(store=url, reductions=["mean"], store_options={
        **job.STORE_OPTIONS, "overwrite": True, "process_group": acs.RankStore(0, WORLD)})
    with scope.track(model) as tracker, torch.no_grad():
        tracker.set_batch(sample_ids=torch.arange(first * job.BATCH, (first + 1) * job.BATCH))
        model(job.batch(first))
    # resumed: task 0 continues its rank store of the capture again, task 1 starts its own
    assert _task(url, None, 0, WORLD, model, resume=True) == job.BATCH
    assert _task(url, None, 1, WORLD, model, resume=True) == 0
    assert acs.open_store(url).status == "complete"  # the old store, until the commit
    commit_ranks(url)
    ref = _committed(str(tmp_path / "ref.zarr"), None, WORLD, _model(1))
    st = acs.open_store(url)
    assert st.verify() == [] and st.n_samples == ref.n_samples
    for hp in ref.hook_points:
        assert torch.equal(st[hp], ref[hp])


def test_a_capture_again_with_another_world_size(tmp_path, capsys):
    """Committed by 2 ranks, captured again by 3: consolidate commits the 3 (a --world-size of
    the old store's 2 is refused, nothing written). An uncommitted store of 2 ranks: a task of 3
    without overwrite is refused before its first forward (the store could never be committed
    with its rank store); with overwrite it captures the store again."""
    from activationscope import cli

    url = str(tmp_path / "s.zarr")
    old = _rows(_committed(url, None, WORLD, _model(0)))
    for task in range(3):
        _task(url, None, task, 3, _model(1), overwrite=True)
    before = _files(url, None)
    assert cli.main(["consolidate", url, "--world-size", "2"]) == 1
    err = capsys.readouterr().err
    assert "world_size=2 (CLI: --world-size 2) disagrees with the store" in err and "captured again by 3 ranks" in err
    assert "nothing was written" in err and _files(url, None) == before
    assert all(torch.equal(acs.open_store(url)[hp], rows) for hp, rows in old.items())
    assert cli.main(["consolidate", url]) == 0
    assert "committed 3 rank stores" in capsys.readouterr().out
    ref = _committed(str(tmp_path / "ref3.zarr"), None, 3, _model(1))
    st = acs.open_store(url)
    assert st.attrs["distributed"]["world_size"] == 3 and st.verify() == []
    for hp in ref.hook_points:
        assert torch.equal(st[hp], ref[hp])

    url = str(tmp_path / "u.zarr")
    for task in range(WORLD):
        _task(url, None, task, WORLD, _model(0))
    before = _files(url, None)
    model = _Counted(_model(1))
    with pytest.raises(acs.StoreError) as e:
        _task(url, None, 0, 3, model)
    msg = str(e.value)
    assert f"the store {url!r} is being captured by 2 ranks" in msg and "this task is RankStore(0, 3)" in msg, msg
    assert ("Pass RankStore(rank, 2) to join that capture; or, to capture it again with 3 ranks, pass "
            "overwrite=True") in msg
    assert model.n == 0 and _files(url, None) == before
    for task in range(3):
        _task(url, None, task, 3, _model(1), overwrite=True)
    assert cli.main(["consolidate", url]) == 0
    assert "replacing the store it held" in capsys.readouterr().out
    st = acs.open_store(url)
    for hp in ref.hook_points:
        assert torch.equal(st[hp], ref[hp])
    assert not (Path(url) / "ranks").exists()


def test_a_damaged_rank_store_of_a_capture_again_leaves_the_old_store(tmp_path, capsys):
    """Every check comes before the new run's root: a damaged rank shard of the capture again
    is refused with the old store intact, byte for byte."""
    from activationscope import cli

    url = str(tmp_path / "s.zarr")
    old = _rows(_committed(url, None, WORLD, _model(0)))
    for task in range(WORLD):
        _task(url, None, task, WORLD, _model(1), overwrite=True)
    shard = next(p for p in sorted((Path(url) / "ranks" / "00001" / "acts").rglob("c/*/*")) if p.is_file())
    with open(shard, "r+b") as f:
        f.truncate(40)
    before = _files(url, None)
    assert cli.main(["consolidate", url]) == 1
    assert "holds 40 bytes" in capsys.readouterr().err and _files(url, None) == before
    st = acs.open_store(url)
    assert st.status == "complete" and st.verify() == []
    assert all(torch.equal(st[hp], rows) for hp, rows in old.items())


@pytest.mark.parametrize("step", ["removing", "tails"])
def test_a_commit_of_a_capture_again_killed_after_the_new_root_is_finished_by_consolidate(tmp_path, monkeypatch, step):
    """Killed once the new run's root is written (while the old store's objects go, or in the
    re-chunking of the tails): the store is an incomplete store of the new run showing its rank
    stores' rows (never a mix with the old arrays); consolidate finishes, and no object of the
    old store (which had a hook point more) is left."""
    from activationscope.store import ranks as R

    url = str(tmp_path / "s.zarr")
    old = _committed(url, None, WORLD, job.toy_mlp(job.WIDTH, 4).eval())
    for task in range(WORLD):
        _task(url, None, task, WORLD, _model(1), overwrite=True)

    def killed(*args):
        raise OSError("simulated crash inside the commit")

    monkeypatch.setattr(*((R, "_remove_store_objects") if step == "removing" else (R._TailWriter, "write")), killed)
    with pytest.raises(OSError, match="simulated crash"):
        commit_ranks(url)
    monkeypatch.undo()
    ref = _committed(str(tmp_path / "ref.zarr"), None, WORLD, _model(1))
    assert set(old.hook_points) > set(ref.hook_points)
    st = acs.open_store(url)
    assert st.status == "incomplete" and st.ranks == [0, 1] and st.n_samples == ref.n_samples
    assert st.attrs["model"] == ref.attrs["model"] and st.hook_points == ref.hook_points  # none of the old store's
    for hp in ref.hook_points:
        ranks = [acs.open_store(Path(url) / "ranks" / f"{r:05d}")[hp] for r in range(WORLD)]
        assert torch.equal(st[hp], torch.cat(ranks))
    summary = commit_ranks(url)
    assert summary["replaced"] is False  # (the root is the new run's already)
    st = acs.open_store(url)
    assert st.status == "complete" and st.verify() == [] and "replaces_run" not in st.attrs["distributed"]
    for hp in ref.hook_points:
        assert torch.equal(st[hp], ref[hp])
    assert _files(url, None).keys() == _files(str(tmp_path / "ref.zarr"), None).keys()


def test_consolidate_names_a_rank_store_that_is_not_of_the_capture_again(tmp_path, capsys):
    from activationscope import cli

    url = str(tmp_path / "s.zarr")
    old = _rows(_committed(url, None, WORLD, _model(0)))
    _task(url, None, 0, WORLD, _model(1), overwrite=True)
    other = str(tmp_path / "other.zarr")
    for task in range(WORLD):
        _task(other, None, task, WORLD, _model(1))
    shutil.copytree(Path(other) / "ranks" / "00001", Path(url) / "ranks" / "00001")
    before = _files(url, None)
    assert cli.main(["consolidate", url]) == 1
    err = capsys.readouterr().err
    assert "rank store(s) [1]" in err and "not of the capture again" in err and "overwrite=True" in err, err
    assert _files(url, None) == before
    assert all(torch.equal(acs.open_store(url)[hp], rows) for hp, rows in old.items())


def test_tasks_capture_a_store_of_one_process_again(tmp_path):
    """A complete store written by one process is replaced the same way: the tasks' rank stores
    are a new run, the store reads as the one-process store until consolidate commits them."""
    url = str(tmp_path / "s.zarr")
    model = _model(0)
    with acs.ActivationScope(store=url, store_options={"process_group": False}).track(model), torch.no_grad():
        model(job.batch(0))
    old = acs.open_store(url)
    old_rows, old_attrs = _rows(old), dict(old.attrs)
    for task in range(WORLD):
        _task(url, None, task, WORLD, _model(1), overwrite=True)
        st = acs.open_store(url)
        assert st.attrs["format"]["version"] == 1 and st.n_samples == job.BATCH
        assert all(torch.equal(st[hp], rows) for hp, rows in old_rows.items())
    assert commit_ranks(url)["replaced"] is True
    ref = _committed(str(tmp_path / "ref.zarr"), None, WORLD, _model(1))
    st = acs.open_store(url)
    assert st.attrs["format"]["version"] == 2 and st.verify() == [] and st.attrs["run_id"] != old_attrs["run_id"]
    for hp in ref.hook_points:
        assert torch.equal(st[hp], ref[hp])
    assert not (Path(url) / "ranks").exists()


@pytest.mark.parametrize("case", ["user-folder", "split-store"])
def test_a_task_on_a_local_folder_that_holds_no_store_to_join_is_refused(tmp_path, case):
    """A task whose path holds no root document but files of the user's, or the half of a store
    that a killed one-process overwrite left there (its root in ``.<name>.replaced-<hex>``), is
    refused before its first forward, naming the path; before, it wrote its rank store there
    (taking the refusal of the root for another task having made it first)."""
    url = str(tmp_path / "s.zarr")
    if case == "user-folder":
        Path(url).mkdir()
        (Path(url) / "notes.txt").write_text("mine")
        match = r"exists and is not empty but holds no Zarr store"
    else:
        model = _model(0)
        with acs.ActivationScope(store=url, store_options={"process_group": False}).track(model), torch.no_grad():
            model(job.batch(0))
        aside = tmp_path / ".s.zarr.replaced-0000aaaa"
        aside.mkdir()
        (Path(url) / "zarr.json").rename(aside / "zarr.json")  # (as an overwrite killed after its first rename)
        match = rf"holds no root document \(zarr\.json\).*moved the store's root document \(zarr\.json\) into '{aside}'"
    found = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    model = _Counted(_model(1))
    for opts in ({}, {"overwrite": True}):
        with pytest.raises(acs.StoreExistsError, match=match):
            _task(url, None, 0, WORLD, model, **opts)
    assert model.n == 0 and sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == found


def test_a_resume_of_a_capture_again_with_another_world_size_is_refused(tmp_path):
    """The rank stores of a capture again record 2 ranks: a task resuming it as RankStore(1, 3)
    (its own rank store of 2 ranks, or one it would start) is refused before its first forward,
    nothing written; never a rank store of rows of two partitions relabelled and committed."""
    url = str(tmp_path / "s.zarr")
    _committed(url, None, WORLD, _model(0))
    model = _model(1)
    for task in range(WORLD):
        _task(url, None, task, WORLD, model, overwrite=True)
    before = _files(url, None)
    for task in (1, 2):  # rank 1 has a rank store of that run, rank 2 has none
        counted = _Counted(model)
        with pytest.raises(acs.StoreError) as e:
            _task(url, None, task, 3, counted, resume=True)
        msg = str(e.value)
        assert "is by 2 ranks (rank_store.world_size in the zarr.json of its rank stores" in msg, msg
        assert f"this task is RankStore({task}, 3); nothing was written. Pass RankStore(rank, 2) to resume" in msg
        assert "to capture it again with 3 ranks, pass overwrite=True on every task" in msg
        assert counted.n == 0 and _files(url, None) == before
    assert _task(url, None, 1, WORLD, model, resume=True) == len(job.batches_of(1, WORLD)) * job.BATCH  # same world: continues
    commit_ranks(url)
    ref = _committed(str(tmp_path / "ref.zarr"), None, WORLD, _model(1))
    st = acs.open_store(url)
    assert st.verify() == [] and st.n_samples == ref.n_samples
    for hp in ref.hook_points:
        assert torch.equal(st[hp], ref[hp])


@pytest.mark.parametrize("kind", ["committed", "uncommitted"])
def test_a_capture_again_rerun_with_fewer_tasks_is_refused_naming_the_stale_rank_store(tmp_path, capsys, kind):
    """Captured again by 3 tasks, then rerun with 2 (overwrite=True, e.g. after an allocation
    changed): ranks/00002 of the 3-task attempt is written over by no task of the rerun and
    would have stopped consolidate after the whole rerun. Now every task of the rerun is refused
    before its first forward, naming that rank store and how to remove it, nothing written; once
    it is removed the rerun commits its own 2 ranks. A rank store of the attempt put back after
    the rerun is named by consolidate (nothing written); never a mix of the two attempts."""
    from activationscope import cli

    url = str(tmp_path / "s.zarr")
    if kind == "committed":
        old = _rows(_committed(url, None, WORLD, _model(0)))
    else:  # an uncommitted store of 2 ranks, captured again by 3
        for task in range(WORLD):
            _task(url, None, task, WORLD, _model(0))
        old = None
    for task in range(3):
        _task(url, None, task, 3, _model(1), overwrite=True)
    before = _files(url, None)
    stale = Path(url) / "ranks" / "00002"
    for task in range(WORLD):
        model = _Counted(_model(2))
        with pytest.raises(acs.StoreError) as e:
            _task(url, None, task, WORLD, model, overwrite=True)
        msg = str(e.value)
        assert f"rank store(s) ['00002'] are of an earlier attempt to capture {url!r} again by 3 tasks" in msg, msg
        assert f"this task, RankStore({task}, {WORLD})" in msg and "nothing was written" in msg
        assert f"`rm -r {stale}`" in msg and "run its tasks as RankStore(rank, 3)" in msg
        assert model.n == 0 and _files(url, None) == before
    if old is not None:
        assert all(torch.equal(acs.open_store(url)[hp], rows) for hp, rows in old.items())
    kept = tmp_path / "attempt-00002"
    shutil.move(stale, kept)  # as the message says (kept aside here, to put it back below)
    for task in range(WORLD):
        _task(url, None, task, WORLD, _model(2), overwrite=True)
    shutil.copytree(kept, stale)  # (the 3-task attempt's rank 2, finishing late)
    before = _files(url, None)
    assert cli.main(["consolidate", url]) == 1
    err = capsys.readouterr().err
    if kind == "committed":
        assert "rank(s) [2] are beyond its 2 ranks (captured as ranks of 3 ranks: an earlier attempt" in err, err
    else:  # (the rerun joined the capture the root names; the late rank store is of the attempt to capture it again)
        assert "are of two captures of" in err and "[0, 1] of the capture its root names" in err, err
        assert "[2] of an attempt to capture it again by 3 tasks" in err and f"`rm -r {stale}`" in err, err
    assert str(stale) in err and "nothing was written" in err and _files(url, None) == before
    shutil.rmtree(stale)
    assert cli.main(["consolidate", url]) == 0
    ref = _committed(str(tmp_path / "ref.zarr"), None, WORLD, _model(2))
    st = acs.open_store(url)
    assert st.attrs["distributed"]["world_size"] == WORLD and st.verify() == [] and st.n_samples == ref.n_samples
    for hp in ref.hook_points:
        assert torch.equal(st[hp], ref[hp])


def test_some_columns_of_the_row_table_of_rank_stores_read_as_those_of_the_whole_table(tmp_path):
    """``row_table(kind, columns=[...])`` of a store whose ranks are not committed yet (each
    rank store's table read with those columns, the view's ``rank`` column added) and of the
    committed store: the columns named, in that order, equal to those of the whole table."""
    url = str(tmp_path / "s.zarr")
    model = _model(0)
    for task in range(WORLD):
        _task(url, None, task, WORLD, model)
    for _ in range(2):  # uncommitted, then committed
        st = acs.open_store(url)
        whole = st.row_table("sample")
        assert {"sample_id", "batch", "rank"} <= set(whole.column_names)
        for columns in (["rank", "sample_id"], ["sample_id"], ["batch", "absent"]):
            some = st.row_table("sample", columns=columns)
            found = [c for c in columns if c in whole.column_names]
            assert some.column_names == found
            assert all(some.column(c).to_pylist() == whole.column(c).to_pylist() for c in found)
        commit_ranks(url)
