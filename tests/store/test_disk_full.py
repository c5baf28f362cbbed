"""A disk that fills up during a capture, a copy or an export: the error names the path, says
the disk is full and what to do (free space, then resume / copy / export again); committed rows
stay equal to plain PyTorch, and a resume once space is freed ends equal to an uninterrupted
capture, reductions included. Disk full is made with RLIMIT_FSIZE in a child process (real
writes, no root needed), or with a rename that fails with ENOSPC at a chosen file."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import activationscope as acs
from activationscope.errors import StoreError
from activationscope.store import copy_store, open_store
from activationscope.store import _format as F
from activationscope.store._backend import LocalBackend

from acs_testing import plain_hooks

import store_child
from store_models import MLP, batches_mlp

HERE = Path(__file__).parent
N = 12
B = store_child.BATCH
HOOK_POINTS = ("fc1.output", "act.output", "fc2.output")


def _plain_rows(model, xs):
    """The hook points' rows by plain PyTorch forward hooks (no activationscope)."""
    rows, _ = plain_hooks(model, lambda: [model(x) for x in xs], [hp.split(".")[0] for hp in HOOK_POINTS])
    return {hp: torch.cat(rows[hp]) for hp in HOOK_POINTS}


def _model_and_data():
    torch.manual_seed(0)
    return MLP().eval(), batches_mlp(n_batches=N, batch=B)


