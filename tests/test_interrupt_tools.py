"""Ctrl-C (``KeyboardInterrupt``) arriving in the store tools: ``copy_store`` (local and
memory://, with and without ``overwrite``), ``commit_ranks`` (``consolidate``), a resume and
the exports. After each interruption the source is unchanged, the target is absent, the old
one intact, or an incomplete store; no lock blocks the rerun, no temporary file is left beside
the target, and the rerun's result is byte-identical to an uninterrupted run's.

The interruption is raised at the first run of each distinct line of the library's code
(``InterruptAt``); with ``ACS_EVERY_LINE_SWEEPS=1`` the ``_every_line`` tests sweep every line event (minutes each)."""

from __future__ import annotations

import json
import os
import shutil

import fsspec
import pytest
import torch

import activationscope as acs
from activationscope.data.export import export_arrow, export_hf, export_parquet
from activationscope.store import copy_store
from activationscope.store.ranks import commit_ranks

from acs_testing import InterruptAt, store_three_batches, toy_mlp

# (a Ctrl-C raised in a weakref callback or a finalizer is printed and ignored by Python, as a
# signal delivered there is: the operation goes on, and pytest reports the print)
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


# Every line event instead of each line once: thousands of interrupted runs, each with its
# rerun (5 to 25 minutes a test), more than the suite's time allows: run on demand.
_EVERY_LINE = pytest.mark.skipif(
    os.environ.get("ACS_EVERY_LINE_SWEEPS") != "1",
    reason="every-line Ctrl-C sweep (5-25 min each): set ACS_EVERY_LINE_SWEEPS=1 to run it")


class _Lines(InterruptAt):
    """Counts the line events as InterruptAt(None), and notes the first event of each line."""

    def __init__(self) -> None:
        super().__init__(None)
        self.first: list[int] = []
        self._seen: set = set()

    def _line(self, frame, event, arg):
        n = self.n
        out = super()._line(frame, event, arg)
        key = (frame.f_code.co_filename, frame.f_lineno)
        if self.n != n and key not in self._seen:
            self._seen.add(key)
            self.first.append(self.n)
        return out


def _points(op, every: bool, most: int) -> list[int]:
    """The line events to interrupt ``op`` at: each (every), else the first of each line, or
    ``most`` of them evenly spread (op is run twice: the first run makes the lazy imports)."""
    op()
    with _Lines() as lines:
        op()
    assert lines.n > 100
    if every:
        return list(range(1, lines.n + 1))
    step = -(-len(lines.first) // most)
    return lines.first[::step]


def _tree(root) -> dict[str, bytes]:
    """Every file under a local folder: {relative path: bytes}."""
    root = str(root)
    out = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            out[os.path.relpath(path, root)] = open(path, "rb").read()
    return out


def _memory_tree(url: str) -> dict[str, bytes]:
    fs = fsspec.filesystem("memory")
    root = url.split("://", 1)[1].rstrip("/")
    return {p[len(root) + 2:] if p.startswith("/") else p[len(root) + 1:]: fs.cat_file(p)
            for p in fs.find(root)} if fs.exists(root) else {}


def _differing(got: dict, want: dict) -> list[str]:
    """The files of two trees that differ (or are in one only), with what differs in a root."""
    out = sorted(key for key in set(got) | set(want) if got.get(key) != want.get(key))
    if "zarr.json" in out and isinstance(got.get("zarr.json"), dict) and isinstance(want.get("zarr.json"), dict):
        a, b = (t["zarr.json"]["attributes"]["activationscope"] for t in (got, want))
        out += [f"{key}: {a.get(key)!r} != {b.get(key)!r}" for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)]
    return out


def _interrupted(op, k) -> str | None:
    """Run ``op`` interrupted at line event ``k``; where (None: it finished first)."""
    try:
        with InterruptAt(k) as where:
            op()
    except KeyboardInterrupt:
        return where.where
    return None


def _lock_free(target, at) -> None:
    from activationscope.store._backend import resolve
    from activationscope.store._lock import writer_holding

    assert writer_holding(resolve(target)) is None, at


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    src = tmp_path_factory.mktemp("src") / "src.zarr"
    store_three_batches(src, chunk_rows=4, shard_rows=16)
    return src


