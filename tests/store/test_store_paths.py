"""Store paths and options rejected before anything is written: a file where the store
should go, resume=True with nothing to resume, compression levels out of range."""

from __future__ import annotations

import json
import re

import pytest
import torch

import activationscope as acs
from activationscope.errors import StoreError
from activationscope.store import StoreWriter


@pytest.mark.parametrize("overwrite", [False, True])
def test_store_writer_on_a_regular_file(tmp_path, overwrite):
    f = tmp_path / "afile"
    f.write_bytes(b"not a store")
    with pytest.raises(StoreError, match="afile.*must be a directory.*choose a directory path") as e:
        StoreWriter(str(f), overwrite=overwrite)
    assert not isinstance(e.value, NotADirectoryError)
    assert f.read_bytes() == b"not a store"


def test_store_inside_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_bytes(b"x")
    with pytest.raises(StoreError, match="its folder .*afile.* is a file"):
        StoreWriter(str(f / "run.zarr"))


@pytest.mark.parametrize("overwrite", [False, True])
def test_scope_on_a_regular_file(tmp_path, overwrite):
    f = tmp_path / "afile"
    f.write_bytes(b"not a store")
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    scope = acs.ActivationScope(store=str(f), store_options={"overwrite": overwrite})
    with pytest.raises(StoreError, match="must be a directory") as e:
        with scope.track(model):
            model(torch.randn(1, 2))
    assert not isinstance(e.value, NotADirectoryError)
    assert f.read_bytes() == b"not a store"


def test_a_store_path_that_is_a_link_to_nothing_says_so(tmp_path):
    """A symbolic link to a folder that does not exist (yet) is named with its target, not
    refused as 'File exists'; once the folder is made, the store is written into it."""
    (tmp_path / "run.zarr").symlink_to(tmp_path / "disk" / "run")
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    x = torch.randn(3, 2)
    fix = f"its path is a symbolic link to {str(tmp_path / 'disk' / 'run')!r}, which does not exist; create that folder"
    with pytest.raises(StoreError, match=re.escape(fix)):
        StoreWriter(str(tmp_path / "run.zarr"))
    with pytest.raises(StoreError, match=re.escape(fix)):
        with acs.ActivationScope(store=str(tmp_path / "run.zarr")).track(model):
            model(x)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.zarr"]
    (tmp_path / "disk" / "run").mkdir(parents=True)
    with acs.ActivationScope(store=str(tmp_path / "run.zarr")).track(model), torch.no_grad():
        model(x)
    with torch.no_grad():
        torch.testing.assert_close(acs.open_store(str(tmp_path / "run.zarr"))["0.output"], model(x), rtol=0, atol=0)
    assert (tmp_path / "disk" / "run" / "zarr.json").is_file()


def test_resume_with_nothing_to_resume(tmp_path):
    path = tmp_path / "nope.zarr"
    with pytest.raises(StoreError, match=r"nothing to resume at .*nope\.zarr.*drop resume=True"):
        StoreWriter(str(path), resume=True)
    assert not path.exists()
    path.mkdir()  # an empty folder is nothing to resume either
    with pytest.raises(StoreError, match="nothing to resume"):
        StoreWriter(str(path), resume=True)


@pytest.mark.parametrize("compression, match", [
    ("zstd:99", r"zstd level must be an int in 1\.\.22, got '99'"),
    ("zstd:0", "zstd level must be an int in 1..22"),
    ("zstd:", "zstd level must be an int"),
    ("zstd:fast", "zstd level must be an int"),
    ("blosc-lz4:10", r"blosc-lz4 level must be an int in 0\.\.9, got '10'"),
    ("blosc-lz4:x", "blosc-lz4 level must be an int"),
])
def test_compression_levels_are_checked(tmp_path, compression, match):
    with pytest.raises(ValueError, match=match):
        StoreWriter(str(tmp_path / "s.zarr"), compression=compression)
    assert not (tmp_path / "s.zarr").exists()


