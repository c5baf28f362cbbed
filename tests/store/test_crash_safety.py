"""Kill -9 at any moment, disk full, concurrent readers, resume."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import activationscope as acs
from activationscope.store import StoreWriter, copy_store, open_store

import store_child
from store_models import MLP, batches_mlp, capture_memory

HERE = Path(__file__).parent
N_BATCHES = 12


def _child(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, str(HERE / "store_child.py"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted store and the in-memory capture of the same run."""
    path = tmp_path_factory.mktemp("ref") / "ref.zarr"
    store_child.capture(str(path), N_BATCHES)
    torch.manual_seed(0)
    mem = capture_memory(MLP().eval(), batches_mlp(n_batches=N_BATCHES, batch=store_child.BATCH))
    return open_store(path), mem


def _assert_equal_stores(a, b):
    assert sorted(a.hook_points) == sorted(b.hook_points)
    for hp in a.hook_points:
        assert torch.equal(a[hp], b[hp]), hp
    for kind in ("sample", "token"):
        assert a.row_table(kind).to_pydict() == b.row_table(kind).to_pydict()
    assert a.n_samples == b.n_samples


@pytest.mark.parametrize("kill_after", [0, 3, 8])
def test_sigkill_then_resume_equals_uninterrupted(tmp_path, reference, kill_after):
    ref_store, mem = reference
    path = tmp_path / "s.zarr"
    proc = _child(str(path), "run", str(N_BATCHES), "0.02")
    try:
        for line in proc.stdout:
            if line.startswith(f"batch {kill_after}"):
                # land anywhere in the writer thread's / commit's work on the next batch
                import time

                time.sleep(random.Random(kill_after).uniform(0.0, 0.03))
                os.kill(proc.pid, signal.SIGKILL)
                break
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()

    store = open_store(path)
    assert store.status == "incomplete"
    s = store.n_samples
    assert s % store_child.BATCH == 0 and s <= (kill_after + 2) * store_child.BATCH
    for hp in store.hook_points:  # committed prefix byte-identical
        assert store.n_rows(hp) == s
        assert torch.equal(store[hp], mem[hp][:s]), hp
    assert store.row_table("sample").column("sample_id").to_pylist() == list(range(s))
    assert store.verify() == []

    store_child.capture(str(path), N_BATCHES)  # resume=True in-process
    resumed = open_store(path)
    assert resumed.status == "complete"
    _assert_equal_stores(resumed, ref_store)
    assert resumed.verify() == []


def _run_and_kill(path, mode: str, at_line: str, delay: float) -> None:
    import time

    proc = _child(str(path), mode, str(N_BATCHES), "0.02")
    try:
        for line in proc.stdout:
            if line.startswith(at_line):
                time.sleep(delay)
                os.kill(proc.pid, signal.SIGKILL)
                break
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()


@pytest.mark.parametrize("mode", ["run", "runz"])
def test_resumes_killed_early_leave_every_committed_row_verifiable(tmp_path, reference, mode):
    """A resume rewrites the shard that holds the last committed rows (it appends to it) under
    another name until its commit (FORMAT.md section 7): resumes killed right after their first
    forward, before or around their first commit, leave a store whose every committed row reads
    and verifies clean, compressed or not, and the last resume ends as an uninterrupted run."""
    _, mem = reference
    path = tmp_path / "s.zarr"
    # 30 samples, closed: every array's last shard is a partial one written at the close, which
    # each resume below rewrites with more rows (fc2's 32-row shards: no commit before row 64)
    store_child.capture(str(path), 6, compression="zstd" if mode == "runz" else None)
    assert open_store(path).n_samples == 30
    for attempt, delay in enumerate([0.0, 0.005, 0.02, 0.05]):
        before = open_store(path).n_samples
        _run_and_kill(path, mode, f"batch {before // store_child.BATCH}", delay)  # the resume's first forward
        store = open_store(path, verify=True)
        s = store.n_samples
        assert store.status in ("complete", "incomplete") and s >= before, attempt
        for hp in store.hook_points:
            assert torch.equal(store[hp], mem[hp][:s]), (attempt, hp)
        assert store.verify() == [], attempt
    store_child.capture(str(path), N_BATCHES, compression="zstd" if mode == "runz" else None)
    store = open_store(path, verify=True)
    assert store.status == "complete" and store.verify() == []
    for hp in store.hook_points:
        assert torch.equal(store[hp], mem[hp]), hp
    assert not list(path.rglob("*.tmp"))


