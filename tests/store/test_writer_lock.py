"""One writer at a time: a second writer (same or another process, new store, resume or
overwrite) gets StoreLockedError naming the holder; the first one's rows stay intact."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import activationscope as acs
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
    assert not (tmp_path / "nothing.zarr").exists() or True
    with pytest.raises(StoreError, match="nothing to resume"):
        StoreWriter(tmp_path / "nothing.zarr", resume=True)
    assert not (tmp_path / "nothing.zarr").exists()  # the folder the lock made is removed again


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
    with pytest.raises(StoreLockedError, match=rf"pid {os.getpid()}.*delete memory://acs-lock-test/run.zarr/{LOCK_KEY}"):
        StoreWriter(url, overwrite=True)
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
    with pytest.raises(StoreLockedError, match="pid 1 on host 'another-host'"):
        StoreWriter(ms, resume=True)
