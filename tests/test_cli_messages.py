"""What the command line says about stores, paths and files: named for what they are."""

from __future__ import annotations

import numpy as np
import torch

import activationscope as acs
from activationscope.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_info_calls_its_size_ratio_data_over_disk(tmp_path, capsys):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(model):
        model(torch.randn(8, 4))
    code, out, _ = run(capsys, "info", str(tmp_path / "s.zarr"))
    assert code == 0
    assert "(compression ratio" not in out and "data/disk" in out and "not a compression ratio" in out


import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402


def test_debug_before_the_command_shows_the_traceback(tmp_path, capsys):
    for argv in (["--debug", "info", str(tmp_path / "nope.zarr")], ["info", str(tmp_path / "nope.zarr"), "--debug"]):
        code, _, err = run(capsys, *argv)
        assert code == 1 and "Traceback" in err and "does not exist" in err, argv
    code, _, err = run(capsys, "info", str(tmp_path / "nope.zarr"))
    assert code == 1 and "Traceback" not in err


@pytest.fixture
def failing_module(user_package):
    """``failnets.nets``: a Linear 6->4 that raises after ``ok`` batches (first, third, good);
    the data: 40 samples of 6 features."""
    return user_package("failnets", """
        import torch

        class FailsAfter(torch.nn.Module):
            def __init__(self, ok_batches):
                super().__init__()
                torch.manual_seed(0)
                self.lin = torch.nn.Linear(6, 4)
                self.ok = ok_batches
            def forward(self, x):
                y = self.lin(x)
                if self.ok == 0:
                    raise RuntimeError("bad batch")
                self.ok -= 1
                return y

        def first():
            return FailsAfter(0)
        def third():
            return FailsAfter(2)
        def good():
            return FailsAfter(-1)
    """, data=(40, 6, 0))


def test_advice_to_exclude_a_module_is_given_as_the_flag(user_package, tmp_path, capsys, recwarn):
    """The warning about a tracked module that recorded nothing ends with advice to leave it
    out; the command line gives it as --exclude, not as the keyword argument exclude=."""
    x = user_package("idlenets", """
        import torch

        class WithIdle(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.used = torch.nn.Linear(6, 3)
                self.idle = torch.nn.Linear(3, 3)
            def forward(self, x):
                return self.used(x)

        def make():
            return WithIdle()
    """, data=(16, 6, 0))
    code, _, err = run(capsys, "capture", "--model", "idlenets.nets:make", "--data", str(x),
                       "--out", str(tmp_path / "s.zarr"), "--no-progress")
    assert code == 0, err
    from activationscope import cli

    caught = next(w for w in recwarn if "recorded nothing" in str(w.message))   # as the command prints it:
    warning = cli._warning_formatter("capture")(caught.message, caught.category, caught.filename, caught.lineno)
    warning = warning.rstrip("\n")
    assert warning.startswith("activationscope capture: warning: ") and "'idle'" in warning
    assert warning.endswith("or --exclude them") and "exclude=" not in warning


def test_cli_spelling_keeps_keyword_pairs_and_translates_lone_exclude():
    from activationscope.cli import _cli_spelling

    assert _cli_spelling("pass storage_dtype= one of those, or exclude= the module of 'a.output'") == \
        "pass storage_dtype= one of those, or --exclude the module of 'a.output'"
    kept = "resume with the same include=/exclude= as the first run (CLI: --include 0)"
    assert _cli_spelling(kept) == kept


def _capture(capsys, factory, x, out, *extra):
    return run(capsys, "capture", "--model", f"failnets.nets:{factory}", "--data", str(x), "--out", str(out),
               "--batch-size", "8", "--no-progress", *extra)


def test_a_capture_failing_before_any_commit_leaves_no_store(failing_module, tmp_path, capsys):
    out = tmp_path / "run.zarr"
    code, _, err = _capture(capsys, "first", failing_module, out)
    assert code == 1 and "bad batch" in err and "no row was committed, so the new store" in err and "was removed" in err
    assert not out.exists()
    code, stdout, err = _capture(capsys, "good", failing_module, out)     # the corrected rerun: no --overwrite
    assert code == 0, err
    assert acs.open_store(str(out)).n_samples == 40
    # an empty folder that was there before stays, empty
    (tmp_path / "mine").mkdir()
    code, _, err = _capture(capsys, "first", failing_module, tmp_path / "mine")
    assert code == 1 and (tmp_path / "mine").is_dir() and list((tmp_path / "mine").iterdir()) == []


def test_a_capture_failing_after_commits_keeps_them(failing_module, tmp_path, capsys):
    out = tmp_path / "run.zarr"
    code, _, err = _capture(capsys, "third", failing_module, out, "--shard-bytes", "128", "--chunk-rows", "8")
    assert code == 1 and "keeps the rows committed before" in err and "--resume" in err
    store = acs.open_store(str(out))
    assert store.status == "incomplete" and store.n_samples == 16


@pytest.mark.parametrize("what", ["file", "folder", "zarr"])
def test_out_that_is_not_a_store_is_named_and_never_offered_for_overwrite(failing_module, tmp_path, capsys, what):
    target = tmp_path / "target"
    if what == "file":
        target.write_text("precious")
        said = "is a file (8 bytes)"
    elif what == "folder":
        target.mkdir()
        (target / "notes.txt").write_text("precious")
        said = "is a folder that is not a store (1 entry: 'notes.txt')"
    else:
        import zarr

        zarr.open_group(str(target), mode="w").attrs["mine"] = 1
        said = "is a Zarr node that is not an activationscope store"
    before = sorted(p.name for p in target.rglob("*")) if target.is_dir() else target.read_text()
    for extra in ([], ["--overwrite"]):
        code, _, err = _capture(capsys, "good", failing_module, target, *extra)
        assert code == 1 and said in err and "choose another path" in err, err
        assert "pass --overwrite" not in err
    after = sorted(p.name for p in target.rglob("*")) if target.is_dir() else target.read_text()
    assert after == before


