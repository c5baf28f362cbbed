"""The overwrite of a multi-rank store (rank 0's prepare_root) killed at any step: the store
is the old run intact or an incomplete store of the new run that shows no row of the old run
(neither its arrays nor its leftover rank stores), and rerunning the capture (overwrite, or
resume) completes it (FORMAT.md section 10), on a local folder, in fsspec memory and on S3."""

from __future__ import annotations

import json
import os
import shutil
import sys
import uuid
from pathlib import Path

import pytest
import torch

import activationscope as acs
from activationscope.store import StoreWriter
from activationscope.store import _backend as B
from activationscope.store.ranks import commit_ranks, prepare_root

from acs_testing import Killed, die_at, hold_aside_delete, run_killed_at_delete, store_target

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import torchrun_capture as job  # noqa: E402

WORLD = 2


def _where(request, where: str) -> tuple[str, dict | None]:
    return store_target(request, where, "ranks", bucket="acs-ranks")


@pytest.fixture(params=["local", "memory", "s3"])
def target(request):
    return _where(request, request.param)


def _model(seed: int) -> torch.nn.Module:
    model = job.toy_mlp(job.WIDTH, 3).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    return model


def _strip_run_ids(url: str, so) -> None:
    """Make the store look written before rank stores recorded their run (no
    ``distributed.run_id`` in the root, no ``rank_store.run_id`` in the rank stores)."""
    b = B.resolve(url, storage_options=so)
    for key in ["zarr.json"] + [f"ranks/{r:05d}/zarr.json" for r in range(WORLD)]:
        doc = json.loads(b.get(key))
        attrs = doc["attributes"]["activationscope"]
        (attrs.get("distributed") or {}).pop("run_id", None)
        (attrs.get("rank_store") or {}).pop("run_id", None)
        b.set(key, json.dumps(doc).encode())


def _old_store(url: str, so, kind: str) -> dict:
    """The store the overwrite replaces: ``committed``, its rank stores ``uncommitted``, or
    uncommitted as written before run ids (``legacy``). Returns its root attributes."""
    if B.resolve(url, storage_options=so).get("zarr.json") is not None:
        prepare_root(url, world_size=WORLD, overwrite=True, storage_options=so)
    job.capture_rank_stores(url, ["mean"], WORLD, storage_options=so, model=_model(0))
    if kind == "committed":
        commit_ranks(url, storage_options=so)
    elif kind == "legacy":
        _strip_run_ids(url, so)
    st = acs.open_store(url, storage_options=so)
    assert st.n_samples == job.N_BATCHES * job.BATCH
    return dict(st.attrs)


def _state(url: str, so, old: dict) -> str:
    """'old' (the old run as it was) or 'new' (an incomplete store of another run, no row)."""
    st = acs.open_store(url, storage_options=so)
    if st.attrs.get("run_id") == old["run_id"]:
        assert st.status == old["status"] and st.n_samples == old["n_samples"]
        assert st.verify() == []
        return "old"
    assert st.status == "incomplete" and st.n_samples == 0 and st.hook_points == []
    assert st.attrs["distributed"]["committed"] is False
    return "new"


def _n_steps(url: str, so) -> int:
    """The writes and deletes an overwrite of the store makes: its root, then one delete per
    other object (object storage) or per top-level entry (a local folder's, removed whole);
    the count varies with the rank stores' commits (one row-table part each)."""
    b = B.resolve(url, storage_options=so)
    if isinstance(b, B.LocalBackend):
        return 1 + sum(p.name not in ("zarr.json", B.LOCK_KEY) for p in b.root.iterdir())
    return 1 + sum(key != "zarr.json" for key in b.list(""))


