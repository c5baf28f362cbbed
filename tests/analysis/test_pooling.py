"""analysis.pooling.sentence_rows against a plain-PyTorch grouping of the store's rows."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import activationscope as acs
from activationscope.analysis.pooling import _labelled_rows, labelled_rows, sentence_rows
from activationscope.analysis.probes import choose_folds, probe_accuracy, probe_store
from activationscope.errors import ArgumentTypeError, ArgumentValueError


class Encoder(torch.nn.Module):
    def __init__(self, d_model: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, d_model)
        self.layer = torch.nn.Linear(d_model, d_model)
        self.head = torch.nn.Linear(d_model, 2)

    def forward(self, input_ids):
        x = torch.relu(self.layer(self.embed(input_ids)))
        return self.head(x.mean(1))


def _two_rank_store(path):
    """Two tasks of a RankStore capture with the default sample ids (counted per rank, so
    both ranks have samples 0..11) and labels that differ between the ranks, consolidated."""
    model = Encoder().eval()
    gen = torch.Generator().manual_seed(3)
    for task in range(2):
        scope = acs.ActivationScope(store=str(path), store_options={"process_group": acs.RankStore(task, 2)})
        with scope.track(model, include=["layer", "head"]) as tracker, torch.no_grad():
            for _ in range(2):
                lengths = torch.randint(2, 7, (6,), generator=gen)
                mask = torch.arange(6)[None, :] < lengths[:, None]
                tracker.set_batch(attention_mask=mask, label=(torch.arange(6) + task) % 2)
                model(torch.randint(1, 50, (6, 6), generator=gen) * mask)
    subprocess.run([sys.executable, "-m", "activationscope", "consolidate", str(path)], check=True,
                   capture_output=True)
    return acs.open_store(str(path))


def test_sentence_rows_keep_samples_of_different_ranks_apart(tmp_path):
    store = _two_rank_store(tmp_path / "ranks.zarr")
    samples = store.row_table("sample").to_pylist()
    assert store.n_samples == 24 and len({s["sample_id"] for s in samples}) == 12  # ids repeat across ranks
    # sample rows: one per row, as stored
    x, labels = sentence_rows(store, "head.output")
    torch.testing.assert_close(x, store["head.output"].double(), rtol=0, atol=0)
    assert labels == [s["label"] for s in samples]
    # token rows: the mean of each (rank, batch, sample_id)'s tokens, in store order
    tokens = store.row_table("token").to_pylist()
    rows = store["layer.output"].double()
    keys = [(t["rank"], t["batch"], t["sample_id"]) for t in tokens]
    order = list(dict.fromkeys(keys))
    want = torch.stack([rows[[i for i, k in enumerate(keys) if k == key]].mean(0) for key in order])
    label_of = {(s["rank"], s["batch"], s["sample_id"]): s["label"] for s in samples}
    for batch_size in (8192, 7, 1):  # samples split across batches are pooled whole
        x, labels = sentence_rows(store, "layer.output", batch_size=batch_size)
        torch.testing.assert_close(x, want, rtol=1e-12, atol=1e-12)
        assert labels == [label_of[k] for k in order]
    assert all(p.n_samples == 24 for p in probe_store(store, n_folds=2).values())


def _labelled_store(path, labels):
    model = Encoder().eval()
    gen = torch.Generator().manual_seed(5)
    scope = acs.ActivationScope(store=str(path))
    with scope.track(model, include=["layer", "head"]) as tracker, torch.no_grad():
        for b in range(0, len(labels), 6):
            mask = torch.arange(6)[None, :] < torch.randint(2, 7, (6, 1), generator=gen)
            tracker.set_batch(attention_mask=mask, label=labels[b:b + 6])
            model(torch.randint(1, 50, (6, 6), generator=gen) * mask)
    return acs.open_store(str(path))


@pytest.mark.parametrize("mark", [-1, -100])
def test_only_minus_one_and_the_ignore_index_mark_a_sample_unlabelled_and_the_probe_says_how_many(tmp_path, mark):
    # mark, 0, 1: -1 (the demo's mark) or -100 (CrossEntropyLoss's ignore_index) is left out and counted
    labels = [mark, 0, 1] * 8
    store = _labelled_store(tmp_path / "a.zarr", labels)
    x, got = sentence_rows(store, "head.output")
    keep = torch.tensor(labels) != mark
    torch.testing.assert_close(x, store["head.output"].double()[keep], rtol=0, atol=0)
    assert got == [v for v in labels if v != mark]
    result = probe_store(store, n_folds=2)
    for hp in ("head.output", "layer.output"):
        assert result[hp].n_samples == 16 and result[hp].n_classes == 2
        assert result[hp].dropped_note == "8 sample(s) without a label (missing, -1, -100 or empty) left out"
    from activationscope.analysis.report import write_report

    page = write_report(store, tmp_path / "rep", probes=result).read_text()  # one line for both hook points
    assert page.count("without a label") == 1
    assert "layer.output, head.output: 8 sample(s) without a label (missing, -1, -100 or empty) left out." in page
    # other negative ints are classes like any other
    labels = [-2, 2, -99, -101] * 6
    store = _labelled_store(tmp_path / "b.zarr", labels)
    assert sentence_rows(store, "layer.output")[1] == labels
    result = probe_store(store, n_folds=2)
    assert result["layer.output"].n_samples == 24 and result["layer.output"].dropped_note == ""
    # a store whose classes are -1 and 1 names the samples left out in the reason it gives
    store = _labelled_store(tmp_path / "c.zarr", [-1, 1] * 12)
    assert "a probe needs at least 2 classes" in probe_store(store).skipped["head.output"]
    assert "(12 sample(s) without a label (missing, -1, -100 or empty) left out)" in probe_store(store).skipped["head.output"]


@pytest.mark.parametrize("mark", [-1.0, -100.0])
def test_a_float_label_column_marks_unlabelled_samples_as_an_int_one_does(tmp_path, mark):
    # a float tensor given to set_batch(label=...) stores -1.0 / -100.0: those samples are
    # unlabelled, not a third class probed with the others
    labels = torch.tensor([mark, 0.0, 1.0] * 8)
    store = _labelled_store(tmp_path / "f.zarr", labels)
    assert store.row_table("sample").schema.field("label").type.bit_width in (32, 64)  # a float column
    keep = labels != mark
    for hp in ("head.output", "layer.output"):
        x, got, n_unlabelled = labelled_rows(store, hp)
        assert got == [0.0, 1.0] * 8 and n_unlabelled == 8 and len(x) == 16
    torch.testing.assert_close(labelled_rows(store, "head.output")[0], store["head.output"][keep], rtol=0, atol=0)
    result = probe_store(store, n_folds=2)
    for hp in ("head.output", "layer.output"):
        assert result[hp].n_samples == 16 and result[hp].n_classes == 2
        assert result[hp].chance == 0.5
        assert result[hp].dropped_note == "8 sample(s) without a label (missing, -1, -100 or empty) left out"
    # other negative floats are classes
    store = _labelled_store(tmp_path / "g.zarr", torch.tensor([-2.0, 2.0, -1.5] * 8))
    assert probe_store(store, n_folds=2)["head.output"].n_classes == 3


def test_str_sample_ids_are_pooled_and_probed(tmp_path):
    model = Encoder().eval()
    gen = torch.Generator().manual_seed(7)
    scope = acs.ActivationScope(store=str(tmp_path / "s.zarr"))
    with scope.track(model, include=["layer", "head"]) as tracker, torch.no_grad():
        for b in range(4):
            mask = torch.arange(6)[None, :] < torch.randint(2, 7, (6, 1), generator=gen)
            tracker.set_batch(attention_mask=mask, sample_ids=[f"doc{6 * b + i}" for i in range(6)],
                              label=["pos", "neg"] * 3)
            model(torch.randint(1, 50, (6, 6), generator=gen) * mask)
    store = acs.open_store(str(tmp_path / "s.zarr"))
    ids = store.row_table("token").column("sample_id").to_pylist()
    rows = store["layer.output"].double()
    want = torch.stack([rows[[i for i, s in enumerate(ids) if s == d]].mean(0) for d in dict.fromkeys(ids)])
    x, labels = sentence_rows(store, "layer.output")
    torch.testing.assert_close(x, want, rtol=1e-12, atol=1e-12)
    assert labels == ["pos", "neg"] * 12
    result = probe_store(store, n_folds=2)
    assert not result.skipped and {p.n_samples for p in result.values()} == {24}


def test_labels_that_cannot_be_paired_with_token_rows_skip_that_hook_point_only(tmp_path):
    # one forward gives each sample id to two samples of different labels: the token rows cannot be
    # told apart, the sample rows can; the report still has every hook point, with the reason
    from activationscope.analysis.report import write_report

    model = Encoder().eval()
    gen = torch.Generator().manual_seed(9)
    scope = acs.ActivationScope(store=str(tmp_path / "d.zarr"))
    with scope.track(model, include=["layer", "head"]) as tracker, torch.no_grad():
        for _ in range(4):
            mask = torch.arange(6)[None, :] < torch.randint(2, 7, (6, 1), generator=gen)
            tracker.set_batch(attention_mask=mask, sample_ids=[0, 0, 1, 1, 2, 2], y=[0, 1] * 3)
            model(torch.randint(1, 50, (6, 6), generator=gen) * mask)
    store = acs.open_store(str(tmp_path / "d.zarr"))
    result = probe_store(store, label_column="y", n_folds=2)
    assert list(result) == ["head.output"] and result["head.output"].n_samples == 24
    assert "one forward gave one sample id twice" in result.skipped["layer.output"]
    page = write_report(store, tmp_path / "rep", label_column="y", n_folds=2).read_text()
    assert "No probe for layer.output: the sample row table" in page
    assert result.skipped.keys() == {"layer.output"}
    assert sentence_rows(store, "head.output", label_column="no_such_column") is None


def test_a_per_token_label_labels_each_token_row(tmp_path):
    # a (batch, pos) column of set_batch (a tag per token): token rows are probed one by one,
    # never pooled under the tag of a sample's first token
    model = torch.nn.Sequential(torch.nn.Embedding(20, 6), torch.nn.Linear(6, 6)).eval()
    gen = torch.Generator().manual_seed(0)
    scope = acs.ActivationScope(store=str(tmp_path / "t.zarr"))
    with scope.track(model, include=["1"]) as tracker, torch.no_grad():
        for _ in range(4):
            ids = torch.randint(0, 20, (6, 5), generator=gen)
            mask = torch.arange(5)[None, :] < torch.randint(2, 6, (6, 1), generator=gen)
            tracker.set_batch(attention_mask=mask, tag=ids % 3, label=torch.arange(6) % 2)
            model(ids)
    store = acs.open_store(str(tmp_path / "t.zarr"))
    tags = store.row_table("token").column("tag").to_pylist()
    x, labels = sentence_rows(store, "1.output", label_column="tag")
    torch.testing.assert_close(x, store["1.output"].double(), rtol=0, atol=0)
    assert labels == tags
    assert probe_store(store, label_column="tag", n_folds=2)["1.output"].n_samples == len(tags)
    # a per-sample label of the same store still pools each sample's tokens
    assert probe_store(store, n_folds=2)["1.output"].n_samples == 24
    from activationscope.analysis.report import write_report

    page = write_report(store, tmp_path / "rep", label_column="tag", n_folds=2).read_text()
    assert "regression on one row per token row of token hook points (the label column &#x27;tag&#x27; is per token" in page
    page = write_report(store, tmp_path / "rep2", n_folds=2).read_text()
    assert "regression on one row per sample (token rows mean-pooled per sample)" in page


def test_probe_store_refuses_bad_folds_instead_of_skipping_every_hook_point(tmp_path):
    import pytest

    from activationscope.errors import ArgumentValueError

    store = _labelled_store(tmp_path / "f.zarr", [0, 1] * 6)
    for bad in (1, 0, "5", True, 2.0):
        with pytest.raises(ArgumentValueError, match=f"n_folds must be an int of at least 2, got {bad!r}"):
            probe_store(store, n_folds=bad)
    with pytest.raises(ArgumentValueError, match="seed must be an int, got 1.5"):
        probe_store(store, seed=1.5)  # (not every hook point skipped with the reason)


@pytest.mark.parametrize("bad", [1, 2.5, 3.0, "3", True])
def test_choose_folds_and_probe_accuracy_refuse_folds_that_are_not_an_int_of_at_least_2(bad):
    labels = [0, 1] * 10
    x = torch.randn(20, 3, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ArgumentValueError, match=f"n_folds must be an int of at least 2, got {bad!r}"):
        choose_folds(labels, bad)  # (2.5 came back as 2.5 folds, "" for the note)
    with pytest.raises(ArgumentValueError, match=f"n_folds must be an int of at least 2, got {bad!r}"):
        probe_accuracy(x, labels, n_folds=bad)  # (a bare TypeError from deep inside for 2.5, "3")


@pytest.mark.parametrize("kwargs, match", [
    ({"max_iter": 0}, "max_iter must be a positive int, got 0"),
    ({"max_iter": 1.5}, "max_iter must be a positive int, got 1.5"),
    ({"max_iter": True}, "max_iter must be a positive int, got True"),
    ({"l2": -1.0}, "l2 must be a finite number of at least 0, got -1.0"),
    ({"l2": float("nan")}, "l2 must be a finite number of at least 0, got nan"),
    ({"seed": 1.5}, "seed must be an int, got 1.5"),
])
def test_probe_accuracy_refuses_a_fit_it_cannot_make(kwargs, match):
    # max_iter=0 gave the accuracy of an untrained probe, l2=-1 rewarded large weights, both
    # without a word; seed=1.5 raised torch's RuntimeError naming no argument
    x = torch.randn(20, 3, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ArgumentValueError, match=match):
        probe_accuracy(x, [0, 1] * 10, **kwargs)


@pytest.mark.parametrize("labels, groups, cls, match", [
    (torch.nn.functional.one_hot(torch.arange(20) % 2), None, ArgumentValueError,
     r"labels must be 1-D, one value per row of x, got shape \(20, 2\); for one-hot labels pass labels\.argmax\(1\)"),
    (np.zeros((20, 1)), None, ArgumentValueError, r"labels must be 1-D, one value per row of x, got shape \(20, 1\)"),
    ([[i % 2] for i in range(20)], None, ArgumentTypeError,
     r"labels must hold one hashable value per row of x \(an int, a str, \.\.\.\), got list \[0\] at row 0"),
    ([0, 1] * 10, torch.arange(40).reshape(20, 2), ArgumentValueError,
     r"groups must be 1-D, one value per row of x, got shape \(20, 2\)$"),
    ([0, 1] * 10, [[i] for i in range(20)], ArgumentTypeError,
     r"groups must hold one hashable value per row of x \(an int, a str, \.\.\.\), got list \[0\] at row 0"),
])
def test_probe_accuracy_names_labels_or_groups_that_are_not_one_value_per_row(labels, groups, cls, match):
    # one-hot labels (20, 2) raised Python's "unhashable type: 'list'" from inside the probe
    x = torch.randn(20, 3, generator=torch.Generator().manual_seed(0))
    with pytest.raises(cls, match=match):
        probe_accuracy(x, labels, groups=groups)
    assert probe_accuracy(x, torch.nn.functional.one_hot(torch.arange(20) % 2).argmax(1)).n_classes == 2


def test_labels_and_groups_given_as_lists_of_scalar_tensors_are_their_values():
    # list(tensor) holds 0-d tensors, which hash by identity: each row was a group of its own
    # (the groups silently ignored: folds not grouped) and each label a class of one row
    y = torch.tensor([0, 1] * 20)
    g = torch.arange(40) // 4
    x = torch.randn(40, 4, generator=torch.Generator().manual_seed(0)) + 3.0 * y[:, None]
    want = probe_accuracy(x, y, n_folds=2, groups=g)
    assert want.n_groups == 10
    for labels, groups in [(list(y), list(g)), (list(y.numpy()), [np.array(v) for v in g.tolist()])]:
        got = probe_accuracy(x, labels, n_folds=2, groups=groups)
        assert (got.n_classes, got.n_groups, got.fold_accuracies) == (2, 10, want.fold_accuracies)
    assert choose_folds(list(y), 3, groups=list(g)) == choose_folds(y.tolist(), 3, groups=g.tolist()) == (3, "")
    with pytest.raises(ArgumentTypeError, match=r"labels must hold one hashable value per row of x .*got Tensor "
                                                r"tensor\(\[0, 1\]\) at row 0"):
        probe_accuracy(x[:20], list(torch.nn.functional.one_hot(y[1:21])))


@pytest.mark.parametrize("labels, groups, cls, match", [
    (np.eye(2)[[0, 1] * 10], None, ArgumentValueError,
     r"labels must be 1-D, one value per row of x, got shape \(20, 2\); for one-hot labels pass labels\.argmax\(1\)"),
    ([[i % 2] for i in range(20)], None, ArgumentTypeError, r"labels must hold one hashable value .* at row 0"),
    ([0, 1] * 10, [[i] for i in range(20)], ArgumentTypeError, r"groups must hold one hashable value .* at row 0"),
])
def test_choose_folds_names_labels_or_groups_that_are_not_one_value_per_row(labels, groups, cls, match):
    # as probe_accuracy: choose_folds raised Python's "unhashable type" from inside
    with pytest.raises(cls, match=match):
        choose_folds(labels, 2, groups=groups)


def test_folds_may_be_numpy_ints():
    labels = [0, 1] * 10
    assert choose_folds(labels, np.int64(3)) == (3, "")
    x = torch.randn(20, 3, generator=torch.Generator().manual_seed(0))
    assert probe_accuracy(x, labels, n_folds=np.int64(4)).n_folds == 4


def test_probes_of_bfloat16_rows_equal_those_of_their_float64_copy_without_holding_it(tmp_path):
    """Sample rows are handed to the probe in their stored dtype and each fold is made
    float64 there (no float64 copy of every row is held): the fold accuracies are exactly
    those of the same rows given as float64."""
    from activationscope.analysis.pooling import labelled_rows
    from activationscope.analysis.probes import probe_accuracy

    torch.manual_seed(0)
    x = (torch.randn(60, 5) + torch.arange(60).remainder(2).unsqueeze(1)).to(torch.bfloat16)
    labels = [i % 2 for i in range(60)]
    a, b = probe_accuracy(x, labels, n_folds=3), probe_accuracy(x.double(), labels, n_folds=3)
    assert a.fold_accuracies == b.fold_accuracies and a.n_features == 5

    model = torch.nn.Identity()
    path = tmp_path / "s.zarr"
    with acs.ActivationScope(store=str(path), storage_dtype=torch.bfloat16).track(model) as tr, torch.no_grad():
        for s in range(0, 60, 20):
            tr.set_batch(label=labels[s:s + 20])
            model(x[s:s + 20].float())
    rows, got, n_unlabelled = labelled_rows(acs.open_store(path), "output")
    assert rows.dtype == torch.bfloat16 and torch.equal(rows, x) and got == labels and n_unlabelled == 0
    assert sentence_rows(acs.open_store(path), "output")[0].dtype == torch.float64
    result = probe_store(acs.open_store(path), n_folds=3)["output"]
    assert result.fold_accuracies == b.fold_accuracies


def test_samples_whose_label_is_missing_are_left_out_and_counted(tmp_path):
    # (set_batch(label=...) given for some batches only leaves the label null for the others:
    # a numeric column with nulls made labelled_rows raise, and probe_store skip every hook
    # point with that error, where missing labels are to be left out and counted)
    model = Encoder().eval()
    gen = torch.Generator().manual_seed(11)
    scope = acs.ActivationScope(store=str(tmp_path / "m.zarr"))
    with scope.track(model, include=["layer", "head"]) as tracker, torch.no_grad():
        for b in range(4):
            mask = torch.arange(6)[None, :] < torch.randint(2, 7, (6, 1), generator=gen)
            labelled = {"label": [(b + i) % 2 for i in range(6)]} if b in (0, 3) else {}
            tracker.set_batch(attention_mask=mask, **labelled)
            model(torch.randint(1, 50, (6, 6), generator=gen) * mask)
    store = acs.open_store(str(tmp_path / "m.zarr"))
    samples = store.row_table("sample").to_pylist()
    assert sum(s["label"] is None for s in samples) == 12
    keep = torch.tensor([s["label"] is not None for s in samples])
    rows, labels, n_unlabelled = labelled_rows(store, "head.output")
    assert torch.equal(rows, store["head.output"][keep]) and n_unlabelled == 12
    assert labels == [s["label"] for s in samples if s["label"] is not None]
    tokens = store.row_table("token").to_pylist()
    token_rows = store["layer.output"].double()
    label_of = {(s["batch"], s["sample_id"]): s["label"] for s in samples}
    keys = [(t["batch"], t["sample_id"]) for t in tokens]
    order = [k for k in dict.fromkeys(keys) if label_of[k] is not None]
    want = torch.stack([token_rows[[i for i, k in enumerate(keys) if k == key]].mean(0) for key in order])
    for batch_size in (8192, 5):
        x, labels, n_unlabelled = labelled_rows(store, "layer.output", batch_size=batch_size)
        torch.testing.assert_close(x, want, rtol=1e-12, atol=1e-12)
        assert labels == [label_of[k] for k in order] and n_unlabelled == 12
    result = probe_store(store, n_folds=2)
    assert not result.skipped
    for hp in ("head.output", "layer.output"):
        assert result[hp].n_samples == 12
        assert result[hp].dropped_note == "12 sample(s) without a label (missing, -1, -100 or empty) left out"


def _layered_store(path):
    """Sample rows of three hook points ``d.0.output``, ``d.1.output``, ``head.output``,
    labelled 0 / 1 alternately and separable in every hook point."""
    model = torch.nn.Sequential()
    model.add_module("d", torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)))
    model.add_module("head", torch.nn.Linear(4, 2))
    torch.manual_seed(0)
    labels = [0, 1] * 20
    x = torch.randn(40, 4) + 3 * torch.tensor(labels, dtype=torch.float32)[:, None]
    with acs.ActivationScope(store=str(path)).track(model, include=["d.?", "head"]) as tracker, torch.no_grad():
        tracker.set_batch(label=labels)
        model(x)
    return acs.open_store(str(path)), labels


@pytest.mark.parametrize("as_path", [False, True], ids=["store", "path"])
def test_probe_store_takes_one_name_or_patterns_as_the_dataset_does(tmp_path, as_path):
    from activationscope.analysis.probes import probe_accuracy

    store, labels = _layered_store(tmp_path / "p.zarr")
    given = str(tmp_path / "p.zarr") if as_path else store
    # a str is one hook point (it was taken letter by letter: "hook point 'h' is not in the store")
    one = probe_store(given, "head.output", n_folds=4)
    assert list(one) == ["head.output"]
    expected = probe_accuracy(store["head.output"], labels, n_folds=4)
    assert one["head.output"].fold_accuracies == expected.fold_accuracies
    # a pattern selects the hook points it matches (it was read as a hook point: a bare KeyError)
    layers = probe_store(given, ["d.?.output"], n_folds=4)
    assert list(layers) == ["d.0.output", "d.1.output"]
    for hp in layers:
        assert layers[hp].fold_accuracies == probe_accuracy(store[hp], labels, n_folds=4).fold_accuracies
    # in the order given, each once
    assert list(probe_store(given, ["head.output", "d.*", "d.1.output"], n_folds=4)) == \
        ["head.output", "d.0.output", "d.1.output"]


def test_probe_store_names_a_pattern_or_hook_point_the_store_lacks(tmp_path):
    from activationscope.errors import ArgumentTypeError, HookPointNotFoundError

    store, _ = _layered_store(tmp_path / "p.zarr")
    with pytest.raises(HookPointNotFoundError, match=r"pattern 'd\.\*\.outptu' matches no hook point of the store .*"
                                                     r"it has \['d\.0\.output', 'd\.1\.output', 'head\.output'\]"):
        probe_store(store, ["d.*.outptu"])
    with pytest.raises(HookPointNotFoundError, match=r"hook point 'd\.2\.output' is not in the store"):
        probe_store(store, "d.2.output")
    with pytest.raises(ArgumentTypeError, match=r"hook_points must be a str or a list of str .*got 3"):
        probe_store(store, ["d.0.output", 3])


def test_probe_store_of_a_mistyped_label_column_names_the_columns_there_are(tmp_path):
    # each hook point was skipped as "the row table has no labelled 'lable' column", naming neither the
    # columns there are nor the one meant
    store, _ = _layered_store(tmp_path / "p.zarr")
    got = probe_store(store, "d.0.output", label_column="lable")
    assert dict(got) == {} and got.skipped == {
        "d.0.output": "the row table has no labelled 'lable' column; its columns are ['sample_id', 'batch', 'label']; "
                      "did you mean ['label'] for 'lable'?; pass one of them as the label column (label_column=; command "
                      "line: --label-column)"}
    assert "d.0.output" in probe_store(store, "d.0.output", label_column="label")


def test_probe_store_of_a_label_column_without_labels_says_so(tmp_path):
    # the column is there, every label -1: the reason said "did you mean ['label'] for 'label'?; pass
    # label_column= one of them", the column it was given
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with acs.ActivationScope(store=str(tmp_path / "p.zarr")).track(model) as tracker, torch.no_grad():
        tracker.set_batch(label=[-1] * 8)
        model(torch.randn(8, 4))
    got = probe_store(str(tmp_path / "p.zarr"), "0.output", label_column="label")
    assert dict(got) == {} and got.skipped == {
        "0.output": "the row table has no labelled 'label' column; every sample's 'label' is missing, -1, -100 or "
                    "empty"}


def test_sentence_rows_of_a_pattern_needs_exactly_one_hook_point(tmp_path):
    from activationscope.errors import ArgumentValueError

    store, labels = _layered_store(tmp_path / "p.zarr")
    x, got = sentence_rows(store, "head.*")                      # matches head.output only
    assert torch.equal(x, store["head.output"].double()) and got == labels
    with pytest.raises(ArgumentValueError, match=r"hook_point must select one hook point, got 'd\.\*', which matches "
                                                 r"\['d\.0\.output', 'd\.1\.output'\]; call once per hook point"):
        sentence_rows(store, "d.*")


@pytest.mark.parametrize("bad, cls, match", [
    (0, ArgumentValueError, r"batch_size must be a positive int \(rows read per batch\), got 0"),
    (-8, ArgumentValueError, r"batch_size must be a positive int \(rows read per batch\), got -8"),
    (2.5, ArgumentTypeError, r"batch_size must be an int \(rows read per batch\), got 2\.5 \(float\)"),
    (True, ArgumentTypeError, r"batch_size must be an int \(rows read per batch\), got True \(bool\)"),
])
def test_sentence_rows_names_a_batch_size_it_cannot_read_by(tmp_path, bad, cls, match):
    # batch_size=0 was refused by the DataLoader inside, a ValueError of torch's own
    store, labels = _layered_store(tmp_path / "p.zarr")
    for read in (sentence_rows, labelled_rows):
        with pytest.raises(cls, match=match):
            read(store, "head.output", batch_size=bad)
    x, got = sentence_rows(store, "head.output", batch_size=np.int64(1))
    assert torch.equal(x, store["head.output"].double()) and got == labels


def test_pool_by_sample_refuses_ids_that_do_not_pair_with_the_rows():
    from activationscope.analysis.pooling import pool_by_sample
    from activationscope.errors import ArgumentValueError

    rows = torch.arange(10.0).reshape(5, 2)
    ids, pooled = pool_by_sample(rows, torch.tensor([3, 1, 3, 1, 1]))
    assert ids.tolist() == [1, 3] and torch.allclose(pooled, torch.tensor([[16 / 3, 19 / 3], [2.0, 3.0]], dtype=torch.float64))
    for bad in (torch.tensor([0, 0, 1]), torch.zeros(5, 1, 1, dtype=torch.long), torch.zeros(4, 2, dtype=torch.long),
                torch.zeros(5, 0, dtype=torch.long)):
        with pytest.raises(ArgumentValueError, match=r"sample_ids must be 1-D with one id per row of rows \(5 rows\), "
                                                     rf"or 2-D .*got shape {re.escape(str(tuple(bad.shape)))}"):
            pool_by_sample(rows, bad)


def test_pool_by_sample_keeps_samples_of_different_ranks_apart(tmp_path):
    # the ids of a two-rank store count per rank: (rank, sample_id) names a sample, and the
    # pooled rows are each sample's own mean, as sentence_rows gives them
    from activationscope.analysis.pooling import pool_by_sample

    store = _two_rank_store(tmp_path / "ranks.zarr")
    tokens = store.row_table("token")
    rank, sid, batch = (torch.tensor(tokens.column(c).to_pylist()) for c in ("rank", "sample_id", "batch"))
    rows = store["layer.output"]
    keys, pooled = pool_by_sample(rows, torch.stack([rank, sid], 1))
    assert len(keys) == 24 and keys.tolist() == [list(k) for k in sorted({(r, s) for r, s in zip(rank.tolist(), sid.tolist())})]
    for (r, s), got in zip(keys.tolist(), pooled):
        want = rows[(rank == r) & (sid == s)].double().mean(0)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # the same rows keyed as sentence_rows keys them, (rank, batch, sample_id): the same means
    x, _ = sentence_rows(store, "layer.output")
    keys3, pooled3 = pool_by_sample(rows, torch.stack([rank, batch, sid], 1))
    order = list(dict.fromkeys(zip(rank.tolist(), batch.tolist(), sid.tolist())))
    torch.testing.assert_close(pooled3[[keys3.tolist().index(list(k)) for k in order]], x, rtol=1e-12, atol=1e-12)


def test_steps_of_one_sample_stay_in_one_fold(tmp_path):
    # a generation-like capture: each batch of samples is fed 4 times, the later forwards as
    # set_batch(same_samples=True) steps, the label given again each step. The labels are
    # random, so a probe that tests a sample it trained on (another step of it) scores far
    # above chance; one that keeps every step of a sample in one fold scores as a probe of
    # one row per sample (identical steps: the same mean loss, the same folds)
    from activationscope.analysis.probes import _fold_accuracies, _group_folds, choose_folds

    n, steps = 40, 4
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 50, (n, 5), generator=gen)
    mask = torch.arange(5)[None, :] < torch.randint(1, 6, (n, 1), generator=gen)
    labels = torch.randint(0, 2, (n,), generator=gen)
    model = Encoder(d_model=12).eval()
    scope = acs.ActivationScope(store=str(tmp_path / "g.zarr"))
    with scope.track(model, include=["layer", "head"]) as tracker, torch.no_grad():
        for b in range(0, n, 10):
            for step in range(steps):
                tracker.set_batch(attention_mask=mask[b:b + 10], label=labels[b:b + 10], same_samples=step > 0)
                model(ids[b:b + 10] * mask[b:b + 10])
    store = acs.open_store(str(tmp_path / "g.zarr"))
    assert store.n_samples == n * steps
    results = probe_store(store, n_folds=5)
    for hp in ("head.output", "layer.output"):
        x, got = sentence_rows(store, hp)
        assert len(x) == n * steps
        first = [i for i in range(len(x)) if i % (10 * steps) < 10]  # the first forward of each batch
        # the folds of the steps are those of one row per sample (the stratified group k-fold
        # looks at each sample's class shares only), each sample's steps in its sample's fold
        y = torch.tensor(got)
        sample = [(i // (10 * steps)) * 10 + i % 10 for i in range(len(x))]
        folds = _group_folds(y, sample, 5, 0)
        one = _group_folds(y[first], [sample[i] for i in first], 5, 0)
        assert [sorted(sample[i] for i in f.tolist()) for f in folds] == \
            [sorted(sample[first[i]] for i in f.tolist() for _ in range(steps)) for f in one]
        once = _fold_accuracies(x[first].double(), y[first], one, 2, 1e-2, 100)
        # (a probe of the steps as unrelated samples: 0.73 and 0.67 here)
        assert results[hp].fold_accuracies == pytest.approx(once, abs=1e-9)
        assert results[hp].n_samples == n * steps and results[hp].n_groups == n
    from activationscope.analysis.report import write_report

    page = write_report(store, tmp_path / "rep", probes=results).read_text()
    assert ("5-fold stratified group cross-validation (the rows of a sample kept in one fold), 40 labelled samples "
            "in 160 rows, 2 classes, chance") in page
    # folds come from the samples of the smallest class, not its rows
    y = [0] * 12 + [1] * 28
    groups = [i // 4 for i in range(40)]
    assert choose_folds(y, 5, groups) == (3, "3-fold instead of 5: the smallest class (0) has 3 labelled samples")
    assert choose_folds(y, 5) == (5, "")
    # groups whose rows differ in label (ids given again to other samples) are not samples: rows are
    assert choose_folds([0, 1] * 20, 5, [i // 4 for i in range(40)]) == (5, "")


class _Context(torch.nn.Module):
    """Token rows that carry their sentence: each token's embedding plus 3x the sentence mean."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, 16)
        self.mix = torch.nn.Identity()

    def forward(self, ids):
        e = self.embed(ids)
        return self.mix(e + 3 * e.mean(1, keepdim=True))


