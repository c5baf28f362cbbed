"""The local staging folders of remote stores' writers (store/_staging.py): a folder left by a
killed process is removed by the next writer on the host; a live writer's never is."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch

import activationscope as acs
from activationscope.store import StoreWriter
from activationscope.store import _staging as S

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="flock and fork: POSIX")

_REPO = str(Path(acs.__file__).parents[1])


@pytest.fixture
def staging_dir(tmp_path, monkeypatch):
    """``tempfile``'s folder in this test (as ``$TMPDIR`` sets it), for this process and the
    scripts it runs."""
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def _script(staging_dir, body: str) -> subprocess.Popen:
    """Run ``body`` in a fresh interpreter with ``$TMPDIR`` = ``staging_dir``: its stdout a pipe
    (the script prints one JSON line when it has made its folder), its stdin a pipe."""
    env = {**os.environ, "TMPDIR": str(staging_dir),
           "PYTHONPATH": os.pathsep.join([_REPO, os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(body)], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# a remote store's writer with shards staged (written, never uploaded), then the process is
# killed (SIGKILL: no finalizer, no atexit), or waits for a line on stdin and closes
_WRITER = """
    import json, os, signal, sys, tempfile
    import torch
    from activationscope.store import StoreWriter
    w = StoreWriter("memory://staged/{name}.zarr", chunk_rows=4, shard_bytes=4 * 16 * 4)
    w.open_array("x", (16,), torch.float32, "sample").append(torch.randn(40, 16))
    w._core.drain()
    print(json.dumps(str(w._staging)), flush=True)
    if {kill}:
        os.kill(os.getpid(), signal.SIGKILL)
    sys.stdin.readline()
    w.close()