@pytest.mark.parametrize("kind", ["committed", "uncommitted", "legacy"])
def test_a_multi_rank_overwrite_killed_at_each_step_leaves_the_old_run_or_an_empty_new_one(target, kind,
                                                                                            monkeypatch):
    url, so = target
    for at in ("first", "root", "second", "half", "last"):
        old = _old_store(url, so, kind)
        n = _n_steps(url, so)
        assert n >= 2
        step = {"first": 0, "root": 1, "second": min(2, n - 1), "half": n // 2, "last": n - 1}[at]
        done = die_at(monkeypatch, step)
        with pytest.raises(Killed):
            prepare_root(url, world_size=WORLD, overwrite=True, storage_options=so)
        monkeypatch.undo()
        assert _state(url, so, old) == ("old" if step == 0 else "new"), (step, done)
        if step:
            assert done[0] == ("set", "zarr.json")  # the new run's root first
            st = acs.open_store(url, storage_options=so)
            if kind != "committed" and not any("ranks" in k for _, k in done[1:]):
                # every old rank store is still there, and none is shown as this run's
                assert st.attrs["distributed"].get("other_runs") == list(range(WORLD))
            with pytest.raises(acs.StoreError):  # consolidate writes nothing of the old run
                commit_ranks(url, storage_options=so)
            assert _state(url, so, old) == "new"


@pytest.mark.parametrize("then", ["overwrite", "resume"])
@pytest.mark.parametrize("kind", ["committed", "uncommitted", "legacy"])
def test_a_killed_multi_rank_overwrite_is_completed_by_rerunning_it(target, kind, then, monkeypatch):
    url, so = target
    old = _old_store(url, so, kind)
    die_at(monkeypatch, 1)  # the new root written, nothing of the old run deleted
    with pytest.raises(Killed):
        prepare_root(url, world_size=WORLD, overwrite=True, storage_options=so)
    monkeypatch.undo()
    killed_run = acs.open_store(url, storage_options=so).attrs["run_id"]
    run = prepare_root(url, world_size=WORLD, overwrite=then == "overwrite", resume=then == "resume",
                       storage_options=so)  # (rank 0's step of the rerun)
    st = acs.open_store(url, storage_options=so)
    assert (st.attrs["run_id"] == killed_run) == (then == "resume") and run == st.attrs["distributed"]["run_id"]
    assert st.n_samples == 0 and not list(B.resolve(url, storage_options=so).list("acts/"))
    job.capture_rank_stores(url, ["mean"], WORLD, storage_options=so, model=_model(1))
    for r in range(WORLD):
        assert acs.open_store(f"{url}/ranks/{r:05d}", storage_options=so).attrs["rank_store"]["run_id"] == run
    commit_ranks(url, storage_options=so)
    st = acs.open_store(url, storage_options=so)
    ref = f"memory://acs/ref-{uuid.uuid4().hex}.zarr"
    job.capture_rank_stores(ref, ["mean"], WORLD, model=_model(1))
    commit_ranks(ref)
    ref = acs.open_store(ref)
    assert st.status == "complete" and st.attrs["run_id"] != old["run_id"] and st.verify() == []
    assert st.attrs["model"] == ref.attrs["model"] != old["model"]
    for hp in ref.hook_points:
        assert torch.equal(st[hp], ref[hp])
    assert not list(B.resolve(url, storage_options=so).list("ranks/"))


def test_a_rank_store_of_another_run_is_overwritten_not_resumed(tmp_path):
    """A rank task (RankStore) resuming under a root of another run than its rank store's
    starts that rank store again instead of continuing the other run's rows."""
    url = str(tmp_path / "s.zarr")
    job.capture_rank_stores(url, ["mean"], WORLD, model=_model(0))
    b = B.resolve(url)
    doc = json.loads(b.get("zarr.json"))
    doc["attributes"]["activationscope"]["distributed"]["run_id"] = uuid.uuid4().hex  # (as a killed overwrite leaves)
    b.set("zarr.json", json.dumps(doc).encode())
    assert acs.open_store(url).n_samples == 0
    scope = acs.ActivationScope(store=url, reductions=["mean"], store_options={
        **job.STORE_OPTIONS, "resume": True, "process_group": acs.RankStore(0, WORLD)})
    model = _model(1)
    with scope.track(model) as tracker, torch.no_grad():
        assert tracker.resume_from == 0
        tracker.set_batch(sample_ids=torch.arange(job.BATCH))
        model(job.batch(0))
    st = acs.open_store(url)
    assert st.n_samples == job.BATCH and st.attrs["distributed"]["other_runs"] == [1]
    with pytest.raises(acs.StoreError, match=r"rank store\(s\) \[1\] .* another run"):
        commit_ranks(url)


_CHILD = """
import json, sys
from activationscope.store.ranks import prepare_root

prepare_root(sys.argv[1], world_size=2, overwrite=True, storage_options=json.loads(sys.argv[2]))
"""


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_multi_rank_overwrite_whose_process_dies_is_resumed(request, where):
    url, so = _where(request, where)
    old = _old_store(url, so, "uncommitted")
    run_killed_at_delete(_CHILD, 1 if where == "local" else 3, url, json.dumps(so))  # (while the old store goes)
    assert _state(url, so, old) == "new"
    prepare_root(url, world_size=WORLD, resume=True, storage_options=so)  # (its lock taken over: a dead pid)
    job.capture_rank_stores(url, ["mean"], WORLD, storage_options=so, model=_model(1))
    commit_ranks(url, storage_options=so)
    st = acs.open_store(url, storage_options=so)
    assert st.status == "complete" and st.attrs["model"] != old["model"] and st.verify() == []


@pytest.mark.parametrize("where", ["local", "memory"])
def test_an_overwrite_leaves_what_is_not_a_store_s_as_a_one_process_overwrite_does(request, where):
    """A multi-rank overwrite cleared the whole folder (prefix): a note of the user's beside the
    store went with it, and a folder that held no store at all was emptied. Both are now refused
    with StoreExistsError naming what would be lost, nothing changed, as a one-process overwrite
    refuses them."""
    url, so = _where(request, where)
    prepare_root(url, world_size=WORLD, storage_options=so)
    b = B.resolve(url, storage_options=so)
    b.set("notes.txt", b"mine")
    root = b.get("zarr.json")
    with pytest.raises(acs.StoreExistsError, match=r"not the store's \('notes.txt'\)"):
        prepare_root(url, world_size=WORLD, overwrite=True, storage_options=so)
    assert b.get("notes.txt") == b"mine" and b.get("zarr.json") == root
    other = B.resolve(url.replace(".zarr", "-data"), storage_options=so)
    other.set("a.bin", b"x")
    with pytest.raises(acs.StoreExistsError, match="holds no Zarr store"):
        prepare_root(url.replace(".zarr", "-data"), world_size=WORLD, overwrite=True, storage_options=so)
    assert other.get("a.bin") == b"x" and other.get("zarr.json") is None


@pytest.mark.parametrize("kind", ["rank-task", "one-process"])
def test_the_warning_about_a_store_moved_aside_names_the_line_of_the_user_s_code(tmp_path, kind):
    """A store folder that an interrupted overwrite moved aside and never settled is warned
    about when the next overwrite opens the store; the warning named a line of
    activationscope/store/ranks.py (where the writer is made), never the user's own code. It
    now names the user's ``with scope.track(model)`` line, for a rank task and for one process."""
    import shutil
    import warnings

    url = tmp_path / "s.zarr"
    model = _model(0)
    if kind == "rank-task":
        opts = {**job.STORE_OPTIONS, "process_group": acs.RankStore(0, WORLD)}
        store, aside = url / "ranks" / "00000", url / "ranks" / ".00000.replaced-0000aaaa"
    else:
        opts = {"process_group": False}
        store, aside = url, tmp_path / ".s.zarr.replaced-0000aaaa"

    def capture(**more) -> int:
        scope = acs.ActivationScope(store=str(url), store_options={**opts, **more})
        line = sys._getframe().f_lineno + 1
        with scope.track(model), torch.no_grad():
            model(job.batch(0))
        return line

    capture()
    shutil.copytree(store, aside)  # (as an overwrite of it killed before it settled its old store)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = capture(overwrite=True)
    (w,) = [w for w in caught if "never settled" in str(w.message)]
    assert str(aside) in str(w.message)
    assert (w.filename, w.lineno) == (__file__, line), (w.filename, w.lineno)


def test_a_resume_names_the_old_store_a_killed_overwrite_left_aside(tmp_path):
    """A multi-rank overwrite killed before its ranks' commit leaves the old store in
    ``.<name>.replaced-<hex>`` (FORMAT.md section 7): a resume of the new run keeps that folder,
    as a one-process resume does, and names it in a warning instead of saying nothing."""
    url = str(tmp_path / "s.zarr")
    prepare_root(url, world_size=WORLD)
    old = tmp_path / "old.zarr"
    prepare_root(str(old), world_size=WORLD)
    aside = tmp_path / ".s.zarr.replaced-0123abcd"
    old.rename(aside)
    before = sorted(p.name for p in aside.iterdir())
    with pytest.warns(RuntimeWarning, match=r"\.s\.zarr\.replaced-0123abcd' holds a store that an earlier "
                      r"overwrite=True moved aside and never settled"):
        prepare_root(url, world_size=WORLD, resume=True)
    assert sorted(p.name for p in aside.iterdir()) == before


def _one_forward(url: Path, model: torch.nn.Module) -> None:
    """A one-process store of ``model``'s forward of the first batch at ``url``."""
    scope = acs.ActivationScope(store=str(url), store_options={"process_group": False})
    with scope.track(model), torch.no_grad():
        model(job.batch(0))


def _files(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path: bytes), but the writer lock (never moved aside)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != B.LOCK_KEY}


