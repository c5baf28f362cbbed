"""An HTML report of a store: one page, PNG plots made with matplotlib (Agg).

Per hook point: a histogram of activation values, mean ± std per unit, the fraction of rows
where each unit is non-zero (dead units sit at 0; only when some value is exactly zero), and
PCA explained variance. A unit is a feature of ``(d,)`` rows and a channel of rows with 2 or
more dimensions (conv outputs, see :func:`hook_point_stats`); panels of more than
``MAX_PLOTTED_UNITS`` units show an evenly spaced subset and say so. Per store: a
table of hook points (row kind, rows, feature shape, dtype, bytes, dead-unit fraction) and,
when the row table has labels, the cross-validated accuracy of a linear probe per hook point
(see :func:`activationscope.analysis.probes.probe_store`).

Statistics come from the store's reductions where it has them, picked by their recorded
kind, not their name (a ``var`` or ``std`` reduction gives mean and variance over every row,
rescaled to ddof 0; ``mean`` the mean; ``nonzero`` the non-zero fraction) and otherwise from at most
``max_rows`` rows (fewer for rows wider than ``MAX_SAMPLED_BYTES`` allows), evenly spaced over
the store. Histograms and PCA always use those rows.
"""

from __future__ import annotations

import html
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import ArgumentValueError, column_hint, warn_at_caller
from ..sizes import format_bytes
from ..store._backend import enclosing_store, relation_to_store
from .pca import explained_variance_ratio
from .pooling import _open, select_hook_points
__all__ = ["HookPointStats", "hook_point_stats", "write_report"]

#: Units (flattened features) above which per-unit plots show an evenly spaced subset.
MAX_PLOTTED_UNITS = 4096
#: Features above which PCA is skipped (the covariance would be too large to decompose).
MAX_PCA_FEATURES = 4096
N_PCA_COMPONENTS = 50


@dataclass
class HookPointStats:
    """Statistics of one hook point, as plotted.

    Attributes
    ----------
    hook_point : str
    n_rows : int
        Committed rows of the hook point.
    feature_shape : tuple of int
        Shape of one row.
    dtype : str
        The stored dtype's name (``"float32"``, ``"bfloat16"``, ...).
    kind : str
        The row kind, ``"sample"`` or ``"token"``.
    n_bytes : int or None
        Bytes on disk of the hook point's shard files (``bytes_on_disk`` of
        ``store.info()``, the ``on disk`` column of ``activationscope info``), or None.
    mean, std, nonzero : Tensor, (units,), float64, CPU
        Per unit: a flattened feature, or with ``feature_axis`` a channel (statistics over
        rows and every other feature position); ``std`` with ddof 0, ``nonzero`` the fraction
        of values that are not 0.
    hist_counts : Tensor, (bins,), int64
    hist_edges : Tensor, (bins + 1,), float64
    explained : Tensor, (k,), float64, or None
        PCA explained variance ratio of the first k components, or None when PCA was
        skipped (``pca_note`` says why).
    dead_fraction : float
        Fraction of units that are zero in every row (from the ``nonzero`` reduction when
        the store has it, else from the sampled rows); NaN for a hook point without rows,
        whose mean, std and nonzero are NaN too.
    source : str
        "reductions", "rows (n of N)", or both with the statistics each gave
        (``"reductions (mean, std) and rows (n of N) (non-zero)"``): where mean / std /
        nonzero came from.
    n_sampled : int
        Rows sampled for the histogram, PCA and the statistics no reduction gave.
    pca_note : str
        Why PCA was skipped ("" when it was not).
    notes : list of str
        What the panels leave out, in words (sampled values NaN or inf, which the histogram
        cannot bin); shown on the page.
    unit_name : str
        ``"unit"`` or ``"channel"``.
    feature_axis : int or None
        The axis of ``feature_shape`` a channel indexes (None: every position is a unit).
    """

    hook_point: str
    n_rows: int
    feature_shape: tuple[int, ...]
    dtype: str
    kind: str
    n_bytes: int | None
    mean: torch.Tensor
    std: torch.Tensor
    nonzero: torch.Tensor
    hist_counts: torch.Tensor
    hist_edges: torch.Tensor
    explained: torch.Tensor | None
    dead_fraction: float
    source: str
    n_sampled: int
    pca_note: str = ""
    notes: list[str] = field(default_factory=list)
    unit_name: str = "unit"
    feature_axis: int | None = None


#: Bytes of float64 values of the rows sampled per hook point at most: wide rows (a
#: ``(pos, d_model)`` sample row of 128 x 768 values) are sampled fewer than ``max_rows``
#: times, so that the report's memory stays a small multiple of this, whatever the store.
MAX_SAMPLED_BYTES = 512 * 2**20


