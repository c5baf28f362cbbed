"""The python blocks of the usage pages that no other test runs (docs/usage/dataset.md,
reductions.md, distributed.md) run as written, in order: their examples keep to the current
signatures of the names they call."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from acs_testing import run_doc_blocks

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("page", ["dataset.md", "reductions.md", "distributed.md"])
def test_usage_page_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    modules = set(sys.modules)
    try:
        run_doc_blocks(ROOT / "docs" / "usage" / page, tmp_path, min_blocks=2)
    finally:
        for name in set(sys.modules) - modules:  # modules the page wrote into tmp_path
            if getattr(sys.modules[name], "__file__", None) and str(tmp_path) in str(sys.modules[name].__file__):
                sys.modules.pop(name, None)
