"""Linear probes: k-fold cross-validated L2-regularised logistic regression on activations,
per hook point of a store (one row per sample; token rows mean-pooled, :mod:`.pooling`; one
row per token for a per-token label column)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import (ActivationScopeError, ArgumentTypeError, ArgumentValueError, FewerGroupsWarning,
                      IncompleteStoreWarning, StoreError, column_hint, warn_at_caller)
from .pooling import _labelled_rows, _open, select_hook_points

__all__ = ["ProbeResult", "ProbeResults", "choose_folds", "drop_nonfinite_rows", "probe_accuracy", "probe_store"]


@dataclass
class ProbeResult:
    """k-fold cross-validated accuracy of a linear probe.

    Attributes
    ----------
    accuracy : float
        Mean accuracy over folds, in [0, 1].
    std : float
        Its standard deviation over folds (population: ``correction=0``).
    fold_accuracies : list of float
        One per fold, each in [0, 1].
    n_samples, n_features, n_classes : int
        The problem's size (``n_samples``: rows fitted, those left out not counted).
    chance : float
        Accuracy of always predicting the most frequent class, in [0, 1].
    n_folds : int
        Folds used.
    note : str
        Why they differ from the folds asked for ("" when they do not).
    n_dropped : int
        Rows holding NaN or inf, left out of the fit and of ``n_samples``.
    dropped_note : str
        Says how many rows were left out, and (:func:`probe_store`) how many samples had no
        label ("" when none).
    n_groups : int
        The samples whose rows the folds keep together when some sample has several rows
        (``groups`` of :func:`probe_accuracy`: the steps of a generation, the tokens of a
        sentence); 0 when every row is a sample of its own.
    """

    accuracy: float
    std: float
    fold_accuracies: list[float] = field(default_factory=list)
    n_samples: int = 0
    n_features: int = 0
    n_classes: int = 0
    chance: float = 0.0
    n_folds: int = 0
    note: str = ""
    n_dropped: int = 0
    dropped_note: str = ""
    n_groups: int = 0


class ProbeResults(dict):
    """``{hook point: ProbeResult}`` of :func:`probe_store`; ``skipped`` holds
    ``{hook point: reason}`` for the hook points it could not probe.

    ``status`` is the store's status when it was probed (``"complete"``, ``"incomplete"``:
    its capture stopped before it closed, or is still running; ``""`` for an object without
    one), ``complete`` is ``status != "incomplete"``, and ``n_store_samples`` the store's
    committed samples (``None`` when it does not say): the probes of an incomplete store are
    over those samples only."""

    def __init__(self) -> None:
        super().__init__()
        self.skipped: dict[str, str] = {}
        self.status: str = ""
        self.complete: bool = True
        self.n_store_samples: int | None = None


def _units(labels: Sequence[Any], groups: Sequence[Any] | None) -> list[int] | None:
    """The sample of each row (an index, in order of first appearance) when ``groups`` puts
    several rows in one sample, whether or not its rows share a label (a sentence's tokens
    with a tag each); else None (each row is a sample: no groups, or every group one row)."""
    if groups is None:
        return None
    groups = list(groups)
    if len(groups) != len(labels):
        raise ArgumentValueError(f"groups has {len(groups)} entries, expected one per row ({len(labels)})")
    index: dict[Any, int] = {}
    units = [index.setdefault(g, len(index)) for g in groups]
    return units if len(index) < len(units) else None


def _samples_per_class(labels: Sequence[Any], units: list[int]) -> dict[Any, int]:
    """``{class: number of samples holding a row of it}``, in order of first appearance."""
    seen: dict[Any, set[int]] = {}
    for u, v in zip(units, labels):
        seen.setdefault(v, set()).add(u)
    return {v: len(s) for v, s in seen.items()}


def _check_n_folds(n_folds: Any) -> int:
    """``n_folds`` as an int (Python or numpy) of at least 2; ArgumentValueError otherwise (a
    bool, a float, a str)."""
    if isinstance(n_folds, (bool, np.bool_)) or not isinstance(n_folds, (int, np.integer)) or n_folds < 2:
        raise ArgumentValueError(f"n_folds must be an int of at least 2, got {n_folds!r}")
    return int(n_folds)


def _check_seed(seed: Any) -> None:
    """ArgumentValueError unless ``seed`` is an int (Python or numpy; a bool is none)."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise ArgumentValueError(f"seed must be an int, got {seed!r}")


