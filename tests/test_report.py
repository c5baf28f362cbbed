"""The HTML report: statistics it plots (against direct computations) and the page it writes."""

from __future__ import annotations

import re

import pytest
import torch

from activationscope.analysis import report
from activationscope.analysis.probes import ProbeResult


class TinyStore:
    """The slice of the store read API the report's statistics use."""

    def __init__(self, arrays, reductions=None, info=None, specs=None):
        self._arrays = arrays
        self.reductions = reductions or {}
        self._specs = specs or {}
        self._info = info or {}
        self.path = "/tmp/tiny.zarr"

    def reduction_specs(self, hp):
        return self._specs.get(hp, {})

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



def test_complex_rows_are_described_by_their_modulus_and_say_so():
    # float64 of complex rows kept the real parts: a unit that is 0 + 5j was a dead unit
    g = torch.Generator().manual_seed(0)
    x = torch.complex(torch.randn(200, 4, generator=g), torch.randn(200, 4, generator=g))
    x[:, 1] = torch.complex(torch.zeros(200), torch.randn(200, generator=g))  # real part 0, not dead
    st = report.hook_point_stats(TinyStore({"fft.output": x}), "fft.output")
    torch.testing.assert_close(st.mean, x.abs().double().mean(0))
    torch.testing.assert_close(st.std, x.abs().double().std(0, correction=0))
    assert st.dead_fraction == 0 and st.dtype == "complex64"
    assert any(n.startswith("complex64 values: every panel shows their modulus |x|") for n in st.notes)


def test_wide_rows_are_sampled_within_a_memory_bound(monkeypatch):
    # a (pos, d_model) sample row of 128 x 768 values: 20 000 of them would be 15.7 GB of float64
    # (and a few copies more); the report samples at most MAX_SAMPLED_BYTES of them
    assert report.MAX_SAMPLED_BYTES // (8 * 128 * 768) == 682
    monkeypatch.setattr(report, "MAX_SAMPLED_BYTES", 8 * 24 * 10)
    x = torch.randn(100, 4, 6, generator=torch.Generator().manual_seed(0))
    st = report.hook_point_stats(TinyStore({"seq": x}), "seq", feature_axis=None)
    idx = torch.linspace(0, 99, 10).round().long()  # 10 rows, evenly spaced
    assert st.n_sampled == 10 and st.source == "rows (10 of 100)"
    torch.testing.assert_close(st.mean, x[idx].double().reshape(10, -1).mean(0))
    assert int(st.hist_counts.sum()) == 10 * 24
    monkeypatch.setattr(report, "MAX_SAMPLED_BYTES", 1)  # never fewer than the 2 rows a PCA needs
    assert report.hook_point_stats(TinyStore({"seq": x}), "seq").n_sampled == 2

def test_stats_prefer_reductions_over_sampled_rows():
    x = _relu_rows(n=1000)
    mean = torch.full((16,), 7.0, dtype=torch.float64)
    var = torch.full((16,), 4.0, dtype=torch.float64)
    nonzero = torch.ones(16, dtype=torch.float64)
    nonzero[0] = 0
    store = TinyStore({"h": x}, reductions={"h": {"var": var, "var.mean": mean, "nonzero": nonzero}},
                      specs={"h": {"var": ("var", {"ddof": 0.0}), "nonzero": ("nonzero", {})}})
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
    st = report.hook_point_stats(TinyStore({"conv": torch.randn(3, 8, 32, 32)}), "conv", feature_axis=None)
    assert st.explained is None and "8192 features" in st.pca_note
    assert st.feature_shape == (8, 32, 32) and st.mean.shape == (8192,)
    assert "per-unit panels show 4,096 of 8,192 units, evenly spaced" in " ".join(report.unit_notes(st))


def test_constant_activation_does_not_break_histogram():
    st = report.hook_point_stats(TinyStore({"h": torch.zeros(10, 4)}), "h")
    assert int(st.hist_counts.sum()) == 40 and st.dead_fraction == 1.0 and st.explained is None


def test_histogram_of_values_across_the_float64_range_counts_every_value():
    # -1e308 .. 1e308: hi - lo overflows float64; every value is still in a bin, edges finite
    values = torch.tensor([[-1e308, 0.0], [1e308, 5.0], [2.0, -3.0]], dtype=torch.float64)
    st = report.hook_point_stats(TinyStore({"h": values}), "h", bins=4)
    assert st.hist_counts.tolist() == [1, 0, 4, 1]
    assert bool(torch.isfinite(st.hist_edges).all()) and st.hist_edges[0] == -1e308 and st.hist_edges[-1] == 1e308


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


def test_a_folder_with_another_index_html_is_left_alone(tmp_path):
    from activationscope.errors import ArgumentValueError

    store = TinyStore({"h": _relu_rows()})
    site = tmp_path / "site"
    site.mkdir()
    mine = {"index.html": "<html>my homepage</html>", "probes.png": "mine", "hp_logo.png": "mine too"}
    for name, text in mine.items():
        (site / name).write_text(text)
    with pytest.raises(ArgumentValueError, match=r"holds an index.html that is not an activationscope report"):
        report.write_report(store, site, probes={})
    assert {p.name: p.read_text() for p in site.iterdir()} == mine
    # a folder of other files, without index.html, gets the report; its own files stay
    other = tmp_path / "other"
    other.mkdir()
    (other / "hp_logo.png").write_text("mine")
    report.write_report(store, other, probes={})
    assert (other / "hp_logo.png").read_text() == "mine" and (other / "hp_h.png").exists()
    # an earlier report is replaced, its plots of hook points no longer shown removed
    rep = tmp_path / "rep"
    report.write_report(TinyStore({"h": _relu_rows(), "g": _relu_rows(seed=3)}), rep, probes={})
    report.write_report(store, rep, probes={})
    assert sorted(p.name for p in rep.iterdir()) == ["hp_h.png", "index.html"]


def test_write_report_without_labels_says_so(tmp_path):
    store = TinyStore({"h": _relu_rows()})
    index = report.write_report(store, tmp_path / "rep", probes={})
    page = index.read_text()
    assert "No probe" in page and "probes.png" not in page


def _conv_rows(n=64, c=4, hw=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, hw, hw, generator=g) * torch.arange(1, c + 1).view(1, c, 1, 1) + torch.arange(c).view(1, c, 1, 1)
    x = torch.relu(x)
    x[:, 1] = 0  # a dead channel
    return x


