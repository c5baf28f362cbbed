"""A hook point that is the very tensor of another (an alias in a one-process store) is an
array of its own in a multi-rank store: the merge of rank stores copies arrays only, so the
uncommitted store (read from the rank stores) and the committed one list no alias, and every
hook point reads the values a one-process capture gives it."""

from __future__ import annotations

import torch
from torch import nn

import activationscope as acs
from activationscope.store.ranks import RankStore, commit_ranks

WORLD, BATCH, BATCHES = 2, 4, 3


def _inputs(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(BATCH, 4, generator=g) for _ in range(BATCHES)]


def _capture(model: nn.Module, path: str, rank: int) -> None:
    options = {"process_group": RankStore(rank, WORLD)}
    with acs.ActivationScope(store=path, capture="both", store_options=options).track(model) as t:
        for b, x in enumerate(_inputs(rank)):
            first = rank * 100 + b * BATCH
            t.set_batch(sample_ids=list(range(first, first + BATCH)))
            model(x)


def test_a_multi_rank_store_keeps_an_array_for_each_hook_point_a_one_process_store_aliases(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    refs = []  # each rank's inputs captured by one process: a store with aliases
    for r in range(WORLD):
        p = str(tmp_path / f"one-{r}.zarr")
        with acs.ActivationScope(store=p, capture="both").track(model):
            for x in _inputs(r):
                model(x)
        refs.append(acs.open_store(p))
        assert refs[r].aliases == {"1.input.0": "0.output", "2.input.0": "1.output"}
    path = str(tmp_path / "ranks.zarr")
    for r in range(WORLD):
        _capture(model, path, r)
    hook_points = ["0.input.0", "0.output", "1.input.0", "1.output", "2.input.0", "2.output"]
    for committed in (False, True):
        if committed:
            commit_ranks(path)
        st = acs.open_store(path)
        assert st.status == ("complete" if committed else "incomplete")
        assert st.hook_points == hook_points and st.aliases == {}
        for hp in hook_points:
            want = torch.cat([ref[hp] for ref in refs])  # (an alias of ref reads as its other's array)
            assert torch.equal(st[hp], want), (committed, hp)
            assert torch.equal(st.rows(hp, BATCH, 2 * BATCH + 1), want[BATCH:2 * BATCH + 1])
        # stored twice: the alias's bytes are its own array's
        assert st.attrs["arrays"]["1.input.0"]["path"] != st.attrs["arrays"]["0.output"]["path"]
        ds = acs.ActivationDataset(path, hook_points=["1.input.0", "0.output"])
        assert len(ds) == WORLD * BATCHES * BATCH
        item = ds[5]
        assert torch.equal(item["1.input.0"], item["0.output"])
