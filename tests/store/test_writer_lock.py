"""One writer at a time: a second writer (same or another process, new store, resume or
overwrite) gets StoreLockedError naming the holder; the first one's rows stay intact."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import activationscope as acs
from acs_testing import run_as_other_user
from activationscope.errors import StoreError, StoreLockedError
from activationscope.store import StoreWriter, copy_store, open_store
from activationscope.store._backend import LOCK_KEY

ROOT = Path(__file__).resolve().parents[2]


def _write_rows(w: StoreWriter, rows: torch.Tensor) -> None:
    a = w.open_array("x", (rows.shape[1],), rows.dtype, "sample")
    a.append(rows)
    w.add_batch(rows.shape[0])


@pytest.mark.parametrize("second", [{}, {"resume": True}, {"overwrite": True}])
def test_second_writer_in_the_same_process(tmp_path, second):
    path = tmp_path / "s.zarr"
    rows = torch.randn(10, 3)
    w = StoreWriter(path)
    _write_rows(w, rows)
    with pytest.raises(StoreLockedError, match=rf"being written by pid {os.getpid()} on host '{socket.gethostname()}'") as e:
        StoreWriter(path, **second)
    assert isinstance(e.value, StoreError)
    w.close()
    s = open_store(path)
    assert s.status == "complete" and torch.equal(s["x"], rows)  # overwrite=True deleted nothing
    StoreWriter(path, resume=True).close()  # free again once closed


def test_lock_released_by_abort_and_by_a_failed_open(tmp_path):
    path = tmp_path / "s.zarr"
    with pytest.raises(RuntimeError):
        with StoreWriter(path) as w:
            _write_rows(w, torch.randn(4, 2))
            raise RuntimeError("stop")
    with pytest.raises(acs.StoreExistsError):
        StoreWriter(path)  # exists: refused, and the lock is given back
    StoreWriter(path, resume=True).close()
    with pytest.raises(StoreError, match="nothing to resume"):
        StoreWriter(tmp_path / "nothing.zarr", resume=True)
    assert not (tmp_path / "nothing.zarr").exists()  # the folder the lock made is removed again


def _listing(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_refused_writer_leaves_the_folder_as_it_found_it(tmp_path):
    """A folder that is not a store, and a store without a lock file (a copy): a writer (or
    copy_store) that refuses them leaves no lock file behind."""
    folder = tmp_path / "papers"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    before = _listing(folder)
    with pytest.raises(acs.StoreExistsError, match="holds no Zarr store"):
        StoreWriter(folder)
    with pytest.raises(acs.StoreExistsError, match="holds no Zarr store"):
        StoreWriter(folder, overwrite=True)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(acs.StoreExistsError):
        with acs.ActivationScope(store=str(folder)).track(model):
            model(torch.randn(3, 2))
    with StoreWriter(tmp_path / "src.zarr") as w:
        _write_rows(w, torch.randn(4, 2))
    with pytest.raises(acs.StoreExistsError, match="not empty"):
        copy_store(tmp_path / "src.zarr", folder)
    with pytest.raises(acs.StoreError, match="none.zarr' of copy_store must be a store"):  # (no source: refused first)
        copy_store(tmp_path / "none.zarr", folder, overwrite=True)
    assert _listing(folder) == before
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]

    path = tmp_path / "s.zarr"
    with StoreWriter(path) as w:
        _write_rows(w, torch.randn(4, 2))
    (path / LOCK_KEY).unlink()  # as a copy of the store would be
    before = _listing(path)
    with pytest.raises(acs.StoreExistsError, match="already exists"):
        StoreWriter(path)
    assert _listing(path) == before
    StoreWriter(path, resume=True).close()  # a writer that opened it keeps its (released) lock file
    assert (path / LOCK_KEY).read_bytes() == b""


def test_lock_file_is_not_part_of_the_store(tmp_path):
    path = tmp_path / "s.zarr"
    with StoreWriter(path) as w:
        _write_rows(w, torch.randn(4, 2))
        assert json.loads((path / LOCK_KEY).read_text())["pid"] == os.getpid()
    s = open_store(path)
    assert s.verify() == []
    copy = tmp_path / "copy.zarr"
    copy_store(s, copy)
    assert not (copy / LOCK_KEY).exists() or (copy / LOCK_KEY).read_bytes() == b""
    assert LOCK_KEY not in list(s._backend.list(""))


_HOLDER = textwrap.dedent("""
    import sys, torch
    from activationscope.store import StoreWriter
    w = StoreWriter(sys.argv[1])
    a = w.open_array("x", (3,), torch.float32, "sample")
    a.append(torch.ones(8, 3))
    w.add_batch(8)
    print("holding", flush=True)
    sys.stdin.readline()
    w.close()
    print("closed", flush=True)