def test_conv_layers_are_reduced_per_channel():
    x = _conv_rows()
    st = report.hook_point_stats(TinyStore({"conv": x}), "conv")
    assert st.unit_name == "channel" and st.feature_axis == 0 and st.mean.shape == (4,)
    per_channel = x.double().transpose(0, 1).reshape(4, -1)
    torch.testing.assert_close(st.mean, per_channel.mean(1))
    torch.testing.assert_close(st.std, per_channel.std(1, correction=0))
    torch.testing.assert_close(st.nonzero, (per_channel != 0).double().mean(1))
    assert st.dead_fraction == 0.25
    assert "the 4 channels along axis 0 of (4, 8, 8), each over rows x 64 positions" in " ".join(report.unit_notes(st))
    # the same from per-position reductions over every row (combined exactly)
    flat = x.double().reshape(len(x), -1)
    reds = {"conv": {"var": flat.var(0, correction=0), "var.mean": flat.mean(0), "nonzero": (flat != 0).double().mean(0)}}
    specs = {"conv": {"var": ("var", {}), "nonzero": ("nonzero", {})}}
    st2 = report.hook_point_stats(TinyStore({"conv": x}, reductions=reds, specs=specs), "conv", max_rows=8)
    assert st2.source == "reductions"
    torch.testing.assert_close(st2.mean, per_channel.mean(1))
    torch.testing.assert_close(st2.std, per_channel.std(1, correction=0))
    torch.testing.assert_close(st2.nonzero, (per_channel != 0).double().mean(1))
    # another axis on request: channels last
    st3 = report.hook_point_stats(TinyStore({"conv": x}), "conv", feature_axis=-1)
    torch.testing.assert_close(st3.mean, x.double().permute(3, 0, 1, 2).reshape(8, -1).mean(1))
    with pytest.raises(ValueError, match="feature_axis must be"):
        report.hook_point_stats(TinyStore({"conv": x}), "conv", feature_axis=3)
    # (pos, d_model) rows of a sequence model: the d_model features, each over rows x positions
    seq = torch.randn(20, 5, 8, generator=torch.Generator().manual_seed(1))
    st4 = report.hook_point_stats(TinyStore({"seq": seq}), "seq")
    assert st4.unit_name == "feature" and st4.feature_axis == 1 and st4.mean.shape == (8,)
    torch.testing.assert_close(st4.mean, seq.double().reshape(-1, 8).mean(0))


def test_per_channel_std_from_reductions_of_maps_with_a_large_offset():
    # conv maps far from 0 (a BatchNorm bias, an unnormalised input): the per-channel std
    # combined from per-position reductions must not lose its digits to E[x^2] - E[x]^2
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(40, 3, 5, 5, generator=g, dtype=torch.float64) * 1e-3 + 1e6)
    flat = x.reshape(len(x), -1)
    reds = {"conv": {"var": flat.var(0, correction=0), "var.mean": flat.mean(0),
                     "nonzero": (flat != 0).double().mean(0)}}
    specs = {"conv": {"var": ("var", {}), "nonzero": ("nonzero", {})}}
    st = report.hook_point_stats(TinyStore({"conv": x}, reductions=reds, specs=specs), "conv", max_rows=8)
    assert st.source == "reductions"
    per_channel = x.transpose(0, 1).reshape(3, -1)
    torch.testing.assert_close(st.std, per_channel.std(1, correction=0), rtol=1e-6, atol=0)
    torch.testing.assert_close(st.mean, per_channel.mean(1), rtol=1e-12, atol=0)


def test_nonzero_panel_only_where_it_informs(tmp_path):
    dense = torch.randn(200, 16, generator=torch.Generator().manual_seed(0))  # no exact zeros (no ReLU)
    st = report.hook_point_stats(TinyStore({"h": dense}), "h")
    assert not report.has_informative_nonzero(st)
    assert "no non-zero panel: every unit is non-zero in every row" in report.unit_notes(st)
    assert report.has_informative_nonzero(report.hook_point_stats(TinyStore({"h": _relu_rows()}), "h"))
    page = report.write_report(TinyStore({"h": dense, "r": _relu_rows()}), tmp_path / "rep", probes={}).read_text()
    assert page.count("no non-zero panel") == 1


def _labelled_store(path, labels):
    import activationscope as acs

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6))
    x = torch.randn(len(labels), 6) + torch.tensor(labels, dtype=torch.float32)[:, None] * 2
    with acs.ActivationScope(store=str(path)).track(model) as tracker:
        tracker.set_batch(label=list(labels))
        model(x)
    return acs.open_store(str(path))


def test_folds_come_from_the_class_counts(tmp_path):
    from activationscope.analysis.probes import choose_folds, probe_store

    assert choose_folds([0] * 4 + [1] * 4, 5) == (4, "4-fold instead of 5: the smallest class (0) has 4 labelled samples")
    assert choose_folds([0] * 9 + [1] * 6, 5) == (5, "")
    store = _labelled_store(tmp_path / "s.zarr", [0, 1] * 4)                 # 8 samples, 4 per class
    probes = probe_store(store, n_folds=5)
    assert probes["0.output"].n_folds == 4 and "smallest class" in probes["0.output"].note
    assert probes["0.output"].accuracy > 0.5
    page = report.write_report(store, tmp_path / "rep", n_folds=5).read_text()
    assert "4-fold stratified cross-validation" in page and "Folds chosen from the class counts: 4-fold instead of 5" in page
    assert "No probe" not in page
    one = _labelled_store(tmp_path / "one.zarr", [0, 0, 0, 1])
    probes = probe_store(one, n_folds=5)
    assert not probes and "class 1 has 1 labelled sample" in probes.skipped["0.output"]
    page = report.write_report(one, tmp_path / "rep1", n_folds=5).read_text()
    assert "No probe for any hook point: class 1 has 1 labelled sample" in page


def test_report_in_a_real_browser(tmp_path):
    """Render the page with headless Chromium: every plot loads and the page is not blank."""
    import shutil
    import subprocess

    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        pytest.skip("no Chromium (apt-get install chromium)")
    store = TinyStore({"conv": _conv_rows(), "mlp": _relu_rows(), "dense": torch.randn(100, 8)})
    probes = {"mlp": ProbeResult(0.8, 0.05, [0.75, 0.85], 100, 16, 2, 0.5, n_folds=2, note="2-fold instead of 5")}
    index = report.write_report(store, tmp_path / "rep", probes=probes)
    shot = tmp_path / "shot.png"
    # a script in the page records how many images decoded with a real size
    html = index.read_text().replace("</body>", "<script>window.onload=()=>{document.title='loaded:'+"
                                     "[...document.images].filter(i=>i.complete&&i.naturalWidth>100).length}</script></body>")
    index.write_text(html)
    run = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                          "--window-size=1300,2400", "--virtual-time-budget=5000", index.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert shot.is_file(), run.stderr[-2000:]
    dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
                          "--dump-dom", index.as_uri()], capture_output=True, text=True, timeout=120).stdout
    assert "<title>loaded:4</title>" in dom  # probes.png and the three hook point plots
    import matplotlib.image

    img = matplotlib.image.imread(str(shot))
    assert img.shape[0] >= 2000 and img.shape[1] >= 1200
    ink = (img[..., :3].mean(-1) < 0.9).mean()         # share of pixels that are not near-white
    assert ink > 0.02, ink


def test_a_nan_row_is_left_out_of_the_pca_and_said_so(tmp_path):
    from activationscope.analysis.pca import explained_variance_ratio

    torch.manual_seed(0)
    rows = torch.randn(64, 4, dtype=torch.float64)
    ref, _ = explained_variance_ratio(torch.cat([rows[:3], rows[4:]]), 4, 100)
    rows[3, 0] = float("nan")
    got, note = explained_variance_ratio(rows, 4, 100)
    torch.testing.assert_close(got, ref)
    assert note == "1 row(s) with NaN or inf left out of the PCA"


def test_report_of_a_store_with_a_nan_activation_is_written(tmp_path):
    from activationscope import ActivationScope

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())
    x = torch.randn(64, 4)
    x[3, 0] = float("nan")
    with torch.no_grad(), ActivationScope(store=str(tmp_path / "s.zarr")).track(m) as tr:
        tr.set_batch(label=torch.arange(64) % 2)
        m(x)
    page = report.write_report(str(tmp_path / "s.zarr"), tmp_path / "r")
    assert page.exists()