def _capture(path, *, resume=False, full_from=None):
    """Capture the MLP (resume=True: what is left of it); ``full_from`` = (batch, failure):
    before that batch, the rows so far are committed, then ``failure`` (of :func:`_fail_renames`)
    is armed."""
    model, xs = _model_and_data()
    scope = acs.ActivationScope(store=str(path), reductions=["mean"],
                                store_options={**store_child.OPTIONS, "resume": resume})
    with scope.track(model) as tr, torch.no_grad():
        for i in range(tr.writer.n_samples_committed // B, N):
            if full_from is not None and i == full_from[0]:
                tr.writer._core.drain()  # let the shards written so far commit first
                tr.writer.commit()
                full_from[1].armed = True
            tr.set_batch(sample_ids=list(range(i * B, (i + 1) * B)))
            model(xs[i])


def _assert_prefix_of_plain(store, n_at_least=1):
    model, xs = _model_and_data()
    plain = _plain_rows(model, xs)
    n = store.n_samples
    assert n >= n_at_least
    for hp in HOOK_POINTS:
        assert store.n_rows(hp) == n
        assert torch.equal(store[hp], plain[hp][:n]), hp
    assert store.row_table().column("sample_id").to_pylist() == list(range(n))


def _assert_whole(store):
    model, xs = _model_and_data()
    plain = _plain_rows(model, xs)
    assert store.status == "complete" and store.n_samples == N * B and store.verify() == []
    for hp in HOOK_POINTS:
        assert torch.equal(store[hp], plain[hp]), hp
        torch.testing.assert_close(store.reductions[hp]["mean"], plain[hp].double().mean(0))
        assert int(store.reductions[hp]["mean.count"]) == N * B
    assert store.partial_reductions == {}


def _no_temp_files(path):
    return [str(p.relative_to(path)) for p in Path(path).rglob("*")
            if p.name.endswith(".tmp") or p.name.startswith("shard-")]


class _Failure:
    """os.replace onto a file whose path ends with ``match`` fails with ENOSPC at its ``nth``
    call once armed (the temporary file was written; the disk is full at that point)."""

    def __init__(self, monkeypatch, match, nth=1, armed=True):
        self.match, self.nth, self.armed, self.seen = match, nth, armed, 0
        self.real = os.replace
        monkeypatch.setattr(os, "replace", self.replace)

    def replace(self, src, dst, *a, **k):
        if self.armed and str(dst).endswith(self.match):
            self.seen += 1
            if self.seen == self.nth:
                raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        return self.real(src, dst, *a, **k)


def _fail_renames(monkeypatch, match, nth=1, armed=True):
    return _Failure(monkeypatch, match, nth, armed)


def test_a_document_that_does_not_fit_names_the_disk_and_keeps_the_old_bytes(tmp_path, monkeypatch):
    b = LocalBackend(tmp_path)
    b.set("a/doc.json", b"old")
    _fail_renames(monkeypatch, "doc.json")
    with pytest.raises(StoreError) as e:
        b.set("a/doc.json", b"new")
    assert str(tmp_path / "a" / "doc.json") in str(e.value)
    assert "No space left on device: the disk holding it is full" in str(e.value)
    assert "free space there" in str(e.value)
    assert (tmp_path / "a" / "doc.json").read_bytes() == b"old"
    assert _no_temp_files(tmp_path) == []


@pytest.mark.parametrize("match", ["s.zarr/zarr.json", "manifest.json", ".parquet"])
def test_a_commit_on_a_full_disk_says_free_space_then_resume(tmp_path, monkeypatch, match):
    """The disk fills after 8 of 12 batches, once the rows so far were committed (fc2's first
    32-row shard: 6 batches): the next commit's root, manifest or row-table part does not fit."""
    path = tmp_path / "s.zarr"
    failure = _fail_renames(monkeypatch, match, armed=False)
    with pytest.raises(StoreError) as e:
        _capture(path, full_from=(8, failure))
    assert failure.seen >= 1
    msg = str(e.value)
    assert "No space left on device" in msg and "free space there" in msg, msg
    assert "resume=True continues from them once the cause is fixed" in msg, msg
    monkeypatch.undo()
    store = open_store(path)
    assert store.status == "incomplete" and store.verify() == []
    _assert_prefix_of_plain(store, 6 * B)
    assert _no_temp_files(path) == []
    _capture(path, resume=True)
    _assert_whole(open_store(path))


def test_reductions_on_a_full_disk_say_how_to_get_them_back(tmp_path, monkeypatch):
    """The rows fit, the reductions written at the close do not: every row stays committed,
    the error says resume=True computes the reductions again, and it does (no new batch)."""
    path = tmp_path / "s.zarr"
    _fail_renames(monkeypatch, "/c/0")  # the first reduction chunk
    with pytest.raises(StoreError) as e:
        _capture(path)
    msg = str(e.value)
    assert "storing reduction 'mean' of hook point" in msg and "free space there" in msg, msg
    assert "resume=True with the same reductions=" in msg and "computes the reductions again" in msg, msg
    monkeypatch.undo()
    store = open_store(path)
    assert store.status == "incomplete" and store.n_samples == N * B
    _assert_prefix_of_plain(store, N * B)
    _capture(path, resume=True)  # no batch left to capture
    _assert_whole(open_store(path))


def test_a_capture_that_hits_a_file_size_limit_says_what_to_do_and_resumes(tmp_path):
    """Real writes: the child caps its file size (RLIMIT_FSIZE) after 8 batches, so the native
    shard writer (or a commit's document) fails with EFBIG; the error raised in the capture's
    thread says what to do, and a resume once the limit is gone completes the store."""
    path = tmp_path / "s.zarr"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent.parent),
                                                       os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(HERE / "store_child.py"), str(path), "diskfull", str(N), "8"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    errs = [line for line in proc.stdout.splitlines() if line.startswith("ERR ")]
    assert errs and errs[0].startswith("ERR StoreError"), proc.stdout
    assert "file size limit was reached; free space there" in errs[0], errs[0]
    assert "resume=True continues from them once the cause is fixed" in errs[0], errs[0]
    store = open_store(path)
    assert store.status == "incomplete"
    _assert_prefix_of_plain(store)
    store_child.capture(str(path), N)  # a resume: the store exists
    store = open_store(path)
    assert store.status == "complete" and store.verify() == []
    _assert_prefix_of_plain(store, N * B)
    assert _no_temp_files(path) == []


