"""PCA of sampled activation rows: the explained variance ratio of the leading components.

For principal components from a streamed ``cov`` reduction (no rows kept), see
:func:`activationscope.reductions.pca`.
"""

from __future__ import annotations

import torch

__all__ = ["explained_variance_ratio"]


def explained_variance_ratio(rows: torch.Tensor, n_components: int, max_features: int) -> tuple[torch.Tensor | None, str]:
    """Explained variance ratio of the first ``n_components`` principal components of ``rows``.

    The eigenvalues of the (units, units) scatter matrix of the centred rows (cheaper than an
    SVD of the rows), descending, negative round-off clipped to 0, divided by their sum. The
    rows are divided by their largest magnitude first (which leaves the ratios as they are),
    so values up to the float64 limit do not overflow.

    Parameters
    ----------
    rows : Tensor, (n_rows, units), float64
        Rows holding NaN or inf are left out; the returned note says how many.
    n_components : int
        Components kept (fewer when there are fewer units).
    max_features : int
        Above this many units PCA is skipped (the matrix would be too large to decompose).

    Returns
    -------
    (ratio, note) : Tensor (min(n_components, units),) float64 and ``""``; or None and why PCA
        was skipped (too many features, fewer than 2 rows, zero variance).
    """
    units = rows.shape[1] if rows.dim() == 2 else 0
    if units > max_features:
        return None, f"PCA skipped: {units} features > {max_features}"
    note = ""
    if rows.dim() == 2 and rows.shape[0] and not bool(torch.isfinite(rows).all()):
        finite = torch.isfinite(rows).all(1)
        dropped = int((~finite).sum())
        rows = rows[finite]
        note = f"{dropped} row(s) with NaN or inf left out of the PCA"
    if rows.shape[0] < 2:
        return None, "PCA skipped: fewer than 2 rows" + (f" ({note})" if note else "")
    # divided by one scale (the ratios do not change), so that sums and squares of values near
    # the float64 limit (1e200: squares overflow) or far below 1 stay in range
    scale = rows.abs().max()
    rows = rows / scale if float(scale) > 0 else rows
    centred = rows - rows.mean(0)
    ev = torch.linalg.eigvalsh(centred.T @ centred).flip(0).clamp_min(0)
    total = ev.sum()
    if float(total) > 0:
        return (ev / total)[:n_components], note
    return None, "PCA skipped: zero variance" + (f" ({note})" if note else "")
