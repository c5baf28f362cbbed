"""A batch index given as a strided view (``torch.arange(n)[::3]``, a column of a 2-D
tensor) reads the rows at its positions, on every read path, and no longer makes torch warn
"input value tensor is non-contiguous" from the gather across a compressed store's shards.
Reference: plain tensor indexing."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from activationscope.data import ActivationDataset
from activationscope.store import StoreWriter


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_strided_index_reads_its_rows_without_a_warning(tmp_path, compression):
    path = str(tmp_path / "s.zarr")
    x = torch.randn(50, 4, generator=torch.Generator().manual_seed(0))
    w = StoreWriter(path, compression=compression, chunk_rows=4, shard_rows=8)
    w.open_array("x", (4,), torch.float32, "sample").append(x)
    w.add_batch(50)
    w.close()
    base = torch.tensor([[7, 1], [3, 9], [40, 2], [0, 49]])
    for idx in (torch.arange(50)[::3], torch.arange(50).flip(0)[::2], base[:, 1], base.t()[0],
                np.arange(50)[::-2], torch.tensor([5]).expand(4)):
        want = x[torch.as_tensor(np.ascontiguousarray(idx))]
        for ds in (ActivationDataset(path), ActivationDataset(path, rows=slice(0, None)), ActivationDataset(path, columns=["sample_id"])):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                got = ds[idx]
            assert torch.equal(got["x"], want)
