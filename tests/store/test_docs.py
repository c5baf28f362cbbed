"""The python blocks of docs/usage/store.md run as written, in order."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_store_docs_examples_run(tmp_path, monkeypatch):
    text = (ROOT / "docs" / "usage" / "store.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 3
    script = tmp_path / "store_md.py"
    script.write_text("\n".join(f"# --- block {i}\n{b}" for i, b in enumerate(blocks)))
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(script), run_name="__docs__")
    assert (tmp_path / "runs" / "demo.zarr" / "zarr.json").is_file()
