"""A store on object storage or in fsspec memory overwritten by another writer while a reader
has it open, with the overwrite landing between the reader's check of the root document and its
read of a file: the reader raises StoreError naming the replacement, never returns the new
run's rows as the opened run's (FORMAT.md sections 2 ``run_id`` and 7). An overwrite replaces
the root document before it deletes or writes anything else, so one killed right after that
leaves a store that opens as a new, incomplete one and can be resumed or overwritten."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from activationscope.errors import StoreCorruptError, StoreError
from activationscope.store import StoreWriter, open_store
from activationscope.store import _backend as B

from acs_testing import Killed, die_at, run_killed_at_delete, store_target
from hostile import CHUNK_ROWS, FEATURE, HP, N_ROWS, SHARD_ROWS, _Mean

REPLACED = r"was replaced since it was opened .*reopen it"


@pytest.fixture(params=["s3", "memory"])
def remote(request):
    return store_target(request, request.param, "race")


@pytest.fixture(params=["s3", "memory", "local"])
def anywhere(request):
    return store_target(request, request.param, "race")


def _write(url: str, so, seed: int, *, overwrite: bool = False, resume: bool = False, n_rows: int = N_ROWS,
           feature: int = FEATURE) -> torch.Tensor:
    """A store of ``n_rows`` rows of ``HP`` (as hostile.make_store: 64-row shards of 16-row chunks,
    a ``label`` column, a ``mean`` reduction); another seed gives other values in the same files."""
    data = torch.randn(n_rows, feature, generator=torch.Generator().manual_seed(seed))
    w = StoreWriter(url, overwrite=overwrite, resume=resume, chunk_rows=CHUNK_ROWS,
                    shard_bytes=SHARD_ROWS * feature * 4, storage_options=so)
    a = w.open_array(HP, (feature,), torch.float32, "sample")
    first = w.n_samples_committed
    for s in range(0, n_rows, 32):
        e = min(n_rows, s + 32)
        a.append(data[s:e])
        w.add_batch(e - s, list(range(first + s, first + e)), None, {"label": (torch.arange(s, e) + seed) % 3})
        w.commit()
    w.add_reductions(HP, "mean", _Mean(data.double().mean(0)))
    w.close()
    return data


def _overwrite_before(st, method: str, pick, overwrite) -> list:
    """Make the reader ``st``'s backend run ``overwrite()`` (once) right before its first
    ``method`` call whose key ``pick(key)`` accepts: after the reader checked the root, before
    it read the file. Returns the list of keys it was triggered at (one, once it ran)."""
    inner = getattr(st._backend, method)
    fired: list = []

    def wrapped(key, *args, **kwargs):
        if not fired and pick(key):
            fired.append(key)
            overwrite()
        return inner(key, *args, **kwargs)

    setattr(st._backend, method, wrapped)  # (this reader's backend only; the writer makes its own)
    return fired


READS = {
    # (backend method, which key, what the reader reads)
    "array document": ("get", lambda k: k == f"acts/{HP}/zarr.json", lambda st: st.rows(HP, 0, 10)),
    "manifest": ("get", lambda k: k.endswith("manifest.json"), lambda st: st.rows(HP, 0, 10)),
    "shard index": ("tail", lambda k: k.startswith(f"acts/{HP}/c/1"), lambda st: st.rows(HP, 64, 74)),
    "row-table part": ("get", lambda k: k.startswith("rows/sample/part-"), lambda st: st.row_table()),
    "reduction": ("get", lambda k: k.startswith("reductions/"), lambda st: st.reductions[HP]["mean"]),
    "dask graph": ("get", lambda k: k.endswith("manifest.json"), lambda st: _to_dask(st).compute()),
    "dask row table": ("tail", lambda k: k.startswith("rows/sample/part-"), lambda st: _row_table_dask(st).compute()),
}


def _row_table_dask(st):
    from activationscope.analysis.dask import row_table_dask

    return row_table_dask(st)


def _to_dask(st):
    from activationscope.analysis.dask import to_dask

    return to_dask(st, HP)


@pytest.mark.parametrize(("what", "crc"), [(w, True) for w in READS] + [
    (w, False) for w in ("row-table part", "reduction", "dask row table")])
def test_overwrite_between_the_check_and_the_read_is_refused(anywhere, what, crc):
    """``crc`` False: a root without the optional crc32c of its row-table parts and reductions
    (stores written before they were recorded: nothing else tells the new run's files). Local
    stores too: their overwrite is no single rename (the old entries are moved aside one by one,
    root first), so a reader may open a file of the new run after its check of the root."""
    url, so = anywhere
    old = _write(url, so, seed=0)
    if not crc:
        _drop_crc32c(url, so)
    st = open_store(url, storage_options=so)
    if what in ("shard index", "reduction"):
        assert torch.equal(st.rows(HP, 0, 10), old[:10])  # (the array checked: its manifest is the old run's)
    new: list = []
    method, pick, read = READS[what]
    fired = _overwrite_before(st, method, pick, lambda: new.append(_write(url, so, seed=1, overwrite=True)))
    with pytest.raises(StoreError, match=REPLACED) as e:
        got = read(st)
        if isinstance(got, (torch.Tensor, np.ndarray)):  # (the defect returned the new run's rows)
            got = torch.as_tensor(got)
            assert not torch.equal(got, new[0][: len(got)]), "the new run's rows were returned as the opened run's"
    assert not isinstance(e.value, StoreCorruptError)
    assert fired, f"the reader never read its {what}"
    st.refresh()
    assert torch.equal(st[HP], new[0])


def _drop_crc32c(url: str, so) -> None:
    from activationscope.store._backend import resolve

    b = resolve(url, storage_options=so)  # (a local one writes it through a temporary file: a new inode)
    doc = json.loads(b.get("zarr.json"))
    attrs = doc["attributes"]["activationscope"]
    for tbl in attrs["row_tables"].values():
        tbl.pop("crc32c", None)
    for entries in attrs["reductions"].values():
        for e in entries.values():
            e.pop("crc32c", None)
    b.set("zarr.json", json.dumps(doc).encode())


def test_a_new_run_read_after_the_check_is_refused_on_every_read_of_rows(remote):
    """The shard of the first read, overwritten after the check, and every later read."""
    url, so = remote
    _write(url, so, seed=0)
    st = open_store(url, storage_options=so)
    _overwrite_before(st, "get", lambda k: k.endswith("manifest.json"), lambda: _write(url, so, seed=1, overwrite=True))
    for read in (lambda: st[HP], lambda: st.rows(HP, 100, 110), lambda: st.row_table(), lambda: st.verify()):
        with pytest.raises(StoreError, match=REPLACED):
            read()


def _root_of(raw: bytes) -> dict:
    return json.loads(raw)["attributes"]["activationscope"]


def test_overwrite_replaces_the_root_before_it_deletes_or_writes_anything(remote, monkeypatch):
    """The first object an overwrite writes is the root of its run (new run_id, incomplete, no
    rows or arrays: a new store's first root); a reader of the old run that reads while the old
    objects are being deleted is told the store was replaced (not that a shard is missing)."""
    url, so = remote
    old = _write(url, so, seed=0)
    st = open_store(url, storage_options=so)
    run = st.attrs["run_id"]
    ops: list = []
    seen: dict = {}
    set_, delete = B.ZarrBackend.set, B.ZarrBackend.delete

    def set_rec(self, key, data):
        if key != B.LOCK_KEY:
            ops.append(("set", key, bytes(data)))
        return set_(self, key, data)

    def delete_rec(self, key):
        if key != B.LOCK_KEY:
            ops.append(("delete", key, None))
            if key.startswith("rows/") and "reader" not in seen:  # the old run's shards are gone: replaced, not damage
                try:
                    st.rows(HP, 0, 10)
                except StoreError as e:
                    seen["reader"] = e
                else:
                    seen["reader"] = None
        return delete(self, key)

    monkeypatch.setattr(B.ZarrBackend, "set", set_rec)
    monkeypatch.setattr(B.ZarrBackend, "delete", delete_rec)
    new = _write(url, so, seed=1, overwrite=True)
    monkeypatch.undo()
    assert ops[0][:2] == ("set", "zarr.json"), ops[:3]
    first = _root_of(ops[0][2])
    assert first["run_id"] != run and first["status"] == "incomplete"
    assert first["n_samples"] == 0 and not first.get("arrays") and not first["row_tables"]["sample"]["parts"]
    deletes = [i for i, op in enumerate(ops) if op[0] == "delete"]
    assert deletes and all(ops[i][1] != "zarr.json" for i in deletes)  # the new root is never deleted
    assert isinstance(seen["reader"], StoreError) and "was replaced since it was opened" in str(seen["reader"])
    again = open_store(url, storage_options=so)
    assert again.attrs["run_id"] == first["run_id"] and torch.equal(again[HP], new)
    assert not torch.equal(new, old)


def _killed_after_replacing_the_root(url: str, so, monkeypatch) -> None:
    done = die_at(monkeypatch, 1)  # (its first delete)
    with pytest.raises(Killed):
        _write(url, so, seed=1, overwrite=True)
    monkeypatch.undo()
    assert done == [("set", "zarr.json")]


def test_an_overwrite_killed_after_replacing_the_root_leaves_a_new_incomplete_store(remote, monkeypatch):
    url, so = remote
    _write(url, so, seed=0)
    st = open_store(url, storage_options=so)
    _killed_after_replacing_the_root(url, so, monkeypatch)
    with pytest.raises(StoreError, match=REPLACED):
        st.rows(HP, 0, 10)
    got = open_store(url, storage_options=so)
    assert got.status == "incomplete" and got.attrs["run_id"] != st.attrs["run_id"]
    assert got.hook_points == [] and got.n_samples == 0 and got.row_table().num_rows == 0
    assert got.reductions == {} or not got.reductions.get(HP)
    assert any(k.startswith(f"acts/{HP}/c/") for k in got._backend.list("acts/"))  # (the old run's files are there)
    assert got.verify() == []


@pytest.mark.parametrize("then", ["resume", "overwrite"])
def test_an_overwrite_killed_after_replacing_the_root_is_resumed_or_overwritten(remote, monkeypatch, then):
    """The old run's files left behind are never rows of the store: a resume (here with another
    feature shape, fewer rows) removes them before it writes, an overwrite deletes them."""
    url, so = remote
    _write(url, so, seed=0)
    _killed_after_replacing_the_root(url, so, monkeypatch)
    killed_run = open_store(url, storage_options=so).attrs["run_id"]
    new = _write(url, so, seed=2, n_rows=70, feature=4, resume=then == "resume", overwrite=then == "overwrite")
    st = open_store(url, storage_options=so)
    assert st.status == "complete" and (st.attrs["run_id"] == killed_run) == (then == "resume")
    assert st.hook_points == [HP] and st.n_samples == 70 and torch.equal(st[HP], new)
    assert st.row_table().num_rows == 70
    assert st.verify() == []
    shards = sorted(k for k in st._backend.list(f"acts/{HP}/") if "/c/" in k)
    assert shards == [f"acts/{HP}/c/0/0", f"acts/{HP}/c/1/0"]  # (70 rows of 4 features: 2 shards; none of the old 5)


def test_remote_lazy_opens_cost_one_root_stamp_each(remote, monkeypatch):
    """The reader's check of the root costs one metadata request (``stamp``) per file it opens
    lazily (the array's documents, a row table, a reduction), none per shard index (each chunk
    read through it is checked against the opened run's manifest) and none per chunk."""
    url, so = remote
    old = _write(url, so, seed=0)
    st = open_store(url, storage_options=so)
    n = []
    stamp = type(st._backend).stamp

    def counted(self, key):
        n.append(key)
        return stamp(self, key)

    monkeypatch.setattr(type(st._backend), "stamp", counted)
    assert torch.equal(st[HP], old)  # the array (documents, manifest); its 5 shards and 20 chunks: none
    assert len(n) == 1, n
    assert torch.equal(st[HP], old)  # (from the reader's cache: no file opened)
    assert len(n) == 1, n
    st.row_table()
    st.reductions[HP]["mean"]
    assert len(n) == 3, n


def test_a_dask_row_table_computed_after_an_overwrite_is_refused_without_crc32c(anywhere):
    """A partition reads its part when computed: in a store that records no crc32c of its parts,
    the root is read after the part, so another run's part (same rows, same batches) is refused."""
    from activationscope.analysis.dask import row_table_dask

    url, so = anywhere
    _write(url, so, seed=0)
    _drop_crc32c(url, so)
    graph = row_table_dask(open_store(url, storage_options=so))
    _write(url, so, seed=1, overwrite=True)
    with pytest.raises(StoreError, match="was replaced since the Dask graph was made"):
        graph.compute()


_CHILD = """
import json, sys
from test_remote_overwrite_race import _write

_write(sys.argv[1], json.loads(sys.argv[2]), seed=1, overwrite=True)
"""


def test_an_overwrite_on_s3_whose_process_dies_after_replacing_the_root_is_resumed(s3):
    """A real death (its lock marker left behind): the store opens as a new incomplete one, and
    a resume in this process (same host, the writer's pid gone) takes the marker over and writes
    only its own rows."""
    url = f"s3://acs-bucket/race-{uuid.uuid4().hex}.zarr"
    _write(url, s3, seed=0)
    old_run = open_store(url, storage_options=s3).attrs["run_id"]
    # (killed at its first delete: right after the root of its run replaced the old one)
    run_killed_at_delete(_CHILD, 1, url, json.dumps(s3), path=[Path(__file__).parent])
    st = open_store(url, storage_options=s3)
    assert st.status == "incomplete" and st.attrs["run_id"] != old_run and st.hook_points == [] and st.n_samples == 0
    new = _write(url, s3, seed=3, n_rows=40, resume=True)
    st = open_store(url, storage_options=s3)
    assert st.status == "complete" and st.n_samples == 40 and torch.equal(st[HP], new)
    assert st.verify() == []
