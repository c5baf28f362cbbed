"""The python blocks of docs/usage/store.md run as written, in order."""

from __future__ import annotations

from pathlib import Path

import torch
from acs_testing import run_doc_blocks

import activationscope as acs

ROOT = Path(__file__).resolve().parents[2]


def test_store_docs_examples_run(tmp_path):
    run_doc_blocks(ROOT / "docs" / "usage" / "store.md", tmp_path, min_blocks=3)
    assert (tmp_path / "runs" / "tiny.zarr" / "zarr.json").is_file()


def test_store_docs_leave_the_demo_store_alone_and_run_twice(tmp_path):
    # `make demo` writes runs/demo.zarr: the page must neither need nor touch it
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with acs.ActivationScope(store=str(tmp_path / "runs" / "demo.zarr")).track(model):
        model(torch.randn(3, 4))
    before = sorted((p.relative_to(tmp_path), p.stat().st_mtime_ns) for p in (tmp_path / "runs" / "demo.zarr").rglob("*"))
    run_doc_blocks(ROOT / "docs" / "usage" / "store.md", tmp_path, min_blocks=3)
    run_doc_blocks(ROOT / "docs" / "usage" / "store.md", tmp_path, min_blocks=3)  # a rerun works too
    after = sorted((p.relative_to(tmp_path), p.stat().st_mtime_ns) for p in (tmp_path / "runs" / "demo.zarr").rglob("*"))
    assert after == before
    assert acs.open_store(str(tmp_path / "runs" / "demo.zarr")).n_samples == 3