def test_report_refuses_a_named_label_column_that_does_not_exist_and_too_few_folds(tmp_path):
    from activationscope import ActivationScope
    from activationscope.errors import ArgumentValueError

    m = torch.nn.Linear(4, 3)
    with torch.no_grad(), ActivationScope(store=str(tmp_path / "s.zarr")).track(m) as tr:
        tr.set_batch(label=torch.arange(16) % 2)
        m(torch.randn(16, 4))
    with pytest.raises(ArgumentValueError, match="label_column 'labl' is not a column"):
        report.write_report(str(tmp_path / "s.zarr"), tmp_path / "r", label_column="labl")
    with pytest.raises(ArgumentValueError, match="n_folds must be an int of at least 2, got 1"):
        report.write_report(str(tmp_path / "s.zarr"), tmp_path / "r", n_folds=1)
    assert not (tmp_path / "r").exists()  # refused before writing anything
    page = report.write_report(str(tmp_path / "s.zarr"), tmp_path / "r", label_column="label", n_folds=2)
    assert "No probe" not in page.read_text()


def test_report_names_the_label_column_a_misspelt_one_meant(tmp_path, capsys):
    from activationscope import ActivationScope, cli
    from activationscope.errors import ArgumentValueError

    m = torch.nn.Linear(4, 3)
    with torch.no_grad(), ActivationScope(store=str(tmp_path / "s.zarr")).track(m) as tr:
        tr.set_batch(label=torch.arange(16) % 2)
        m(torch.randn(16, 4))
    with pytest.raises(ArgumentValueError) as info:
        report.write_report(str(tmp_path / "s.zarr"), tmp_path / "r", label_column="lable")
    message = str(info.value)
    assert str(tmp_path / "s.zarr") in message and message.endswith("did you mean ['label'] for 'lable'?"), message
    assert cli.main(["report", str(tmp_path / "s.zarr"), "--out", str(tmp_path / "r"), "--label-column", "lable"]) == 1
    err = capsys.readouterr().err
    assert "--label-column 'lable' is not a column" in err and "did you mean ['label'] for 'lable'?" in err, err
    assert not (tmp_path / "r").exists()


def _store_of_rows(path, x, labels):
    import activationscope as acs

    with acs.ActivationScope(store=str(path)).track(torch.nn.Sequential(torch.nn.Identity())) as tracker:
        tracker.set_batch(label=list(labels))
        tracker.model(x)
    return acs.open_store(str(path))