def test_model_folder_that_does_not_exist(failing_module, tmp_path, capsys):
    code, _, err = run(capsys, "capture", "--model", "./no-such-dir", "--data", str(failing_module), "--out",
                       str(tmp_path / "o.zarr"))
    assert code == 1 and "--model './no-such-dir' does not exist: no such folder" in err
    assert not (tmp_path / "o.zarr").exists()


def test_text_file_named_npy(failing_module, tmp_path, capsys):
    fake = tmp_path / "sentences.npy"
    fake.write_text("a first sentence\na second one\n")
    code, _, err = _capture(capsys, "good", fake, tmp_path / "o.zarr")
    assert code == 1 and "sentences.npy' is a text file" in err and "pickle" not in err.lower()


@pytest.mark.parametrize("content, kind", [(b"a sentence\n", "is a text file"), (bytes(range(200, 256)) * 4,
                                                                                   "is not a torch file")])
def test_data_named_pt_that_is_not_a_torch_file(failing_module, tmp_path, capsys, content, kind):
    fake = tmp_path / "batch.pt"
    fake.write_bytes(content)
    code, _, err = _capture(capsys, "good", fake, tmp_path / "o.zarr")
    assert code == 1 and f"batch.pt' {kind}: a file of torch.save starts with" in err
    assert "Traceback" not in err and not (tmp_path / "o.zarr").exists()


def test_data_pt_holding_a_tensor_is_captured(failing_module, tmp_path, capsys):
    x = tmp_path / "x.pt"
    torch.save(torch.randn(16, 6), x)
    code, out, err = _capture(capsys, "good", x, tmp_path / "o.zarr")
    assert code == 0, err
    assert acs.open_store(tmp_path / "o.zarr").n_samples == 16