def choose_folds(labels: Sequence[Any], n_folds: int, groups: Sequence[Any] | None = None) -> tuple[int, str]:
    """Folds for a stratified cross-validation of ``labels``: ``n_folds``, or fewer when the
    smallest class has fewer samples (every fold needs one of each class). With ``groups``
    (the sample of each row, as :func:`probe_accuracy` takes it; some sample of several
    rows) a class's samples are the groups holding a row of it, whatever their other rows'
    labels: a group's rows stay in one fold.

    Parameters
    ----------
    labels : sequence or Tensor (rows,)
        Any hashable labels (0-d tensors and arrays are taken as their values).
    n_folds : int
        Folds asked for, at least 2.
    groups : sequence or Tensor (rows,), optional
        The sample of each row.

    Returns
    -------
    (folds, note) : int, str
        ``note`` says what was done when ``folds != n_folds`` ("" otherwise).

    Raises
    ------
    ArgumentTypeError
        ``labels`` or ``groups`` holding an entry that is no single hashable value (a list).
    ValueError
        Fewer than 2 classes, a class with a single sample, bool labels mixed with others
        (``True == 1``), ``labels`` or ``groups`` a tensor or array that is not 1-D, or
        ``n_folds`` not an int of at least 2 (ArgumentValueError).
    """
    n_folds = _check_n_folds(n_folds)
    labels = _one_per_row(labels, "labels")
    groups = None if groups is None else _one_per_row(groups, "groups")
    _check_label_types(labels)
    units = _units(labels, groups)
    if units is None:
        counts: dict[Any, int] = {}
        for v in labels:
            counts[v] = counts.get(v, 0) + 1
    else:  # a class's samples: the samples holding a row of it (a sample's rows stay in one fold)
        counts = _samples_per_class(labels, units)
    if len(counts) < 2:
        raise ArgumentValueError(f"a probe needs at least 2 classes, got {sorted(map(str, counts))}")
    smallest_class, smallest = min(counts.items(), key=lambda kv: kv[1])
    if smallest < 2:
        raise ArgumentValueError(
            f"class {smallest_class!r} has {smallest} labelled sample; a cross-validated probe needs at least 2 per class"
        )
    if smallest >= n_folds:
        return n_folds, ""
    if units is None or len(set(units)) == sum(counts.values()):  # each sample of one class
        return smallest, (f"{smallest}-fold instead of {n_folds}: the smallest class ({smallest_class!r}) has "
                          f"{smallest} labelled samples")
    return smallest, (f"{smallest}-fold instead of {n_folds}: class {smallest_class!r} is in {smallest} of the "
                      f"{max(units) + 1} samples, and a sample's rows stay in one fold")


def _is_bool(v: Any) -> bool:
    return isinstance(v, (bool, np.bool_))  # numpy bools too (np.True_ is not a bool)


def _columns_note(store: Any, hook_point: str, label_column: str) -> str:
    """``"; its columns are [...]"`` of the row tables that label ``hook_point``'s rows (the
    sample table's, and the token table's first for token rows), with the closest to
    ``label_column`` (a typo); where ``label_column`` is one of them, that no sample has a label
    there; ``""`` when they cannot be read."""
    names: list[str] = []
    try:
        for kind in ("token", "sample") if store.row_kind(hook_point) == "token" else ("sample",):
            names += [c for c in store.row_table(kind).column_names if c not in names]
    except (ActivationScopeError, AttributeError):  # (no reason to fail a probe: the note only helps)
        return ""
    if label_column in names:  # (the column is there: not one of its samples is labelled)
        return f"; every sample's {label_column!r} is missing, -1, -100 or empty"
    return f"; its columns are {names}{column_hint([label_column], names)}; pass one of them as the label column (label_column=; command line: --label-column)"


def _check_one_per_row(values: Any, what: str) -> None:
    """Refuse ``labels`` / ``groups`` that are not one hashable value per row: a tensor or
    array of another shape than ``(rows,)`` (one-hot labels ``(rows, n_classes)``), or entries
    that are lists (their classes could not be counted) or tensors of a dimension or more
    (hashed by identity: each would be a class, a group, of its own)."""
    shape = getattr(values, "shape", None)
    if isinstance(values, (torch.Tensor, np.ndarray)) and len(shape) != 1:
        raise ArgumentValueError(
            f"{what} must be 1-D, one value per row of x, got shape {tuple(shape)}"
            + ("; for one-hot labels pass labels.argmax(1)" if what == "labels" and len(shape) == 2 else ""))
    if isinstance(values, (torch.Tensor, np.ndarray)):
        return
    values = values if isinstance(values, (list, tuple)) else []  # (another iterable: checked once a list)
    for i, v in enumerate(values):
        try:
            if isinstance(v, torch.Tensor):
                raise TypeError(v)
            hash(v)
        except TypeError:
            raise ArgumentTypeError(
                f"{what} must hold one hashable value per row of x (an int, a str, ...), got {type(v).__name__} "
                f"{v!r} at row {i}") from None