def _separable_rows(n=60, d=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    labels = [0, 1] * (n // 2)
    x = torch.randn(n, d, generator=g) + torch.tensor(labels, dtype=torch.float32)[:, None] * 0.8
    return x, labels


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_probe_leaves_out_nonfinite_rows(bad):
    from activationscope.analysis.probes import probe_accuracy

    x, labels = _separable_rows()
    clean = probe_accuracy(x, labels, n_folds=5)
    row = torch.zeros(1, x.shape[1])
    row[0, 3] = bad
    got = probe_accuracy(torch.cat([x[:7], row, x[7:]]), labels[:7] + [1] + labels[7:], n_folds=5)
    assert clean.accuracy > 0.7 and (clean.n_dropped, clean.dropped_note) == (0, "")
    assert got.accuracy == clean.accuracy and got.fold_accuracies == clean.fold_accuracies
    assert got.n_samples == 60 and got.n_dropped == 1
    assert got.dropped_note == "1 row(s) with NaN or inf left out of the probe"


def test_probe_of_only_nonfinite_rows_is_refused():
    from activationscope.analysis.probes import probe_accuracy
    from activationscope.errors import ArgumentValueError

    with pytest.raises(ArgumentValueError, match="every one of the 4 rows holds NaN or inf"):
        probe_accuracy(torch.full((4, 3), float("nan")), [0, 1, 0, 1], n_folds=2)


def test_probe_store_and_report_say_how_many_rows_were_left_out(tmp_path):
    from activationscope.analysis.probes import probe_store

    x, labels = _separable_rows()
    clean = probe_store(_store_of_rows(tmp_path / "clean.zarr", x, labels), n_folds=5)["0.output"]
    x_nan = x.clone()
    x_nan[7, 3] = float("nan")
    x_nan[20] = float("nan")
    store = _store_of_rows(tmp_path / "nan.zarr", x_nan, labels)
    keep = [i for i in range(60) if i not in (7, 20)]
    without = probe_store(_store_of_rows(tmp_path / "without.zarr", x[keep], [labels[i] for i in keep]),
                          n_folds=5)["0.output"]
    got = probe_store(store, n_folds=5)["0.output"]
    assert clean.accuracy > 0.7 and clean.n_dropped == 0
    assert got.accuracy == without.accuracy and got.fold_accuracies == without.fold_accuracies
    assert got.n_samples == 58 and got.n_dropped == 2
    assert got.dropped_note == "2 row(s) with NaN or inf left out of the probe"
    page = report.write_report(store, tmp_path / "rep", n_folds=5).read_text()
    assert "0.output: 2 row(s) with NaN or inf left out of the probe." in page
    assert "left out of the probe" not in report.write_report(
        _store_of_rows(tmp_path / "c2.zarr", x, labels), tmp_path / "rep2", n_folds=5).read_text()
    everything = probe_store(_store_of_rows(tmp_path / "all.zarr", torch.full((6, 2), float("nan")), [0, 1] * 3))
    assert not everything and "every one of the 6 rows holds NaN or inf" in everything.skipped["0.output"]


class _NanRows(torch.nn.Module):
    """The rows as they are, but NaN in the rows ``rows``."""

    def __init__(self, rows):
        super().__init__()
        self.rows = list(rows)

    def forward(self, x):
        x = x.clone()
        x[self.rows] = float("nan")
        return x


def test_report_gives_each_hook_point_the_size_of_its_own_probe(tmp_path):
    # hook point 1 loses 10 rows of class 1 to NaN: its probe has 50 samples and chance 0.6, not
    # the 60 samples and chance 0.5 of hook point 0
    import activationscope as acs
    from activationscope.analysis.probes import probe_store

    x, labels = _separable_rows()
    nan_rows = [i for i in range(60) if labels[i] == 1][:10]
    model = torch.nn.Sequential(torch.nn.Identity(), _NanRows(nan_rows))
    with acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(model) as tracker:
        tracker.set_batch(label=labels)
        tracker.model(x)
    store = acs.open_store(str(tmp_path / "s.zarr"))
    probes = probe_store(store, n_folds=5)
    assert (probes["0.output"].n_samples, probes["0.output"].chance) == (60, 0.5)
    assert (probes["1.output"].n_samples, probes["1.output"].chance) == (50, 0.6)
    page = report.write_report(store, tmp_path / "rep", probes=probes).read_text()
    assert "0.output: 60 labelled samples, 2 classes, chance 0.500." in page
    assert "1.output: 50 labelled samples, 2 classes, chance 0.600." in page
    assert "60 labelled samples, 2 classes, chance 0.500.</p>" not in page.split("0.output: ")[0]
    # one size for every hook point: said once
    clean = _store_of_rows(tmp_path / "c.zarr", x, labels)
    page = report.write_report(clean, tmp_path / "rep2").read_text()
    assert "5-fold stratified cross-validation, 60 labelled samples, 2 classes, chance 0.500." in page


def test_report_table_shows_bytes_on_disk_as_info_does(tmp_path):
    from activationscope.sizes import format_bytes

    x, labels = _separable_rows(n=10, d=5)
    store = _store_of_rows(tmp_path / "s.zarr", x, labels)
    entry = store.info()["arrays"]["0.output"]
    on_disk, data = format_bytes(entry["bytes_on_disk"]), format_bytes(entry["bytes"])
    assert on_disk != data
    page = report.write_report(store, tmp_path / "rep", probes={}).read_text()
    head = re.search(r"<h2>Hook points</h2><table><tr>(.*?)</tr>", page).group(1)
    cells = re.findall(r"<th[^>]*>(.*?)</th>", head)
    assert "on disk" in cells and "bytes" not in cells
    row = re.search(r"<tr><td class='l'><a href='#[^']*'>0.output</a></td>(.*?)</tr>", page).group(1)
    values = re.findall(r"<td>(.*?)</td>", row)
    assert values[cells.index("on disk") - 1] == on_disk


def test_a_hook_point_off_the_row_table_is_plotted_without_a_probe(tmp_path):
    import activationscope as acs
    from acs_testing import late_branch_store
    from activationscope.analysis.probes import probe_store

    model, xs = late_branch_store(tmp_path / "s.zarr")
    store = acs.open_store(str(tmp_path / "s.zarr"))
    probes = probe_store(store, n_folds=2)
    assert list(probes) == ["a.output"] and probes["a.output"].n_samples == 24
    assert list(probes.skipped) == ["b.output"] and "do not follow the row table" in probes.skipped["b.output"]
    page = report.write_report(store, tmp_path / "rep", n_folds=2).read_text()
    assert "No probe for b.output: its rows do not follow the row table" in page
    assert (tmp_path / "rep" / "hp_b_output.png").exists() and (tmp_path / "rep" / "hp_a_output.png").exists()
    st = report.hook_point_stats(store, "b.output")
    with torch.no_grad():
        want = torch.cat([model.b(model.a(x)) for x in xs[2:]]).double()
    assert st.n_rows == 12
    torch.testing.assert_close(st.mean, want.mean(0))


def test_report_of_a_hook_point_without_rows_and_inside_the_store(tmp_path, recwarn):
    """A hook point that saw 0 rows gets its page without plotting warnings; a report folder
    inside the store is refused before anything is written there."""
    from activationscope import ActivationScope
    from activationscope.errors import ArgumentValueError

    m = torch.nn.Sequential(torch.nn.Linear(3, 3))
    path = tmp_path / "s.zarr"
    with torch.no_grad(), ActivationScope(store=str(path)).track(m):
        m(torch.randn(0, 3))
    before = sorted(p.name for p in path.rglob("*"))
    for inside in (path, path / "acts", path / "acts" / "new"):
        with pytest.raises(ArgumentValueError, match=r"is inside the store .*give a folder outside the store"):
            report.write_report(str(path), inside)
    assert sorted(p.name for p in path.rglob("*")) == before
    page = report.write_report(str(path), tmp_path / "r")
    assert page.exists() and "0.output" in page.read_text()
    assert not [w for w in recwarn.list if "log-scaled" in str(w.message)]


def test_a_report_into_another_store_is_refused(tmp_path):
    """A report written into another store's folder (its root, or below) was deleted without
    a word when that store was captured again with overwrite=True: refused, nothing written."""
    from activationscope import ActivationScope
    from activationscope.errors import ArgumentValueError

    m = torch.nn.Sequential(torch.nn.Linear(3, 3))
    src, other = tmp_path / "s.zarr", tmp_path / "other.zarr"
    for root in (src, other):
        with torch.no_grad(), ActivationScope(store=str(root)).track(m):
            m(torch.randn(4, 3))
    before = sorted(p.name for p in other.rglob("*"))
    for inside in (other, other / "acts", other / "rep"):
        with pytest.raises(ArgumentValueError, match=r"is inside the store .*other\.zarr.*give a folder outside"):
            report.write_report(str(src), inside)
    assert sorted(p.name for p in other.rglob("*")) == before
    assert report.write_report(str(src), tmp_path / "r").exists()


def _relu_store(path, reductions):
    import activationscope as acs

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU())
    with torch.no_grad(), acs.ActivationScope(store=str(path), reductions=reductions).track(m, include=["1"]):
        m(torch.randn(50, 6))
    store = acs.open_store(str(path))
    return store, store["1.output"].double()


def test_stats_pick_reductions_by_kind_not_by_name(tmp_path):
    """Reductions named like statistics but of other kinds are not read as those statistics
    (the rows give them); reductions of the right kinds under other names are, a ddof-1
    ``var`` rescaled to the population std."""
    store, x = _relu_store(tmp_path / "a.zarr", [("mean", "max"), ("var", "absmax"), ("nonzero", "min")])
    st = report.hook_point_stats(store, "1.output")
    assert st.source == "rows (50 of 50)"
    torch.testing.assert_close(st.mean, x.mean(0))
    torch.testing.assert_close(st.std, x.std(0, correction=0))
    torch.testing.assert_close(st.nonzero, (x != 0).double().mean(0))
    assert st.dead_fraction == float(((x != 0).sum(0) == 0).double().mean()) == 0.0

    store, x = _relu_store(tmp_path / "b.zarr", [("avg", "mean"), ("spread", "var", {"ddof": 1}), ("alive", "nonzero")])
    st = report.hook_point_stats(store, "1.output", max_rows=10)
    assert st.source == "reductions"
    torch.testing.assert_close(st.mean, x.mean(0))
    torch.testing.assert_close(st.std, x.std(0, correction=0))
    torch.testing.assert_close(st.nonzero, (x != 0).double().mean(0))

    store, x = _relu_store(tmp_path / "c.zarr", [("s", "std", {"ddof": 1}), "nonzero"])
    st = report.hook_point_stats(store, "1.output", max_rows=10)
    assert st.source == "reductions"
    torch.testing.assert_close(st.mean, x.mean(0))
    torch.testing.assert_close(st.std, x.std(0, correction=0))


def test_plots_of_hook_points_whose_names_differ_only_by_dot_or_underscore(tmp_path):
    """``d.a_b.output`` and ``d.a.b.output`` get a PNG and an anchor each, each page entry
    showing its own."""
    import activationscope as acs

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.d = torch.nn.ModuleDict({"a_b": torch.nn.Linear(3, 3), "a": torch.nn.ModuleDict({"b": torch.nn.Linear(3, 3)}),
                                          "c": torch.nn.Linear(3, 3)})

        def forward(self, x):
            return self.d["a_b"](x) * 10 + self.d["a"]["b"](x) * -10 + self.d["c"](x)

    torch.manual_seed(0)
    m = M()
    with torch.no_grad(), acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(m, include=["d.*"]):
        m(torch.randn(20, 3))
    page = report.write_report(str(tmp_path / "s.zarr"), tmp_path / "rep").read_text()
    imgs = dict((alt, src) for src, alt in re.findall(r"<img src='(hp_[^']+)' alt='([^']+)'>", page))
    assert sorted(imgs) == ["d.a.b.output", "d.a_b.output", "d.c.output"]
    assert imgs["d.c.output"] == "hp_d_c_output.png"  # a name of its own keeps the plain one
    assert imgs["d.a.b.output"] != imgs["d.a_b.output"]
    assert all(re.fullmatch(r"hp_d_a_b_output-[0-9a-f]{8}\.png", imgs[hp]) for hp in ("d.a.b.output", "d.a_b.output"))
    pngs = {hp: (tmp_path / "rep" / src).read_bytes() for hp, src in imgs.items()}
    assert pngs["d.a.b.output"] != pngs["d.a_b.output"]
    ids = re.findall(r"<h3 id='([^']+)'>", page)
    assert len(set(ids)) == 3
    assert sorted(re.findall(r"href='#([^']+)'", page)) == sorted(ids)


def test_probe_says_a_class_was_lost_to_nonfinite_rows():
    """Every row of class 0 holds NaN: the refusal says the rows were left out and which
    class went with them; with a third class left, the probe runs and its note says so."""
    from activationscope.analysis.probes import choose_folds, drop_nonfinite_rows, probe_accuracy
    from activationscope.errors import ArgumentValueError

    x, labels = _separable_rows()
    x = x.double()
    x[[i for i, v in enumerate(labels) if v == 0], 2] = float("nan")
    with pytest.raises(ArgumentValueError, match=r"at least 2 classes, but every row of class\(es\) \[0\] holds NaN or "
                                                 r"inf: after leaving out those 30 row\(s\) only class\(es\) \[1\] remain"):
        probe_accuracy(x, labels, n_folds=2)
    x3 = torch.cat([x, torch.randn(10, x.shape[1], dtype=torch.float64) + 5])
    got = probe_accuracy(x3, labels + [2] * 10, n_folds=2)
    assert got.n_classes == 2 and got.n_samples == 40 and got.n_dropped == 30 and got.accuracy == 1.0
    assert got.dropped_note == ("30 row(s) with NaN or inf left out of the probe; every row of class(es) [0] held "
                                "NaN or inf: the probe is over the other classes")
    kept_x, kept, n, _ = drop_nonfinite_rows(x3, labels + [2] * 10)
    assert kept == [1] * 30 + [2] * 10 and n == 30 and kept_x.shape == (40, x.shape[1])
    assert choose_folds(kept, 5) == (5, "")


def test_probe_refuses_bool_labels_mixed_with_ints():
    from activationscope.analysis.probes import choose_folds, probe_accuracy
    from activationscope.errors import ArgumentValueError

    x, labels = _separable_rows()
    mixed = [True if v == 1 and i % 4 == 1 else v for i, v in enumerate(labels)]
    assert True in mixed and 1 in [v for v in mixed if not isinstance(v, bool)]
    for call in (lambda: probe_accuracy(x, mixed, n_folds=2), lambda: choose_folds(mixed, 2)):
        with pytest.raises(ArgumentValueError, match=r"labels must be all bools or no bools, got bool True and int 0"):
            call()
    import numpy as np

    np_mixed = [np.True_ if v == 1 and i % 4 == 1 else v for i, v in enumerate(labels)]  # numpy bools too
    with pytest.raises(ArgumentValueError, match=r"labels must be all bools or no bools"):
        probe_accuracy(x, np_mixed, n_folds=2)
    as_bools = probe_accuracy(x, [bool(v) for v in labels], n_folds=5)
    as_ints = probe_accuracy(x, labels, n_folds=5)
    assert as_bools.fold_accuracies == as_ints.fold_accuracies and as_bools.n_classes == 2


def test_probe_leaves_out_a_feature_column_that_is_nan_in_every_row():
    from activationscope.analysis.probes import probe_accuracy

    x, labels = _separable_rows()
    clean = probe_accuracy(x, labels, n_folds=5)
    col = torch.full((x.shape[0], 1), float("nan"))
    got = probe_accuracy(torch.cat([x[:, :3], col, x[:, 3:]], 1), labels, n_folds=5)
    assert got.fold_accuracies == clean.fold_accuracies and got.n_samples == 60 and got.n_dropped == 0
    assert got.n_features == x.shape[1]
    assert got.dropped_note == "1 feature column(s) NaN or inf in every row left out of the probe (index 3)"


@pytest.mark.parametrize("scale", [1e200, 1e-200, 1e300])
def test_probe_of_features_near_the_float64_limits(scale):
    """Features of 1e200 (whose squares overflow) or 1e-200 give the probe of the same
    features at scale 1."""
    from activationscope.analysis.probes import probe_accuracy

    x, labels = _separable_rows()
    x = x.double()
    unit = probe_accuracy(x, labels, n_folds=5)
    got = probe_accuracy(x * scale, labels, n_folds=5)
    assert unit.accuracy > 0.7
    assert got.accuracy == pytest.approx(unit.accuracy, abs=0.02)
    sep = torch.tensor(labels, dtype=torch.float64)[:, None].expand(-1, 4) * scale
    assert probe_accuracy(sep, labels, n_folds=5).accuracy == 1.0


def test_plots_of_hook_points_with_names_longer_than_a_file_name(tmp_path):
    """A hook point whose name is longer than a file name may be (255 bytes; a deep module
    path, or a store from elsewhere) gets a PNG named by its first 200 bytes and a hash, each
    its own; before, report failed with OSError 'File name too long'."""
    from activationscope.store import StoreWriter

    import json

    names = ["x" * 300 + ".a.output", "x" * 300 + ".b.output", "é" * 150 + ".output"]
    store = tmp_path / "s.zarr"
    w = StoreWriter(store)
    for i in range(3):
        w.open_array(f"{i}.output", (3,), torch.float32, "sample").append(torch.randn(20, 3) + i)
    w.add_batch(20)
    w.close()
    # a store from elsewhere, whose arrays (at short paths) are named by long hook points
    doc = json.loads((store / "zarr.json").read_text())
    arrays = doc["attributes"]["activationscope"]["arrays"]
    for i, hp in enumerate(names):
        arrays[hp] = arrays.pop(f"{i}.output")
        for f in ("zarr.json", "manifest.json"):
            d = json.loads((store / "acts" / f"{i}.output" / f).read_text())
            (d["attributes"]["activationscope"] if f == "zarr.json" else d)["hook_point"] = hp
            (store / "acts" / f"{i}.output" / f).write_text(json.dumps(d))
    (store / "zarr.json").write_text(json.dumps(doc))
    page = report.write_report(str(tmp_path / "s.zarr"), tmp_path / "rep").read_text()
    imgs = dict((alt, src) for src, alt in re.findall(r"<img src='(hp_[^']+)' alt='([^']+)'>", page))
    assert sorted(imgs) == sorted(names) and len(set(imgs.values())) == 3
    for hp, src in imgs.items():
        assert len(src.encode()) <= 255 and (tmp_path / "rep" / src).is_file()
        assert re.fullmatch(r"hp_.+-[0-9a-f]{8}\.png", src)


def test_a_hook_point_without_rows_has_no_statistics(tmp_path):
    # every mask of the capture is empty for the token hook point: 0 rows, reductions that saw none
    import activationscope as acs
    from activationscope.analysis.probes import probe_store

    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4))
    scope = acs.ActivationScope(store=str(tmp_path / "z.zarr"), reductions=["mean", "var", "nonzero"])
    with scope.track(model, include=["1"]) as tracker, torch.no_grad():
        for _ in range(2):
            tracker.set_batch(attention_mask=torch.zeros(3, 5, dtype=torch.bool), label=[0, 1, 0])
            model(torch.randint(0, 10, (3, 5)))
    store = acs.open_store(str(tmp_path / "z.zarr"))
    assert store.n_rows("1.output") == 0
    st = report.hook_point_stats(store, "1.output")
    assert st.mean.isnan().all() and st.std.isnan().all() and st.nonzero.isnan().all()
    assert st.dead_fraction != st.dead_fraction and "no rows: no statistics" in report.unit_notes(st)
    assert probe_store(store).skipped == {"1.output": "it has no rows"}
    page = report.write_report(store, tmp_path / "rep").read_text()
    assert "<td>0</td><td>token</td><td>(4,)</td><td>float32</td><td>0 B</td><td>-</td>" in page
    assert "100.0%" not in page and "No probe for any hook point: it has no rows." in page