""")


def test_second_writer_in_another_process(tmp_path):
    path = tmp_path / "s.zarr"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "holding", child.stderr.read()
        for options in ({}, {"overwrite": True}, {"resume": True}):
            with pytest.raises(StoreLockedError, match=rf"pid {child.pid} on host"):
                StoreWriter(path, **options)
        with pytest.raises(StoreLockedError):
            copy_store(open_store(path), path, overwrite=True)
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "closed"
    finally:
        child.wait(timeout=60)
    assert child.returncode == 0
    assert torch.equal(open_store(path)["x"], torch.ones(8, 3))
    StoreWriter(path, resume=True).close()


def test_killed_holder_releases_the_lock(tmp_path):
    path = tmp_path / "s.zarr"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    assert child.stdout.readline().strip() == "holding"
    child.kill()
    child.wait(timeout=60)
    StoreWriter(path, resume=True).close()  # the kernel released the flock


def test_object_store_marker(tmp_path):
    url = "memory://acs-lock-test/run.zarr"
    w = StoreWriter(url, overwrite=False)
    _write_rows(w, torch.randn(5, 2))
    with pytest.raises(StoreLockedError, match=rf"pid {os.getpid()}.*that writer is in this process and still open"):
        StoreWriter(url, overwrite=True)  # (a writer of another process: see the next test)
    w.close()
    s = open_store(url)
    assert s.n_rows("x") == 5
    w2 = StoreWriter(url, resume=True)
    w2.close()


def test_object_store_marker_of_a_dead_writer_is_taken_over(tmp_path):
    import zarr

    ms = zarr.storage.MemoryStore()
    from activationscope.store._backend import resolve

    b = resolve(ms)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    b.set(LOCK_KEY, json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": "x", "token": "t"}).encode())
    StoreWriter(ms).close()  # taken over
    b.set(LOCK_KEY, json.dumps({"pid": 1, "host": "another-host", "started": "x", "token": "t"}).encode())
    with pytest.raises(StoreLockedError, match=rf"pid 1 on host 'another-host'.*if that writer is gone, delete .*{LOCK_KEY}"):
        StoreWriter(ms, resume=True)


_RACER = textwrap.dedent("""
    import sys, torch
    from activationscope.errors import StoreLockedError
    from activationscope.store import StoreWriter
    me = int(sys.argv[1])
    while True:
        cmd = sys.stdin.readline().split()
        if not cmd or cmd[0] == "quit":
            break
        mode, path, rnd = cmd[0], cmd[1], int(cmd[2])
        print("ready", flush=True)
        assert sys.stdin.readline().strip() == "go"
        try:
            w = StoreWriter(path, resume=mode == "resume", overwrite=mode == "overwrite")
        except StoreLockedError as e:
            print("locked", str(e).replace("\\n", " "), flush=True)
            continue
        print("acquired", flush=True)
        a = w.open_array("x", (4,), torch.float32, "sample")
        a.append(torch.full((32, 4), float(me * 1000 + rnd)))
        w.add_batch(32, list(range(rnd * 1000 + me * 100, rnd * 1000 + me * 100 + 32)))
        assert sys.stdin.readline().strip() == "close"  # held until the other one has tried
        w.close()
        print("closed", flush=True)
