"""docs/usage/sae.md (a sparse autoencoder over ActivationDataset) and docs/usage/interop.md
(Hugging Face datasets, SAELens, TransformerLens, pandas; zarr-python, xarray, Dask,
TensorStore and pyarrow without activationscope) run as written."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from acs_testing import python_blocks, run_doc_blocks

ROOT = Path(__file__).resolve().parents[1]


def test_sae_training_loop_runs_and_learns(tmp_path, capsys):
    page = ROOT / "docs" / "usage" / "sae.md"
    loop = python_blocks(page)[1]
    assert len([line for line in loop.splitlines() if line.strip()]) <= 45
    run_doc_blocks(page, tmp_path, min_blocks=2)       # asserts FVU < 0.2 after training
    fvu = re.search(r"FVU ([\d.]+) -> ([\d.]+), L0 ([\d.]+) of 64", capsys.readouterr().out)
    assert fvu and float(fvu.group(2)) < 0.2 < float(fvu.group(1)) and 0 < float(fvu.group(3)) < 64


def test_interop_page_runs(tmp_path, monkeypatch):
    missing = [m for m in ("datasets", "transformer_lens", "sae_lens") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"docs/usage/interop.md needs {missing}: pip install -e '.[interop]'")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    run_doc_blocks(ROOT / "docs" / "usage" / "interop.md", tmp_path, min_blocks=4)
    assert (tmp_path / "runs" / "tl-sae" / "state.json").is_file()


def test_readers_without_activationscope_find_every_hook_point_by_the_page(tmp_path):
    """The page's own section, alone (without the interop extra): escaped and shortened
    folders, an alias, bfloat16 bits and int64 ids read by each outside tool equal the model's."""
    missing = [m for m in ("dask", "xarray", "tensorstore", "ml_dtypes") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the outside readers of docs/usage/interop.md need {missing}: pip install -e '.[dask]'")
    text = (ROOT / "docs" / "usage" / "interop.md").read_text()
    section = text[text.index("## Without activationscope"):]
    page = tmp_path / "outside.md"
    page.write_text(section)
    run_doc_blocks(page, tmp_path, min_blocks=1)
    assert (tmp_path / "runs" / "outside.zarr" / "acts").is_dir()
