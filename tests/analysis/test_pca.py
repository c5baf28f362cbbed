"""analysis.pca against numpy's SVD of the centred rows."""

from __future__ import annotations

import numpy as np
import torch

from activationscope.analysis.pca import explained_variance_ratio


def test_ratio_matches_the_singular_values_of_the_centred_rows():
    gen = torch.Generator().manual_seed(0)
    rows = (torch.randn(200, 6, generator=gen, dtype=torch.float64) * torch.tensor([5.0, 3, 2, 1, 0.5, 0.1], dtype=torch.float64)) + 7
    ratio, note = explained_variance_ratio(rows, 4, 100)
    x = rows.numpy() - rows.numpy().mean(0)
    s = np.linalg.svd(x, compute_uv=False) ** 2
    assert note == ""
    np.testing.assert_allclose(ratio.numpy(), (s / s.sum())[:4], rtol=1e-10)


def test_skips_say_why():
    assert explained_variance_ratio(torch.zeros(10, 9, dtype=torch.float64), 3, 8) == (None, "PCA skipped: 9 features > 8")
    assert explained_variance_ratio(torch.ones(1, 3, dtype=torch.float64), 3, 8) == (None, "PCA skipped: fewer than 2 rows")
    assert explained_variance_ratio(torch.ones(5, 3, dtype=torch.float64), 3, 8) == (None, "PCA skipped: zero variance")