def test_codec_object_levels_are_checked(tmp_path):
    numcodecs = pytest.importorskip("numcodecs")
    with pytest.raises(ValueError, match="blosc clevel must be in 0..9"):
        StoreWriter(str(tmp_path / "s.zarr"), compression=numcodecs.Blosc(clevel=12))
    with pytest.raises(ValueError, match="zstd level must be at most 22"):
        StoreWriter(str(tmp_path / "s.zarr"), compression=numcodecs.Zstd(level=40))


@pytest.mark.parametrize("compression, level", [("zstd:1", 1), ("zstd:22", 22), ("blosc-lz4:0", 0), ("blosc-lz4:9", 9)])
def test_valid_levels(compression, level):
    from activationscope.store import _format as F

    conf = F.parse_compression(compression)["configuration"]
    assert conf.get("level", conf.get("clevel")) == level


def test_describe_local_path_says_what_is_there(tmp_path):
    from activationscope.store._backend import describe_local_path

    assert describe_local_path(tmp_path / "nothing") is None
    (tmp_path / "f.txt").write_text("hello")
    assert describe_local_path(tmp_path / "f.txt") == ("file", "a file (5 bytes)")
    (tmp_path / "empty").mkdir()
    assert describe_local_path(tmp_path / "empty") == ("empty", "an empty folder")
    (tmp_path / "photos").mkdir()
    for name in ("a.jpg", "b.jpg", "c.jpg", "d.jpg"):
        (tmp_path / "photos" / name).write_bytes(b"x")
    kind, text = describe_local_path(tmp_path / "photos")
    assert kind == "folder" and text == "a folder that is not a store (4 entries: 'a.jpg', 'b.jpg', 'c.jpg', ...)"
    import zarr

    zarr.open_group(str(tmp_path / "plain.zarr"), mode="w")
    assert describe_local_path(tmp_path / "plain.zarr")[0] == "zarr"
    model = torch.nn.Linear(2, 2)
    with acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(model):
        model(torch.randn(3, 2))
    assert describe_local_path(tmp_path / "s.zarr") == (
        "store", "an activationscope store (status 'complete', 3 samples)")


def test_info_names_its_size_ratio_for_what_it_is(tmp_path):
    model = torch.nn.Linear(4, 4)
    with acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(model):
        model(torch.randn(8, 4))
    info = acs.open_store(str(tmp_path / "s.zarr")).info()
    assert "compression_ratio" not in info and "compression_ratio" not in info["arrays"]["output"]
    a = info["arrays"]["output"]
    assert a["bytes"] == 8 * 4 * 4
    assert a["data_to_disk_ratio"] == pytest.approx(a["bytes"] / a["bytes_on_disk"]) and a["data_to_disk_ratio"] < 0.5


def test_tilde_is_expanded_in_every_local_store_path(tmp_path, monkeypatch):
    """``~`` / ``~/...`` (str, Path, file:// URL) names the home folder, as in a shell: a
    capture, a writer, open_store, ActivationDataset, save and export under ~ land in $HOME,
    never in a folder named '~' under the working directory."""
    from pathlib import Path

    import numpy as np
    import pyarrow as pa

    from activationscope.data import ActivationDataset
    from activationscope.data.export import export_arrow

    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3)).eval()
    x = torch.randn(5, 4)
    scope = acs.ActivationScope(store="~/cap.zarr")
    with scope.track(model, include=["0"]) as tracker, torch.no_grad():
        tracker.set_batch()
        model(x)
    with torch.no_grad():
        ref = model(x)  # plain torch
    assert (home / "cap.zarr" / "zarr.json").is_file()
    for target in ("~/cap.zarr", Path("~/cap.zarr"), "file://~/cap.zarr"):
        torch.testing.assert_close(acs.open_store(target)["0.output"], ref)
    ds = ActivationDataset("~/cap.zarr")
    torch.testing.assert_close(ds[0:5]["0.output"], ref)
    acs.open_store("~/cap.zarr").save("~/copy.zarr")
    assert (home / "copy.zarr" / "zarr.json").is_file()
    export_arrow("~/cap.zarr", "~/out.arrow")
    table = pa.ipc.open_file(home / "out.arrow").read_all()
    assert table.num_rows == 5
    w = StoreWriter(Path("~/w.zarr"))
    a = w.open_array("x", (2,), torch.float32, "sample")
    a.append(torch.ones(3, 2))
    w.add_batch(3)
    w.close()
    assert np.array_equal(acs.open_store(str(home / "w.zarr"))["x"].numpy(), np.ones((3, 2), np.float32))
    assert not any(p.name == "~" for p in work.rglob("*")) and not (work / "~").exists()