def _sweep_copy(tmp_path, source, where, overwrite, every):
    src_before = _tree(source)
    old = tmp_path / "old.zarr"
    store_three_batches(old, chunk_rows=8, shard_rows=8)  # another store, replaced by overwrite=True
    old_rows = acs.open_store(old)["0.output"].clone()
    if where == "local":
        reference = tmp_path / "reference.zarr"
        copy_store(source, reference)
        want = _tree(reference)

        def target(k):
            path = tmp_path / f"{k}.zarr"
            if overwrite:
                shutil.copytree(old, path)
            return path, _tree
    else:
        reference = f"memory://interrupt-tools-{overwrite}/reference.zarr"
        copy_store(source, reference)
        want = _memory_tree(reference)

        def target(k):
            url = f"memory://interrupt-tools-{overwrite}/{k}.zarr"
            if overwrite:
                copy_store(old, url)
            return url, _memory_tree

    counted = iter(range(2))
    points = _points(lambda: copy_store(source, target(f"count{next(counted)}")[0], overwrite=overwrite), every, 150)
    for k in points:
        dst, tree = target(k)
        at = _interrupted(lambda: copy_store(source, dst, overwrite=overwrite), k)
        assert _tree(source) == src_before, at
        _lock_free(dst, at)
        left = tree(dst)
        if "zarr.json" in left:
            st = acs.open_store(dst)
            if st.attrs["run_id"] != acs.open_store(source).attrs["run_id"]:
                if overwrite and st.n_samples:  # the old store, intact
                    assert torch.equal(st["0.output"], old_rows), at
                else:  # the copy's root first: incomplete, no row
                    assert st.status == "incomplete" and st.n_samples == 0, at
        elif where == "local":
            assert not overwrite or not dst.exists() or not any(dst.iterdir()), at
        copy_store(source, dst, overwrite=True)
        assert tree(dst) == want, at
    if where == "local":  # nothing beside the stores
        assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".zarr")) == [], points


