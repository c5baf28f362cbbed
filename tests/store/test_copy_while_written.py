"""copy_store of a store that a capture is still writing (a colleague copying a running capture
off object storage): the copy is one commit of the source, or a StoreError leaving an
incomplete target with no rows; never a root listing rows that the copied objects lack."""

from __future__ import annotations

import time

import pytest
import torch

import activationscope as acs
from activationscope.store import _backend as B
from activationscope.store import copy_store, open_store

from acs_testing import store_target


@pytest.fixture(params=["s3", "memory"])
def live(request):
    """A capture attached to a new store (S3 or fsspec memory) that commits at every forward
    (one chunk a shard, commit_interval 0), after two forwards; ``step()`` runs one more."""
    url, so = store_target(request, request.param, "live")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()).eval()
    xs = torch.randn(40, 4)
    scope = acs.ActivationScope(store=url, store_options={"storage_options": so, "chunk_rows": 4,
                                                           "shard_bytes": 4 * 8 * 4, "commit_interval": 0})
    with torch.no_grad():  # (before the capture; batch by batch, as captured: a matmul's rounding depends on the batch)
        ref = {"0.output": torch.cat([model[0](x) for x in xs.split(4)]),
               "1.output": torch.cat([model(x) for x in xs.split(4)])}
    tracker = scope.track(model).attach()
    done = [0]

    def step():
        i = done[0]
        tracker.set_batch(sample_ids=range(4 * i, 4 * i + 4))
        with torch.no_grad():
            model(xs[4 * i: 4 * i + 4])
        done[0] += 1
        deadline = time.monotonic() + 10
        while tracker.writer.n_samples_committed < 4 * done[0]:  # (the writer thread made its shards durable)
            assert time.monotonic() < deadline, tracker.writer.n_samples_committed
            time.sleep(0.01)
            tracker.writer.commit()

    step()
    step()
    yield url, so, step, ref
    tracker.remove()


def _commit_while_copying(monkeypatch, step, times):
    """Run ``step`` (a forward that commits) each time the copy reads the first shard, ``times`` times."""
    left = [times]
    get = B.ZarrBackend.get

    def get_committing(self, key, *args, **kwargs):
        if left[0] and key == "acts/0.output/c/0/0":
            left[0] -= 1
            step()
        return get(self, key, *args, **kwargs)

    monkeypatch.setattr(B.ZarrBackend, "get", get_committing)
    return left


def test_a_copy_of_a_store_committed_during_it_is_one_commit_of_it(live, tmp_path, monkeypatch):
    """The root was read after the objects: a commit landing during the copy gave a root listing
    rows whose array documents and shards were copied before them, and the copy did not open."""
    url, so, step, ref = live
    _commit_while_copying(monkeypatch, step, 1)
    copy_store(B.resolve(url, storage_options=so), str(tmp_path / "copy.zarr"))
    monkeypatch.undo()
    copy = open_store(tmp_path / "copy.zarr")
    assert copy.status == "incomplete" and copy.n_samples >= 8
    assert copy.verify() == []
    for hp, rows in ref.items():
        assert torch.equal(copy[hp], rows[: copy.n_samples]), hp


def test_a_copy_of_a_store_committed_during_every_attempt_is_refused(live, tmp_path, monkeypatch):
    url, so, step, _ = live
    left = _commit_while_copying(monkeypatch, step, 10)
    with pytest.raises(acs.StoreError, match=r"of copy_store was committed again while it was copied, 3 times "
                       r"\(a capture or resume is writing it\).*left an incomplete store with no rows: copy again "
                       r"once the writer has finished"):
        copy_store(B.resolve(url, storage_options=so), str(tmp_path / "copy.zarr"))
    monkeypatch.undo()
    assert left[0] == 7
    copy = open_store(tmp_path / "copy.zarr")
    assert copy.status == "incomplete" and copy.n_samples == 0 and copy.hook_points == []


def test_a_copy_of_a_store_being_written_never_replaces_an_existing_target(live, tmp_path, monkeypatch):
    """With overwrite=True the target's store was deleted before the source was read: a copy
    that then failed (a commit landing during every attempt) left an empty incomplete store
    where the user's old store had been. Refused now before anything changes while a writer
    holds the source; a copy into an empty target still copies it (above)."""
    url, so, step, ref = live
    old = tmp_path / "old.zarr"
    copy_store(B.resolve(url, storage_options=so), str(old))  # a store of 8 rows, then replaced
    before = sorted(p.relative_to(old) for p in old.rglob("*"))
    left = _commit_while_copying(monkeypatch, step, 10)
    with pytest.raises(acs.StoreLockedError, match=r"source .* of copy_store is being written by pid \d+ on host .*"
                       r"nothing was changed.*copy into a new path"):
        copy_store(B.resolve(url, storage_options=so), str(old), overwrite=True)
    monkeypatch.undo()
    assert left[0] == 10  # (refused before the source's objects were read)
    assert sorted(p.relative_to(old) for p in old.rglob("*")) == before
    kept = open_store(old)
    assert kept.n_samples == 8 and kept.verify() == []
    for hp, rows in ref.items():
        assert torch.equal(kept[hp], rows[:8]), hp


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_copy_of_a_store_no_writer_holds_replaces_an_existing_target(request, where, tmp_path):
    """A released lock (a local lock file left empty) or one of a process of this host that is
    gone (killed: its pid in the lock file or marker) is no writer: overwrite=True copies."""
    import json
    import socket
    import subprocess

    from acs_testing import store_target, store_three_batches

    url, so = store_target(request, where, "done")
    data = store_three_batches(url)
    src = B.resolve(url, storage_options=so)
    gone = subprocess.Popen(["true"])
    gone.wait()
    src_w = B.resolve(url, storage_options=so, read_only=False) if where != "local" else src
    dead = json.dumps({"pid": gone.pid, "host": socket.gethostname(), "started": "2026-01-01T00:00:00Z",
                       "token": "x"}).encode()
    if where == "local":
        (tmp_path / url.rsplit("/", 1)[-1] / B.LOCK_KEY).write_bytes(dead)
    else:
        src_w.set(B.LOCK_KEY, dead)
    old = tmp_path / "old.zarr"
    store_three_batches(old)
    copy_store(src, str(old), overwrite=True)
    copy = open_store(old)
    assert copy.status == "complete" and copy.verify() == [] and torch.equal(copy["0.output"], data)