@pytest.mark.parametrize("url, fix", [
    ("file:{path}", "give 'file://{path}' or the path '{path}'"),
    ("file://localhost{path}", "give 'file://{path}' or the path '{path}'"),
    ("file://{quoted}", "give the path itself, '{path}'"),
])
def test_a_file_url_read_other_than_the_standard_reads_it_is_refused(tmp_path, monkeypatch, capsys, url, fix):
    """``file:/p`` (one slash), ``file://localhost/p`` and the ``%20`` of ``Path.as_uri()``
    name ``/p`` and ``/my run.zarr`` by the URL standard, but would be read as a folder
    ``file:`` or ``localhost`` in the current folder, or a folder named with ``%20``: each is
    refused naming the path to give, for a capture, a writer, a reader, a dataset and the CLI,
    and nothing is made anywhere."""
    from pathlib import Path

    from activationscope import cli
    from activationscope.data import ActivationDataset

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    path = str(tmp_path / "my run.zarr")
    url = url.format(path=path, quoted=Path(path).as_uri()[len("file://"):])
    fix = fix.format(path=path)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(acs.ActivationScopeError, match=re.escape(fix)) as e:
        with acs.ActivationScope(store=url).track(model):
            model(torch.randn(1, 2))
    assert isinstance(e.value, ValueError)
    for call in (lambda: StoreWriter(url), lambda: acs.open_store(url), lambda: ActivationDataset(url)):
        with pytest.raises(ValueError, match=re.escape(fix)):
            call()
    for command in ("info", "verify"):
        capsys.readouterr()
        assert cli.main([command, url]) == 1
        assert fix in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"] and not any(work.iterdir())


