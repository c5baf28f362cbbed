"""Stores received from someone else: what copying, reading and resuming one does."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Optional

import pytest
import torch
from acs_testing import SumRows
from hostile import HP, edit_root, make_store, root

import activationscope as acs
from activationscope.data.export import export_parquet
from activationscope.errors import (
    HookPointNotFoundError,
    ReductionNotFoundError,
    StoreCorruptError,
    StoreError,
    StoreLockedError,
)
from activationscope.reductions import make_reduction, script_reduction
from activationscope.store import StoreWriter, copy_store, open_store
from activationscope.store.ranks import commit_ranks

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("overwrite", [False, True])
def test_copy_store_refuses_a_store_of_a_newer_format_version(tmp_path, overwrite):
    # copy_store knows which files make up a store of the versions it reads (temporary files are
    # left out, kept files taken instead of damaged ones): a newer version's copy could miss files
    src = tmp_path / "newer.zarr"
    make_store(src)
    edit_root(src, lambda a: a["format"].update(version=5))
    (src / "acts" / HP / "c" / "0" / "0.x.tmp").write_bytes(b"a newer writer's file")
    dst = tmp_path / "copy.zarr"
    old = None
    if overwrite:
        old = make_store(dst)
    before = sorted(p.relative_to(dst) for p in dst.rglob("*")) if overwrite else None
    with pytest.raises(StoreError, match=r"format version 5; this activationscope reads versions up to 4: upgrade "
                                         r"activationscope.*cp -a.*nothing was copied") as e:
        copy_store(src, dst, overwrite=overwrite)
    assert not isinstance(e.value, StoreCorruptError)
    if overwrite:  # the store there is left as it was
        assert sorted(p.relative_to(dst) for p in dst.rglob("*")) == before
        assert torch.equal(open_store(dst)[HP], old) and open_store(dst).verify() == []
    else:
        assert not dst.exists()


def test_copy_store_still_copies_the_versions_it_reads(tmp_path):
    src = tmp_path / "two.zarr"
    rows = make_store(src)
    edit_root(src, lambda a: a["format"].update(version=2))  # (version 1 is version 2 without its fields)
    copy_store(src, tmp_path / "copy.zarr")
    assert root(tmp_path / "copy.zarr")["attributes"]["activationscope"]["format"]["version"] == 2
    assert torch.equal(open_store(tmp_path / "copy.zarr")[HP], rows)
    shutil.rmtree(src)



def test_a_store_moved_under_an_open_reader_says_to_open_it_at_its_new_path(tmp_path):
    path = tmp_path / "s.zarr"
    rows = make_store(path)
    s = open_store(path)
    assert torch.equal(s.rows(HP, 0, 10), rows[:10])
    path.rename(tmp_path / "renamed.zarr")  # handed over: the folder renamed while it was open
    with pytest.raises(StoreError, match=r"s\.zarr' was removed or moved since it was opened .*if it was moved or "
                                         r"renamed, open it at its new path \(open_store\(new path\)") as e:
        s.rows(HP, 200, 210)
    assert not isinstance(e.value, StoreCorruptError)
    assert torch.equal(open_store(tmp_path / "renamed.zarr").rows(HP, 200, 210), rows[200:210])


def _sum_of_squares(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    s = x.double().pow(2).sum(0)
    return s if acc is None else acc + s


def _capture(path, pt, batches):
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU())
    torch.manual_seed(0)
    model.load_state_dict({k: torch.randn_like(v) for k, v in model.state_dict().items()})
    reductions = ["mean"] + ([str(pt)] if pt is not None else [])
    opts = {"resume": True} if pt is None or path.exists() else {}
    scope = acs.ActivationScope(store=str(path), reductions=reductions, store_options=opts)
    with scope.track(model, include=["0"]) as tracker, torch.no_grad():
        for x in batches:
            model(x)
    return tracker


def test_a_received_stores_custom_reduction_reads_without_its_pt_and_nothing_is_loaded(tmp_path, monkeypatch):
    pt = script_reduction(_sum_of_squares, tmp_path / "a" / "sumsq.pt")
    program = pt.read_bytes()
    batches = list(torch.randn(12, 4, generator=torch.Generator().manual_seed(1)).split(5))
    _capture(tmp_path / "a" / "run.zarr", pt, batches)
    received = tmp_path / "b" / "received run.zarr"
    shutil.copytree(tmp_path / "a" / "run.zarr", received)
    shutil.rmtree(tmp_path / "a")  # the sender's folder, .pt included, is gone

    def refuse(*args, **kwargs):
        raise AssertionError("a store's program was loaded")

    monkeypatch.setattr(torch.jit, "load", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    store = open_store(received)
    rows = store["0.output"]
    assert store.verify() == [] and rows.shape == (12, 6)
    expected = None  # the capture's result: the rows of each forward folded in, in order
    for part in rows.split(5):
        expected = _sum_of_squares(expected, part)
    assert torch.equal(store.reductions["0.output"]["sumsq"], expected)
    assert store.reduction_specs("0.output")["sumsq"] == ("script", {})
    assert store.reduction_script("0.output", "sumsq") == program  # its bytes, as they ran
    assert store.info()["status"] == "complete"
    export_parquet(store, tmp_path / "b" / "rows.parquet")
    copy_store(store, tmp_path / "b" / "copy.zarr")
    assert torch.equal(open_store(tmp_path / "b" / "copy.zarr").reductions["0.output"]["sumsq"],
                       store.reductions["0.output"]["sumsq"])
    monkeypatch.undo()

    # a resume without the program leaves its values as they were, reported partial
    before = store.reductions["0.output"]["sumsq"].clone()
    _capture(received, None, [torch.randn(3, 4)])
    again = open_store(received)
    assert again.partial_reductions["0.output"]["sumsq"] == (12, 15)
    assert "sumsq" not in again.reductions["0.output"]

    # the page says what loading a .pt does, and how a received store's program is had
    text = (ROOT / "docs" / "usage" / "reductions.md").read_text()
    assert "a `.pt` is\ncode, so load one only from someone you trust" in text
    assert "never load or run a store's program" in text and "store.reduction_script(hook_point, name)" in text
    assert torch.equal(before, expected)


def test_rank_stores_whose_custom_reduction_program_is_damaged_are_not_committed(tmp_path):
    # rank stores received to be committed (consolidate): a damaged .pt of rank 0 was copied into the
    # committed store with a crc32c computed anew over the damaged bytes, so verify found nothing
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(SumRows())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()
    path = tmp_path / "tasks.zarr"
    xs = list(torch.randn(12, 4, generator=torch.Generator().manual_seed(2)).split(3))
    for task in range(2):
        scope = acs.ActivationScope(store=str(path), reductions=["mean", ("rows", scripted)],
                                    store_options={"shard_rows": 8, "process_group": acs.RankStore(task, 2)})
        with scope.track(model) as tracker, torch.no_grad():
            for b in range(2 * task, 2 * task + 2):
                tracker.set_batch(sample_ids=torch.arange(3 * b, 3 * b + 3))
                model(xs[b])
    pt = path / "ranks" / "00000" / "reductions" / "0.output" / "rows.pt"
    program = pt.read_bytes()
    damaged = bytearray(program)
    damaged[len(damaged) // 2] ^= 0xFF
    pt.write_bytes(bytes(damaged))

    def make(hook_point, name, entry):
        return make_reduction(scripted) if name == "rows" else None

    with pytest.raises(StoreCorruptError, match=r"ranks/00000'.*reduction 'rows': script "
                                                r"'reductions/0.output/rows.pt': crc32c mismatch"):
        commit_ranks(path, make_reduction=make)
    assert open_store(path).status == "incomplete"  # nothing committed
    assert pt.read_bytes() == bytes(damaged)  # and the rank store left as it was

    pt.write_bytes(program)  # restored from an intact copy: it commits
    commit_ranks(path, make_reduction=make)
    store = open_store(path)
    assert store.status == "complete" and store.verify() == []
    assert store.reduction_script("0.output", "rows") == program
    rows = store["0.output"]
    assert rows.shape == (12, 4)
    assert torch.allclose(store.reductions["0.output"]["rows"], rows.double().sum(0), rtol=1e-12, atol=0)


def _lock_of_a_writer_killed_elsewhere(path):
    (path / ".activationscope-writer.lock").write_text(json.dumps(
        {"pid": 1, "host": "capture-node-7", "started": "2026-01-01T00:00:00Z", "token": "0" * 32}))


def test_a_received_store_whose_writer_was_killed_elsewhere_can_replace_a_copy(tmp_path):
    # a capture killed on another machine, then tarred: its lock file still names that writer.
    # No process holds the lock here, so copying it over an existing copy is no race with a writer
    src = tmp_path / "received.zarr"
    rows = make_store(src)
    _lock_of_a_writer_killed_elsewhere(src)
    dst = tmp_path / "mine.zarr"
    make_store(dst, n_rows=64)
    copy_store(src, dst, overwrite=True)
    assert torch.equal(open_store(dst)[HP], rows) and open_store(dst).verify() == []


def test_a_store_a_writer_holds_is_still_refused_as_a_copy_source_and_named(tmp_path):
    src = tmp_path / "live.zarr"
    make_store(src)
    dst = tmp_path / "mine.zarr"
    old = make_store(dst, n_rows=64)
    writer = StoreWriter(src, resume=True)  # holds the lock of src
    try:
        with pytest.raises(StoreLockedError, match=rf"of copy_store is being written by pid {os.getpid()} on host"):
            copy_store(src, dst, overwrite=True)
    finally:
        writer.close()
    assert torch.equal(open_store(dst)[HP], old)


def _writer_started_during_a_look(tmp_path, monkeypatch, look_s: float) -> None:
    """A store whose lock file names a writer killed on another host, a shared look at its lock
    (what writer_holding takes a moment) that ends after ``look_s`` seconds of a starting
    writer's waits (0: at its first wait); the writer must start, and the store stay intact."""
    import fcntl

    from activationscope.store import _lock

    path = tmp_path / "s.zarr"
    make_store(path)
    _lock_of_a_writer_killed_elsewhere(path)  # a stale name the refusal would show
    looker = os.open(path / ".activationscope-writer.lock", os.O_RDONLY)
    fcntl.flock(looker, fcntl.LOCK_SH | fcntl.LOCK_NB)
    real_sleep, slept = _lock.time.sleep, []

    def sleep(s):
        slept.append(s)
        if sum(slept) >= look_s:
            fcntl.flock(looker, fcntl.LOCK_UN)
        real_sleep(s)

    monkeypatch.setattr(_lock.time, "sleep", sleep)
    try:
        writer = StoreWriter(path, resume=True)
    finally:
        os.close(looker)
    monkeypatch.undo()
    writer.close()
    assert open_store(path).verify() == []