""")


def _line(p: subprocess.Popen, timeout: float = 60) -> str:
    import select

    ready, _, _ = select.select([p.stdout], [], [], timeout)
    assert ready, f"racer {p.pid} said nothing for {timeout} s"
    return p.stdout.readline().strip()


def test_two_processes_race_for_one_store(tmp_path):
    """Two real processes open the same store as writers at the same moment (a new store,
    both resuming, both overwriting), round after round: exactly one gets the store, the
    other gets StoreLockedError naming the holder's pid and host, and afterwards the store
    holds exactly the winner's rows (after the earlier ones, on resume) and verifies clean."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    racers = [subprocess.Popen([sys.executable, "-c", _RACER, str(i)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env) for i in (1, 2)]
    first = torch.arange(64, dtype=torch.float32).view(16, 4)
    wins = {1: 0, 2: 0}
    try:
        for rnd in range(15):
            mode = ("new", "resume", "overwrite")[rnd % 3]
            path = tmp_path / f"r{rnd}.zarr"
            if mode != "new":
                with StoreWriter(path) as w:
                    _write_rows(w, first)
            for p in racers:
                p.stdin.write(f"{mode} {path} {rnd}\n")
                p.stdin.flush()
            assert [_line(p) for p in racers] == ["ready", "ready"]
            for p in racers:  # both start at once
                p.stdin.write("go\n")
                p.stdin.flush()
            said = [_line(p) for p in racers]
            assert sorted(s.split()[0] for s in said) == ["acquired", "locked"], (rnd, mode, said)
            won = said.index("acquired")
            winner = racers[won]
            assert f"pid {winner.pid} on host {socket.gethostname()!r}" in said[1 - won], said
            winner.stdin.write("close\n")
            winner.stdin.flush()
            assert _line(winner) == "closed", winner.stderr.read()
            wins[won + 1] += 1
            s = open_store(path)
            mine = torch.full((32, 4), float((won + 1) * 1000 + rnd))
            want = torch.cat([first, mine]) if mode == "resume" else mine
            assert torch.equal(s["x"], want), (rnd, mode)
            assert s.n_samples == want.shape[0] and s.verify() == []
    finally:
        for p in racers:
            try:
                p.stdin.write("quit\n")
                p.stdin.flush()
            except OSError:
                pass
            p.wait(timeout=60)
    assert [p.returncode for p in racers] == [0, 0], [p.stderr.read()[-2000:] for p in racers]


def test_a_store_folder_that_cannot_be_made_is_a_store_error(tmp_path):
    """A store path whose folder cannot be created (here under /proc, which refuses new
    entries even to root) is a StoreError naming the store and what to choose, not the raw
    FileNotFoundError / PermissionError of mkdir."""
    if not os.path.isdir("/proc/self"):
        pytest.skip("needs Linux's /proc")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(StoreError, match=r"store '/proc/acs-new\.zarr': cannot create its folder: .*choose a "
                                         r"store path where this process may create folders"):
        with acs.ActivationScope(store="/proc/acs-new.zarr").track(model):
            model(torch.randn(2, 4))
    assert not os.path.exists("/proc/acs-new.zarr")


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to act as another user")
def test_a_store_read_only_to_this_user_reads_and_refuses_writers_with_the_fix():
    """A store another user made and this user may only read (a colleague's shared store):
    it opens and reads; a resume or an overwrite is refused before anything is touched, a
    StoreError that says the store is read-only here and how to go on (copy it), and the
    store's files are unchanged."""
    import shutil
    import tempfile

    tmp_path = Path(tempfile.mkdtemp(prefix="acs-shared-"))  # (pytest's own folder is closed to other users)
    try:
        _read_only_store_checks(tmp_path)
    finally:
        for folder, _dirs, _files in os.walk(tmp_path):
            os.chmod(folder, 0o755)
        shutil.rmtree(tmp_path)


def _read_only_store_checks(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    path = tmp_path / "shared.zarr"
    x = torch.randn(3, 4)
    with torch.no_grad(), acs.ActivationScope(store=str(path), reductions=["mean"]).track(model):
        model(x)
    for opts in ({}, {"resume": True}):  # (imports a resume needs, made before the child drops root)
        with torch.no_grad(), acs.ActivationScope(store=str(tmp_path / "warm.zarr"), store_options=opts,
                                                  reductions=["mean"]).track(model):
            model(x)
    for folder, _dirs, files in os.walk(path):
        os.chmod(folder, 0o555)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o444)
    os.chmod(tmp_path, 0o755)
    before = _listing(path)

    with torch.no_grad():
        expected = model(x)

    def read() -> None:
        s = open_store(str(path))
        if not torch.equal(s["0.output"], expected):  # (torch.testing imports more in the child)
            raise AssertionError(f"read other values: {s['0.output']} != {expected}")

    got = run_as_other_user(read)
    assert got == ("", ""), got
    for opts in ({"resume": True}, {"overwrite": True}):
        def write(opts=opts) -> None:
            with torch.no_grad(), acs.ActivationScope(store=str(path), store_options=opts,
                                                      reductions=["mean"]).track(model):
                model(x)

        name, msg = run_as_other_user(write)
        assert name == "StoreError", (name, msg)
        assert "cannot open the writer lock" in msg and "Permission denied" in msg
        assert "read-only to this process" in msg and "copy_store" in msg
    assert _listing(path) == before