"""


def _killed_writer_folder(staging_dir) -> Path:
    p = _script(staging_dir, _WRITER.format(name=uuid.uuid4().hex, kill=True))
    out, err = p.communicate(timeout=300)
    assert p.returncode == -signal.SIGKILL, err[-3000:]
    folder = Path(json.loads(out))
    # what the killed writer left: its lock file, and the shards it never uploaded
    assert folder.parent == staging_dir and (folder / S.LOCK_NAME).is_file()
    assert len(list((folder / "acts" / "x" / "c").iterdir())) == 10
    return folder


def test_a_remote_writer_removes_the_staging_folders_killed_writers_left_and_no_other(staging_dir):
    dead = _killed_writer_folder(staging_dir)
    live = _script(staging_dir, _WRITER.format(name=uuid.uuid4().hex, kill=False))
    try:
        live_folder = Path(json.loads(live.stdout.readline()))
        # what is not a staging folder of a dead writer is left as it is
        (staging_dir / "acs-staging-unlocked").mkdir()  # no lock file (a writer where flock fails)
        (staging_dir / "acs-staging-unlocked" / "shard").write_bytes(b"x")
        (staging_dir / "acs-staging-being-made").mkdir()  # its lock file not yet renamed
        (staging_dir / "acs-staging-being-made" / (S.LOCK_NAME + ".new")).write_bytes(b"")
        (staging_dir / "acs-staging-file").write_bytes(b"not a folder")
        (staging_dir / "other").mkdir()
        (staging_dir / "other" / S.LOCK_NAME).write_bytes(b"")  # another name
        outside = staging_dir.parent / "outside"
        outside.mkdir()
        (outside / S.LOCK_NAME).write_bytes(b"")
        (staging_dir / "acs-staging-link").symlink_to(outside, target_is_directory=True)
        kept = sorted(p.name for p in staging_dir.iterdir() if p != dead)

        w = StoreWriter(f"memory://staged/{uuid.uuid4().hex}.zarr", chunk_rows=4)
        assert not dead.exists()
        assert sorted(p.name for p in staging_dir.iterdir() if p != w._staging) == kept
        assert live_folder.name in kept and (live_folder / S.LOCK_NAME).is_file()
        assert sorted(p.name for p in outside.iterdir()) == [S.LOCK_NAME]
        # the new writer's own folder is locked while it lives: another writer leaves it
        assert S.remove_dead_staging_folders() == [] and (w._staging / S.LOCK_NAME).is_file()
        w.open_array("x", (16,), torch.float32, "sample").append(torch.randn(8, 16))
        w.close()
        assert not w._staging.exists()
    finally:
        live.stdin.write("\n")
        live.stdin.flush()
        _, err = live.communicate(timeout=300)
    assert live.returncode == 0, err[-3000:]
    assert not live_folder.exists()  # (its writer removed it)


@pytest.mark.parametrize("prefix", S.PREFIXES)
def test_a_folder_is_removed_only_once_no_process_holds_its_lock(staging_dir, prefix):
    """A folder made by a process that forked, then died: its lock is held by the forked child
    as long as that one lives (the child may still write there), and the folder stays."""
    go = staging_dir.parent / "go"
    p = _script(staging_dir, f"""
        import json, os, sys, time
        from activationscope.store._staging import make_staging_folder
        folder, fd = make_staging_folder({prefix!r})
        (folder / "shard").write_bytes(b"staged")
        child = os.fork()
        if child == 0:
            os.close(1)  # (the test reads the script's output to its end: this child keeps none of it)
            os.close(2)
            for _ in range(30000):
                if os.path.exists({str(go)!r}):
                    break
                time.sleep(0.01)
            os._exit(0)
        print(json.dumps([str(folder), child]), flush=True)
        os._exit(9)
    """)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 9, err[-3000:]
    folder, child = json.loads(out)
    folder = Path(folder)
    assert folder.name.startswith(prefix) and (folder / "shard").read_bytes() == b"staged"
    assert S.remove_dead_staging_folders() == [] and folder.exists()
    go.write_bytes(b"")
    deadline = time.monotonic() + 60
    while os.path.exists(f"/proc/{child}") if os.path.isdir("/proc") else False:
        assert time.monotonic() < deadline, "the forked child did not end"
        time.sleep(0.05)
    for _ in range(200):  # (its end, as seen by the kernel's locks, may lag the exit a little)
        removed = S.remove_dead_staging_folders()
        if removed:
            break
        time.sleep(0.05)
    assert removed == [str(folder)] and not folder.exists()


def test_without_flock_a_folder_has_no_lock_file_and_only_its_writer_removes_it(staging_dir, monkeypatch):
    monkeypatch.setattr(S, "_take_lock", lambda fd: False)
    w = StoreWriter(f"memory://staged/{uuid.uuid4().hex}.zarr", chunk_rows=4)
    folder = w._staging
    assert folder.parent == staging_dir and list(folder.iterdir()) == []  # (no lock file, no .new one)
    monkeypatch.undo()
    assert S.remove_dead_staging_folders(staging_dir) == [] and folder.is_dir()
    w.abort()
    assert not folder.exists()


def test_a_staging_folder_has_a_known_prefix():
    with pytest.raises(ValueError, match="prefix must be one of"):
        S.make_staging_folder("elsewhere-")


def test_a_dead_writers_folder_of_another_host_is_left(staging_dir):
    """On a $TMPDIR shared between hosts (a network file system whose locks may not reach across
    them), only this host's folders are taken for dead writers'."""
    dead = _killed_writer_folder(staging_dir)
    lock = dead / S.LOCK_NAME
    holder = json.loads(lock.read_text())
    assert holder["pid"] > 0 and holder["host"] == socket.gethostname()
    lock.write_text(json.dumps({**holder, "host": holder["host"] + "-other"}))
    damaged = _killed_writer_folder(staging_dir)
    (damaged / S.LOCK_NAME).write_text("{not json")
    assert S.remove_dead_staging_folders() == [] and dead.is_dir() and damaged.is_dir()
    lock.write_text(json.dumps(holder))
    assert S.remove_dead_staging_folders() == [str(dead)] and damaged.is_dir()


def test_without_fcntl_the_sweep_removes_nothing_and_never_fails_the_writer(staging_dir, monkeypatch):
    """Where there is no flock (no fcntl, no O_NONBLOCK, no os.pread: not POSIX) no folder has a
    lock file: the sweep at a remote writer's open leaves every folder, and does not fail it."""
    other = staging_dir / "acs-staging-other"
    other.mkdir()
    (other / "shard").write_bytes(b"staged")
    monkeypatch.setitem(sys.modules, "fcntl", None)
    monkeypatch.delattr(os, "O_NONBLOCK", raising=False)
    monkeypatch.delattr(os, "pread", raising=False)
    w = StoreWriter(f"memory://staged/{uuid.uuid4().hex}.zarr", chunk_rows=4)
    try:
        assert list(w._staging.iterdir()) == []  # (no lock file)
        assert (other / "shard").read_bytes() == b"staged"
        assert S.remove_dead_staging_folders() == []
    finally:
        w.abort()
    assert not w._staging.exists() and other.is_dir()


