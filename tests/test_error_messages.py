"""The messages of mistakes made through the Python API: our error class, the argument or name
given, and the fix (STYLE.md, Errors); one mistake worded alike wherever it is made."""

from __future__ import annotations

import re

import pytest
import torch

import activationscope as acs
from activationscope.data import ActivationDataset
from activationscope.errors import HookPointNotFoundError


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("names") / "s.zarr"
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    with acs.ActivationScope(store=str(path), reductions={"0.output": ["mean"]}).track(model), torch.no_grad():
        model(torch.ones(4, 2))
    return str(path)


def _reads(store_path):
    store = acs.open_store(store_path)
    return {
        "store[...]": lambda hp: store[hp],
        "store.n_rows": lambda hp: store.n_rows(hp),
        "store.reductions": lambda hp: store.reductions[hp],
        "store.reduction_script": lambda hp: store.reduction_script(hp, "mean"),
        "ActivationDataset": lambda hp: ActivationDataset(store_path, hook_points=[hp]),
    }


@pytest.mark.parametrize("read", ["store[...]", "store.n_rows", "store.reductions", "store.reduction_script",
                                  "ActivationDataset"])
def test_a_hook_point_typo_suggests_the_closest_hook_point(store_path, read):
    with pytest.raises(HookPointNotFoundError, match=r"hook point '0\.outptu' .*; did you mean \['0\.output'\]\?$"):
        _reads(store_path)[read]("0.outptu")


@pytest.mark.parametrize("read", ["store[...]", "store.n_rows", "ActivationDataset"])
def test_a_module_name_suggests_its_hook_points(store_path, read):
    # "2" is the module; its hook point is "2.output"
    with pytest.raises(HookPointNotFoundError, match=r"hook point '2' .*; did you mean \['2\.output'\]\? \(a hook "
                                                     r"point is a module path plus '\.output' or '\.input\.<k>'\)"):
        _reads(store_path)[read]("2")


def test_a_name_close_to_none_suggests_nothing_and_a_hook_point_without_reductions_no_other(store_path):
    with pytest.raises(HookPointNotFoundError) as e:
        acs.open_store(store_path)["zzz"]
    assert "did you mean" not in str(e.value) and "it has ['0.output', '1.output', '2.output']" in str(e.value)
    # "2.output" is a hook point, stored without reductions: "1.output" or "0.output" would be no fix
    with pytest.raises(HookPointNotFoundError, match=r"hook point '2\.output' has no reductions") as e:
        acs.open_store(store_path).reductions["2.output"]
    assert "did you mean" not in str(e.value)


def test_tracker_activations_of_a_hook_point_not_captured_is_a_hook_point_error():
    # it was a plain dict: a bare KeyError('0.outptu'), where tracker.reductions names the hook points
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU())
    with acs.ActivationScope().track(model) as tracker, torch.no_grad():
        model(torch.ones(4, 2))
    acts = tracker.activations
    assert sorted(acts) == ["0.output", "1.output"] and acts["0.output"][0].shape == (4, 3)
    with pytest.raises(HookPointNotFoundError, match=r"hook point '0\.outptu' has no activations; hook points with "
                                                     r"activations: \['0\.output', '1\.output'\]; did you mean "
                                                     r"\['0\.output'\]\?"):
        acts["0.outptu"]
    with pytest.raises(KeyError, match=r"did you mean \['1\.output'\]\? \(a hook point is a module path"):
        acts["1"]


@pytest.fixture(scope="module")
def labelled_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("columns") / "s.zarr"
    model = torch.nn.Sequential(torch.nn.Linear(2, 3))
    with acs.ActivationScope(store=str(path)).track(model) as tracker, torch.no_grad():
        tracker.set_batch(label=[0, 1, 0, 1])
        model(torch.ones(4, 2))
    return str(path)


@pytest.mark.parametrize("read", ["ActivationDataset", "export_parquet", "export_arrow"])
def test_a_column_typo_is_named_alike_with_the_store_and_the_closest_column(labelled_path, tmp_path, read):
    # the export's message named no store, and neither suggested 'label' for 'lable'
    from activationscope.data import export_arrow, export_parquet

    calls = {
        "ActivationDataset": lambda cols: ActivationDataset(labelled_path, hook_points="0.output", columns=cols),
        "export_parquet": lambda cols: export_parquet(labelled_path, tmp_path / "o.parquet", columns=cols),
        "export_arrow": lambda cols: export_arrow(labelled_path, tmp_path / "o.arrow", columns=cols),
    }
    with pytest.raises(ValueError, match=re.escape(
            f"columns ['lable', 'zzz'] are not in the sample row table of {labelled_path!r}; it has ['sample_id', "
            "'batch', 'label']; did you mean ['label'] for 'lable'?")):
        calls[read](["lable", "zzz"])
    with pytest.raises(ValueError) as e:
        calls[read](["zzz"])
    assert str(e.value).endswith("it has ['sample_id', 'batch', 'label']")
    assert not (tmp_path / "o.parquet").exists() and not (tmp_path / "o.arrow").exists()


def test_a_pattern_where_one_hook_point_is_read_says_so(store_path):
    # store["*.output"] and to_dask(store, "0.*") were told only that no such hook point exists
    from activationscope.analysis.dask import to_dask

    store = acs.open_store(store_path)
    for read, pattern, hits in [(lambda p: store[p], "*.output", "['0.output', '1.output', '2.output']"),
                                (lambda p: store.n_rows(p), "0.*", "['0.output']"),
                                (lambda p: to_dask(store_path, p), "[01].output", "['0.output', '1.output']")]:
        with pytest.raises(HookPointNotFoundError, match=re.escape(
                f"; {pattern!r} is read as one name, not a pattern (it would match {hits}): pass one hook point")):
            read(pattern)
    with pytest.raises(HookPointNotFoundError) as e:  # a pattern matching nothing: no such note
        store["9.*"]
    assert "not a pattern" not in str(e.value)