def _four_commits(path):
    """A writer of hook point 'x' (8 floats a row) after 4 committed forwards of 5 rows (row values
    the forward's number): the writer, its array and the samples committed."""
    a = StoreWriter(path, chunk_rows=4, shard_bytes=4 * 8 * 4 * 2, commit_interval=0)
    arr = a.open_array("x", (8,), torch.float32, "sample")
    for i in range(4):
        arr.append(torch.full((5, 8), float(i)))
        a.add_batch(5, list(range(i * 5, i * 5 + 5)))
        a._core.drain()
        a.commit()
    return a, arr, open_store(path).n_samples


@pytest.mark.parametrize("how", ["moved", "removed"])
def test_a_writer_whose_store_folder_was_replaced_writes_nothing_into_the_new_one(tmp_path, how):
    """The store folder moved away (or deleted) while a writer writes it, and another writer
    makes a new store at the path: the first one's next commit, close and abort write nothing
    there (its commits went to a folder that is no longer at its path; writing its root over
    the new store's would take that store's rows away). The new store stays whole, and a moved
    one keeps every row its writer committed."""
    path = tmp_path / "s.zarr"
    a, arr, committed = _four_commits(path)
    assert committed > 0
    arr.append(torch.full((5, 8), 4.0))
    a.add_batch(5, list(range(20, 25)))
    a._core.drain()
    deadline = time.monotonic() + 10  # (the spare files of its next commit made, in the folder it wrote)
    while not {"zarr.json", "acts/x/manifest.json"} <= set(a._backend._spare) and time.monotonic() < deadline:
        time.sleep(0.005)
    if how == "moved":
        os.rename(path, tmp_path / "old.zarr")
    else:  # (renamed first: the writer's background thread may be making a spare file in it)
        import shutil

        os.rename(path, tmp_path / "trash")
        shutil.rmtree(tmp_path / "trash")
    with StoreWriter(path) as b:
        _write_rows(b, torch.full((3, 2), 9.0))
    new = _listing(path)
    with pytest.raises(StoreError, match=r"s\.zarr.*(moved|removed|replaced).*nothing"):
        a.commit()
    with pytest.raises(StoreError, match=r"s\.zarr.*(moved|removed|replaced)"):
        a.close()
    a.abort()
    assert _listing(path) == new
    s = open_store(path)
    assert s.hook_points == ["x"] and torch.equal(s["x"], torch.full((3, 2), 9.0)) and s.verify() == []
    if how == "moved":
        old = open_store(tmp_path / "old.zarr")
        assert old.n_samples == committed and old.verify() == []
        assert torch.equal(old["x"], torch.cat([torch.full((5, 8), float(i)) for i in range(4)])[:committed])


def test_a_writer_whose_lock_file_was_deleted_and_taken_writes_no_shard_at_its_close(tmp_path):
    """The lock file of a local writer still alive deleted by hand, and the store taken by a
    second writer (resume): the first one's commit says nothing more is written there, and its
    close then wrote the rows still in its chunk buffers as shards into the second writer's
    store (a partial shard renamed to a shard key, a rewrite of its partial last shard). The
    close writes nothing there, so the second writer's store stays whole."""
    path = tmp_path / "s.zarr"
    a, arr, committed = _four_commits(path)
    arr.append(torch.full((5, 8), 4.0))  # (rows past a whole chunk: in the writer's buffers until its close)
    a.add_batch(5, list(range(20, 25)))
    a._core.drain()
    a._backend.release()  # (no spare file of its next commit made meanwhile)
    (path / LOCK_KEY).unlink()
    with StoreWriter(path, resume=True) as b:
        _write_rows(b, torch.full((16, 8), 9.0))  # (into the shards the first one's rows would go to)
    new = _listing(path)
    with pytest.raises(StoreError, match=r"s\.zarr.*(moved|removed|replaced).*nothing"):
        a.commit()
    with pytest.raises(StoreError, match=r"s\.zarr.*(moved|removed|replaced)"):
        a.close()
    assert sorted(k for k in set(_listing(path)) | set(new) if _listing(path).get(k) != new.get(k)) == []
    s = open_store(path)
    assert s.n_samples == committed + 16 and s.verify() == []
    assert torch.equal(s["x"][committed:], torch.full((16, 8), 9.0))