def test_values_nan_or_inf_left_out_of_the_histogram_are_counted(tmp_path):
    x = _relu_rows(n=40, d=4, dead=(2,))
    x[3, 1] = float("nan")
    x[7] = float("inf")
    st = report.hook_point_stats(TinyStore({"h": x}), "h")
    assert int(st.hist_counts.sum()) == 160 - 5
    assert st.notes == ["histogram: 5 of the 160 sampled values are NaN or inf and left out of it",
                        "mean / std: 4 of the 4 units have a NaN or inf mean or std (not plotted): some rows hold NaN "
                        "or inf, and the mean and std (from the sampled rows) count every row, where the PCA and the "
                        "probe leave those rows out"]
    assert st.pca_note == "2 row(s) with NaN or inf left out of the PCA"
    page = report.write_report(TinyStore({"h": x}), tmp_path / "rep", probes={}).read_text()
    assert "histogram: 5 of the 160 sampled values are NaN or inf and left out of it" in page
    assert report.hook_point_stats(TinyStore({"h": _relu_rows()}), "h").notes == []


def test_source_names_the_statistics_each_source_gave():
    x = _relu_rows(n=1000)
    mean = torch.full((16,), 7.0, dtype=torch.float64)
    var = torch.full((16,), 4.0, dtype=torch.float64)
    # a var reduction, no nonzero: mean and std over every row, the non-zero fraction from the sampled rows
    store = TinyStore({"h": x}, reductions={"h": {"var": var, "var.mean": mean}},
                      specs={"h": {"var": ("var", {"ddof": 0.0})}})
    st = report.hook_point_stats(store, "h", max_rows=100)
    torch.testing.assert_close(st.mean, mean)
    torch.testing.assert_close(st.std, torch.full((16,), 2.0, dtype=torch.float64))
    idx = torch.linspace(0, 999, 100).round().long()
    torch.testing.assert_close(st.nonzero, (x[idx] != 0).double().mean(0))
    assert st.source == "reductions (mean, std) and rows (100 of 1,000) (non-zero)"