@pytest.mark.parametrize("case", ["commits", "fails", "two folders"])
def test_a_one_process_overwrite_settles_the_old_store_a_killed_multi_rank_overwrite_left_aside(tmp_path, case):
    """A multi-rank overwrite killed before its ranks' commit (rank 0 gone after it moved the old
    store aside and wrote the new run's root, its ranks' stores written) leaves the old store
    whole in ``.<name>.replaced-<hex>`` beside an uncommitted multi-rank root. A one-process
    ``overwrite=True`` settles that folder as a multi-rank overwrite does (FORMAT.md section 7):
    the uncommitted root and its rank stores go, and the folder is deleted once the new store
    commits, else the old store is put back whole. Two folders aside still cannot be told apart:
    named in a warning, kept. (Before, the one-process overwrite kept the folder and warned,
    and so did every later overwrite.)"""
    import warnings

    from activationscope.store.ranks import _prepare

    url = tmp_path / "s.zarr"
    model = _model(0)
    _one_forward(url, model)
    before = _files(url)
    aside: list[Path] = []
    _prepare(str(url), WORLD, True, False, None, aside)  # (rank 0's step; killed after it: nothing settles it)
    job.capture_rank_stores(str(url), ["mean"], WORLD, model=_model(1))
    (moved,) = aside
    assert _files(moved) == before and (url / "ranks").is_dir()
    assert acs.open_store(url).attrs["distributed"]["committed"] is False
    if case == "two folders":
        other = tmp_path / ".s.zarr.replaced-0000aaaa"
        shutil.copytree(moved, other)
        with pytest.warns(RuntimeWarning, match=r"never settled"):
            StoreWriter(str(url), overwrite=True).abort(RuntimeError("stop"))
        assert _files(moved) == before and _files(other) == before  # (kept, both)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (the folder is this overwrite's own: nothing to warn about)
        w = StoreWriter(str(url), overwrite=True)
        if case == "commits":
            w.open_array("new.output", (4,), torch.float32, "sample").append(torch.ones(8, 4))
            w.add_batch(8)
            w.close()
        else:
            w.abort(RuntimeError("stop"))
    assert [p.name for p in tmp_path.iterdir() if ".replaced-" in p.name] == []
    assert not (url / "ranks").exists()
    st = acs.open_store(url)
    assert st.verify() == [] and "distributed" not in st.attrs
    if case == "commits":
        assert st.hook_points == ["new.output"] and torch.equal(st["new.output"], torch.ones(8, 4))
    else:
        assert _files(url) == before  # (the old store back, byte for byte)