def _tagged_store(tmp_path, columns):
    """A store of ``_Context``'s token rows, 8 forwards of 8 sentences of 6 tokens, each forward's
    per-token columns ``columns(generator, ids)``."""
    model = _Context().eval()
    gen = torch.Generator().manual_seed(0)
    scope = acs.ActivationScope(store=str(tmp_path / "tok.zarr"))
    with scope.track(model, include=["mix"]) as tracker, torch.no_grad():
        for _ in range(8):
            ids = torch.randint(0, 50, (8, 6), generator=gen)
            tracker.set_batch(attention_mask=torch.ones(8, 6, dtype=torch.bool), **columns(gen, ids))
            model(ids)
    return acs.open_store(str(tmp_path / "tok.zarr"))


def test_tokens_of_one_sentence_with_one_per_token_label_stay_in_one_fold(tmp_path):
    # a per-token column whose value is one random tag per sentence: a probe that trains on
    # some tokens of a sentence and tests on others learns the sentence (0.62 here, chance
    # 0.53); with each sentence's tokens in one fold it has nothing to learn
    store = _tagged_store(tmp_path, lambda gen, ids: dict(
        tag=torch.randint(0, 2, (8, 1), generator=gen).expand(8, 6), word=ids % 2))
    result = probe_store(store, label_column="tag", n_folds=5)["mix.output"]
    assert result.accuracy < 0.53125
    assert (result.n_samples, result.n_groups, result.chance) == (384, 64, 0.53125)
    # a per-token label that differs within a sentence: its tokens stay in one fold too
    assert probe_store(store, label_column="word", n_folds=5)["mix.output"].n_groups == 64


