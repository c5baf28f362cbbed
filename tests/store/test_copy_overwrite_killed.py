"""copy_store killed at any step (each write or delete made to raise in turn, and one real
death of a child process): the target is the old store intact or an incomplete store listing
no row, never the old root over missing files, and copy_store(..., overwrite=True) run again
completes the copy (FORMAT.md section 7), on a local folder, in fsspec memory and on S3."""

from __future__ import annotations

import json
import uuid

import pytest
import torch

from activationscope.store import copy_store, open_store
from activationscope.store import _backend as B

from acs_testing import Killed, die_at, run_killed_at_delete, store_target
from hostile import HP
from test_remote_overwrite_race import _write


@pytest.fixture(params=["local", "memory", "s3"])
def target(request):
    return store_target(request, request.param, "copy")


@pytest.fixture(scope="module")
def sources():
    """Two stores in memory: the old one (copied to the target first) and the new one."""
    old, new = (f"memory://acs/copy-src-{uuid.uuid4().hex}.zarr" for _ in range(2))
    return (old, _write(old, None, seed=0)), (new, _write(new, None, seed=1, n_rows=100, feature=4))


def _old_or_new_incomplete(url: str, so, old_rows: torch.Tensor, old_run: str) -> str:
    st = open_store(url, storage_options=so)
    if st.attrs.get("run_id") == old_run:
        assert st.status == "complete" and torch.equal(st[HP], old_rows) and st.verify() == []
        return "old"
    assert st.status == "incomplete" and st.hook_points == [] and st.n_samples == 0
    assert st.row_table().num_rows == 0 and not st.reductions.get(HP)
    assert st.verify() == []
    return "new"


def test_copy_store_killed_at_each_step_leaves_the_old_store_or_an_incomplete_one(target, sources, monkeypatch):
    url, so = target
    (old, old_rows), (new, new_rows) = sources
    src_old, src_new = open_store(old), open_store(new)
    seen, step = [], 0
    while True:
        copy_store(src_old, _target(url, so), overwrite=True)
        old_run = open_store(url, storage_options=so).attrs["run_id"]
        done = die_at(monkeypatch, step)
        try:
            copy_store(src_new, _target(url, so), overwrite=True)
        except Killed:
            killed = True
        else:
            killed = False
        monkeypatch.undo()
        if not killed:
            break
        if step == 0:
            assert _old_or_new_incomplete(url, so, old_rows, old_run) == "old"  # (nothing written yet)
        else:
            assert done[0] == ("set", "zarr.json"), done[:3]  # the first write is the new, empty root
            assert _old_or_new_incomplete(url, so, old_rows, old_run) == "new", (step, done[-1])
        seen.append(done[-1] if done else None)
        if step % 5 == 0 or step < 3:  # (running it again completes it, whatever it left)
            copy_store(src_new, _target(url, so), overwrite=True)
            st = open_store(url, storage_options=so)
            assert st.status == "complete" and torch.equal(st[HP], new_rows) and st.verify() == []
        step += 1
    assert any(op == "delete" for op, _ in filter(None, seen)) and step > 10, seen
    st = open_store(url, storage_options=so)
    assert st.status == "complete" and torch.equal(st[HP], new_rows) and st.verify() == []
    assert st.attrs["run_id"] == src_new.attrs["run_id"]


def _target(url: str, so):
    """copy_store's target: a path or memory URL, or an S3 store by its storage options."""
    return url if so is None else B.resolve(url, storage_options=so)


def test_a_new_copy_killed_partway_is_completed_by_an_overwrite(target, sources, monkeypatch):
    """An empty target killed into holds an incomplete store (not files without a root)."""
    url, so = target
    (_, _), (new, new_rows) = sources
    die_at(monkeypatch, 3)
    with pytest.raises(Killed):
        copy_store(open_store(new), _target(url, so))
    monkeypatch.undo()
    st = open_store(url, storage_options=so)
    assert st.status == "incomplete" and st.n_samples == 0 and st.hook_points == []
    copy_store(open_store(new), _target(url, so), overwrite=True)
    assert torch.equal(open_store(url, storage_options=so)[HP], new_rows)


_CHILD = """
import json, sys
from activationscope.store import _backend as B, copy_store, open_store

so = json.loads(sys.argv[3])
copy_store(open_store(sys.argv[1]), sys.argv[2] if so is None else B.resolve(sys.argv[2], storage_options=so),
           overwrite=True)
"""


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_copy_whose_process_dies_while_deleting_the_old_store_is_completed(request, where, tmp_path):
    """A real death (its lock left behind: a file lock the kernel released, or a marker of a
    dead pid): the target opens as an incomplete store, and copy_store again completes it."""
    url, so = store_target(request, where, "copy")
    src_old = tmp_path / "old.zarr"
    old_rows = _write(str(src_old), None, seed=0)
    src_new = tmp_path / "new.zarr"
    new_rows = _write(str(src_new), None, seed=1, n_rows=100, feature=4)
    copy_store(open_store(src_old), _target(url, so))
    old_run = open_store(url, storage_options=so).attrs["run_id"]
    run_killed_at_delete(_CHILD, 2, str(src_new), url, json.dumps(so))  # (while the old store goes)
    assert _old_or_new_incomplete(url, so, old_rows, old_run) == "new"
    copy_store(open_store(src_new), _target(url, so), overwrite=True)
    st = open_store(url, storage_options=so)
    assert st.status == "complete" and torch.equal(st[HP], new_rows) and st.verify() == []