def test_hook_points_with_dollar_signs_are_plotted_as_written(tmp_path):
    # a ModuleDict key may hold '$': matplotlib would read '$\foo$' as TeX math and fail
    names = ["d.$\\foo$.output", "d.a_$x.output", "d.$x^2$.output"]
    probes = {n: ProbeResult(accuracy=0.6, std=0.1, chance=0.5, n_samples=6, n_classes=2, n_folds=2) for n in names}
    index = report.write_report(TinyStore({n: torch.randn(6, 3) for n in names}), tmp_path / "rep", probes=probes)
    assert (tmp_path / "rep" / "probes.png").is_file() and "d.$\\foo$.output" in index.read_text()
    import matplotlib.pyplot as plt

    seen = []
    real = plt.Axes.set_xticklabels

    def spy(self, labels, *args, **kwargs):
        seen.extend(labels)
        return real(self, labels, *args, **kwargs)

    plt.Axes.set_xticklabels = spy
    try:
        report.plot_probes(probes, tmp_path / "p.png", 2)
    finally:
        plt.Axes.set_xticklabels = real
    assert seen == ["d.\\$\\foo\\$.output", "d.a_\\$x.output", "d.\\$x^2\\$.output"]  # '\\$': a literal '$'


def test_max_rows_is_checked_and_kept():
    x = _relu_rows(n=50)
    assert report.hook_point_stats(TinyStore({"h": x}), "h", max_rows=1).n_sampled == 1
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=f"max_rows must be a positive int, got {bad!r}"):
            report.hook_point_stats(TinyStore({"h": x}), "h", max_rows=bad)


def test_bins_is_checked_and_kept():
    # bins=0 / 2.5 / True raised torch's RuntimeError / TypeError naming histc, not the argument
    x = _relu_rows(n=50)
    assert len(report.hook_point_stats(TinyStore({"h": x}), "h", bins=7).hist_counts) == 7
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=f"bins must be a positive int, got {bad!r}"):
            report.hook_point_stats(TinyStore({"h": x}), "h", bins=bad)


def test_write_report_takes_one_name_or_patterns_of_hook_points(tmp_path):
    import activationscope as acs
    from activationscope.analysis.report import write_report
    from activationscope.errors import HookPointNotFoundError

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    torch.manual_seed(0)
    labels = [0, 1] * 10
    with acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(model) as tracker, torch.no_grad():
        tracker.set_batch(label=labels)
        model(torch.randn(20, 3) + torch.tensor(labels)[:, None])
    store = acs.open_store(str(tmp_path / "s.zarr"))
    # a pattern, as --hook-points takes it (it was looked up as a hook point: "not in the store")
    index = write_report(store, tmp_path / "a", hook_points=["[02].output"], n_folds=2)
    assert sorted(p.name for p in index.parent.glob("hp_*.png")) == ["hp_0_output.png", "hp_2_output.png"]
    # one name as a str (it was taken letter by letter)
    index = write_report(str(tmp_path / "s.zarr"), tmp_path / "b", hook_points="1.output", n_folds=2)
    assert [p.name for p in index.parent.glob("hp_*.png")] == ["hp_1_output.png"]
    assert "1.output" in index.read_text() and "2.output" not in index.read_text()
    with pytest.raises(HookPointNotFoundError, match=r"pattern '\[34\]\.output' matches no hook point"):
        write_report(store, tmp_path / "c", hook_points="[34].output")


def test_hook_point_stats_of_a_store_path_equal_those_of_the_open_store(tmp_path):
    import activationscope as acs
    from activationscope.analysis.report import hook_point_stats

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
    torch.manual_seed(0)
    with acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(model, include=["1"]), torch.no_grad():
        model(torch.randn(30, 3))
    store = acs.open_store(str(tmp_path / "s.zarr"))
    x = store["1.output"].double()
    got = hook_point_stats(str(tmp_path / "s.zarr"), "1.output")    # a path was indexed as a str: TypeError
    assert torch.allclose(got.mean, x.mean(0)) and torch.allclose(got.std, x.std(0, correction=0))
    assert torch.equal(got.nonzero, (x != 0).double().mean(0)) and got.n_rows == 30