def test_export_hf_from_the_command_line(failing_module, tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    out = tmp_path / "run.zarr"
    assert _capture(capsys, "good", failing_module, out)[0] == 0
    code, stdout, err = run(capsys, "export", str(out), "--format", "hf", "--out", str(tmp_path / "hf"),
                            "--hook-points", "lin.output")
    assert code == 0, err
    assert "load_from_disk" in stdout
    got = datasets.load_from_disk(str(tmp_path / "hf")).with_format("torch")[:]["lin.output"]
    assert torch.equal(got, acs.open_store(str(out))["lin.output"])
    code, _, err = run(capsys, "export", str(out), "--format", "parquet", "--out", str(tmp_path / "hf"))
    assert code == 1 and "is a folder" in err


def test_help_does_not_import_torch():
    code = ("import sys\nfrom activationscope.cli import main\n"
            "for argv in (['--help'], ['capture', '--help'], ['report', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print('torch' in sys.modules, 'numpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False False"


def test_export_keeps_a_file_that_is_not_an_export_and_report_names_a_file_out(failing_module, tmp_path, capsys):
    out = tmp_path / "run.zarr"
    assert _capture(capsys, "good", failing_module, out)[0] == 0
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    for fmt in ("arrow", "parquet"):
        code, _, err = run(capsys, "export", str(out), "--format", fmt, "--out", str(notes))
        assert code == 1 and f"notes.txt' exists and is not an earlier {fmt} export" in err and "--overwrite" in err
        assert notes.read_text() == "my notes"
    code, _, err = run(capsys, "export", str(out), "--format", "arrow", "--out", str(notes), "--overwrite")
    assert code == 0, err
    notes.write_text("my notes")
    code, _, err = run(capsys, "report", str(out), "--out", str(notes))
    assert code == 1 and "notes.txt' is a file; the report is a folder" in err and "Errno" not in err
    assert notes.read_text() == "my notes"


def test_sample_rows_pattern_matching_nothing_is_refused(failing_module, tmp_path, capsys):
    out = tmp_path / "run.zarr"
    code, _, err = _capture(capsys, "good", failing_module, out, "--sample-rows", "nomatch*")
    assert code == 1 and "--sample-rows 'nomatch*' matches no tracked hook point" in err
    assert "[lin.output]" in err and "no row was committed" in err and not out.exists()
    assert _capture(capsys, "good", failing_module, out)[0] == 0
    before = acs.open_store(str(out))["lin.output"].clone()
    code, _, err = _capture(capsys, "good", failing_module, out, "--overwrite", "--token-rows", "lin.out",
                            "--batch-size", "40")
    assert code == 1 and "--token-rows 'lin.out' matches no tracked hook point" in err and "left as it was" in err
    store = acs.open_store(str(out))
    assert store.status == "complete" and store.n_samples == 40 and torch.equal(store["lin.output"], before)


@pytest.mark.parametrize("extra", [[], ["--reduce", "mean"]])
def test_sample_rows_pattern_matching_nothing_is_refused_on_a_full_resume(failing_module, tmp_path, capsys, extra):
    """Nothing left to capture (no forward runs): the pattern is checked against the stored
    hook points, and the store is left as it was."""
    out = tmp_path / "run.zarr"
    assert _capture(capsys, "good", failing_module, out)[0] == 0
    before = acs.open_store(str(out))["lin.output"].clone()
    files = sorted((p.relative_to(out), p.read_bytes()) for p in out.rglob("*") if p.is_file())
    code, _, err = _capture(capsys, "good", failing_module, out, "--resume", "--sample-rows", "nope", *extra)
    assert code == 1 and "--sample-rows 'nope' matches no tracked hook point" in err and "[lin.output]" in err
    assert "token_rows=" not in err
    assert sorted((p.relative_to(out), p.read_bytes()) for p in out.rglob("*") if p.is_file()) == files
    store = acs.open_store(str(out))
    assert store.status == "complete" and store.n_samples == 40 and torch.equal(store["lin.output"], before)
    code, _, err = _capture(capsys, "good", failing_module, out, "--resume", "--token-rows", "lin.output", *extra)
    assert code == 0, err


def test_token_rows_without_a_mask_is_refused_in_cli_words(failing_module, tmp_path, capsys):
    code, _, err = _capture(capsys, "good", failing_module, tmp_path / "o.zarr", "--token-rows", "lin.output")
    assert code == 1 and "set to token rows by --token-rows" in err and "leave it out of --token-rows" in err
    assert "set_batch" not in err and "token_rows=" not in err


def test_export_drop_last_needs_context_size(failing_module, tmp_path, capsys):
    out = tmp_path / "run.zarr"
    assert _capture(capsys, "good", failing_module, out)[0] == 0
    code, _, err = run(capsys, "export", str(out), "--format", "hf", "--out", str(tmp_path / "x"), "--drop-last")
    assert code == 1 and "--drop-last applies only with --context-size (--format hf)" in err, err
    assert "drop_last" not in err and "context_size" not in err
    assert not (tmp_path / "x").exists()
    code, _, err = run(capsys, "export", str(out), "--format", "parquet", "--out", str(tmp_path / "x"), "--drop-last")
    assert code == 1 and "--drop-last has no effect for --format parquet: it applies to --format hf only" in err, err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("fmt, extra, option, applies", [
    ("hf", ["--overwrite"], "--overwrite", "--format parquet and --format arrow"),
    ("hf", ["--tensor-type", "fixed_size_list"], "--tensor-type", "--format parquet and --format arrow"),
    ("hf", ["--tensor-type", "fixed_shape_tensor"], "--tensor-type", "--format parquet and --format arrow"),
    ("arrow", ["--context-size", "4"], "--context-size", "--format hf"),
    ("parquet", ["--context-size", "4", "--drop-last"], "--context-size", "--format hf"),
])
def test_export_refuses_options_without_effect_for_the_format(failing_module, tmp_path, capsys, fmt, extra, option,
                                                               applies):
    """An option that does nothing for --format is refused, naming both, before anything is
    written (the store is not even opened: a missing store is not what is reported)."""
    out = tmp_path / "run.zarr"
    assert _capture(capsys, "good", failing_module, out)[0] == 0
    before = sorted(p.name for p in tmp_path.iterdir())
    target = tmp_path / "x"
    code, stdout, err = run(capsys, "export", str(out), "--format", fmt, "--out", str(target), *extra)
    assert code == 1 and stdout == "", err
    assert f"error: {option} has no effect for --format {fmt}: it applies to {applies} only" in err, err
    assert "nothing was written" in err and "option " not in err and "_" not in err.split("error:")[1].split(":")[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    code, _, err = run(capsys, "export", str(tmp_path / "missing.zarr"), "--format", fmt, "--out", str(target), *extra)
    assert code == 1 and f"{option} has no effect for --format {fmt}" in err and "does not exist" not in err, err


def test_export_hf_without_the_refused_options_still_writes(failing_module, tmp_path, capsys):
    pytest.importorskip("datasets")
    out = tmp_path / "run.zarr"
    assert _capture(capsys, "good", failing_module, out)[0] == 0
    code, stdout, err = run(capsys, "export", str(out), "--format", "hf", "--out", str(tmp_path / "hf"))
    assert code == 0 and "wrote" in stdout, err
    import datasets

    assert len(datasets.load_from_disk(str(tmp_path / "hf"))) == 40


def test_export_context_size_errors_in_cli_words(failing_module, tmp_path, capsys):
    pytest.importorskip("datasets")
    out = tmp_path / "run.zarr"
    assert _capture(capsys, "good", failing_module, out)[0] == 0
    code, _, err = run(capsys, "export", str(out), "--format", "hf", "--out", str(tmp_path / "hf"),
                       "--context-size", "7")
    assert code == 1 and "must be a multiple of --context-size 7 (remainder 5); pass --drop-last" in err, err
    assert "another --context-size" in err and "drop_last" not in err and "context_size" not in err
    code, _, err = run(capsys, "export", str(out), "--format", "hf", "--out", str(tmp_path / "hf"),
                       "--context-size", "41", "--drop-last")
    assert code == 1 and "--context-size 41 is more than the 40 rows" in err and "with --drop-last nothing" in err
    assert "pass a --context-size of at most 40" in err and "drop_last" not in err and "context_size" not in err


def test_demo_and_export_hf_errors_in_cli_words(failing_module, tmp_path, capsys):
    code, _, err = run(capsys, "demo", "--out", str(tmp_path / "d.zarr"), "--batch-size", "0", "--no-report")
    assert code == 1 and "--batch-size must be a positive int, got 0" in err and "batch_size" not in err, err
    pytest.importorskip("datasets")
    model = torch.nn.Sequential(torch.nn.Linear(3, 4))
    empty = tmp_path / "empty.zarr"
    with acs.ActivationScope(store=str(empty)).track(model):       # nothing committed yet
        model(torch.randn(2, 3))
        code, _, err = run(capsys, "export", str(empty), "--format", "hf", "--out", str(tmp_path / "hf"))
    assert code == 1 and "have no rows to export" in err and "(none committed)" in err, err
    assert "--format parquet and --format arrow write an empty table" in err and "export_parquet" not in err
    (tmp_path / "afile").write_text("keep")
    out = tmp_path / "run.zarr"
    assert _capture(capsys, "good", failing_module, out)[0] == 0
    code, _, err = run(capsys, "export", str(out), "--format", "hf", "--out", str(tmp_path / "afile"))
    assert code == 1 and "for --format hf, got an existing file" in err and "file_format" not in err, err


def test_report_errors_in_cli_words(failing_module, tmp_path, capsys):
    out = tmp_path / "run.zarr"
    assert _capture(capsys, "good", failing_module, out)[0] == 0
    code, _, err = run(capsys, "report", str(out), "--out", str(tmp_path / "r"), "--label-column", "nope")
    assert code == 1 and "--label-column 'nope' is not a column" in err and "label_column" not in err, err
    code, _, err = run(capsys, "report", str(out), "--out", str(out / "r"))
    assert code == 1 and f"--out '{out / 'r'}' is inside the store" in err and "out_dir" not in err, err
    site = tmp_path / "site"
    site.mkdir()
    (site / "index.html").write_text("mine")
    code, _, err = run(capsys, "report", str(out), "--out", str(site))
    assert code == 1 and f"--out '{site}' holds an index.html that is not" in err and "out_dir" not in err, err


def test_export_refuses_an_unknown_compression_naming_those_it_accepts(failing_module, tmp_path, capsys):
    import pyarrow.parquet as pq

    out = tmp_path / "run.zarr"
    assert _capture(capsys, "good", failing_module, out)[0] == 0
    before = sorted(p.name for p in tmp_path.iterdir())
    code, _, err = run(capsys, "export", str(out), "--format", "parquet", "--out", str(tmp_path / "x.parquet"),
                       "--compression", "lz99")
    assert code == 1
    assert ("error: --compression must be one of ['none', 'snappy', 'gzip', 'brotli', 'lz4', 'zstd'] for --format "
            "parquet, got 'lz99' (nothing was written)") in err, err
    code, _, err = run(capsys, "export", str(out), "--format", "arrow", "--out", str(tmp_path / "x.arrow"),
                       "--compression", "snappy")
    assert code == 1 and "--compression must be one of ['none', 'lz4', 'zstd'] for --format arrow" in err, err
    code, _, err = run(capsys, "export", str(out), "--format", "hf", "--out", str(tmp_path / "hf"),
                       "--compression", "zstd")
    assert code == 1 and "--compression has no effect for --format hf" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    code, _, err = run(capsys, "export", str(out), "--format", "parquet", "--out", str(tmp_path / "x.parquet"),
                       "--compression", "gzip")
    assert code == 0, err
    meta = pq.ParquetFile(tmp_path / "x.parquet").metadata
    assert meta.row_group(0).column(0).compression == "GZIP" and meta.num_rows == 40


def test_export_hf_twice_replaces_the_earlier_export_and_its_datasets_caches(failing_module, tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    out = tmp_path / "run.zarr"
    assert _capture(capsys, "good", failing_module, out)[0] == 0
    hf = tmp_path / "hf"
    assert run(capsys, "export", str(out), "--format", "hf", "--out", str(hf))[0] == 0
    datasets.load_from_disk(str(hf)).map(lambda row: {"y": 1})      # datasets writes cache-*.arrow into hf/
    assert list(hf.glob("cache-*.arrow"))
    code, stdout, err = run(capsys, "export", str(out), "--format", "hf", "--out", str(hf))
    assert code == 0 and "wrote" in stdout, err
    assert len(datasets.load_from_disk(str(hf))) == 40 and not list(hf.glob("cache-*.arrow"))
    (hf / "notes.txt").write_text("mine")
    code, _, err = run(capsys, "export", str(out), "--format", "hf", "--out", str(hf))
    assert code == 1 and "['notes.txt'], which the export did not write; it is left alone" in err, err
    assert (hf / "notes.txt").read_text() == "mine"


def test_an_overwrite_failing_before_any_commit_keeps_the_old_store_that_holds_no_row(failing_module, tmp_path,
                                                                                      capsys):
    # a store of an earlier run that holds no row (its data was empty) is the user's: --overwrite
    # failing on its first batch puts it back, and nothing removes it afterwards
    out = tmp_path / "old.zarr"
    model = torch.nn.Sequential(torch.nn.Linear(6, 4))
    with acs.ActivationScope(store=str(out)).track(model), torch.no_grad():
        model(torch.randn(0, 6))
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    code, _, err = _capture(capsys, "first", failing_module, out, "--overwrite")
    assert code == 1 and "bad batch" in err and "was removed" not in err and "kept as it was" in err, err
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert acs.open_store(str(out)).status == "complete"


def test_a_resume_refused_for_its_hook_points_names_the_flags(user_package, capsys):
    data = user_package("resnets", """
        import torch

        def mlp():
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    """, data=(40, 6, 0))
    code, _, _ = run(capsys, "capture", "--model", "resnets.nets:mlp", "--data", str(data), "--out", "r.zarr",
                     "--max-samples", "20", "--no-progress")
    assert code == 0
    before = acs.open_store("r.zarr")["2.output"].clone()
    code, _, err = run(capsys, "capture", "--model", "resnets.nets:mlp", "--data", str(data), "--out", "r.zarr",
                       "--resume", "--include", "2", "--no-progress")
    line = err.strip().splitlines()[-1]
    assert code == 1 and line.startswith("activationscope capture: error: cannot resume ")
    # the command's flags, not the Python keywords (it said "include=/exclude=/capture=")
    assert "resume with the same --include / --exclude / --capture as the first run" in line
    assert "include=" not in line
    store = acs.open_store("r.zarr")
    assert store.n_samples == 20 and torch.equal(store["2.output"], before)


def test_cli_spelling_turns_token_rows_advice_into_the_row_flags():
    # the library's token_rows={...} advice, printed by `capture`, is --sample-rows / --token-rows there
    from activationscope.cli import _cli_spelling
    from activationscope.capture import scope

    with pytest.warns(acs.CaptureWarning) as caught:
        scope._warn_2d_token_rows("embeddings.input.kw.input_ids", (10, 39))
        scope._warn_head_first_token_rows({"a.output": (2, 5, 5), "b'q.output": (2, 5, 5, 3)})
    first, second = (_cli_spelling(" ".join(str(w.message).split()), "capture") for w in caught)
    assert "token_rows" not in first + second
    assert "pass --sample-rows 'embeddings.input.kw.input_ids' (one row per sample), or --token-rows " \
           "'embeddings.input.kw.input_ids' to confirm token rows" in first
    assert """pass --sample-rows 'a.output' --sample-rows "b'q.output" (one row per sample""" in second
    assert second.endswith("; --token-rows instead confirms token rows")


def test_cli_spelling_of_overwrite_where_the_command_has_the_flag():
    from activationscope.cli import _cli_spelling

    lock = "write elsewhere (overwrite=True is refused while a writer holds the store); kept (overwrite replaces it only once"
    assert _cli_spelling(lock, "capture") == \
        "write elsewhere (--overwrite is refused while a writer holds the store); kept (--overwrite replaces it only once"
    assert _cli_spelling("files (overwrite does not allow it); or pass overwrite=True (--overwrite) to", "export") == \
        "files (--overwrite does not allow it); or pass --overwrite to"
    assert _cli_spelling(lock, "demo") == lock  # (the demo has no --overwrite)
    python = "run it again with overwrite=True (StoreWriter(..., overwrite=True) finishes it; store_options overwrite=True)"
    assert _cli_spelling(python, "capture") == \
        "run it again with --overwrite (StoreWriter(..., overwrite=True) finishes it; store_options overwrite=True)"


@pytest.mark.parametrize("command", ["report", "export-parquet", "export-hf"])
def test_an_output_folder_this_process_may_not_write_is_named_with_the_fix(capsys, tmp_path, monkeypatch, command):
    # a read-only folder (or file system): "[Errno 1] Operation not permitted: 'ro/rep'" named a
    # temporary file, or no argument, and no fix
    import os

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(model):
        model(torch.randn(8, 4))
    ro = tmp_path / "ro"
    ro.mkdir()
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if os.fspath(p).rstrip("/").endswith("ro")
                        and mode & os.W_OK else access(p, mode, **kw))
    out = ro / ("rep" if command == "report" else "x.parquet" if command == "export-parquet" else "hf")
    argv = (["report", str(tmp_path / "s.zarr"), "--out", str(out)] if command == "report" else
            ["export", str(tmp_path / "s.zarr"), "--format", command.split("-")[1], "--out", str(out)])
    code, _, err = run(capsys, *argv)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"--out '{out}'" in lines[0] and "is not writable by this process" in lines[0], lines[0]
    assert "nothing was written" in lines[0] and "you may write" in lines[0]
    assert list(ro.iterdir()) == []


def test_a_capture_whose_folder_cannot_be_created_says_nothing_was_written(capsys, tmp_path, monkeypatch):
    # "ro/x.zarr keeps the rows committed before" was said of a store that never existed
    x = tmp_path / "x.npy"
    np.save(x, np.zeros((4, 4), np.float32))
    import pathlib

    out = tmp_path / "ro" / "x.zarr"
    mkdir = pathlib.Path.mkdir

    def refused(self, *args, **kwargs):  # a read-only folder: creating the store's folder fails
        if self == out:
            raise PermissionError(1, "Operation not permitted", str(self))
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "mkdir", refused)
    code, _, err = run(capsys, "capture", "--model", "torch.nn:Identity", "--data", str(x), "--out", str(out),
                       "--no-progress")
    assert code == 1 and "Traceback" not in err
    assert "cannot create its folder" in err and "keeps the rows committed before" not in err, err
    assert err.strip().endswith(f"nothing was written at {out}") and not out.exists()


def test_an_interrupted_capture_says_what_is_kept_in_the_commands_flags(capsys, monkeypatch):
    # Ctrl-C during `capture --overwrite`: the note said "(overwrite replaces it only once ...)"
    from activationscope import cli

    def interrupted(args):
        e = KeyboardInterrupt()
        e.add_note("no row was committed, so the store that was at s.zarr is kept as it was (overwrite replaces it "
                   "only once the new capture commits)")
        raise e

    monkeypatch.setitem(cli._COMMANDS, "capture", interrupted)
    code, _, err = run(capsys, "capture", "--model", "m:f", "--data", "d.npy", "--out", "s.zarr")
    assert code == 130
    assert err == ("activationscope capture: interrupted; no row was committed, so the store that was at s.zarr is "
                   "kept as it was (--overwrite replaces it only once the new capture commits)\n")


def test_a_new_remote_store_that_could_not_be_written_is_not_said_to_keep_rows(monkeypatch):
    # `capture --out s3://...` without credentials: the lock could not be written, yet the error
    # ended "s3://bucket/q.zarr keeps the rows committed before" of a store that never existed
    from activationscope.analysis import capture_run
    from activationscope.errors import StoreError
    from activationscope.store import _lock

    def refused(self):
        raise StoreError("writing '.activationscope-writer.lock' to memory://acs-nocreds failed: Unable to locate "
                         "credentials")

    monkeypatch.setattr(_lock.WriterLock, "_acquire_marker", refused)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(StoreError) as info:
        capture_run.run_capture(model, capture_run.tensor_batches(torch.zeros(8, 4), 4), out="memory://acs-nocreds",
                                n_total=8, include=None, exclude=None, reductions=None, progress=False)
    notes = " ".join(getattr(info.value, "__notes__", ()))
    assert "keeps the rows committed before" not in notes and "nothing was committed at memory://acs-nocreds" in notes


def test_demo_help_says_where_the_report_goes(capsys):
    # "<store folder>/demo-report" read as a folder inside the store; the report is its sibling
    from activationscope import cli

    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "demo-report next to the store" in out and "<store folder>" not in out


def test_include_and_exclude_leaving_nothing_are_named_as_flags(capsys, tmp_path, user_package):
    # "include=['0', '2'] and exclude=['*'] leave no module" spoke Python to a command-line user
    x = user_package("leavenone", """
        import torch
        def mlp():
            return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    """, data=(4, 4, 0))
    code, _, err = run(capsys, "capture", "--model", "leavenone.nets:mlp", "--data", str(x), "--out",
                       str(tmp_path / "a.zarr"), "--include", "0,2", "--exclude", "*", "--no-progress")
    assert code == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "--include '0,2' and --exclude '*' leave no module" in err and "include=[" not in err, err
    from activationscope.cli import _cli_spelling

    assert _cli_spelling("include=None and exclude=['x'] leave no module of M to track") == \
        "--include '*' and --exclude 'x' leave no module of M to track"


def test_exclude_leaving_none_of_the_default_modules_does_not_name_an_include_never_given(capsys, tmp_path,
                                                                                         user_package):
    # without --include the error read "--include '<the default modules>' and --exclude '*' ...",
    # a flag the user never gave
    x = user_package("leavenodefault", """
        import torch
        def mlp():
            return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    """, data=(4, 4, 0))
    code, _, err = run(capsys, "capture", "--model", "leavenodefault.nets:mlp", "--data", str(x), "--out",
                       str(tmp_path / "a.zarr"), "--exclude", "*", "--no-progress")
    assert code == 1 and "Traceback" not in err, err
    assert "the modules tracked by default (" in err and "no --include given) and --exclude '*' leave no module" in err
    assert "--include '" not in err, err
    from activationscope.cli import _cli_spelling

    assert _cli_spelling("include=['a'] and exclude=['x'] leave no module of M", "capture", include_given=False) == \
        "the modules tracked by default ('a'; no --include given) and --exclude 'x' leave no module of M"


CLI_FULL_CHILD = """
import resource, signal, sys
from activationscope import cli
args = ["capture", "--model", "toymodels_full:mlp", "--data", "inputs.npy", "--out", "cli.zarr", "--overwrite",
        "--no-progress", "--batch-size", "64", "--shard-bytes", "1048576"]
if sys.argv[1] == "full":
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))
sys.exit(cli.main(args))
"""


def _cli_full_setup(tmp_path):
    """A user module ``toymodels_full`` (an MLP) and ``inputs.npy`` (2000 samples) in
    ``tmp_path``; the environment that lets a child process import both."""
    import os

    (tmp_path / "toymodels_full.py").write_text(
        "import torch\n"
        "def mlp():\n"
        "    torch.manual_seed(0)\n"
        "    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))\n")
    np.save(tmp_path / "inputs.npy", np.random.default_rng(0).standard_normal((2000, 64)).astype(np.float32))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.path.dirname(os.path.dirname(acs.__file__))])}