def test_tokens_of_one_sentence_with_per_token_labels_that_differ_stay_in_one_fold(tmp_path):
    # a random tag per sentence on its first 5 tokens, the other tag on its last: the tags
    # differ within each sentence, and a probe that trains on some tokens of a sentence and
    # tests on others learns the sentence (0.575 when folded token by token, chance 0.521)
    def tags(gen, ids):
        s = torch.randint(0, 2, (8, 1), generator=gen)
        return dict(tag=torch.cat([s.expand(8, 5), 1 - s], 1))

    store = _tagged_store(tmp_path, tags)
    result = probe_store(store, label_column="tag", n_folds=5)["mix.output"]
    assert result.chance == pytest.approx(200 / 384)
    assert result.accuracy < 0.52
    assert (result.n_samples, result.n_groups, result.n_folds, result.note) == (384, 64, 5, "")
    # each sentence's 6 token rows (in row order) are in one fold, and each fold holds 12 or 13
    from activationscope.analysis.probes import _group_folds

    x, labels, _, groups = _labelled_rows(store, "mix.output", "tag")
    units = [i // 6 for i in range(384)]
    assert len(set(groups)) == 64 and all(groups[i] == groups[6 * (i // 6)] for i in range(384))
    folds = _group_folds(torch.tensor(labels), units, 5, 0)
    assert sorted(len(f) for f in folds) == [72, 78, 78, 78, 78]
    assert all({i // 6 for i in f.tolist()}.isdisjoint(j // 6 for j in g.tolist())
               for a, f in enumerate(folds) for g in folds[a + 1:])
    # folds are bounded by the sentences holding each tag: 3 sentences of tag 0, 2 of tag 1
    y = [0, 0, 1] + [0, 1] + [0, 0] + [1, 1] + [0, 0]
    sentence = [0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert choose_folds(y, 5, sentence) == (
        3, "3-fold instead of 5: class 1 is in 3 of the 5 samples, and a sample's rows stay in one fold")
    gen = torch.Generator().manual_seed(1)
    r = probe_accuracy(torch.randn(11, 3, generator=gen), y, n_folds=3, groups=sentence)
    assert (r.n_folds, r.n_groups, r.n_samples) == (3, 5, 11)
    with pytest.raises(ArgumentValueError, match=r"smallest class's size \(3 samples\), got 4"):
        probe_accuracy(torch.randn(11, 3, generator=gen), y, n_folds=4, groups=sentence)


def test_group_folds_are_those_of_scikit_learn():
    # the stratified group k-fold of scikit-learn, its samples taken in order (shuffle=False):
    # the same test folds, for groups of one label and of several
    sklearn = pytest.importorskip("sklearn.model_selection")
    import warnings

    from activationscope.analysis.probes import _group_folds

    rng = np.random.default_rng(0)
    checked = 0
    for t in range(120):
        n_groups, k, c = int(rng.integers(4, 40)), int(rng.integers(2, 6)), int(rng.integers(2, 4))
        units = np.repeat(np.arange(n_groups), rng.integers(1, 8, n_groups))
        y = rng.integers(0, c, len(units)) if t % 2 else rng.integers(0, c, n_groups)[units]
        if len(np.unique(y)) < c or min(len(set(units[y == v])) for v in range(c)) < k:
            continue
        ours = _group_folds(torch.tensor(y), units.tolist(), k, 0, order=torch.arange(n_groups))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (a class with fewer rows than folds)
            theirs = [np.sort(test) for _, test in sklearn.StratifiedGroupKFold(k).split(y, y, units)]
        assert [f.tolist() for f in ours] == [f.tolist() for f in theirs]
        # shuffled by the seed: deterministic, every fold holding rows
        shuffled = _group_folds(torch.tensor(y), units.tolist(), k, 7)
        assert [f.tolist() for f in shuffled] == [f.tolist() for f in _group_folds(torch.tensor(y), units.tolist(), k, 7)]
        assert all(len(f) for f in shuffled)
        checked += 1
    assert checked > 80


def test_token_rows_of_a_sample_in_several_forwards_stay_in_one_fold(tmp_path):
    # the same sentences again in later forwards (set_batch(same_samples=True), the steps of a
    # generation) with a per-token label: their token rows were grouped per forward, so a
    # probe trained on a sentence's tokens in one step and tested on them in another (0.67
    # here, chance 0.54); each sentence is now one sample in every step, as the one-step probe
    stores = {}
    for steps in (1, 3):
        model = _Context().eval()
        gen = torch.Generator().manual_seed(0)
        scope = acs.ActivationScope(store=str(tmp_path / f"s{steps}.zarr"))
        with scope.track(model, include=["mix"]) as tracker, torch.no_grad():
            for _ in range(4):
                ids = torch.randint(0, 50, (8, 6), generator=gen)
                s = torch.randint(0, 2, (8, 1), generator=gen)
                tag = torch.cat([s.expand(8, 5), 1 - s], 1)
                for step in range(steps):
                    tracker.set_batch(attention_mask=torch.ones(8, 6, dtype=torch.bool), tag=tag,
                                      same_samples=step > 0)
                    model(ids)
        stores[steps] = acs.open_store(str(tmp_path / f"s{steps}.zarr"))
    _, _, _, groups = _labelled_rows(stores[3], "mix.output", "tag")
    assert len(groups) == 3 * 192 and len(set(groups)) == 32
    # row r of a forward: sample r // 6 of that batch, the same in each of its 3 steps
    assert all(groups[i] == groups[(i // 144) * 144 + i % 48] for i in range(len(groups)))
    once, again = (probe_store(stores[k], label_column="tag")["mix.output"] for k in (1, 3))
    assert (again.n_samples, again.n_groups, once.n_groups) == (576, 32, 32)
    assert again.fold_accuracies == pytest.approx(once.fold_accuracies, abs=1e-9)
    assert again.chance == once.chance


@pytest.mark.parametrize("n_classes", [2, 3])
def test_the_probe_is_scikit_learns_logistic_regression_at_the_c_its_docstring_gives(n_classes):
    """probe_accuracy's l2 is C = 1 / (l2 * n_train) of scikit-learn's binary logistic regression
    with 2 classes and C = 1 / (2 * l2 * n_train) of its multinomial one with more: the decision
    boundaries over a fine grid of test points agree with the C given, not with the other one."""
    linear_model = pytest.importorskip("sklearn.linear_model")
    from activationscope.analysis.probes import _fit_predict

    g = torch.Generator().manual_seed(0)
    n, l2 = 60, 0.05
    # (classes of unequal sizes: the penalty then moves the boundaries, not only the slopes)
    y = torch.tensor([0] * 30 + [1] * 20 + [2] * 10)[:n] if n_classes == 3 else (torch.arange(n) % 4 == 0).long()
    x = (y.double() * 1.5 + torch.randn(n, generator=g, dtype=torch.float64)).unsqueeze(1)
    grid = torch.linspace(-3, 3 * n_classes, 2000, dtype=torch.float64).unsqueeze(1)
    ours = _fit_predict(x.clone(), y, grid.clone(), n_classes, l2, 500).numpy()
    mean, std = x.mean(0), x.std(0, correction=0)
    xs, gs = ((x - mean) / std).numpy(), ((grid - mean) / std).numpy()

    def theirs(c):
        clf = linear_model.LogisticRegression(C=c, max_iter=10000, tol=1e-12).fit(xs, y.numpy())
        return clf.predict(gs)

    documented = 1 / (l2 * n) if n_classes == 2 else 1 / (2 * l2 * n)
    other = documented / 2 if n_classes == 2 else documented * 2
    assert (ours != theirs(documented)).sum() <= 2
    assert (ours != theirs(other)).sum() > 10  # (the grid sees the boundaries move)


class _Spectrum(torch.nn.Module):
    """Complex activations: a Linear layer's outputs as the real part, their squares as the imaginary one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 3)
        self.cx = torch.nn.Identity()

    def forward(self, x):
        h = self.lin(x)
        return self.cx(torch.complex(h, 10 * h * h))


def test_complex_rows_are_pooled_whole_and_not_probed_as_their_real_part(tmp_path):
    # the probe and the pooling cast complex rows to float64: the imaginary parts were dropped
    # (a torch UserWarning the only sign) and a probe of the real parts was reported
    from activationscope.analysis.pooling import pool_by_sample
    from activationscope.errors import ArgumentTypeError

    rows = torch.tensor([[1 + 2j], [3 - 4j], [5j]], dtype=torch.complex64)
    ids, pooled = pool_by_sample(rows, torch.tensor([7, 7, 8]))
    assert ids.tolist() == [7, 8]
    assert pooled.dtype == torch.complex128 and pooled[:, 0].tolist() == [2 - 1j, 5j]

    with pytest.raises(ArgumentTypeError, match=r"x must be real, got torch.complex64.*torch.view_as_real\(x\)"):
        probe_accuracy(torch.randn(20, 3, dtype=torch.complex64), [0, 1] * 10)

    model = _Spectrum()
    with acs.ActivationScope(store=tmp_path / "s.zarr").track(model, include=["cx"]) as tr, torch.no_grad():
        for _ in range(4):
            tr.set_batch(label=torch.tensor([0, 1] * 5))
            model(torch.randn(10, 3))
    res = probe_store(tmp_path / "s.zarr")
    assert "cx.output" not in res
    assert res.skipped["cx.output"].startswith("its rows are complex (complex64): a probe takes real values")


def test_sentence_rows_of_complex_rows_keep_their_imaginary_parts(tmp_path):
    # sentence_rows cast its result, and labelled_rows its token rows, to float64: the imaginary
    # parts were dropped (a torch UserWarning the only sign)
    from activationscope.analysis.pooling import labelled_rows, sentence_rows
    from activationscope.store import StoreWriter

    x = torch.complex(torch.arange(24.0).view(4, 3, 2), -torch.arange(24.0).view(4, 3, 2) ** 2)  # 4 samples x 3 tokens
    w = StoreWriter(tmp_path / "s.zarr")
    w.open_array("t.output", (2,), torch.complex64, "token").append(x.reshape(12, 2))
    w.open_array("s.output", (2,), torch.complex64, "sample").append(x[:, 0])
    w.add_batch(4, list(range(4)), torch.ones(4, 3, dtype=torch.bool), {"label": torch.tensor([0, 1, 0, 1])})
    w.close()
    want = {"t.output": x.to(torch.complex128).mean(1), "s.output": x[:, 0].to(torch.complex128)}
    for hp, rows in want.items():
        got, labels = sentence_rows(tmp_path / "s.zarr", hp)
        assert got.dtype == torch.complex128 and labels == [0, 1, 0, 1]
        assert torch.equal(got, rows), hp
        assert torch.equal(labelled_rows(tmp_path / "s.zarr", hp)[0].to(torch.complex128), rows), hp
