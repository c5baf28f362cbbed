"""Pooling token rows into one row per sample, and reading a hook point back that way."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["labelled_rows", "pool_by_sample", "sentence_rows"]


def pool_by_sample(rows: torch.Tensor, sample_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean of token rows per sample.

    Parameters
    ----------
    rows : Tensor, (rows, *feature_shape)
    sample_ids : Tensor, (rows,), int64

    Returns
    -------
    (ids, pooled) : Tensor (n_samples,) sorted unique ids, Tensor (n_samples, *feature_shape) float64
    """
    ids, inverse = torch.unique(sample_ids, return_inverse=True)
    flat = rows.reshape(rows.shape[0], -1).to(torch.float64)
    total = torch.zeros(len(ids), flat.shape[1], dtype=torch.float64).index_add_(0, inverse, flat)
    count = torch.bincount(inverse, minlength=len(ids)).to(torch.float64).unsqueeze(1)
    return ids, (total / count).reshape(len(ids), *rows.shape[1:])


def _is_label(v: Any) -> bool:
    if v is None:
        return False
    if isinstance(v, float) and v != v:  # NaN
        return False
    if isinstance(v, int) and not isinstance(v, bool) and v == -1:
        return False  # -1 marks unlabelled rows (the demo's --corpus); other negative ints are classes
    return not (isinstance(v, str) and v == "")


def sentence_rows(
    store: Any, hook_point: str, label_column: str = "label", batch_size: int = 8192
) -> tuple[torch.Tensor, list[Any]] | None:
    """Read one hook point back through ``ActivationDataset`` + ``DataLoader``, one row per sample.

    Token rows are mean-pooled per sample (exactly the masked mean, since padding never
    enters the store); a sample is a ``(rank, batch, sample_id)`` of the row table (those of
    the three it has, as ``ActivationDataset`` joins per-sample columns), so ids repeated
    across forwards or ranks (default ids count per rank) stay separate samples. Sample rows
    are used as they are, one per row. Unlabelled rows (missing label, ``-1``, empty string)
    are dropped.

    Returns
    -------
    (x, labels) : Tensor (n_samples, *feature_shape) float64 (samples in store order), list
        of labels; or None when the store's row table has no ``label_column``.
    """
    got = labelled_rows(store, hook_point, label_column, batch_size)
    return None if got is None else got[:2]


def labelled_rows(
    store: Any, hook_point: str, label_column: str = "label", batch_size: int = 8192
) -> tuple[torch.Tensor, list[Any], int] | None:
    """:func:`sentence_rows` plus the number of samples left out for having no label
    (missing, ``-1``, empty string): ``(x, labels, n_unlabelled)``, or None."""
    from torch.utils.data import DataLoader

    from ..data import ActivationDataset

    try:
        ds = ActivationDataset(store, hook_points=[hook_point], columns=["sample_id", label_column])
    except (ValueError, KeyError) as e:
        if label_column in str(e):
            return None
        raise
    keys = ["sample_id"]
    if ds.row_kind == "token":
        names = ds.source.row_table("token").column_names
        keys = [c for c in ("rank", "batch") if c in names] + keys
        if len(keys) > 1:
            ds = ActivationDataset(store, hook_points=[hook_point], columns=[*keys, label_column])
    rows, samples, labels = [], [], []
    for batch in DataLoader(ds, batch_size=batch_size, shuffle=False):
        rows.append(torch.as_tensor(batch[hook_point]).to(torch.float64))
        samples.extend(zip(*(_as_list(batch[k]) for k in keys)))
        labels.extend(_as_list(batch[label_column]))
    if not rows:
        return None
    x = torch.cat(rows)
    keep = torch.tensor([_is_label(v) for v in labels], dtype=torch.bool)
    if not bool(keep.any()):
        return None
    kept = keep.tolist()
    labels = [v for v, k in zip(labels, kept) if k]
    if ds.row_kind != "token":
        return x[keep], labels, len(kept) - len(labels)
    n_unlabelled = len({s for s, k in zip(samples, kept) if not k})
    group: dict[Any, int] = {}
    label_of: list[Any] = []
    for key, v in zip((s for s, k in zip(samples, kept) if k), labels):
        if key not in group:
            group[key] = len(group)
            label_of.append(v)
    inverse = torch.tensor([group[s] for s, k in zip(samples, kept) if k], dtype=torch.long)
    _, pooled = pool_by_sample(x[keep], inverse)
    return pooled, label_of, n_unlabelled


def _as_list(values: Any) -> list[Any]:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)