def _cli_full_run(tmp_path, env, how):
    """``CLI_FULL_CHILD`` in a child process: ``how`` "full" under a file size limit, "plain" without."""
    return subprocess.run([sys.executable, "-c", CLI_FULL_CHILD, how], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)


def test_an_overwrite_that_filled_the_disk_before_its_first_commit_does_not_claim_the_old_rows(tmp_path):
    # `capture --overwrite` over a whole store, and the file size limit is reached before the new
    # capture's first shard is written: the error ended "cli.zarr keeps its 2000 committed samples
    # (status complete)", the earlier capture's, as if this one had finished
    env = _cli_full_setup(tmp_path)
    first = _cli_full_run(tmp_path, env, "plain")
    assert first.returncode == 0, first.stderr
    before = acs.open_store(tmp_path / "cli.zarr")["2.output"].clone()
    full = _cli_full_run(tmp_path, env, "full")
    assert full.returncode == 1, full.stderr
    error = [line for line in full.stderr.splitlines() if line.startswith("activationscope capture: error:")]
    assert len(error) == 1 and "EFBIG" in error[0], full.stderr
    assert error[0].endswith(
        "; no row of this capture was committed, so the store that was at cli.zarr is kept as it was, with the "
        "rows of the capture that wrote it (--overwrite replaces it only once the new capture commits); once the "
        "cause is fixed, run the command again"), error[0]
    assert "committed samples" not in error[0] and "overwrite=True" not in error[0]
    kept = acs.open_store(tmp_path / "cli.zarr")
    assert kept.status == "complete" and kept.n_samples == 2000
    assert torch.equal(kept["2.output"], before)


