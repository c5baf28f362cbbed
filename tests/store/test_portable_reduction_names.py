"""Reduction names become folders and files, ``reductions/<node>/<name>[.<key>]``, but only
hook points' folders were made portable (FORMAT.md section 1): a reduction named ``a:b``,
``x?``, ``con`` or ``a.`` made a store that a copy to Windows (or to a share macOS mounts from
one) lost or refused, a name with NUL failed at the capture's close, and ``StoreWriter`` took
any name (``mean/../../evil``, ``zarr.json``: a misleading "restore the store" error, or a
half-written reduction). Reduction names are the user's own, refused as FORMAT.md section 6
says (not escaped); stores written before keep theirs, read and resumed where they are.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import zarr

import activationscope as acs
from activationscope.errors import ReductionError
from activationscope.store import StoreWriter, copy_store, open_store
from activationscope.store import writer as W

from hostile import _Mean

UNPORTABLE = ["a:b", "x?", "con", "nul.txt", "a.", "a ", "__x", "tab\there", "a\x00b", 'q"<>|*', "COM1", "lpt¹.x",
              "mean%2Fc%2F0.committed.tmp", "m%2fzarr.json.Committed.TMP"]
NOT_NODES = ["mean/../../evil", ".", "..", "zarr.json", "Zarr.JSON", "x" * 300, "a\\b"]


@pytest.mark.parametrize("name", UNPORTABLE)
def test_a_capture_refuses_a_reduction_name_windows_cannot_hold_before_it_starts(name, tmp_path):
    with pytest.raises(ReductionError, match=r"reduction name must be a name every file system holds.*got "
                       + re.escape(repr(name)) + r" \(pattern '\*'\), which .*give another with \(name, spec\)"):
        acs.ActivationScope(reductions=[(name, "mean")], store=str(tmp_path / "s.zarr"))
    assert not (tmp_path / "s.zarr").exists()


def test_a_portable_name_that_looks_like_one_is_accepted(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 2)).eval()
    x = torch.randn(5, 3)
    names = ["console", "con_", "m.con", "a_b", "_x", "%41", "é", "m.committed.tmp", "a%2Fb"]
    scope = acs.ActivationScope(reductions=[(n, "mean") for n in names], store=str(tmp_path / "s.zarr"))
    with torch.no_grad(), scope.track(model):
        y = model(x)
    st = open_store(tmp_path / "s.zarr")
    for n in names:
        torch.testing.assert_close(st.reductions["0.output"][n], y.double().mean(0))


def _rows(path, n=4):
    w = StoreWriter(path, chunk_rows=2, shard_rows=4)
    w.open_array("0.output", (3,), torch.float32, "sample").append(torch.arange(n * 3.0).view(n, 3))
    w.add_batch(n, list(range(n)), None, {})
    w.commit()
    return w


@pytest.mark.parametrize("name", UNPORTABLE + NOT_NODES)
def test_store_writer_refuses_such_a_name_naming_it_and_the_hook_point_before_writing(name, tmp_path):
    path = tmp_path / "s.zarr"
    w = _rows(path)
    with pytest.raises(ReductionError, match=r"reduction name must .*\(hook point '0\.output'\).*give a"):
        w.add_reductions("0.output", name, _Mean(torch.ones(3, dtype=torch.float64)))
    w.add_reductions("0.output", "mean", _Mean(torch.ones(3, dtype=torch.float64)))
    w.close()
    assert sorted(os.listdir(tmp_path)) == ["s.zarr"]  # nothing outside the store
    assert sorted(os.listdir(path / "reductions" / "0.output")) == ["mean", "zarr.json"]
    st = open_store(path)
    assert list(st.reductions["0.output"]) == ["mean"]
    assert torch.equal(st["0.output"], torch.arange(12.0).view(4, 3))
    assert st.verify() == []


OLD = ["a:b", "con", "x?"]


def _old_store(path, monkeypatch):
    """A store written before the rule, holding reductions named ``OLD`` in folders of those names."""
    real = W.check_reduction_name
    with monkeypatch.context() as m:
        m.setattr(W, "check_reduction_name", lambda name, where="", portable=True: real(name, where, portable=False))
        w = _rows(path)
        for i, n in enumerate(OLD):
            w.add_reductions("0.output", n, _Mean(torch.full((3,), float(i), dtype=torch.float64)))
        w.close()
    assert sorted(os.listdir(path / "reductions" / "0.output")) == sorted(["zarr.json", *OLD])


def _reads(path, values):
    st = open_store(path)
    group = zarr.open_group(str(path), mode="r")
    for n, v in values.items():
        assert torch.equal(st.reductions["0.output"][n], torch.full((3,), v, dtype=torch.float64)), n
        entry = st.attrs["reductions"]["0.output"][n]
        assert entry["path"] == f"reductions/0.output/{n}"
        # a plain Zarr reader, by the path the metadata gives
        assert group[entry["path"]][:].tolist() == [v] * 3, n
    assert st.verify() == []


def test_a_store_written_before_reads_copies_and_resumes_its_reductions_where_they_are(tmp_path, monkeypatch):
    path = tmp_path / "s.zarr"
    _old_store(path, monkeypatch)
    _reads(path, {n: float(i) for i, n in enumerate(OLD)})
    copy_store(path, tmp_path / "copy.zarr")
    _reads(tmp_path / "copy.zarr", {n: float(i) for i, n in enumerate(OLD)})
    w = StoreWriter(path, resume=True)
    w.open_array("0.output", (3,), torch.float32, "sample").append(torch.zeros(2, 3))
    w.add_batch(2, [4, 5], None, {})
    w.commit()
    w.add_reductions("0.output", "a:b", _Mean(torch.full((3,), 7.0, dtype=torch.float64)))  # the stored name
    with pytest.raises(ReductionError, match=r"got 'x\?:' \(hook point '0\.output'\)"):  # a new one is not
        w.add_reductions("0.output", "x?:", _Mean(torch.ones(3, dtype=torch.float64)))
    w.close()
    assert sorted(os.listdir(path / "reductions" / "0.output")) == sorted(["zarr.json", *OLD])
    _reads(path, {"a:b": 7.0, "con": 1.0, "x?": 2.0})
    assert open_store(path)["0.output"].shape == (6, 3)


def test_a_resume_refuses_a_reduction_named_as_a_stored_one_in_another_case(tmp_path):
    """The store holds 'Mean'; a resume adding 'mean' wrote a second folder, one with the
    first on macOS or Windows (one read as the other): refused before the capture goes on,
    naming both, with the committed rows intact."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2)).eval()
    path = tmp_path / "s.zarr"
    x = torch.randn(4, 3)
    with torch.no_grad(), acs.ActivationScope(reductions=[("Mean", "mean")], store=str(path)).track(model):
        y = model(x)
    with pytest.raises(ReductionError, match=r"reduction 'mean' of hook point '0\.output' and the store's reduction "
                       r"'Mean' differ only in case"):
        with torch.no_grad(), acs.ActivationScope(reductions=["mean"], store=str(path),
                                                      store_options={"resume": True}).track(model):
            model(torch.randn(4, 3))
    st = open_store(path)
    assert torch.equal(st["0.output"][:4], y)
    assert sorted(st.reductions["0.output"]) == ["Mean", "Mean.count"]
    torch.testing.assert_close(st.reductions["0.output"]["Mean"], y.double().mean(0))
    assert not any(n.startswith("mean") for n in os.listdir(path / "reductions" / "0.output"))