def test_a_writer_told_its_lock_was_taken_refuses_every_later_write(tmp_path):
    """After a commit said the store is no longer this writer's (its lock file deleted, the
    store taken by a second writer), rows appended to its array went on as full shards into
    the second writer's store (over that writer's shard 2, whose rows then failed their
    crc32c). Every later append, batch, array, alias, reduction and commit is refused
    (StoreError naming the path), and nothing of them is written there."""
    path = tmp_path / "s.zarr"
    a = StoreWriter(path, chunk_rows=4, shard_bytes=4 * 8 * 4 * 2, commit_interval=0)  # shards of 8 rows
    arr = a.open_array("x", (8,), torch.float32, "sample")
    for i in range(2):
        arr.append(torch.full((8, 8), float(i)))
        a.add_batch(8)
        a._core.drain()
        a.commit()
    assert open_store(path).n_samples == 16
    a._backend.release()  # (no spare file of its next commit made meanwhile)
    (path / LOCK_KEY).unlink()
    with StoreWriter(path, resume=True) as b:
        _write_rows(b, torch.full((3, 8), 9.0))  # (rows 16-18: its shard 2, partial)
    new = _listing(path)
    lost = r"s\.zarr.*(moved|removed|replaced).*nothing more is written"
    with pytest.raises(StoreError, match=lost):
        a.commit()
    with pytest.raises(StoreError, match=lost):
        arr.append(torch.full((16, 8), 7.0))  # (shards 2 and 3 of the first writer)
    for write in (lambda: a.add_batch(16), lambda: a.open_array("y", (2,), torch.float32, "sample"),
                  lambda: a.add_alias("z", "x"), lambda: a.add_reductions("x", "mean", torch.zeros(8)),
                  a.maybe_commit, a.commit):
        with pytest.raises(StoreError, match=lost):
            write()
    a._core.drain()
    with pytest.raises(StoreError, match=lost):
        a.close()
    assert _listing(path) == new
    s = open_store(path)
    assert s.n_samples == 19 and s.verify() == []
    assert torch.equal(s["x"][:], torch.cat([torch.zeros(8, 8), torch.ones(8, 8), torch.full((3, 8), 9.0)]))


def test_a_writer_whose_object_store_marker_was_taken_writes_nothing_more(tmp_path):
    """On object storage the marker of a writer still alive deleted by hand (as the refusal of
    a second writer tells to do for a writer that is gone) and taken by a second writer: the
    first one's next commit and close write nothing, so the second one's store stays whole."""
    url = "memory://acs-lock-taken/run.zarr"
    a = StoreWriter(url, commit_interval=0, chunk_rows=4, shard_bytes=4 * 2 * 4)
    arr = a.open_array("x", (2,), torch.float32, "sample")
    arr.append(torch.ones(4, 2))
    a.add_batch(4)
    a._core.drain()
    a.commit()
    assert open_store(url).n_samples == 4
    resolve_backend = __import__("activationscope.store._backend", fromlist=["resolve"]).resolve
    resolve_backend(url).delete(LOCK_KEY)
    b = StoreWriter(url, resume=True)
    _write_rows(b, torch.full((3, 2), 9.0))
    b.close()
    arr.append(torch.zeros(5, 2))
    a.add_batch(5)
    with pytest.raises(StoreError, match=rf"{LOCK_KEY}.*(gone|held by pid {os.getpid()}).*writes nothing more"):
        a.commit()
    with pytest.raises(StoreError, match="writes nothing more"):
        a.close()
    s = open_store(url)
    assert s.n_samples == 7 and torch.equal(s["x"], torch.cat([torch.ones(4, 2), torch.full((3, 2), 9.0)]))
    assert s.status == "complete" and s.verify() == []