@pytest.mark.parametrize("mode", ["run", "runz"])
def test_a_resume_killed_between_its_shard_rename_and_its_manifest_leaves_a_verified_store(tmp_path, reference,
                                                                                           mode):
    """Between the rename of a resume's rewritten partial last shard over its key and the
    manifest that lists it, the key holds bytes the manifest does not describe; the committed
    file kept as <key>.committed.tmp is read instead, so a store killed there opens verified
    with every committed row, and the next resume ends as an uninterrupted run."""
    _, mem = reference
    path = tmp_path / "s.zarr"
    compression = "zstd" if mode == "runz" else None
    store_child.capture(str(path), 6, compression=compression)
    proc = _child(str(path), "killinstall" + mode, str(N_BATCHES))
    proc.wait(timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()
    assert list(path.rglob("*.committed.tmp"))  # (killed inside the window)
    store = open_store(path, verify=True)
    assert store.verify() == []
    s = store.n_samples
    assert s == 30
    for hp in store.hook_points:
        assert torch.equal(store[hp], mem[hp][:s]), hp
    # a copy (another folder, memory) holds the committed file under the key, and no temporary file
    for target in (tmp_path / "copy.zarr", f"memory://killinstall-{mode}/copy.zarr"):
        copy_store(str(path), str(target))
        copy = open_store(str(target), verify=True)
        assert copy.verify() == [] and copy.n_samples == s, target
        for hp in store.hook_points:
            assert torch.equal(copy[hp], mem[hp][:s]), (target, hp)
    assert not list((tmp_path / "copy.zarr").rglob("*.tmp"))
    store_child.capture(str(path), N_BATCHES, compression=compression)
    store = open_store(path, verify=True)
    assert store.status == "complete" and store.verify() == []
    for hp in store.hook_points:
        assert torch.equal(store[hp], mem[hp]), hp
    assert not list(path.rglob("*.tmp"))


def test_resume_reports_committed_samples_and_truncates(tmp_path):
    path = tmp_path / "s.zarr"
    w = StoreWriter(path, capture_config={}, model=None, storage_dtype=None, chunk_rows=2, shard_bytes=2 * 16 * 2)
    a = w.open_array("x", (4,), torch.float32, "sample")
    for i in range(3):
        a.append(torch.full((3, 4), float(i)))
        w.add_batch(3, [3 * i, 3 * i + 1, 3 * i + 2], None, {})
        w.commit()
    a.append(torch.full((2, 4), 9.0))  # rows of a batch that never ends
    w.abort(RuntimeError("boom"))
    st = open_store(path)
    assert st.status == "incomplete"
    committed = st.n_samples
    assert committed in (3, 6, 9) and st.n_rows("x") == committed
    w2 = StoreWriter(path, capture_config={}, model=None, storage_dtype=None, resume=True)
    assert w2.n_samples_committed == committed
    a2 = w2.open_array("x", (4,), torch.float32, "sample")
    assert a2.n_rows == committed
    for i in range(committed // 3, 4):
        a2.append(torch.full((3, 4), float(i)))
        w2.add_batch(3, [3 * i, 3 * i + 1, 3 * i + 2], None, {})
    w2.close()
    st = open_store(path)
    assert st.status == "complete"
    assert torch.equal(st["x"], torch.arange(4).repeat_interleave(3)[:, None].float().expand(12, 4))
    assert st.row_table().column("sample_id").to_pylist() == list(range(12))
    assert st.verify() == []


def test_disk_full_is_a_clear_error_and_committed_rows_stay(tmp_path, reference):
    _, mem = reference
    path = tmp_path / "s.zarr"
    proc = _child(str(path), "diskfull", str(N_BATCHES), "8")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    lines = [l for l in out.splitlines() if l.startswith("ERR ")]
    assert lines, out
    assert lines[0].startswith("ERR StoreError") and ("EFBIG" in lines[0] or "too large" in lines[0]), lines[0]
    store = open_store(path)
    assert store.status == "incomplete"
    s = store.n_samples
    assert 0 < s <= 8 * store_child.BATCH  # fc2 (16-byte rows) completes a shard every 32 rows
    for hp in store.hook_points:
        assert torch.equal(store[hp], mem[hp][:s]), hp


def test_reader_during_writes_sees_a_consistent_prefix(tmp_path, mlp):
    xs = batches_mlp(n_batches=10)
    mem = capture_memory(mlp, xs)
    scope = acs.ActivationScope(store=str(tmp_path / "s.zarr"), store_options=store_child.OPTIONS)
    seen = []
    with scope.track(mlp) as tr, torch.no_grad():
        for x in xs:
            mlp(x)
            st = open_store(tmp_path / "s.zarr")
            n = st.n_samples
            for hp in st.hook_points:
                assert st.n_rows(hp) == n
                assert torch.equal(st[hp], mem[hp][:n]), hp
            seen.append(n)
        tr.writer._core.drain()  # the writer thread is asynchronous: let it finish, then commit
        tr.writer.commit()
        st = open_store(tmp_path / "s.zarr")
        assert st.status == "incomplete" and st.n_samples > 0
        assert torch.equal(st["fc2.output"], mem["fc2.output"][: st.n_samples])
    assert seen == sorted(seen)
    assert open_store(tmp_path / "s.zarr").n_samples == 50


def test_writer_errors_surface_on_the_python_side(tmp_path):
    path = tmp_path / "s.zarr"
    w = StoreWriter(path, capture_config={}, model=None, storage_dtype=None, chunk_rows=1, shard_bytes=16)
    a = w.open_array("x", (4,), torch.float32, "sample")
    a.append(torch.zeros(1, 4))
    w.add_batch(1, [0], None, {})
    w._core.drain()
    w.commit()
    (path / "acts" / "x" / "c").rename(path / "acts" / "x" / "c-moved")
    (path / "acts" / "x" / "c").write_text("not a directory")  # the next shard cannot be created
    with pytest.raises(acs.StoreError, match=r"acts/x/c"):
        for _ in range(100):
            a.append(torch.zeros(1, 4))
            w._core.drain()
    with pytest.raises(acs.StoreError):
        w.commit()
    with pytest.raises(acs.StoreError):
        w.close()


def _durable_shards(w, a, n_batches, start=0):
    for i in range(start, start + n_batches):
        a.append(torch.full((4, 4), float(i)))  # one whole 4-row shard per batch
        w.add_batch(4, list(range(4 * i, 4 * i + 4)), None, {})
    w._core.drain()


def test_maybe_commit_waits_for_the_commit_interval_and_commit_does_not(tmp_path):
    path = tmp_path / "s.zarr"
    w = StoreWriter(path, chunk_rows=2, shard_rows=4, commit_interval=3600)
    a = w.open_array("x", (4,), torch.float32, "sample")
    w.maybe_commit()  # a new array is listed from the batch that records the forward it is first seen in
    assert open_store(path).hook_points == []
    w.add_batch(0)
    w.maybe_commit()  # then at once (no rows yet)
    assert open_store(path).hook_points == ["x"]
    _durable_shards(w, a, 2)
    assert not w.maybe_commit()  # durable, but the interval has not passed
    assert open_store(path).n_samples == 0
    assert w.commit()
    st = open_store(path)
    assert st.status == "incomplete" and st.n_samples == 8
    assert torch.equal(st["x"], torch.arange(2).repeat_interleave(4)[:, None].expand(8, 4).float())
    _durable_shards(w, a, 1, start=2)
    assert not w.maybe_commit()
    w.close()
    assert open_store(path).n_samples == 12


def test_commit_interval_zero_commits_every_durable_shard(tmp_path):
    path = tmp_path / "s.zarr"
    w = StoreWriter(path, chunk_rows=2, shard_rows=4, commit_interval=0)
    a = w.open_array("x", (4,), torch.float32, "sample")
    w.maybe_commit()
    for i in range(3):
        _durable_shards(w, a, 1, start=i)
        assert w.maybe_commit()
        assert open_store(path).n_samples == 4 * (i + 1)
        assert not w.maybe_commit()  # nothing new: cheap, no commit
    w.close()


def test_commit_interval_elapsed_lets_maybe_commit_through(tmp_path, monkeypatch):
    import activationscope.store.writer as writer_mod

    now = [1000.0]
    monkeypatch.setattr(writer_mod.time, "monotonic", lambda: now[0])
    path = tmp_path / "s.zarr"
    w = StoreWriter(path, chunk_rows=2, shard_rows=4, commit_interval=5)
    a = w.open_array("x", (4,), torch.float32, "sample")
    w.add_batch(0)
    w.maybe_commit()  # lists the new array
    _durable_shards(w, a, 1)
    now[0] += 4.9
    assert not w.maybe_commit()
    now[0] += 0.2
    assert w.maybe_commit() and open_store(path).n_samples == 4
    w.close()


def _count_document_writes(monkeypatch) -> list[int]:
    """Bytes of each document and row-table part a writer writes (shards are written natively)."""
    from activationscope.store._backend import LocalBackend

    sizes: list[int] = []
    set_ = LocalBackend.set

    def counted(self, key, data, *args, **kwargs):
        sizes.append(len(data))
        return set_(self, key, data, *args, **kwargs)

    monkeypatch.setattr(LocalBackend, "set", counted)
    return sizes


def test_a_long_capture_writes_documents_within_a_share_of_its_rows(tmp_path, monkeypatch):
    # every commit rewrites each manifest (listing all its shards) and the root (listing every
    # row-table part, one a commit): committed at every shard, the documents written grew with
    # the square of the shards, far past the rows captured
    import activationscope.store.writer as writer_mod

    monkeypatch.setattr(writer_mod, "DOCUMENT_ALLOWANCE_BYTES", 4096)
    monkeypatch.setattr(writer_mod, "DOCUMENT_MAX_WAIT_S", float("inf"))
    path = tmp_path / "s.zarr"
    w = StoreWriter(path, chunk_rows=2, shard_rows=4, commit_interval=0)
    a = w.open_array("x", (16,), torch.float32, "sample")
    w.add_batch(0)
    w.maybe_commit()
    sizes = _count_document_writes(monkeypatch)
    n_shards, commits, last = 200, 0, 0
    for i in range(n_shards):
        a.append(torch.full((4, 16), float(i)))  # one whole 4-row shard per batch
        w.add_batch(4)
        w._core.drain()
        before = sum(sizes)
        if w.maybe_commit():
            commits, last = commits + 1, sum(sizes) - before
    appended = n_shards * 4 * 16 * 4
    assert 0 < commits < n_shards // 4
    # (each commit is let through while the documents are within the budget: the last may pass it)
    assert sum(sizes) - last <= 4096 + writer_mod.DOCUMENT_SHARE * appended
    w.close()
    st = open_store(path)
    assert st.status == "complete" and st.n_samples == 4 * n_shards
    assert torch.equal(st["x"][:, 0], torch.arange(n_shards).repeat_interleave(4).float())


def test_the_document_budget_takes_the_bytes_appended_without_a_step_per_array(tmp_path, monkeypatch):
    # held back by the budget, maybe_commit runs it after every forward: the bytes appended come
    # from the row counts the forward recorded, in one product, never a read of each array's
    # writer (hundreds of microseconds a forward with 500 hook points)
    import activationscope.store.writer as writer_mod

    monkeypatch.setattr(writer_mod, "DOCUMENT_ALLOWANCE_BYTES", 0)
    monkeypatch.setattr(writer_mod, "DOCUMENT_MAX_WAIT_S", float("inf"))
    path = tmp_path / "s.zarr"
    w = StoreWriter(path, chunk_rows=2, shard_rows=4, commit_interval=0)
    arrays = [w.open_array(f"x{i}", (4 * (i + 1),), torch.float32, "sample") for i in range(3)]
    w.add_batch(0)
    assert w.maybe_commit()  # lists the new arrays: documents far beyond their rows' share from now on
    for b in range(2):
        for i, a in enumerate(arrays):
            a.append(torch.full((4, 4 * (i + 1)), float(b)))
        w.add_batch(4)
    w._core.drain()
    assert w._appended_bytes() == 8 * (4 + 8 + 12) * 4

    class Unread:
        @property
        def n_rows(self):
            raise AssertionError("the document budget read an array's writer")

    kept = [a.writer for a in w._order]
    for a in w._order:
        a.writer = Unread()
    try:
        assert not w.maybe_commit()
    finally:
        for a, writer in zip(w._order, kept):
            a.writer = writer
    w.close()
    st = open_store(path)
    assert st.n_samples == 8 and torch.equal(st["x2"][:, 0], torch.tensor([0.0] * 4 + [1.0] * 4))


def test_a_commit_held_back_for_its_documents_comes_after_the_longest_wait(tmp_path, monkeypatch):
    import activationscope.store.writer as writer_mod

    now = [1000.0]
    monkeypatch.setattr(writer_mod.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(writer_mod, "DOCUMENT_ALLOWANCE_BYTES", 0)
    path = tmp_path / "s.zarr"
    w = StoreWriter(path, chunk_rows=2, shard_rows=4, commit_interval=1)
    a = w.open_array("x", (4,), torch.float32, "sample")
    w.add_batch(0)
    w.maybe_commit()  # lists the new array: its documents are far more than its rows' share
    _durable_shards(w, a, 1)
    now[0] += writer_mod.DOCUMENT_MAX_WAIT_S - 1
    assert not w.maybe_commit() and open_store(path).n_samples == 0
    now[0] += 1
    assert w.maybe_commit() and open_store(path).n_samples == 4
    w.close()


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), True, "1", None])
def test_bad_commit_interval_is_refused_before_anything_is_written(tmp_path, bad):
    path = tmp_path / "s.zarr"
    with pytest.raises(acs.ActivationScopeError, match="commit_interval"):
        StoreWriter(path, commit_interval=bad)
    assert not path.exists()