def test_a_capture_that_filled_the_disk_says_its_failure_once(tmp_path):
    # the writer's error was printed three times: twice in a warning ("the store could not be fully
    # committed after StoreError('writing shard ...'): the store writer ... failed: writing shard
    # ...") that the close raised again for the same failure, then as the error
    env = _cli_full_setup(tmp_path)
    full = _cli_full_run(tmp_path, env, "full")
    assert full.returncode == 1, full.stderr
    assert full.stderr.count("File too large (EFBIG)") == 1, full.stderr
    assert "could not be fully committed" not in full.stderr, full.stderr
    # (the writer thread's failure reaches the command directly, or through "the store writer of
    # ... failed: ...", by when the capture's thread meets it)
    assert full.stderr.startswith("activationscope capture: error: "), full.stderr
    assert full.stderr.count("writing shard") == 1, full.stderr


def test_a_writer_error_in_capture_names_the_resume_flag():
    # a full disk during `capture`: the error said "resume=True continues from them", a keyword
    # argument the command does not take
    from activationscope.cli import _cli_spelling

    said = ("writing shard 's.zarr/acts/a/shard-1.tmp' failed: No space left on device (ENOSPC): free space there; "
            "rows committed before the failure stay readable (open_store), and resume=True continues from them once "
            "the cause is fixed")
    assert _cli_spelling(said, "capture").endswith(
        "rows committed before the failure stay readable (open_store), and --resume continues from them once the "
        "cause is fixed")
    assert _cli_spelling("StoreWriter(..., resume=True) failed", "capture") == "StoreWriter(..., resume=True) failed"
    assert "resume=True" in _cli_spelling(said, "export")  # (export has no --resume)