def test_copy_store_onto_a_full_disk_says_copy_again(tmp_path, monkeypatch):
    src = tmp_path / "src.zarr"
    _capture(src)
    dst = tmp_path / "dst.zarr"
    _fail_renames(monkeypatch, "manifest.json", 2)
    with pytest.raises(StoreError) as e:
        copy_store(src, dst)
    msg = str(e.value)
    assert f"copy_store into {str(dst)!r}" in msg and "free space there" in msg, msg
    assert "left an incomplete store with no rows" in msg and "copy again with overwrite=True" in msg, msg
    monkeypatch.undo()
    assert open_store(dst).n_samples == 0
    copy_store(src, dst, overwrite=True)
    _assert_whole(open_store(dst))


EXPORT_CHILD = textwrap.dedent("""
    import resource, signal, sys
    from activationscope.data import export_arrow, export_parquet
    from activationscope.errors import ExportError
    src, out, kind = sys.argv[1:4]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    try:
        (export_arrow if kind == "arrow" else export_parquet)(src, out, overwrite=True)
    except ExportError as e:
        print("ERR ExportError:", e)
    except BaseException as e:
        print(f"ERR other {type(e).__name__}:", e)
    else:
        print("done")
""")


@pytest.mark.parametrize("kind", ["arrow", "parquet"])
def test_an_export_onto_a_full_disk_is_an_export_error_and_keeps_the_old_export(tmp_path, kind):
    """The export's writes hit a file size limit (a child process): ExportError naming the
    path and the fix, no temporary file left, the earlier export there unchanged."""
    src = tmp_path / "src.zarr"
    _capture(src)
    out = tmp_path / f"out.{kind}"
    from activationscope.data import export_arrow, export_parquet

    (export_arrow if kind == "arrow" else export_parquet)(src, out, hook_points=["fc2.output"])
    before = out.read_bytes()
    assert len(before) < 4096
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", EXPORT_CHILD, str(src), str(out), kind], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("ERR ExportError: writing the export"), proc.stdout
    assert str(out) in line and "free space there" in line and f"nothing at {str(out)!r} was changed" in line, line
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["src.zarr", out.name])


def test_a_new_store_removed_after_a_failure_says_to_start_again_not_resume(tmp_path):
    """A new store that committed no row is removed after the failure (a disk full before the
    first commit, a first forward that raised): the error's note says resume=True has nothing to
    continue, where the error itself may say resume=True continues from the committed rows."""
    path = tmp_path / "s.zarr"
    model, xs = _model_and_data()
    with pytest.raises(StoreError) as e:
        with acs.ActivationScope(store=str(path)).track(model), torch.no_grad():
            raise StoreError("writing shard failed: No space left on device (ENOSPC); rows committed before the "
                             "failure stay readable (open_store), and resume=True continues from them")
    notes = getattr(e.value, "__notes__", [])
    assert any(f"no row was committed, so the new store {str(path)!r} was removed (resume=True has nothing to "
               "continue: once the cause is fixed, run the capture again without it)" in n for n in notes), notes
    assert not path.exists()


def _complete_store(path):
    """A complete store of the test model's N batches at ``path``: ``(model, xs, its
    fc2.output rows)``, the rows (N * B, d) read back."""
    model, xs = _model_and_data()
    with acs.ActivationScope(store=str(path)).track(model), torch.no_grad():
        for x in xs:
            model(x)
    return model, xs, open_store(path)["fc2.output"].clone()


def test_an_overwrite_that_committed_nothing_says_the_earlier_store_is_kept_not_its_rows(tmp_path):
    """overwrite=True over a whole store, and the disk fills before the new capture commits: the
    earlier store is put back, and the error said only that "rows committed before the failure
    stay readable (open_store), and resume=True continues from them", which open_store then
    seemed to confirm with the earlier capture's rows, status complete."""
    path = tmp_path / "s.zarr"
    model, xs, before = _complete_store(path)
    with pytest.raises(StoreError) as e:
        with acs.ActivationScope(store=str(path), store_options={"overwrite": True}).track(model), torch.no_grad():
            raise StoreError("writing shard failed: No space left on device (ENOSPC); rows committed before the "
                             "failure stay readable (open_store), and resume=True continues from them")
    notes = getattr(e.value, "__notes__", [])
    assert notes == [f"no row of this capture was committed, so the store that overwrite=True was to replace at "
                     f"{str(path)!r} is kept as it was: open_store reads that earlier store, none of this capture's "
                     "rows, and resume=True would continue that store, not this capture; once the cause is fixed, "
                     "run the capture again with overwrite=True"], notes
    kept = open_store(path)
    assert kept.status == "complete" and kept.n_samples == N * B
    assert torch.equal(kept["fc2.output"], before)


