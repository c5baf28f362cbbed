"""Pooling token rows into one row per sample, and reading a hook point back that way."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["labelled_rows", "pool_by_sample", "select_hook_points", "sentence_rows"]


def select_hook_points(store: Any, hook_points: Any) -> list[str]:
    """The hook points of ``store`` that ``hook_points`` names, in the order given (the
    hook points a pattern matches in store order; each once).

    The rule of ``ActivationDataset(hook_points=...)``, ``export_parquet`` and the command
    line's ``--hook-points``: a str is one name or fnmatch pattern, a list holds several;
    a pattern equal to a hook point selects that hook point only; None selects them all.

    Parameters
    ----------
    store : an open store (``hook_points``, as :func:`activationscope.open_store` gives)
    hook_points : str, iterable of str or None

    Returns
    -------
    list of str

    Raises
    ------
    HookPointNotFoundError
        A name that is not a hook point of the store, or a pattern that matches none (the
        message lists the hook points there are); None for a store without hook points.
    ArgumentValueError
        An empty list.
    ArgumentTypeError
        ``hook_points`` neither a str nor an iterable of str.
    """
    from ..data.dataset import select_hook_points as select

    class _Named:  # (what that rule reads of a store: its hook points, and how to name it)
        hook_points = list(store.hook_points)

        def describe(self) -> str:
            return repr(getattr(store, "path", store))

    return select(_Named(), hook_points)


def _open(store: Any) -> Any:
    """An open store: a path or URL is opened read-only, anything else is returned as it is."""
    import os

    if isinstance(store, (str, os.PathLike)):
        from ..store import open_store

        return open_store(os.fspath(store))
    return store


def pool_by_sample(rows: torch.Tensor, sample_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean of token rows per sample.

    A sample is what ``sample_ids`` names: one id per row (the row table's ``sample_id``
    column of the same rows), or a row of key columns per row, ``(rows, k)``. The ids of a
    store written by several ranks count per rank (rank 0 and rank 1 both have a sample 0),
    so there a sample is ``(rank, sample_id)``: pass ``torch.stack([rank, sample_id], 1)``
    (the id column alone would pool the rows of two samples into one); add ``batch`` to keep
    the forwards of one sample (``set_batch(same_samples=True)`` steps) apart.

    Parameters
    ----------
    rows : Tensor, (rows, *feature_shape)
    sample_ids : Tensor, (rows,) or (rows, k), int64

    Returns
    -------
    (ids, pooled) : Tensor (n_samples,) or (n_samples, k) sorted unique ids (keys sorted as
        tuples), Tensor (n_samples, *feature_shape) float64 (complex128 for complex rows)

    Raises
    ------
    ArgumentValueError
        ``sample_ids`` is not 1-D or 2-D with one id (row of keys) per row of ``rows``.
    """
    if sample_ids.dim() not in (1, 2) or len(sample_ids) != len(rows) or (sample_ids.dim() == 2
                                                                          and sample_ids.shape[1] == 0):
        from ..errors import ArgumentValueError

        raise ArgumentValueError(
            f"sample_ids must be 1-D with one id per row of rows ({len(rows)} rows), or 2-D with a row of key "
            f"columns per row (rank, sample_id), got shape {tuple(sample_ids.shape)}; pass the row table's "
            "sample_id column of the same rows (with its rank column, stacked, for a store of several ranks)"
        )
    ids, inverse = torch.unique(sample_ids, dim=0, return_inverse=True)
    # (complex rows in complex128: float64 would drop their imaginary parts)
    dtype = torch.complex128 if rows.is_complex() else torch.float64
    flat = rows.reshape(rows.shape[0], -1).to(dtype)
    total = torch.zeros(len(ids), flat.shape[1], dtype=dtype).index_add_(0, inverse, flat)
    count = torch.bincount(inverse, minlength=len(ids)).to(torch.float64).unsqueeze(1)
    return ids, (total / count).reshape(len(ids), *rows.shape[1:])


#: Labels that mark a sample unlabelled: -1 (the demo's --corpus articles) and -100
#: (``ignore_index`` of ``torch.nn.CrossEntropyLoss``, which Hugging Face token-classification
#: datasets put on tokens that carry no label); ints, or the same values of a float label column
#: (a float tensor given to ``set_batch(label=...)``: -1.0 is -1).
UNLABELLED_INTS = (-1, -100)


def _is_label(v: Any) -> bool:
    if v is None:
        return False
    if isinstance(v, float) and v != v:  # NaN
        return False
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v in UNLABELLED_INTS:
        return False  # (-1.0 and -100.0 of a float label column too); other negative numbers are classes
    return not (isinstance(v, str) and v == "")


