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


class _FirstForwardOnly(torch.nn.Module):
    """Its ``lin`` runs in the first forward only (a branch the data takes once)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x) if self.calls == 1 else x


def test_a_hook_point_called_once_does_not_hold_back_the_commits(tmp_path):
    import warnings

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _FirstForwardOnly())
    xs = [torch.full((1, 4), float(i)) for i in range(300)]
    path = tmp_path / "s.zarr"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), acs.ActivationScope(store=path, store_options={
                "shard_rows": 64, "chunk_rows": 64, "commit_interval": 0}).track(model, exclude=["1"]) as tracker:
            for x in xs:
                model(x)
                tracker.writer._core.drain()  # (the writer thread keeps up: the commits are exact)
            # '0.output' fills a 64-row shard every 64 forwards; '1.lin.output' got 1 row, in forward 0,
            # and its shard never fills: its row is written as a partial shard, and the commits follow
            # '0.output' (before, no forward was committed until the close, and the capture warned)
            live = acs.open_store(path)
            assert live.n_samples == 256 and live.n_rows("1.lin.output") == 1
            with torch.no_grad():
                assert torch.equal(live.rows("0.output", 0, 256), torch.cat([model[0](x) for x in xs[:256]]))
                assert torch.equal(live.rows("1.lin.output", 0, 1), model[1].lin(model[0](xs[0])))
    assert not [w for w in caught if "are not committed" in str(w.message)]
    ds = ActivationDataset(path, hook_points=["0.output"])
    assert len(ds) == 300
    with torch.no_grad():
        assert torch.equal(ds[0:300]["0.output"], torch.cat([model[0](x) for x in xs]))