def test_an_overwrite_whose_close_did_not_fit_says_the_earlier_store_is_kept_not_its_rows(tmp_path, monkeypatch):
    """The same where the `with` block ended and the close's commit (the new capture's first)
    ran out of room: the earlier store was put back, and the error, with no note, said that
    resume=True continues from the committed rows, so that a resume continued the earlier store
    with this capture's rows."""
    path = tmp_path / "s.zarr"
    model, xs, before = _complete_store(path)
    failure = _fail_renames(monkeypatch, "manifest.json", armed=False)
    with pytest.raises(StoreError) as e:
        with acs.ActivationScope(store=str(path), store_options={"overwrite": True}).track(model), torch.no_grad():
            model(xs[0])
            failure.armed = True  # (the disk is full from here on: the close's commit does not fit)
    assert failure.seen >= 1 and "free space there" in str(e.value)
    notes = getattr(e.value, "__notes__", [])
    assert notes == [f"no row of this capture was committed, so the store that overwrite=True was to replace at "
                     f"{str(path)!r} is kept as it was: open_store reads that earlier store, none of this capture's "
                     "rows, and resume=True would continue that store, not this capture; once the cause is fixed, "
                     "run the capture again with overwrite=True"], notes
    monkeypatch.undo()
    kept = open_store(path)
    assert kept.status == "complete" and kept.n_samples == N * B
    assert torch.equal(kept["fc2.output"], before)


REMOTE_CHILD = textwrap.dedent("""
    import resource, signal, sys, uuid
    import torch
    import activationscope as acs
    from activationscope.store import open_store
    from store_models import MLP, batches_mlp
    import store_child
    torch.manual_seed(0)
    model, xs = MLP().eval(), batches_mlp(n_batches=12, batch=store_child.BATCH)
    url = f"memory://acs-test/{uuid.uuid4().hex}.zarr"
    scope = acs.ActivationScope(store=url, store_options=store_child.OPTIONS)
    try:
        with scope.track(model) as tr, torch.no_grad():
            for i, x in enumerate(xs):
                if i == 8:
                    tr.writer._core.drain()
                    tr.writer.commit()
                    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                    resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100))
                model(x)
    except acs.ActivationScopeError as e:
        print("ERR", type(e).__name__, e)
    store = open_store(url)
    print("ROWS", store.status, store.n_samples, bool(torch.equal(store["fc2.output"], model(torch.cat(xs))[:store.n_samples])))
""")


def test_a_remote_capture_whose_staging_disk_fills_names_the_staging_folder(tmp_path):
    """A remote store's shards are written first in a local staging folder (TMPDIR): when that
    disk fills, the error names the staged shard and says where the staging is, not the store."""
    env = dict(os.environ, TMPDIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", REMOTE_CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    errs = [line for line in proc.stdout.splitlines() if line.startswith("ERR ")]
    assert errs and errs[0].startswith("ERR StoreError"), proc.stdout
    assert f"{tmp_path}{os.sep}acs-staging-" in errs[0] and "free space there" in errs[0], errs[0]
    assert "a remote store's shards are staged in the local temporary folder, TMPDIR" in errs[0], errs[0]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("ROWS ")]
    status, n, equal = rows[0].split()[1:]
    assert status == "incomplete" and int(n) > 0 and equal == "True", rows