def test_removing_an_empty_store_checks_it_under_the_lock(tmp_path, monkeypatch):
    """remove_if_empty (what a capture whose first forward raised calls on its store) looked at
    the store, then took the writer lock and deleted everything: a resume that took the store
    and committed rows in between lost them. The store is looked at under the lock."""
    from activationscope.store import _remove, remove_if_empty

    path = tmp_path / "s.zarr"
    StoreWriter(path).close()  # a store of no rows
    rows = torch.randn(6, 3)
    acquire = _remove.WriterLock.acquire

    def another_writer_first(self):
        if not getattr(another_writer_first, "done", False):
            another_writer_first.done = True
            with StoreWriter(path, resume=True) as w:  # takes the store and commits rows meanwhile
                _write_rows(w, rows)
        return acquire(self)

    monkeypatch.setattr(_remove.WriterLock, "acquire", another_writer_first)
    assert remove_if_empty(path) is False
    s = open_store(path)
    assert s.n_samples == 6 and torch.equal(s["x"], rows) and s.verify() == []


def test_a_copy_onto_its_own_store_or_a_folder_of_other_files_deletes_nothing(tmp_path):
    """copy_store(..., overwrite=True) cleared the target before it read the source: onto the
    source itself (its path, a link to it, or a folder holding it) it deleted the store, and
    onto a folder that is not a store it deleted the files there. Both are refused (StoreError
    naming both paths; StoreExistsError as a writer's overwrite=True refuses a folder that
    holds no store), and nothing is deleted."""
    path = tmp_path / "s.zarr"
    rows = torch.randn(5, 3)
    with StoreWriter(path) as w:
        _write_rows(w, rows)
    os.symlink(path, tmp_path / "alias.zarr")
    for target in (path, tmp_path / "alias.zarr", tmp_path):
        with pytest.raises(StoreError, match="itself|holds no Zarr store"):
            copy_store(path, target, overwrite=True)
        with pytest.raises(StoreError, match="itself|holds no Zarr store"):
            open_store(path).save(target, overwrite=True)
        s = open_store(path)
        assert torch.equal(s["x"], rows) and s.verify() == [], target
    folder = tmp_path / "papers"
    (folder / "sub").mkdir(parents=True)
    (folder / "notes.txt").write_text("mine")
    (folder / "sub" / "data.csv").write_text("mine too")
    before = _listing(folder)
    with pytest.raises(acs.StoreExistsError, match="holds no Zarr store"):
        copy_store(path, folder, overwrite=True)
    assert _listing(folder) == before and not (folder / LOCK_KEY).exists()
    other = tmp_path / "other.zarr"  # a store is still replaced
    with StoreWriter(other) as w:
        _write_rows(w, torch.zeros(2, 3))
    copy_store(path, other, overwrite=True)
    assert torch.equal(open_store(other)["x"], rows)


def test_an_object_store_marker_of_a_writer_dropped_unclosed_is_taken_over_by_the_same_process(tmp_path):
    """On object storage a writer garbage collected without a close (its capture loop failed
    outside a ``with`` block) left its marker, naming this very process, which is alive: the
    same process could not resume the store until the marker was deleted by hand (a local
    store's flock goes with the dropped writer). Such a marker is taken over; one held by a live
    writer of this process is still refused."""
    import gc

    url = "memory://acs-lock-dropped/run.zarr"
    w = StoreWriter(url, chunk_rows=1, shard_bytes=8, commit_interval=0)
    a = w.open_array("x", (2,), torch.float32, "sample")
    a.append(torch.ones(3, 2))
    w.add_batch(3)
    w._core.drain()
    w.commit()
    holder = StoreWriter("memory://acs-lock-dropped/other.zarr")  # a live writer of this process
    with pytest.raises(StoreLockedError, match=rf"pid {os.getpid()}"):
        StoreWriter("memory://acs-lock-dropped/other.zarr", resume=True)
    del a, w
    gc.collect()
    again = StoreWriter(url, resume=True)
    assert again.n_samples_committed == 3
    _write_rows(again, torch.zeros(2, 2))
    again.close()
    holder.close()
    assert open_store(url).n_samples == 5