def _one_per_row(values: Any, what: str) -> list[Any]:
    """``labels`` / ``groups`` as a list of one hashable value per row, checked by
    :func:`_check_one_per_row`; 0-d tensors and arrays (``list(tensor)`` holds them) become their
    Python values, as ``tensor.tolist()`` gives them (a tensor hashes by identity: each row
    would be a class, a group, of its own)."""
    if isinstance(values, (torch.Tensor, np.ndarray)):
        _check_one_per_row(values, what)  # (its shape: (rows, n_classes) one-hot labels are named so)
    values = values.tolist() if isinstance(values, torch.Tensor) else list(values)
    values = [v.item() if isinstance(v, (torch.Tensor, np.ndarray)) and v.ndim == 0 else v for v in values]
    _check_one_per_row(values, what)
    return values


def _check_label_types(labels: Sequence[Any]) -> None:
    """Refuse bool labels mixed with others: ``True == 1`` would merge two classes."""
    bools = [v for v in labels if _is_bool(v)]
    if bools and len(bools) != len(labels):
        other = next(v for v in labels if not _is_bool(v))
        raise ArgumentValueError(
            f"labels must be all bools or no bools, got bool {bools[0]!r} and {type(other).__name__} {other!r}: "
            "True equals 1 and False equals 0, so the probe would merge their classes; convert the labels to one "
            "type (e.g. int)")


def drop_nonfinite_rows(x: torch.Tensor, labels: Sequence[Any]) -> tuple[torch.Tensor, list[Any], int, str]:
    """``x`` and ``labels`` without the rows of ``x`` holding NaN or inf (as the PCA of
    :func:`.pca.explained_variance_ratio` leaves them out). Feature columns that are NaN or
    inf in every row are left out first (they would take every row with them), unless every
    column is.

    Parameters
    ----------
    x : Tensor, (rows, features), float
    labels : sequence (rows,)

    Returns
    -------
    (x, labels, n_dropped, note) : Tensor (kept rows, kept features) (``x`` itself when
        nothing is dropped, else a copy), list, int (rows left out), str (what was left out:
        rows, columns, and classes whose every row was left out; ``""`` when nothing is)

    Raises
    ------
    ArgumentValueError
        Every row holds NaN or inf; or fewer than 2 classes keep a row (the message names
        the classes whose rows were all left out).
    """
    x, labels, n_dropped, note, _ = _drop_nonfinite_rows(x, labels)
    return x, labels, n_dropped, note


def _drop_nonfinite_rows(x: torch.Tensor, labels: Sequence[Any]
                         ) -> tuple[torch.Tensor, list[Any], int, str, torch.Tensor | None]:
    """:func:`drop_nonfinite_rows` plus the rows kept (a bool mask; None when all are)."""
    notes = []
    if x.shape[0] and x.shape[1]:
        bad_cols = ~torch.isfinite(x).any(0)
        n_bad = int(bad_cols.sum())
        if 0 < n_bad < x.shape[1]:
            which = torch.nonzero(bad_cols).flatten().tolist()
            shown = ", ".join(map(str, which[:10])) + (", ..." if n_bad > 10 else "")
            notes.append(f"{n_bad} feature column(s) NaN or inf in every row left out of the probe (index {shown})")
            x = x[:, ~bad_cols]
    finite = torch.isfinite(x).all(1) if x.shape[0] else torch.ones(0, dtype=torch.bool)
    if bool(finite.all()):
        return x, list(labels), 0, "; ".join(notes), None
    n_dropped = int((~finite).sum())
    if n_dropped == x.shape[0]:
        raise ArgumentValueError(
            f"every one of the {n_dropped} rows holds NaN or inf; a probe needs finite activations "
            "(check the capture, e.g. its dtype: float16 overflows above 65504)")
    keep = finite.tolist()
    kept = [v for v, k in zip(labels, keep) if k]
    notes.insert(0, f"{n_dropped} row(s) with NaN or inf left out of the probe")
    lost = sorted(set(labels) - set(kept), key=str)
    if lost:
        left = sorted(set(kept), key=str)
        if len(left) < 2:
            raise ArgumentValueError(
                f"a probe needs at least 2 classes, but every row of class(es) {lost} holds NaN or inf: after "
                f"leaving out those {n_dropped} row(s) only class(es) {left} remain (check the capture, e.g. its "
                "dtype: float16 overflows above 65504)")
        notes.append(f"every row of class(es) {lost} held NaN or inf: the probe is over the other classes")
    return x[finite], kept, n_dropped, "; ".join(notes), finite


