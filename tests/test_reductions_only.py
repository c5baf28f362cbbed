"""Stores that keep reductions only: ``ActivationScope(store=..., reduction_policy=STREAMING)``
(store/FORMAT.md section 11, format version 3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import activationscope as acs
from activationscope.errors import ArgumentValueError, CaptureError, StoreCorruptError, StoreError
from activationscope.store import _format as F
from activationscope.store import open_store

STREAMING = acs.ReductionPolicy.STREAMING


def _sum_of_squares(acc: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    s = x.double().pow(2).sum(0)
    return s if acc is None else acc + s


REDUCTIONS = ["mean", "var", "min", "max", ("ss", _sum_of_squares)]


class _Tokens(torch.nn.Module):
    """``pool.output`` one row per sample, ``proj.output`` one row per real token."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(3, 4)
        self.pool = torch.nn.Identity()

    def forward(self, x):
        h = self.proj(x)
        return self.pool(h.mean(1))


def _batches(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for b in range(n):
        mask = torch.ones(3, 5, dtype=torch.bool)
        mask[b % 3, 3:] = False  # padding, left out of the token rows
        out.append((torch.randn(3, 5, 3, generator=g), mask))
    return out


def _files(path: Path) -> dict:
    """Every file of the store at ``path`` and its bytes."""
    return {p: p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _two_layers_reduced(path: Path) -> torch.nn.Module:
    """A two-layer model whose means went into a reductions-only store at ``path``, one forward."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).eval()
    with acs.ActivationScope(store=str(path), reduction_policy=STREAMING, reductions=["mean"]).track(model), \
            torch.no_grad():
        model(torch.randn(3, 4))
    return model


def _capture(model, target, batches, **kw):
    with kw.pop("scope", None) or acs.ActivationScope(store=target, **kw).track(model) as tracker, torch.no_grad():
        for x, mask in batches:
            tracker.set_batch(attention_mask=mask)
            model(x)
    return tracker


@pytest.mark.parametrize("where", ["local", "memory", "s3"])
def test_values_equal_in_memory_streaming_and_a_float64_reference(request, tmp_path, where):
    torch.manual_seed(0)
    model = _Tokens().eval()
    batches = _batches()
    target = {"local": str(tmp_path / "r.zarr"), "memory": f"memory://redonly-{tmp_path.name}",
              "s3": f"s3://acs-bucket/redonly-{tmp_path.name}.zarr"}[where]
    options = request.getfixturevalue("s3") if where == "s3" else None
    _capture(model, target, batches, reduction_policy=STREAMING, reductions=REDUCTIONS,
             store_options={"storage_options": options} if options else None)
    memory = _capture(model, None, batches, reduction_policy=STREAMING, reductions=REDUCTIONS)
    store = open_store(target, storage_options=options)
    assert store.status == "complete" and not store.rows_stored
    assert store.attrs["format"]["version"] == 3 and "arrays" not in store.attrs
    with torch.no_grad():
        h = [model.proj(x) for x, _ in batches]
    reference = {"proj.output": torch.cat([x[m] for x, (_, m) in zip(h, batches)]).double(),
                 "pool.output": torch.cat([x.mean(1) for x in h]).double()}
    assert store.hook_points == ["proj.output", "pool.output"]
    assert store.reduced == {
        "proj.output": {"row_kind": "token", "feature_shape": [4], "dtype": "float32", "n_rows": 52},
        "pool.output": {"row_kind": "sample", "feature_shape": [4], "dtype": "float32", "n_rows": 12}}
    for hp, rows in reference.items():
        got, mem = store.reductions[hp], memory.reductions[hp]
        assert sorted(got) == sorted(mem)
        for name in got:
            assert torch.equal(got[name], mem[name]), (hp, name)
        assert torch.allclose(got["mean"], rows.mean(0))
        assert torch.allclose(got["var"], rows.var(0, unbiased=False))
        assert torch.equal(got["min"], rows.min(0).values) and torch.equal(got["max"], rows.max(0).values)
        assert torch.allclose(got["ss"], rows.pow(2).sum(0))
        assert int(got["mean.count"]) == len(rows)
    assert store.reduction_script("proj.output", "ss") is not None  # kept as a STORE_ALL store keeps it
    assert store.partial_reductions == {} and store.verify() == []
    assert store.row_table("sample").column("sample_id").to_pylist() == list(range(12))
    assert set(store.attrs["row_tables"]) == {"sample"}  # no token table
    if where == "local":
        assert not (tmp_path / "r.zarr" / "acts").exists()
        copy = store.save(tmp_path / "copy.zarr")  # a copy holds every file it reads
        assert not copy.rows_stored and copy.reduced == store.reduced and copy.verify() == []
        assert torch.equal(copy.reductions["pool.output"]["ss"], store.reductions["pool.output"]["ss"])


def test_a_store_of_rows_keeps_writing_version_1(tmp_path):
    model = _Tokens().eval()
    _capture(model, str(tmp_path / "s.zarr"), _batches(2), reductions=["mean"])
    attrs = open_store(tmp_path / "s.zarr").attrs
    assert attrs["format"]["version"] == 1
    assert "rows_stored" not in attrs and "reduced" not in attrs and "arrays" in attrs and "aliases" in attrs


def test_reductions_are_required():
    with pytest.raises(ArgumentValueError, match=r"STREAMING keeps only reductions, and none were given.*keeps "
                                                 r"reductions only would hold no value.*leave reduction_policy out"):
        acs.ActivationScope(store="memory://x", reduction_policy=STREAMING)


def test_every_reader_of_rows_raises(tmp_path):
    from activationscope.analysis.dask import to_dask
    from activationscope.analysis.probes import probe_store
    from activationscope.analysis.report import write_report
    from activationscope.data import ActivationDataset, export_arrow, export_parquet

    path = tmp_path / "r.zarr"
    model = _Tokens().eval()
    scope = acs.ActivationScope(store=str(path), reduction_policy=STREAMING, reductions=["mean"])
    with scope.track(model) as tracker, torch.no_grad():
        for b, (x, mask) in enumerate(_batches(2)):
            tracker.set_batch(attention_mask=mask, label=torch.tensor([0, 1, b]))
            model(x)
    store = open_store(path)
    said = r"keeps reductions only.*no activation row of hook point 'pool.output'.*capture again without reduction_policy"
    reads = {
        "getitem": lambda: store["pool.output"],
        "slice": lambda: store["pool.output", 0:2],
        "rows": lambda: store.rows("pool.output", 0, 1),
        "n_rows": lambda: store.n_rows("pool.output"),
        "feature_shape": lambda: store.feature_shape("pool.output"),
        "dtype": lambda: store.dtype("pool.output"),
        "follows_row_table": lambda: store.follows_row_table("pool.output"),
        "dataset": lambda: ActivationDataset(str(path), hook_points=["pool.output"]),
        "dataset of every hook point": lambda: ActivationDataset(str(path)),
        "to_dask": lambda: to_dask(str(path), "pool.output"),
        "parquet": lambda: export_parquet(store, tmp_path / "x.parquet", hook_points=["pool.output"]),
        "arrow": lambda: export_arrow(store, tmp_path / "x.arrow", hook_points="pool.output"),
        "probe": lambda: probe_store(store, ["pool.output"]),
        "report": lambda: write_report(store, tmp_path / "report", hook_points=["pool.output"]),
    }
    for what, read in reads.items():
        with pytest.raises(StoreError, match=said if what != "dataset of every hook point" else
                           said.replace("'pool.output'", "'.*'")) as e:
            read()
        assert not isinstance(e.value, StoreCorruptError), what
    assert not (tmp_path / "x.parquet").exists() and not (tmp_path / "x.arrow").exists()
    # what it holds reads as in any store
    assert store.row_table("sample").column("label").to_pylist() == [0, 1, 0, 0, 1, 1]
    assert "pool.output" in store and "nope" not in store and len(store) == 2
    info = store.info()
    assert info["rows_stored"] is False and info["arrays"] == {} and info["reduced"] == store.reduced
    assert info["reductions"] == {"proj.output": ["mean", "mean.count"], "pool.output": ["mean", "mean.count"]}


def test_a_raised_forward_leaves_its_rows_out_of_the_committed_count(tmp_path):
    # a forward that raised at the end of the block: its rows were reduced (as in memory), the
    # store counts the recorded forwards only, so the reduction shows as partial, never complete
    path = tmp_path / "r.zarr"
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)).eval()
    scope = acs.ActivationScope(store=str(path), reduction_policy=STREAMING, reductions=["mean"])
    with pytest.warns(acs.CaptureWarning, match="raised"), scope.track(model), torch.no_grad():
        model(torch.randn(4, 3))
        try:
            model(torch.randn(4, 2))  # the first Linear refuses it
        except RuntimeError:
            pass
        model(torch.randn(3, 3))
    store = open_store(path)
    assert store.reduced["0.output"]["n_rows"] == 7 and store.n_samples == 7
    assert store.partial_reductions == {} and int(store.reductions["1.output"]["mean.count"]) == 7


def test_a_store_of_rows_and_one_of_reductions_only_never_resume_each_other(tmp_path):
    path = tmp_path / "r.zarr"
    model = _Tokens().eval()
    _capture(model, str(path), _batches(2), reduction_policy=STREAMING, reductions=["mean"])
    before = _files(path)
    scope = acs.ActivationScope(store=str(path), store_options={"resume": True}, reductions=["mean"])
    with pytest.raises(StoreError, match=r"cannot resume .*it keeps reductions only.*this capture stores activation "
                                         r"rows.*nothing was changed.*'overwrite': True"):
        scope.track(model).attach()
    assert _files(path) == before
    # a capture that keeps reductions only never continues a store of rows
    rows = tmp_path / "rows.zarr"
    _capture(model, str(rows), _batches(1), reductions=["mean"])
    before = _files(rows)
    scope = acs.ActivationScope(store=str(rows), store_options={"resume": True}, reduction_policy=STREAMING,
                                reductions=["mean"])
    with pytest.raises(StoreError, match=r"it stores activation rows, and this capture keeps reductions only"):
        scope.track(model).attach()
    assert _files(rows) == before
    # overwrite replaces it, either way
    _capture(model, str(path), _batches(1), reductions=["mean"], store_options={"overwrite": True})
    assert open_store(path).rows_stored and open_store(path).n_rows("pool.output") == 3


def test_each_commit_stores_the_reductions_of_its_forwards(tmp_path):
    # a reader sees the reductions of the forwards committed so far; one opened before a later
    # commit (whose files are new ones) is told to refresh, never shown damage
    path = tmp_path / "r.zarr"
    model = _Tokens().eval()
    scope = acs.ActivationScope(store=str(path), reduction_policy=STREAMING, reductions=["mean"],
                                store_options={"commit_interval": 0})
    batches = _batches(3)
    with torch.no_grad():
        want = model.proj(batches[0][0]).mean(1).double().mean(0)
    with scope.track(model) as tracker, torch.no_grad():
        for i, (x, mask) in enumerate(batches):
            tracker.set_batch(attention_mask=mask)
            model(x)
            if i == 0:
                early = open_store(path)
                assert early.status == "incomplete" and early.reduced["pool.output"]["n_rows"] == 3
                assert torch.allclose(early.reductions["pool.output"]["mean"], want)
    with pytest.raises(StoreError, match=r"committed again since it was opened.*each commit of a store that keeps "
                                         r"reductions only writes them anew.*refresh\(\)") as e:
        early.reductions["pool.output"]
    assert not isinstance(e.value, StoreCorruptError)
    early.refresh()
    assert early.reduced["pool.output"]["n_rows"] == 9 and early.verify() == []


def test_multi_rank_capture_is_refused_at_attach(tmp_path):
    model = _Tokens().eval()
    scope = acs.ActivationScope(store=str(tmp_path / "r.zarr"), reduction_policy=STREAMING, reductions=["mean"],
                                store_options={"process_group": acs.RankStore(0, 2)})
    with pytest.raises(CaptureError, match=r"multi-rank capture .* cannot keep reductions only.*process_group': "
                                           r"False.*nothing was written"):
        scope.track(model).attach()
    assert not (tmp_path / "r.zarr").exists()


def test_a_reader_of_version_2_refuses_it(tmp_path, monkeypatch):
    path = tmp_path / "r.zarr"
    _capture(_Tokens().eval(), str(path), _batches(1), reduction_policy=STREAMING, reductions=["mean"])
    monkeypatch.setattr(F, "MAX_READ_VERSION", 2)
    with pytest.raises(StoreError, match=r"format version 3; this activationscope reads versions up to 2: upgrade") \
            as e:
        open_store(path)
    assert not isinstance(e.value, StoreCorruptError)


def _edit(path: Path, fn) -> None:
    doc = json.loads((path / "zarr.json").read_text())
    fn(doc["attributes"]["activationscope"])
    (path / "zarr.json").write_text(json.dumps(doc))


@pytest.mark.parametrize("edit, said", [
    (lambda a: a.pop("rows_stored"), r"rows_stored must be false in a root of format version 3"),
    (lambda a: a.update(rows_stored=0), r"rows_stored must be false"),
    (lambda a: a.pop("reduced"), r"reduced must be a JSON object"),
    (lambda a: a.update(reduced=None), r"reduced must be a JSON object"),
    (lambda a: a.update(arrays={}), r"arrays must be absent in a store that keeps reductions only"),
    (lambda a: a.update(aliases={}), r"aliases must be absent"),
    (lambda a: a.update(distributed={"world_size": 2, "committed": True}), r"distributed must be absent"),
    (lambda a: a["row_tables"].update(token={"parts": [], "n_rows": 0}), r"row_tables key must be 'sample' only"),
    (lambda a: a["reduced"]["pool.output"].update(n_rows=-1), r"reduced\['pool.output'\].n_rows must be an int"),
    (lambda a: a["reduced"]["pool.output"].update(n_rows=True), r"reduced\['pool.output'\].n_rows must be an int"),
    (lambda a: a["reduced"]["pool.output"].update(n_rows=1 << 60), r"n_rows must be an int in 0\.\."),
    (lambda a: a["reduced"]["pool.output"].update(row_kind="pixel"), r"row_kind must be one of"),
    (lambda a: a["reduced"]["pool.output"].update(dtype="float128"), r"dtype must be one of"),
    (lambda a: a["reduced"]["pool.output"].update(feature_shape=[-1]), r"feature_shape must be a list"),
    (lambda a: a["reduced"]["pool.output"].update(feature_shape=[1 << 20, 1 << 20]), r"rows of at most"),
    (lambda a: a["reduced"].update({"x": "y"}), r"reduced\['x'\] must be a JSON object"),
    (lambda a: a["reduced"].pop("pool.output"), r"reductions\['pool.output'\] must be the reductions of a hook "
                                                r"point of 'reduced'"),
    # a version 1 root that says it keeps no rows: a version 1 reader would read it as a store of none
    (lambda a: a["format"].update(version=1), r"format.version must be 3 in a root whose rows_stored is False"),
    (lambda a: (a["format"].update(version=2), a.pop("rows_stored")), r"format.version must be 3 in a root with "
                                                                      r"'reduced'"),
])
def test_hostile_root_fields_are_refused(tmp_path, edit, said):
    path = tmp_path / "r.zarr"
    _capture(_Tokens().eval(), str(path), _batches(1), reduction_policy=STREAMING, reductions=["mean"])
    _edit(path, edit)
    with pytest.raises(StoreCorruptError, match=said):
        open_store(path)


def test_a_reduction_whose_shape_is_not_its_reduced_rows_is_refused(tmp_path):
    # FORMAT.md section 9 rule 10: a built-in's output shape is checked against the reduced feature shape
    path = tmp_path / "r.zarr"
    _capture(_Tokens().eval(), str(path), _batches(1), reduction_policy=STREAMING, reductions=["mean"])
    _edit(path, lambda a: a["reduced"]["pool.output"].update(feature_shape=[5]))
    store = open_store(path)
    assert "mean" in store.refused_reductions["pool.output"]
    with pytest.warns(UserWarning, match="mean"):
        store.reductions["pool.output"]


def test_cli_capture_info_and_verify(tmp_path, capsys):
    from activationscope.cli import main

    out = tmp_path / "r.zarr"
    assert main(["capture", "--model", "demo", "--data", "demo", "--out", str(out), "--reduce", "mean,var",
                 "--reductions-only", "--max-samples", "8", "--no-progress"]) == 0
    assert "(reductions only: ['mean', 'var'])" in capsys.readouterr().out
    store = open_store(out)
    assert not store.rows_stored and store.n_samples == 8 and store.hook_points
    assert all(sorted(store.reductions[hp]) == ["mean", "mean.count", "var", "var.count", "var.mean"]
               for hp in store.hook_points)
    assert main(["info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "stores:   reductions only" in text and "reduced, reductions only (no activation row)" in text
    assert main(["verify", str(out)]) == 0
    assert "ok (reductions only:" in capsys.readouterr().out
    # --reductions-only needs --reduce; nothing is written
    assert main(["capture", "--model", "demo", "--data", "demo", "--out", str(tmp_path / "n.zarr"),
                 "--reductions-only", "--no-progress"]) != 0
    assert "--reductions-only keeps the reductions only, and no --reduce was given" in capsys.readouterr().err
    assert not (tmp_path / "n.zarr").exists()
    # its resume needs --reductions-only; the store is left as it was
    before = _files(out)
    assert main(["capture", "--model", "demo", "--data", "demo", "--out", str(out), "--reduce", "mean,var",
                 "--resume", "--max-samples", "16", "--no-progress"]) != 0
    assert "keeps reductions only (captured with --reductions-only): pass --reductions-only" in capsys.readouterr().err
    assert _files(out) == before


def test_cli_resume_equals_an_uninterrupted_capture(tmp_path, capsys):
    from activationscope.cli import main

    args = ["--model", "demo", "--data", "demo", "--reduce", "mean,var,topk[k=3]", "--reductions-only",
            "--batch-size", "4", "--no-progress"]
    assert main(["capture", *args, "--out", str(tmp_path / "ref.zarr"), "--max-samples", "16"]) == 0
    assert main(["capture", *args, "--out", str(tmp_path / "r.zarr"), "--max-samples", "8"]) == 0
    assert main(["capture", *args, "--out", str(tmp_path / "r.zarr"), "--max-samples", "16", "--resume"]) == 0
    a, b = open_store(tmp_path / "r.zarr"), open_store(tmp_path / "ref.zarr")
    assert a.n_samples == 16 and a.reduced == b.reduced and a.partial_reductions == {}
    for hp in b.hook_points:
        for name, value in b.reductions[hp].items():
            assert torch.equal(a.reductions[hp][name], value), (hp, name)
    # a store of rows is never continued with --reductions-only
    assert main(["capture", "--model", "demo", "--data", "demo", "--out", str(tmp_path / "rows.zarr"),
                 "--max-samples", "4", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["capture", *args, "--out", str(tmp_path / "rows.zarr"), "--max-samples", "8", "--resume"]) != 0
    assert "stores activation rows, and one store cannot hold both" in capsys.readouterr().err


def test_cli_messages_name_the_command_flags(tmp_path, capsys):
    from activationscope.cli import main

    out = tmp_path / "r.zarr"
    args = ["capture", "--model", "demo", "--data", "demo", "--out", str(out), "--reductions-only",
            "--max-samples", "4", "--no-progress"]
    assert main([*args, "--reduce", "mean,var"]) == 0
    capsys.readouterr()
    # nothing left to capture: the stored reductions are kept, not computed over rows it has not
    assert main([*args, "--reduce", "mean,var", "--resume"]) == 0
    said = capsys.readouterr().out
    assert "nothing to capture; reductions ['mean', 'var'] of 12 hook point(s) kept as stored" in said
    assert "computed over the stored rows" not in said
    # a refused resume gives the fix in flags
    before = _files(out)
    assert main([*args, "--reduce", "mean,var,l2", "--resume"]) == 1
    err = capsys.readouterr().err
    assert "holds no reduction 'l2'" in err and "resume with the same --model, --reduce and --dtype, or capture " \
        "again with --overwrite" in err and "store_options" not in err
    assert _files(out) == before
    for command in (["export", str(out), "--format", "parquet", "--out", str(tmp_path / "x.parquet")],
                    ["report", str(out), "--out", str(tmp_path / "report")]):
        assert main(command) == 1
        err = capsys.readouterr().err
        assert "to store rows, capture again without --reductions-only" in err, err
        assert "without reduction_policy" not in err, err


def test_a_stopped_capture_says_what_the_store_keeps(tmp_path):
    # the line the command prints after Ctrl-C, SIGTERM or an error: no row, its reductions
    from activationscope.analysis.capture_run import _what_is_kept

    path = tmp_path / "r.zarr"
    model = _Tokens().eval()
    with pytest.raises(RuntimeError, match="stop"):
        with acs.ActivationScope(store=str(path), reduction_policy=STREAMING, reductions=["mean"]).track(model) \
                as tracker, torch.no_grad():
            for x, mask in _batches(2):
                tracker.set_batch(attention_mask=mask)
                model(x)
            raise RuntimeError("stop")
    assert open_store(path).status == "incomplete"
    assert _what_is_kept(str(path)) == (f"{path} keeps the reductions of the samples committed before (6 samples, "
                                        "status incomplete; --resume continues it)")


def test_commits_wait_for_ten_times_the_time_their_states_took(tmp_path):
    # each commit writes every reduction's state (a cov of wide rows: megabytes): a store that keeps
    # reductions only commits no more often than STATE_WRITE_SHARE times the time that took
    from activationscope.store.writer import STATE_WRITE_SHARE

    path = tmp_path / "r.zarr"
    model = _Tokens().eval()
    scope = acs.ActivationScope(store=str(path), reduction_policy=STREAMING, reductions=["mean"],
                                store_options={"commit_interval": 0})
    with scope.track(model) as tracker, torch.no_grad():
        for i, (x, mask) in enumerate(_batches(4)):
            tracker.set_batch(attention_mask=mask)
            model(x)
            if i == 0:  # (committed: its hook points are new) as if its states had taken 1000 s
                assert tracker.writer._state_write_s < 1000
                tracker.writer._state_write_s = 1000.0
                assert tracker.writer._due_interval() == STATE_WRITE_SHARE * 1000.0
        assert open_store(path).n_samples == 3  # no commit since
    assert open_store(path).n_samples == 12 and open_store(path).partial_reductions == {}


def test_a_dtype_change_is_refused_as_a_store_array_refuses_it(tmp_path):
    # the store records each hook point's dtype from its first call: a forward under autocast
    # after one outside it is refused before its rows are reduced, the store left as committed
    path = tmp_path / "r.zarr"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()
    x = torch.randn(3, 4)
    scope = acs.ActivationScope(store=str(path), reduction_policy=STREAMING, reductions=["mean"])
    with pytest.raises(CaptureError, match=r"hook point '0.output' changed its dtype from torch.float32 to "
                                           r"torch.bfloat16 during the capture; the store \(it keeps reductions only\) "
                                           r"records its rows as torch.float32.*torch.autocast.*storage_dtype="):
        with scope.track(model), torch.no_grad():
            model(x)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(torch.randn(3, 4))
    store = open_store(path)
    assert store.status == "incomplete"
    assert store.reduced["0.output"] == {"row_kind": "sample", "feature_shape": [4], "dtype": "float32", "n_rows": 3}
    with torch.no_grad():
        want = model(x).double().mean(0)
    torch.testing.assert_close(store.reductions["0.output"]["mean"], want, rtol=0, atol=0)


class _EmptyFirst(torch.nn.Module):
    """Returns ``placeholder`` at its first call (an empty batch), its input after."""

    def __init__(self, placeholder: torch.Tensor):
        super().__init__()
        self.placeholder, self.calls = placeholder, 0

    def forward(self, x):
        self.calls += 1
        return self.placeholder if self.calls == 1 else x


@pytest.mark.parametrize("placeholder", [torch.empty(0, 3, dtype=torch.int64), torch.empty(0, 5)],
                         ids=["other-dtype", "other-shape"])
def test_rows_unlike_an_empty_first_batch_are_refused_as_a_store_array_refuses_them(tmp_path, placeholder):
    # the store records the dtype and feature shape of a hook point's first call, an empty batch
    # here: the rows after it were reduced without a word, the store recording int64 rows for
    # float32 ones, or feature shape (5,) for reductions of (3,), which open_store then refused
    path = tmp_path / "r.zarr"
    model = torch.nn.Sequential(_EmptyFirst(placeholder))
    rows = torch.tensor([[1.5, -2.0, 3.25]])
    scope = acs.ActivationScope(store=str(path), reduction_policy=STREAMING, reductions=["mean"])
    with pytest.raises(CaptureError) as err, scope.track(model), torch.no_grad():
        model(rows)  # (the empty batch)
        model(rows)
    msg = str(err.value)
    shape, dtype = tuple(placeholder.shape[1:]), str(placeholder.dtype)
    assert (f"hook point '0.output' returned an empty batch at its first call (rows of shape {shape}, {dtype}), "
            "which fixed the row shape and dtype the store (it keeps reductions only) records for it; its first "
            "rows are (3,), torch.float32, and would be reduced as rows the store does not describe") in msg, msg
    assert "x.new_empty" in msg and "exclude= its module" in msg
    store = open_store(path)  # the forward of the empty batch (one sample), and nothing of the refused one
    assert store.status == "incomplete" and store.n_samples == 1, (store.status, store.n_samples)
    assert store.reduced["0.output"]["n_rows"] == 0
    # an empty first batch of the rows' own dtype and shape is fine
    model = torch.nn.Sequential(_EmptyFirst(torch.empty(0, 3)))
    with acs.ActivationScope(store=str(path), reduction_policy=STREAMING, reductions=["mean"],
                             store_options={"overwrite": True}).track(model), torch.no_grad():
        model(rows)
        model(rows)
    store = open_store(path)
    assert store.reduced["0.output"]["dtype"] == "float32" and store.reduced["0.output"]["n_rows"] == 1
    torch.testing.assert_close(store.reductions["0.output"]["mean"], rows[0].double(), rtol=0, atol=0)


@pytest.mark.parametrize("storage_dtype", [None, torch.float16], ids=["no-storage-dtype", "float16"])
@pytest.mark.parametrize("policy", [acs.ReductionPolicy.STORE_ALL, STREAMING], ids=["array", "reductions-only"])
def test_rows_after_an_integer_empty_first_batch_are_not_told_to_pass_storage_dtype(tmp_path, policy, storage_dtype):
    # an int64 placeholder at the first call fixed the hook point's rows as int64: the refusal
    # of the float32 rows after it advised storage_dtype=, which casts floating-point hook points
    # only, so that a capture given it was refused the same way again
    path = tmp_path / "r.zarr"
    rows = torch.tensor([[1.5, -2.0, 3.25]])

    def capture(placeholder, **options):
        model = torch.nn.Sequential(_EmptyFirst(placeholder))
        scope = acs.ActivationScope(store=str(path), reduction_policy=policy, reductions=["mean"],
                                    storage_dtype=storage_dtype, store_options=options)
        with scope.track(model), torch.no_grad():
            model(rows[:0])  # (the empty batch)
            model(rows)

    with pytest.raises(CaptureError) as err:
        capture(torch.empty(0, 3, dtype=torch.int64))
    msg = str(err.value)
    assert "hook point '0.output' returned an empty batch at its first call (rows of shape (3,), torch.int64)" in msg
    assert "storage_dtype=" not in msg, msg
    assert ("(x.new_empty((0, *rows.shape[1:]))), or exclude= its module (storage_dtype casts floating-point hook "
            "points only, decided at their first call, which was torch.int64 here, so it does not make these rows "
            "fit)") in msg, msg
    # the fix it names: an empty first batch of the rows' shape and dtype
    capture(torch.empty(0, 3), overwrite=True)
    store = open_store(path)
    want = rows if storage_dtype is None else rows.to(storage_dtype)
    torch.testing.assert_close(store.reductions["0.output"]["mean"], want[0].double(), rtol=0, atol=0)
    if policy is STREAMING:
        assert store.reduced["0.output"]["dtype"] == str(want.dtype).replace("torch.", "")
    else:
        got = store["0.output"][:]
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("placeholder, then, advised", [
    (torch.empty(0, 3, dtype=torch.float16), torch.tensor([[1.5, -2.0, 3.25]]), True),
    (torch.empty(0, 3), torch.tensor([[1, 2, 3]]), True),  # (integer rows of a floating-point hook point: cast)
    (torch.empty(0, 5), torch.tensor([[1.5, -2.0, 3.25]]), False),  # (the shape differs: no cast makes it fit)
    (torch.empty(0, 3, dtype=torch.bool), torch.tensor([[1.5, -2.0, 3.25]]), False),
    (torch.empty(0, 3), torch.tensor([[1 + 2j, 0j, 3j]]), False),  # (a complex row: storage_dtype refuses it)
], ids=["float16-placeholder", "integer-rows", "other-shape", "bool-placeholder", "complex-rows"])
def test_storage_dtype_is_advised_after_an_empty_first_batch_only_where_it_makes_the_rows_fit(
        tmp_path, placeholder, then, advised):
    model = torch.nn.Sequential(_EmptyFirst(placeholder))

    def capture(**kwargs):
        with acs.ActivationScope(store=str(tmp_path / "r.zarr"), reduction_policy=STREAMING, reductions=["max"],
                                 store_options={"overwrite": True}, **kwargs).track(model), torch.no_grad():
            model[0].calls = 0
            model(then[:0])
            model(then)

    with pytest.raises(CaptureError) as err:
        capture()
    msg = str(err.value)
    assert ("pass storage_dtype= to store every row as one dtype, or exclude= its module" in msg) is advised, msg
    assert ("storage_dtype casts floating-point hook points only" in msg) is (placeholder.dtype == torch.bool), msg
    if advised:  # the advice, taken: the rows are stored cast
        capture(storage_dtype=torch.float32)
        torch.testing.assert_close(open_store(tmp_path / "r.zarr").reductions["0.output"]["max"],
                                   then[0].double(), rtol=0, atol=0)
    else:  # storage_dtype changes nothing, or refuses the rows itself
        with pytest.raises(CaptureError):
            capture(storage_dtype=torch.float32)


@pytest.mark.parametrize("policy", [acs.ReductionPolicy.STORE_ALL, STREAMING], ids=["array", "reductions-only"])
def test_a_resume_whose_first_call_is_integer_casts_it_as_the_store_holds_it(tmp_path, policy):
    # a hook point the store holds as float16 (storage_dtype: its first call was floating-point)
    # whose first call of the resume gives integers: a store of arrays cast them to float16, as
    # its rows are; a store that keeps reductions only refused them (int64 rows, where it reduced
    # float16 ones). Now both cast them, and refuse an integer float16 would change
    path = tmp_path / "s.zarr"
    model = torch.nn.Sequential(torch.nn.Identity())

    def capture(xs, resume):
        scope = acs.ActivationScope(store=str(path), reduction_policy=policy, reductions=["mean", "max"],
                                    storage_dtype=torch.float16, store_options={"resume": resume})
        with scope.track(model), torch.no_grad():
            for x in xs:
                model(x)

    first, ints = torch.tensor([[1.5, -2.0, 3.25]]), torch.tensor([[3, 2048, -7]])
    capture([first], False)
    capture([ints], True)
    want = torch.cat([first, ints.float()]).half()
    store = open_store(path)
    assert store.status == "complete" and store.n_samples == 2
    if policy is STREAMING:
        assert store.reduced["0.output"] == {"row_kind": "sample", "feature_shape": [3], "dtype": "float16", "n_rows": 2}
    else:
        got = store["0.output"][:]
        assert got.dtype == torch.float16 and torch.equal(got, want)
    torch.testing.assert_close(store.reductions["0.output"]["mean"], want.double().mean(0))
    torch.testing.assert_close(store.reductions["0.output"]["max"], want.double().max(0).values, rtol=0, atol=0)
    # an integer float16 cannot hold is refused, naming why it is cast; the store kept as it was
    with pytest.raises(CaptureError) as err:
        capture([torch.tensor([[3, 2049, -7]])], True)
    msg = str(err.value)
    assert ("hook point '0.output' is torch.int64 and storage_dtype=torch.float16 changes its integers (2049 would be "
            "stored as 2048") in msg, msg
    held = ("the store it resumes (it keeps reductions only) reduced its rows as torch.float16" if policy is STREAMING
            else "its store array holds torch.float16")
    assert f"this one is cast because {held} (a store written by an earlier version, which cast integer hook " \
           "points too, or one whose first call of the hook point was floating-point)" in msg, msg
    store = open_store(path)
    assert store.n_samples == 2
    torch.testing.assert_close(store.reductions["0.output"]["max"], want.double().max(0).values, rtol=0, atol=0)


def test_a_new_store_whose_capture_committed_no_row_is_removed(tmp_path):
    # a capture that failed before any row was committed removes the new store it made: one that
    # keeps reductions only was left in place, with a RuntimeWarning that its removal failed (the
    # removal counted its hook points' rows, which such a store refuses to read)
    import warnings

    path = tmp_path / "r.zarr"
    model = torch.nn.Sequential(_EmptyFirst(torch.empty(0, 5)))
    scope = acs.ActivationScope(store=str(path), reduction_policy=STREAMING, reductions=["mean"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(CaptureError, match=r"returned an empty batch at its first call"), scope.track(model), \
                torch.no_grad():
            model(torch.zeros(0, 3))  # (recorded: no sample, the hook point listed with 0 rows reduced)
            model(torch.ones(2, 3))
    assert not path.exists()
    # one that reduced rows is kept
    model = torch.nn.Sequential(_EmptyFirst(torch.empty(0, 3)))
    with pytest.raises(RuntimeError, match="stop"), \
            acs.ActivationScope(store=str(path), reduction_policy=STREAMING, reductions=["mean"]).track(model), \
            torch.no_grad():
        model(torch.zeros(0, 3))
        model(torch.ones(2, 3))
        raise RuntimeError("stop")
    assert open_store(path).reduced["0.output"]["n_rows"] == 2


def test_a_feature_shape_change_is_refused_also_by_a_whole_tensor_reduction(tmp_path):
    # a per_feature=0 reduction takes rows of any feature shape: the store, which records one
    # feature shape per hook point, refuses the change before the rows are reduced
    path = tmp_path / "r.zarr"
    model = torch.nn.Sequential(torch.nn.Identity())
    x = torch.randn(3, 4, dtype=torch.float64)
    scope = acs.ActivationScope(store=str(path), reduction_policy=STREAMING,
                                reductions=[("m", "mean", {"per_feature": 0})])
    with pytest.raises(CaptureError, match=r"hook point '0.output' changed its feature shape from \(4,\) to \(5,\); a "
                                           r"store that keeps reductions only needs one feature shape per hook point"):
        with scope.track(model):
            model(x)
            model(torch.randn(3, 5, dtype=torch.float64))
    store = open_store(path)
    assert store.reduced["0.output"]["feature_shape"] == [4] and store.reduced["0.output"]["n_rows"] == 3
    torch.testing.assert_close(store.reductions["0.output"]["m"], x.mean())


def test_the_token_row_table_it_has_not_is_refused(tmp_path):
    # an empty token table would say that no token was reduced: proj.output reduced 13 of them
    path = tmp_path / "r.zarr"
    _capture(_Tokens().eval(), str(path), _batches(1), reduction_policy=STREAMING, reductions=["mean"])
    store = open_store(path)
    assert store.reduced["proj.output"]["n_rows"] == 13
    with pytest.raises(StoreError, match=r"keeps reductions only.*no token row table.*row_table\('sample'\)") as e:
        store.row_table("token")
    assert not isinstance(e.value, StoreCorruptError)
    with pytest.raises(StoreError, match=r"no token row table"):
        store.row_table("token", columns=["sample_id"])
    assert store.row_table("sample").column("sample_id").to_pylist() == [0, 1, 2]


def test_a_resume_with_another_storage_dtype_names_the_reduced_hook_points(tmp_path):
    # the store has no arrays: its hook points are those it reduced, never "none yet"
    path = tmp_path / "r.zarr"
    model = _two_layers_reduced(path)
    before = _files(path)
    scope = acs.ActivationScope(store=str(path), reduction_policy=STREAMING, reductions=["mean"],
                                storage_dtype=torch.bfloat16, store_options={"resume": True})
    with pytest.raises(CaptureError, match=r"its hook points \('0.output', '1.output'\) are stored with "
                                           r"storage_dtype=None.*this capture has storage_dtype=torch.bfloat16.*nothing "
                                           r"was changed"):
        with scope.track(model), torch.no_grad():
            model(torch.randn(3, 4))
    assert _files(path) == before


def test_the_document_budget_counts_the_rows_reduced(tmp_path, monkeypatch):
    # past DOCUMENT_ALLOWANCE_BYTES, commits wait until the documents are within DOCUMENT_SHARE
    # of the bytes captured: a store of no array counts the rows it reduced (counting none, it
    # committed once per DOCUMENT_MAX_WAIT_S whatever it captured)
    import activationscope.store.writer as writer_mod

    monkeypatch.setattr(writer_mod, "DOCUMENT_ALLOWANCE_BYTES", 0)
    monkeypatch.setattr(writer_mod, "DOCUMENT_MAX_WAIT_S", float("inf"))
    monkeypatch.setattr(writer_mod, "STATE_WRITE_SHARE", 0.0)  # (commits wait for the documents only)
    path = tmp_path / "r.zarr"
    model = torch.nn.Sequential(torch.nn.Identity()).eval()
    scope = acs.ActivationScope(store=str(path), reduction_policy=STREAMING, reductions=["mean"],
                                store_options={"commit_interval": 0})
    with scope.track(model) as tracker, torch.no_grad():
        model(torch.zeros(2, 256))  # its root and row-table part: far more than a quarter of 2 rows
        w = tracker.writer
        assert w._appended_bytes() == 2 * 256 * 4
        model(torch.zeros(2, 256))
        assert open_store(path).n_samples == 2  # held back
        for _ in range(38):
            model(torch.ones(2, 256))
        assert w._appended_bytes() == 80 * 256 * 4
        assert open_store(path).n_samples > 2  # committed again, once the rows reduced allowed it
    assert open_store(path).n_samples == 80


def test_reduced_rows_never_go_back_below_the_committed_count(tmp_path):
    # a hook point left out of the first batch after a commit keeps its committed count: a later
    # batch that gives it fewer rows is refused, not committed as a count that went back
    from activationscope.store import StoreWriter

    w = StoreWriter(tmp_path / "r.zarr", reductions_only=True, commit_interval=0)
    w.open_reduced("a.output", (2,), torch.float32, "sample")
    w.open_reduced("b.output", (2,), torch.float32, "sample")
    w.add_batch(3, reduced_rows={"a.output": 3, "b.output": 3})
    w.commit()
    w.add_batch(3, reduced_rows={"a.output": 6})
    with pytest.raises(ArgumentValueError, match=r"reduced_rows\['b.output'\] counts rows from the start of the "
                                                 r"capture and never goes back: 3 before, got 1"):
        w.add_batch(3, reduced_rows={"a.output": 9, "b.output": 1})
    w.add_batch(3, reduced_rows={"a.output": 9, "b.output": 6})
    w.close()
    reduced = open_store(tmp_path / "r.zarr").reduced
    assert (reduced["a.output"]["n_rows"], reduced["b.output"]["n_rows"]) == (9, 6)


def test_a_resume_with_other_hook_points_names_reductions_not_arrays(tmp_path):
    # the store has no arrays: the refusal says why in its terms (every reduction covers every sample)
    path = tmp_path / "r.zarr"
    model = _two_layers_reduced(path)
    before = _files(path)
    scope = acs.ActivationScope(store=str(path), reduction_policy=STREAMING, reductions=["mean"],
                                store_options={"resume": True})
    with pytest.raises(CaptureError) as e:
        with scope.track(model, include=["0"]), torch.no_grad():
            model(torch.randn(3, 4))
    msg = str(e.value)
    assert "it holds ['1.output'] which this capture does not give" in msg, msg
    assert "every reduction of a store that keeps reductions only must cover every sample" in msg, msg
    assert "array" not in msg, msg
    assert _files(path) == before


def test_a_resume_refused_for_a_damaged_state_points_to_verify(tmp_path):
    path = tmp_path / "r.zarr"
    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()
    scope = acs.ActivationScope(store=str(path), reduction_policy=STREAMING, reductions=["mean"])
    with scope.track(model), torch.no_grad():
        model(torch.randn(3, 4))
    states = [p for p in (path / "reductions").rglob("*") if p.is_file() and "__c" in str(p.relative_to(path))
              and p.name != "zarr.json"]
    assert states, sorted(str(p.relative_to(path)) for p in path.rglob("*"))
    data = bytearray(states[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    states[0].write_bytes(bytes(data))
    before = _files(path)
    again = acs.ActivationScope(store=str(path), reduction_policy=STREAMING, reductions=["mean"],
                                store_options={"resume": True})
    with pytest.raises(acs.ActivationScopeError) as e:
        with again.track(model), torch.no_grad():
            model(torch.randn(3, 4))
    msg = str(e.value)
    assert "files that fail their checks" in msg and f"activationscope verify {path}" in msg, msg
    assert _files(path) == before
    assert open_store(path).verify(), "verify names the damaged file"
