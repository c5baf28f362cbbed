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


def test_values_near_the_float64_limit_and_far_below_one():
    # squares of 1e200 overflow float64: the ratio is scale-free, so it must equal that of the rows / 1e200
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(50, 4, generator=gen, dtype=torch.float64) * torch.tensor([4.0, 2, 1, 0.5], dtype=torch.float64)
    want, _ = explained_variance_ratio(base, 4, 100)
    for scale in (1e200, 1e300, 1e-200):
        got, note = explained_variance_ratio(base * scale, 4, 100)
        assert note == ""
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
