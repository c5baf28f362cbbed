"""The python blocks of docs/usage/store.md run as written, in order."""

from __future__ import annotations

from pathlib import Path

from acs_testing import run_doc_blocks

ROOT = Path(__file__).resolve().parents[2]


def test_store_docs_examples_run(tmp_path):
    run_doc_blocks(ROOT / "docs" / "usage" / "store.md", tmp_path, min_blocks=3)
    assert (tmp_path / "runs" / "demo.zarr" / "zarr.json").is_file()