def test_default_sample_ids_run_on_across_commits(tmp_path):
    path = tmp_path / "s.zarr"
    w = StoreWriter(path, chunk_rows=2, shard_rows=4, commit_interval=3600)
    a = w.open_array("x", (4,), torch.float32, "sample")
    for i in range(5):
        a.append(torch.full((4, 4), float(i)))
        w.add_batch(4)  # no sample_ids: the running count
        if i == 2:
            w._core.drain()
            w.commit()  # three batches leave the pending list, two stay
    w.close()
    st = open_store(path)
    assert st.row_table("sample").column("sample_id").to_pylist() == list(range(20))


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_resume_whose_close_fails_before_its_root_puts_the_committed_shard_back(tmp_path, monkeypatch, compression):
    """A resume rewrites the partial last shard and its close renames the rewrite over the key
    just before the manifests and the root (FORMAT.md section 7). When a manifest could not be
    written (a full disk), the failed close removed the kept committed file too: the key held
    the rewrite, the root the old rows, and (compressed) the last committed rows were an error
    to read and verify listed the shard until another resume. The close now puts the committed
    file back: every committed row reads, and the store verifies clean."""
    import sys as _sys

    from activationscope.store._backend import LocalBackend

    _sys.path.insert(0, str(HERE))
    from hostile import FEATURE, HP, make_store

    path = tmp_path / "s.zarr"
    data = make_store(path, compression=compression, n_rows=300)  # 64-row shards: the last one holds 44
    before = {p: p.read_bytes() for p in path.rglob("*") if p.is_file() and p.name != ".activationscope-writer.lock"}
    real_set = LocalBackend.set

    def set_or_fail(self, key, raw):
        if key.endswith("manifest.json"):
            raise acs.StoreError(f"writing {key!r} failed: File too large")
        return real_set(self, key, raw)

    w = StoreWriter(path, resume=True)
    a = w.open_array(HP, (FEATURE,), torch.float32, "sample")
    a.append(torch.ones(10, FEATURE))
    w.add_batch(10)
    monkeypatch.setattr(LocalBackend, "set", set_or_fail)
    with pytest.raises(acs.StoreError, match="File too large"):
        w.close()
    monkeypatch.undo()
    s = open_store(path)
    assert s.n_rows(HP) == 300 and torch.equal(s[HP], data)
    assert s.verify() == []
    after = {p: p.read_bytes() for p in path.rglob("*") if p.is_file() and p.name != ".activationscope-writer.lock"}
    assert {p for p in after if p.name.endswith(".tmp")} == set()
    assert {p: after[p] for p in before if p.name != "zarr.json" or p.parent != path} == \
           {p: before[p] for p in before if p.name != "zarr.json" or p.parent != path}
