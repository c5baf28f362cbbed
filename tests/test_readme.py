"""The README's self-contained examples run as written and print what they say."""

from __future__ import annotations

import contextlib
import io
import re
import warnings
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_runnable_quick_start_prints_its_comment():
    block = next(b for b in _python_blocks() if "runnable" not in b and "mse_loss" in b)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, "README.md", "exec"), {})
    expected = re.search(r"^# (\{.*\})$", block, flags=re.M).group(1)
    assert out.getvalue().strip() == expected


def test_sae_caching_example_runs_and_prints_its_comment(tmp_path, monkeypatch):
    import importlib.util

    import pytest

    if importlib.util.find_spec("transformer_lens") is None:
        pytest.skip("transformer_lens is not installed (the README's SAE example needs it)")
    block = next(b for b in _python_blocks() if "stop_after_last=True" in b and "HookedTransformer" in b)
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TransformerLens announces its successor
        exec(compile(block, "README.md", "exec"), {})
    expected = re.search(r"print\(acts.shape\)\s+# (.*)$", block, flags=re.M).group(1)
    assert out.getvalue().strip().splitlines()[-1] == expected
