"""The HTML report: statistics it plots (against direct computations) and the page it writes."""

from __future__ import annotations

import re

import pytest
import torch

from activationscope.analysis import report
from activationscope.analysis.probes import ProbeResult


class TinyStore:
    """The slice of the store read API the report's statistics use."""

    def __init__(self, arrays, reductions=None, info=None):
        self._arrays = arrays
        self.reductions = reductions or {}
        self._info = info or {}
        self.path = "/tmp/tiny.zarr"

    @property
    def hook_points(self):
        return list(self._arrays)

    def __getitem__(self, hp):
        return self._arrays[hp]

    def info(self):
        return self._info


def _relu_rows(n=500, d=16, dead=(2, 5, 11), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.relu(torch.randn(n, d, generator=g) + 0.3)
    x[:, list(dead)] = 0
    return x


def test_stats_from_rows_match_direct_computation():
    x = _relu_rows()
    st = report.hook_point_stats(TinyStore({"mlp.1.output": x}), "mlp.1.output", max_rows=10_000)
    torch.testing.assert_close(st.mean, x.double().mean(0))
    torch.testing.assert_close(st.std, x.double().std(0, correction=0))
    assert st.dead_fraction == pytest.approx(3 / 16)
    assert st.source.startswith("rows (500 of 500)")
    assert int(st.hist_counts.sum()) == x.numel()
    assert st.n_rows == 500 and st.feature_shape == (16,) and st.dtype == "float32"


def test_stats_prefer_reductions_over_sampled_rows():
    x = _relu_rows(n=1000)
    mean = torch.full((16,), 7.0, dtype=torch.float64)
    var = torch.full((16,), 4.0, dtype=torch.float64)
    nonzero = torch.ones(16, dtype=torch.float64)
    nonzero[0] = 0
    store = TinyStore({"h": x}, reductions={"h": {"var": var, "var.mean": mean, "nonzero": nonzero}})
    st = report.hook_point_stats(store, "h", max_rows=100)
    torch.testing.assert_close(st.mean, mean)
    torch.testing.assert_close(st.std, torch.full((16,), 2.0, dtype=torch.float64))
    assert st.dead_fraction == pytest.approx(1 / 16) and st.source == "reductions"
    assert st.n_sampled == 100  # histogram and PCA use an evenly spaced subset


def test_pca_explained_variance_of_low_rank_data():
    g = torch.Generator().manual_seed(0)
    basis = torch.randn(2, 32, generator=g)
    coeff = torch.randn(400, 2, generator=g) * torch.tensor([3.0, 1.0])
    st = report.hook_point_stats(TinyStore({"h": coeff @ basis + 5.0}), "h")
    assert st.explained is not None
    assert float(st.explained[:2].sum()) == pytest.approx(1.0, abs=1e-9)
    assert float(st.explained[0]) > 0.8


def test_pca_skipped_for_wide_features_with_reason():
    st = report.hook_point_stats(TinyStore({"conv": torch.randn(3, 8, 32, 32)}), "conv")
    assert st.explained is None and "8192 features" in st.pca_note
    assert st.feature_shape == (8, 32, 32) and st.mean.shape == (8192,)


def test_constant_activation_does_not_break_histogram():
    st = report.hook_point_stats(TinyStore({"h": torch.zeros(10, 4)}), "h")
    assert int(st.hist_counts.sum()) == 40 and st.dead_fraction == 1.0 and st.explained is None


def test_write_report_html_and_pngs(tmp_path):
    store = TinyStore(
        {"enc.0.output": _relu_rows(seed=1), "enc.1.output": _relu_rows(seed=2)},
        info={"status": "complete", "provenance": {"model": "TinyNet", "data": "random"},
              "arrays": {"enc.0.output": {"row_kind": "token", "bytes_on_disk": 32768}}},
    )
    probes = {
        "enc.0.output": ProbeResult(0.71, 0.05, [0.7, 0.72], 200, 16, 2, 0.5),
        "enc.1.output": ProbeResult(0.80, 0.03, [0.79, 0.81], 200, 16, 2, 0.5),
    }
    index = report.write_report(store, tmp_path / "rep", probes=probes, title="tiny <report>")
    page = index.read_text()
    assert index.name == "index.html"
    assert "tiny &lt;report&gt;" in page  # escaped
    imgs = re.findall(r"<img src='([^']+)'", page)
    assert imgs == ["probes.png", "hp_enc_0_output.png", "hp_enc_1_output.png"]
    for name in imgs:
        data = (tmp_path / "rep" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert "0.710 ± 0.050" in page and "0.800 ± 0.030" in page
    assert "18.8%" in page  # 3 of 16 units dead
    assert "32.0 KiB" in page and "token" in page and "TinyNet" in page
    assert "status-complete" in page


def test_write_report_without_labels_says_so(tmp_path):
    store = TinyStore({"h": _relu_rows()})
    index = report.write_report(store, tmp_path / "rep", probes={})
    page = index.read_text()
    assert "No probe" in page and "probes.png" not in page