def test_hook_points_with_names_longer_than_a_file_name_are_stored_and_read_back(tmp_path):
    """A module name of 300 characters made the capture fail with a raw OSError (File name too
    long) creating acts/<hook point>: a node name over 128 bytes is now its first 100 bytes,
    '~' and 16 hex digits of the name's sha256, so two long names that share those bytes get
    folders of their own, and every reader finds them through the metadata's path."""
    import hashlib

    import activationscope as acs
    from activationscope.store import _format as F

    class Long(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.add_module("y" * 300 + "1", torch.nn.Linear(3, 4))
            self.add_module("y" * 300 + "2", torch.nn.Linear(4, 2))
            self.add_module("é" * 70, torch.nn.Linear(2, 2))  # 140 bytes: cut between characters

        def forward(self, x):
            for m in self.children():
                x = m(x)
            return x

    model = Long().eval()
    path = tmp_path / "s.zarr"
    xs = [torch.randn(5, 3) for _ in range(2)]
    with torch.no_grad(), acs.ActivationScope(store=str(path), reductions=["mean"]).track(model):
        for x in xs:
            model(x)
    s = acs.open_store(path)
    names = ["y" * 300 + "1.output", "y" * 300 + "2.output", "é" * 70 + ".output"]
    assert sorted(s.hook_points) == sorted(names) and s.verify() == []
    with torch.no_grad():
        ref = []
        for x in xs:
            outs, h = [], x
            for m in model.children():
                h = m(h)
                outs.append(h)
            ref.append(outs)
    for k, hp in enumerate(names):
        node = F.node_name(hp)
        assert len(node.encode()) <= F.MAX_NODE_BYTES
        assert node.endswith("~" + hashlib.sha256(hp.encode()).hexdigest()[:16])
        assert s.attrs["arrays"][hp]["path"] == f"acts/{node}" and (path / "acts" / node).is_dir()
        want = torch.cat([r[k] for r in ref])
        torch.testing.assert_close(s[hp][:], want)
        torch.testing.assert_close(s.reductions[hp]["mean"], want.double().mean(0))
    assert F.node_name("é" * 70 + ".output").startswith("é" * 50 + "~")
    assert F.node_name("a" * 128) == "a" * 128  # up to 128 bytes: as it was


def _files(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("inner", ["acts/new.zarr", "sub", "sub/deeper/new.zarr", "acts/0.output/x.zarr", "acts",
                                   "rows/sample"])
@pytest.mark.parametrize("how", ["new", "overwrite", "resume", "scope", "copy", "rank"])
def test_a_store_inside_another_store_is_refused(tmp_path, inner, how):
    """A store written at a path inside another store would put its files among that store's
    (and overwrite=True would move that store's own folders aside): refused before anything
    is written, naming the outer store and a path outside it."""
    from acs_testing import store_three_batches

    from activationscope.store import copy_store

    outer = tmp_path / "a.zarr"
    data = store_three_batches(str(outer))
    before = _files(outer)
    target = outer / inner
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    # a rank store goes to <store>/ranks/<rank>: refused there when the store's folder exists
    shown = inner + ("(/ranks/00000)?" if how == "rank" else "")
    match = (rf"store path .*{inner}.* lies inside the store '{outer}' \(as '{shown}'\).*nothing was written"
             rf".*Choose a path outside '{outer}'")
    with pytest.raises(StoreError, match=match):
        if how in ("new", "overwrite", "resume"):
            StoreWriter(str(target), **({how: True} if how != "new" else {}))
        elif how == "copy":
            copy_store(str(outer), str(target))
        else:
            opts = {"process_group": acs.RankStore(0, 2)} if how == "rank" else {}
            with acs.ActivationScope(store=str(target), store_options=opts).track(model):
                model(torch.randn(1, 2))
    assert _files(outer) == before
    assert not (outer / "sub").exists() and not (outer / "acts" / "new.zarr").exists()
    store = acs.open_store(outer)
    assert store.verify() == [] and torch.equal(store["0.output"], data)


@pytest.mark.parametrize("how", ["new", "scope", "copy", "rank"])
def test_a_store_inside_another_store_on_an_fsspec_file_system_is_refused(how):
    """The same on ``memory://`` (an fsspec file system, as s3://): refused before anything is
    written; a store beside it, and rank stores in their own multi-rank store, are not."""
    import uuid

    import fsspec

    from activationscope.store import copy_store

    base = f"memory://inside-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with acs.ActivationScope(store=f"{base}/a.zarr").track(model), torch.no_grad():
        model(torch.randn(3, 2))
    before = {k: fs.cat_file(k) for k in fs.find(f"{base}/a.zarr")}
    target = f"{base}/a.zarr/acts/new.zarr"
    with pytest.raises(StoreError, match=r"lies inside the store 'memory://.*/a.zarr' \(as 'acts/new.zarr"
                                         r"(/ranks/00000)?'\).*nothing was written"):
        if how == "new":
            StoreWriter(target)
        elif how == "copy":
            copy_store(f"{base}/a.zarr", target)
        else:
            opts = {"process_group": acs.RankStore(0, 2)} if how == "rank" else {}
            with acs.ActivationScope(store=target, store_options=opts).track(model), torch.no_grad():
                model(torch.randn(1, 2))
    assert {k: fs.cat_file(k) for k in fs.find(f"{base}/a.zarr")} == before
    assert acs.open_store(f"{base}/a.zarr").verify() == []
    # beside it: a store like any other; rank stores in their multi-rank store: as before
    for task in range(2):
        opts = {"process_group": acs.RankStore(task, 2)}
        with acs.ActivationScope(store=f"{base}/m.zarr", store_options=opts).track(model), torch.no_grad():
            model(torch.randn(3, 2))
    assert acs.open_store(f"{base}/m.zarr").n_samples == 6


def test_a_link_into_a_store_is_refused_and_a_store_beside_one_is_not(tmp_path):
    from acs_testing import store_three_batches

    outer = tmp_path / "a.zarr"
    store_three_batches(str(outer))
    before = _files(outer)
    (tmp_path / "link").symlink_to(outer / "acts", target_is_directory=True)
    with pytest.raises(StoreError, match=f"lies inside the store '{outer}' \\(as 'acts/new.zarr'\\)"):
        StoreWriter(str(tmp_path / "link" / "new.zarr"))
    assert _files(outer) == before
    # beside it, and in a folder above it: stores as any other
    beside = store_three_batches(str(tmp_path / "b.zarr"))
    assert torch.equal(acs.open_store(tmp_path / "b.zarr")["0.output"], beside)
    assert _files(outer) == before


def test_rank_stores_still_go_in_their_multi_rank_store_but_not_in_another_store(tmp_path):
    """A rank store belongs in ``ranks/<rank>`` of its multi-rank store; that multi-rank store
    itself inside a one-process store is refused for every rank."""
    from activationscope.store.ranks import commit_ranks

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    xs = [torch.randn(3, 2) for _ in range(2)]
    store = tmp_path / "m.zarr"
    for task in range(2):
        opts = {"process_group": acs.RankStore(task, 2)}
        with acs.ActivationScope(store=str(store), store_options=opts).track(model), torch.no_grad():
            model(xs[task])
    commit_ranks(store)
    with torch.no_grad():
        assert torch.equal(acs.open_store(store)["0.output"], torch.cat([model(x) for x in xs]))
    # a one-process store holding a multi-rank store made before this was refused
    outer = tmp_path / "a.zarr"
    with StoreWriter(str(outer)) as w:
        w.open_array("0.output", (2,), torch.float32, "sample").append(torch.zeros(1, 2))
        w.add_batch(1)
    from activationscope.store.ranks import prepare_root

    (outer / "m.zarr").mkdir()
    (outer / "m.zarr" / "zarr.json").write_bytes((tmp_path / "m.zarr" / "zarr.json").read_bytes())
    root = json.loads((outer / "m.zarr" / "zarr.json").read_text())
    root["attributes"]["activationscope"]["distributed"]["committed"] = False
    (outer / "m.zarr" / "zarr.json").write_text(json.dumps(root))
    before = _files(outer)
    with pytest.raises(StoreError, match=f"lies inside the store '{outer}' \\(as 'm.zarr/ranks/00001'\\)"):
        StoreWriter(str(outer / "m.zarr" / "ranks" / "00001"))
    with pytest.raises(StoreError, match=f"lies inside the store '{outer}' \\(as 'm.zarr'\\)"):
        prepare_root(str(outer / "m.zarr"), world_size=2, resume=True)
    with pytest.raises(StoreError, match=f"lies inside the store '{outer}' \\(as 'm.zarr'\\)"):
        commit_ranks(str(outer / "m.zarr"))
    assert _files(outer) == before


@pytest.mark.parametrize("node", ["acts", "acts/0.output", "acts/0.output/c", "rows", "rows/sample", "reductions",
                                  "reductions/0.output", "reductions/0.output/mean", "reductions/0.output/mean.count"])
def test_opening_a_node_inside_a_store_names_the_store_to_open(tmp_path, node, capsys):
    """open_store / verify of a folder inside a store (an array's, a group's, the row tables')
    says which store to open instead, not "no store" or that the store is damaged."""
    from activationscope import cli

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    outer = tmp_path / "a.zarr"
    with acs.ActivationScope(store=str(outer), reductions=["mean"]).track(model), torch.no_grad():
        model(torch.randn(3, 2))
    before = _files(outer)
    hp = r" \(the array of hook point '0\.output'\)" if node == "acts/0.output" else ""
    match = (rf"'{outer}/{node}' is not a store: it is '{node}'{hp} inside the store '{outer}'\. "
             rf"Open that store instead \(open_store\('{outer}'\); `activationscope verify {outer}`\)")
    with pytest.raises(StoreError, match=match) as e:
        acs.open_store(outer / node)
    assert not isinstance(e.value, acs.StoreCorruptError)
    with pytest.raises(StoreError, match=match):
        acs.open_store(str(outer / node), verify=True).verify()
    assert cli.main(["verify", str(outer / node)]) != 0
    assert f"inside the store '{outer}'" in capsys.readouterr().err
    assert _files(outer) == before
    assert acs.open_store(outer).verify() == []


def test_a_path_that_is_not_there_or_not_in_a_store_says_so(tmp_path):
    from acs_testing import store_three_batches

    outer = tmp_path / "a.zarr"
    store_three_batches(str(outer))
    with pytest.raises(StoreError, match=r"no store at .*a\.zarr/missing': nothing is there"):
        acs.open_store(outer / "missing")
    (tmp_path / "plain").mkdir()
    with pytest.raises(StoreError, match=r"no store at .*plain' \(no zarr\.json\)"):
        acs.open_store(tmp_path / "plain")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(StoreError, match=r"no store at .*afile': it is a file, and a store is a folder"):
        acs.open_store(tmp_path / "afile")


@pytest.mark.parametrize("target", ["local", "memory://acs-storage-options"])
def test_storage_options_that_are_not_a_mapping_are_refused(tmp_path, target):
    """storage_options= of another type than a dict is ArgumentTypeError naming it, for a local
    path too (it was ignored there without a word, and an fsspec URL raised fsspec's error)."""
    from activationscope.errors import ArgumentTypeError

    path = str(tmp_path / "s.zarr") if target == "local" else target
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with torch.no_grad(), acs.ActivationScope(store=path).track(model):
        model(torch.randn(2, 4))
    with pytest.raises(ArgumentTypeError, match=r"storage_options must be a dict of fsspec options .*got int"):
        acs.open_store(path, storage_options=3)
    assert acs.open_store(path, storage_options={}).n_samples == 2
    if target != "local":
        import fsspec

        fsspec.filesystem("memory").rm("/acs-storage-options", recursive=True)


def test_a_misspelt_store_path_names_the_stores_beside_it(tmp_path):
    """A typo in a store's path (run.zar for run.zarr) names the store meant; a path whose
    folder is missing says so; nothing close, nothing added."""
    from acs_testing import store_three_batches

    store_three_batches(str(tmp_path / "run.zarr"))
    (tmp_path / "run.zarx").mkdir()  # (a folder that is no store is never suggested)
    with pytest.raises(StoreError, match=r"no store at .*run\.zar': nothing is there; did you mean '.*run\.zarr'\?$"):
        acs.open_store(tmp_path / "run.zar")
    with pytest.raises(StoreError, match=r"nothing is there; its folder '.*nodir' does not exist either$"):
        acs.open_store(tmp_path / "nodir" / "run.zarr")
    with pytest.raises(StoreError, match=r"nothing is there$"):
        acs.open_store(tmp_path / "other.zarr")


def test_the_misspelt_store_path_hint_names_only_stores_beside_the_path_and_never_raises(tmp_path, monkeypatch):
    """The hint of a path where nothing is suggests stores beside it only, spelt as the path
    was given: never a group or array inside a store (run.zarr/act named run.zarr/acts, a
    group, and run.zarr/acts/hx the array acts/h), never a path made of a URL (s3://b/run.zar
    named the folder 's3:/b'), a folder that is a file as a file (it said it does not exist),
    and a path it cannot look at (a name too long: the command line printed [Errno 36], a NUL
    byte, bytes) gets no hint, not an error."""
    from acs_testing import store_three_batches

    from activationscope.store.reader import missing_store_hint

    store_three_batches(str(tmp_path / "run.zarr"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    assert missing_store_hint("run.zar") == "; did you mean 'run.zarr'?"
    assert missing_store_hint("./run.zar/") == "; did you mean 'run.zarr'?"
    assert missing_store_hint(tmp_path / "run.zar") == f"; did you mean '{tmp_path / 'run.zarr'}'?"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert missing_store_hint("~/run.zar") == "; did you mean '~/run.zarr'?"
    assert missing_store_hint("nodir/run.zarr") == "; its folder 'nodir' does not exist either"
    assert missing_store_hint("afile/run.zarr") == "; 'afile' is a file, not a folder"
    for given in ["run.zarr/act", "run.zarr/acts/" + next(p.name for p in (tmp_path / "run.zarr" / "acts").iterdir() if p.is_dir()) + "x",
                  "s3://bucket/run.zar", "memory://run.zar", "file:run.zar", "x" * 300 + "/run.zar",
                  "run\x00.zar", b"run.zar", "", "/"]:
        assert missing_store_hint(given) == "", given
    with pytest.raises(StoreError, match=r"nothing is there; '.*afile' is a file, not a folder$"):
        acs.open_store("afile/run.zarr")