@pytest.mark.parametrize("where", ["local", "memory"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
def test_ctrl_c_in_copy_store(tmp_path, source, where, overwrite):
    _sweep_copy(tmp_path, source, where, overwrite, every=False)


@_EVERY_LINE
@pytest.mark.slow
@pytest.mark.timeout(3600)  # (thousands of interrupted runs, each with its rerun)
@pytest.mark.parametrize("where", ["local", "memory"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
def test_ctrl_c_in_copy_store_every_line(tmp_path, source, where, overwrite):
    _sweep_copy(tmp_path, source, where, overwrite, every=True)


def _rank_stores(path) -> None:
    """Two RankStore tasks of a toy model into ``path`` (not committed)."""
    torch.manual_seed(0)
    model = toy_mlp(depth=1)
    for task in range(2):
        scope = acs.ActivationScope(store=path, reductions=["mean"],
                                    store_options={"shard_rows": 4, "process_group": acs.RankStore(task, 2)})
        with scope.track(model), torch.no_grad():
            for b in range(3):
                model(torch.randn(3, 16, generator=torch.Generator().manual_seed(10 * task + b)))


def _without_times(tree: dict[str, bytes]) -> dict:
    """A store's files, its root's attributes without the commit's time stamps."""
    tree = dict(tree)
    root = json.loads(tree.pop("zarr.json"))
    attrs = root["attributes"]["activationscope"]
    for key in ("committed", "closed", "updated", "commit_s"):
        attrs.pop(key, None)
    return {**tree, "zarr.json": root}


def _sweep_consolidate(tmp_path, every):
    template = tmp_path / "template.zarr"
    _rank_stores(template)
    shutil.copytree(template, tmp_path / "reference.zarr")
    commit_ranks(tmp_path / "reference.zarr")
    want = _tree(tmp_path / "reference.zarr")

    def fresh(k):
        path = tmp_path / f"{k}.zarr"
        shutil.copytree(template, path)
        return path

    counted = iter(range(2))
    points = _points(lambda: commit_ranks(fresh(f"count{next(counted)}")), every, 100)
    for k in points:
        path = fresh(k)
        at = _interrupted(lambda: commit_ranks(path), k)
        _lock_free(path, at)
        st = acs.open_store(path)
        assert st.status in ("incomplete", "complete"), at
        commit_ranks(path)
        assert _tree(path) == want or _without_times(_tree(path)) == _without_times(want), at


def test_ctrl_c_in_consolidate(tmp_path):
    _sweep_consolidate(tmp_path, every=False)


@_EVERY_LINE
@pytest.mark.slow
@pytest.mark.timeout(3600)  # (thousands of interrupted runs, each with its rerun)
def test_ctrl_c_in_consolidate_every_line(tmp_path):
    _sweep_consolidate(tmp_path, every=True)


_EXPORTS = {"arrow": export_arrow, "parquet": export_parquet, "hf": export_hf}


def _sweep_export(tmp_path, source, fmt, every):
    export = _EXPORTS[fmt]
    reference = export(source, tmp_path / f"reference.{fmt}")

    def read(path):  # (a datasets folder: without the fingerprint each save_to_disk draws)
        if not path.is_dir():
            return path.read_bytes()
        tree = _tree(path)
        state = json.loads(tree["state.json"])
        state.pop("_fingerprint")
        return {**tree, "state.json": state}

    old = tmp_path / f"old.{fmt}"
    export(source, old, batch_rows=5)  # an earlier export, replaced
    old_bytes, want = read(old), read(reference)
    points = _points(lambda: export(source, tmp_path / f"count.{fmt}"), every, 150)
    for k in points:
        path = tmp_path / f"{k}.{fmt}"
        (shutil.copytree if old.is_dir() else shutil.copyfile)(old, path)
        at = _interrupted(lambda: export(source, path), k)
        assert read(path) in (old_bytes, want), at
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(f"{k}.")) == [path.name], at
        export(source, path)
        assert read(path) == want, at


@pytest.mark.parametrize("fmt", sorted(_EXPORTS))
def test_ctrl_c_in_export(tmp_path, source, fmt):
    _sweep_export(tmp_path, source, fmt, every=False)


@_EVERY_LINE
@pytest.mark.slow
@pytest.mark.timeout(3600)  # (thousands of interrupted runs, each with its rerun)
@pytest.mark.parametrize("fmt", sorted(_EXPORTS))
def test_ctrl_c_in_export_every_line(tmp_path, source, fmt):
    _sweep_export(tmp_path, source, fmt, every=True)


def _sweep_resume(tmp_path, every):
    # a capture killed after one of three forwards, resumed; the resume interrupted, resumed again
    model = toy_mlp(depth=1)
    xs = torch.randn(3, 2, 16, generator=torch.Generator().manual_seed(0))

    def capture(path, n, **options):
        scope = acs.ActivationScope(store=path, store_options=dict(options, commit_interval=0))
        with torch.no_grad(), scope.track(model) as tracker:
            for x in xs[tracker.resume_from // 2:n]:
                model(x)

    template = tmp_path / "template.zarr"
    with pytest.raises(KeyboardInterrupt), torch.no_grad():
        with acs.ActivationScope(store=template, store_options={"commit_interval": 0}).track(model):
            model(xs[0])
            raise KeyboardInterrupt
    reference = tmp_path / "reference.zarr"
    shutil.copytree(template, reference)
    capture(reference, 3, resume=True)

    def result(path) -> dict:
        # each resume writes its rows' table as parts of its own (FORMAT.md): the parts of a resume
        # resumed again are others than an uninterrupted resume's, their rows the same
        tree = _without_times({key: data for key, data in _tree(path).items() if not key.startswith("rows/")})
        tree["zarr.json"]["attributes"]["activationscope"].pop("row_tables")
        st = acs.open_store(path)
        return {**tree, "rows": {kind: st.row_table(kind).to_pydict() for kind in ("sample", "token")}}

    want = result(reference)

    def fresh(k):
        path = tmp_path / f"{k}.zarr"
        shutil.copytree(template, path)
        return path

    counted = iter(range(2))
    points = _points(lambda: capture(fresh(f"count{next(counted)}"), 3, resume=True), every, 100)
    for k in points:
        path = fresh(k)
        at = _interrupted(lambda: capture(path, 3, resume=True), k)
        _lock_free(path, at)
        st = acs.open_store(path)
        assert st.n_samples in (2, 4, 6), at
        capture(path, 3, resume=True)
        differing = _differing(result(path), want)
        assert not differing, (at, differing)


def test_ctrl_c_in_a_resume(tmp_path):
    _sweep_resume(tmp_path, every=False)


@_EVERY_LINE
@pytest.mark.slow
@pytest.mark.timeout(3600)  # (thousands of interrupted runs, each with its rerun)
def test_ctrl_c_in_a_resume_every_line(tmp_path):
    _sweep_resume(tmp_path, every=True)
