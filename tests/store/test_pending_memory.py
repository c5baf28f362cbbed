"""The bookkeeping of forwards not yet committed (every array's rows after each forward, kept
until the slowest array's shard is durable) costs 8 bytes an array a forward, not a Python
int each: a capture of hundreds of hook points holds thousands of such forwards."""

from __future__ import annotations

import gc
import tracemalloc

import torch

import activationscope as acs
from activationscope.data import ActivationDataset


def test_pending_forwards_of_many_hook_points_cost_eight_bytes_an_array(tmp_path):
    n_layers, n_forwards = 200, 400
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(n_layers)])
    xs = [torch.full((2, 4), float(i)) for i in range(n_forwards + 20)]
    path = tmp_path / "s.zarr"
    with torch.no_grad(), acs.ActivationScope(store=path).track(model):
        for x in xs[:20]:
            model(x)
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for x in xs[20:]:
                model(x)  # 2 rows of 16 bytes per array: no shard is complete, nothing commits
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
    # a Python int per array and forward was 200 * 400 * 40 bytes = 3.2 MB; int64 counts are 0.64 MB
    assert grown < 1_600_000, grown
    ds = ActivationDataset(path, hook_points=["0.output", f"{n_layers - 1}.output"])
    assert len(ds) == 2 * len(xs)
    with torch.no_grad():
        assert torch.equal(ds[0:len(ds)]["0.output"], torch.cat([model[0](x) for x in xs]))