def test_a_capture_that_filled_the_disk_names_only_the_commands_flags(tmp_path):
    # the error said "and resume=True continues from them" and its note "(resume=True has nothing
    # to continue: ...)": notes were printed without the command's spelling
    env = _cli_full_setup(tmp_path)
    full = _cli_full_run(tmp_path, env, "full")
    assert full.returncode == 1, full.stderr
    assert "resume=True" not in full.stderr, full.stderr
    assert "and --resume continues from them once the cause is fixed" in full.stderr, full.stderr
    assert full.stderr.rstrip().endswith(
        "was removed (--resume has nothing to continue: once the cause is fixed, run the capture again without it)")
    assert not (tmp_path / "cli.zarr").exists()


@pytest.fixture
def bracket_module(user_package):
    """``bracketnets.nets.make``: a ModuleDict holding the keys 'a[1]' and 'a1' (a Linear 6->6
    each, called in turn); the data: 16 samples of 6 features."""
    return user_package("bracketnets", """
        import torch

        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(6, 6)
            def forward(self, x):
                return self.fc(x)

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                torch.manual_seed(0)
                self.d = torch.nn.ModuleDict({"a[1]": Block(), "a1": Block()})
            def forward(self, x):
                return self.d["a1"](self.d["a[1]"](x))

        def make():
            return Net()
    """, data=(16, 6, 0))