def test_a_writer_starting_while_a_copy_looks_at_the_lock_is_not_turned_away(tmp_path, monkeypatch):
    _writer_started_during_a_look(tmp_path, monkeypatch, 0.0)


def test_rank_stores_under_a_root_of_a_newer_format_version_are_not_committed(tmp_path):
    # the commit wrote its version 2 root over a newer activationscope's, reading that store by this version's rules
    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()
    path = tmp_path / "tasks.zarr"
    xs = list(torch.randn(12, 4, generator=torch.Generator().manual_seed(3)).split(3))
    for task in range(2):
        scope = acs.ActivationScope(store=str(path), reductions=["mean"],
                                    store_options={"shard_rows": 8, "process_group": acs.RankStore(task, 2)})
        with scope.track(model) as tracker, torch.no_grad():
            for b in range(2 * task, 2 * task + 2):
                tracker.set_batch(sample_ids=torch.arange(3 * b, 3 * b + 3))
                model(xs[b])
    edit_root(path, lambda a: a["format"].update(version=5))
    before = {p.relative_to(path): p.read_bytes() for p in path.rglob("*") if p.is_file()}
    with pytest.raises(StoreError, match=r"format version 5; this activationscope reads versions up to 4: upgrade "
                                         r"activationscope to commit its rank stores; nothing was changed") as e:
        commit_ranks(path)
    assert not isinstance(e.value, StoreCorruptError)
    assert {p.relative_to(path): p.read_bytes() for p in path.rglob("*") if p.is_file()} == before

    edit_root(path, lambda a: a["format"].update(version=2))  # the version it was written with: commits
    commit_ranks(path)
    store = open_store(path)
    assert store.status == "complete" and store.verify() == []
    with torch.no_grad():
        assert torch.equal(store["0.output"], torch.cat([model(x) for x in xs]))