def _stratified_folds(y: torch.Tensor, n_folds: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    folds: list[list[torch.Tensor]] = [[] for _ in range(n_folds)]
    offset = 0
    for cls in torch.unique(y):
        idx = torch.nonzero(y == cls).flatten()
        idx = idx[torch.randperm(len(idx), generator=gen)]
        for j, part in enumerate(idx.tensor_split(n_folds)):
            folds[(j + offset) % n_folds].append(part)
        offset += len(idx) % n_folds
    return [torch.cat(f) if f else torch.empty(0, dtype=torch.long) for f in folds]


def _group_folds(y: torch.Tensor, units: list[int], n_folds: int, seed: int,
                 order: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Stratified group k-fold: each fold holds every row of its samples (``units``: the sample
    of each row), so that no sample is in a training fold and a test fold, and the folds' class
    distributions are kept as even as the samples allow. The algorithm of scikit-learn's
    ``StratifiedGroupKFold`` (Pedregosa et al., JMLR 12, 2011): the samples, shuffled with
    ``seed`` (or taken in ``order``), are sorted (stably) by the spread (std) of their class
    counts, largest first; each in turn goes to the fold that keeps the mean over classes of
    the std over folds of each class's share the least, the fold with fewer rows on a tie."""
    unit = torch.tensor(units, dtype=torch.long)
    n_units, n_classes = int(unit.max()) + 1, int(y.max()) + 1
    counts = np.zeros((n_units, n_classes))
    np.add.at(counts, (unit.numpy(), y.numpy()), 1.0)
    y_cnt = counts.sum(0)
    if order is None:
        order = torch.randperm(n_units, generator=torch.Generator().manual_seed(seed))
    order = order.numpy()
    spread = np.std(counts[order], axis=1)
    per_fold = np.zeros((n_folds, n_classes))
    fold_of_unit = np.empty(n_units, dtype=np.int64)
    rows = np.arange(n_folds)
    for g in order[np.argsort(-spread, kind="stable")]:
        trial = np.broadcast_to(per_fold, (n_folds, n_folds, n_classes)).copy()
        trial[rows, rows] += counts[g]  # trial[i]: the folds with g in fold i
        evals = np.std(trial / y_cnt, axis=1).mean(1)
        best, best_eval, best_rows = 0, np.inf, np.inf
        for i in range(n_folds):
            in_fold = per_fold[i].sum()
            if evals[i] < best_eval or (np.isclose(evals[i], best_eval) and in_fold < best_rows):
                best, best_eval, best_rows = i, evals[i], in_fold
        per_fold[best] += counts[g]
        fold_of_unit[g] = best
    fold_of_row = torch.from_numpy(fold_of_unit)[unit]
    return [torch.nonzero(fold_of_row == f).flatten() for f in range(n_folds)]


def _fit_predict(x_train, y_train, x_test, n_classes: int, l2: float, max_iter: int) -> torch.Tensor:
    """Fit on ``x_train`` and predict ``x_test``; both are the caller's own copies (the
    fold's rows), standardised in place: no further copy of the rows is made."""
    # scaled by each column's largest magnitude first, so that the mean and std of values near
    # the float64 limits (1e200: squares overflow) or far below 1 are computed in range
    scale = torch.maximum(x_train.amax(0), x_train.amin(0).neg_())  # max |x| without a copy of |x|
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    x_train.div_(scale)
    x_test.div_(scale)
    mean = x_train.mean(0)
    std = x_train.std(0, correction=0).clamp_min(1e-12)
    xt = x_train.sub_(mean).div_(std)
    xs = x_test.sub_(mean).div_(std)
    w = torch.zeros(xt.shape[1], n_classes, dtype=xt.dtype, requires_grad=True)
    b = torch.zeros(n_classes, dtype=xt.dtype, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(xt @ w + b, y_train) + l2 * (w * w).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    with torch.no_grad():
        return (xs @ w + b).argmax(1)


def _fold_accuracies(x: torch.Tensor, y: torch.Tensor, folds: list[torch.Tensor], n_classes: int, l2: float,
                     max_iter: int) -> list[float]:
    """The accuracy on each fold (its test rows) of a probe fitted on the other folds' rows."""
    accs = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (rows, d_model) problems this small only lose time to thread sync
    try:
        for test in folds:
            train_mask = torch.ones(len(y), dtype=torch.bool)
            train_mask[test] = False
            # each fold's rows as float64 copies, standardised in place by _fit_predict: no
            # float64 copy of every row is held (a wide bfloat16 store's is 4x its size)
            pred = _fit_predict(x[train_mask].to(torch.float64), y[train_mask], x[test].to(torch.float64),
                                n_classes, l2, max_iter)
            accs.append(float((pred == y[test]).double().mean()))
    finally:
        torch.set_num_threads(threads)
    return accs


def probe_accuracy(
    x: torch.Tensor,
    labels: Sequence[Any] | torch.Tensor,
    *,
    n_folds: int = 5,
    seed: int = 0,
    l2: float = 1e-2,
    max_iter: int = 100,
    groups: Sequence[Any] | torch.Tensor | None = None,
) -> ProbeResult:
    """k-fold cross-validated accuracy of an L2-regularised multinomial logistic regression.

    Folds are stratified by label and shuffled with ``seed`` (with ``groups``, a stratified
    group k-fold); features are standardised
    with the training fold's mean and std (computed after dividing each column by its
    largest magnitude, so values up to the float64 limit do not overflow); the model is
    fitted with L-BFGS (Liu & Nocedal, Math. Programming 45, 1989; ``torch.optim.LBFGS``)
    in float64. Feature columns NaN or inf in every row, then rows
    holding NaN or inf are left out (with their labels) before anything else; the result's
    ``n_dropped`` and ``dropped_note`` say how many (:func:`drop_nonfinite_rows`).

    Parameters
    ----------
    x : Tensor, (rows, *feature_shape), any real dtype, CPU
        One row per sample (features are flattened). Complex rows are refused (a float64 copy
        would drop their imaginary parts): pass ``torch.view_as_real(x)`` (real and imaginary
        parts as features), ``x.abs()`` or ``x.real``.
    labels : sequence or Tensor (rows,)
        Any hashable labels (ints, strings; 0-d tensors and arrays, as ``list(tensor)``
        holds, are taken as their values); at least 2 classes. Bools mixed with other
        labels are refused (``True == 1`` would merge two classes).
    n_folds : int, default 5
        Number of folds, at least 2 and at most the smallest class's size.
    seed : int, default 0
        Seed of the shuffle that assigns rows (or samples, with ``groups``) to folds; the
        same seed gives the same folds and the same result.
    l2 : float, default 1e-2
        Weight of the squared L2 norm of the weights in the loss (mean cross-entropy over a
        softmax of one weight column per class, on standardised rows). With 3 or more classes
        this is scikit-learn's multinomial ``LogisticRegression(C=1 / (2 * l2 * n_train))``; with
        2 classes, whose two columns act as one weight vector (their difference) with half the
        penalty, its binary ``LogisticRegression(C=1 / (l2 * n_train))``.
    max_iter : int, default 100
        Iterations of L-BFGS (``torch.optim.LBFGS(max_iter=...)``, strong Wolfe line search)
        per fold.
    groups : sequence or Tensor (rows,), optional
        The sample of each row (any hashable): rows of one sample (a generation's steps,
        each captured as a row with the sample's label; a sentence's tokens, each with its
        own tag or all with one) are kept in one fold, so that no sample is both trained on
        and tested. Folds are then a stratified group k-fold (scikit-learn's
        ``StratifiedGroupKFold`` algorithm, the samples shuffled with ``seed``: each fold's
        class shares as even as whole samples allow) and ``n_folds`` is at most the number
        of samples holding a row of the rarest class (so at most the number of samples).
        Used where some sample has several rows (else every row is a sample, as without
        ``groups``, and the folds are those of no ``groups``).

    Returns
    -------
    ProbeResult

    Raises
    ------
    ArgumentTypeError
        ``x`` is complex; ``labels`` or ``groups`` holding an unhashable entry (a list).
    ValueError
        ``labels`` or ``groups`` a tensor or array that is not 1-D; fewer than 2 classes (also after rows with NaN or inf are left out), bool labels
        mixed with others, NaN labels (no class: leave their rows out), mismatched lengths,
        ``n_folds`` not an int of at least 2, too few samples for ``n_folds``, or every row
        holding NaN or inf (:class:`ArgumentValueError`); ``seed`` not an int, ``max_iter``
        not a positive int, ``l2`` not a finite number of at least 0 (ArgumentValueError).
    """
    n_folds = _check_n_folds(n_folds)
    _check_seed(seed)
    if isinstance(max_iter, (bool, np.bool_)) or not isinstance(max_iter, (int, np.integer)) or max_iter < 1:
        raise ArgumentValueError(f"max_iter must be a positive int, got {max_iter!r}")
    if isinstance(l2, (bool, np.bool_)) or not isinstance(l2, (int, float, np.integer, np.floating)) \
            or not math.isfinite(l2) or l2 < 0:
        raise ArgumentValueError(f"l2 must be a finite number of at least 0, got {l2!r}")
    x = torch.as_tensor(x).detach().reshape(len(x), -1)
    if x.is_complex():
        raise ArgumentTypeError(f"x must be real, got {x.dtype}: {COMPLEX_ADVICE}")
    if not x.dtype.is_floating_point:  # (a float x stays in its dtype: each fold is made float64)
        x = x.to(torch.float64)
    labels = _one_per_row(labels, "labels")
    if len(labels) != x.shape[0]:
        raise ArgumentValueError(f"labels has {len(labels)} entries, expected one per row of x ({x.shape[0]})")
    _check_label_types(labels)
    n_nan = sum(1 for v in labels if isinstance(v, (float, np.floating)) and v != v)
    if n_nan:  # (NaN != NaN: each would be a class of its own, of one row)
        raise ArgumentValueError(
            f"labels hold {n_nan} NaN value(s) of {len(labels)}; NaN is no class (it equals no label, not even "
            "itself): leave those rows out first, e.g. keep = ~torch.isnan(labels); probe_accuracy(x[keep], "
            "labels[keep]) (probe_store leaves samples with a NaN or missing label out itself)")
    if groups is not None:
        groups = _one_per_row(groups, "groups")
        if len(groups) != len(labels):
            raise ArgumentValueError(f"groups has {len(groups)} entries, expected one per row of x ({len(labels)})")
    x, labels, n_dropped, dropped_note, kept = _drop_nonfinite_rows(x, labels)
    if groups is not None and kept is not None:
        groups = [g for g, k in zip(groups, kept.tolist()) if k]
    classes = sorted(set(labels), key=lambda v: (str(type(v)), v))
    if len(classes) < 2:
        raise ArgumentValueError(f"a probe needs at least 2 classes, got {classes!r}")
    index = {c: i for i, c in enumerate(classes)}
    y = torch.tensor([index[v] for v in labels], dtype=torch.long)
    counts = torch.bincount(y, minlength=len(classes))
    units = _units(labels, groups)
    # a class's samples: its rows, or the samples (groups) holding a row of it
    per_class = counts
    if units is not None:
        n_of = _samples_per_class(labels, units)
        per_class = torch.tensor([n_of[c] for c in classes], dtype=torch.long)
    if n_folds < 2 or int(per_class.min()) < n_folds:
        raise ArgumentValueError(
            f"n_folds must be between 2 and the smallest class's size ({int(per_class.min())}"
            f"{'' if units is None else ' samples'}), got {n_folds}"
        )
    folds = _stratified_folds(y, n_folds, seed) if units is None else _group_folds(y, units, n_folds, seed)
    empty = [i for i, f in enumerate(folds) if not len(f)]
    if empty:  # (not met: a fold left empty would make the std of the folds' shares larger)
        raise ArgumentValueError(f"fold(s) {empty} of {n_folds} got no sample; give fewer n_folds")
    accs = _fold_accuracies(x, y, folds, len(classes), l2, max_iter)
    t = torch.tensor(accs, dtype=torch.float64)
    return ProbeResult(
        accuracy=float(t.mean()),
        std=float(t.std(correction=0)),
        fold_accuracies=accs,
        n_samples=len(y),
        n_features=x.shape[1],
        n_classes=len(classes),
        chance=float(counts.max()) / len(y),
        n_folds=n_folds,
        n_dropped=n_dropped,
        dropped_note=dropped_note,
        n_groups=0 if units is None else max(units) + 1,
    )




#: What to probe instead of complex rows (a probe is of real values; float64 would drop the
#: imaginary parts).
COMPLEX_ADVICE = ("a probe takes real values; probe torch.view_as_real(x) (real and imaginary parts as features), "
                  "x.abs() or x.real with probe_accuracy")

OFF_TABLE = ("its rows do not follow the row table (store.follows_row_table() is False: first captured after "
             "some forwards, or another number of rows than the row table's, or none, in some forward), so no label "
             "lines up with them")


def _fewer_folds_message(hp: str, labels: Sequence[Any], groups: Sequence[Any], n_folds: int, result: Any) -> str:
    """The :class:`FewerGroupsWarning` of a hook point whose probe got fewer folds than
    ``n_folds`` while some rows share a sample id, saying what bounded the folds: the rows
    sharing ids (a class has rows enough, but in fewer samples), a class with too few rows
    (its samples would bound the folds even with an id per row), or both; with the numbers."""
    rows: dict[Any, int] = {}
    for v in labels:
        rows[v] = rows.get(v, 0) + 1
    units = _units(labels, groups)
    samples = _samples_per_class(labels, units) if units is not None else dict(rows)
    folds = result.n_folds
    by_samples, n_samples = min(samples.items(), key=lambda kv: kv[1])
    by_rows, n_rows = min(rows.items(), key=lambda kv: kv[1])
    head = f"hook point {hp!r}: {folds}-fold instead of {n_folds}: "
    grouped = (f"its {result.n_samples} rows are {result.n_groups} samples by (rank, sample_id), each kept in one "
               f"fold, and class {by_samples!r} has {rows[by_samples]} rows in {n_samples} samples")
    ids_fix = "if some ids were given again to other samples, give each sample its own id"
    class_fix = f"label more samples of class {by_rows!r} or ask for fewer folds (n_folds=)"
    if n_rows >= n_folds:  # one id per row would have given every fold asked for
        return f"{head}{grouped}; {ids_fix}"
    if n_rows <= folds:  # one id per row would not have given more folds
        return (f"{head}the smallest class ({by_rows!r}) has {n_rows} labelled rows ({samples[by_rows]} samples "
                f"by (rank, sample_id)), fewer than the {n_folds} folds, not the rows sharing sample ids (its "
                f"{result.n_samples} rows are {result.n_groups} samples); {class_fix}")
    small = "its" if by_rows == by_samples else f"class {by_rows!r}'s"
    return (f"{head}both the rows sharing sample ids and the smallest class bound the folds: {grouped}, and {small} "
            f"{n_rows} labelled rows are fewer than the {n_folds} folds (one id per row would give {n_rows}-fold); "
            f"{ids_fix}, and {class_fix}")


def probe_store(
    store: Any,
    hook_points: Sequence[str] | None = None,
    *,
    label_column: str = "label",
    n_folds: int = 5,
    seed: int = 0,
) -> dict[str, ProbeResult]:
    """A cross-validated linear probe (:func:`probe_accuracy`) per hook point of a store.

    Folds come from the class counts (:func:`choose_folds`): ``n_folds``, or as many as the
    smallest class has samples when that is fewer (each result's ``n_folds`` and ``note``
    say so). Hook points that cannot be probed (no rows, no ``label_column``, no labelled row, fewer
    than 2 classes, a class with a single sample, every row holding NaN or inf, rows that do
    not follow the row table because the hook point was first captured after some forwards,
    token rows whose labels cannot be paired with them because one forward gave one sample
    id to two samples of different labels)
    are left out of the result, with the reason in its ``skipped`` mapping. Samples without a
    label (missing, ``-1``, ``-100``, empty string) and rows holding NaN or inf are left out before the
    folds are chosen; each result's ``dropped_note`` says how many of each (``n_dropped``
    counts the rows with NaN or inf). Rows of one sample (its ``(rank, sample_id)``: the steps
    of ``set_batch(same_samples=True)``, each with the sample's label) are kept in one fold
    (``groups`` of :func:`probe_accuracy`); so are the token rows of a sample, in every forward
    of it, for a per-token label, one tag per sentence or one per token (training on some
    tokens of a sentence and testing on others would learn the sentence).
    Those folds are a stratified group k-fold, bounded by the samples of each class: a
    result's ``note`` says when that gives fewer folds than ``n_folds``; ``n_groups``
    counts the samples.

    Parameters
    ----------
    store : an open store, or a path / URL (opened read-only)
    hook_points : str or list of str, optional
        Hook point names or fnmatch patterns (``"pool.*"``; the rule of
        ``ActivationDataset(hook_points=...)``), in the order given; default: all.
    label_column : str, default "label"
        The row-table column holding the labels (per sample, or per token for token rows).
    n_folds : int, default 5
        Folds asked for (at least 2); fewer where the classes are too small (see above).
    seed : int, default 0
        As :func:`probe_accuracy`'s.

    Returns
    -------
    ProbeResults
        ``{hook point: ProbeResult}`` plus ``.skipped`` ``{hook point: reason}``, and the
        store's ``.status``, ``.complete`` and ``.n_store_samples``.

    Warns
    -----
    IncompleteStoreWarning
        The store is incomplete (a capture stopped before it closed, or still running): the
        probes are over its committed samples only (the result's ``complete`` is False,
        ``n_store_samples`` says how many); resume the capture or wait for it to close.
    FewerGroupsWarning
        A hook point whose rows share sample ids (kept in one fold) got fewer folds than
        ``n_folds``; says what bounded them: the rows sharing ids (a class's rows are fewer
        samples), a class with fewer labelled rows than ``n_folds``, or both, naming the
        rows, the samples (``n_groups``), the class and the folds used. Both warnings name
        the caller's line.

    Raises
    ------
    ArgumentValueError
        ``n_folds`` is not an int of at least 2, or ``seed`` no int (before any hook point
        is read).
    HookPointNotFoundError
        A name that is not a hook point of the store, or a pattern that matches none.
    """
    n_folds = _check_n_folds(n_folds)
    _check_seed(seed)  # (before any hook point: a bad seed is no reason to skip each of them)
    store = _open(store)
    out = ProbeResults()
    status = getattr(store, "status", "")
    out.status = status if isinstance(status, str) else ""
    out.complete = out.status != "incomplete"
    n = getattr(store, "n_samples", None)
    out.n_store_samples = n if isinstance(n, int) and not isinstance(n, bool) else None
    if not out.complete:
        held = "its committed samples" if out.n_store_samples is None else f"its {out.n_store_samples} committed samples"
        warn_at_caller(
            f"store {getattr(store, 'path', store)!r} is incomplete (its capture stopped before it closed, or is still "
            f"running): the probes are over {held} only; resume the capture (capture --resume, or store_options "
            "resume=True) or wait for it to close, then probe again", IncompleteStoreWarning)
    follows = getattr(store, "follows_row_table", None)
    for hp in select_hook_points(store, hook_points):
        if follows is not None and not follows(hp):
            out.skipped[hp] = OFF_TABLE
            continue
        dtype = store.dtype(hp) if callable(getattr(store, "dtype", None)) else None
        if isinstance(dtype, torch.dtype) and dtype.is_complex:
            out.skipped[hp] = f"its rows are complex ({str(dtype).replace('torch.', '')}): {COMPLEX_ADVICE}"
            continue
        if callable(getattr(store, "n_rows", None)) and store.n_rows(hp) == 0:
            out.skipped[hp] = "it has no rows"
            continue
        try:
            got = _labelled_rows(store, hp, label_column)
        except ActivationScopeError as e:  # labels that cannot be paired with the rows (one id twice in a forward)
            if isinstance(e, (StoreError, KeyError, ImportError)):  # a damaged store, an unknown hook point
                raise
            out.skipped[hp] = str(e)
            continue
        if got is None:
            out.skipped[hp] = f"the row table has no labelled {label_column!r} column" + _columns_note(store, hp, label_column)
            continue
        x, labels, n_unlabelled, groups = got
        unlabelled = (f"{n_unlabelled} sample(s) without a label (missing, -1, -100 or empty) left out"
                      if n_unlabelled else "")
        try:
            x = torch.as_tensor(x).detach().reshape(len(x), -1)
            # (a float x stays in its dtype: probe_accuracy makes each fold float64)
            x, labels, n_dropped, dropped_note, kept = _drop_nonfinite_rows(
                x if x.dtype.is_floating_point else x.to(torch.float64), labels)
            if groups is not None and kept is not None:
                groups = [g for g, k in zip(groups, kept.tolist()) if k]
            # rows of one sample (steps of set_batch(same_samples=True)) stay in one fold
            folds, note = choose_folds(labels, n_folds, groups)
            result = probe_accuracy(x, labels, n_folds=folds, seed=seed, groups=groups)
        except ValueError as e:
            out.skipped[hp] = f"{e} ({unlabelled})" if unlabelled else str(e)
            continue
        result.note = note
        if note and result.n_groups:  # fewer folds, with rows sharing a sample id
            warn_at_caller(_fewer_folds_message(hp, labels, groups, n_folds, result), FewerGroupsWarning)
        result.n_dropped = n_dropped
        result.dropped_note = "; ".join(n for n in (unlabelled, dropped_note) if n)
        out[hp] = result
    return out