def test_the_report_of_an_incomplete_store_says_it_covers_the_committed_samples_only(tmp_path, capsys):
    # a capture stopped by an exception after 3 of its forwards: the store holds those 3
    # (12 samples), status incomplete; the page and the command say what the figures cover
    import activationscope as acs
    from activationscope import cli

    x, labels = _separable_rows(n=40)
    model = torch.nn.Sequential(torch.nn.Identity())
    with pytest.raises(RuntimeError):
        with acs.ActivationScope(store=str(tmp_path / "k.zarr")).track(model) as tracker:
            for b in range(0, 40, 4):
                tracker.set_batch(label=labels[b:b + 4])
                tracker.model(x[b:b + 4])
                if b == 8:
                    raise RuntimeError("stopped")
    store = acs.open_store(str(tmp_path / "k.zarr"))
    assert store.status == "incomplete" and store.n_samples == 12
    stats = report.hook_point_stats(store, "0.output")
    torch.testing.assert_close(stats.mean, x[:12].double().mean(0), rtol=1e-12, atol=1e-12)
    page = report.write_report(store, tmp_path / "rep").read_text()
    note = ("incomplete store (its capture stopped before it closed, or is still running): every table, plot and "
            "probe here is over its 12 committed samples and their rows only; forwards after the last commit are "
            "not in the store")
    assert note in page
    assert cli.main(["report", str(tmp_path / "k.zarr"), "--out", str(tmp_path / "rep2")]) == 0
    assert f"activationscope report: note: {note}" in capsys.readouterr().out
    clean = _store_of_rows(tmp_path / "c.zarr", x, labels)
    assert "incomplete store" not in report.write_report(clean, tmp_path / "rep3").read_text()


def test_probe_refuses_nan_labels_naming_them():
    # NaN equals no label, not even itself: each would have been a class of one row, refused
    # as "n_folds must be between 2 and the smallest class's size (1)"
    import numpy as np

    from activationscope.analysis.probes import probe_accuracy
    from activationscope.errors import ArgumentValueError

    x, labels = _separable_rows(n=20)
    for bad in (torch.tensor([0.0, 1.0] * 9 + [float("nan")] * 2), np.array([0.0, 1.0] * 9 + [np.nan] * 2)):
        with pytest.raises(ArgumentValueError, match=r"labels hold 2 NaN value\(s\) of 20; NaN is no class"):
            probe_accuracy(x, bad, n_folds=2)
    keep = [i for i in range(20) if i < 18]
    assert probe_accuracy(x[keep], [labels[i] for i in keep], n_folds=2).n_samples == 18


def test_probe_store_of_an_incomplete_store_says_so_in_its_result_and_a_warning(tmp_path):
    # a capture stopped by an exception after 3 of its 10 forwards: the probes cover those 12
    # samples; the result said nothing of it (only the report and the CLI did)
    import warnings

    import activationscope as acs
    from activationscope.analysis.probes import probe_store

    x, labels = _separable_rows(n=40)
    path = tmp_path / "k.zarr"
    with pytest.raises(RuntimeError):
        with acs.ActivationScope(store=str(path)).track(torch.nn.Sequential(torch.nn.Identity())) as tracker:
            for b in range(0, 40, 4):
                tracker.set_batch(label=labels[b:b + 4])
                tracker.model(x[b:b + 4])
                if b == 8:
                    raise RuntimeError("stopped")
    with pytest.warns(acs.IncompleteStoreWarning) as caught:
        got = probe_store(str(path), n_folds=2)
    message = str(caught[0].message)
    assert str(path) in message and "incomplete" in message and "its 12 committed samples only" in message
    assert "resume" in message and "wait for it to close" in message
    assert got.status == "incomplete" and got.complete is False and got.n_store_samples == 12
    assert got["0.output"].n_samples == 12 and got["0.output"].n_folds == 2  # the other fields as they were
    assert isinstance(got["0.output"].accuracy, float)
    clean = _store_of_rows(tmp_path / "c.zarr", x, labels)
    with warnings.catch_warnings():
        warnings.simplefilter("error", acs.IncompleteStoreWarning)
        done = probe_store(clean, n_folds=2)
        report.write_report(str(path), tmp_path / "rep", n_folds=2)  # (the page says it: no warning too)
    assert done.status == "complete" and done.complete is True and done.n_store_samples == 40


def _probe_figure(monkeypatch, probes, tmp_path):
    """The figure plot_probes draws (captured as it is saved)."""
    import matplotlib.figure

    figures = []
    real = matplotlib.figure.Figure.savefig

    def keep(fig, *args, **kwargs):
        figures.append(fig)
        return real(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    report.plot_probes(probes, tmp_path / "p.png", 2)
    return figures[0].axes[0]


def test_probe_plot_draws_the_chance_of_each_hook_point(tmp_path, monkeypatch):
    # three hook points whose probes have different chances (0.5, 0.75, 0.6): one line at the
    # largest (0.75) was drawn for all, putting 0.5 and 0.6 probes under "chance"
    from matplotlib.collections import LineCollection

    chances = {"a.output": 0.5, "b.output": 0.75, "c.output": 0.6}
    probes = {n: ProbeResult(accuracy=0.8, std=0.05, chance=c, n_samples=40, n_classes=2, n_folds=2)
              for n, c in chances.items()}
    ax = _probe_figure(monkeypatch, probes, tmp_path)
    drawn = [c for c in ax.collections if isinstance(c, LineCollection) and c.get_label().startswith("chance")]
    assert len(drawn) == 1
    segments = drawn[0].get_segments()
    assert [float(s[0][1]) for s in segments] == [0.5, 0.75, 0.6]  # each at its own height
    assert [float(s[1][1]) for s in segments] == [0.5, 0.75, 0.6]
    assert [round(float(s[:, 0].mean()), 9) for s in segments] == [0, 1, 2]  # under its own point
    assert not [ln for ln in ax.lines if ln.get_label().startswith("chance")]  # no single line across
    # equal chances: one line across, at that chance
    same = {n: ProbeResult(accuracy=0.8, std=0.05, chance=0.5, n_samples=40, n_classes=2, n_folds=2)
            for n in chances}
    ax = _probe_figure(monkeypatch, same, tmp_path)
    lines = [ln for ln in ax.lines if ln.get_label().startswith("chance")]
    assert len(lines) == 1 and list(lines[0].get_ydata()) == [0.5, 0.5] and lines[0].get_label() == "chance (0.50)"


def test_probe_store_warns_when_reused_sample_ids_give_fewer_folds(tmp_path):
    # ids 0..3 given again in each of 6 forwards (a per-batch counter): the 24 samples are 4
    # groups, 2 per class, so 2-fold instead of 5; only the note said so, no warning
    import warnings

    import activationscope as acs
    from activationscope.analysis.probes import probe_store

    x, labels = _separable_rows(n=24)
    path = tmp_path / "r.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", acs.CaptureWarning)  # (the capture warns of the reused ids)
        with acs.ActivationScope(store=str(path)).track(torch.nn.Sequential(torch.nn.Identity())) as tracker:
            for b in range(0, 24, 4):
                tracker.set_batch(label=labels[b:b + 4], sample_ids=range(4))
                tracker.model(x[b:b + 4])
    with pytest.warns(acs.FewerGroupsWarning) as caught:
        got = probe_store(str(path), n_folds=5)
    r = got["0.output"]
    assert r.n_folds == 2 and r.n_groups == 4 and r.n_samples == 24 and len(r.fold_accuracies) == 2
    message = str(caught[0].message)
    assert message == ("hook point '0.output': 2-fold instead of 5: its 24 rows are 4 samples by (rank, sample_id), "
                       "each kept in one fold, and class 0 has 12 rows in 2 samples; if some ids were given again to "
                       "other samples, give each sample its own id")
    assert caught[0].filename == __file__
    with warnings.catch_warnings():  # own ids: 5 folds, no warning
        warnings.simplefilter("error", acs.FewerGroupsWarning)
        clean = probe_store(_store_of_rows(tmp_path / "c.zarr", x, labels), n_folds=5)
    assert clean["0.output"].n_folds == 5 and clean["0.output"].n_groups == 0