def _sample_rows(acts: torch.Tensor, max_rows: int) -> torch.Tensor:
    n = acts.shape[0]
    row_bytes = 8 * max(1, math.prod(acts.shape[1:]))
    max_rows = min(max_rows, max(2, MAX_SAMPLED_BYTES // row_bytes))
    if n <= max_rows:
        rows = acts
    else:
        idx = torch.linspace(0, n - 1, max_rows).round().long()
        rows = acts.index_select(0, idx)
    if rows.is_complex():  # (the modulus: float64 of the rows would drop their imaginary parts)
        rows = rows.abs()
    return rows.reshape(rows.shape[0], -1).to(torch.float64)


def _tensor(reds: Mapping[str, Any], key: str) -> torch.Tensor | None:
    value = reds.get(key) if reds else None
    return value.reshape(-1).to(torch.float64) if isinstance(value, torch.Tensor) else None


def _from_reductions(store: Any, hook_point: str, reds: Mapping[str, Any]
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(mean, population std, non-zero fraction) per feature from the stored reductions,
    picked by their recorded kind (a reduction named ``"mean"`` of kind ``max`` is not a
    mean) and per-feature option; a ``var`` / ``std`` with ``ddof`` d is rescaled to ddof 0
    by its count. Each is None when no reduction of a fitting kind is there."""
    specs_fn = getattr(store, "reduction_specs", None)
    try:
        specs = specs_fn(hook_point) if callable(specs_fn) and reds else {}
    except Exception:  # noqa: BLE001 - a store that cannot say: compute from rows
        specs = {}
    mean = std = nonzero = None
    for name, (kind, options) in specs.items():
        if float(options.get("per_feature", 1.0)) != 1.0:
            continue
        if kind == "mean" and mean is None:
            mean = _tensor(reds, name)
        elif kind in ("var", "std"):
            if mean is None:
                mean = _tensor(reds, f"{name}.mean")
            if std is not None:
                continue
            value = _tensor(reds, name)
            if value is None:
                continue
            var = value.clamp_min(0) if kind == "var" else value * value
            ddof = float(options.get("ddof", 0.0))
            if ddof:
                count = reds.get(f"{name}.count")
                n = float(count) if isinstance(count, torch.Tensor) and count.numel() == 1 else 0.0
                if n <= ddof:
                    continue
                var = var * (n - ddof) / n
            std = var.sqrt()
        elif kind == "nonzero" and nonzero is None:
            nonzero = _tensor(reds, name)
    return mean, std, nonzero


def hook_point_stats(
    store: Any,
    hook_point: str,
    *,
    max_rows: int = 20000,
    bins: int = 80,
    info: Mapping[str, Any] | None = None,
    feature_axis: int | None | str = "auto",
) -> HookPointStats:
    """Compute what the report plots for one hook point.

    Parameters
    ----------
    store : an open store (``activationscope.open_store``), or a path / URL (opened read-only)
    hook_point : str
    max_rows : int
        Rows sampled (evenly spaced) for histograms, PCA and missing reductions; fewer for
        wide rows, at most ``MAX_SAMPLED_BYTES`` (512 MiB) of float64 values (``source``
        and ``n_sampled`` say how many).
    bins : int
        Histogram bins over [min, max] of the sampled values, at least 1.
    info : dict, optional
        The store's ``store.info()``, when the caller has it (:func:`write_report` reads it
        once for every hook point): ``n_bytes`` comes from its ``bytes_on_disk``; None:
        ``n_bytes`` is None.
    feature_axis : int, None or "auto", default "auto"
        What a *unit* of the per-unit panels is. An int ``k``: the indices along axis ``k``
        of the feature shape, each reduced over rows and every other feature position (a
        conv output ``(C, H, W)`` with ``k = 0`` gives ``C`` channels over rows x H x W).
        None: every feature position is a unit. "auto": axis 0 (channels) for features of 3
        or more dimensions (``nn.Conv2d`` / ``Conv3d`` outputs), the last axis for 2
        (``(pos, d_model)`` rows of a sequence model captured without a mask), None for 1. Statistics
        from reductions are combined exactly (equal counts per position); dead channels are
        channels that are zero at every position of every row.
    """
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
        raise ArgumentValueError(f"max_rows must be a positive int, got {max_rows!r}")
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ArgumentValueError(f"bins must be a positive int, got {bins!r}")
    store = _open(store)
    acts = store[hook_point]
    n_rows = int(acts.shape[0])
    feature_shape = tuple(int(s) for s in acts.shape[1:])
    rows = _sample_rows(acts, max_rows) if n_rows else torch.zeros(0, max(1, math.prod(feature_shape)), dtype=torch.float64)
    units = rows.shape[1]
    refused = (getattr(store, "refused_reductions", None) or {}).get(hook_point)
    try:
        if refused:  # (an entry its readers refuse: no value of that hook point's reductions is used)
            reds = {}
        else:
            reds = store.reductions.get(hook_point, {}) if hasattr(store.reductions, "get") else store.reductions[hook_point]
    except (KeyError, AttributeError):
        reds = {}
    entry = _hp_info(info, hook_point)

    mean, std, nonzero = _from_reductions(store, hook_point, reds)
    reduced = [name for name, t in (("mean", mean), ("std", std), ("non-zero", nonzero))
               if t is not None and t.numel() == units]  # the statistics taken from reductions
    if "mean" not in reduced:
        mean = rows.mean(0) if len(rows) else torch.full((units,), math.nan, dtype=torch.float64)
    if "std" not in reduced:
        std = rows.std(0, correction=0) if len(rows) else torch.full((units,), math.nan, dtype=torch.float64)
    if "non-zero" not in reduced:
        nonzero = (rows != 0).double().mean(0) if len(rows) else torch.full((units,), math.nan, dtype=torch.float64)
    if feature_axis == "auto":  # channels first for conv maps, the last axis of (pos, d_model) rows
        axis = 0 if len(feature_shape) >= 3 else (-1 if len(feature_shape) == 2 else None)
    else:
        axis = feature_axis
    if axis is not None:
        if not isinstance(axis, int) or not -len(feature_shape) <= axis < len(feature_shape):
            raise ArgumentValueError(
                f"feature_axis must be None, 'auto' or an axis of the feature shape {feature_shape} of "
                f"{hook_point!r}, got {feature_axis!r}"
            )
        axis %= len(feature_shape)
        mean, std, nonzero = _per_channel(mean, std, nonzero, feature_shape, axis)
    n_units = mean.numel()
    # a hook point without rows (nor reductions) has no statistics: NaN, shown as '-'
    no_rows = bool(torch.isnan(nonzero).all()) if n_units else False
    dead_fraction = math.nan if no_rows else float((nonzero == 0).double().mean()) if n_units else 0.0

    finite = rows[torch.isfinite(rows)]
    notes = []
    if acts.dtype.is_complex:
        notes.append(f"{str(acts.dtype).replace('torch.', '')} values: every panel shows their modulus |x| "
                     "(the probe skips complex rows)")
    if refused:
        name, problem = next(iter(refused.items()))
        note = (f"reductions: the store's reduction {name!r} of this hook point is refused ({problem}), so its "
                "reductions are not used: mean, std and non-zero fraction are computed from the sampled rows")
        notes.append(note)
        warn_at_caller(f"hook point {hook_point!r}: {note}; capture that reduction again to use it", UserWarning)
    if finite.numel() < rows.numel():
        notes.append(f"histogram: {rows.numel() - finite.numel():,} of the {rows.numel():,} sampled values are NaN or inf "
                     "and left out of it")
    bad_units = int((~(torch.isfinite(mean) & torch.isfinite(std))).sum()) if n_units and not no_rows else 0
    if bad_units:  # (rows holding NaN or inf: the mean and std count every row, and are not plotted there)
        source = {name: "reductions" if name in reduced else "sampled rows" for name in ("mean", "std")}
        sources = (f"from the {source['mean']}" if source["mean"] == source["std"]
                   else f"the mean from the {source['mean']}, the std from the {source['std']}")
        notes.append(f"mean / std: {bad_units} of the {n_units} {'unit' if axis is None else ('channel' if axis == 0 else 'feature')}s "
                     f"have a NaN or inf mean or std (not plotted): some rows hold NaN or inf, and the mean and std "
                     f"({sources}) count every row, where the PCA and the probe leave those rows out")
    if finite.numel():
        finite = finite.double()
        lo, hi = float(finite.min()), float(finite.max())
        if lo == hi:
            lo, hi = lo - 0.5, hi + 0.5
        # values across most of the float64 range (-1e308 .. 1e308): hi - lo (or its product with
        # bins) overflows, and every value would fall in one bin; binned at a power-of-2 scale
        # (exact: the same bins), edges scaled back
        scale = 1.0 if math.isfinite((hi - lo) * bins) else 2.0 ** -(math.ceil(math.log2(bins)) + 2)
        counts = torch.histc(finite * scale, bins=bins, min=lo * scale, max=hi * scale).to(torch.int64)
        edges = torch.linspace(lo * scale, hi * scale, bins + 1, dtype=torch.float64) / scale
    else:
        counts = torch.zeros(bins, dtype=torch.int64)
        edges = torch.linspace(0, 1, bins + 1, dtype=torch.float64)

    explained, pca_note = explained_variance_ratio(rows, N_PCA_COMPONENTS, MAX_PCA_FEATURES)

    sampled = f"rows ({rows.shape[0]:,} of {n_rows:,})"
    source = ("reductions" if len(reduced) == 3 else sampled if not reduced else
              f"reductions ({', '.join(reduced)}) and {sampled} "
              f"({', '.join(n for n in ('mean', 'std', 'non-zero') if n not in reduced)})")
    return HookPointStats(
        hook_point=hook_point, n_rows=n_rows, feature_shape=feature_shape,
        dtype=str(acts.dtype).replace("torch.", ""), kind=_row_kind(store, hook_point, entry),
        n_bytes=_int_or_none(entry, "bytes_on_disk"),
        mean=mean, std=std, nonzero=nonzero, hist_counts=counts, hist_edges=edges,
        explained=explained, dead_fraction=dead_fraction, source=source, n_sampled=rows.shape[0],
        pca_note=pca_note, feature_axis=axis, notes=notes,
        unit_name="unit" if axis is None else ("channel" if axis == 0 else "feature"),
    )


def _per_channel(mean: torch.Tensor, std: torch.Tensor, nonzero: torch.Tensor, shape: tuple[int, ...],
                 axis: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-position mean / std / non-zero fraction (over the same rows) -> per channel of
    ``axis``: mean of means, sqrt(mean of (var + (mean - channel mean)^2)), mean of fractions.

    The law of total variance with deviations from the channel mean (Chan, Golub & LeVeque
    1979), not ``E[x^2] - E[x]^2``, which loses every digit of the std of maps far from 0."""
    def channels(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(shape).movedim(axis, 0).reshape(shape[axis], -1)

    m, sd, nz = channels(mean), channels(std), channels(nonzero)
    mean_c = m.mean(1)
    var_c = (sd * sd + (m - mean_c[:, None]) ** 2).mean(1)
    return mean_c, var_c.sqrt(), nz.mean(1)


def incomplete_note(store: Any) -> str:
    """What the report of an incomplete store covers, in words: its committed samples only."""
    n = getattr(store, "n_samples", None)
    held = f"its {n:,} committed samples" if isinstance(n, int) else "its committed samples"
    return (f"incomplete store (its capture stopped before it closed, or is still running): every table, plot and "
            f"probe here is over {held} and their rows only; forwards after the last commit are not in the store")


def _hp_info(info: Mapping[str, Any] | None, hp: str) -> Mapping[str, Any]:
    if not isinstance(info, Mapping):
        return {}
    arrays = info.get("arrays")
    entry = arrays.get(hp) if isinstance(arrays, Mapping) else None
    return entry if isinstance(entry, Mapping) else {}


def _row_kind(store: Any, hp: str, entry: Mapping[str, Any]) -> str:
    if hasattr(store, "row_kind"):
        try:
            return str(store.row_kind(hp))
        except (KeyError, ValueError):
            pass
    return str(entry.get("row_kind", "?"))


def _int_or_none(entry: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        if isinstance(entry.get(key), int):
            return entry[key]
    return None


# ---------------------------------------------------------------------------- plots


def _plt():
    """``matplotlib.pyplot`` on the Agg backend; ImportError naming the install when there is none."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(
            f"the report draws its plots with matplotlib, which is not installed ({e}): pip install 'matplotlib>=3.8' "
            "(the demo extra has it: pip install 'activationscope[demo]')") from None

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _units_subset(n: int) -> torch.Tensor:
    if n <= MAX_PLOTTED_UNITS:
        return torch.arange(n)
    return torch.linspace(0, n - 1, MAX_PLOTTED_UNITS).round().long()


def has_informative_nonzero(stats: HookPointStats) -> bool:
    """Whether the non-zero panel says anything: False when every unit is non-zero in every
    row (a layer without ReLU-like zeros would show a flat line at 1)."""
    return bool(stats.nonzero.numel()) and float(stats.nonzero.nan_to_num(1.0).min()) < 1.0


def plot_hook_point(stats: HookPointStats, path: str | os.PathLike) -> Path:
    """Write the four-panel PNG of one hook point; returns its path."""
    plt = _plt()
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.4), dpi=80)
    ax = axes[0]
    edges = stats.hist_edges.numpy()
    ax.stairs(stats.hist_counts.numpy(), edges, fill=True, color="#4c72b0")
    if bool((stats.hist_counts > 0).any()):  # a log axis needs a positive count (none for a hook point of 0 rows)
        ax.set_yscale("log")
    ax.set_title(f"activation values ({stats.n_sampled:,} rows)")
    ax.set_xlabel("value")
    ax.set_ylabel("count (log)")

    ax = axes[1]
    unit = stats.unit_name
    n_units = stats.mean.numel()
    idx = _units_subset(n_units)
    shown = "" if len(idx) == n_units else f"\n{len(idx):,} of {n_units:,} {unit}s shown, evenly spaced"
    order = torch.argsort(stats.mean[idx])
    m = stats.mean[idx][order].numpy()
    s = stats.std[idx][order].numpy()
    x = range(len(m))
    ax.fill_between(x, m - s, m + s, color="#dd8452", alpha=0.35, linewidth=0, label="± std")
    ax.plot(x, m, color="#c44e52", linewidth=1.2, label="mean")
    ax.set_title(f"mean ± std per {unit}{shown}")
    ax.set_xlabel(f"{unit} (sorted by mean)")
    ax.legend(loc="upper left", fontsize=8, frameon=False)

    ax = axes[2]
    if not has_informative_nonzero(stats):
        text = ("no rows: no statistics" if math.isnan(stats.dead_fraction) else
                f"no exact zeros: every {unit} is non-zero\nin every row (no dead {unit}s),\nso no non-zero panel")
        ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=10)
        ax.set_axis_off()
    else:
        nz = torch.sort(stats.nonzero[idx]).values.numpy()
        ax.plot(range(len(nz)), nz, color="#55a868", linewidth=1.5)
        ax.set_ylim(-0.03, 1.03)
        ax.set_title(f"non-zero fraction per {unit} (dead: {stats.dead_fraction:.1%}){shown}")
        ax.set_xlabel(f"{unit} (sorted)")
        ax.set_ylabel("fraction of rows ≠ 0" if unit == "unit" else "fraction of values ≠ 0")

    ax = axes[3]
    if stats.explained is not None:
        ev = stats.explained.numpy()
        k = range(1, len(ev) + 1)
        ax.bar(k, ev, color="#8172b3", label="per component")
        ax2 = ax.twinx()
        ax2.plot(k, ev.cumsum(), color="#333333", marker=".", linewidth=1, label="cumulative")
        ax2.set_ylim(0, 1.02)
        ax2.set_ylabel("cumulative")
        ax.set_title(f"PCA explained variance (first {len(ev)})")
        ax.set_xlabel("component" + (f"\n{stats.pca_note}" if stats.pca_note else ""))
        ax.set_ylabel("ratio")
    else:
        ax.text(0.5, 0.5, stats.pca_note or "PCA skipped", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def unit_notes(st: HookPointStats) -> list[str]:
    """What the per-unit panels of ``st`` show, in words: channels, subsampling, no zeros."""
    notes = []
    n = st.mean.numel()
    if st.feature_axis is not None:
        per = math.prod(st.feature_shape) // max(st.feature_shape[st.feature_axis], 1)
        notes.append(f"per-{st.unit_name} panels: the {n:,} channels along axis {st.feature_axis} of "
                     f"{st.feature_shape}, each over rows x {per:,} positions")
    if n > MAX_PLOTTED_UNITS:
        notes.append(f"per-{st.unit_name} panels show {MAX_PLOTTED_UNITS:,} of {n:,} {st.unit_name}s, evenly spaced "
                     "(after sorting the shown ones)")
    if not has_informative_nonzero(st):
        notes.append("no rows: no statistics" if math.isnan(st.dead_fraction) else
                     f"no non-zero panel: every {st.unit_name} is non-zero in every row")
    return notes


def _folds_used(probes: Mapping[str, Any], n_folds: int) -> int | str:
    """The folds of the probes shown: one number, or a range when they differ."""
    used = sorted({int(getattr(p, "n_folds", 0) or n_folds) for p in probes.values()})
    return used[0] if len(used) == 1 else f"{used[0]}-{used[-1]}"


def plot_probes(probes: Mapping[str, Any], path: str | os.PathLike, n_folds: int) -> Path:
    """Probe accuracy (mean ± std over folds) per hook point, with the chance level of each:
    one dashed line when every hook point has the same chance, else a short dashed line at
    each hook point's own chance (the probes' rows, labels or class balances differ: rows
    left out for NaN or inf, a per-token label on token hook points)."""
    plt = _plt()
    names = list(probes)
    acc = [probes[n].accuracy for n in names]
    err = [probes[n].std for n in names]
    chances = [float(probes[n].chance) for n in names]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(names) + 2), 3.6), dpi=80)
    ax.errorbar(range(len(names)), acc, yerr=err, marker="o", color="#4c72b0", capsize=3, label="probe accuracy")
    if len(set(chances)) == 1:
        ax.axhline(chances[0], color="#999999", linestyle="--", linewidth=1, label=f"chance ({chances[0]:.2f})")
    else:  # each hook point's own chance, a short line under its point
        ax.hlines(chances, [i - 0.35 for i in range(len(names))], [i + 0.35 for i in range(len(names))],
                  color="#999999", linestyle="--", linewidth=1.5,
                  label=f"chance of each hook point ({min(chances):.2f}-{max(chances):.2f})")
    ax.set_xticks(range(len(names)))
    # '$' escaped: matplotlib reads text between two '$' as TeX math (a module named '$\\foo$' would fail)
    ax.set_xticklabels([n.replace("$", "\\$") for n in names], rotation=30, ha="right", fontsize=9)
    ax.set_xlim(-0.6, len(names) - 0.4)
    ax.set_ylim(min(min(chances), min(acc) - max(err, default=0)) - 0.05, 1.0)
    ax.set_ylabel(f"accuracy ({n_folds}-fold CV)")
    ax.set_title("linear probe per hook point")
    ax.legend(loc="best", fontsize=8, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- html


_CSS = """
body { font-family: -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; margin: 24px 32px; color: #222; max-width: 1320px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
h3 { font-size: 14px; margin: 18px 0 4px; font-family: monospace; }
.meta { color: #555; font-size: 13px; } .meta code { background: #f3f3f3; padding: 1px 4px; }
table { border-collapse: collapse; font-size: 13px; margin-top: 8px; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: right; } th { background: #f5f5f5; }
td.l, th.l { text-align: left; font-family: monospace; }
img { max-width: 100%; } .note { color: #777; font-size: 12px; }
.status-complete { color: #2a7a2a; font-weight: 600; } .status-incomplete { color: #b03030; font-weight: 600; }
"""


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


def _unique_slugs(names: Sequence[str]) -> dict[str, str]:
    """``{hook point: file and anchor name}``: the hook point with every character but
    letters, digits, ``-`` and ``_`` made ``_``; where two hook points give the same name
    (``d.a_b.output`` and ``d.a.b.output``, or names equal but for case, which a
    case-insensitive file system mixes up) each of them gets ``-`` and 8 hex digits of the
    SHA-1 of the exact hook point appended; so does a name cut to its first 200 bytes (a
    file name has at most 255)."""
    import hashlib

    base = {n: _slug(n) for n in names}
    seen: dict[str, int] = {}
    for slug in base.values():
        seen[slug.lower()] = seen.get(slug.lower(), 0) + 1
    out = {}
    for n, slug in base.items():
        long = len(slug.encode()) > _MAX_SLUG_BYTES  # a file name has at most 255 bytes
        if long:
            slug = slug.encode()[:_MAX_SLUG_BYTES].decode("utf-8", "ignore")
        out[n] = slug if seen[base[n].lower()] == 1 and not long else f"{slug}-{hashlib.sha1(n.encode()).hexdigest()[:8]}"
    return out


#: Bytes of a hook point's name kept in its file name (``hp_<name>[-<hash>].png`` stays
#: within the 255 bytes a file name may have); a longer one is cut and gets the hash.
_MAX_SLUG_BYTES = 200


_PAGE_HEAD = "<!doctype html><html><head><meta charset='utf-8'>"
#: The line that marks a page as written by :func:`write_report` (a later report may replace it).
_GENERATOR = "<meta name='generator' content='activationscope report'>"


def _is_report(index: Path) -> bool:
    """Whether ``index`` is the ``index.html`` of an earlier :func:`write_report` (marked by
    :data:`_GENERATOR`; a page written before the mark by its first line and its meta block)."""
    try:
        with open(index, encoding="utf-8", errors="replace") as f:
            head = f.read(1 << 16)
    except OSError:  # a folder, a dangling link, unreadable
        return False
    lines = head.split("\n")
    if lines[0] != _PAGE_HEAD:
        return False
    return len(lines) > 1 and (lines[1] == _GENERATOR or (lines[1].startswith("<title>") and "<div class='meta'>" in head))


def _row_table_kinds(store: Any) -> tuple[str, ...]:
    """The kinds of row table ``store`` has: a store without rows of a kind reads an empty
    table of it, one that keeps reductions only (``rows_stored`` False) has no token table, and
    a store object with no ``row_table`` none. Asked of the store, never told by an error of a
    read: a table that cannot be read (a damaged part) raises."""
    if not callable(getattr(store, "row_table", None)):
        return ()
    return ("sample", "token") if getattr(store, "rows_stored", True) else ("sample",)


def check_out_dir(out_dir: str | os.PathLike) -> Path:
    """The local folder a report's ``out_dir`` names: a path (``~`` expanded) or a ``file://``
    URL's path, checked exactly as that path.

    Raises
    ------
    ArgumentValueError
        ``out_dir`` a URL of another filesystem (a report is local files), an existing
        file (the report is a folder), a folder inside an activationscope store (replacing
        that store would remove the report with it), one holding an ``index.html`` that
        is not an earlier report, or one this process may not write or create (a read-only
        folder or file system, or a file in its path). Nothing is written either way.
    """
    from ..errors import ArgumentValueError
    from ..store._backend import local_path

    local = local_path(out_dir)
    if local is None:
        raise ArgumentValueError(
            f"out_dir {os.fspath(out_dir)!r} must be a local folder or a file:// URL, got a URL of another "
            "filesystem; write the report to a local folder (nothing was written)")
    out = Path(local)
    if out.exists() and not out.is_dir():
        raise ArgumentValueError(
            f"out_dir {os.fspath(out_dir)!r} is a file; the report is a folder (index.html and its plots): give a "
            "folder path (created if missing)")
    other = enclosing_store(out)
    if other is not None:  # replacing that store (overwrite=True) would remove the report with it
        raise ArgumentValueError(
            f"out_dir {os.fspath(out_dir)!r} is inside the store {other!r}: the report would write its files among "
            "the store's (and capturing it again with overwrite=True removes its folder, the report with it); give "
            "a folder outside the store")
    index = out / "index.html"
    if (index.exists() or index.is_symlink()) and not _is_report(index):
        raise ArgumentValueError(
            f"out_dir {os.fspath(out_dir)!r} holds an index.html that is not an activationscope report: it and the "
            "folder's other files are left as they are; give another folder (or remove that index.html)"
        )
    # the folder is written, or created in the nearest folder that exists: refused here, before
    # the store is read, rather than as an OSError naming neither the argument nor a fix
    existing = out.resolve()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.is_dir() and not os.access(existing, os.W_OK | os.X_OK):
        where = "it" if existing == out.resolve() else f"its folder {str(existing)!r}"
        raise ArgumentValueError(
            f"out_dir {os.fspath(out_dir)!r}: {where} is not writable by this process (a read-only folder or file "
            "system); give a folder you may write (nothing was written)")
    if not existing.is_dir():
        raise ArgumentValueError(
            f"out_dir {os.fspath(out_dir)!r}: {str(existing)!r} is a file, so the folder cannot be created there; give "
            "a folder path (nothing was written)")
    return out


def write_report(
    store: Any,
    out_dir: str | os.PathLike,
    *,
    hook_points: Sequence[str] | None = None,
    probes: Mapping[str, Any] | None = None,
    label_column: str | None = None,
    n_folds: int = 5,
    title: str | None = None,
    max_rows: int = 20000,
    feature_axis: int | None | str = "auto",
) -> Path:
    """Write ``index.html`` and its PNGs into ``out_dir`` (created).

    Parameters
    ----------
    store : an open store, or a path / URL (opened read-only)
    out_dir : str or os.PathLike
        The report folder: a local path, or a ``file://`` URL checked exactly as the path it
        names (other URLs are refused, see :func:`check_out_dir`).
    hook_points : str or list of str, optional
        Hook points to show, names or fnmatch patterns (``"encoder.layer.*"``; the rule of
        ``ActivationDataset(hook_points=...)``), in the order given (default: all, in store
        order). A hook point whose rows do not
        follow the row table (``store.follows_row_table()`` False: first captured after some
        forwards) gets its statistics and plots but no probe; the page says why.
    probes : {hook point: ProbeResult}, optional
        Probe results to show; computed with :func:`activationscope.analysis.probes.probe_store` when
        None and the row table has ``label_column``.
    label_column : str, optional
        Row-table column with the labels the probes predict. Default: ``"label"`` when the
        store has one (no probes otherwise). A column named here must exist.
    n_folds : int, default 5
        Folds of the probes computed here (fewer when the smallest class is smaller; the
        page says so).
    title : str, optional
        The page's title and heading (HTML-escaped); default: "activationscope report".
    max_rows : int, default 20000
        Rows sampled per hook point for histograms and PCA (fewer for wide rows, see
        :func:`hook_point_stats`).
    feature_axis : int, None or "auto", default "auto"
        What a unit of the per-unit panels is (see :func:`hook_point_stats`): "auto" makes
        it a channel (axis 0) for rows of 3 or more dimensions (conv outputs), a feature of
        the last axis for 2 (``(pos, d_model)`` rows), every value for 1.

    Returns
    -------
    Path of ``index.html``.

    Raises
    ------
    ArgumentValueError
        ``n_folds`` below 2, a ``label_column`` that no row table of the store has, an
        ``out_dir`` inside the store, or one holding an ``index.html`` that is not an earlier
        report (nothing in the folder is changed; an earlier report's page and plots are
        replaced).
    StoreCorruptError
        A row table the report reads (its columns, for ``label_column``) cannot be read: a
        damaged or missing part, named (never taken as a store without that column).
    ImportError
        matplotlib is not installed (nothing is written, no folder made).
    """
    from ..errors import ArgumentValueError

    if isinstance(n_folds, bool) or not isinstance(n_folds, int) or n_folds < 2:
        raise ArgumentValueError(f"n_folds must be an int of at least 2, got {n_folds!r}")
    out = check_out_dir(out_dir)
    _plt()  # before the folder is made
    if isinstance(store, (str, os.PathLike)):
        from ..store import open_store

        store = open_store(os.fspath(store))
    if label_column is None:
        label_column = "label"
    else:
        columns: list[str] = []
        # (a table that cannot be read, a damaged part, raises its StoreError: never "no such column")
        for kind in _row_table_kinds(store):
            columns += [c for c in store.row_table(kind).column_names if c not in columns]
        if label_column not in columns:
            raise ArgumentValueError(
                f"label_column {label_column!r} is not a column of the row tables of the store {str(store.path)!r}; "
                f"they have {columns}{column_hint([label_column], columns)}"
            )
    if relation_to_store(out, store) == "inside":
        raise ArgumentValueError(
            f"out_dir {str(out_dir)!r} is inside the store {store.path!r}: the report would write its files among "
            "the store's; give a folder outside the store"
        )
    index = out / "index.html"
    earlier = index.exists() or index.is_symlink()  # (an earlier report: check_out_dir refused any other)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # (check_out_dir found it writable: a race, or a file system that says so wrongly)
        raise ArgumentValueError(
            f"out_dir {os.fspath(out_dir)!r}: cannot create the folder: {e.strerror or e}; give a folder you may write "
            "(nothing was written)") from None
    if earlier:  # plots of the earlier report here (only then: other PNGs in a folder are not ours)
        for stale in [*out.glob("hp_*.png"), out / "probes.png"]:
            stale.unlink(missing_ok=True)
    hps = select_hook_points(store, hook_points)
    info = store.info() if hasattr(store, "info") else {}
    if probes is None:
        from .probes import probe_store

        from ..errors import FewerGroupsWarning, IncompleteStoreWarning

        with warnings.catch_warnings():  # (the page says both: the store's status, the folds used)
            warnings.simplefilter("ignore", IncompleteStoreWarning)
            warnings.simplefilter("ignore", FewerGroupsWarning)
            probes = probe_store(store, hps, label_column=label_column, n_folds=n_folds)

    slugs = _unique_slugs(hps)
    stats = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many small reductions: thread sync costs more than it saves
    try:
        for hp in hps:
            st = hook_point_stats(store, hp, max_rows=max_rows, info=info, feature_axis=feature_axis)
            plot_hook_point(st, out / f"hp_{slugs[hp]}.png")
            stats.append(st)
    finally:
        torch.set_num_threads(threads)
    probe_png = None
    if probes:
        probe_png = plot_probes(probes, out / "probes.png", _folds_used(probes, n_folds))

    status = info.get("status") if isinstance(info, Mapping) else None
    if isinstance(status, Mapping):
        status = status.get("status", status.get("state"))
    prov = info.get("provenance") if isinstance(info, Mapping) else None
    path = getattr(store, "path", None) or getattr(store, "url", None) or ""

    e = html.escape
    parts = [
        _PAGE_HEAD,
        _GENERATOR,
        f"<title>{e(title or 'activationscope report')}</title><style>{_CSS}</style></head><body>",
        f"<h1>{e(title or 'activationscope report')}</h1>",
        "<div class='meta'>",
        f"store <code>{e(str(path))}</code>" if path else "",
        f" &middot; status <span class='status-{e(str(status))}'>{e(str(status))}</span>" if status else "",
        f" &middot; {len(hps)} hook points",
        "</div>",
    ]
    if status == "incomplete":  # what every figure below covers: the committed forwards only
        parts.append(f"<div class='meta'>{e(incomplete_note(store))}</div>")
    if isinstance(prov, Mapping) and prov:
        items = []
        for key in ("model", "data", "command", "torch", "activationscope"):
            if key in prov and not isinstance(prov[key], (Mapping, list)):
                items.append(f"{e(key)}: <code>{e(str(prov[key]))}</code>")
        if items:
            parts.append("<div class='meta'>" + " &middot; ".join(items) + "</div>")

    parts.append("<h2>Hook points</h2><table><tr><th class='l'>hook point</th><th>rows</th><th>kind</th>"
                 "<th>feature shape</th><th>dtype</th><th>on disk</th><th>dead units</th><th>PCA top-10</th>"
                 "<th>probe accuracy</th></tr>")
    for st in stats:
        p = probes.get(st.hook_point) if probes else None
        top10 = "-" if st.explained is None else f"{float(st.explained[:10].sum()):.1%}"
        parts.append(
            f"<tr><td class='l'><a href='#{slugs[st.hook_point]}'>{e(st.hook_point)}</a></td><td>{st.n_rows:,}</td>"
            f"<td>{e(st.kind)}</td><td>{e(str(st.feature_shape))}</td><td>{e(st.dtype)}</td>"
            f"<td>{format_bytes(st.n_bytes)}</td><td>{'-' if math.isnan(st.dead_fraction) else f'{st.dead_fraction:.1%}'}</td><td>{top10}</td>"
            f"<td>{'-' if p is None else f'{p.accuracy:.3f} ± {p.std:.3f}'}</td></tr>"
        )
    parts.append("</table>")

    if probe_png is not None:
        folds = _folds_used(probes, n_folds)
        notes = sorted({getattr(p, "note", "") for p in probes.values()} - {""})
        parts.append("<h2>Linear probes</h2>")
        # a per-token label column labels each token row (probed as it is, not pooled)
        per_token = "token" in _row_table_kinds(store) and label_column in store.row_table("token").column_names
        rows = (f"one row per token row of token hook points (the label column {label_column!r} is per token; "
                "sample rows as they are)" if per_token else
                "one row per sample (token rows mean-pooled per sample)")
        # the size of each problem: one line when every hook point has the same, else one per
        # size naming its hook points (rows left out for NaN or inf differ between hook points)
        by_size: dict[tuple[int, int, int, float], list[str]] = {}
        for hp, p in probes.items():
            key = (p.n_samples, getattr(p, "n_groups", 0), p.n_classes, p.chance)
            by_size.setdefault(key, []).append(hp)

        def size(key: tuple[int, int, int, float]) -> str:
            # (samples with several rows, kept in one fold each: the steps of a generation)
            samples = f"{key[1]} labelled samples in {key[0]} rows" if key[1] else f"{key[0]} labelled samples"
            return f"{samples}, {key[2]} classes, chance {key[3]:.3f}"

        grouped = any(getattr(p, "n_groups", 0) for p in probes.values())
        parts.append(
            f"<p class='note'>L2-regularised logistic regression on {e(rows)}, {folds}-fold stratified "
            + ("group " if grouped else "")
            + "cross-validation" + (" (the rows of a sample kept in one fold)" if grouped else "")
            + (f", {size(next(iter(by_size)))}.</p>" if len(by_size) == 1 else ", on problems of different sizes:</p>")
        )
        if len(by_size) > 1:
            for key, which_hps in by_size.items():
                parts.append(f"<p class='note'>{e(', '.join(which_hps))}: {size(key)}.</p>")
        for note in notes:
            parts.append(f"<p class='note'>Folds chosen from the class counts: {e(note)}.</p>")
        by_note: dict[str, list[str]] = {}  # one line per note, naming every hook point it is about
        for hp, p in probes.items():
            if getattr(p, "dropped_note", ""):
                by_note.setdefault(p.dropped_note, []).append(hp)
        for note, which_hps in by_note.items():
            parts.append(f"<p class='note'>{e(', '.join(which_hps))}: {e(note)}.</p>")
        parts.append(f"<img src='{probe_png.name}' alt='probe accuracy per hook point'>")
    skipped = getattr(probes, "skipped", {}) if probes is not None else {}
    if skipped:
        by_reason: dict[str, list[str]] = {}
        for hp, reason in skipped.items():
            by_reason.setdefault(reason, []).append(hp)
        for reason, which_hps in sorted(by_reason.items()):
            which = "any hook point" if not probes and len(by_reason) == 1 else ", ".join(sorted(which_hps))
            parts.append(f"<p class='note'>No probe for {e(which)}: {e(reason)}.</p>")
    elif probes is not None and not probes:
        parts.append(f"<p class='note'>No probe: the row table has no usable '{e(label_column)}' column.</p>")

    parts.append("<h2>Per hook point</h2>")
    for st in stats:
        parts.append(f"<h3 id='{slugs[st.hook_point]}'>{e(st.hook_point)}</h3>")
        parts.append(
            f"<div class='note'>{st.n_rows:,} rows &times; {e(str(st.feature_shape))} {e(st.dtype)}; "
            f"mean/std/non-zero from {e(st.source)}</div>"
        )
        for note in [*st.notes, *unit_notes(st)]:
            parts.append(f"<div class='note'>{e(note)}</div>")
        parts.append(f"<img src='hp_{slugs[st.hook_point]}.png' alt='{e(st.hook_point)}'>")
    parts.append("</body></html>")
    index.write_text("\n".join(p for p in parts if p), encoding="utf-8")
    return index