def sentence_rows(
    store: Any, hook_point: str, label_column: str = "label", batch_size: int = 8192
) -> tuple[torch.Tensor, list[Any]] | None:
    """Read one hook point back through ``ActivationDataset`` + ``DataLoader``, one row per sample.

    Token rows are mean-pooled per sample (exactly the masked mean, since padding never
    enters the store); a sample is a ``(rank, batch, sample_id)`` of the row table (those of
    the three it has, as ``ActivationDataset`` joins per-sample columns), so ids repeated
    across forwards or ranks (default ids count per rank) stay separate samples. Sample rows
    are used as they are, one per row, and so are token rows when ``label_column`` is a
    per-token column (given to ``set_batch`` with shape ``(batch, pos)``: a label per token).
    Unlabelled rows (missing label, ``-1``, ``-100`` as int or float, empty string) are dropped.
    Token rows are summed per sample batch by batch: memory holds one batch of rows and one
    float64 row per sample, not every token row.

    ``hook_point`` is one hook point: a name, or a pattern that matches exactly one (else
    :class:`~activationscope.errors.ArgumentValueError` naming those it matches).

    Parameters
    ----------
    store : str, os.PathLike, or Store
        A store path or URL, or an open store (as :class:`~activationscope.data.ActivationDataset`
        takes it).
    hook_point : str
        One hook point, or a pattern matching exactly one.
    label_column : str, default "label"
        The row-table column holding the labels.
    batch_size : int, default 8192
        Rows read per batch (memory: one batch of rows at a time).

    Raises
    ------
    ArgumentTypeError
        ``batch_size`` is no int.
    ArgumentValueError
        ``batch_size`` is below 1, or ``hook_point`` a pattern matching several hook points.
    HookPointNotFoundError
        ``hook_point`` names no hook point of the store.

    Returns
    -------
    (x, labels) : Tensor (n_samples, *feature_shape) float64 (complex128 for complex rows;
        samples in store order), list of labels; or None when the store's row table has no
        ``label_column``.
    """
    got = labelled_rows(store, hook_point, label_column, batch_size)
    return None if got is None else (got[0].to(torch.complex128 if got[0].is_complex() else torch.float64), got[1])


def labelled_rows(
    store: Any, hook_point: str, label_column: str = "label", batch_size: int = 8192
) -> tuple[torch.Tensor, list[Any], int] | None:
    """:func:`sentence_rows` plus the number of samples left out for having no label
    (missing, ``-1``, ``-100``, empty string): ``(x, labels, n_unlabelled)``, or None. Sample rows
    come in their stored dtype (a float64 copy of a wide store is 4x a bfloat16 one; the
    probe makes each fold float64), pooled token rows in float64 (complex128 for complex rows).

    Parameters
    ----------
    store, hook_point, label_column, batch_size
        As in :func:`sentence_rows` (``store``: str, os.PathLike or Store; ``hook_point``: str;
        ``label_column``: str; ``batch_size``: int, rows).

    Raises
    ------
    ArgumentTypeError, ArgumentValueError, HookPointNotFoundError
        As :func:`sentence_rows` raises them.
    """
    got = _labelled_rows(store, hook_point, label_column, batch_size)
    return None if got is None else got[:3]