def test_an_object_store_marker_released_while_a_writer_starts_is_taken(monkeypatch):
    """Two writers start on one object store, and the holder of the marker lets it go (a writer
    refused with StoreExistsError, or one that closed) between the other's conditional put
    and its read of the marker: the store is free, yet that writer raised StoreLockedError
    "being written by another process (it has not written its pid yet)"; now it takes the lock."""
    from activationscope.store import _backend

    url = "memory://acs-lock-released/run.zarr"
    set_if_absent = _backend.FsspecBackend.set_if_absent
    raced = []

    def holder_lets_go_meanwhile(self, key, data):
        if key == LOCK_KEY and not raced:
            raced.append(key)
            assert set_if_absent(self, key, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                                        "started": "x", "token": "other"}).encode())
            taken = set_if_absent(self, key, data)  # refused: the other writer holds it
            self.delete(key)  # ... and lets it go before this writer reads who holds it
            return taken
        return set_if_absent(self, key, data)

    monkeypatch.setattr(_backend.FsspecBackend, "set_if_absent", holder_lets_go_meanwhile)
    w = StoreWriter(url)
    try:
        assert raced
        _write_rows(w, torch.arange(6.0).reshape(3, 2))
    finally:
        w.close()
    assert torch.equal(open_store(url)["x"], torch.arange(6.0).reshape(3, 2))
    with pytest.raises(StoreLockedError, match=rf"pid {os.getpid()}"):  # a held marker still refuses
        with StoreWriter(url, resume=True):
            StoreWriter(url, resume=True)


def test_a_second_capture_while_a_tracker_of_this_process_holds_the_store_names_what_releases_it(tmp_path):
    # the message said "call its close()", which a Tracker has not (AttributeError): it is remove()
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    path = str(tmp_path / "s.zarr")
    first = acs.ActivationScope(store=path).track(model)
    first.attach()
    with torch.no_grad():
        model(torch.ones(3, 2))
    with pytest.raises(acs.StoreLockedError, match=r"still open: close it first \(leave its `with` block, or call "
                                                   r"its close\(\), tracker\.remove\(\) for a tracker; one whose close a "
                                                   r"Ctrl-C cut short holds the store until that close\(\) or "
                                                   r"tracker\.remove\(\) is called again, which finishes it\)\n"
                                                   r"it is held by a tracker of "
                                                   r"Sequential attached in this process and not closed"):
        acs.ActivationScope(store=path, store_options={"overwrite": True}).track(model).attach()
    first.remove()  # (what the message says releases it)
    assert acs.open_store(path).status == "complete" and acs.open_store(path).n_rows("0.output") == 3
    with acs.ActivationScope(store=path, store_options={"resume": True}).track(model), torch.no_grad():
        model(torch.ones(2, 2))
    assert acs.open_store(path).n_rows("0.output") == 5


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_second_writer_of_the_same_process_is_told_to_close_the_first(tmp_path, where):
    """The holder is a writer of this process that is still open: the message says so and how to
    go on, not to delete a lock file (that writer is not gone); the first writer goes on."""
    import uuid

    from activationscope.store import StoreWriter

    target = str(tmp_path / "s.zarr") if where == "local" else f"memory://same-{uuid.uuid4().hex}.zarr"
    first = StoreWriter(target, capture_config={}, model=None, storage_dtype=None)
    with pytest.raises(acs.StoreLockedError, match=rf"pid {os.getpid()} .*that writer is in this process and still "
                       r"open: close it first \(leave its `with` block, or call its close\(\), tracker\.remove\(\) "
                       r"for a tracker; one whose close a Ctrl-C cut short holds the store until that close\(\) or "
                       r"tracker\.remove\(\) is called again, which finishes it\)$") as e:
        StoreWriter(target, capture_config={}, model=None, storage_dtype=None, resume=True)
    assert "delete" not in str(e.value)
    first.open_array("x", (2,), torch.float32, "sample").append(torch.ones(3, 2))
    first.add_batch(3, [0, 1, 2], None, {})
    first.close()
    assert torch.equal(acs.open_store(target)["x"], torch.ones(3, 2))


def test_ctrl_c_while_taking_the_lock_keeps_no_lock(tmp_path):
    # Ctrl-C at any line of taking the lock, whose frames a notebook keeps alive (its last
    # traceback): the next writer of this process takes the store, not a StoreLockedError
    # naming "another process (it has not written its pid yet)"
    from acs_testing import InterruptAt

    from activationscope.store._backend import LocalBackend
    from activationscope.store._lock import WriterLock

    path = tmp_path / "s.zarr"
    with InterruptAt(None) as count:
        WriterLock(LocalBackend(path)).acquire().discard_root()
    assert count.n > 10
    for k in range(1, count.n + 2):
        lock = WriterLock(LocalBackend(path))
        with pytest.raises(KeyboardInterrupt) as interrupted, InterruptAt(k) as where:
            lock.acquire()
            raise KeyboardInterrupt  # (k past the last line: taken)
        if not interrupted.value.args:
            lock.discard_root()
        try:
            other = WriterLock(LocalBackend(path)).acquire()  # (`lock` and the traceback still alive)
        except StoreLockedError as e:
            pytest.fail(f"Ctrl-C at {where.where} kept the lock: {e}")
        other.discard_root()
    assert count.n >= k - 1 and not interrupted.value.args


