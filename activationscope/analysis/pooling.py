"""Pooling token rows into one row per sample, and reading a hook point back that way."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["pool_by_sample", "sentence_rows"]


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
    if isinstance(v, (int,)) and not isinstance(v, bool) and v < 0:
        return False  # -1 marks unlabelled rows (the demo's --corpus)
    return not (isinstance(v, str) and v == "")


def sentence_rows(
    store: Any, hook_point: str, label_column: str = "label", batch_size: int = 8192
) -> tuple[torch.Tensor, list[Any]] | None:
    """Read one hook point back through ``ActivationDataset`` + ``DataLoader``, one row per sample.

    Token rows are mean-pooled per ``sample_id`` (exactly the masked mean, since padding
    never enters the store); sample rows are used as they are. Unlabelled rows (missing
    label, ``-1``, empty string) are dropped.

    Returns
    -------
    (x, labels) : Tensor (n_samples, *feature_shape) float64, list of labels; or None when the
        store's row table has no ``label_column``.
    """
    from torch.utils.data import DataLoader

    from ..data import ActivationDataset

    try:
        ds = ActivationDataset(store, hook_points=[hook_point], columns=["sample_id", label_column])
    except (ValueError, KeyError) as e:
        if label_column in str(e):
            return None
        raise
    rows, ids, labels = [], [], []
    for batch in DataLoader(ds, batch_size=batch_size, shuffle=False):
        rows.append(torch.as_tensor(batch[hook_point]).to(torch.float64))
        ids.append(torch.as_tensor(batch["sample_id"]).to(torch.long))
        lab = batch[label_column]
        labels.extend(lab.tolist() if isinstance(lab, torch.Tensor) else list(lab))
    if not rows:
        return None
    x = torch.cat(rows)
    sid = torch.cat(ids)
    keep = torch.tensor([_is_label(v) for v in labels], dtype=torch.bool)
    if not bool(keep.any()):
        return None
    label_of = {}
    for i, v in zip(sid[keep].tolist(), (v for v, k in zip(labels, keep.tolist()) if k)):
        label_of.setdefault(i, v)
    uids, pooled = pool_by_sample(x[keep], sid[keep])
    return pooled, [label_of[i] for i in uids.tolist()]