@pytest.mark.parametrize("resume", [False, True])
def test_a_capture_started_on_a_full_disk_is_a_store_error_and_leaves_no_lock_held(tmp_path, monkeypatch, resume):
    """The disk is full before the capture starts: writing the writer lock fails. A StoreError
    naming the lock file (was: a bare OSError), the target as found (a new store's folder and
    lock file gone, a resumed store's files unchanged), and the lock released: a capture in
    the same process then takes the store (was: StoreLockedError, by this very process)."""
    path = tmp_path / "s.zarr"
    if resume:
        _capture(path)
        before = {p.relative_to(path): p.read_bytes() for p in path.rglob("*")
                  if p.is_file() and p.name != ".activationscope-writer.lock"}
    real = os.pwrite

    def pwrite(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(StoreError) as e:
        _capture(path, resume=resume)
    msg = str(e.value)
    assert f"writing its writer lock {str(path / '.activationscope-writer.lock')!r} failed: No space left" in msg, msg
    assert "free space there" in msg and "the store was left as it was found" in msg, msg
    monkeypatch.setattr(os, "pwrite", real)
    if resume:
        after = {p.relative_to(path): p.read_bytes() for p in path.rglob("*")
                 if p.is_file() and p.name != ".activationscope-writer.lock"}
        assert after == before
    else:
        assert not path.exists()
    _capture(path, resume=resume)
    _assert_whole(open_store(path))


def test_reductions_over_more_rows_than_a_failed_close_committed_say_so(tmp_path):
    """A close that stored the reductions (over every captured row) and then failed to write
    its last shards (a full disk) leaves reductions over more rows than the store holds. They
    are partial, and the error no longer says they cover 'only part of its rows'."""
    import json

    path = tmp_path / "s.zarr"
    _capture(path)
    root = json.loads((path / "zarr.json").read_text())
    meta = root["attributes"]["activationscope"]
    for entry in meta["reductions"]["fc1.output"].values():
        entry["n_rows"] = N * B + 2 * B  # what such a close leaves: 2 batches more than were committed
    (path / "zarr.json").write_text(json.dumps(root))
    store = open_store(path)
    assert store.partial_reductions["fc1.output"]["mean"] == (N * B + 2 * B, N * B)
    with pytest.raises(KeyError) as e:
        store.reductions["fc1.output"]
    msg = str(e.value)
    assert f"cover {N * B + 2 * B} rows, more than the {N * B} it stores" in msg, msg
    assert "only part of its rows" not in msg and "resume=True with the same reductions=" in msg, msg
    # the Python call it gives names the store (store_options without store= is refused)
    assert f"(ActivationScope(store={str(path)!r}, store_options={{'resume': True}}, reductions=...)" in msg, msg
    # opened with storage_options (object storage's credentials): the call names them, not their values
    with pytest.raises(KeyError) as e:
        open_store(f"file://{path}", storage_options={"key": "AKIAEXAMPLE", "secret": "s3cr3t"}).reductions["fc1.output"]
    msg = str(e.value)
    assert (f"(ActivationScope(store={str(path)!r}, store_options={{'resume': True, 'storage_options': "
            "{'key': '...', 'secret': '...'}}, reductions=...)") in msg, msg
    assert "AKIAEXAMPLE" not in msg and "s3cr3t" not in msg


def test_a_store_folder_removed_under_a_running_capture_is_said_so(tmp_path):
    """The store's folder is deleted while the capture runs: the writer thread then fails to
    create the next shard (ENOENT), and its error says the committed rows stay readable and
    resume=True continues them. A note now says the folder was removed, and nothing more is
    written at its path."""
    import shutil

    path = tmp_path / "s.zarr"
    model, xs = _model_and_data()
    scope = acs.ActivationScope(store=str(path), store_options={**store_child.OPTIONS, "commit_interval": 3600})
    with pytest.raises(StoreError) as e:
        with scope.track(model) as tr, torch.no_grad():
            for i in range(N):
                if i == 4:
                    tr.writer._core.drain()
                    tr.writer.commit()
                    tr.writer._core.drain()  # (a partial shard the commit asked for)
                    # the commit's background reservations of its next files end first: one made
                    # while the folder is removed (in a folder not removed yet) fails the removal
                    tr.writer._backend.release()
                    shutil.rmtree(path)
                model(xs[i])
                tr.writer._core.drain()  # the writer thread's error reaches the next forward
    text = " ".join([str(e.value), *getattr(e.value, "__notes__", [])])
    assert "was moved, removed or replaced while this" in text, text
    assert not path.exists()


def test_a_store_folder_removed_during_a_commit_is_not_made_again(tmp_path, monkeypatch):
    """The store's folder is deleted while a commit writes (after its check that the store is
    still this writer's, before its first file): the commit's writes fail, and make neither the
    folder nor any of its files again (no half store of manifests and a root over shards that
    are gone, which open_store would read); the error says the folder is gone."""
    import shutil

    path = tmp_path / "s.zarr"
    model, xs = _model_and_data()
    scope = acs.ActivationScope(store=str(path), reductions=["mean"],
                                store_options={**store_child.OPTIONS, "commit_interval": 3600})
    with pytest.raises(StoreError) as e:
        with scope.track(model) as tr, torch.no_grad():
            for i in range(N):
                tr.set_batch(sample_ids=list(range(i * B, (i + 1) * B)))
                model(xs[i])
                if i == 4:
                    tr.writer._core.drain()
                    tr.writer.commit()
                    tr.writer._core.drain()  # (the partial shards the commit asked for: the next commit lists them)
                    real_set = tr.writer._backend.set
                    written = []

                    def set_after_removal(key, data):
                        if not written:
                            # the backend's background reservations of its next files end first: one
                            # made while the folder is removed (in a folder not removed yet) fails the
                            # removal ("Directory not empty"), as for any program writing there
                            tr.writer._backend.release()
                            shutil.rmtree(path)
                        written.append(key)
                        return real_set(key, data)

                    monkeypatch.setattr(tr.writer._backend, "set", set_after_removal)
                    tr.writer.commit()
    assert written, "the commit wrote nothing"
    assert not path.exists(), sorted(str(p.relative_to(path)) for p in path.rglob("*"))
    text = " ".join([str(e.value), *getattr(e.value, "__notes__", [])])
    assert f"the store's folder {str(path)!r} is gone" in text, text
    assert "was moved, removed or replaced while this" in text, text


FIRST_COMMIT_CHILD = textwrap.dedent("""
    import resource, signal, sys
    import torch
    import activationscope as acs
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).eval()
    resource.setrlimit(resource.RLIMIT_FSIZE, (3000, 3000))
    try:
        with torch.no_grad(), acs.ActivationScope(store=sys.argv[1], reductions=["mean"]).track(model):
            model(torch.randn(4, 4))
    except BaseException as e:
        print("ERR", type(e).__name__, str(e).replace(chr(10), " "), " ".join(getattr(e, "__notes__", [])))
    else:
        print("done")
""")


def test_a_first_commit_that_did_not_fit_leaves_no_store_of_no_rows(tmp_path):
    """The first commit's documents hit the file size limit after its batch was counted: the
    root lists no row, so the new store is removed (and the note says to run again without
    resume=True), as after any failure before a row was committed; it was left as an
    incomplete store of 0 rows."""
    path = tmp_path / "first.zarr"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", FIRST_COMMIT_CHILD, str(path)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("ERR "), proc.stdout
    assert "no row was committed, so the new store" in line and "was removed" in line, line
    assert not path.exists()


def test_a_kept_reduction_file_put_back_after_its_store_folder_was_removed_makes_no_folder(tmp_path):
    """A close that puts back the committed bytes of a reduction it was rewriting (kept next to
    the key, FORMAT.md section 6) after the store's folder was removed: putting it back fails
    (warned about) and makes neither the store's folder nor the reduction's folders again."""
    import shutil

    path = tmp_path / "s.zarr"
    model, xs = _model_and_data()
    scope = acs.ActivationScope(store=str(path), store_options=store_child.OPTIONS)
    with pytest.raises(StoreError, match="moved, removed or replaced"):
        with scope.track(model) as tr, torch.no_grad():
            model(xs[0])
            key = "reductions/fc1.output/mean/c/0"
            tr.writer._kept_reductions = {key: path / F.kept_reduction_key(key)}
            tr.writer._core.drain()
            tr.writer._backend.release()  # (no file made in the folder while it is removed)
            shutil.rmtree(path)
            with pytest.warns(RuntimeWarning, match="restoring"):
                tr.writer._drop_kept_reductions(restore=True)
            assert not path.exists()
    assert not path.exists()