def test_a_lock_file_of_any_content_never_fails_the_sweep(staging_dir):
    for name, content in [("deep", b"[" * 100_000), ("bytes", b"\xff\xfe{"), ("list", b"[1, 2]"),
                          ("host", json.dumps({"host": ["x"]}).encode())]:
        folder = staging_dir / f"acs-staging-{name}"
        folder.mkdir()
        (folder / S.LOCK_NAME).write_bytes(content)
    assert S.remove_dead_staging_folders() == []
    assert sorted(p.name for p in staging_dir.iterdir()) == ["acs-staging-bytes", "acs-staging-deep",
                                                             "acs-staging-host", "acs-staging-list"]
    w = StoreWriter(f"memory://staged/{uuid.uuid4().hex}.zarr", chunk_rows=4)
    w.abort()


def test_a_dead_folder_whose_removal_fails_part_way_keeps_its_lock_file(staging_dir, monkeypatch):
    """A file that cannot go (or a sweep killed part way) leaves the rest of a dead writer's
    folder with its lock file, never without it (a folder without one is never removed)."""
    folder, fd = S.make_staging_folder()
    shards = folder / "acts" / "x" / "c"
    shards.mkdir(parents=True)
    for k in range(4):
        (shards / str(k)).write_bytes(b"staged")
    (folder / "zarr.json").write_bytes(b"{}")
    os.close(fd)  # (its writer is gone)
    unlink = os.unlink

    def stuck(path, *args, **kwargs):
        if os.fspath(path) == "2":
            raise PermissionError(13, "Permission denied", path)
        return unlink(path, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(os, "unlink", stuck)
        assert S.remove_dead_staging_folders() == []
    assert (folder / S.LOCK_NAME).is_file() and [p.name for p in shards.iterdir()] == ["2"]
    assert S.remove_dead_staging_folders() == [str(folder)] and not folder.exists()


@pytest.mark.parametrize("where", ["missing", "file"])
def test_a_staging_folder_that_cannot_be_made_fails_the_writer_naming_tmpdir_and_the_fix(tmp_path, monkeypatch,
                                                                                         where):
    tmp = tmp_path / "tmp"
    if where == "file":
        tmp.write_bytes(b"not a folder")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    url = f"memory://staged/{uuid.uuid4().hex}.zarr"
    with pytest.raises(acs.StoreError, match=r"(?s)staging folder of store .*cannot be made in .*TMPDIR.*"
                                             r"set TMPDIR to a folder .*'Into a store'") as e:
        StoreWriter(url, chunk_rows=4)
    assert isinstance(e.value, OSError) and str(tmp) in str(e.value) and url in str(e.value)
    import fsspec

    assert not fsspec.filesystem("memory").exists(url)  # (nothing of the store was made)


def test_a_writers_own_removal_that_fails_part_way_keeps_its_lock_file_for_the_next_sweep(staging_dir,
                                                                                           monkeypatch):
    """The close of a remote writer that cannot remove every file of its staging folder (or is
    killed while it does) leaves the rest with the lock file, which the next sweep takes."""
    w = StoreWriter(f"memory://staged/{uuid.uuid4().hex}.zarr", chunk_rows=4, shard_bytes=4 * 16 * 4)
    w.open_array("x", (16,), torch.float32, "sample").append(torch.randn(40, 16))
    w._core.drain()
    folder = w._staging
    (folder / "acts" / "x" / "left").write_bytes(b"")  # (a file that will not go)
    unlink = os.unlink

    def stuck(path, *args, **kwargs):
        if os.path.basename(os.fspath(path)) == "left":
            raise PermissionError(13, "Permission denied", path)
        return unlink(path, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(os, "unlink", stuck)
        w.abort()
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) == \
        [S.LOCK_NAME, os.path.join("acts", "x", "left")]
    assert S.remove_dead_staging_folders() == [str(folder)] and not folder.exists()