def test_ctrl_c_while_taking_the_lock_of_a_new_store_leaves_no_folder(tmp_path):
    # Ctrl-C after the lock made the store's folder (and its lock file) but before it held the
    # lock left that folder behind, with the lock file in it
    from acs_testing import InterruptAt

    from activationscope.store._backend import LocalBackend
    from activationscope.store._lock import WriterLock

    with InterruptAt(None) as count:
        WriterLock(LocalBackend(tmp_path / "count.zarr")).acquire().discard_root()
    for k in range(1, count.n + 1):
        path = tmp_path / f"s{k}.zarr"
        lock = WriterLock(LocalBackend(path))
        try:
            with InterruptAt(k) as where:
                lock.acquire()
        except KeyboardInterrupt:
            assert not path.exists(), f"Ctrl-C at {where.where} left {sorted(os.listdir(path))} in a new folder"
        else:
            lock.discard_root()


@pytest.mark.parametrize("failing", [False, True], ids=["block-ends", "block-raises"])
def test_ctrl_c_at_any_line_of_a_writer_lock_leaves_no_marker(failing):
    # a marker on object storage left by a lock interrupted as it was taken (the marker written,
    # the token not yet noted) or given back (release, or __exit__ before it) refused every writer
    # of another host until deleted by hand; now the lock is given back, whatever line was interrupted
    from acs_testing import InterruptAt

    from activationscope.store._backend import resolve
    from activationscope.store._lock import WriterLock, writer_holding

    def cell(url):
        with WriterLock(resolve(url)):
            if failing:
                raise ValueError("the block failed")

    with InterruptAt(None) as count, pytest.raises(ValueError) if failing else contextlib.nullcontext():
        cell("memory://acs-lock-ctrl-c/count.zarr")
    assert count.n > 10
    interrupted = 0
    for k in range(1, count.n + 1):
        url = f"memory://acs-lock-ctrl-c/{failing}-{k}.zarr"
        try:
            with InterruptAt(k) as where:
                cell(url)
        except KeyboardInterrupt:
            interrupted += 1
        except ValueError:  # (the lines run vary a little: a marker taken over the first time)
            pass
        assert writer_holding(resolve(url)) is None, where.where
        with WriterLock(resolve(url)):
            pass
    assert interrupted > count.n // 2


def test_ctrl_c_at_any_line_of_giving_the_lock_back_never_touches_a_file_opened_since(tmp_path):
    # a Ctrl-C after the lock file's descriptor was closed but before it was forgotten: the give-
    # back run again (release's handler) truncated, unlocked and closed that number again, by
    # then another file's (here one opened as the Ctrl-C comes, as the writer thread opens shards)
    from acs_testing import InterruptAt

    from activationscope.store._backend import LocalBackend
    from activationscope.store._lock import WriterLock

    class OpenAsInterrupted(InterruptAt):
        def _line(self, frame, event, arg):
            try:
                return super()._line(frame, event, arg)
            except KeyboardInterrupt:
                self.opened = open(victim, "r+")  # (the lowest free number: the one just closed, if any)
                raise

    victim = tmp_path / "victim.txt"
    path = tmp_path / "s.zarr"
    lock = WriterLock(LocalBackend(path)).acquire()
    with InterruptAt(None) as count:
        lock.release()
    assert count.n >= 5
    for k in range(1, count.n + 1):
        victim.write_text("kept")
        lock = WriterLock(LocalBackend(path)).acquire()
        with pytest.raises(KeyboardInterrupt), OpenAsInterrupted(k) as where:
            lock.release()
        with where.opened as opened:
            assert os.fstat(opened.fileno()).st_size == 4, where.where
            lock.release()  # (run again, as a rerun would: finishes what is left, if anything)
            assert os.fstat(opened.fileno()).st_size == 4 and opened.read() == "kept", where.where
        WriterLock(LocalBackend(path)).acquire().release()  # (given back: taken again)