@pytest.mark.parametrize("stored, new, match", [
    ("é", "e\u0301", r"\(written 'e\\u0301' and '\\xe9'\) differ only in case"),
    ("var", "var.mean", r"'var\.mean' of hook point '0\.output' and the store's reduction 'var': the arrays"),
    ("m.count", "M", r"'M' of hook point '0\.output' and the store's reduction 'm\.count': the arrays"),
])
def test_store_writer_refuses_a_name_sharing_a_file_with_a_stored_reduction(stored, new, match, tmp_path):
    path = tmp_path / "s.zarr"
    w = _rows(path)
    w.add_reductions("0.output", stored, _Mean(torch.ones(3, dtype=torch.float64)))
    w.close()
    w = StoreWriter(path, resume=True)
    with pytest.raises(ReductionError, match=match):
        w.add_reductions("0.output", new, _Mean(torch.zeros(3, dtype=torch.float64)))
    w.close()
    st = open_store(path)
    assert list(st.reductions["0.output"]) == [stored]
    assert torch.equal(st.reductions["0.output"][stored], torch.ones(3, dtype=torch.float64))


def test_a_name_spelled_as_a_kept_reduction_file_is_refused(tmp_path):
    """'mean%2Fc%2F0.committed.tmp' is where a resume keeps the committed chunk of 'mean': a
    store holding both reductions (the writer took it) failed verify() and refused every resume."""
    path = tmp_path / "s.zarr"
    w = _rows(path)
    w.add_reductions("0.output", "mean", _Mean(torch.ones(3, dtype=torch.float64)))
    with pytest.raises(ReductionError, match=r"got 'mean%2Fc%2F0\.committed\.tmp' \(hook point '0\.output'\), which is "
                       r"spelled as the file a resume keeps.*e\.g\. 'mean_2Fc_2F0\.committed\.tmp'"):
        w.add_reductions("0.output", "mean%2Fc%2F0.committed.tmp", _Mean(torch.ones(3, dtype=torch.float64)))
    w.close()
    assert open_store(path).verify() == []
    w = StoreWriter(path, resume=True)
    w.add_reductions("0.output", "mean", _Mean(torch.full((3,), 2.0, dtype=torch.float64)))
    w.close()
    assert torch.equal(open_store(path).reductions["0.output"]["mean"], torch.full((3,), 2.0, dtype=torch.float64))
