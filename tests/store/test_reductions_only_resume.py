"""A capture into a store that keeps reductions only, killed (SIGKILL) at any point and resumed,
ends equal to an uninterrupted run: each commit stores the states of its committed forwards under
new files before the root lists them (FORMAT.md section 11)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import activationscope as acs
import reduced_child
from activationscope.errors import StoreError
from activationscope.reductions import EagerFallbackWarning
from activationscope.store import open_store

HERE = Path(__file__).parent
N_BATCHES = 10


def _child(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, str(HERE / "reduced_child.py"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _run_and_kill(path: Path, mode: str, at_line: str | None = None, delay: float = 0.0) -> None:
    proc = _child(str(path), mode, str(N_BATCHES), "0.02")
    try:
        for line in proc.stdout:
            if at_line is not None and line.startswith(at_line):
                time.sleep(delay)
                os.kill(proc.pid, signal.SIGKILL)
                break
    finally:
        proc.wait(timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("ref") / "ref.zarr"
    reduced_child.capture(str(path), N_BATCHES)
    return open_store(path)


def _commit_folders(path: Path) -> set[str]:
    """The names of the commit folders ``reductions/<node>/__c...`` that hold a file."""
    parts = [p.relative_to(path / "reductions").parts for p in (path / "reductions").rglob("*") if p.is_file()]
    return {x[1] for x in parts if len(x) > 2 and x[1].startswith("__c")}


def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
            and p.name != ".activationscope-writer.lock"}


def _root_but_updated(document: bytes) -> dict:
    root = json.loads(document)
    root["attributes"]["activationscope"].pop("updated")
    return root


def _assert_equal_stores(a, b):
    assert a.status == b.status == "complete" and a.n_samples == b.n_samples
    assert a.reduced == b.reduced and a.partial_reductions == {} and a.refused_reductions == {}
    assert sorted(a.reductions) == sorted(b.reductions)
    for hp in b.reductions:
        assert sorted(a.reductions[hp]) == sorted(b.reductions[hp])
        for name, value in b.reductions[hp].items():
            assert torch.equal(a.reductions[hp][name], value), (hp, name)  # bit for bit
    assert a.row_table("sample").to_pydict() == b.row_table("sample").to_pydict()
    assert a.verify() == []


def _assert_committed_prefix(path: Path) -> int:
    """The killed store: its reductions cover exactly its committed forwards."""
    store = open_store(path)
    assert store.status == "incomplete" and store.verify() == []
    s = store.n_samples
    assert s % reduced_child.BATCH == 0
    assert store.partial_reductions == {}
    if s:
        torch.manual_seed(0)
        model = reduced_child.MLP().eval()
        xs = reduced_child.batches_mlp(n_batches=N_BATCHES, batch=reduced_child.BATCH)
        with torch.no_grad():
            rows = torch.cat([model.fc1(x) for x in xs])[:s].double()
        assert store.reduced["fc1.output"]["n_rows"] == s
        assert torch.allclose(store.reductions["fc1.output"]["mean"], rows.mean(0))
        assert torch.allclose(store.reductions["fc1.output"]["ss"], rows.pow(2).sum(0))
    return s


@pytest.mark.parametrize("kill_after", [0, 4, 8])
def test_sigkill_then_resume_equals_uninterrupted(tmp_path, reference, kill_after):
    path = tmp_path / "r.zarr"
    _run_and_kill(path, "run", f"batch {kill_after}", random.Random(kill_after).uniform(0.0, 0.03))
    _assert_committed_prefix(path)
    reduced_child.capture(str(path), N_BATCHES)  # resume=True, in-process
    _assert_equal_stores(open_store(path), reference)


@pytest.mark.parametrize("mode, n_folders", [("killfiles3", 2), ("killroot3", 2), ("killroot1", 1)])
def test_killed_inside_a_commit_then_resumed(tmp_path, reference, mode, n_folders):
    """Killed after a commit wrote its reduction files but before its root (they are listed
    nowhere), or after its root but before the files of the commit before were removed: the
    store reads as one root lists it, and the resume removes the unlisted files."""
    path = tmp_path / "r.zarr"
    _run_and_kill(path, mode)
    s = _assert_committed_prefix(path)
    folders = _commit_folders(path)
    assert len(folders) == n_folders  # the listed commit's and the unlisted one (the first commit: none before)
    reduced_child.capture(str(path), N_BATCHES)
    resumed = open_store(path)
    _assert_equal_stores(resumed, reference)
    folders = _commit_folders(path)
    assert len(folders) == 1 and s < resumed.n_samples


def test_a_complete_store_resumed_with_more_forwards(tmp_path, reference):
    path = tmp_path / "r.zarr"
    reduced_child.capture(str(path), 4)
    assert open_store(path).status == "complete"
    reduced_child.capture(str(path), N_BATCHES)
    _assert_equal_stores(open_store(path), reference)


def _resume(path: Path, reductions) -> None:
    torch.manual_seed(0)
    model = reduced_child.MLP().eval()
    xs = reduced_child.batches_mlp(n_batches=N_BATCHES, batch=reduced_child.BATCH)
    scope = acs.ActivationScope(store=str(path), reduction_policy=acs.ReductionPolicy.STREAMING, reductions=reductions,
                                store_options={"resume": True})
    with scope.track(model) as tracker, torch.no_grad():
        start = tracker.resume_from // reduced_child.BATCH
        model(xs[start])


@pytest.mark.parametrize("reductions, said", [
    (["mean", "var"], r"its reductions \['max', 'min', 'ss', 'top'\] of hook point 'act.output' are not among"),
    (reduced_child.REDUCTIONS[:4] + [("top", "topk", {"k": 4}), reduced_child.REDUCTIONS[5]],
     r"its reduction 'top' of hook point 'fc1.output' has no state this capture's reduction can continue"),
])
def test_a_resume_that_cannot_continue_every_reduction_is_refused(tmp_path, reductions, said):
    path = tmp_path / "r.zarr"
    reduced_child.capture(str(path), 2)
    before = _files(path)
    with pytest.raises(StoreError, match=said + r".*holds no row to compute a reduction again from.*left as it was"):
        _resume(path, reductions)
    assert _files(path) == before


def test_a_resume_of_reductions_over_other_rows_than_the_store_counts_is_refused(tmp_path):
    # reductions over more rows than the store counts for their hook point (as a capture whose
    # last forward raised inside the block left them before such a forward was taken out of its
    # reductions; here the count is lowered by hand): read as partial, and a resume cannot
    # continue them
    path = tmp_path / "r.zarr"
    torch.manual_seed(0)
    model = reduced_child.MLP().eval()
    scope = acs.ActivationScope(store=str(path), reduction_policy=acs.ReductionPolicy.STREAMING, reductions=["mean"])
    with scope.track(model), torch.no_grad():
        model(torch.randn(5, 8))
    root = json.loads((path / "zarr.json").read_text())
    root["attributes"]["activationscope"]["reduced"]["fc1.output"]["n_rows"] = 3
    (path / "zarr.json").write_text(json.dumps(root))
    store = open_store(path)
    assert store.status == "complete" and store.n_samples == 5
    assert store.partial_reductions["fc1.output"]["mean"] == (5, 3)
    before = _files(path)
    scope = acs.ActivationScope(store=str(path), reduction_policy=acs.ReductionPolicy.STREAMING, reductions=["mean"],
                                store_options={"resume": True})
    with pytest.raises(StoreError, match=r"its reduction 'mean' of hook point 'fc1.output' covers 5 of the 3 rows "
                                         r"it reduced.*left as it was"):
        with scope.track(model), torch.no_grad():
            model(torch.randn(5, 8))
    assert _files(path) == before


def test_a_resume_that_captures_no_forward(tmp_path, reference):
    # nothing left to capture: the stored states are loaded and the store is closed as it was; a
    # reduction added then cannot be computed (no row) and is refused, the store left as it was
    path = tmp_path / "r.zarr"
    reduced_child.capture(str(path), N_BATCHES)
    first = before = _files(path)
    torch.manual_seed(0)
    model = reduced_child.MLP().eval()
    for extra, refused in (([], False), (["std"], True)):
        scope = acs.ActivationScope(store=str(path), reduction_policy=acs.ReductionPolicy.STREAMING,
                                    reductions=reduced_child.REDUCTIONS + extra, store_options={"resume": True})
        if refused:
            with pytest.raises(StoreError, match=r"its hook point '\w+.output' holds no reduction 'std' \(it holds "
                                                 r"\['max', 'mean', .*\]\), and a reduction cannot be added"):
                with scope.track(model):
                    pass
        else:
            with scope.track(model):
                pass
            # (its close writes the root again, the same but for the time it was `updated`)
            before = _files(path)
            assert _root_but_updated(before["zarr.json"]) == _root_but_updated(first["zarr.json"])
        assert _files(path) == before
    _assert_equal_stores(open_store(path), reference)
    reduced_child.capture(str(path), N_BATCHES)  # the lock was let go: a resume opens it


def test_a_resume_that_captures_no_forward_and_leaves_a_reduction_out_is_refused(tmp_path):
    # as a resume with forwards is: the store would list reductions the capture never continued
    path = tmp_path / "r.zarr"
    reduced_child.capture(str(path), 2)
    before = _files(path)
    torch.manual_seed(0)
    model = reduced_child.MLP().eval()
    scope = acs.ActivationScope(store=str(path), reduction_policy=acs.ReductionPolicy.STREAMING,
                                reductions=["mean"], store_options={"resume": True})
    with pytest.raises(StoreError, match=r"its reductions \['max', 'min', 'ss', 'top', 'var'\] of hook point "
                                         r"'\w+.output' are not among this capture's reductions \(\['mean'\]\)"):
        with scope.track(model):
            pass
    assert _files(path) == before


_SCALE = 0.5  # a global float: TorchScript cannot compile a function reading it


def _scaled_sum(acc, x):
    s = x.double().sum(0) * _SCALE
    return s if acc is None else acc + s


def test_a_resume_of_an_eager_reduction_says_why_it_cannot_continue(tmp_path):
    path = tmp_path / "r.zarr"
    torch.manual_seed(0)
    model = reduced_child.MLP().eval()
    xs = reduced_child.batches_mlp(n_batches=2, batch=reduced_child.BATCH)

    def capture(resume):
        scope = acs.ActivationScope(store=str(path), reduction_policy=acs.ReductionPolicy.STREAMING,
                                    reductions={"fc1.output": ["mean", _scaled_sum]}, store_options={"resume": resume})
        with scope.track(model), torch.no_grad():
            model(xs[int(resume)])

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        capture(False)
    said = [str(w.message) for w in caught if w.category is acs.CaptureWarning]
    assert EagerFallbackWarning in [w.category for w in caught]
    assert len(said) == 1 and said[0].startswith("custom reduction(s) ['_scaled_sum'] run as eager Python") \
        and "a resume of this store after a kill or an error is refused" in said[0], said
    before = _files(path)
    with pytest.warns(acs.CaptureWarning, match="run as eager Python"), pytest.raises(
            StoreError, match=r"its reduction '_scaled_sum' of hook point 'fc1.output' runs as eager Python .*"
                              r"never continued.*Make the function TorchScript-compatible"):
        capture(True)
    assert _files(path) == before


def test_a_resume_where_reductions_apply_to_some_hook_points(tmp_path):
    # only the reduced hook points are stored (listed in `reduced`); the others of the resumed
    # capture are no new hook points of the store
    torch.manual_seed(0)
    model = reduced_child.MLP().eval()
    xs = reduced_child.batches_mlp(n_batches=4, batch=reduced_child.BATCH)

    def capture(path, first, last, resume):
        scope = acs.ActivationScope(store=str(path), reduction_policy=acs.ReductionPolicy.STREAMING,
                                    reductions={"fc1.output": ["mean", "var"]}, store_options={"resume": resume})
        with scope.track(model), torch.no_grad():
            for x in xs[first:last]:
                model(x)

    capture(tmp_path / "ref.zarr", 0, 4, False)
    capture(tmp_path / "r.zarr", 0, 2, False)
    capture(tmp_path / "r.zarr", 2, 4, True)
    a, b = open_store(tmp_path / "r.zarr"), open_store(tmp_path / "ref.zarr")
    assert a.hook_points == ["fc1.output"]
    _assert_equal_stores(a, b)


@pytest.mark.parametrize("where", ["memory", "s3"])
def test_resume_on_object_storage(request, tmp_path, where):
    # no kept copy there: each commit's files are new ones, and the ones before go after its root
    options = request.getfixturevalue("s3") if where == "s3" else None
    url = (f"memory://reduced-{tmp_path.name}" if where == "memory"
           else f"s3://acs-bucket/reduced-{tmp_path.name}.zarr")
    torch.manual_seed(0)
    model = reduced_child.MLP().eval()
    xs = reduced_child.batches_mlp(n_batches=4, batch=reduced_child.BATCH)

    def capture(target, first, last, resume, storage_options=None):
        opts = {"resume": resume, "commit_interval": 0,
                **({"storage_options": storage_options} if storage_options else {})}
        scope = acs.ActivationScope(store=target, reduction_policy=acs.ReductionPolicy.STREAMING,
                                    reductions=reduced_child.REDUCTIONS, store_options=opts)
        with scope.track(model), torch.no_grad():
            for x in xs[first:last]:
                model(x)

    capture(str(tmp_path / "ref.zarr"), 0, 4, False)
    capture(url, 0, 2, False, options)
    capture(url, 2, 4, True, options)
    store = open_store(url, storage_options=options)
    _assert_equal_stores(store, open_store(tmp_path / "ref.zarr"))
    listed = {e["path"].split("/")[2] for entries in store.attrs["reductions"].values() for e in entries.values()}
    assert len(listed) == 1  # one commit's folder listed, and the files of the commits before are gone
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **(options or {}))
    found = {p.split("/reductions/")[1].split("/")[1] for p in fs.find(root) if "/reductions/" in p
             and p.split("/reductions/")[1].count("/") >= 2}
    assert found == listed


def test_a_resume_removes_unlisted_commit_folders_only_inside_the_store(tmp_path, reference):
    path = tmp_path / "r.zarr"
    reduced_child.capture(str(path), 2)
    node = path / "reductions" / "fc1.output"
    stray = node / "__c7-0000abcd" / "mean" / "c"
    stray.mkdir(parents=True)
    (stray / "0").write_bytes(b"left by a killed commit")
    victim = tmp_path / "victim"
    (victim / "mean").mkdir(parents=True)
    (victim / "mean" / "keep").write_bytes(b"keep me")
    (node / "__c8-0000abcd").symlink_to(victim, target_is_directory=True)
    named_alike = node / "__c9-notacommit"  # (not a commit folder's name: left alone)
    named_alike.mkdir()
    (named_alike / "x").write_bytes(b"x")
    reduced_child.capture(str(path), N_BATCHES)
    assert not (node / "__c7-0000abcd").exists()
    assert (victim / "mean" / "keep").read_bytes() == b"keep me"  # a link is never followed
    assert (named_alike / "x").exists()
    (node / "__c8-0000abcd").unlink()
    shutil.rmtree(named_alike)
    _assert_equal_stores(open_store(path), reference)