def _labelled_rows(
    store: Any, hook_point: str, label_column: str = "label", batch_size: int = 8192
) -> tuple[torch.Tensor, list[Any], int, list[Any] | None] | None:
    """:func:`labelled_rows` plus the sample of each row, ``(rank, sample_id)`` (those of the
    two the row table has), for a per-sample label: rows of one sample in several forwards
    (the steps of ``set_batch(same_samples=True)``) are one sample, which a probe keeps in one
    fold. For a per-token label, the ``(rank, sample_id)`` of each token row too: the tokens of
    one sample, in every forward of it."""
    import pyarrow.compute as pc
    from torch.utils.data import DataLoader

    from ..data import ActivationDataset
    from ..errors import ArgumentTypeError, ArgumentValueError

    # (checked here, not by the DataLoader: its ValueError names neither this function nor the fix)
    if isinstance(batch_size, (bool, np.bool_)) or not isinstance(batch_size, (int, np.integer)):
        raise ArgumentTypeError(f"batch_size must be an int (rows read per batch), got {batch_size!r} "
                                f"({type(batch_size).__name__})")
    if batch_size < 1:
        raise ArgumentValueError(f"batch_size must be a positive int (rows read per batch), got {batch_size}")
    batch_size = int(batch_size)  # (the DataLoader refuses a numpy int)
    ds = ActivationDataset(store, hook_points=[hook_point])
    if len(ds.hook_points) != 1:  # (a pattern: the rows of one hook point are pooled here)
        raise ArgumentValueError(
            f"hook_point must select one hook point, got {hook_point!r}, which matches {ds.hook_points}; "
            "call once per hook point"
        )
    hook_point = ds.hook_points[0]
    # (the tables' columns from their schemas, and only the columns read below decoded: a token
    # table of 10**9 rows is never read whole here)
    names = list(ds.source.row_schema(ds.row_kind).names)
    keys = ["sample_id"]
    # token rows are pooled for a per-sample label; a per-token one (a (batch, pos) column of
    # set_batch, in the token row table) labels each token row
    token = ds.row_kind == "token" and label_column not in names
    per_token = ds.row_kind == "token" and not token
    if token:  # token rows also see the per-sample columns of their sample
        keys = [c for c in ("rank", "batch") if c in names] + keys
        names = [*names, *ds.source.row_schema("sample").names]
    elif per_token:  # token rows of a per-token label, read with their (rank, batch, sample_id)
        keys = [c for c in ("rank", "batch") if c in names] + keys
    elif "rank" in names:  # sample rows: their sample is (rank, sample_id)
        keys = ["rank", *keys]
    if label_column not in names:
        return None
    # a label missing for some samples (set_batch(label=...) given for some batches only) is
    # null in the row table, and a numeric column with nulls cannot be read as a tensor: those
    # rows are left out by a filter, and counted as unlabelled
    holder = "sample" if token else ds.row_kind
    missing = None
    if ds.source.row_table(holder, [label_column]).column(label_column).null_count:
        missing = ActivationDataset(store, hook_points=[hook_point], columns=keys,
                                    filter=pc.field(label_column).is_null())
    ds = ActivationDataset(store, hook_points=[hook_point], columns=[*keys, label_column],
                           filter=None if missing is None else pc.field(label_column).is_valid())
    rows: list[torch.Tensor] = []  # sample rows: the labelled rows of each batch
    labels: list[Any] = []  # labels of the kept sample rows, or of the samples of the token rows
    groups: list[Any] = []  # the (rank, sample_id) of each of those
    group: dict[Any, int] = {}  # token rows: (rank, batch, sample_id) -> index of the sample
    sums = torch.zeros(0, dtype=torch.float64)  # token rows: per sample, the sum of its rows so far
    counts = torch.zeros(0, dtype=torch.float64)
    unlabelled: set[Any] = set()
    n_unlabelled = n_seen = 0
    if missing is not None and len(missing):
        if token:  # the samples of those token rows, from the row table (their rows are not read)
            at = missing.store_rows()
            at = np.arange(at.start, at.stop) if isinstance(at, range) else at.numpy()
            table = ds.source.row_table("token", keys).take(at)
            unlabelled.update(zip(*(table.column(c).to_pylist() for c in keys)))
        else:
            n_unlabelled += len(missing)
        n_seen += len(missing)
    for batch in DataLoader(ds, batch_size=batch_size, shuffle=False):
        x = torch.as_tensor(batch[hook_point])
        n_seen += len(x)
        batch_labels = _as_list(batch[label_column])
        kept = [_is_label(v) for v in batch_labels]
        keep = torch.tensor(kept, dtype=torch.bool)
        x = x[keep]
        if not token:
            rows.append(x)  # (in the stored dtype)
            labels.extend(v for v, k in zip(batch_labels, kept) if k)
            # the sample of each row, (rank, sample_id): a sample's rows in every forward of it
            # (the steps of set_batch(same_samples=True)) are one sample, token rows too
            groups.extend(tuple(c for c, name in zip(key, keys) if name != "batch")
                          for key, k in zip(zip(*(_as_list(batch[c]) for c in keys)), kept) if k)
            n_unlabelled += len(kept) - len(x)
            continue
        index = []
        for key, v, k in zip(zip(*(_as_list(batch[c]) for c in keys)), batch_labels, kept):
            if not k:
                unlabelled.add(key)
                continue
            if key not in group:
                group[key] = len(group)
                labels.append(v)
                groups.append(tuple(c for c, name in zip(key, keys) if name != "batch"))
            index.append(group[key])
        # (only this batch's labelled rows are held as float64; complex rows as complex128, whose
        # imaginary parts float64 would drop)
        x = x.to(torch.complex128 if x.is_complex() else torch.float64)
        if len(group) > len(sums):  # (grown by doubling: a copy per doubling)
            grown = torch.zeros(max(len(group), 2 * len(sums)), *x.shape[1:], dtype=x.dtype)
            if len(sums):
                grown[:len(sums)] = sums
            sums = grown
            counts = torch.cat([counts, torch.zeros(len(sums) - len(counts), dtype=torch.float64)])
        if index:
            index_t = torch.tensor(index, dtype=torch.long)
            sums.index_add_(0, index_t, x)
            counts.index_add_(0, index_t, torch.ones(len(index), dtype=torch.float64))
    if not n_seen or not labels:
        return None
    if not token:
        return torch.cat(rows), labels, n_unlabelled, groups
    n = len(group)
    pooled = sums[:n] / counts[:n].reshape(n, *([1] * (sums.dim() - 1)))
    return pooled, labels, len(unlabelled), groups


def _as_list(values: Any) -> list[Any]:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)
