"""Hook points whose node names differ only in case or Unicode normalization (``d.Attn.output``
and ``d.attn.output``; ``é`` as one character and as ``e`` plus an accent): stored apart where
the file system tells them apart, with a warning that a copy on one that does not (macOS,
Windows) would hold one folder for both; refused where the store's file system folds them."""

from __future__ import annotations

import warnings

import pytest
import torch

import activationscope as acs
from activationscope.errors import StoreError
from activationscope.store import StoreWriter, copy_store
from activationscope.store import reader as reader_module
from activationscope.store import writer as writer_module

NAMES = ["Attn", "attn", "e\u0301", "\u00e9", "b"]


class Dict(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.d = torch.nn.ModuleDict({k: torch.nn.Linear(4, 3) for k in NAMES})

    def forward(self, x):
        return [m(x) for m in self.d.values()]


def _capture(model, path, x, include=None, **store_options):
    scope = acs.ActivationScope(store=str(path), store_options=store_options)
    with scope.track(model, include=include) as tracker, torch.no_grad():
        tracker.set_batch()
        model(x)


def test_names_that_differ_only_in_case_or_normalization_are_stored_apart_with_a_warning(tmp_path):
    model, x = Dict(), torch.randn(5, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _capture(model, tmp_path / "s.zarr", x)
    said = [str(w.message) for w in caught if "differ only in case or Unicode normalization" in str(w.message)]
    assert len(said) == 2
    assert "'d.Attn.output' and 'd.attn.output'" in said[0] and "macOS, Windows" in said[0]
    assert r"(written 'd.e\u0301.output' and 'd.\xe9.output')" in said[1]
    store = acs.open_store(tmp_path / "s.zarr")
    assert store.hook_points == [f"d.{k}.output" for k in NAMES]
    with torch.no_grad():
        for k in NAMES:  # each under its own name, against plain torch
            torch.testing.assert_close(store[f"d.{k}.output"], model.d[k](x), rtol=0, atol=0)


def test_a_file_system_that_folds_them_refuses_the_second_before_it_is_written(tmp_path, monkeypatch):
    """Where the store's folder folds the names (probed there), the second hook point is
    refused naming both, and no store is left; a resume
    that brings a new hook point folded like a stored one is refused too, the store as it was."""
    folds = []

    def fake_folds(folder, a, b):  # the lookup a case-insensitive file system makes
        folds.append((folder, a, b))
        return writer_module._folded(a) == writer_module._folded(b)

    monkeypatch.setattr(writer_module, "_folds_names", fake_folds)
    model, x = Dict(), torch.randn(5, 4)
    with pytest.raises(StoreError, match=r"hook points 'd\.Attn\.output' and 'd\.attn\.output' differ only in case "
                                         r"or Unicode normalization, and the file system of store .*rename one module"):
        _capture(model, tmp_path / "s.zarr", x)
    assert folds and folds[0][0] == tmp_path / "s.zarr" and folds[0][1:] == ("d.attn.output", "d.Attn.output")
    assert not (tmp_path / "s.zarr").exists()

    w = StoreWriter(str(tmp_path / "r.zarr"))  # a stored 'd.Attn.output', then a resume bringing 'd.attn.output'
    w.open_array("d.Attn.output", (2,), torch.float32, "sample").append(torch.ones(3, 2))
    w.add_batch(3)
    w.close()
    w = StoreWriter(str(tmp_path / "r.zarr"), resume=True)
    with pytest.raises(StoreError, match=r"'d\.Attn\.output' and 'd\.attn\.output' differ only in case"):
        w.open_array("d.attn.output", (2,), torch.float32, "sample")
    w.open_array("d.Attn.output", (2,), torch.float32, "sample").append(torch.full((1, 2), 2.0))
    w.add_batch(1)
    w.close()
    after = acs.open_store(tmp_path / "r.zarr")
    assert after.hook_points == ["d.Attn.output"]
    torch.testing.assert_close(after["d.Attn.output"], torch.tensor([[1.0, 1.0]] * 3 + [[2.0, 2.0]]), rtol=0, atol=0)


def test_the_probe_reads_the_file_system_and_leaves_nothing(tmp_path):
    (tmp_path / "ref").mkdir()
    (tmp_path / "ref" / "Q").touch()
    case_insensitive = (tmp_path / "ref" / "q").exists()
    (tmp_path / "ref" / "Q").unlink()
    (tmp_path / "ref").rmdir()
    assert writer_module._folds_names(tmp_path, "d.Attn.output", "d.attn.output") is case_insensitive
    assert writer_module._folds_names(tmp_path, "d.a.output", "d.a.output") is True
    assert writer_module._folds_names(tmp_path, "d.a.output", "d.b.output") is False
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("source", ["memory", "local"])
def test_a_copy_onto_a_file_system_that_folds_them_is_refused_before_anything_is_copied(tmp_path, monkeypatch, source):
    """copy_store of a store holding 'd.Attn.output' and 'd.attn.output' (made on Linux or
    object storage) into a folder whose file system folds the names is refused naming both,
    with nothing copied; a file system that tells them apart gets both, each its own rows."""
    model, x = Dict(), torch.randn(5, 4)
    src = "memory://folded/s.zarr" if source == "memory" else str(tmp_path / "src.zarr")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (said by the test above)
        _capture(model, src, x)
    monkeypatch.setattr(reader_module, "folds_names",
                        lambda folder, a, b: writer_module._folded(a) == writer_module._folded(b))
    with pytest.raises(StoreError, match=r"holds 'acts/d\.Attn\.output/.*' and 'acts/d\.attn\.output/.*', which differ "
                                         r"only in case.*nothing was copied"):
        copy_store(src, tmp_path / "copy.zarr")
    assert not (tmp_path / "copy.zarr" / "zarr.json").exists()
    monkeypatch.undo()
    copy_store(src, tmp_path / "copy.zarr")
    store = acs.open_store(tmp_path / "copy.zarr")
    with torch.no_grad():
        for k in NAMES:
            torch.testing.assert_close(store[f"d.{k}.output"], model.d[k](x), rtol=0, atol=0)


def test_errors_listing_hook_points_tell_apart_those_that_print_alike(tmp_path):
    """'d.e\u0301.output' ('e' plus a combining accent) and 'd.\u00e9.output' printed alike
    in the lists of a HookPointNotFoundError (the store's hook points, the modules of a
    no-match include= error), so a user could not tell which is which; now the one not in
    NFC form is shown with its escapes, the other as it is."""
    model, x = Dict(), torch.randn(5, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the warning that a copy on macOS would fold them)
        _capture(model, tmp_path / "s.zarr", x, include=["d.e\u0301", "d.\u00e9"])
    store = acs.open_store(tmp_path / "s.zarr")
    with pytest.raises(acs.HookPointNotFoundError) as e:
        store["d.x.output"]
    assert "it has ['d.e\\u0301.output', 'd.\u00e9.output']" in str(e.value)
    with pytest.raises(acs.HookPointNotFoundError) as e:
        store.reductions["d.e\u0301.output"]
    assert "hook point 'd.e\\u0301.output' has no reductions" in str(e.value)
    with pytest.raises(acs.HookPointNotFoundError) as e:
        acs.ActivationScope().track(model, include=["d.x"])
    assert "'d.e\\u0301'" in str(e.value) and "'d.\u00e9'" in str(e.value)
