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


def test_demo_table_in_the_readme_is_what_the_demo_prints():
    """The README's demo table, rebuilt from its own values by ``DemoResult.table()``."""
    from activationscope.analysis.demo import DemoResult, LayerRow
    from activationscope.analysis.probes import ProbeResult

    block = re.search(r"```\n(layer .*?)```", README.read_text(), flags=re.S).group(1).rstrip("\n").splitlines()
    head = re.split(r"\s{2,}", block[0].strip())
    assert head == ["layer", "token rows", "sentence rows", "on disk", "probe acc (5-fold)"]
    layers = []
    for line in block[2:]:
        layer, tokens, sentences, size, acc = re.split(r"\s{2,}", line.strip())
        value, unit = size.split()
        n_bytes = round(float(value) * {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit])
        mean, std = (float(v) for v in acc.split(" ± "))
        layers.append(LayerRow(int(layer), int(tokens.replace(",", "")), int(sentences.replace(",", "")), n_bytes,
                               ProbeResult(mean, std, chance=0.5)))
    result = DemoResult("s", None, layers, 200, 200, 1.0, 1.0, 1.0, 0, 5)
    assert result.table().splitlines()[:len(block)] == block


def test_demo_table_names_the_folds_the_probes_used():
    # --folds 5 with a class of 3 labelled sentences (--max-samples): the probes are 3-fold
    from activationscope.analysis.demo import DemoResult, LayerRow
    from activationscope.analysis.probes import ProbeResult

    layers = [LayerRow(i, 40, 10, 1024, ProbeResult(0.7, 0.1, chance=0.7, n_folds=3)) for i in range(2)]
    head = DemoResult("s", None, layers, 10, 10, 1.0, 1.0, 1.0, 0, 5).table().splitlines()[0]
    assert head.endswith("probe acc (3-fold)")
    layers[1].probe = None  # a layer without a probe does not count
    assert DemoResult("s", None, layers, 10, 10, 1.0, 1.0, 1.0, 0, 5).table().splitlines()[0].endswith("(3-fold)")
    assert DemoResult("s", None, [LayerRow(0, 4, 1, 8, None)], 1, 1, 1.0, 1.0, 1.0, 0, 5).table().splitlines()[0] \
        .endswith("probe acc (5-fold)")