def test_a_look_at_the_lock_that_lasts_a_few_time_slices_does_not_turn_a_writer_away(tmp_path, monkeypatch):
    """A process descheduled between taking and dropping its shared look at the lock (a busy
    machine) held it for longer than the 20 ms a starting writer waited: the writer was refused,
    naming the dead writer the file still names. It now waits up to 200 ms."""
    _writer_started_during_a_look(tmp_path, monkeypatch, 0.06)


def test_the_program_of_a_reduction_the_store_does_not_hold_is_an_error(tmp_path):
    """store.reduction_script of a misspelt reduction or hook point returned None, as for a
    built-in reduction, so writing the program to a file failed later with a bare TypeError
    naming neither. Each is now an error naming what the store holds; None stays the answer
    for a reduction without a program."""
    pt = script_reduction(_sum_of_squares, tmp_path / "sumsq.pt")
    _capture(tmp_path / "run.zarr", pt, [torch.randn(3, 4)])
    store = open_store(tmp_path / "run.zarr")
    assert store.reduction_script("0.output", "sumsq") == pt.read_bytes()
    assert store.reduction_script("0.output", "mean") is None  # a built-in: no program
    assert store.reduction_script("0.output", "mean.count") is None  # (one of its result arrays)
    with pytest.raises(ReductionNotFoundError, match=r"hook point '0.output' has no reduction named 'sumsqr'; its "
                                                     r"reductions are \['mean', 'sumsq'\] \(those with a program: "
                                                     r"\['sumsq'\]\)"):
        store.reduction_script("0.output", "sumsqr")
    with pytest.raises(HookPointNotFoundError, match=r"hook point '0' has no reductions in the store .*; hook points "
                                                     r"with reductions: \['0.output'\]"):
        store.reduction_script("0", "sumsq")