@pytest.mark.parametrize("flag, said", [
    ("--include", "include pattern 'd.a[1].*' selects ['d.a1.fc']; fnmatch reads '[...]' in it as a character class "
                  "(one of its characters): the modules whose names hold those brackets are ['d.a[1].fc'], which "
                  "--include 'd.a[[]1].*' selects"),
    ("--exclude", "exclude pattern 'd.a[1].*' leaves out ['d.a1.fc']; fnmatch reads '[...]' in it as a character "
                  "class (one of its characters): the modules whose names hold those brackets are ['d.a[1].fc'], "
                  "which --exclude 'd.a[[]1].*' leaves out"),
    ("--exclude-hook-points", "--exclude-hook-points pattern 'd.a[1].*' leaves out ['d.a1.fc.output', "
                              "'d.a1.output']; fnmatch reads '[...]' in it as a character class (one of its "
                              "characters): the hook points whose names hold those brackets are ['d.a[1].fc.output', "
                              "'d.a[1].output'], which --exclude-hook-points 'd.a[[]1].*' leaves out"),
    ("--sample-rows", "--sample-rows / --token-rows pattern 'd.a[1].*' selects ['d.a1.fc.output', 'd.a1.output']; "
                      "fnmatch reads '[...]' in it as a character class (one of its characters): the hook points "
                      "whose names hold those brackets are ['d.a[1].fc.output', 'd.a[1].output'], which "
                      "--sample-rows or --token-rows 'd.a[[]1].*' selects"),
])
def test_a_pattern_read_as_a_character_class_is_fixed_with_the_flag(bracket_module, tmp_path, capsys, recwarn,
                                                                     flag, said):
    # the warning named the fix as a keyword argument: include=['d.a[[]1].*'], token_rows={'d.a[[]1].*': ...},
    # and exclude_hook_points=['d.a[[]1].*'] as "--exclude-hook-points ['d.a[[]1].*'" (its list cut at the first ']')
    from activationscope import cli

    code, _, err = run(capsys, "capture", "--model", "bracketnets.nets:make", "--data", str(bracket_module),
                       "--out", str(tmp_path / "s.zarr"), "--no-progress", flag, "d.a[1].*")
    assert code == 0, err
    caught = [w for w in recwarn if "character class" in str(w.message)]
    assert len(caught) == 1, [str(w.message) for w in recwarn]
    w = caught[0]
    assert cli._warning_formatter("capture")(w.message, w.category, w.filename, w.lineno) == \
        f"activationscope capture: warning: {said}\n"


@pytest.mark.parametrize("policy, options, fix", [
    ("MAX_K", {"max_k": 1}, "resume it from Python with capture_policy=CapturePolicy.MAX_K, max_k=1, or capture into "
                            "a new store"),
    ("SAMPLE_N", {"sample_every": 2}, "a store captured with CapturePolicy.SAMPLE_N cannot be resumed: start again "
                                      "with --overwrite, or capture into a new store"),
])
def test_a_resume_of_a_store_of_another_capture_policy_names_what_the_command_can_do(bracket_module, tmp_path,
                                                                                      capsys, policy, options, fix):
    # the refusal said "this capture has capture_policy=CapturePolicy.EVERY" and "resume with
    # capture_policy=CapturePolicy.MAX_K, max_k=1", which the command has no option for
    from bracketnets.nets import make

    out, model = tmp_path / "s.zarr", make()
    with acs.ActivationScope(store=str(out), capture_policy=getattr(acs.CapturePolicy, policy), **options).track(model):
        model(torch.randn(8, 6))
    code, _, err = run(capsys, "capture", "--model", "bracketnets.nets:make", "--data", str(bracket_module),
                       "--out", str(out), "--no-progress", "--resume")
    assert code == 1
    assert "this capture captures every forward (the command line has no capture policy), " in err, err
    assert fix in err and "capture_policy=CapturePolicy.EVERY" not in err and "overwrite=" not in err, err
    assert acs.open_store(str(out)).n_samples == 8


def test_reduce_refusing_a_complex_hook_point_names_the_flags_that_fix_it(user_package, tmp_path, capsys):
    # --reduce applies to every hook point: the library's fix (reductions= as a dict) has no flag
    x = user_package("fftnets", """
        import torch

        class FFT(torch.nn.Module):
            def forward(self, x):
                return torch.fft.fft(x)

        def make():
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(6, 6), FFT())
    """, data=(16, 6, 0))
    code, _, err = run(capsys, "capture", "--model", "fftnets.nets:make", "--data", str(x), "--out",
                       str(tmp_path / "s.zarr"), "--no-progress", "--batch-size", "8", "--reduce", "mean")
    assert code == 1
    assert ("hook point '1.output': reduction 'mean' needs real-valued rows, got dtype torch.complex64; "
            "built-in reductions take real rows: capture without --reduce, or --exclude the module of '1.output'") in err, err
    assert "reductions=" not in err, err