def test_the_old_store_rank_0_deletes_after_the_commit_is_not_said_to_be_left_by_a_killed_writer(tmp_path,
                                                                                                 monkeypatch):
    """Rank 0 deletes the old store a multi-rank overwrite moved aside once the ranks' commit is
    written; it now holds the store's writer lock meanwhile, as a one-process writer's close
    does, so ``Store.leftovers()`` says a running writer deletes the folder (before, it said its
    writer was killed and gave an rm -rf of it), and a resume waits rather than deleting it too."""
    import threading

    from activationscope.store._lock import writer_holding
    from activationscope.store.ranks import RankSession

    url = tmp_path / "s.zarr"
    model = _model(0)
    for at in (url, tmp_path / "old.zarr"):
        _one_forward(at, model)
    aside = tmp_path / ".s.zarr.replaced-0123abcd"  # (the old store, as rank 0 moved it aside)
    shutil.copytree(tmp_path / "old.zarr", aside, ignore=shutil.ignore_patterns(B.LOCK_KEY))
    go, started = hold_aside_delete(monkeypatch)
    session = RankSession(None, 0, WORLD, str(url))
    session._aside.append(aside)
    settling = threading.Thread(target=session._settle_aside, args=(True,))
    settling.start()
    try:
        assert started.wait(10)
        assert not (aside / "zarr.json").exists() and any(aside.iterdir())
        (line,) = acs.open_store(url).leftovers()
        assert f"a writer of this store is running (pid {os.getpid()} on host" in line and "killed" not in line, line
        with pytest.raises(acs.StoreLockedError):
            StoreWriter(str(url), resume=True)
    finally:
        go.set()
        settling.join(30)
    assert not settling.is_alive() and not aside.exists() and writer_holding(B.resolve(str(url))) is None
    assert acs.open_store(url).leftovers() == []