def _store_of_forwards(path, forwards):
    """A store of one Identity hook point captured from ``forwards``: ``(labels, sample_ids)``
    per forward, each row shifted by its label (separable classes)."""
    import warnings

    import activationscope as acs

    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", acs.CaptureWarning)  # (the capture warns of reused ids)
        with acs.ActivationScope(store=str(path)).track(torch.nn.Sequential(torch.nn.Identity())) as tracker:
            for labels, ids in forwards:
                tracker.set_batch(label=list(labels), sample_ids=list(ids))
                tracker.model(torch.randn(len(labels), 4, generator=g) + torch.tensor(labels, dtype=torch.float32)[:, None])
    return str(path)


def test_probe_store_says_when_a_small_class_not_reused_ids_gave_fewer_folds(tmp_path):
    # class 0 has 3 rows, each its own sample; class 1's 20 rows are 10 samples (ids given again in
    # a second forward): 3 folds, which one id per row would not have raised, yet the warning
    # told the user to give each sample its own id
    import activationscope as acs
    from activationscope.analysis.probes import probe_store

    path = _store_of_forwards(tmp_path / "s.zarr", [([0] * 3 + [1] * 10, range(13)), ([1] * 10, range(3, 13))])
    with pytest.warns(acs.FewerGroupsWarning) as caught:
        got = probe_store(path, n_folds=5)
    r = got["0.output"]
    assert r.n_folds == 3 and r.n_groups == 13 and r.n_samples == 23
    assert [str(w.message) for w in caught] == [
        "hook point '0.output': 3-fold instead of 5: the smallest class (0) has 3 labelled rows (3 samples by "
        "(rank, sample_id)), fewer than the 5 folds, not the rows sharing sample ids (its 23 rows are 13 samples); "
        "label more samples of class 0 or ask for fewer folds (n_folds=)"]
    assert caught[0].filename == __file__


def test_probe_store_says_when_both_reused_ids_and_a_small_class_gave_fewer_folds(tmp_path):
    # class 0's 4 rows are 2 samples (ids 0 and 1 given again), fewer than 5 rows too: one id per
    # row would give 4 folds, not 5; the warning names both causes and their numbers
    import activationscope as acs
    from activationscope.analysis.probes import probe_store

    path = _store_of_forwards(tmp_path / "s.zarr", [([0] * 2 + [1] * 20, range(22)), ([0] * 2, range(2))])
    with pytest.warns(acs.FewerGroupsWarning) as caught:
        got = probe_store(path, n_folds=5)
    r = got["0.output"]
    assert r.n_folds == 2 and r.n_groups == 22 and r.n_samples == 24
    assert [str(w.message) for w in caught] == [
        "hook point '0.output': 2-fold instead of 5: both the rows sharing sample ids and the smallest class bound "
        "the folds: its 24 rows are 22 samples by (rank, sample_id), each kept in one fold, and class 0 has 4 rows "
        "in 2 samples, and its 4 labelled rows are fewer than the 5 folds (one id per row would give 4-fold); "
        "if some ids were given again to other samples, give each sample its own id, and label more samples of "
        "class 0 or ask for fewer folds (n_folds=)"]


def test_probe_store_warnings_name_the_line_outside_the_package(tmp_path):
    # called from a function of the package (as the demo calls it), the warnings named that
    # function's line (stacklevel=2), not the user's
    import os

    import activationscope as acs
    from activationscope.analysis import probes

    x, labels = _separable_rows(n=24)
    reused = _store_of_forwards(tmp_path / "r.zarr", [(labels[b:b + 4], range(4)) for b in range(0, 24, 4)])
    incomplete = tmp_path / "k.zarr"
    with pytest.raises(RuntimeError):
        with acs.ActivationScope(store=str(incomplete)).track(torch.nn.Sequential(torch.nn.Identity())) as tracker:
            tracker.set_batch(label=labels[:8])
            tracker.model(x[:8])
            raise RuntimeError("stopped")
    inside = os.path.join(os.path.dirname(probes.__file__), "_caller.py")  # (a frame of the package, as demo's)
    caller = compile("def call(path):\n    return probe_store(path, n_folds=5)\n", inside, "exec")
    scope = {"probe_store": probes.probe_store}
    exec(caller, scope)
    for path, kind in ((reused, acs.FewerGroupsWarning), (str(incomplete), acs.IncompleteStoreWarning)):
        with pytest.warns(kind) as caught:
            scope["call"](path)
        assert [w.filename for w in caught if issubclass(w.category, kind)] == [__file__]


@pytest.mark.parametrize("reductions", [["mean", "var", "nonzero"], [], ["mean"]])
def test_units_whose_mean_or_std_a_nan_row_made_nan_are_named(tmp_path, reductions):
    # a NaN value and an inf row: the mean and std count every row (as numpy does over them),
    # so every unit's is NaN or inf and nothing was drawn, with nothing on the page saying why
    import numpy as np

    import activationscope as acs

    x = torch.randn(40, 5, generator=torch.Generator().manual_seed(0))
    x[3, 1], x[7] = float("nan"), float("inf")
    path = tmp_path / "n.zarr"
    with acs.ActivationScope(store=str(path), reductions=reductions).track(torch.nn.Sequential(torch.nn.Identity())) as tr:
        tr.set_batch(label=[0, 1] * 20)
        tr.model(x)
    st = report.hook_point_stats(str(path), "0.output")
    ref = x.double().numpy()
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(st.mean.numpy(), ref.mean(0))  # (NaN and inf where numpy has them)
    # (with a mean reduction only, the std is from the sampled rows: the note said both were
    # from the reductions)
    source = {3: "from the reductions", 0: "from the sampled rows",
              1: "the mean from the reductions, the std from the sampled rows"}[len(reductions)]
    note = (f"mean / std: 5 of the 5 units have a NaN or inf mean or std (not plotted): some rows hold NaN or inf, "
            f"and the mean and std ({source}) count every row, where the PCA and the probe leave those "
            "rows out")
    assert note in st.notes
    page = report.write_report(str(path), tmp_path / "rep").read_text()
    assert note in page
    clean = report.hook_point_stats(_store_of_rows(tmp_path / "c.zarr", x[8:], [0, 1] * 16), "0.output")
    assert not [n for n in clean.notes if n.startswith("mean / std")]


def test_report_without_matplotlib_names_the_install_and_makes_no_folder(tmp_path, monkeypatch, capsys):
    import sys

    from activationscope import cli

    x, labels = _separable_rows()
    _store_of_rows(tmp_path / "s.zarr", x, labels)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ImportError, match=r"matplotlib, which is not installed .*: pip install 'matplotlib>=3.8' "
                       r"\(the demo extra has it: pip install 'activationscope\[demo\]'\)"):
        report.write_report(tmp_path / "s.zarr", tmp_path / "rep")
    assert not (tmp_path / "rep").exists()
    assert cli.main(["report", str(tmp_path / "s.zarr"), "--out", str(tmp_path / "rep")]) == 1
    err = capsys.readouterr().err
    assert "activationscope report: error: the report draws its plots with matplotlib" in err
    assert not (tmp_path / "rep").exists()