def test_a_hook_point_turning_float64_is_given_the_dtype_flag(user_package, tmp_path, capsys):
    # the refusal advised "Pass storage_dtype= to cast every row to one dtype"
    x = user_package("doublenets", """
        import torch

        class Doubles(torch.nn.Module):
            def __init__(self):
                super().__init__()
                torch.manual_seed(0)
                self.fc = torch.nn.Linear(6, 6)
                self.n = 0
            def forward(self, x):
                self.n += 1
                y = self.fc(x) * 2
                return y if self.n == 1 else y.double()

        def make():
            return torch.nn.Sequential(Doubles())
    """, data=(16, 6, 0))
    code, _, err = run(capsys, "capture", "--model", "doublenets.nets:make", "--data", str(x), "--out",
                       str(tmp_path / "s.zarr"), "--no-progress", "--batch-size", "8")
    assert code == 1
    assert ("hook point '0.output' changed its dtype from torch.float32 to torch.float64 during the capture; its store "
            "array holds torch.float32. Pass --dtype to cast every row to one dtype, or capture each dtype into its "
            "own store") in err, err
    assert "storage_dtype" not in err, err


@pytest.mark.parametrize("first,advice", [
    # float16 first: --dtype makes the float32 rows fit
    ("torch.float16", "pass --dtype to store every row as one dtype, or --exclude its module; "),
    # int64 first: --dtype casts floating-point hook points only, so it is named as no fix
    ("torch.int64", "or --exclude its module (--dtype casts floating-point hook points only, decided at their "
                    "first call, which was torch.int64 here, so it does not make these rows fit)"),
])
def test_an_empty_first_batch_is_refused_with_the_commands_flags(user_package, tmp_path, capsys, first, advice):
    # the refusal advised "pass storage_dtype= to store every row as one dtype"; the fix in the
    # model's code (new_empty) stays as it is
    x = user_package("emptynets", f"""
        import torch

        class EmptyFirst(torch.nn.Module):
            def __init__(self):
                super().__init__()
                torch.manual_seed(0)
                self.fc = torch.nn.Linear(6, 6)
                self.n = 0
            def forward(self, x):
                self.n += 1
                y = self.fc(x)
                return y[:0].to({first}) if self.n == 1 else y

        def make():
            return torch.nn.Sequential(EmptyFirst())
    """, data=(16, 6, 0))
    code, _, err = run(capsys, "capture", "--model", "emptynets.nets:make", "--data", str(x), "--out",
                       str(tmp_path / "s.zarr"), "--no-progress", "--batch-size", "8")
    assert code == 1
    assert (f"hook point '0.output' returned an empty batch at its first call (rows of shape (6,), {first}), which "
            "fixed its store array's row shape and dtype; its first rows are (6,), torch.float32, and would be "
            f"stored cast to {first} or refused. Return an empty tensor of the rows' shape and dtype "
            f"(x.new_empty((0, *rows.shape[1:]))), {advice}") in err, err
    assert "storage_dtype" not in err and "exclude=" not in err, err


@pytest.fixture
def alike_module(user_package):
    """``alikenets.nets``: ``case()``, a ModuleDict of the keys 'Attn' and 'attn', and ``nfc()``,
    one of '\\u00e9' and 'e\\u0301' (the same letter, one character or two); each a Linear 6->6
    called in turn; the data: 16 samples of 6 features."""
    return user_package("alikenets", """
        import torch

        class Two(torch.nn.Module):
            def __init__(self, a, b):
                super().__init__()
                torch.manual_seed(0)
                self.d = torch.nn.ModuleDict({a: torch.nn.Linear(6, 6), b: torch.nn.Linear(6, 6)})
                self.order = (a, b)
            def forward(self, x):
                return self.d[self.order[1]](self.d[self.order[0]](x))

        def case():
            return Two("Attn", "attn")
        def nfc():
            return Two("\\u00e9", "e\\u0301")
    """, data=(16, 6, 0))


def test_names_alike_but_for_normalization_are_left_out_with_a_value_the_shell_gives(alike_module, tmp_path, capsys,
                                                                                   recwarn):
    # the advice "--exclude-hook-points 'd.é.output'" printed the decomposed name as the other one
    # prints: copied from the terminal it could name either hook point
    from activationscope import cli

    out = tmp_path / "s.zarr"
    code, _, err = run(capsys, "capture", "--model", "alikenets.nets:nfc", "--data", str(alike_module), "--out",
                       str(out), "--no-progress")
    assert code == 0, err
    w = next(w for w in recwarn if "differ only in case" in str(w.message))
    said = cli._warning_formatter("capture")(w.message, w.category, w.filename, w.lineno)
    assert said.endswith("; rename one module, or leave one out (--exclude-hook-points $'d.e\\u0301.output')\n"), said
    # what the shell makes of $'d.e\u0301.output' leaves out that hook point, the other one kept
    code, _, err = run(capsys, "capture", "--model", "alikenets.nets:nfc", "--data", str(alike_module), "--out",
                       str(out), "--no-progress", "--overwrite", "--exclude-hook-points", "d.e\u0301.output")
    assert code == 0, err
    assert acs.open_store(str(out)).hook_points == ["d.\u00e9.output"]


def test_names_alike_on_a_file_system_that_folds_them_are_refused_in_the_commands_flags(alike_module, tmp_path,
                                                                                      capsys, monkeypatch):
    # the refusal advised "leave one out (track(exclude=...) or ...)", a call the command line has not
    import activationscope.store.writer as writer

    monkeypatch.setattr(writer, "_folds_names", lambda *names: True)  # (as on macOS or Windows)
    code, _, err = run(capsys, "capture", "--model", "alikenets.nets:case", "--data", str(alike_module), "--out",
                       str(tmp_path / "s.zarr"), "--no-progress")
    assert code == 1
    assert "; rename one module, leave one out (--exclude its module or --exclude-hook-points 'd.attn.output'), or " \
           "capture into a store on a case-sensitive file system" in err, err
    assert "track(" not in err and not (tmp_path / "s.zarr").exists()