def test_rank_0_puts_the_old_store_back_under_the_lock_when_its_preparation_fails(tmp_path, monkeypatch):
    """Rank 0's preparation of a local multi-rank overwrite that fails once it moved the old
    store aside (the new run's root not written: a full disk) puts the old store back before it
    lets go of the store's writer lock, as a one-process writer does. Before, the lock went
    first: the old store stayed aside, with no lock held, until the ranks had met (up to
    rank_wait_s), and another overwrite started meanwhile took that folder for its own."""
    from activationscope.store import ranks
    from activationscope.store._lock import writer_holding
    from activationscope.store.ranks import _prepare

    url = tmp_path / "s.zarr"
    model = _model(0)
    _one_forward(url, model)
    before = _files(url)
    seen = []

    def full(b, attrs, replacing):
        seen.append(writer_holding(b))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ranks, "write_root_first", full)
    aside: list[Path] = []
    held: list = []
    with pytest.raises(OSError, match="No space left"):
        _prepare(str(url), WORLD, True, False, None, aside, held)
    assert seen and seen[0] is not None  # (it failed under the lock)
    assert aside == [] and held == [] and writer_holding(B.resolve(str(url))) is None
    assert _files(url) == before and [p.name for p in tmp_path.iterdir() if ".replaced-" in p.name] == []


def test_a_put_back_that_fails_partway_says_what_is_where_and_a_rerun_finishes_it(tmp_path, monkeypatch):
    """Rank 0 putting the old store back (nothing committed) fails after it moved some entries
    back: its message no longer says the old store is still whole in the folder aside (part of
    it is back at the path); it names the folder, says the rest is there with its root document
    and that a rerun with overwrite=True finishes the move, which it does."""
    from activationscope.store.ranks import RankSession, _prepare

    url = tmp_path / "s.zarr"
    model = _model(0)
    _one_forward(url, model)
    before = _files(url)
    session = RankSession(None, 0, WORLD, str(url))
    _prepare(str(url), WORLD, True, False, None, session._aside, session._held)
    (moved,) = session._aside
    rename, calls = os.rename, []

    def failing(src, dst, *args, **kwargs):
        if str(src).startswith(str(moved)):
            calls.append(src)
            if len(calls) == 2:  # (one entry moved back, then the disk fails)
                raise OSError(5, "Input/output error")
        return rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", failing)
    try:
        said = session._settle_aside(committed=False)
    finally:
        monkeypatch.setattr(os, "rename", rename)
        session._release_held()
    assert said is not None and repr(str(moved)) in said and "Input/output error" in said, said
    assert "still whole" not in said and "overwrite=True" in said, said
    assert moved.is_dir() and (moved / "zarr.json").exists() and any(p.name != B.LOCK_KEY for p in url.iterdir())
    StoreWriter(str(url), overwrite=True).abort(RuntimeError("stop"))  # (finishes the move, commits nothing)
    assert _files(url) == before and [p.name for p in tmp_path.iterdir() if ".replaced-" in p.name] == []
